//! [`ServerSim`] against the server it models: the shape read from a real
//! `kvtier serve`'s `/metrics` (small tiers, `--g3-sync-ms 0`), then the
//! engine and store that server runs, built the same way and driven
//! through the same scheduler, one request at a time: shared prefixes,
//! prompts that end mid-block, repeats, growing conversations, prompts of
//! a 4-token alphabet (chance matches of a few tokens), clean restarts on
//! the same cache directory. Every request's cached prompt tokens per
//! tier, and where the store holds every block seen, must be the
//! simulator's; every tier must have served hits.
//!
//! Twice, with kvtier's own policy: G2 evicting over a G3 that never has
//! to, then a G2 that keeps everything over a G3 that evicts when each
//! restart writes G2's blocks to it. Not G2 and G3 evicting at once:
//! while requests run, G3 takes G2's evictions on the store's writer
//! thread, and what it then evicts depends on that thread's timing (the
//! writer merges the jobs queued while it was busy into one batch, whose
//! blocks take their slots before any enters the policy; an offer reads
//! G3's index while a queued write may still evict from it), so the
//! server itself is not deterministic there.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_engine::serving::scheduler::{BatchConfig, GenerateEvent, GenerateRequest, Scheduler};
use kvtier_engine::{
    Engine, EngineOptions, ModelConfig, Preset, StoreOptions, TierTokens, write_preset,
};
use kvtier_server::ServeOptions;
use kvtier_store::eviction::EvictionKind;
use kvtier_store::{BlockKey, KeyChain, KvCodec, Recovery, TieredStore};
use kvtier_trace::server_sim::{BlockPlace, ServerShape, ServerSim, SimStats};

const BLOCK_TOKENS: usize = 16;
const G1_PAGES: usize = 10;
const CONTEXT: usize = 512;

/// `GET /metrics` of a server at `addr` (HTTP/1.0: the body is all that
/// follows the headers).
fn metrics(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    body.to_string()
}

/// The shape `kvtier serve --block-tokens 16 --pool-pages 10 --g2-bytes
/// (g2_blocks blocks) --g3-bytes (g3_slots slots) --g3-sync-ms 0` states
/// on its `/metrics`.
fn served_shape(model: &Path, cache: &Path, (g2_blocks, g3_slots): (u64, u64)) -> ServerShape {
    let block = ModelConfig::from_dir(model)
        .unwrap()
        .kv_layout(BLOCK_TOKENS)
        .encoded_bytes();
    let server = kvtier_server::start(ServeOptions {
        cache_dir: cache.to_path_buf(),
        port: 0,
        block_tokens: BLOCK_TOKENS,
        pool_pages: Some(G1_PAGES),
        g2_bytes: g2_blocks * block,
        g3_bytes: g3_slots * block,
        g3_sync: Duration::ZERO,
        max_seq_tokens: CONTEXT,
        ..ServeOptions::new(model)
    })
    .unwrap();
    let shape = ServerShape::from_metrics(&metrics(server.addr())).unwrap();
    server.shutdown().unwrap();
    assert_eq!(
        (
            shape.block_tokens,
            shape.g1_pages,
            shape.g3_slots,
            shape.block_bytes
        ),
        (BLOCK_TOKENS, G1_PAGES, g3_slots, block)
    );
    assert_eq!(shape.eviction, EvictionKind::Kvtier, "the default");
    assert_eq!(shape.g2_bytes, g2_blocks * block);
    assert!(shape.store && shape.prefix_reuse && shape.layerwise_restore);
    shape
}

/// The engine `kvtier serve` builds for `shape` (launch.rs: its engine
/// options and store options), on `cache`.
fn engine(model: &Path, cache: &Path, shape: &ServerShape) -> Engine {
    let opts = EngineOptions {
        block_tokens: shape.block_tokens,
        pool_pages: shape.g1_pages,
        max_seq_tokens: CONTEXT,
        prefix_reuse: shape.prefix_reuse,
        layerwise_restore: shape.layerwise_restore,
        ..Default::default()
    };
    let store = StoreOptions {
        memory_bytes: shape.g2_bytes,
        disk_dirs: vec![cache.to_path_buf()],
        disk_bytes: shape.g3_bytes,
        remote: None,
        g3_sync: Some(Duration::from_millis(shape.g3_sync_ms)),
        eviction: shape.eviction,
        codec: KvCodec::None,
    };
    Engine::load(model, opts, Some(store)).unwrap()
}

