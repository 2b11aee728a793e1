//! `kvtier trace sim`: a trace through tier policies at several
//! capacities.
//!
//! The online policies are kvtier-store's own types ([`EvictionKind`]),
//! driven through the store's [`Eviction`] trait with a block as weight 1;
//! the optimum is [`crate::belady`]. Per request, as the engine and the
//! vLLM connector look up: the blocks hit while every earlier block of the
//! request hit (the prefix rule), and each of those is a touch; then the
//! request's missing blocks are inserted in order, each under its parent,
//! until one cannot be (its parent is gone, or the policy refuses it).
//! Hit rates count the requests after the warm-up fraction (0.5 by
//! default: the published curves measure the second half).

use std::collections::BTreeMap;

use kvtier_store::admission::SecondSighting;
use kvtier_store::eviction::{Eviction, EvictionKind};
use serde::Serialize;

use crate::prefix::{Hits, PrefixTree, ROOT, look_up};

/// A policy the simulator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SimPolicy {
    /// One of the store's online policies.
    Online(EvictionKind),
    /// Belady with bypass, the offline optimum.
    Belady,
}

impl SimPolicy {
    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Online(k) => k.as_str(),
            Self::Belady => "belady",
        }
    }

    /// The simulator's policies, by name (`lru`, `fifo`, `s3fifo`, `clock`,
    /// `kvtier`, `belady`).
    pub fn parse(s: &str) -> Result<SimPolicy, String> {
        if s.trim() == "belady" {
            return Ok(Self::Belady);
        }
        Ok(Self::Online(s.parse()?))
    }
}

/// A cache size as asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Capacity {
    /// A share of the trace's distinct blocks, in percent.
    Percent(f64),
    /// A number of blocks.
    Blocks(u64),
}

impl Capacity {
    /// Parses `5%` or `1200`.
    pub fn parse(s: &str) -> Result<Capacity, String> {
        let s = s.trim();
        if let Some(p) = s.strip_suffix('%') {
            let p: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("bad capacity {s:?}"))?;
            if !(p > 0.0 && p <= 1000.0) {
                return Err(format!(
                    "capacity {s:?} must be above 0 % and at most 1000 %"
                ));
            }
            return Ok(Self::Percent(p));
        }
        match s.parse::<u64>() {
            Ok(b) if b > 0 => Ok(Self::Blocks(b)),
            _ => Err(format!(
                "bad capacity {s:?}: a number of blocks or a percentage like 5%"
            )),
        }
    }

    /// In blocks, for a trace of `unique` distinct blocks (at least 1).
    pub fn blocks(self, unique: usize) -> u64 {
        match self {
            Self::Percent(p) => ((unique as f64 * p / 100.0).round() as u64).max(1),
            Self::Blocks(b) => b,
        }
    }
}

/// What one run of one policy at one capacity gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Hits over the measured requests.
    pub hits: Hits,
    /// Blocks written into the tier (over the whole trace).
    pub writes: u64,
    /// True when the tier was full before the measured part began (when
    /// false, a warm-up too short for this capacity: the published curves
    /// leave such points out).
    pub filled_before_measurement: bool,
    /// Hit tokens of each measured request, in order.
    pub request_hits: Vec<u32>,
}

/// Runs an online policy (any [`Eviction`]) at `capacity` blocks.
pub fn run_online(tree: &PrefixTree, policy: &mut dyn Eviction<u32>, from: usize) -> Outcome {
    run_admitted(tree, policy, None, from)
}

/// [`run_online`] behind G3's admission filter (the store's
/// [`SecondSighting`]): every block of a request is a sighting, and a block
/// is stored only once it was seen twice within the filter's window.
pub fn run_admitted(
    tree: &PrefixTree,
    policy: &mut dyn Eviction<u32>,
    mut admission: Option<SecondSighting<u32>>,
    from: usize,
) -> Outcome {
    let capacity = policy.capacity();
    let mut hits = Hits::default();
    let mut request_hits = Vec::new();
    let (mut writes, mut filled) = (0u64, false);
    for (i, r) in tree.requests.iter().enumerate() {
        let got = look_up(tree, r.clone(), i >= from, &mut hits, |e, alive| {
            let n = tree.node[e];
            let hit = policy.contains(&n);
            if alive && hit {
                policy.touch(&n);
            }
            hit
        });
        if let Some(a) = admission.as_mut() {
            for e in r.clone() {
                a.record(&tree.node[e]);
            }
        }
        for e in r.clone() {
            let n = tree.node[e];
            if policy.contains(&n) {
                continue;
            }
            let parent = tree.parent[n as usize];
            if parent != ROOT && !policy.contains(&parent) {
                break;
            }
            if admission.as_ref().is_some_and(|a| !a.admits(&n)) {
                break;
            }
            let evicted = policy.insert(n, 1, (parent != ROOT).then_some(&parent));
            if evicted.contains(&n) {
                break;
            }
            writes += 1;
            filled |= policy.used() >= capacity && i < from;
        }
        if i >= from {
            request_hits.push(got as u32);
        }
    }
    Outcome {
        hits,
        writes,
        filled_before_measurement: filled,
        request_hits,
    }
}

/// Runs `policy` at `capacity` blocks.
pub fn run(tree: &PrefixTree, policy: SimPolicy, capacity: u64, from: usize) -> Outcome {
    run_with(tree, policy, capacity, from, None)
}

