//! Running a seeded simulation: which seeds, on how many threads, and
//! reporting failures.

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
/// reports, each of which names its seed.
///
/// Each seed is a world of its own on a manual clock, so its run does not
/// depend on which thread runs it or what ran before: the seeds are dealt
/// out to one thread per core (`KEEL_SIM_THREADS` sets how many), each
/// with its own single-threaded runtime. One thread ran a thousand worlds
/// in six minutes on two cores while the other core idled.
pub fn run_seeds<F, Fut>(what: &str, seeds: &[u64], run: F)
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
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the simulation's worlds");
                while !enough() {
                    let Some(&seed) = seeds.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    if let Err(e) = runtime.block_on(run(seed)) {
                        failures.lock().expect("failures").push((seed, e));
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
}
