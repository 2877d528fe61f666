//! `keel node list` and `keel node info [NAME]`.

use anyhow::bail;
use keel_api::Clock;

use super::output::{self, fields, Table};
use super::{encode, Client};
use crate::api::nodes::{NodeList, NodeResponse};
use crate::args::{NodeCommand, NodeVerb};
use crate::timefmt::{ago, rfc3339};

pub fn run(cmd: NodeCommand) -> anyhow::Result<()> {
    let client = Client::from_args(&cmd.client)?;
    let out = cmd.client.output;
    let now = keel_api::SystemClock.now_ms();
    match cmd.verb {
        NodeVerb::List => {
            let list: NodeList = client.get("/api/v1/nodes")?;
            output::print(out, &list, || {
                let mut t =
                    Table::new(&["NAME", "ACCELERATOR", "HYPERVISOR", "HEARTBEAT", "CORDONED"]);
                for item in &list.items {
                    let n = &item.node;
                    t.row(vec![
                        n.name.clone(),
                        n.status
                            .accelerator
                            .map(|a| format!("{a:?}"))
                            .unwrap_or_else(|| "-".into()),
                        n.status.hypervisor.clone().unwrap_or_else(|| "-".into()),
                        ago(n.status.last_heartbeat, now),
                        n.cordoned.to_string(),
                    ]);
                }
                t.render()
            })
        }
        NodeVerb::Info { name } => {
            let resp: NodeResponse = match name {
                Some(name) => client.get(&format!("/api/v1/nodes/{}", encode(&name)))?,
                None => {
                    let mut list: NodeList = client.get("/api/v1/nodes")?;
                    match list.items.len() {
                        1 => list.items.remove(0),
                        0 => bail!("no nodes have reported yet; is `keel serve` running?"),
                        _ => bail!(
                            "several nodes; name one of: {}",
                            list.items
                                .iter()
                                .map(|i| i.node.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    }
                }
            };
            output::print(out, &resp, || {
                let n = &resp.node;
                fields(&[
                    ("name", n.name.clone()),
                    (
                        "accelerator",
                        n.status
                            .accelerator
                            .map(|a| format!("{a:?}"))
                            .unwrap_or_else(|| "unknown".into()),
                    ),
                    (
                        "hypervisor",
                        n.status
                            .hypervisor
                            .clone()
                            .unwrap_or_else(|| "unknown".into()),
                    ),
                    (
                        "last heartbeat",
                        format!(
                            "{} ({})",
                            rfc3339(n.status.last_heartbeat),
                            ago(n.status.last_heartbeat, now)
                        ),
                    ),
                    ("cordoned", n.cordoned.to_string()),
                    ("revision", resp.revision.to_string()),
                ])
            })
        }
    }
}
