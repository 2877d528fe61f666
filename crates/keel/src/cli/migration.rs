//! `keel migration list [VM]`.

use super::output::{self, Table};
use super::{encode, Client};
use crate::api::migrations::MigrationList;
use crate::args::{MigrationCommand, MigrationVerb};
use crate::timefmt::rfc3339;

pub fn run(cmd: MigrationCommand) -> anyhow::Result<()> {
    let client = Client::from_args(&cmd.client)?;
    let out = cmd.client.output;
    match cmd.verb {
        MigrationVerb::List { vm } => {
            let path = match &vm {
                Some(vm) => format!("/api/v1/migrations?vm={}", encode(vm)),
                None => "/api/v1/migrations".to_string(),
            };
            let list: MigrationList = client.get(&path)?;
            output::print(out, &list, || {
                let mut t = Table::new(&[
                    "ID",
                    "VM",
                    "PHASE",
                    "FROM",
                    "TO",
                    "CREATED",
                    "TRANSPORT",
                    "DOWNTIME",
                    "TUNING",
                    "MESSAGE",
                ]);
                for item in &list.items {
                    let m = &item.migration;
                    t.row(vec![
                        m.id.clone(),
                        m.vm.clone(),
                        format!("{:?}", m.status.phase),
                        format!("{} ({})", m.source_node, m.source_instance),
                        format!("{} ({})", m.target_node, m.target_instance),
                        rfc3339(m.created_at),
                        m.transport().map_or_else(|| "-".into(), |t| t.to_string()),
                        m.status
                            .downtime_ms
                            .map(|d| format!("{d}ms"))
                            .unwrap_or_else(|| "-".into()),
                        super::node::tuning_text(&m.tuning),
                        m.status.message.clone().unwrap_or_else(|| "-".into()),
                    ]);
                }
                t.render()
            })
        }
    }
}
