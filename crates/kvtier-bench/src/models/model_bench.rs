//! `kvtier model bench`: loads one model with every contender, cold (page
//! cache dropped, freed RAM settled, fresh destination memory) and/or with a
//! warm destination (memory touched before timing), interleaved (A B C A B
//! C ...), with the device's raw O_DIRECT read limit measured before every
//! load and the first-touch RAM rate measured once per repeat, in the same
//! run.
//!
//! Before each load: (Python: start the process), drop the page cache, wait
//! `--settle-secs`, measure the device limit (O_DIRECT reads of the shards
//! into buffers touched at the start: page cache and free memory stay as
//! they are), then time the load. Measuring the limit right after a drop,
//! without the settle, read low on a VM that hands the freed memory back
//! to its host during it.
//!
//! Contenders: `naive`, `mmap`, `kvtier` ([`rust_contenders`]) and,
//! when Python is there, `python-safetensors` and `runai-streamer`
//! ([`python_contenders`]). The report: [`loader_report`].

pub mod loader_report;
pub mod python_contenders;
pub mod rust_contenders;

use std::alloc::Layout;
use std::path::PathBuf;
use std::sync::Arc;

use crate::bench_error::{BenchError, Result, StepContext, fail};
use kvtier_io::loader::{LoadStats, LoaderConfig, model_shards};
use kvtier_io::safetensors::read_header;
use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator, IoEngine, align_up, system_allocator};

use kvtier_io::recycle::RecyclingAllocator;

use crate::common::progress::progress_bar;
use crate::machine::device_limit::{DeviceLimit, limit_file_bytes};
use crate::machine::host::{CacheDrops, first_touch_gbps, settle};
use crate::machine::run_dirs::RunDirs;
use crate::models::model_load::check_model_dir;
use crate::reporting::stats::{fraction, median, paired_fraction};
use loader_report::{KvtierIo, LoaderReport, ModelBenchReport, Skipped};
use python_contenders::{PyLoader, Python};
use rust_contenders::{self as lc, Loaded, NaivePool};

/// Which destination-memory states the model bench measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadModes {
    /// Page cache dropped, freed RAM settled, fresh destination memory.
    #[default]
    Cold,
    /// Page cache dropped, destination memory touched before timing.
    Warm,
    /// Both, cold first.
    Both,
}

/// What the model bench measures (`kvtier model bench`).
#[derive(Debug, Clone)]
pub struct ModelBenchOptions {
    /// Model directory (as for [`crate::models::model_load`]).
    pub dir: PathBuf,
    /// Times to run every contender; the median is reported.
    pub repeat: u32,
    /// Cold, warm, or both.
    pub modes: LoadModes,
    /// Seconds to wait after dropping the page cache (and freeing the last
    /// contender's memory) before each load.
    pub settle_secs: f64,
    /// Run only these contenders (by name) (default, empty: all).
    pub only: Vec<String>,
    /// Run the Python contenders when Python is there.
    pub python_contenders: bool,
    /// pip-install missing Python packages (else their contenders are
    /// skipped).
    pub install_python_packages: bool,
    /// The Python interpreter.
    pub python: PathBuf,
    /// Directory for the Python helper script and its logs (a
    /// `kvtier-bench-<pid>` subdirectory, removed at the end) [default: the
    /// model directory].
    pub scratch: Option<PathBuf>,
    /// How the kvtier contender reads.
    pub loader: LoaderConfig,
    /// Bytes per read of the device-limit measurement.
    pub limit_io_bytes: u64,
    /// Bytes of each device-limit sample [default: the model's size, at
    /// most 1 GiB].
    pub limit_bytes: Option<u64>,
    /// Show a progress bar and status lines on stderr.
    pub progress: bool,
}

impl ModelBenchOptions {
    /// `kvtier model bench`'s defaults for the model in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            repeat: 3,
            modes: LoadModes::Cold,
            settle_secs: 6.0,
            only: Vec::new(),
            python_contenders: true,
            install_python_packages: true,
            python: PathBuf::from("python3"),
            scratch: None,
            loader: LoaderConfig::default(),
            limit_io_bytes: 16 << 20,
            limit_bytes: None,
            progress: true,
        }
    }
}

/// Largest first-touch sample.
const MAX_FIRST_TOUCH_BYTES: u64 = 1 << 30;

/// A contender of the bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    Naive,
    Mmap,
    Kvtier,
    Py(PyLoader),
}

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Naive => "naive",
            Contender::Mmap => "mmap",
            Contender::Kvtier => "kvtier",
            Contender::Py(p) => p.name(),
        }
    }
}

/// Destination memory for the warm mode, touched before timing.
struct WarmPools {
    naive: NaivePool,
    kvtier: Arc<RecyclingAllocator>,
}

