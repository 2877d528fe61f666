//! `keel snapshot create|list|get|delete` and `keel restore`.

use std::time::{Duration, Instant};

use anyhow::bail;
use keel_api::{PowerState, Snapshot, SnapshotPhase};
use ureq::http::Method;

use super::output::{self, fields, Table};
use super::wait::{self, Goal};
use super::{encode, Client};
use crate::api::snapshots::{
    CreateSnapshotRequest, RestoreVmRequest, SnapshotList, SnapshotResponse,
};
use crate::api::vms::VmResponse;
use crate::args::{OutputFormat, RestoreArgs, SnapshotCommand, SnapshotCreateArgs, SnapshotVerb};
use crate::timefmt::rfc3339;

const POLL: Duration = Duration::from_millis(200);

pub fn run(cmd: SnapshotCommand) -> anyhow::Result<()> {
    let client = Client::from_args(&cmd.client)?;
    let out = cmd.client.output;
    match cmd.verb {
        SnapshotVerb::Create(args) => create(&client, out, args),
        SnapshotVerb::List { vm } => list(&client, out, &vm),
        SnapshotVerb::Get { vm, name } => {
            let resp: SnapshotResponse = client.get(&path(&vm, &name))?;
            output::print(out, &resp, || describe(&resp))
        }
        SnapshotVerb::Delete { vm, name } => {
            let resp: SnapshotResponse =
                client.call(Method::DELETE, &path(&vm, &name), None::<&()>)?;
            output::print(out, &resp, || {
                format!("snapshot {vm}/{name}: deletion requested\n")
            })
        }
    }
}

fn path(vm: &str, name: &str) -> String {
    format!("/api/v1/vms/{}/snapshots/{}", encode(vm), encode(name))
}

fn create(client: &Client, out: OutputFormat, args: SnapshotCreateArgs) -> anyhow::Result<()> {
    let req = CreateSnapshotRequest {
        name: args.name.clone(),
    };
    let resp: SnapshotResponse = client.call(
        Method::POST,
        &format!("/api/v1/vms/{}/snapshots", encode(&args.vm)),
        Some(&req),
    )?;
    if !args.wait {
        return output::print(out, &resp, || {
            format!(
                "snapshot {}/{} requested (revision {})\n",
                args.vm, args.name, resp.revision
            )
        });
    }
    let done = wait_taken(
        client,
        &args.vm,
        &args.name,
        Duration::from_secs(args.timeout),
    )?;
    output::print(out, &done, || {
        let s = &done.snapshot;
        format!(
            "snapshot {}/{}: Ready ({}, taken {})\n",
            s.vm,
            s.name,
            if s.status.live { "live" } else { "offline" },
            s.status.taken_at.map(rfc3339).unwrap_or_else(|| "-".into())
        )
    })
}

