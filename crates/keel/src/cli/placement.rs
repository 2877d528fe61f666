//! `keel vm create` flags for where a VM may go (node selector,
//! anti-affinity and affinity groups), and their line in `keel vm get`.

use clap::Args;
use keel_api::{AntiAffinity, PlacementRules, VirtualMachine};

#[derive(Debug, Clone, Default, Args)]
pub struct PlacementArgs {
    /// Only on nodes labelled KEY=VALUE (`keel node label`); required,
    /// never ignored. Repeat for more (all must match).
    #[arg(long = "node-selector", value_parser = keel_api::placement::parse_label, value_name = "KEY=VALUE")]
    pub node_selector: Vec<(String, String)>,
    /// Keep the VMs of GROUP on distinct nodes: a member that has nowhere
    /// else to go waits with the reason.
    #[arg(long, value_name = "GROUP")]
    pub anti_affinity: Option<String>,
    /// With --anti-affinity: apart where possible, sharing a node only when
    /// there is no other way.
    #[arg(long, requires = "anti_affinity")]
    pub anti_affinity_preferred: bool,
    /// Keep the VMs of GROUP together: a node already running one of them
    /// comes first where the VM fits (a preference, never a reason to wait).
    #[arg(long, value_name = "GROUP")]
    pub affinity: Option<String>,
}

impl PlacementArgs {
    /// The rules the flags ask for; the server validates them again,
    /// naming the field.
    pub fn rules(&self) -> PlacementRules {
        PlacementRules {
            node_selector: self.node_selector.iter().cloned().collect(),
            anti_affinity: self.anti_affinity.clone().map(|group| AntiAffinity {
                group,
                preferred: self.anti_affinity_preferred,
            }),
            affinity: self.affinity.clone(),
        }
    }
}

/// The `placement` line of `keel vm get`, if the VM has rules.
pub fn describe(vm: &VirtualMachine) -> Option<(&'static str, String)> {
    let rules = &vm.spec.placement;
    if rules.is_empty() {
        return None;
    }
    let mut parts = Vec::new();
    if !rules.node_selector.is_empty() {
        let labels: Vec<String> = rules
            .node_selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        parts.push(format!("nodes labelled {}", labels.join(",")));
    }
    if let Some(anti) = &rules.anti_affinity {
        parts.push(format!(
            "apart from group {} ({})",
            anti.group,
            if anti.preferred {
                "preferred"
            } else {
                "required"
            }
        ));
    }
    if let Some(group) = &rules.affinity {
        parts.push(format!("together with group {group} (preferred)"));
    }
    Some(("placement", parts.join("; ")))
}