/// A running scheduler and a handle on its engine's store.
struct Served {
    scheduler: Scheduler,
    store: TieredStore,
}

impl Served {
    fn start(model: &Path, cache: &Path, shape: &ServerShape) -> Self {
        let e = engine(model, cache, shape);
        let store = e.store().unwrap().clone();
        let scheduler = Scheduler::start(e, BatchConfig::default()).unwrap();
        Self { scheduler, store }
    }

    /// One request, greedy, `max_tokens` generated whatever they are (no
    /// stop token: `ignore_eos`): what it found cached, and its tokens.
    fn request(&self, prompt: &[u32], max_tokens: usize) -> (TierTokens, Vec<u32>) {
        let (tx, rx) = mpsc::channel();
        assert!(self.scheduler.submit(GenerateRequest {
            prompt: prompt.to_vec(),
            max_tokens,
            sampling: Default::default(),
            stop_tokens: Vec::new(),
            salt: Vec::new(),
            events: tx.into(),
        }));
        let wait = Duration::from_secs(60);
        let cached = match rx.recv_timeout(wait).unwrap() {
            GenerateEvent::Started { cached, .. } => cached,
            other => panic!("{other:?}"),
        };
        let mut out = Vec::new();
        loop {
            match rx.recv_timeout(wait).unwrap() {
                GenerateEvent::Token(t) => out.push(t.token),
                GenerateEvent::Finished { .. } => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(out.len(), max_tokens);
        self.settle();
        (cached, out)
    }

    /// Waits until the scheduler has offered the request's last blocks to
    /// the store (it publishes its queues just after: idle once it has; a
    /// request of two tokens or more published itself running before its
    /// last step) and the store's G3 writer has written what G2 evicted.
    fn settle(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let q = self.scheduler.stats().snapshot();
            let idle = q.queued == 0 && q.restoring == 0 && q.running == 0;
            if idle && self.store.stats().writeback_pending == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "never idle: {q:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Where the store holds each block of `tokens` (as
    /// [`ServerSim::store_places`] counts them), under the engine's keys.
    fn store_places(&self, tokens: &[u32]) -> Vec<BlockPlace> {
        let chain = KeyChain::new(&self.store.fingerprint(), &self.store.layout(), b"");
        let full = tokens.len() / BLOCK_TOKENS * BLOCK_TOKENS;
        let mut keys = chain.keys(&tokens[..full]);
        if full < tokens.len() {
            let prev = keys.last().copied().unwrap_or_else(|| chain.seed());
            keys.push(chain.partial(&prev, &tokens[full..]));
        }
        let disk = self.store.disk().unwrap();
        let place = |k: &BlockKey| BlockPlace {
            g2: self.store.memory().contains(k),
            g3: disk.contains(k),
        };
        keys.iter().map(place).collect()
    }

    /// A clean stop, as `kvtier serve` stops on SIGTERM: the scheduler
    /// finishes, the engine and the store are dropped (G2's blocks written
    /// to G3, its index saved).
    fn stop(self) {
        let Self { scheduler, store } = self;
        let engine = scheduler.shutdown().unwrap();
        drop(engine);
        drop(store);
    }
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `n` token ids of the plain byte range (no special token).
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| 3 + self.below(253) as u32).collect()
    }

    /// `n` token ids of a 4-token alphabet: different prompts share runs
    /// of a few tokens by chance.
    fn narrow(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| 40 + self.below(4) as u32).collect()
    }
}

/// The requests: (prompt, max_tokens); a conversation's next turn is made
/// from the last answer, so the prompts are built as the answers come.
struct Workload {
    rng: Rng,
    system: Vec<u32>,
    odd_system: Vec<u32>,
    docs: Vec<Vec<u32>>,
    sessions: Vec<Vec<u32>>,
    history: Vec<Vec<u32>>,
}

