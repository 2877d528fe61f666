//! Per-token limits: API requests per second (`keel serve
//! --max-requests-per-token`, a token bucket holding two seconds' worth)
//! and console sessions held open at once (`--max-consoles-per-token`).
//! A refusal is a 429 naming the limit and its flag.
//!
//! Counted by each control plane for the requests it serves: a client
//! spreading its requests over N control planes gets N times the rate.
//! Hand-written rather than `governor`: a bucket is a few lines, and it
//! runs on the injected clock, so tests step time instead of sleeping.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use keel_api::{Clock, Mono};

use super::ApiError;

pub const DEFAULT_REQUESTS_PER_SECOND: usize = 50;
pub const DEFAULT_CONSOLES_PER_TOKEN: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenLimits {
    pub requests_per_second: usize,
    pub consoles_per_token: usize,
}

impl Default for TokenLimits {
    fn default() -> Self {
        Self {
            requests_per_second: DEFAULT_REQUESTS_PER_SECOND,
            consoles_per_token: DEFAULT_CONSOLES_PER_TOKEN,
        }
    }
}

/// The requests and console sessions of each token (by id).
pub struct TokenMeters {
    limits: TokenLimits,
    clock: Arc<dyn Clock>,
    buckets: Mutex<HashMap<String, Bucket>>,
    consoles: Mutex<HashMap<String, usize>>,
}

struct Bucket {
    /// Requests that may be made now, in thousandths.
    milli: u64,
    at: Mono,
}

/// One open console session of a token; given back when dropped.
pub struct ConsoleSession {
    meters: Arc<TokenMeters>,
    token: String,
}

impl Drop for ConsoleSession {
    fn drop(&mut self) {
        let mut open = self.meters.consoles.lock().expect("console counts");
        if let Some(n) = open.get_mut(&self.token) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.token);
            }
        }
    }
}

impl TokenMeters {
    pub fn new(limits: TokenLimits, clock: Arc<dyn Clock>) -> Self {
        Self {
            limits,
            clock,
            buckets: Mutex::default(),
            consoles: Mutex::default(),
        }
    }

    /// Takes one request from the token's bucket, or the 429.
    pub fn admit(&self, token: &str) -> Result<(), ApiError> {
        let rate = self.limits.requests_per_second as u64;
        let capacity = rate.saturating_mul(2).saturating_mul(1000);
        let now = self.clock.mono();
        let mut buckets = self.buckets.lock().expect("request buckets");
        let bucket = buckets.entry(token.to_string()).or_insert(Bucket {
            milli: capacity,
            at: now,
        });
        // `rate` requests a second is `rate` thousandths a millisecond.
        let refill = now.since(bucket.at).saturating_mul(rate);
        bucket.milli = bucket.milli.saturating_add(refill).min(capacity);
        bucket.at = now;
        if bucket.milli < 1000 {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "limit reached: at most {rate} API requests per second per token \
                     (keel serve --max-requests-per-token); slow down and retry"
                ),
            )
            .with_field("max-requests-per-token"));
        }
        bucket.milli -= 1000;
        Ok(())
    }

    /// A console session for the token, or the 429 when it holds as many
    /// as it may.
    pub fn open_console(self: &Arc<Self>, token: &str) -> Result<ConsoleSession, ApiError> {
        let cap = self.limits.consoles_per_token;
        let mut open = self.consoles.lock().expect("console counts");
        let n = open.entry(token.to_string()).or_insert(0);
        if *n >= cap {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "limit reached: at most {cap} console sessions open at once per token \
                     (keel serve --max-consoles-per-token); close one first"
                ),
            )
            .with_field("max-consoles-per-token"));
        }
        *n += 1;
        Ok(ConsoleSession {
            meters: self.clone(),
            token: token.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::ManualClock;

    fn meters(rate: usize, consoles: usize) -> (Arc<TokenMeters>, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000));
        let limits = TokenLimits {
            requests_per_second: rate,
            consoles_per_token: consoles,
        };
        (Arc::new(TokenMeters::new(limits, clock.clone())), clock)
    }

    #[test]
    fn a_token_gets_its_rate_and_a_burst_of_two_seconds() {
        let (m, clock) = meters(5, 1);
        for _ in 0..10 {
            m.admit("a").unwrap();
        }
        let err = m.admit("a").unwrap_err();
        assert_eq!(err.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(err.message().contains("--max-requests-per-token"), "{err}");
        // Other tokens have their own bucket.
        m.admit("b").unwrap();
        clock.advance(200);
        m.admit("a").unwrap();
        assert!(m.admit("a").is_err());
    }

    #[test]
    fn console_sessions_are_given_back() {
        let (m, _) = meters(5, 2);
        let one = m.open_console("a").unwrap();
        let _two = m.open_console("a").unwrap();
        let err = m.open_console("a").err().expect("third refused");
        assert!(err.message().contains("--max-consoles-per-token"), "{err}");
        m.open_console("b").unwrap();
        drop(one);
        m.open_console("a").unwrap();
    }
}