/// Polls until the snapshot is Ready (or fails: an error), printing each
/// change of phase or message on stderr.
pub(super) fn wait_taken(
    client: &Client,
    vm: &str,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<SnapshotResponse> {
    let deadline = Instant::now() + timeout;
    let mut last_seen = None;
    loop {
        let Some(resp) = client.get_opt::<SnapshotResponse>(&path(vm, name))? else {
            bail!("snapshot {vm}/{name} was deleted while waiting for it to be taken");
        };
        let s = &resp.snapshot;
        let progress = format!(
            "{vm}/{name}: {:?}{}",
            s.status.phase,
            s.status
                .message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        );
        if last_seen.as_ref() != Some(&progress) {
            eprintln!("{}", keel_api::untrusted::terminal_safe(&progress));
            last_seen = Some(progress);
        }
        match s.status.phase {
            SnapshotPhase::Ready => return Ok(resp),
            SnapshotPhase::Failed => bail!(
                "snapshot {vm}/{name} failed: {}",
                s.status.message.as_deref().unwrap_or("no reason given")
            ),
            SnapshotPhase::Pending => {}
        }
        if Instant::now() >= deadline {
            bail!(
                "timed out after {}s waiting for snapshot {vm}/{name} to be taken",
                timeout.as_secs()
            );
        }
        std::thread::sleep(POLL);
    }
}

fn list(client: &Client, out: OutputFormat, vm: &str) -> anyhow::Result<()> {
    let resp: SnapshotList = client.get_all(&format!("/api/v1/vms/{}/snapshots", encode(vm)))?;
    output::print(out, &resp, || {
        let mut t = Table::new(&["NAME", "PHASE", "LIVE", "REQUESTED", "TAKEN", "MESSAGE"]);
        for item in &resp.items {
            let s = &item.snapshot;
            t.row(vec![
                s.name.clone(),
                phase(s),
                if s.status.phase == SnapshotPhase::Ready {
                    s.status.live.to_string()
                } else {
                    "-".into()
                },
                rfc3339(s.requested_at),
                s.status.taken_at.map(rfc3339).unwrap_or_else(|| "-".into()),
                s.status.message.clone().unwrap_or_else(|| "-".into()),
            ]);
        }
        t.render()
    })
}

fn phase(s: &Snapshot) -> String {
    match s.deletion_requested_at {
        Some(_) => format!("{:?} (deleting)", s.status.phase),
        None => format!("{:?}", s.status.phase),
    }
}

fn describe(resp: &SnapshotResponse) -> String {
    let s = &resp.snapshot;
    let mut pairs = vec![
        ("vm", s.vm.clone()),
        ("name", s.name.clone()),
        ("phase", phase(s)),
        ("requested", rfc3339(s.requested_at)),
        (
            "taken",
            s.status.taken_at.map(rfc3339).unwrap_or_else(|| "-".into()),
        ),
        ("live", s.status.live.to_string()),
        (
            "spec",
            format!(
                "{} cpus, {} MiB, disks: {}",
                s.spec.cpus,
                s.spec.memory_mib,
                if s.spec.disks.is_empty() {
                    "-".into()
                } else {
                    s.spec
                        .disks
                        .iter()
                        .map(|d| format!("{} ({} MiB)", d.name, d.size_mib))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        ),
    ];
    if let Some(at) = s.deletion_requested_at {
        pairs.push(("deletion requested", rfc3339(at)));
    }
    if let Some(msg) = &s.status.message {
        pairs.push(("message", msg.clone()));
    }
    pairs.push(("revision", resp.revision.to_string()));
    fields(&pairs)
}

/// `keel restore VM SNAPSHOT [--wait]`.
pub fn restore(args: RestoreArgs) -> anyhow::Result<()> {
    let client = Client::from_args(&args.client)?;
    let out = args.client.output;
    let req = RestoreVmRequest {
        snapshot: args.snapshot.clone(),
        revision: None,
    };
    let resp: VmResponse = client.call(
        Method::POST,
        &format!("/api/v1/vms/{}/restore", encode(&args.vm)),
        Some(&req),
    )?;
    // The controller's own rule, so the CLI waits for what it will do.
    let power = resp.vm.power_after_restore();
    if !args.wait {
        return output::print(out, &resp, || {
            format!(
                "{}: restore from snapshot {} requested; it comes back {power:?} (revision {})\n",
                args.vm, args.snapshot, resp.revision
            )
        });
    }
    let done = wait::until(
        &client,
        &args.vm,
        &Goal::Restored { power },
        Duration::from_secs(args.timeout),
    )?
    .expect("only Gone yields no VM");
    output::print(out, &done, || {
        let vm = &done.vm;
        match (power, &vm.status.instance) {
            (PowerState::Running, Some(i)) => format!(
                "{}: restored from snapshot {}; Running (instance {})\n",
                args.vm, args.snapshot, i.id
            ),
            _ => format!(
                "{}: restored from snapshot {}; {:?}\n",
                args.vm, args.snapshot, vm.status.phase
            ),
        }
    })
}
