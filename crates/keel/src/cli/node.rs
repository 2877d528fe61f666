//! `keel node list|info|cordon|uncordon|drain|freeze|label`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use keel_api::{Clock, Migration, MigrationTuning, Millis, Node, VirtualMachine};
use ureq::http::Method;

use super::live_progress::{LiveLine, SendRate, Sending};
use super::output::{self, fields, Table};
use super::{encode, Client};
use crate::api::migrations::MigrationList;
use crate::api::node_labels::LabelRequest;
use crate::api::nodes::{DrainRequest, NodeList, NodeResponse, UncordonRequest, UncordonResponse};
use crate::api::vms::VmList;
use crate::args::{DrainArgs, LabelArgs, NodeCommand, NodeVerb, OutputFormat, UncordonArgs};
use crate::timefmt::{ago, rfc3339};
use keel_api::capacity::human_mib;

const POLL: Duration = Duration::from_millis(500);

pub fn run(cmd: NodeCommand) -> anyhow::Result<()> {
    let client = Client::from_args(&cmd.client)?;
    let out = cmd.client.output;
    let now = keel_api::SystemClock.now_ms();
    match cmd.verb {
        NodeVerb::List => {
            let list: NodeList = client.get("/api/v1/nodes")?;
            output::print(out, &list, || {
                let mut t = Table::new(&[
                    "NAME",
                    "ACCELERATOR",
                    "HYPERVISOR",
                    "HEARTBEAT",
                    "CORDONED",
                    "DRAIN",
                    "CPU",
                    "MEMORY",
                    "LABELS",
                ]);
                for item in &list.items {
                    let n = &item.node;
                    t.row(vec![
                        n.name.clone(),
                        accelerator_text(n),
                        n.status.hypervisor.clone().unwrap_or_else(|| "-".into()),
                        ago(n.status.last_heartbeat, now),
                        cordon_text(n),
                        drain_text(n, now),
                        cpu_text(item),
                        memory_text(item),
                        labels_text(n),
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
                    ("accelerator", accelerator_text(n)),
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
                    ("cordoned", cordon_text(n)),
                    ("drain", drain_text(n, now)),
                    ("freeze", super::freeze::freeze_text(n)),
                    ("labels", labels_text(n)),
                    ("cpus (allocated/offered)", cpu_text(&resp)),
                    ("memory (allocated/offered)", memory_text(&resp)),
                    (
                        "host",
                        n.status.capacity.map_or_else(
                            || "-".into(),
                            |c| format!("{} CPU, {}", c.host.cpus, human_mib(c.host.memory_mib)),
                        ),
                    ),
                    (
                        "migrations",
                        n.drain
                            .as_ref()
                            .map_or_else(|| "-".into(), |d| tuning_text(&d.tuning)),
                    ),
                    ("revision", resp.revision.to_string()),
                ])
            })
        }
        NodeVerb::Cordon { name } => {
            let resp: NodeResponse =
                client.call(Method::POST, &verb_path(&name, "cordon"), None::<&()>)?;
            output::print(out, &resp, || {
                format!("node {name}: cordoned by operator; lift with `keel node uncordon {name} --operator`\n")
            })
        }
        NodeVerb::Uncordon(args) => uncordon(&client, out, args),
        NodeVerb::Drain(args) => drain(&client, out, args),
        NodeVerb::Freeze(args) => super::freeze::freeze(&client, out, args),
        NodeVerb::Label(args) => label(&client, out, args),
    }
}

fn label(client: &Client, out: OutputFormat, args: LabelArgs) -> anyhow::Result<()> {
    let mut req = LabelRequest::default();
    for arg in &args.labels {
        match arg.strip_suffix('-') {
            Some(key) if !key.contains('=') => req.remove.push(key.to_string()),
            _ => {
                let (k, v) = keel_api::placement::parse_label(arg).map_err(|e| {
                    anyhow::anyhow!("{arg}: {e} (KEY=VALUE to set, KEY- to remove)")
                })?;
                req.set.insert(k, v);
            }
        }
    }
    let resp: NodeResponse =
        client.call(Method::POST, &verb_path(&args.name, "labels"), Some(&req))?;
    output::print(out, &resp, || {
        format!("node {}: labels {}\n", args.name, labels_text(&resp.node))
    })
}

fn labels_text(n: &Node) -> String {
    if n.labels.is_empty() {
        return "-".into();
    }
    n.labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn verb_path(name: &str, verb: &str) -> String {
    format!("/api/v1/nodes/{}/{verb}", encode(name))
}

/// A node that reported its hypervisor but no accelerator is still
/// settling it (its driver probes KVM in the background).
fn accelerator_text(n: &Node) -> String {
    match (n.status.accelerator, &n.status.hypervisor) {
        (Some(a), _) => format!("{a:?}"),
        (None, Some(_)) => "probing".into(),
        (None, None) => "unknown".into(),
    }
}

fn cordon_text(n: &Node) -> String {
    match (n.cordoned, n.cordoned_by_keel) {
        (false, _) => "false".into(),
        (true, true) => "true (keel)".into(),
        (true, false) => "true (operator)".into(),
    }
}

fn drain_text(n: &Node, now: Millis) -> String {
    match &n.drain {
        None => "-".into(),
        Some(d) => match d.completed_at {
            Some(at) => format!("completed {}", ago(at, now)),
            None => format!("draining since {}", ago(d.requested_at, now)),
        },
    }
}

fn uncordon(client: &Client, out: OutputFormat, args: UncordonArgs) -> anyhow::Result<()> {
    let req = UncordonRequest {
        operator: args.operator,
        return_vms: args.return_vms,
    };
    let resp: UncordonResponse =
        client.call(Method::POST, &verb_path(&args.name, "uncordon"), Some(&req))?;
    output::print(out, &resp, || {
        let name = &args.name;
        let mut text = if resp.schedulable {
            format!("node {name}: uncordoned; new VMs may be placed on it\n")
        } else if resp.operator_cordon {
            format!(
                "node {name}: Keel's drain and cordon lifted, but an operator's cordon remains; \
                 lift it with `keel node uncordon {name} --operator`\n"
            )
        } else {
            format!("node {name}: still cordoned\n")
        };
        if let Some(r) = &resp.returned {
            text.push_str(&return_text(name, r));
        }
        text
    })?;
    match &resp.returned {
        Some(r) if args.wait && !r.returning.is_empty() => {
            wait_returned(client, &args.name, &r.returning, args.timeout)
        }
        _ => Ok(()),
    }
}

fn return_text(node: &str, r: &crate::api::drain_return::ReturnOutcome) -> String {
    let mut text = match r.returning.as_slice() {
        [] => format!("node {node}: no VM to migrate back\n"),
        vms => format!("node {node}: migrating back {}\n", vms.join(", ")),
    };
    for n in &r.not_returned {
        text.push_str(&format!("  {} stays: {}\n", n.vm, n.reason));
    }
    text
}

/// Until every one of `vms` runs on `node` again, or its migration back
/// has failed (the VM then keeps running where it is, with the reason).
fn wait_returned(
    client: &Client,
    node: &str,
    vms: &[String],
    timeout_s: u64,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(timeout_s);
    let mut failed = Vec::new();
    let mut waiting: Vec<&String> = vms.iter().collect();
    while !waiting.is_empty() {
        let list: VmList = client.get("/api/v1/vms")?;
        waiting.retain(|name| {
            let Some(item) = list.items.iter().find(|i| &i.vm.name == *name) else {
                return false;
            };
            let vm = &item.vm;
            if vm.status.instance.as_ref().is_some_and(|i| i.node == node)
                && vm.pending_migration().is_none()
            {
                return false;
            }
            match &vm.status.migrate_outcome {
                Some(o) if !o.succeeded && vm.pending_migration().is_none() => {
                    failed.push(format!("{name}: {}", o.message));
                    false
                }
                _ => true,
            }
        });
        if waiting.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "timed out after {timeout_s}s waiting for {} to return to node {node}",
                waiting
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        std::thread::sleep(POLL);
    }
    if !failed.is_empty() {
        bail!("not returned to node {node}: {}", failed.join("; "));
    }
    eprintln!("node {node}: every VM asked back runs on it again");
    Ok(())
}

/// One line for a drain's migration tuning.
pub fn tuning_text(t: &MigrationTuning) -> String {
    format!(
        "timeout {}s/GiB, progress {}s, bandwidth {}, auto-converge {}, downtime {}, parallel {}/cluster {}/node",
        t.completion_timeout_per_gib_s,
        t.progress_timeout_s,
        t.bandwidth_mib_s
            .map_or_else(|| "node default".into(), |b| format!("{b} MiB/s")),
        if t.auto_converge { "on" } else { "off" },
        t.downtime_limit_ms
            .map_or_else(|| "default".into(), |d| format!("{d}ms")),
        t.parallel_per_cluster,
        t.parallel_per_node
    )
}

fn requested_tuning(args: &DrainArgs) -> Option<MigrationTuning> {
    let d = MigrationTuning::default();
    let t = MigrationTuning {
        completion_timeout_per_gib_s: args
            .completion_timeout_per_gib
            .unwrap_or(d.completion_timeout_per_gib_s),
        progress_timeout_s: args.progress_timeout.unwrap_or(d.progress_timeout_s),
        bandwidth_mib_s: args.bandwidth.or(d.bandwidth_mib_s),
        auto_converge: !args.no_auto_converge,
        downtime_limit_ms: args.downtime_limit.or(d.downtime_limit_ms),
        parallel_per_cluster: args.max_parallel.unwrap_or(d.parallel_per_cluster),
        parallel_per_node: args.max_parallel_per_node.unwrap_or(d.parallel_per_node),
    };
    (t != d).then_some(t)
}

fn drain(client: &Client, out: OutputFormat, args: DrainArgs) -> anyhow::Result<()> {
    let req = DrainRequest {
        submit_window_s: args.submit_window,
        migrate_window_s: args.migrate_window,
        fallback_window_s: args.fallback_window,
        tuning: requested_tuning(&args),
    };
    let resp: NodeResponse =
        client.call(Method::POST, &verb_path(&args.name, "drain"), Some(&req))?;
    if !args.wait {
        return output::print(out, &resp, || {
            let d = resp.node.drain.as_ref();
            format!(
                "node {}: drain requested{}\n",
                args.name,
                d.map(|d| format!(
                    " (windows: submit {}s, migrate {}s, fallback {}s; migrations: {})",
                    d.windows.submit_ms / 1000,
                    d.windows.migrate_ms / 1000,
                    d.windows.fallback_ms / 1000,
                    tuning_text(&d.tuning)
                ))
                .unwrap_or_default()
            )
        });
    }
    let done = wait_drained(client, &args.name, Duration::from_secs(args.timeout))?;
    output::print(out, &done, || {
        format!(
            "node {}: drained, no VM left on it (completed {}); it stays cordoned until `keel node uncordon {}`\n",
            args.name,
            done.node
                .drain
                .as_ref()
                .and_then(|d| d.completed_at)
                .map(rfc3339)
                .unwrap_or_else(|| "-".into()),
            args.name
        )
    })
}

/// Polls the node until its drain completed, printing on stderr each
/// change of a VM's eviction on it, and when a VM is off it.
fn wait_drained(client: &Client, name: &str, timeout: Duration) -> anyhow::Result<NodeResponse> {
    let deadline = Instant::now() + timeout;
    let node_path = format!("/api/v1/nodes/{}", encode(name));
    // The last line printed for each VM seen on the node.
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut live = LiveLine::new();
    let mut rates: BTreeMap<String, SendRate> = BTreeMap::new();
    loop {
        let resp: NodeResponse = client.get(&node_path)?;
        let Some(drain) = resp.node.drain.clone() else {
            bail!("the drain of node {name} was cancelled (uncordoned) while waiting");
        };
        let vms: VmList = client.get_all("/api/v1/vms")?;
        let mut on_node = BTreeMap::new();
        for item in &vms.items {
            let vm = &item.vm;
            if vm.owner_node() == Some(name) {
                on_node.insert(vm.name.clone(), eviction_line(vm));
            }
        }
        for (vm, line) in &on_node {
            if seen.get(vm) != Some(line) {
                live.clear();
                eprintln!("{}", keel_api::untrusted::terminal_safe(line));
                seen.insert(vm.clone(), line.clone());
            }
        }
        let gone: Vec<String> = seen
            .keys()
            .filter(|vm| !on_node.contains_key(*vm))
            .cloned()
            .collect();
        for vm_name in gone {
            seen.remove(&vm_name);
            let now = vms.items.iter().find(|i| i.vm.name == vm_name);
            let line = off_node_line(&vm_name, name, now.map(|i| &i.vm));
            live.clear();
            eprintln!("{}", keel_api::untrusted::terminal_safe(&line));
        }
        if drain.completed_at.is_some() {
            return Ok(resp);
        }
        if live.is_on() {
            live.show(&drain_line(client, name, on_node.len(), &mut rates));
        }
        if Instant::now() >= deadline {
            bail!(
                "timed out after {}s waiting for node {name} to drain ({} VM(s) still on it: {})",
                timeout.as_secs(),
                on_node.len(),
                on_node.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        std::thread::sleep(POLL);
    }
}

/// The drain's progress line: the VMs still on the node and the sums of
/// the migrations sending them away (bytes, rate, ETA).
fn drain_line(
    client: &Client,
    node: &str,
    vms_on_node: usize,
    rates: &mut BTreeMap<String, SendRate>,
) -> String {
    let mut line = format!("node {node}: draining, {vms_on_node} VM(s) on it");
    // The line is a nicety: without the list it says what it knows.
    let Ok(list) = client.get::<MigrationList>("/api/v1/migrations") else {
        return line;
    };
    let under_way: Vec<Migration> = list
        .items
        .into_iter()
        .map(|i| i.migration)
        .filter(|m| m.source_node == node && !m.status.phase.is_final())
        .collect();
    if under_way.is_empty() {
        return line;
    }
    line.push_str(&format!(", {} migrating", under_way.len()));
    let sending = Sending::sum(under_way.iter().filter_map(|m| {
        let rate = rates.entry(m.id.clone()).or_default().observe(m);
        Sending::of(m, rate)
    }));
    if let Some(sending) = sending {
        line.push_str(&format!(": {}", sending.describe()));
    }
    line
}

fn eviction_line(vm: &VirtualMachine) -> String {
    let s = &vm.status;
    match &s.eviction {
        Some(ev) => format!(
            "{}: eviction {:?}{}{}",
            vm.name,
            ev.phase,
            ev.migration
                .as_deref()
                .map(|m| format!(" (migration {m})"))
                .unwrap_or_default(),
            ev.message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ),
        None => format!(
            "{}: {:?} on the node, eviction not started",
            vm.name, s.phase
        ),
    }
}

fn off_node_line(vm: &str, node: &str, now: Option<&VirtualMachine>) -> String {
    let Some(v) = now else {
        return format!("{vm}: off node {node} (deleted)");
    };
    let s = &v.status;
    let mut line = format!("{vm}: off node {node}, {:?}", s.phase);
    if let Some(inst) = &s.instance {
        line.push_str(&format!(" on node {} (instance {})", inst.node, inst.id));
    }
    if let Some(msg) = &s.message {
        line.push_str(&format!(": {msg}"));
    }
    line
}

/// `allocated/offered` vCPUs (`-` for a node that reports no capacity).
fn cpu_text(item: &NodeResponse) -> String {
    let used = item.allocated.map_or(0, |a| a.cpus);
    match item.node.status.capacity {
        Some(c) => format!("{used}/{}", c.cpus),
        None => format!("{used}/-"),
    }
}

/// `allocated/offered` memory.
fn memory_text(item: &NodeResponse) -> String {
    let used = human_mib(item.allocated.map_or(0, |a| a.memory_mib));
    match item.node.status.capacity {
        Some(c) => format!("{used}/{}", human_mib(c.memory_mib)),
        None => format!("{used}/-"),
    }
}
