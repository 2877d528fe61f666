//! Readiness: whether the guest is up, as opposed to its QEMU process
//! running. What counts as "up" is the VM's choice (`spec.readiness`);
//! what was seen is on the instance (`status.instance.readiness`), so a new
//! instance (a restart) starts out not ready.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Millis, ValidationError};

/// The longest console text a readiness check may look for.
pub const MAX_READY_TEXT: usize = 128;

// What is kept of a guest agent's answers: a guest chooses their size, and
// they land in the VM's record, which every store write and every API read
// carries (an unbounded list once made a record too big for etcd to take,
// and the VM unreconcilable). With these, a readiness stays within ~20 KiB.

/// Addresses kept per guest: more than any VM `keel vm get` can usefully
/// show; a guest with more (a container host's veths) keeps the first.
pub const MAX_GUEST_ADDRESSES: usize = 64;
/// Interfaces whose addresses are kept.
pub const MAX_GUEST_INTERFACES: usize = 16;
/// Linux names are at most 15 bytes (IFNAMSIZ); Windows reports friendly
/// names such as `vEthernet (Default Switch)`, which run longer.
pub const MAX_INTERFACE_NAME: usize = 64;
/// A DNS name's limit (Linux's own host names stop at 64).
pub const MAX_HOSTNAME: usize = 253;
/// Any other string a guest reports (its agent's version, OS names).
pub const MAX_GUEST_TEXT: usize = 256;
/// A reason or note, which may quote a guest.
pub const MAX_REASON: usize = 1024;

/// `spec.readiness`, written `agent`, `console:<text>` or `none`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Readiness {
    /// Ready once the guest agent (qemu-guest-agent) answers. The default
    /// for new VMs: every Debian or Ubuntu cloud image ships one.
    #[default]
    Agent,
    /// Ready once the serial console has printed this text (guests without
    /// an agent; e.g. `console:login:`).
    Console(String),
    /// Ready as soon as the instance runs (the only meaning before
    /// readiness existed: records stored without the field get this).
    None,
}

impl Readiness {
    /// What a stored record written before `spec.readiness` existed means.
    pub fn legacy() -> Self {
        Readiness::None
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        if let Readiness::Console(text) = self {
            if text.is_empty() || text.len() > MAX_READY_TEXT {
                return Err(ValidationError::new(
                    "spec.readiness",
                    format!("console text must be 1..={MAX_READY_TEXT} bytes"),
                ));
            }
            if text.chars().any(char::is_control) {
                return Err(ValidationError::new(
                    "spec.readiness",
                    "console text must be on one line, without control characters",
                ));
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Readiness::Agent => f.write_str("agent"),
            Readiness::Console(text) => write!(f, "console:{text}"),
            Readiness::None => f.write_str("none"),
        }
    }
}

impl std::str::FromStr for Readiness {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let r = match s {
            "agent" => Readiness::Agent,
            "none" => Readiness::None,
            _ => match s.strip_prefix("console:") {
                Some(text) => Readiness::Console(text.to_string()),
                None => {
                    return Err(ValidationError::new(
                        "spec.readiness",
                        format!("{s:?} is not one of agent, console:<text>, none"),
                    ))
                }
            },
        };
        r.validate()?;
        Ok(r)
    }
}

impl Serialize for Readiness {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Readiness {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(|e: ValidationError| {
            serde::de::Error::custom(format!("{}: {}", e.field, e.message))
        })
    }
}

/// Written as text, so described by hand: one of the three forms, the
/// console's text bounded as validation bounds it.
impl utoipa::PartialSchema for Readiness {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some("^(agent|none|console:[^\\x00-\\x1f\\x7f]+)$"))
            .max_length(Some("console:".len() + MAX_READY_TEXT))
            .description(Some(
                "When the guest counts as up: agent (its guest agent answers), \
                 console:<text> (the serial console printed the text) or none (once running)",
            ))
            .into()
    }
}

impl utoipa::ToSchema for Readiness {}

/// One guest address, as its agent reported it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GuestAddress {
    pub interface: String,
    /// `10.0.2.15/24`
    pub address: String,
}

/// What was seen of the guest of one instance.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InstanceReadiness {
    /// When the guest was first seen up (per `spec.readiness`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_at: Option<Millis>,
    /// Why it is not ready yet (`None` once ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Whether the guest agent answered at the last look.
    #[serde(default)]
    pub agent: bool,
    /// The guest's addresses from its agent, loopback left out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<GuestAddress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// What was cut or ignored of the agent's last answers, and why: a
    /// guest's bad answer costs it these details, never its VM's reconcile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_note: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prints_and_refuses_with_the_field() {
        for (text, r) in [
            ("agent", Readiness::Agent),
            ("none", Readiness::None),
            (
                "console:KEEL-GUEST-READY",
                Readiness::Console("KEEL-GUEST-READY".into()),
            ),
            ("console:login: ", Readiness::Console("login: ".into())),
        ] {
            assert_eq!(text.parse::<Readiness>().unwrap(), r);
            assert_eq!(r.to_string(), text);
            assert_eq!(serde_json::to_value(&r).unwrap(), text);
        }
        for bad in ["Agent", "console:", "console:a\nb", "sometimes"] {
            let err = bad.parse::<Readiness>().unwrap_err();
            assert_eq!(err.field, "spec.readiness", "{bad}");
        }
        let long = format!("console:{}", "x".repeat(MAX_READY_TEXT + 1));
        assert!(long.parse::<Readiness>().is_err());
    }
}
