//! What a restore does to the answers: the tokens and log probabilities
//! generated after a restore, against those of a recompute of the same
//! prompt, request by request (`kvtier bench --kv-offload-codec C`).
//!
//! Decisions:
//! * The reference is the baseline run at concurrency 1 (the whole prompt
//!   recomputed, one sequence at a time, so batch composition cannot differ);
//!   the subject is the kvtier run at concurrency 1. Run with
//!   `--kv-offload-codec none` the same numbers measure the uncoded restore
//!   itself, the floor every codec is read against.
//! * **Greedy agreement** of a request: the generated tokens equal to the
//!   reference's before the first that differs, out of those generated
//!   (after a divergence the two continue from different text, so later
//!   tokens say nothing about the KV).
//! * **Top-5 log-probability delta**: at every step before the first
//!   divergence, the largest |delta| between the two runs' k-th most
//!   likely log probabilities, k = 1..5 (rank by rank, so two tokens of
//!   near-equal probability swapping places count as the small change they
//!   are).
//! * **Margins**: the reference's gap between its two most likely tokens,
//!   median over steps, and the smallest gap at a step where a request
//!   diverged. A randomly initialised model (the embedded presets, the
//!   models the tests make with `transformers`) spreads its probability
//!   almost evenly, so its gaps are tiny and a codec's small delta can
//!   flip a near-tie: these say how near.

use serde::Serialize;

use crate::reporting::run_summary::RequestRecord;

/// Log probabilities compared per step.
pub const TOP_LOGPROBS: usize = 5;

/// Restored answers against recomputed ones (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Accuracy {
    /// Requests compared (completed in both runs).
    pub requests: usize,
    /// Requests whose generated tokens were all the reference's.
    pub identical_requests: usize,
    /// Tokens compared (the reference's, summed).
    pub tokens: usize,
    /// Least agreement of one request: tokens equal before the first
    /// difference / tokens generated.
    pub greedy_agreement_min: f64,
    /// Mean agreement over requests.
    pub greedy_agreement_mean: f64,
    /// The smallest number of agreeing leading tokens of a request, and
    /// how many it generated ("15/16").
    pub worst: String,
    /// The session of that request (the first such).
    pub worst_session: Option<usize>,
    /// Largest |delta| of a top-5 log probability before divergence.
    pub max_abs_delta_logprob_top5: f64,
    /// The reference's top-1 minus top-2 log probability, median over
    /// every step compared.
    pub reference_margin_p50: f64,
    /// That gap at the steps where a request diverged, the largest (0
    /// when none did): a codec flips only tokens this close to a tie.
    pub max_margin_at_divergence: f64,
}

/// Compares `restored` with `reference` session by session; `None` when no
/// session completed in both with tokens recorded (an endpoint target, a
/// run that failed).
pub fn compare(reference: &[RequestRecord], restored: &[RequestRecord]) -> Option<Accuracy> {
    let mut acc = Accuracy {
        greedy_agreement_min: 1.0,
        ..Default::default()
    };
    let mut sum = 0.0;
    let mut worst = (usize::MAX, 0usize, 2.0f64, None);
    let mut margins = Vec::new();
    let margin = |lp: &Vec<f32>| match lp.as_slice() {
        [a, b, ..] => Some(f64::from(a - b)),
        _ => None,
    };
    for r in reference.iter().filter(|r| r.error.is_none()) {
        let Some(s) = restored
            .iter()
            .find(|s| s.session == r.session && s.error.is_none())
        else {
            continue;
        };
        if r.tokens.is_empty() {
            continue;
        }
        let same = r
            .tokens
            .iter()
            .zip(&s.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        let n = r.tokens.len();
        let agreement = same as f64 / n as f64;
        margins.extend(r.top_logprobs.iter().filter_map(margin));
        if same < n
            && let Some(m) = r.top_logprobs.get(same).and_then(margin)
        {
            acc.max_margin_at_divergence = acc.max_margin_at_divergence.max(m);
        }
        for (a, b) in r.top_logprobs.iter().zip(&s.top_logprobs).take(same + 1) {
            for (x, y) in a.iter().zip(b) {
                acc.max_abs_delta_logprob_top5 =
                    acc.max_abs_delta_logprob_top5.max(f64::from((x - y).abs()));
            }
        }
        acc.requests += 1;
        acc.tokens += n;
        acc.identical_requests += usize::from(same == n && s.tokens.len() == n);
        sum += agreement;
        if agreement < worst.2 {
            worst = (same, n, agreement, Some(r.session));
        }
        acc.greedy_agreement_min = acc.greedy_agreement_min.min(agreement);
    }
    if acc.requests == 0 {
        return None;
    }
    acc.greedy_agreement_mean = sum / acc.requests as f64;
    acc.reference_margin_p50 = crate::reporting::stats::percentile(&margins, 50.0).unwrap_or(0.0);
    acc.worst = format!("{}/{}", worst.0, worst.1);
    acc.worst_session = worst.3;
    Some(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(session: usize, tokens: &[u32], lp: &[[f32; 2]]) -> RequestRecord {
        RequestRecord {
            session,
            tokens: tokens.to_vec(),
            top_logprobs: lp.iter().map(|l| l.to_vec()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn agreement_counts_tokens_before_the_first_difference() {
        let reference = [
            rec(0, &[1, 2, 3, 4], &[[-0.1, -2.0]; 4]),
            rec(1, &[5, 6, 7, 8], &[[-0.5, -1.0]; 4]),
            rec(2, &[9, 9], &[[-0.2, -3.0]; 2]),
        ];
        let restored = [
            // Diverges at the third token, agrees again after: 2/4.
            rec(
                0,
                &[1, 2, 9, 4],
                &[[-0.1, -2.0], [-0.15, -2.0], [-0.3, -2.5], [-9.0, -9.0]],
            ),
            rec(1, &[5, 6, 7, 8], &[[-0.5, -1.0]; 4]),
            // Session 2 failed in the restored run: not compared.
            RequestRecord {
                session: 2,
                error: Some("boom".into()),
                ..Default::default()
            },
        ];
        let a = compare(&reference, &restored).unwrap();
        assert_eq!(a.requests, 2);
        assert_eq!(a.identical_requests, 1);
        assert_eq!(a.tokens, 8);
        assert_eq!(a.worst, "2/4");
        assert_eq!(a.worst_session, Some(0));
        assert!((a.greedy_agreement_min - 0.5).abs() < 1e-12);
        assert!((a.greedy_agreement_mean - 0.75).abs() < 1e-12);
        // Steps up to and including the divergent one; not the one after.
        assert!((a.max_abs_delta_logprob_top5 - 0.5).abs() < 1e-6, "{a:?}");
        // Gaps 1.9 (session 0) and 0.5 (session 1), four steps each.
        assert!((a.reference_margin_p50 - 1.2).abs() < 1e-6, "{a:?}");
        assert!((a.max_margin_at_divergence - 1.9).abs() < 1e-6, "{a:?}");
    }

    #[test]
    fn nothing_to_compare_is_none() {
        assert_eq!(compare(&[], &[]), None);
        let no_tokens = [rec(0, &[], &[])];
        assert_eq!(compare(&no_tokens, &no_tokens), None);
    }
}