impl Workload {
    fn new() -> Self {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let system = rng.tokens(2 * BLOCK_TOKENS);
        // A shared prefix that ends mid-block.
        let odd_system = rng.tokens(BLOCK_TOKENS + 5);
        let docs = (0..6)
            .map(|i| rng.tokens(BLOCK_TOKENS * (1 + i % 3)))
            .collect();
        Self {
            rng,
            system,
            odd_system,
            docs,
            sessions: vec![Vec::new(); 3],
            history: Vec::new(),
        }
    }

    /// The next prompt (at most 100 tokens, so one sequence never needs
    /// all of G1) and its `max_tokens` (2 or more: see `Served::settle`).
    fn next(&mut self, i: usize) -> (Vec<u32>, usize) {
        let r = &mut self.rng;
        let max_tokens = 2 + r.below(4);
        let kind = if i < 4 { i } else { r.below(10) };
        let mut p = match kind {
            // The system prompt, a document, a question.
            0 => {
                let doc = &self.docs[r.below(self.docs.len())];
                let mut p = self.system.clone();
                p.extend(doc);
                let q = 1 + r.below(20);
                p.extend(r.tokens(q));
                p
            }
            // A prompt of the narrow alphabet after the odd system prompt.
            1 => {
                let mut p = self.odd_system.clone();
                let n = 5 + r.below(40);
                p.extend(r.narrow(n));
                p
            }
            // A conversation's next turn: the last prompt, its answer
            // (added when it came) and a new message.
            2 | 3 => {
                let s = r.below(self.sessions.len());
                if self.sessions[s].len() > 70 {
                    self.sessions[s].clear();
                }
                let n = 3 + r.below(15);
                let msg = r.tokens(n);
                self.sessions[s].extend(msg);
                self.sessions[s].clone()
            }
            // A prompt seen a while ago, again: its tail (the tokens after
            // its last full block but its last) may come from the store.
            4 if self.history.len() > 4 => {
                let old = self.history.len() - 4;
                self.history[r.below(old)].clone()
            }
            // One of the last few prompts again, or extended: G1 then
            // holds its tail twice, in the page of the prompt that went
            // on and in the last page of the one that ended there (equal
            // runs: the later page serves it).
            8 | 9 if self.history.len() > 3 => {
                let mut p = self.history[self.history.len() - 1 - r.below(3)].clone();
                if kind == 9 {
                    let n = 1 + r.below(20);
                    p.extend(r.narrow(n));
                }
                p
            }
            // A prompt seen before, cut anywhere, maybe extended.
            5 if !self.history.is_empty() => {
                let old = &self.history[r.below(self.history.len())];
                let cut = 1 + r.below(old.len());
                let mut p = old[..cut].to_vec();
                if r.below(2) == 0 {
                    let n = 1 + r.below(10);
                    p.extend(r.narrow(n));
                }
                p
            }
            // Something new.
            _ => {
                let n = 1 + r.below(60);
                r.narrow(n.min(3)).into_iter().chain(r.tokens(n)).collect()
            }
        };
        p.truncate(100);
        self.history.push(p.clone());
        (p, max_tokens)
    }

    /// A conversation whose last turn was `prompt` takes the answer.
    fn answered(&mut self, prompt: &[u32], output: &[u32]) {
        for s in &mut self.sessions {
            if s.as_slice() == prompt {
                s.extend(output);
            }
        }
    }
}

fn hits(c: TierTokens) -> TierTokens {
    assert_eq!(c.g4, 0, "no G4");
    c
}

/// What a replay saw.
struct Replayed {
    /// Cached prompt tokens of every request, by tier.
    by_tier: TierTokens,
    /// Requests with a prompt tail from the store (fewer tokens than a
    /// block).
    store_tails: usize,
    /// G3's tokens served after the restart.
    g3_after_restart: usize,
    stats: SimStats,
}

