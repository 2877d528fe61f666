//! Where a VM may go besides capacity: the node labels it requires, and the
//! groups it is kept apart from (anti-affinity) or together with
//! (affinity). The scheduler (`keel-ctrl`'s `placement_rules`) applies
//! them at every placement, migration target and start.
//!
//! - A node selector is required: a VM goes only to a node carrying every
//!   label it names, with that value; never ignored.
//! - Anti-affinity is required unless `preferred`: no two members of a
//!   group run (or are placed, or migrate) onto one node. A member that
//!   has nowhere else to go waits with the reason. Preferred: apart where
//!   possible, together only when there is no other way.
//! - Affinity is a preference: a node already holding a member of the
//!   group comes first among those where the VM fits; it never keeps a VM
//!   from starting elsewhere.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::name::validate_name;
use crate::ValidationError;

/// A node's labels, or what a selector asks of them: key → value.
pub type Labels = BTreeMap<String, String>;

/// At most this many labels on a node, or in one selector.
pub const MAX_LABELS: usize = 32;
/// The longest label key and value.
pub const MAX_LABEL_LEN: usize = 63;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlacementRules {
    /// Labels a node must carry, each with this value, for the VM to go
    /// there (`--node-selector k=v`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: Labels,
    /// Members of this group run on distinct nodes (`--anti-affinity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anti_affinity: Option<AntiAffinity>,
    /// Members of this group run together where they fit (`--affinity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AntiAffinity {
    pub group: String,
    /// Apart where possible; sharing a node allowed when there is no other
    /// way. `false` (the default): required.
    #[serde(default)]
    pub preferred: bool,
}

impl PlacementRules {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The required anti-affinity group, if the VM has one.
    pub fn required_apart(&self) -> Option<&str> {
        self.anti_affinity
            .as_ref()
            .filter(|a| !a.preferred)
            .map(|a| a.group.as_str())
    }

    /// The selector's labels `labels` lacks (or has with another value),
    /// as `k=v`.
    pub fn unmet_by(&self, labels: &Labels) -> Vec<String> {
        self.node_selector
            .iter()
            .filter(|(k, v)| labels.get(*k) != Some(v))
            .map(|(k, v)| format!("{k}={v}"))
            .collect()
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_labels("spec.placement.node_selector", &self.node_selector)?;
        if let Some(anti) = &self.anti_affinity {
            validate_name("spec.placement.anti_affinity.group", &anti.group)?;
        }
        if let Some(group) = &self.affinity {
            validate_name("spec.placement.affinity", group)?;
        }
        Ok(())
    }
}

/// `k=v` as `keel node label` and `--node-selector` take it.
pub fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))?;
    validate_label("label", k, v).map_err(|e| e.message)?;
    Ok((k.to_string(), v.to_string()))
}

/// Keys: 1..=63 of letters, digits, `.`, `_`, `-` and `/`, starting and
/// ending with a letter or digit (as Kubernetes spells them). Values: up to
/// 63 of letters, digits, `.`, `_` and `-`.
pub fn validate_labels(field: &str, labels: &Labels) -> Result<(), ValidationError> {
    if labels.len() > MAX_LABELS {
        return Err(ValidationError::new(
            field,
            format!("{} labels; at most {MAX_LABELS}", labels.len()),
        ));
    }
    for (k, v) in labels {
        validate_label(field, k, v)?;
    }
    Ok(())
}

fn validate_label(field: &str, key: &str, value: &str) -> Result<(), ValidationError> {
    let edge_ok = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
    };
    let key_ok = !key.is_empty()
        && key.len() <= MAX_LABEL_LEN
        && edge_ok(key)
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if !key_ok {
        return Err(ValidationError::new(
            format!("{field}.{key}"),
            format!(
                "key {key:?} must be 1..={MAX_LABEL_LEN} letters, digits, '.', '_', '-' or '/', \
                 starting and ending with a letter or digit"
            ),
        ));
    }
    let value_ok = value.is_empty()
        || (value.len() <= MAX_LABEL_LEN
            && edge_ok(value)
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')));
    if !value_ok {
        return Err(ValidationError::new(
            format!("{field}.{key}"),
            format!(
                "value {value:?} must be at most {MAX_LABEL_LEN} letters, digits, '.', '_' or '-', \
                 starting and ending with a letter or digit"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_label("zone=eu-1").unwrap(),
            ("zone".into(), "eu-1".into())
        );
        assert_eq!(
            parse_label("keel.dev/ssd=").unwrap(),
            ("keel.dev/ssd".into(), String::new())
        );
        assert!(parse_label("zone").unwrap_err().contains("KEY=VALUE"));
        assert!(parse_label("-zone=a").unwrap_err().contains("key"));
        assert!(parse_label("zone=a b").unwrap_err().contains("value"));
        let rules = PlacementRules {
            node_selector: [("zone".to_string(), "a,b".to_string())].into(),
            ..Default::default()
        };
        assert_eq!(
            rules.validate().unwrap_err().field,
            "spec.placement.node_selector.zone"
        );
        let rules = PlacementRules {
            anti_affinity: Some(AntiAffinity {
                group: "Web".into(),
                preferred: false,
            }),
            ..Default::default()
        };
        assert_eq!(
            rules.validate().unwrap_err().field,
            "spec.placement.anti_affinity.group"
        );
    }

    #[test]
    fn a_selector_names_what_a_node_lacks() {
        let rules = PlacementRules {
            node_selector: [
                ("zone".to_string(), "eu".to_string()),
                ("disk".to_string(), "ssd".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        let node: Labels = [
            ("zone".to_string(), "us".to_string()),
            ("disk".to_string(), "ssd".to_string()),
        ]
        .into();
        assert_eq!(rules.unmet_by(&node), ["zone=eu"]);
        assert!(rules.unmet_by(&rules.node_selector).is_empty());
    }

    #[test]
    fn an_empty_rule_set_is_not_stored() {
        let json = serde_json::to_string(&PlacementRules::default()).unwrap();
        assert_eq!(json, "{}");
        let anti: PlacementRules =
            serde_json::from_str(r#"{"anti_affinity":{"group":"web"}}"#).unwrap();
        assert_eq!(anti.required_apart(), Some("web"));
    }
}
