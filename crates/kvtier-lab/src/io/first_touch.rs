//! How fast fresh memory can be faulted in, by one thread and by several:
//! the bound a cold load into new memory runs into, and why the loader's
//! prefault uses several helper threads (`loader::prefault`).
//!
//! Each measurement maps `GIB` GiB of fresh anonymous memory after `IDLE`
//! seconds of sleep (so memory freed by the previous one has had time to go
//! back to a hypervisor that takes freed pages, as a cold load meets it),
//! faults it in in 4 MiB pieces taken in turn by the threads, either by
//! writing one byte per 4 KiB page ("touch") or with
//! `madvise(MADV_POPULATE_WRITE)` ("populate", what the loader does), and
//! unmaps it. Rounds alternate the four ways; medians are printed.
//!
//! ```sh
//! cargo run --release -p kvtier-lab -- first_touch [GIB] [IDLE] [ROUNDS]   # 4 20 2
//! ```

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvtier_bench::reporting::stats::median;

/// Bytes per piece, as the loader's prefault.
const STEP: usize = 4 << 20;

/// Faults `bytes` of fresh memory in with `threads` threads; GB/s.
fn fault_in(bytes: usize, threads: usize, populate: bool) -> Result<f64, String> {
    // SAFETY: a fresh private anonymous mapping; checked below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    let addr = base as usize;
    let next = AtomicUsize::new(0);
    let failed = AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let off = next.fetch_add(1, Ordering::Relaxed) * STEP;
                    if off >= bytes {
                        return;
                    }
                    let n = STEP.min(bytes - off);
                    if populate {
                        // SAFETY: inside the mapping; populating changes no bytes.
                        let rc = unsafe {
                            libc::madvise(
                                (addr + off) as *mut libc::c_void,
                                n,
                                libc::MADV_POPULATE_WRITE,
                            )
                        };
                        if rc != 0 {
                            failed.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    } else {
                        for p in (off..off + n).step_by(4096) {
                            // SAFETY: inside the mapping, which this piece's
                            // thread alone writes.
                            unsafe { std::ptr::write_volatile((addr + p) as *mut u8, 1) };
                        }
                    }
                }
            });
        }
    });
    let secs = t.elapsed().as_secs_f64();
    // SAFETY: mapped above with this length; no reference outlives this.
    unsafe { libc::munmap(base, bytes) };
    if failed.load(Ordering::Relaxed) > 0 {
        return Err(format!(
            "madvise(MADV_POPULATE_WRITE): {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(bytes as f64 / secs.max(1e-9) / 1e9)
}

fn arg<T: std::str::FromStr>(v: Option<String>, default: T, name: &str) -> Result<T, String> {
    v.map_or(Ok(default), |s| {
        s.parse().map_err(|_| format!("{name}: not a number: {s}"))
    })
}

/// Runs the experiment: `args` are `[GIB] [IDLE] [ROUNDS]`.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn Error>> {
    measure(args).map_err(Into::into)
}

fn measure(args: Vec<String>) -> Result<(), String> {
    let mut args = args.into_iter();
    let gib: usize = arg(args.next(), 4, "GIB")?;
    let idle: f64 = arg(args.next(), 20.0, "IDLE")?;
    let rounds: usize = arg(args.next(), 2, "ROUNDS")?;
    if rounds == 0 {
        return Err("ROUNDS: at least 1".into());
    }
    let bytes = gib
        .checked_mul(1 << 30)
        .filter(|&b| b > 0)
        .ok_or("GIB: out of range")?;
    let ways = [(1, false), (1, true), (4, false), (4, true)];
    let mut got = vec![Vec::new(); ways.len()];
    for round in 0..rounds {
        for (i, &(threads, populate)) in ways.iter().enumerate() {
            std::thread::sleep(Duration::from_secs_f64(idle.max(0.0)));
            let g = fault_in(bytes, threads, populate)?;
            eprintln!(
                "round {}: {threads} thread(s) {:8} {g:.2} GB/s",
                round + 1,
                name(populate)
            );
            got[i].push(g);
        }
    }
    println!("{gib} GiB fresh, {idle} s idle before each; median of {rounds}");
    for (&(threads, populate), g) in ways.iter().zip(&mut got) {
        g.sort_by(f64::total_cmp);
        let samples: Vec<String> = g.iter().map(|x| format!("{x:.2}")).collect();
        println!(
            "{threads} thread(s) {:8} {:6.2} GB/s  ({})",
            name(populate),
            median(g),
            samples.join(" ")
        );
    }
    Ok(())
}

fn name(populate: bool) -> &'static str {
    if populate { "populate" } else { "touch" }
}