impl WarmPools {
    fn new(paths: &[PathBuf], lens: &[u64]) -> Result<Self> {
        let naive = NaivePool::new(paths)?;
        let mut pool = RecyclingAllocator::new(lens.len());
        for &len in lens {
            let cap = align_up(usize::try_from(len)?, DIRECT_IO_ALIGN);
            let layout = Layout::from_size_align(cap, DIRECT_IO_ALIGN)?;
            if !pool.reserve(layout, 1) {
                fail!("out of memory reserving the warm kvtier buffers");
            }
        }
        Ok(Self {
            naive,
            kvtier: Arc::new(pool),
        })
    }
}

/// Samples of one contender in one mode.
#[derive(Debug, Default, Clone)]
struct Samples {
    gbps: Vec<f64>,
    /// Index of the device-limit sample taken just before each load.
    limit_pos: Vec<usize>,
    /// Why it stopped running, if it did.
    failed: Option<String>,
}

/// True when `path` can be read with O_DIRECT (one aligned read).
fn direct_read_works(path: &std::path::Path) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(f) = kvtier_io::direct::open_read(path, true) else {
        return false;
    };
    AlignedBuf::zeroed(DIRECT_IO_ALIGN, DIRECT_IO_ALIGN)
        .ok()
        .is_some_and(|mut b| f.read_at(&mut b, 0).is_ok())
}

fn mode_name(warm: bool) -> &'static str {
    if warm { "warm" } else { "cold" }
}

