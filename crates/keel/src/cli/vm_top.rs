//! `keel vm top [NAME...]`: CPU, memory, disk and network rates of the VMs
//! of the cluster (the server's node and, on a control plane, its bare
//! agent nodes), from two reads of `GET /api/v1/vm-stats?cluster=true`; live
//! (redrawn every `--interval` seconds) on a terminal, one table with
//! `--once` or when stdout is not a terminal.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use serde::Serialize;

use super::output::{self, Table};
use super::Client;
use crate::args::{OutputFormat, TopArgs};
use crate::metrics::vm_figures::{VmFigures, VmStatsPage};

/// One VM's line: rates over the interval between two reads.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopRow {
    pub vm: String,
    pub node: String,
    pub instance: String,
    pub ready: bool,
    pub uptime_seconds: Option<f64>,
    /// 100 is one host CPU busy all the time.
    pub cpu_percent: Option<f64>,
    pub rss_bytes: Option<u64>,
    pub memory_configured_bytes: u64,
    /// The guest's own view (its balloon driver's report): memory it
    /// could still use (available, or free from drivers that do not tell
    /// available) and all it manages.
    pub guest_available_bytes: Option<u64>,
    pub guest_total_bytes: Option<u64>,
    pub disk_read_bytes_per_s: Option<f64>,
    pub disk_write_bytes_per_s: Option<f64>,
    pub net_receive_bytes_per_s: Option<f64>,
    pub net_transmit_bytes_per_s: Option<f64>,
}

/// The whole cluster's VMs, as far as the server can ask for them.
const STATS_PATH: &str = "/api/v1/vm-stats?cluster=true";

pub fn run(client: &Client, out: OutputFormat, args: TopArgs) -> anyhow::Result<()> {
    let live = !args.once && std::io::stdout().is_terminal();
    let interval = Duration::from_secs_f64(args.interval.max(1.0));
    let mut before: VmStatsPage = client.get(STATS_PATH)?;
    loop {
        std::thread::sleep(if live {
            interval
        } else {
            // Long enough for the server's cached read to renew.
            Duration::from_secs(1)
        });
        let now: VmStatsPage = client.get(STATS_PATH)?;
        let rows = rows(&before, &now, &args.names);
        let text = output::render(out, &rows, || table(&now, &rows, &args.names))?;
        let mut stdout = std::io::stdout().lock();
        if live {
            // Home and clear, then the table: a redraw, not a scroll.
            write!(stdout, "\x1b[H\x1b[2J")?;
        }
        stdout.write_all(text.as_bytes())?;
        stdout.flush()?;
        if !live {
            return Ok(());
        }
        before = now;
    }
}

/// The lines of the VMs in `now` (those named, if any are), with rates
/// against `before` where the same instance is in both.
pub fn rows(before: &VmStatsPage, now: &VmStatsPage, names: &[String]) -> Vec<TopRow> {
    let seconds = now.sampled_at.saturating_sub(before.sampled_at) as f64 / 1000.0;
    now.vms
        .iter()
        .filter(|v| names.is_empty() || names.contains(&v.vm))
        .map(|v| {
            let was = before
                .vms
                .iter()
                .find(|b| b.instance == v.instance && b.node == v.node)
                .filter(|_| seconds > 0.0);
            let rate = |of: fn(&VmFigures) -> Option<f64>| -> Option<f64> {
                let (a, b) = (of(was?)?, of(v)?);
                Some((b - a).max(0.0) / seconds)
            };
            TopRow {
                vm: v.vm.clone(),
                node: v.node.clone(),
                instance: v.instance.clone(),
                ready: v.ready,
                uptime_seconds: v.uptime_seconds,
                cpu_percent: rate(|f| f.cpu_seconds).map(|r| r * 100.0),
                rss_bytes: v.rss_bytes,
                memory_configured_bytes: v.memory_configured_bytes,
                guest_available_bytes: v
                    .guest_memory
                    .and_then(|g| g.available_bytes.or(g.free_bytes)),
                guest_total_bytes: v.guest_memory.and_then(|g| g.total_bytes),
                disk_read_bytes_per_s: rate(|f| sum(&f.disks, |d| d.read_bytes)),
                disk_write_bytes_per_s: rate(|f| sum(&f.disks, |d| d.write_bytes)),
                net_receive_bytes_per_s: rate(|f| sum(&f.nics, |n| n.receive_bytes)),
                net_transmit_bytes_per_s: rate(|f| sum(&f.nics, |n| n.transmit_bytes)),
            }
        })
        .collect()
}

