//! The planner's arithmetic on a worked example, and hardware files that
//! must cite a source for every figure.

use std::collections::BTreeMap;

use kvtier_energy::CostModel;
use kvtier_trace::plan::{self, Hardware, PlanModel, Tiers};
use kvtier_trace::prefix::PrefixTree;
use kvtier_trace::{Format, Request, Trace};

fn hardware() -> Hardware {
    let mut sources = BTreeMap::new();
    for k in plan::SOURCED {
        sources.insert(k.to_owned(), "the worked example".to_owned());
    }
    Hardware {
        name: "worked example".into(),
        // 2 FLOPs per parameter per token, 1 parameter: a missed token
        // takes 1 s.
        prefill_flops_per_s: 2.0,
        busy_watts: 100.0,
        g1_kv_bytes: 1,
        // 1 byte per token: a G2 token restores in 0.5 s.
        g2_read_bytes_per_s: 2.0,
        g3_read_bytes_per_s: 1.0,
        g4_read_bytes_per_s: 1.0,
        // 1 USD an hour of capex, no energy price.
        cost: CostModel {
            capex_usd: 5.0 * 8760.0,
            service_years: 5.0,
            electricity_usd_per_kwh: 0.0,
            pue: 1.0,
            other_usd_per_hour: 0.0,
        },
        sources,
    }
}

#[test]
fn a_worked_plan() {
    // One-token blocks: [1,2] at 0 s, [3] at 1 s, [1,2] at 2 s, [3] at 4 s;
    // the second half (the last two requests, 2 s apart) is measured.
    let blocks: [(&[u64], f64); 4] = [(&[1, 2], 0.0), (&[3], 1.0), (&[1, 2], 2.0), (&[3], 4.0)];
    let trace = Trace {
        name: "worked".into(),
        format: Format::Generic,
        block_size: 1,
        requests: blocks
            .iter()
            .map(|(b, t)| Request {
                time_s: *t,
                session: None,
                blocks: b.to_vec(),
                block_tokens: vec![1; b.len()],
                input_tokens: b.len() as u64,
                output_tokens: 0,
            })
            .collect(),
    };
    let tree = PrefixTree::new(&trace);
    let model = PlanModel {
        bytes_per_token: 1,
        parameters: 1,
    };
    // G1 holds one block: it never keeps [1,2] (2 cannot evict its own
    // parent) and [3] and [1] push each other out, so G1 alone hits
    // nothing. With 2 blocks of G2 (3 in all) every measured token hits,
    // from G2.
    let tiers = Tiers {
        g1_bytes: 1,
        g2_bytes: 2,
        g3_bytes: 0,
        g4_bytes: 0,
    };
    let p = plan::plan(&tree, 1, model, &hardware(), &[tiers], 0.5, 1);
    assert_eq!(p.baseline.hit_rate, 0.0);
    // Baseline: 3 missed tokens, 2 s and 1 s: p50 1.5 s; 1 s a token, 100 W:
    // 1e8 J per million tokens; 1 USD/h: 1e6 / 3600 USD per million.
    assert_eq!(p.baseline.ttft_p50_s, 1.5);
    assert_eq!(p.baseline.joules_per_million_tokens, 1e8);
    assert!((p.baseline.usd_per_million_tokens - 1e6 / 3600.0).abs() < 1e-9);
    let r = &p.rows[0];
    assert_eq!(r.hit_rate, 1.0);
    assert_eq!((r.hit_rate_by_tier.g1, r.hit_rate_by_tier.g2), (0.0, 1.0));
    // 3 tokens of 1 byte from G2 over the 2 s measured.
    assert_eq!(r.restore_bytes_per_s.g2, 1.5);
    assert_eq!(r.prefill_tokens_avoided_per_s, 1.5);
    // Restores of 1 s and 0.5 s: p50 0.75 s; 1.5 s in all against 3 s, over
    // 2 s of traffic: 2,700 accelerator-seconds saved an hour.
    assert_eq!(r.ttft_p50_s, 0.75);
    assert_eq!(r.accelerator_s_saved_per_hour, 2700.0);
    assert_eq!(r.joules_per_million_tokens, 5e7);
    assert!((r.usd_per_million_tokens - 0.5e6 / 3600.0).abs() < 1e-9);
    assert_eq!(
        (r.g3_write_bytes_per_day, r.g3_drive_writes_per_day),
        (0.0, None)
    );
    assert_eq!(p.infinite_hit_rate, 1.0);
    assert_eq!(p.smallest_within_1_point, Some(0));
}

#[test]
fn every_figure_needs_a_source() {
    let mut hw = hardware();
    hw.sources.remove("busy_watts");
    let e = hw.check().expect_err("no source");
    assert!(e.contains("busy_watts"), "{e}");
    let mut hw = hardware();
    hw.g3_read_bytes_per_s = 0.0;
    assert!(
        hw.check()
            .expect_err("zero")
            .contains("g3_read_bytes_per_s")
    );
    // The shipped files pass.
    for f in ["hardware/this-machine.toml", "hardware/h100-sxm.toml"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(f);
        Hardware::load(&path).unwrap_or_else(|e| panic!("{e}"));
    }
}
