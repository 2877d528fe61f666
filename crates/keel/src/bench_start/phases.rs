//! The phases of a Keel start, from the marks the server logs
//! ([`keel_hv::start_marks`]), the bench's own clock (the request, the
//! CLI's return) and the moment the guest's console showed its ready text
//! (watched by the bench, beside Keel).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_hv::qemu::bare;
use keel_hv::qemu::console_watch::ConsoleChanges;
pub use keel_hv::start_marks::now_us;

/// The server's log filter: its usual lines and the start marks.
pub const LOG_FILTER: &str = "info,keel_start_phase=debug";

/// The longest phase of Keel's own the bench calls fine.
pub const OWN_TARGET_MS: f64 = 50.0;

/// Who a phase's time belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Whose {
    /// Keel's own work: a bare start has none of it.
    Keel,
    /// What a bare start of the same command line does as well.
    Qemu,
    /// The guest booting.
    Guest,
}

/// Where one phase ends: a mark the server logs, or one of the bench's.
#[derive(Debug, Clone, Copy)]
enum End {
    Logged(&'static str),
    /// The last of these marks before the first of the other: of the
    /// reconciles of a VM, the one that recorded the instance. (The
    /// reconcile the API's write wakes may begin before the API logs that
    /// write: the watch and the response race.)
    LoggedBefore(&'static str, &'static str),
    ConsoleReady,
    Returned,
    /// A step Keel's start does not take (its row says why).
    NotTaken(&'static str),
}

/// A start's phases in order; each runs from the end of the one before it
/// that took place.
const PHASES: &[(&str, End, Whose)] = &[
    (
        "API write (CLI, TLS, store write)",
        End::Logged("api_written"),
        Whose::Keel,
    ),
    (
        "watch delivery (to the reconcile)",
        End::LoggedBefore("reconcile_begun", "instance_recorded"),
        Whose::Keel,
    ),
    (
        "placement",
        End::LoggedBefore("placed", "instance_recorded"),
        Whose::Keel,
    ),
    (
        "reconcile (decide, record the instance)",
        End::Logged("instance_recorded"),
        Whose::Keel,
    ),
    (
        "disk creation (and the images' check)",
        End::Logged("disks_ready"),
        Whose::Keel,
    ),
    (
        "instance dir (record, sockets)",
        End::Logged("prepared"),
        Whose::Keel,
    ),
    ("spawn (passt, QEMU)", End::Logged("spawned"), Whose::Qemu),
    ("QMP handshake", End::Logged("qmp_connected"), Whose::Qemu),
    (
        "cont",
        End::NotTaken("not sent: Keel starts QEMU running (no -S)"),
        Whose::Qemu,
    ),
    (
        "guest boot (to its ready text)",
        End::ConsoleReady,
        Whose::Guest,
    ),
    (
        "readiness detection",
        End::Logged("ready_seen"),
        Whose::Keel,
    ),
    ("status write", End::Logged("ready_written"), Whose::Keel),
    ("the CLI's wait sees it", End::Returned, Whose::Keel),
];

/// One Keel start's marks from the bench's side.
#[derive(Debug, Clone)]
pub struct StartMarks {
    pub requested_us: u64,
    /// When the bench saw the guest's ready text in its console log.
    pub console_ready_us: Option<u64>,
    pub returned_us: u64,
}

/// One phase over all starts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PhaseFigure {
    pub phase: String,
    pub whose: Whose,
    /// Median over the starts that had it; `None`: not taken.
    pub median_ms: Option<f64>,
    /// Of the median start→ready.
    pub share: Option<f64>,
    /// Starts that had the phase.
    pub starts: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A mark of the server's log: (vm, mark, µs).
fn logged_marks(log: &str) -> Vec<(String, String, u64)> {
    log.lines()
        .filter(|l| l.contains("start mark"))
        .filter_map(|l| {
            let field = |name: &str| {
                l.split(&format!(" {name}="))
                    .nth(1)
                    .and_then(|v| v.split_whitespace().next())
                    .map(|v| v.trim_matches('"').to_string())
            };
            Some((field("vm")?, field("mark")?, field("at_us")?.parse().ok()?))
        })
        .collect()
}

/// Each phase's median over `starts` of VM `vm`, cut from the server's log.
pub fn figures(
    vm: &str,
    starts: &[StartMarks],
    log: &str,
    keel_median_ms: f64,
) -> Vec<PhaseFigure> {
    let marks: Vec<(String, u64)> = logged_marks(log)
        .into_iter()
        .filter(|(v, _, _)| v == vm)
        .map(|(_, m, at)| (m, at))
        .collect();
    let mut per_phase: Vec<Vec<f64>> = vec![Vec::new(); PHASES.len()];
    for start in starts {
        let (from, until) = (start.requested_us, start.returned_us);
        let window = move |at: &u64| (from..=until).contains(at);
        let mut prev = start.requested_us;
        for (i, (_, end, _)) in PHASES.iter().enumerate() {
            let in_window = |name: &'static str| {
                marks
                    .iter()
                    .filter(move |(m, at)| m == name && window(at))
                    .map(|(_, at)| *at)
            };
            let at = match end {
                // The first after the phase before; one logged before it
                // (the API's write racing its watch, the console observer
                // a moment behind Keel) counts as taking no time.
                End::Logged(name) => in_window(name)
                    .find(|at| *at >= prev)
                    .or_else(|| in_window(name).any(|at| at < prev).then_some(prev)),
                End::LoggedBefore(name, anchor) => in_window(anchor).next().and_then(|until| {
                    in_window(name)
                        .filter(|at| *at <= until)
                        .max()
                        .map(|at| at.max(prev))
                }),
                // The observer can only be late: a text it saw after the
                // CLI returned showed before (Keel had seen it).
                End::ConsoleReady => start
                    .console_ready_us
                    .map(|at| at.min(until))
                    .filter(window),
                End::Returned => Some(start.returned_us),
                End::NotTaken(_) => None,
            };
            if let Some(at) = at {
                per_phase[i].push(at.saturating_sub(prev) as f64 / 1e3);
                prev = prev.max(at);
            }
        }
    }
    PHASES
        .iter()
        .zip(per_phase)
        .map(|((name, end, whose), samples)| {
            let median_ms = (!samples.is_empty()).then(|| super::median(&samples));
            PhaseFigure {
                phase: name.to_string(),
                whose: *whose,
                median_ms,
                share: median_ms.map(|m| m / keel_median_ms),
                starts: samples.len(),
                note: match end {
                    End::NotTaken(why) => Some(why.to_string()),
                    _ if samples.is_empty() => Some("not taken in these starts".into()),
                    _ => None,
                },
            }
        })
        .collect()
}

pub fn print(figures: &[PhaseFigure]) {
    println!("phases of a Keel start (medians; share of the median start→ready):");
    for f in figures {
        let whose = match f.whose {
            Whose::Keel => "Keel",
            Whose::Qemu => "QEMU (bare too)",
            Whose::Guest => "guest",
        };
        match (f.median_ms, f.share) {
            (Some(ms), Some(share)) => {
                let over = if f.whose == Whose::Keel && ms > OWN_TARGET_MS {
                    "  OVER 50 ms"
                } else {
                    ""
                };
                println!(
                    "  {:<42} {ms:>9.1} ms {:>6.1}%  {whose}{over}",
                    f.phase,
                    share * 100.0
                );
            }
            _ => println!(
                "  {:<42} {:>12} {:>7}  {}",
                f.phase,
                "—",
                "",
                f.note.as_deref().unwrap_or("")
            ),
        }
    }
    let over: Vec<&str> = figures
        .iter()
        .filter(|f| f.whose == Whose::Keel && f.median_ms.is_some_and(|m| m > OWN_TARGET_MS))
        .map(|f| f.phase.as_str())
        .collect();
    if over.is_empty() {
        println!("  every phase of Keel's own under {OWN_TARGET_MS:.0} ms");
    } else {
        println!(
            "  Keel's own phases over {OWN_TARGET_MS:.0} ms: {}",
            over.join("; ")
        );
    }
}

/// Watches for the next instance directory to appear under `instances`
/// (every 10 ms) and for its console log to show `text`, on a thread of its
/// own: when the guest was ready, independently of when Keel noticed. The
/// log is followed as the bare side follows its own
/// (`bare::console_shows`, woken by each change): a poll of the log lagged
/// Keel's own detection once that became immediate.
pub struct ConsoleObserver {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Option<u64>>,
}

impl ConsoleObserver {
    pub fn watch(instances: &Path, text: &str) -> ConsoleObserver {
        let before: Vec<PathBuf> = dirs(instances);
        let (instances, text) = (instances.to_path_buf(), text.to_string());
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let dir = loop {
                if stopped.load(Ordering::Relaxed) {
                    return None;
                }
                // Not the driver's staging directory, which becomes the
                // instance's by a rename.
                let found = dirs(&instances).into_iter().find(|d| {
                    !before.contains(d)
                        && d.file_name()
                            .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
                });
                if let Some(dir) = found {
                    break dir;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let log = dir.join("console.log");
                let mut changes = ConsoleChanges::watch(&log).ok()?;
                tokio::select! {
                    shown = bare::console_shows(&mut changes, &log, &text) => {
                        shown.ok().map(|()| now_us())
                    }
                    () = async {
                        while !stopped.load(Ordering::Relaxed) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    } => None,
                }
            })
        });
        ConsoleObserver { stop, thread }
    }

    /// When the text showed (`None`: not seen). Called once Keel says the
    /// guest is ready, so the text is in the log: the observer gets a
    /// moment to finish its scan before it is stopped.
    pub fn finish(self) -> Option<u64> {
        let grace = Instant::now() + Duration::from_secs(2);
        while !self.thread.is_finished() && Instant::now() < grace {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().ok().flatten()
    }
}

fn dirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}
