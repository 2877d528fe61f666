//! `keel vm migrate NAME [--to NODE] [--wait]`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use keel_api::{Migration, VirtualMachine};
use ureq::http::Method;

use super::live_progress::{migration_line, LiveLine, SendRate};
use super::output;
use super::{encode, Client};
use crate::api::migrate::MigrateVmRequest;
use crate::api::migrations::MigrationList;
use crate::api::vms::VmResponse;
use crate::args::{MigrateArgs, OutputFormat};

pub fn run(client: &Client, out: OutputFormat, args: MigrateArgs) -> anyhow::Result<()> {
    let path = format!("/api/v1/vms/{}/migrate", encode(&args.name));
    let body = MigrateVmRequest {
        to: args.to.clone(),
        revision: None,
    };
    let resp: VmResponse = client.call(Method::POST, &path, Some(&body))?;
    let requested_at = resp
        .vm
        .migrate
        .as_ref()
        .map(|r| r.requested_at)
        .context("the server did not record the migration request")?;
    if !args.wait {
        return output::print(out, &resp, || {
            format!(
                "{}: migration requested{} (revision {})\n",
                args.name,
                args.to
                    .as_deref()
                    .map(|t| format!(" to node {t}"))
                    .unwrap_or_default(),
                resp.revision
            )
        });
    }
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    let mut live = LiveLine::new();
    let mut rate = SendRate::default();
    let vm = loop {
        let now: VmResponse = client.get(&format!("/api/v1/vms/{}", encode(&args.name)))?;
        if is_over(&now.vm, requested_at) {
            break now.vm;
        }
        if live.is_on() {
            if let Some(m) = migration_of(client, &args.name, requested_at) {
                live.show(&migration_line(&m, rate.observe(&m)));
            }
        }
        if Instant::now() >= deadline {
            bail!(
                "{}: migration not over after {}s; see `keel vm get {}` and `keel migration list {}`",
                args.name,
                args.timeout,
                args.name,
                args.name
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    live.clear();
    let outcome = vm.status.migrate_outcome.as_ref();
    let migration = match outcome.and_then(|o| o.migration.as_deref()) {
        Some(id) => {
            let list: MigrationList =
                client.get(&format!("/api/v1/migrations?vm={}", encode(&args.name)))?;
            list.items
                .into_iter()
                .map(|i| i.migration)
                .find(|m| m.id == id)
        }
        None => None,
    };
    let succeeded = outcome.is_some_and(|o| o.succeeded);
    output::print(out, &vm, || summary(&vm, outcome, migration.as_ref()))?;
    if !succeeded {
        bail!(
            "{}: migration failed; the VM keeps running where it was",
            args.name
        );
    }
    Ok(())
}

/// The newest migration of the VM made for the request of `requested_at`,
/// for the progress line; none when it cannot be read (the line is a
/// nicety, the wait goes on by the VM's record).
fn migration_of(client: &Client, vm: &str, requested_at: u64) -> Option<Migration> {
    let list: MigrationList = client
        .get(&format!("/api/v1/migrations?vm={}", encode(vm)))
        .ok()?;
    list.items
        .into_iter()
        .map(|i| i.migration)
        .rfind(|m| m.created_at >= requested_at)
}

/// The request made at `requested_at` has ended, one way or another.
fn is_over(vm: &VirtualMachine, requested_at: u64) -> bool {
    let handled = vm
        .status
        .migrate_outcome
        .as_ref()
        .is_some_and(|o| o.requested_at == requested_at);
    // Moot: a newer request replaced it, or the VM left its node otherwise.
    handled
        || vm.migrate.as_ref().map(|r| r.requested_at) != Some(requested_at)
        || vm.pending_migration().is_none() && vm.status.eviction.as_ref().is_none_or(|e| !e.user)
}

fn summary(
    vm: &VirtualMachine,
    outcome: Option<&keel_api::MigrateOutcome>,
    m: Option<&Migration>,
) -> String {
    let Some(o) = outcome else {
        return format!(
            "{}: not migrated as asked (the VM no longer runs on the node it was asked from)\n",
            vm.name
        );
    };
    let verdict = if o.succeeded { "Succeeded" } else { "Failed" };
    let mut s = format!("{}: migration {verdict}: {}\n", vm.name, o.message);
    if let Some(m) = m {
        s.push_str(&format!(
            "  {} from {} to {}, transport {}, downtime {}\n",
            m.id,
            m.source_node,
            m.target_node,
            m.transport().map_or_else(|| "-".into(), |t| t.to_string()),
            m.status
                .downtime_ms
                .map_or_else(|| "-".into(), |d| format!("{d}ms"))
        ));
    }
    s
}

/// `keel vm get` lines about the user's last migration request.
pub fn describe(vm: &VirtualMachine) -> Vec<(&'static str, String)> {
    let Some(req) = &vm.migrate else {
        return vec![];
    };
    let t = crate::timefmt::rfc3339;
    let asked = format!(
        "{} from node {} to {}",
        t(req.requested_at),
        req.from_node,
        req.to.as_deref().unwrap_or("the best node")
    );
    let state = match &vm.status.migrate_outcome {
        Some(o) if o.requested_at == req.requested_at => {
            format!(
                "{}: {}",
                if o.succeeded { "succeeded" } else { "failed" },
                o.message
            )
        }
        _ if vm.pending_migration().is_some() => "in progress".to_string(),
        _ => "moot (the VM left that node otherwise)".to_string(),
    };
    vec![("migrate requested", asked), ("migrate outcome", state)]
}
