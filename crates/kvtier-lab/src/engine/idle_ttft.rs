//! The TTFT of a request whose prefix is in G1, against what the machine
//! does around it: how long the scheduler was idle before it came (does an
//! idle server answer its next request as fast as a busy one?), and what
//! other CPU work runs beside its forward pass (what a restore's own work
//! costs a forward pass that already uses every core).
//!
//! ```text
//! cargo run --release -p kvtier-lab -- idle_ttft \
//!     [--model DIR] [--prompt 769] [--max-tokens 16] [--gaps 0,5,50] [--rounds 15]
//!     [--beside none,decode,copy,spin]
//! ```
//!
//! One scheduler serves the same prompt over and over (its prefix stays in
//! G1, so each request computes its last token, then decodes
//! `--max-tokens - 1` more). Before each request the client waits one of
//! `--gaps` (milliseconds); as it sends the request, another thread starts
//! one of `--beside`:
//!
//! * `none`: nothing;
//! * `decode`: kvtier's int8 decode of the prompt's whole blocks, in the
//!   model's block layout, into f32: what restoring them decodes into G1
//!   (3 MiB into 12 MiB for the `small` preset's 768 tokens);
//! * `copy`: a copy of the same f32 bytes (that restore, uncoded);
//! * `spin`: arithmetic with no memory traffic, for as long as `decode`
//!   took alone (its median over a warm-up).
//!
//! Every (gap, beside) pair is taken in turn, `--rounds` times each. Prints
//! the TTFT p50, min and max per pair, and the side work's own time. Default
//! model: the embedded `small` preset in a temporary directory.
//!
//! The decode step's pool (kvtier-engine's `compute/parallel.rs`) keeps its
//! workers spinning for `SPIN_LIMIT` rounds after each part before they park;
//! change it there to compare (candle's barrier pool, which the engine used
//! before, takes the same limit from `CANDLE_BARRIER_POOL_SPIN_LIMIT`;
//! docs/decisions.md, "kvtier's own pool for the decode step's parts").

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_bench::reporting::stats::median;
use kvtier_engine::serving::sampling::SamplingParams;
use kvtier_engine::serving::scheduler::{BatchConfig, GenerateEvent, GenerateRequest, Scheduler};
use kvtier_engine::{Engine, EngineOptions, Preset, write_preset};
use kvtier_store::{KvCodec, KvLayout};

struct Args {
    model: Option<std::path::PathBuf>,
    prompt: usize,
    max_tokens: usize,
    gaps: Vec<u64>,
    rounds: usize,
    beside: Vec<Beside>,
}

/// Work another thread does while a request's forward pass runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Beside {
    None,
    Decode,
    Copy,
    Spin,
}

impl Beside {
    fn parse(name: &str) -> Result<Self, String> {
        Ok(match name.trim() {
            "none" => Beside::None,
            "decode" => Beside::Decode,
            "copy" => Beside::Copy,
            "spin" => Beside::Spin,
            other => {
                return Err(format!(
                    "--beside: expected none, decode, copy or spin, not {other:?}"
                ));
            }
        })
    }
}

/// The blocks side work decodes or copies, and how long `spin` runs.
struct SideWork {
    /// The model's block layout, coded int8.
    layout: KvLayout,
    coded: Vec<u8>,
    plain: Vec<u8>,
    out: Vec<u8>,
    spin: Duration,
}

