//! When the replay sends each request: open loop at the trace's times, or
//! closed loop per session.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::progress::request_bar;
use crate::targets::endpoint::{Completion, Endpoint};

use super::Prepared;

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// At the trace's times x `time_scale`, at most `max_concurrency` in
    /// flight (a request due while that many are out waits for one).
    Open {
        /// Multiplies the trace's time gaps (0: no waiting).
        time_scale: f64,
        /// At most this many in flight (0: no limit).
        max_concurrency: usize,
    },
    /// `sessions` sessions at a time, each request after the previous one's
    /// answer and the trace's gap x `time_scale`.
    Closed {
        /// Sessions in flight at once.
        sessions: usize,
        /// Multiplies the think times (0: none).
        time_scale: f64,
    },
}

/// One request as sent and answered.
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    /// Its place in the cut.
    pub index: usize,
    /// Seconds from the start of the run to sending it.
    pub sent_at_s: f64,
    /// What came back.
    pub completion: Completion,
}

impl Arrivals {
    /// One request at a time, each after the last one's answer.
    pub fn sequential(&self) -> bool {
        matches!(
            self,
            Arrivals::Open {
                max_concurrency: 1,
                ..
            } | Arrivals::Closed { sessions: 1, .. }
        )
    }
}

/// Sends `requests` to `endpoint` as `arrivals` says; every request comes
/// back, failed or not. Times are from the start of this call. A
/// sequential replay also waits, after each answer, for the server to go
/// idle ([`super::metrics::wait_idle`]): its next request then finds the
/// tiers settled, as the simulator of the server's tiers assumes.
pub(crate) fn run_phase(
    endpoint: &Endpoint,
    requests: &[Prepared],
    arrivals: &Arrivals,
    label: &str,
    progress: bool,
) -> Vec<Sent> {
    let pb = request_bar(requests.len() as u64, label.to_string(), progress);
    let out = Mutex::new(Vec::with_capacity(requests.len()));
    let t0 = Instant::now();
    let settle = arrivals.sequential();
    let send = |r: &Prepared| {
        let sent_at_s = t0.elapsed().as_secs_f64();
        let completion = endpoint.complete_ids(&r.prompt, r.max_tokens, true);
        if settle {
            super::metrics::wait_idle(endpoint);
        }
        pb.inc(1);
        let s = Sent {
            index: r.index,
            sent_at_s,
            completion,
        };
        match out.lock() {
            Ok(mut v) => v.push(s),
            Err(p) => p.into_inner().push(s),
        }
    };
    match *arrivals {
        Arrivals::Open {
            time_scale,
            max_concurrency,
        } => open_loop(requests, time_scale, max_concurrency, t0, &send),
        Arrivals::Closed {
            sessions,
            time_scale,
        } => closed_loop(requests, sessions.max(1), time_scale, &send),
    }
    pb.finish_and_clear();
    out.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// Sleeps until `t0 + at_s` (no-op when past).
fn sleep_until(t0: Instant, at_s: f64) {
    let due = t0 + Duration::from_secs_f64(at_s.max(0.0));
    let now = Instant::now();
    if due > now {
        std::thread::sleep(due - now);
    }
}

fn open_loop(
    requests: &[Prepared],
    time_scale: f64,
    max_concurrency: usize,
    t0: Instant,
    send: &(dyn Fn(&Prepared) + Sync),
) {
    let first = requests.first().map_or(0.0, |r| r.time_s);
    let in_flight = (Mutex::new(0usize), std::sync::Condvar::new());
    std::thread::scope(|scope| {
        for r in requests {
            sleep_until(t0, (r.time_s - first) * time_scale);
            if max_concurrency > 0 {
                let (n, cv) = &in_flight;
                let mut n = n.lock().unwrap_or_else(|p| p.into_inner());
                while *n >= max_concurrency {
                    n = cv.wait(n).unwrap_or_else(|p| p.into_inner());
                }
                *n += 1;
            }
            let in_flight = &in_flight;
            scope.spawn(move || {
                send(r);
                let (n, cv) = in_flight;
                let mut n = n.lock().unwrap_or_else(|p| p.into_inner());
                *n = n.saturating_sub(1);
                cv.notify_one();
            });
        }
    });
}

fn closed_loop(
    requests: &[Prepared],
    sessions: usize,
    time_scale: f64,
    send: &(dyn Fn(&Prepared) + Sync),
) {
    // Sessions in the order of their first request; a request without a
    // session is one of its own.
    let mut by_session: BTreeMap<(usize, Option<u64>), Vec<&Prepared>> = BTreeMap::new();
    let mut first_of: BTreeMap<u64, usize> = BTreeMap::new();
    for r in requests {
        let key = match r.session {
            Some(s) => (*first_of.entry(s).or_insert(r.index), Some(s)),
            None => (r.index, None),
        };
        by_session.entry(key).or_default().push(r);
    }
    let queue = Mutex::new(by_session.into_values());
    std::thread::scope(|scope| {
        for _ in 0..sessions {
            scope.spawn(|| {
                loop {
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                    let Some(session) = next else { break };
                    let mut prev: Option<f64> = None;
                    for r in session {
                        if let Some(p) = prev {
                            let think = (r.time_s - p).max(0.0) * time_scale;
                            std::thread::sleep(Duration::from_secs_f64(think));
                        }
                        prev = Some(r.time_s);
                        send(r);
                    }
                }
            });
        }
    });
}
