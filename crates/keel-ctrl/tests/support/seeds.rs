//! Running a seeded simulation: which seeds, on how many threads, and
//! reporting failures.

use std::any::Any;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The seed in `$one` (replaying a failure), else seeds `0..$count`
/// (`default` when unset).
pub fn seeds(one: &str, count: &str, default: u64) -> Vec<u64> {
    match std::env::var(one) {
        Ok(s) => vec![s
            .parse()
            .unwrap_or_else(|_| panic!("{one} must be a number"))],
        Err(_) => {
            let n: u64 = std::env::var(count)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(default);
            (0..n).collect()
        }
    }
}

/// Runs every seed (stopping after three failures) and fails with their
/// reports, each of which names its seed (a panic's says to replay it
/// with `replay_var`), or with a forbidden transition refused outside
/// any seed's own check.
///
/// Each seed is a world of its own on a manual clock, so its run does not
/// depend on which thread runs it or what ran before: the seeds are dealt
/// out to one thread per core (`KEEL_SIM_THREADS` sets how many). One
/// thread ran a thousand worlds in six minutes on two cores while the
/// other core idled. Each seed gets a thread and a single-threaded
/// runtime of its own, so no task a world left behind runs into the next
/// one, nor does a count it kept per thread (a replay of that seed alone
/// would have neither), and a seed that panics is reported by its seed
/// like one that fails.
pub fn run_seeds<F, Fut>(what: &str, replay_var: &str, seeds: &[u64], run: F)
where
    F: Fn(u64) -> Fut + Sync,
    Fut: Future<Output = Result<(), String>>,
{
    let threads = std::env::var("KEEL_SIM_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .clamp(1, seeds.len().max(1));
    let next = AtomicUsize::new(0);
    let failures: Mutex<Vec<(u64, String)>> = Mutex::new(Vec::new());
    let enough = || failures.lock().map_or(true, |f| f.len() >= 3);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while !enough() {
                    let Some(&seed) = seeds.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    // A thread of its own, so that what the world counts
                    // per thread (refused transitions) is this seed's.
                    let ran = std::thread::scope(|own| {
                        own.spawn(|| {
                            tokio::runtime::Builder::new_current_thread()
                                .enable_all()
                                .build()
                                .expect("a runtime for the seed's world")
                                .block_on(run(seed))
                        })
                        .join()
                    });
                    let failed = match ran {
                        Ok(outcome) => outcome.err(),
                        Err(panic) => Some(format!(
                            "{what}: seed {seed} panicked: {}\nreplay: {replay_var}={seed}",
                            panic_text(panic.as_ref())
                        )),
                    };
                    if let Some(report) = failed {
                        failures.lock().expect("failures").push((seed, report));
                    }
                }
            });
        }
    });
    println!("{what}: {} seeds run on {threads} threads", seeds.len());
    let mut failures = failures.into_inner().expect("failures");
    failures.sort_by_key(|(seed, _)| *seed);
    let reports: Vec<String> = failures.into_iter().map(|(_, e)| e).collect();
    assert!(reports.is_empty(), "{}", reports.join("\n\n"));
    // Each world checks the refusals made on its own thread; none may
    // have been made anywhere else either.
    let (refused, last) = keel_ctrl::transitions::refused_so_far();
    assert_eq!(
        refused, 0,
        "forbidden phase transitions refused, the last: {last:?}"
    );
}

fn panic_text(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(not a string)")
}