impl SideWork {
    /// `blocks` blocks of `layout` (the engine's, uncoded), made up and
    /// coded int8.
    fn new(layout: KvLayout, blocks: usize) -> Result<Self, String> {
        let layout = layout.with_codec(KvCodec::Int8);
        let (logical, stored) = block_bytes(&layout);
        let values: Vec<f32> = (0..blocks * logical / 4)
            .map(|i| ((i * 37 % 1001) as f32 - 500.0) / 97.0)
            .collect();
        let plain: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        let mut coded = vec![0u8; blocks * stored];
        for (src, dst) in plain
            .chunks_exact(logical)
            .zip(coded.chunks_exact_mut(stored))
        {
            layout.encode_into(0, src, dst).map_err(|e| e.to_string())?;
        }
        let mut w = SideWork {
            layout,
            coded,
            out: vec![0u8; plain.len()],
            plain,
            spin: Duration::ZERO,
        };
        let took: Vec<f64> = (0..9)
            .map(|_| w.run(Beside::Decode).map(|d| d.as_secs_f64()))
            .collect::<Result<_, _>>()?;
        w.spin = Duration::from_secs_f64(median(&took));
        Ok(w)
    }

    /// Does `what` once; how long it took.
    fn run(&mut self, what: Beside) -> Result<Duration, String> {
        let t = Instant::now();
        match what {
            Beside::None => {}
            Beside::Decode => {
                let (logical, stored) = block_bytes(&self.layout);
                for (src, dst) in self
                    .coded
                    .chunks_exact(stored)
                    .zip(self.out.chunks_exact_mut(logical))
                {
                    self.layout
                        .decode_into(src, 0, dst)
                        .map_err(|e| e.to_string())?;
                }
            }
            Beside::Copy => self.out.copy_from_slice(&self.plain),
            Beside::Spin => {
                let mut x = 1u64;
                while t.elapsed() < self.spin {
                    for _ in 0..64 {
                        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    }
                }
                std::hint::black_box(x);
            }
        }
        std::hint::black_box(&self.out);
        Ok(t.elapsed())
    }
}

/// (logical, stored) payload bytes of one block of `layout`.
fn block_bytes(layout: &KvLayout) -> (usize, usize) {
    (
        layout.payload_bytes() as usize,
        layout.stored_payload_bytes() as usize,
    )
}

/// Tokens per KV block (and G1 page), as the bench's engine uses.
const BLOCK_TOKENS: usize = 256;