/// Runs the bench and returns its report.
pub fn run_model_bench(opts: &ModelBenchOptions) -> Result<ModelBenchReport> {
    let dir = &opts.dir;
    check_model_dir(dir)?;
    let paths =
        model_shards(dir).with_step(|| format!("cannot load the model in {}", dir.display()))?;
    // Every header validated before anything is timed: a corrupt shard is
    // a clear error, not a failure half-way through the bench.
    let mut lens = Vec::with_capacity(paths.len());
    for p in &paths {
        let h = read_header(p).with_step(|| format!("invalid model in {}", dir.display()))?;
        lens.push(h.file_len());
    }
    let bytes: u64 = lens.iter().sum();
    let limit_bytes = opts.limit_bytes.unwrap_or_else(|| limit_file_bytes(bytes));
    let scratch = opts.scratch.clone().unwrap_or_else(|| dir.clone());
    let run_dirs = RunDirs::create(std::slice::from_ref(&scratch), 0, 0, false)?;
    let work = run_dirs.first().to_path_buf();
    let engine = IoEngine::shared();
    let quiet = !opts.progress;
    let say = |msg: &str| {
        if !quiet {
            eprintln!("{msg}");
        }
    };

    // Python contenders: ready (installed) or skipped with the reason.
    let mut skipped = Vec::new();
    let mut contenders = vec![Contender::Naive, Contender::Mmap, Contender::Kvtier];
    let python = if !opts.python_contenders {
        for p in PyLoader::ALL {
            skipped.push(Skipped {
                name: p.name().into(),
                reason: "--no-python given".into(),
            });
        }
        None
    } else {
        match Python::prepare(&opts.python, &work) {
            Err(why) => {
                for p in PyLoader::ALL {
                    skipped.push(Skipped {
                        name: p.name().into(),
                        reason: why.clone(),
                    });
                }
                None
            }
            Ok(py) => {
                for p in PyLoader::ALL {
                    say(&format!("checking Python packages for {}...", p.name()));
                    match py.ensure(p, opts.install_python_packages) {
                        Ok(()) => contenders.push(Contender::Py(p)),
                        Err(reason) => skipped.push(Skipped {
                            name: p.name().into(),
                            reason,
                        }),
                    }
                }
                Some(py)
            }
        }
    };

    if !opts.only.is_empty() {
        contenders.retain(|c| opts.only.iter().any(|n| n == c.name()));
        skipped.retain(|s| opts.only.contains(&s.name));
        if contenders.is_empty() {
            fail!("none of --only {} can run", opts.only.join(","));
        }
    }
    let direct = paths.first().is_some_and(|p| direct_read_works(p));
    let mut limit = DeviceLimit::over_files(&paths, limit_bytes, opts.limit_io_bytes, direct)?;
    let limit_bytes = limit.bytes();

    let modes: Vec<bool> = match opts.modes {
        LoadModes::Cold => vec![false],
        LoadModes::Warm => vec![true],
        LoadModes::Both => vec![false, true],
    };
    let repeats = opts.repeat as usize;
    let total_work =
        (modes.len() * repeats * contenders.len()) as u64 * (bytes + limit_bytes) + limit_bytes;
    let pb = progress_bar(total_work, quiet);
    let cfg = opts.loader.clone();
    let ft_bytes = bytes.min(MAX_FIRST_TOUCH_BYTES) as usize;

    let mut drops = CacheDrops::default();
    let mut limit_samples: Vec<f64> = Vec::new();
    let mut first_touch: Vec<f64> = Vec::new();
    let mut results: Vec<Vec<Samples>> =
        vec![vec![Samples::default(); contenders.len()]; modes.len()];
    let mut kv_stats: Option<LoadStats> = None;
    let mut tensors = 0usize;
    let mut checksum: Option<u64> = None;

    for (m, &warm) in modes.iter().enumerate() {
        let mut pools = if warm {
            pb.set_message("touching warm buffers");
            Some(WarmPools::new(&paths, &lens)?)
        } else {
            None
        };
        for rep in 0..repeats {
            for (c, &who) in contenders.iter().enumerate() {
                if results[m][c].failed.is_some() {
                    pb.inc(bytes + limit_bytes);
                    continue;
                }
                let label = format!(
                    "{} {} ({}/{})",
                    who.name(),
                    mode_name(warm),
                    rep + 1,
                    repeats
                );
                // Python: start the process (imports; warm: untimed load)
                // before the cache is dropped.
                let pending = match (who, &python) {
                    (Contender::Py(p), Some(py)) => {
                        pb.set_message(format!("{label}: starting"));
                        match py.start(p, warm, &paths) {
                            Ok(pending) => Some(pending),
                            Err(why) => {
                                results[m][c].failed = Some(why);
                                pb.inc(bytes + limit_bytes);
                                continue;
                            }
                        }
                    }
                    _ => None,
                };
                if let Some(pools) = &pools {
                    pools.kvtier.rezero();
                }
                pb.set_message(format!("{label}: settling"));
                drops.drop_or_evict(&paths);
                settle(opts.settle_secs);
                // The device limit right before the load, in the same settled
                // state (O_DIRECT into buffers touched long ago: it leaves
                // the page cache and free memory as they are).
                pb.set_message(format!("{label}: device limit"));
                limit_samples.push(limit.measure(engine)?);
                pb.inc(limit_bytes);
                pb.set_message(label);
                let loaded: Result<Loaded, String> = match who {
                    Contender::Py(_) => match pending {
                        Some(pending) => pending.go(),
                        None => Err("Python is not available".into()),
                    },
                    Contender::Naive => match pools.as_mut() {
                        Some(p) => lc::naive_warm(&paths, &mut p.naive),
                        None => lc::naive(&paths),
                    }
                    .map_err(|e| format!("{e:#}")),
                    Contender::Mmap => lc::mmap(&paths).map_err(|e| format!("{e:#}")),
                    Contender::Kvtier => {
                        let alloc: Arc<dyn HostAllocator> = match &pools {
                            Some(p) => p.kvtier.clone(),
                            None => system_allocator(),
                        };
                        lc::kvtier(&paths, &cfg, engine, &alloc)
                            .map(|(l, s)| {
                                kv_stats = Some(s);
                                l
                            })
                            .map_err(|e| format!("{e:#}"))
                    }
                };
                pb.inc(bytes);
                match loaded {
                    Ok(l) => {
                        tracing::debug!("{}: {:.3} GB/s", who.name(), l.gbps());
                        if !matches!(who, Contender::Py(_)) {
                            tensors = l.tensors;
                            match checksum {
                                None => checksum = Some(l.checksum),
                                Some(c) if c != l.checksum => fail!(
                                    "{} read different bytes than the other contenders (checksum {:#x} vs {c:#x}): did the model change during the bench?",
                                    who.name(),
                                    l.checksum
                                ),
                                Some(_) => {}
                            }
                        }
                        results[m][c].gbps.push(l.gbps());
                        results[m][c].limit_pos.push(limit_samples.len() - 1);
                    }
                    Err(why) if matches!(who, Contender::Py(_)) => {
                        results[m][c].failed = Some(why);
                    }
                    Err(why) => fail!("{} load failed: {why}", who.name()),
                }
            }
            pb.set_message("first touch");
            settle(opts.settle_secs);
            first_touch.push(first_touch_gbps(ft_bytes).map_err(BenchError::Failed)?);
        }
        drop(pools);
    }
    pb.set_message("device limit");
    drops.drop_or_evict(&paths);
    settle(opts.settle_secs);
    limit_samples.push(limit.measure(engine)?);
    pb.inc(limit_bytes);
    pb.finish_and_clear();

    let report = build_report(
        opts,
        &modes,
        &contenders,
        &results,
        skipped,
        limit_samples,
        first_touch,
        kv_stats,
        Facts {
            bytes,
            shards: paths.len(),
            tensors,
            limit_bytes,
            limit_io_bytes: limit.io_bytes(),
            drops: &drops,
        },
    );
    drop(run_dirs);
    Ok(report)
}

