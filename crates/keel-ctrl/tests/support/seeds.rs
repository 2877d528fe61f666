//! Running a seeded simulation: which seeds, and reporting failures.

use std::future::Future;

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
pub async fn run_seeds<F, Fut>(what: &str, seeds: &[u64], run: F)
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let mut failures = Vec::new();
    for &seed in seeds {
        if let Err(e) = run(seed).await {
            failures.push(e);
            if failures.len() >= 3 {
                break;
            }
        }
    }
    println!("{what}: {} seeds run", seeds.len());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
