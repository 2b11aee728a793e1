//! The simulator's own tests: the shape from `/metrics`, refused shapes,
//! token-granular reuse, G3 across a restart.

use kvtier_store::eviction::EvictionKind;

use super::shape::parse_labels;
use super::*;

/// The tiny preset's shape at 4-token blocks: pages of 2 x 2 x 2 x 4
/// x 16 f32, a 4 KiB slot each.
fn shape() -> ServerShape {
    ServerShape {
        block_tokens: 4,
        g1_pages: 8,
        g2_bytes: 4 * 4096,
        g3_bytes: 8 * 4096,
        block_bytes: 4096,
        g3_slots: 8,
        g3_slot_bytes: 4096,
        eviction: EvictionKind::Kvtier,
        admission_window: None,
        prefix_reuse: true,
        layerwise_restore: true,
        store: true,
        g3_sync_ms: 0,
        writeback_max_bytes: 256 << 20,
        g4: false,
    }
}

const LINE: &str = "kvtier_server_kv_cache_info{block_tokens=\"4\",g1_pages=\"8\",\
    prefix_reuse=\"true\",layerwise_restore=\"true\",store=\"true\",g2_bytes=\"16384\",\
    block_bytes=\"4096\",g3_bytes=\"32768\",g3_slots=\"8\",g3_slot_bytes=\"4096\",\
    g3_sync_ms=\"0\",eviction=\"kvtier\",admission=\"off\",admission_window=\"0\",\
    writeback_max_bytes=\"268435456\",codec=\"none\",g4=\"none\"} 1";

#[test]
fn the_shape_comes_back_from_the_servers_metrics_text() {
    let text = format!(
        "# HELP kvtier_server_kv_cache_info The KV cache tiers.\n\
         # TYPE kvtier_server_kv_cache_info gauge\n{LINE}\n\
         kvtier_server_kv_cache_infos{{a=\"b\"}} 1\nkvtier_store_hits_total{{tier=\"g2\"}} 3\n"
    );
    assert_eq!(ServerShape::from_metrics(&text), Ok(shape()));
    let sighting = LINE
        .replace("admission=\"off\"", "admission=\"second-sighting\"")
        .replace("admission_window=\"0\"", "admission_window=\"9\"");
    assert_eq!(
        ServerShape::from_metrics(&sighting).map(|s| s.admission_window),
        Ok(Some(9))
    );
    for (bad, why) in [
        (
            "kvtier_store_hits_total 1\n".to_string(),
            "no kvtier_server",
        ),
        (format!("{LINE}\n{LINE}\n"), "more than once"),
        (LINE.replace("g1_pages=\"8\",", ""), "`g1_pages`"),
        (LINE.replace("\"8\"", "\"eight\""), "not a count"),
        (LINE.replace("\"kvtier\"", "\"mru\""), "unknown eviction"),
        (LINE.replace("\"true\"", "\"yes\""), "not true or false"),
        (LINE.replace("} 1", " 1"), "malformed"),
    ] {
        let got = ServerShape::from_metrics(&bad);
        assert!(
            got.as_ref().is_err_and(|e| e.contains(why)),
            "{bad}: {got:?}"
        );
    }
    // Escapes are undone.
    let labels = parse_labels(r#"a="x\"y\\z",b="1\n"}"#).expect("labels");
    assert_eq!(labels["a"], "x\"y\\z");
    assert_eq!(labels["b"], "1\n");
}

#[test]
fn shapes_it_cannot_follow_exactly_are_refused() {
    let mut s = shape();
    s.g3_sync_ms = 1000;
    assert!(ServerSim::new(s.clone()).is_err_and(|e| e.contains("--g3-sync-ms 0")));
    s.g3_slots = 0;
    assert!(ServerSim::new(s).is_ok(), "no G3: nothing to sync");
    let mut s = shape();
    s.g4 = true;
    assert!(ServerSim::new(s).is_err());
    let mut s = shape();
    s.g1_pages = 0;
    assert!(ServerSim::new(s).is_err());
}

#[test]
fn reuse_is_token_granular_and_the_last_prompt_token_always_computed() {
    let mut sim = ServerSim::new(shape()).expect("sim");
    let p: Vec<u32> = (10..20).collect();
    assert_eq!(sim.request(&p, &[1, 2]), TierTokens::default());
    // The same prompt: all but its last token from G1 (2 full pages,
    // then its tail's one token from the finished sequence's last
    // page, which holds 3).
    let again = sim.request(&p, &[1, 2]);
    assert_eq!(
        again,
        TierTokens {
            g1: 9,
            g2: 0,
            g3: 0,
            g4: 0
        }
    );
    // A prompt sharing 5 tokens: one block by key, one token copied.
    let mut q = p[..5].to_vec();
    q.extend([99, 98, 97]);
    assert_eq!(sim.request(&q, &[3, 4]).g1, 5);
    // Generated tokens are cached: the prompt and its answer, asked
    // again, come back but for the last token.
    let mut turn = p.clone();
    turn.extend([1, 2, 50]);
    assert_eq!(sim.request(&turn, &[7, 8]).total(), 11);
    assert_eq!(sim.request(&[5], &[1]), TierTokens::default());
    assert_eq!(
        sim.try_request(&[], &[1], Ending::Length),
        Err(RequestError::EmptyPrompt)
    );
}

#[test]
fn blocks_come_back_from_g3_once_g1_and_g2_let_go_and_g3_survives_a_restart() {
    let mut sim = ServerSim::new(shape()).expect("sim");
    // Prompts of 3 blocks and a token, answered with 2 tokens, take 4
    // of the 8 G1 pages each (3 more while their store read runs): the
    // third takes the first one's; G2 holds 4 blocks of the 9 offered.
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..13).map(|i| 100 * (s + 1) + i).collect())
        .collect();
    for p in &prompts {
        assert_eq!(sim.request(p, &[1, 2]).total(), 0);
    }
    let st = sim.stats();
    assert!(st.g1_reclaimed > 0 && st.g2_evicted > 0, "{st:?}");
    assert_eq!(st.g2_blocks, 4, "{st:?}");
    assert_eq!(st.g3_blocks, 5, "{st:?}");
    let first = sim.request(&prompts[0], &[1, 2]);
    assert_eq!(
        first,
        TierTokens {
            g1: 0,
            g2: 0,
            g3: 12,
            g4: 0
        }
    );
    sim.restart();
    let st = sim.stats();
    assert_eq!((st.g1_cached_pages, st.g2_blocks), (0, 0));
    assert!(st.g3_blocks > 0, "{st:?}");
    let after = sim.request(&prompts[0], &[1, 2]);
    assert_eq!((after.g1, after.g2), (0, 0), "{after:?}");
    assert!(after.g3 > 0, "{after:?}");
}
