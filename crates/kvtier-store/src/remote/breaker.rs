//! The circuit breaker in front of G4: a slow or dead pool turns into
//! immediate misses instead of requests that wait on it.
//!
//! Closed: every operation goes through; `failures_to_open` failures in a
//! row open it. Open: every operation is refused (a miss, a dropped
//! write-through) until `open_for` has passed; then one operation goes
//! through as a probe (half-open). A successful probe closes the breaker; a
//! failed one opens it again for twice as long, up to `max_open_for`. So a
//! pool that comes back is used again within `max_open_for`, with no
//! operator action.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// When the breaker opens and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Failures in a row (errors or timeouts) that open the breaker.
    pub failures_to_open: u32,
    /// How long it stays open the first time.
    pub open_for: Duration,
    /// The longest it stays open after repeated failed probes.
    pub max_open_for: Duration,
}

impl Default for BreakerConfig {
    /// 3 failures; open 1 s, doubling up to 10 s.
    fn default() -> Self {
        Self {
            failures_to_open: 3,
            open_for: Duration::from_secs(1),
            max_open_for: Duration::from_secs(10),
        }
    }
}

/// The breaker's state as metrics and logs show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Operations go through.
    Closed,
    /// Operations are refused.
    Open,
    /// One probe is in flight; others are refused.
    HalfOpen,
}

#[derive(Debug)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant, open_for: Duration },
    HalfOpen { open_for: Duration },
}

/// A thread-safe circuit breaker (see the module docs).
#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    state: Mutex<State>,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State::Closed { failures: 0 }),
        }
    }

    /// True when an operation may go to the pool now. When it returns true
    /// the caller must report [`success`](Self::success) or
    /// [`failure`](Self::failure) for it.
    pub fn allow(&self, now: Instant) -> bool {
        let mut s = self.state.lock();
        match *s {
            State::Closed { .. } => true,
            State::Open { until, open_for } if now >= until => {
                *s = State::HalfOpen { open_for };
                true
            }
            State::Open { .. } | State::HalfOpen { .. } => false,
        }
    }

    /// The pool answered (a miss is an answer). Closes the breaker.
    pub fn success(&self) {
        *self.state.lock() = State::Closed { failures: 0 };
    }

    /// The pool failed or timed out. Returns true when this failure opened
    /// the breaker (so the caller logs it once).
    pub fn failure(&self, now: Instant) -> bool {
        let cfg = self.config;
        let mut s = self.state.lock();
        match *s {
            State::Closed { failures } => {
                let failures = failures + 1;
                if failures >= cfg.failures_to_open.max(1) {
                    *s = State::Open {
                        until: now + cfg.open_for,
                        open_for: cfg.open_for,
                    };
                    true
                } else {
                    *s = State::Closed { failures };
                    false
                }
            }
            State::HalfOpen { open_for } => {
                let open_for = (open_for * 2).min(cfg.max_open_for.max(cfg.open_for));
                *s = State::Open {
                    until: now + open_for,
                    open_for,
                };
                true
            }
            // Late reports from operations started before it opened.
            State::Open { .. } => false,
        }
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        match *self.state.lock() {
            State::Closed { .. } => BreakerState::Closed,
            State::Open { .. } => BreakerState::Open,
            State::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failures_to_open: 3,
            open_for: Duration::from_millis(100),
            max_open_for: Duration::from_millis(300),
        }
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = Breaker::new(cfg());
        let t = Instant::now();
        assert!(!b.failure(t));
        assert!(!b.failure(t));
        b.success();
        assert!(!b.failure(t));
        assert!(!b.failure(t));
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.failure(t));
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow(t + Duration::from_millis(99)));
    }

    #[test]
    fn half_open_lets_one_probe_through_and_closes_on_success() {
        let b = Breaker::new(cfg());
        let t = Instant::now();
        for _ in 0..3 {
            b.failure(t);
        }
        let later = t + Duration::from_millis(100);
        assert!(b.allow(later));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(!b.allow(later), "a second caller waits for the probe");
        b.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.allow(later));
    }

    #[test]
    fn failed_probes_back_off_up_to_the_cap() {
        let b = Breaker::new(cfg());
        let mut t = Instant::now();
        for _ in 0..3 {
            b.failure(t);
        }
        // 100 ms, then 200, then capped at 300.
        for wait in [100u64, 200, 300, 300] {
            assert!(!b.allow(t + Duration::from_millis(wait - 1)));
            t += Duration::from_millis(wait);
            assert!(b.allow(t), "probe after {wait} ms");
            assert!(b.failure(t));
        }
    }
}
