//! The TTFT of a request whose prefix is in G1, against how long the
//! scheduler was idle before it came: does an idle server answer its next
//! request as fast as a busy one?
//!
//! ```text
//! cargo run --release -p kvtier-engine --example idle_ttft -- \
//!     [--model DIR] [--prompt 769] [--max-tokens 16] [--gaps 0,5,50] [--rounds 15]
//! ```
//!
//! One scheduler serves the same prompt over and over (its prefix stays in
//! G1, so each request computes its last token, then decodes
//! `--max-tokens - 1` more). Before each request the client waits one of
//! `--gaps` (milliseconds), the gaps taken in turn, `--rounds` times each.
//! Prints the TTFT p50, min and max per gap. Default model: the embedded
//! `small` preset in a temporary directory.
//!
//! candle's barrier pool (the decode step's threads) keeps its workers
//! spinning for `CANDLE_BARRIER_POOL_SPIN_LIMIT` rounds after each piece of
//! work; run it with that variable set to compare (docs/benchmarks.md, "An
//! idle server's next first token").

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_engine::sampling::SamplingParams;
use kvtier_engine::scheduler::{BatchConfig, GenerateEvent, GenerateRequest, Scheduler};
use kvtier_engine::{Engine, EngineOptions, Preset, write_preset};

struct Args {
    model: Option<std::path::PathBuf>,
    prompt: usize,
    max_tokens: usize,
    gaps: Vec<u64>,
    rounds: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        model: None,
        prompt: 769,
        max_tokens: 16,
        gaps: vec![0, 5, 50],
        rounds: 15,
    };
    let mut it = std::env::args().skip(1);
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
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.prompt < 2 || a.max_tokens == 0 || a.rounds == 0 {
        return Err("--prompt must be at least 2, --max-tokens and --rounds at least 1".into());
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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: first thing in main, before any thread starts.
    unsafe { kvtier_engine::fix_cpu_threads(None) };
    kvtier_engine::tune_host_allocator();
    let a = parse()?;
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
        block_tokens: 256,
        pool_pages: (a.prompt + a.max_tokens).div_ceil(256) * 2 + 8,
        max_seq_tokens: a.prompt + a.max_tokens + 16,
        ..Default::default()
    };
    let engine = Engine::load(&dir, opts, None)?;
    let vocab = engine.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..a.prompt as u32).map(|i| (i * 31 + 7) % vocab).collect();
    let s = Scheduler::start(engine, BatchConfig::default())?;
    // The first request computes the prompt and leaves its prefix in G1.
    ttft_ms(&s, &prompt, a.max_tokens)?;
    let mut by_gap: Vec<Vec<f64>> = vec![Vec::new(); a.gaps.len()];
    for _ in 0..a.rounds {
        for (i, &gap) in a.gaps.iter().enumerate() {
            std::thread::sleep(Duration::from_millis(gap));
            by_gap[i].push(ttft_ms(&s, &prompt, a.max_tokens)?);
        }
    }
    let spin = std::env::var("CANDLE_BARRIER_POOL_SPIN_LIMIT").unwrap_or_else(|_| "unset".into());
    println!(
        "{}-token prompt, its prefix in G1, {} tokens each; CANDLE_BARRIER_POOL_SPIN_LIMIT {spin}",
        a.prompt, a.max_tokens
    );
    for (gap, mut v) in a.gaps.iter().zip(by_gap) {
        v.sort_by(f64::total_cmp);
        let (lo, mid, hi) = (v[0], v[v.len() / 2], v[v.len() - 1]);
        println!("idle {gap:>4} ms before: TTFT p50 {mid:.2} ms (min {lo:.2}, max {hi:.2})");
    }
    Ok(())
}