fn parse(args: Vec<String>) -> Result<Args, String> {
    let mut a = Args {
        model: None,
        prompt: 769,
        max_tokens: 16,
        gaps: vec![0, 5, 50],
        rounds: 15,
        beside: vec![Beside::None],
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String| v.trim().parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--model" => a.model = Some(value()?.into()),
            "--prompt" => a.prompt = number(value()?)? as usize,
            "--max-tokens" => a.max_tokens = number(value()?)? as usize,
            "--rounds" => a.rounds = number(value()?)? as usize,
            "--gaps" => {
                a.gaps = value()?
                    .split(',')
                    .map(|g| number(g.to_string()))
                    .collect::<Result<_, _>>()?
            }
            "--beside" => {
                a.beside = value()?
                    .split(',')
                    .map(Beside::parse)
                    .collect::<Result<_, _>>()?
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.prompt < 2
        || a.max_tokens == 0
        || a.rounds == 0
        || a.gaps.is_empty()
        || a.beside.is_empty()
    {
        return Err("--prompt must be at least 2, --max-tokens and --rounds at least 1, --gaps and --beside not empty".into());
    }
    Ok(a)
}

/// Sends `prompt` and waits for the request to finish; its TTFT in
/// milliseconds.
fn ttft_ms(s: &Scheduler, prompt: &[u32], max_tokens: usize) -> Result<f64, String> {
    let (tx, rx) = mpsc::channel();
    let t0 = Instant::now();
    let sent = s.submit(GenerateRequest {
        salt: Vec::new(),
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        events: tx.into(),
    });
    if !sent {
        return Err("the scheduler stopped".into());
    }
    let mut first = None;
    loop {
        match rx.recv_timeout(Duration::from_secs(600)) {
            Ok(GenerateEvent::Token(_)) => {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64() * 1e3);
            }
            Ok(GenerateEvent::Finished { .. }) => {
                return first.ok_or_else(|| "finished without a token".into());
            }
            Ok(GenerateEvent::Failed(e)) => return Err(e),
            Ok(GenerateEvent::Started { .. }) => {}
            Err(e) => return Err(format!("no answer: {e}")),
        }
    }
}

/// Runs the experiment: `args` are its flags.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn std::error::Error>> {
    let a = parse(args)?;
    let tmp = tempfile::tempdir()?;
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => {
            let d = tmp.path().join("small");
            write_preset(Preset::Small, 0, &d)?;
            d
        }
    };
    let opts = EngineOptions {
        block_tokens: BLOCK_TOKENS,
        pool_pages: (a.prompt + a.max_tokens).div_ceil(BLOCK_TOKENS) * 2 + 8,
        max_seq_tokens: a.prompt + a.max_tokens + 16,
        ..Default::default()
    };
    let engine = Engine::load(&dir, opts, None)?;
    let vocab = engine.config().vocab_size as u32;
    let layout = engine.config().kv_layout(BLOCK_TOKENS);
    let prompt: Vec<u32> = (0..a.prompt as u32).map(|i| (i * 31 + 7) % vocab).collect();
    let s = Scheduler::start(engine, BatchConfig::default())?;
    // The first request computes the prompt and leaves its prefix in G1.
    ttft_ms(&s, &prompt, a.max_tokens)?;
    let mut side = SideWork::new(layout, a.prompt / BLOCK_TOKENS)?;
    let (spin, coded_mb, plain_mb) = (
        side.spin,
        side.coded.len() as f64 / 1e6,
        side.plain.len() as f64 / 1e6,
    );
    let (go, todo) = mpsc::channel::<Beside>();
    let (done, took) = mpsc::channel::<Result<Duration, String>>();
    let worker = std::thread::spawn(move || {
        while let Ok(what) = todo.recv() {
            if done.send(side.run(what)).is_err() {
                break;
            }
        }
    });
    let pairs: Vec<(u64, Beside)> = a
        .gaps
        .iter()
        .flat_map(|&g| a.beside.iter().map(move |&b| (g, b)))
        .collect();
    let mut ttfts: Vec<Vec<f64>> = vec![Vec::new(); pairs.len()];
    let mut side_ms: Vec<Vec<f64>> = vec![Vec::new(); pairs.len()];
    for _ in 0..a.rounds {
        for (i, &(gap, beside)) in pairs.iter().enumerate() {
            std::thread::sleep(Duration::from_millis(gap));
            // `none` leaves the other thread asleep: waking it is work too.
            let busy = beside != Beside::None;
            if busy {
                go.send(beside)?;
            }
            ttfts[i].push(ttft_ms(&s, &prompt, a.max_tokens)?);
            side_ms[i].push(if busy {
                took.recv()??.as_secs_f64() * 1e3
            } else {
                0.0
            });
        }
    }
    drop(go);
    let _ = worker.join();
    let spin_env =
        std::env::var("CANDLE_BARRIER_POOL_SPIN_LIMIT").unwrap_or_else(|_| "unset".into());
    println!(
        "{}-token prompt, its prefix in G1, {} tokens each; CANDLE_BARRIER_POOL_SPIN_LIMIT {spin_env}; decode {coded_mb:.1} MB into {plain_mb:.1} MB; spin {:.3} ms",
        a.prompt,
        a.max_tokens,
        spin.as_secs_f64() * 1e3
    );
    for ((gap, beside), (v, w)) in pairs.iter().zip(ttfts.into_iter().zip(side_ms)) {
        let (lo, mid, hi) = spread(v);
        let (_, side_mid, _) = spread(w);
        println!(
            "idle {gap:>4} ms before, {:<6} beside: TTFT p50 {mid:.2} ms (min {lo:.2}, max {hi:.2}); side work p50 {side_mid:.3} ms",
            format!("{beside:?}").to_lowercase()
        );
    }
    Ok(())
}

/// (min, median, max) of samples (at least one).
fn spread(v: Vec<f64>) -> (f64, f64, f64) {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (min, median(&v), max)
}