/// Replays the workload against a server of `g2_blocks` and `g3_slots`,
/// restarted before each of `restarts`, asserting the simulator's word on
/// every request.
fn replay(g2_blocks: u64, g3_slots: u64, restarts: &[usize]) -> Replayed {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    write_preset(Preset::Tiny, 3, &model).unwrap();
    let served_cache = tmp.path().join("served-cache");
    let shape = served_shape(&model, &served_cache, (g2_blocks, g3_slots));
    let cache = tmp.path().join("cache");
    let mut sim = ServerSim::new(shape.clone()).unwrap();
    let mut served = Served::start(&model, &cache, &shape);
    let mut work = Workload::new();
    let requests = 120;
    let mut by_tier = TierTokens::default();
    // Store hits of a prompt's tail: fewer tokens than a block.
    let mut store_tails = 0;
    let mut g3_after_restart = 0;
    for i in 0..requests {
        if restarts.contains(&i) {
            served.stop();
            sim.restart();
            served = Served::start(&model, &cache, &shape);
            let disk = served.store.disk().unwrap();
            assert!(
                matches!(disk.recovery(), Recovery::Saved { .. }),
                "{:?}",
                disk.recovery()
            );
        }
        let (prompt, max_tokens) = work.next(i);
        let (cached, output) = served.request(&prompt, max_tokens);
        work.answered(&prompt, &output);
        let got = hits(cached);
        let want = sim.request(&prompt, &output);
        assert_eq!(
            got,
            want,
            "request {i}: {} prompt tokens {prompt:?}, answered {output:?}",
            prompt.len()
        );
        // What each tier holds afterwards, too.
        let st: SimStats = sim.stats();
        let real = served.store.stats();
        let g1_cached = served.scheduler.stats().snapshot().g1_cached;
        assert_eq!(
            (g1_cached, real.g2_blocks, real.g3_blocks),
            (st.g1_cached_pages, st.g2_blocks, st.g3_blocks),
            "after request {i}: G1 cached pages, G2 blocks, G3 blocks"
        );
        // Block by block, for every prompt so far (as its tail is stored:
        // without its last token).
        for p in &work.history {
            let reused = &p[..p.len() - 1];
            assert_eq!(
                served.store_places(reused),
                sim.store_places(reused),
                "after request {i}: where the store holds the blocks of {reused:?}"
            );
        }
        by_tier.g1 += got.g1;
        by_tier.g2 += got.g2;
        by_tier.g3 += got.g3;
        if !(got.g2 + got.g3).is_multiple_of(BLOCK_TOKENS) {
            store_tails += 1;
        }
        if restarts.first().is_some_and(|&r| i >= r) {
            g3_after_restart += got.g3;
        }
    }
    served.stop();
    let stats = sim.stats();
    assert_eq!((stats.failed, stats.writeback_dropped), (0, 0), "{stats:?}");
    Replayed {
        by_tier,
        store_tails,
        g3_after_restart,
        stats,
    }
}

#[test]
fn every_request_is_predicted_with_g2_evicting_over_a_g3_that_keeps_all() {
    let r = replay(16, 512, &[70]);
    let (t, st) = (r.by_tier, r.stats);
    // The comparison meant something: every tier served prompts, prompt
    // tails among them, G3 across the restart; G1 and G2 ran out of room.
    assert!(t.g1 > 0 && t.g2 > 0 && t.g3 > 0, "{t:?}");
    assert!(r.store_tails > 0 && r.g3_after_restart > 0, "{st:?}");
    assert!(st.g1_reclaimed > 0 && st.g2_evicted > 0, "{st:?}");
    assert_eq!(st.g3_evicted, 0, "{st:?}");
}

#[test]
fn every_request_is_predicted_with_g3_evicting_as_restarts_fill_it() {
    // G2 keeps every block between restarts; each restart writes those G3
    // lacks to its 40 slots, evicting by what was read since the last.
    let r = replay(512, 40, &[25, 50, 75, 100]);
    let (t, st) = (r.by_tier, r.stats);
    assert!(t.g1 > 0 && t.g2 > 0 && t.g3 > 0, "{t:?}");
    assert!(r.store_tails > 0 && r.g3_after_restart > 0, "{st:?}");
    assert!(st.g1_reclaimed > 0 && st.g3_evicted > 0, "{st:?}");
    assert_eq!(st.g2_evicted, 0, "{st:?}");
    assert_eq!(st.g3_evicted_at_restart, st.g3_evicted, "{st:?}");
}
