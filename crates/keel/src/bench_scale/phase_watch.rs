//! What the runs wait for: how many VMs are Running, and how many run an
//! instance started for their restart request, counted from the VM watch
//! stream (`GET /api/v1/vms?watch=true`) as the web console keeps its
//! list.
//!
//! The count was polled from `/metrics`, which renders every VM's series
//! (580 ms of the server's CPU at 10,000 VMs): load on what is measured,
//! so the probes were spaced to a fifth of the time, and "all Running" was
//! known only to within seconds. The stream tells the change that made it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use serde::Deserialize;

/// The counts, kept current by a thread reading the stream.
pub(super) struct PhaseWatch {
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    running: AtomicUsize,
    restarted: AtomicUsize,
    /// Why the stream ended, once it has.
    ended: Mutex<Option<String>>,
}

/// One line of the stream, only what the counts need of it.
#[derive(Deserialize)]
struct Line {
    #[serde(rename = "type")]
    kind: String,
    vm: Option<VmLine>,
    name: Option<String>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct VmLine {
    name: String,
    spec: SpecLine,
    status: StatusLine,
}

#[derive(Deserialize)]
struct SpecLine {
    #[serde(default)]
    restart_generation: u64,
}

#[derive(Deserialize)]
struct StatusLine {
    #[serde(default)]
    phase: String,
    #[serde(default)]
    observed_restart_generation: u64,
}

/// Of one VM: Running, and running for its restart request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Seen {
    running: bool,
    restarted: bool,
}

impl Seen {
    fn of(vm: &VmLine) -> Self {
        let running = vm.status.phase == "Running";
        let wanted = vm.spec.restart_generation;
        Seen {
            running,
            restarted: running && wanted > 0 && vm.status.observed_restart_generation == wanted,
        }
    }
}

impl PhaseWatch {
    /// Follows `stream` (the body of the watch) on a thread of its own.
    pub(super) fn follow(stream: impl Read + Send + 'static) -> Self {
        let counts = Arc::new(Counts::default());
        let kept = counts.clone();
        std::thread::spawn(move || {
            let why = match count(BufReader::new(stream), &kept) {
                Ok(()) => "the VM watch stream ended".to_string(),
                Err(err) => format!("the VM watch stream: {err:#}"),
            };
            *kept.ended.lock().expect("phase watch lock") = Some(why);
        });
        Self { counts }
    }

    pub(super) fn running(&self) -> anyhow::Result<usize> {
        self.check()?;
        Ok(self.counts.running.load(Ordering::Relaxed))
    }

    pub(super) fn restarted(&self) -> anyhow::Result<usize> {
        self.check()?;
        Ok(self.counts.restarted.load(Ordering::Relaxed))
    }

    fn check(&self) -> anyhow::Result<()> {
        match &*self.counts.ended.lock().expect("phase watch lock") {
            Some(why) => anyhow::bail!("{why}"),
            None => Ok(()),
        }
    }
}

fn count(stream: impl BufRead, counts: &Counts) -> anyhow::Result<()> {
    let mut seen: HashMap<String, Seen> = HashMap::new();
    let tally = |name: &str, now: Seen, seen: &mut HashMap<String, Seen>| {
        let before = match now == Seen::default() {
            true => seen.remove(name),
            false => seen.insert(name.to_string(), now),
        }
        .unwrap_or_default();
        for (was, is, count) in [
            (before.running, now.running, &counts.running),
            (before.restarted, now.restarted, &counts.restarted),
        ] {
            match (was, is) {
                (false, true) => {
                    count.fetch_add(1, Ordering::Relaxed);
                }
                (true, false) => {
                    count.fetch_sub(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
    };
    for line in stream.lines() {
        let line = line.context("reading")?;
        let line: Line = serde_json::from_str(&line).context("a line that is not a watch line")?;
        match (line.kind.as_str(), line.vm, line.name) {
            ("put", Some(vm), _) => tally(&vm.name, Seen::of(&vm), &mut seen),
            ("deleted", _, Some(name)) => tally(&name, Seen::default(), &mut seen),
            ("synced", _, _) => {}
            ("error", _, _) => anyhow::bail!("{}", line.error.unwrap_or_default()),
            (other, _, _) => anyhow::bail!("an unexpected line of type {other:?}"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_each_vms_latest_line() {
        let put = |name: &str, phase: &str, wanted: u64, observed: u64| {
            format!(
                r#"{{"type":"put","revision":1,"ready":false,"vm":{{"name":"{name}","spec":{{"restart_generation":{wanted},"cpus":1}},"status":{{"phase":"{phase}","observed_restart_generation":{observed}}}}}}}"#
            )
        };
        let lines = [
            put("a", "Running", 0, 0),
            put("b", "Starting", 0, 0),
            r#"{"type":"synced","revision":2}"#.to_string(),
            put("b", "Running", 0, 0),
            put("a", "Running", 0, 0),
            put("a", "Stopping", 1, 0),
            put("a", "Running", 1, 1),
            put("c", "Running", 0, 0),
            r#"{"type":"deleted","revision":9,"name":"c"}"#.to_string(),
        ]
        .join("\n");
        let counts = Counts::default();
        count(lines.as_bytes(), &counts).unwrap();
        assert_eq!(counts.running.load(Ordering::Relaxed), 2);
        assert_eq!(counts.restarted.load(Ordering::Relaxed), 1);

        let broken = r#"{"type":"error","error":"watch broke"}"#;
        let err = count(broken.as_bytes(), &Counts::default()).unwrap_err();
        assert!(err.to_string().contains("watch broke"), "{err}");
    }
}
