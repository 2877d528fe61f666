//! The cache that serves the guests' figures (`Hypervisor::stats_all`) to
//! scrapes and `keel vm top`: a scrape of a node with a thousand guests
//! asks each QEMU at most once per interval, and a slow or hung one delays
//! no scrape beyond a bound.

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_api::Clock;

use crate::vm_stats::NodeStats;
use crate::Hypervisor;

/// The node's figures, read at most once per `max_age` whoever asks, and
/// each read bounded by `bound`: past it, the last figures are served with
/// the reason they are stale, while the read that overran is dropped.
pub struct StatsCache {
    hv: Arc<dyn Hypervisor>,
    clock: Arc<dyn Clock>,
    max_age: Duration,
    bound: Duration,
    /// Held while a read is under way, so concurrent scrapes share it.
    last: tokio::sync::Mutex<Option<(Instant, Arc<NodeStats>)>>,
}

/// Short enough for `keel vm top`'s two-second refresh to see new figures
/// at each turn; long enough that scrapers polling together share a read.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_millis(900);
/// A read of every domain longer than this serves the previous figures.
pub const DEFAULT_BOUND: Duration = Duration::from_secs(3);

impl StatsCache {
    pub fn new(hv: Arc<dyn Hypervisor>, clock: Arc<dyn Clock>) -> Self {
        Self::with_timing(hv, clock, DEFAULT_MAX_AGE, DEFAULT_BOUND)
    }

    pub fn with_timing(
        hv: Arc<dyn Hypervisor>,
        clock: Arc<dyn Clock>,
        max_age: Duration,
        bound: Duration,
    ) -> Self {
        Self {
            hv,
            clock,
            max_age,
            bound,
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// The node's figures, no older than `max_age` unless the read failed.
    pub async fn get(&self) -> Arc<NodeStats> {
        let mut last = self.last.lock().await;
        if let Some((at, stats)) = last.as_ref() {
            if at.elapsed() < self.max_age {
                return stats.clone();
            }
        }
        let read = tokio::time::timeout(self.bound, self.hv.stats_all()).await;
        let fresh = match read {
            Ok(Ok(domains)) => NodeStats {
                sampled_at: self.clock.now_ms(),
                domains,
                stale_reason: None,
            },
            Ok(Err(err)) => self.stale(last.as_ref(), crate::cause::with_causes(&err)),
            Err(_) => self.stale(
                last.as_ref(),
                format!("reading the guests' figures took over {:?}", self.bound),
            ),
        };
        let fresh = Arc::new(fresh);
        *last = Some((Instant::now(), fresh.clone()));
        fresh
    }

    fn stale(&self, last: Option<&(Instant, Arc<NodeStats>)>, reason: String) -> NodeStats {
        tracing::warn!(%reason, "guest figures: serving the previous read");
        let mut stats = last.map(|(_, s)| (**s).clone()).unwrap_or_default();
        stats.stale_reason = Some(reason);
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimConfig, SimHypervisor};
    use crate::DomainSpec;
    use keel_api::ManualClock;

    #[tokio::test]
    async fn a_read_is_shared_until_it_is_older_than_max_age() {
        let clock = ManualClock::new(0);
        let sim = Arc::new(SimHypervisor::new(
            Arc::new(clock.clone()),
            1,
            SimConfig::default(),
        ));
        sim.start(&DomainSpec::bare("web", "web-1", 2, 512))
            .await
            .unwrap();
        clock.advance(60_000);
        let cache = StatsCache::with_timing(
            sim.clone(),
            Arc::new(clock.clone()),
            Duration::from_secs(3600),
            Duration::from_secs(5),
        );
        let first = cache.get().await;
        assert_eq!(first.domains.len(), 1);
        clock.advance(60_000);
        let again = cache.get().await;
        assert!(Arc::ptr_eq(&first, &again), "served from the cache");
        let fresh = StatsCache::with_timing(
            sim,
            Arc::new(clock.clone()),
            Duration::ZERO,
            Duration::from_secs(5),
        );
        let later = fresh.get().await;
        assert!(later.sampled_at > first.sampled_at);
        assert!(
            later.domains[0].cpu_seconds > first.domains[0].cpu_seconds,
            "{later:?} after {first:?}"
        );
    }
}