struct Facts<'a> {
    bytes: u64,
    shards: usize,
    tensors: usize,
    limit_bytes: u64,
    limit_io_bytes: u64,
    drops: &'a CacheDrops,
}

#[allow(clippy::too_many_arguments)]
fn build_report(
    opts: &ModelBenchOptions,
    modes: &[bool],
    contenders: &[Contender],
    results: &[Vec<Samples>],
    mut skipped: Vec<Skipped>,
    limit_samples: Vec<f64>,
    first_touch: Vec<f64>,
    kv_stats: Option<LoadStats>,
    facts: Facts<'_>,
) -> ModelBenchReport {
    let device_limit_gbps = median(&limit_samples);
    let first_touch_gbps = median(&first_touch);
    let mut per_mode: Vec<Vec<LoaderReport>> = Vec::new();
    for (m, &warm) in modes.iter().enumerate() {
        let gbps_of = |who: Contender| {
            contenders
                .iter()
                .position(|&c| c == who)
                .map(|c| &results[m][c])
                .filter(|s| s.failed.is_none() && !s.gbps.is_empty())
                .map(|s| median(&s.gbps))
        };
        let naive = gbps_of(Contender::Naive);
        let runai = gbps_of(Contender::Py(PyLoader::Runai));
        let mut out = Vec::new();
        for (c, &who) in contenders.iter().enumerate() {
            let s = &results[m][c];
            if let Some(why) = &s.failed {
                skipped.push(Skipped {
                    name: who.name().into(),
                    reason: format!("failed ({} mode): {why}", mode_name(warm)),
                });
                continue;
            }
            if s.gbps.is_empty() {
                continue;
            }
            let gbps = median(&s.gbps);
            let div = |d: Option<f64>| d.filter(|&d| d > 0.0).map(|d| gbps / d);
            let note = match (who, warm) {
                (Contender::Mmap, true) => Some(
                    "the page cache is its destination: no warm form exists, measured as cold"
                        .into(),
                ),
                (Contender::Naive, true) => Some(
                    "pre-touched Vec per shard, read_exact through the page cache (cache pages still fresh)"
                        .into(),
                ),
                (Contender::Kvtier, true) => {
                    Some("buffers from a pool touched and zeroed before timing".into())
                }
                (Contender::Py(_), true) => Some(
                    "one untimed load first in the same process, glibc keeping freed memory (MALLOC_MMAP_MAX_=0)"
                        .into(),
                ),
                _ => None,
            };
            out.push(LoaderReport {
                name: who.name().into(),
                gbps,
                mode: mode_name(warm).into(),
                samples_gbps: s.gbps.clone(),
                fraction_of_limit: fraction(gbps, device_limit_gbps),
                paired_fraction: paired_fraction(&s.gbps, &s.limit_pos, &limit_samples),
                fraction_of_first_touch: fraction(gbps, first_touch_gbps),
                ratio_vs_naive: div(naive),
                ratio_vs_runai: div(runai),
                note,
            });
        }
        per_mode.push(out);
    }
    let mut per_mode = per_mode.into_iter();
    let loaders = per_mode.next().unwrap_or_default();
    let warm_loaders = per_mode.next().unwrap_or_default();
    let cfg = opts.loader.clone();
    let kvtier_io = KvtierIo {
        direct: kv_stats.as_ref().is_some_and(|s| s.direct),
        buffered_reason: kv_stats.as_ref().and_then(|s| s.buffered_reason.clone()),
        io_backend: kv_stats.as_ref().map_or_else(
            || IoEngine::shared().backend().name().to_string(),
            |s| s.io_backend.to_string(),
        ),
        chunk_bytes: cfg.chunk_bytes as u64,
        in_flight: cfg.in_flight as u32,
    };
    ModelBenchReport {
        device_limit_gbps,
        bytes: facts.bytes,
        loaders,
        warm_loaders,
        skipped,
        modes: modes.iter().map(|&w| mode_name(w).to_string()).collect(),
        device_limit_samples_gbps: limit_samples,
        first_touch_gbps,
        first_touch_samples_gbps: first_touch,
        dir: opts.dir.display().to_string(),
        shards: facts.shards,
        tensors: facts.tensors,
        repeat: opts.repeat,
        settle_secs: opts.settle_secs,
        page_cache_cold: facts.drops.all_cold(),
        page_cache: facts.drops.describe(),
        kvtier_io,
        limit_file_bytes: facts.limit_bytes,
        limit_io_bytes: facts.limit_io_bytes,
        prefault: cfg.prefault,
    }
}