/// The total of a counter over a VM's disks or NICs; `None` without any
/// (no figure, rather than a rate of 0).
fn sum<T>(items: &[T], of: fn(&T) -> u64) -> Option<f64> {
    if items.is_empty() {
        return None;
    }
    Some(items.iter().map(of).sum::<u64>() as f64)
}

pub fn table(page: &VmStatsPage, rows: &[TopRow], names: &[String]) -> String {
    let mut t = Table::new(&[
        "NAME",
        "NODE",
        "READY",
        "UPTIME",
        "CPU%",
        "MEMORY",
        "GUEST AVAIL",
        "DISK R/s",
        "DISK W/s",
        "NET RX/s",
        "NET TX/s",
    ]);
    for r in rows {
        t.row(vec![
            r.vm.clone(),
            r.node.clone(),
            if r.ready { "yes" } else { "no" }.into(),
            r.uptime_seconds.map_or("-".into(), |s| uptime(s as u64)),
            r.cpu_percent.map_or("-".into(), |p| format!("{p:.1}")),
            format!(
                "{}/{}",
                r.rss_bytes.map_or("-".into(), bytes),
                bytes(r.memory_configured_bytes)
            ),
            match (r.guest_available_bytes, r.guest_total_bytes) {
                (None, None) => "-".into(),
                (available, total) => format!(
                    "{}/{}",
                    available.map_or("-".into(), bytes),
                    total.map_or("-".into(), bytes)
                ),
            },
            r.disk_read_bytes_per_s.map_or("-".into(), rate),
            r.disk_write_bytes_per_s.map_or("-".into(), rate),
            r.net_receive_bytes_per_s.map_or("-".into(), rate),
            r.net_transmit_bytes_per_s.map_or("-".into(), rate),
        ]);
    }
    let mut text = match (&page.node, page.agents.is_empty()) {
        (Some(node), true) => format!("node {node}: {} VMs running\n", page.vms.len()),
        (None, true) => "this server runs no guests and knows no agent nodes to ask: ask the server of the VMs' node\n".to_string(),
        (own, false) => {
            let nodes: Vec<&str> = own
                .iter()
                .map(String::as_str)
                .chain(page.agents.iter().filter(|a| a.answered).map(|a| a.node.as_str()))
                .collect();
            format!(
                "cluster: {} VMs running on nodes {}\n",
                page.vms.len(),
                nodes.join(", ")
            )
        }
    };
    text.push_str(&t.render());
    let missing: Vec<&str> = names
        .iter()
        .filter(|n| !rows.iter().any(|r| &r.vm == *n))
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        let place = if page.agents.is_empty() {
            "this node"
        } else {
            "the nodes asked"
        };
        text.push_str(&format!("not running on {place}: {}\n", missing.join(", ")));
    }
    for silent in page.agents.iter().filter(|a| !a.answered) {
        text.push_str(&format!(
            "node {} did not answer: its VMs are left out (the reason is in the server's log)\n",
            silent.node
        ));
    }
    if let Some(reason) = &page.stale_reason {
        text.push_str(&format!("figures from an earlier read: {reason}\n"));
    }
    text
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "Ki", "Mi", "Gi", "Ti"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n}B")
    } else {
        format!("{value:.1}{}", UNITS[unit])
    }
}