/// [`run`], the online policies behind an admission filter of
/// `admission_window` keys when given (the optimum needs none: it bypasses
/// on its own).
pub fn run_with(
    tree: &PrefixTree,
    policy: SimPolicy,
    capacity: u64,
    from: usize,
    admission_window: Option<usize>,
) -> Outcome {
    match policy {
        SimPolicy::Belady => crate::belady::run(tree, capacity, from),
        SimPolicy::Online(k) => {
            let mut p = k.build::<u32>(capacity);
            run_admitted(
                tree,
                p.as_mut(),
                admission_window.map(SecondSighting::new),
                from,
            )
        }
    }
}

/// One point of the JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// The policy's name.
    pub policy: String,
    /// The capacity in blocks.
    pub capacity_blocks: u64,
    /// Hit tokens over the measured tokens.
    pub hit_rate_tokens: f64,
    /// Hit blocks over the measured blocks.
    pub hit_rate_blocks: f64,
    /// Blocks written into the tier (as G3, its writes): the SSD wear.
    pub g3_write_blocks: u64,
    /// Whether the tier was full before the measured part began.
    pub filled_before_measurement: bool,
}

/// Every policy at every capacity, on as many threads as `threads`, the
/// online ones behind an admission filter of `admission_window` keys when
/// given.
pub fn sweep(
    tree: &PrefixTree,
    policies: &[SimPolicy],
    capacities: &[u64],
    warmup: f64,
    threads: usize,
    admission_window: Option<usize>,
) -> Vec<Point> {
    let from = tree.measured_from(warmup);
    let jobs: Vec<(SimPolicy, u64)> = capacities
        .iter()
        .flat_map(|&c| policies.iter().map(move |&p| (p, c)))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut results: Vec<(usize, Point)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let j = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(p, c)) = jobs.get(j) else { break };
                        let o = run_with(tree, p, c, from, admission_window);
                        mine.push((
                            j,
                            Point {
                                policy: p.name().to_owned(),
                                capacity_blocks: c,
                                hit_rate_tokens: o.hits.token_rate(),
                                hit_rate_blocks: o.hits.block_rate(),
                                g3_write_blocks: o.writes,
                                filled_before_measurement: o.filled_before_measurement,
                            },
                        ));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    });
    results.sort_by_key(|(j, _)| *j);
    results.into_iter().map(|(_, p)| p).collect()
}

/// (kvtier - lru) / (belady - lru) per capacity (in blocks), where the
/// optimum is above LRU.
pub fn gap_closed(points: &[Point]) -> BTreeMap<String, f64> {
    let at = |policy: &str, c: u64| {
        points
            .iter()
            .find(|p| p.policy == policy && p.capacity_blocks == c)
            .map(|p| p.hit_rate_tokens)
    };
    let mut out = BTreeMap::new();
    for p in points.iter().filter(|p| p.policy == "kvtier") {
        let c = p.capacity_blocks;
        if let (Some(k), Some(l), Some(b)) = (at("kvtier", c), at("lru", c), at("belady", c))
            && b - l > 1e-12
        {
            out.insert(c.to_string(), (k - l) / (b - l));
        }
    }
    out
}

/// The points as the text table of `kvtier trace sim`: a row per
/// capacity, a column per policy (token hit rate, %), the mean over
/// capacities and the share of the LRU-to-optimum gap kvtier closes.
pub fn text(
    points: &[Point],
    unique: usize,
    bytes_per_block: Option<u64>,
    gap: &BTreeMap<String, f64>,
) -> String {
    let mut policies: Vec<&str> = Vec::new();
    let mut capacities: Vec<u64> = Vec::new();
    for p in points {
        if !policies.contains(&p.policy.as_str()) {
            policies.push(&p.policy);
        }
        if !capacities.contains(&p.capacity_blocks) {
            capacities.push(p.capacity_blocks);
        }
    }
    let mut out = format!("{:>10} {:>8} {:>10}", "blocks", "% uniq", "bytes");
    for p in &policies {
        out += &format!(" {p:>8}");
    }
    out += &format!(" {:>10}\n", "gap closed");
    let at = |policy: &str, c: u64| {
        points
            .iter()
            .find(|p| p.policy == policy && p.capacity_blocks == c)
    };
    for &c in &capacities {
        let bytes = bytes_per_block.map_or("-".to_owned(), |b| human_bytes(b.saturating_mul(c)));
        out += &format!(
            "{c:>10} {:>8.2} {bytes:>10}",
            c as f64 * 100.0 / unique.max(1) as f64
        );
        for p in &policies {
            match at(p, c) {
                Some(pt) => {
                    let mark = if pt.filled_before_measurement {
                        ' '
                    } else {
                        '*'
                    };
                    out += &format!(" {:>7.2}{mark}", pt.hit_rate_tokens * 100.0);
                }
                None => out += &format!(" {:>8}", "-"),
            }
        }
        match gap.get(&c.to_string()) {
            Some(g) => out += &format!(" {:>9.1}%\n", g * 100.0),
            None => out += &format!(" {:>10}\n", "-"),
        }
    }
    out += &format!("{:>10} {:>8} {:>10}", "mean", "", "");
    for p in &policies {
        let v: Vec<f64> = points
            .iter()
            .filter(|x| x.policy == *p)
            .map(|x| x.hit_rate_tokens)
            .collect();
        out += &format!(
            " {:>7.2} ",
            v.iter().sum::<f64>() * 100.0 / v.len().max(1) as f64
        );
    }
    out += "\n(token hit rates, %, over the measured requests; * the tier was not full before the measured part)\n";
    out
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1}{}", UNITS[u])
}