fn uptime(s: u64) -> String {
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        7200..=172_799 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

fn rate(per_s: f64) -> String {
    bytes(per_s.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::vm_figures::AgentAnswer;
    use keel_hv::vm_stats::DiskStats;

    fn figures(vm: &str, instance: &str, cpu: f64, read: u64) -> VmFigures {
        VmFigures {
            vm: vm.into(),
            node: "n1".into(),
            instance: instance.into(),
            cpus: 2,
            memory_configured_bytes: 512 << 20,
            ready: true,
            uptime_seconds: Some(90.0),
            restarts: 0,
            guest_resets: 0,
            cpu_seconds: Some(cpu),
            rss_bytes: Some(300 << 20),
            disks: vec![DiskStats {
                disk: "root".into(),
                read_bytes: read,
                ..Default::default()
            }],
            nics: vec![],
            guest_memory: Some(keel_hv::vm_stats::GuestMemory {
                total_bytes: Some(480 << 20),
                free_bytes: Some(100 << 20),
                available_bytes: Some(360 << 20),
                reported_at: Some(1_733_390_000),
            }),
        }
    }

    #[test]
    fn rates_come_from_the_same_instance_over_the_interval() {
        let before = VmStatsPage {
            node: Some("n1".into()),
            sampled_at: 10_000,
            stale_reason: None,
            agents: vec![],
            vms: vec![
                figures("web", "web-1", 1.0, 0),
                figures("db", "db-1", 5.0, 0),
            ],
        };
        let now = VmStatsPage {
            sampled_at: 12_000,
            vms: vec![
                figures("web", "web-1", 2.0, 4 << 20),
                // Restarted: nothing to compare with.
                figures("db", "db-2", 0.5, 1 << 20),
            ],
            ..before.clone()
        };
        let rows = rows(&before, &now, &[]);
        assert_eq!(rows[0].cpu_percent, Some(50.0));
        assert_eq!(rows[0].disk_read_bytes_per_s, Some(2.0 * 1024.0 * 1024.0));
        assert_eq!(rows[0].net_receive_bytes_per_s, None, "no NIC counters");
        assert_eq!(rows[1].cpu_percent, None);
        let text = table(&now, &rows, &["web".into(), "gone".into()]);
        assert!(text.contains("50.0"), "{text}");
        assert!(text.contains("2.0Mi"), "{text}");
        assert!(text.contains("GUEST AVAIL"), "{text}");
        assert!(text.contains("360.0Mi/480.0Mi"), "the guest's view: {text}");
        assert!(text.contains("not running on this node: gone"), "{text}");
        let only_web = super::rows(&before, &now, &["web".into()]);
        assert_eq!(only_web.len(), 1);
    }

    #[test]
    fn a_cluster_page_shows_each_vms_node_and_the_agents_that_did_not_answer() {
        let mut db = figures("db", "db-1", 1.0, 0);
        db.node = "n2".into();
        let page = VmStatsPage {
            node: Some("n1".into()),
            sampled_at: 10_000,
            stale_reason: None,
            vms: vec![db, figures("web", "web-1", 1.0, 0)],
            agents: vec![
                AgentAnswer {
                    node: "n2".into(),
                    answered: true,
                },
                AgentAnswer {
                    node: "n3".into(),
                    answered: false,
                },
            ],
        };
        let rows = rows(&page, &page, &[]);
        let text = table(&page, &rows, &["gone".into()]);
        assert!(
            text.starts_with("cluster: 2 VMs running on nodes n1, n2\n"),
            "{text}"
        );
        let db_line = text.lines().find(|l| l.starts_with("db ")).expect(&text);
        assert!(db_line.contains(" n2 "), "its node: {text}");
        assert!(text.contains("node n3 did not answer"), "{text}");
        assert!(
            text.contains("not running on the nodes asked: gone"),
            "{text}"
        );
    }
}
