//! `kvtier-lab`: kvtier's experiments, one subcommand each. An experiment
//! measures something (a speed, a latency, a bound) to decide a design or
//! check a claim; the crates' `examples/` show how to use their API.
//!
//! ```text
//! cargo run --release -p kvtier-lab -- EXPERIMENT [ARGS...]
//! cargo run --release -p kvtier-lab -- list
//! ```
//!
//! Each experiment's own docs say what it measures, its arguments and what
//! it prints. What lives where:
//!
//! * [`io`]: kvtier-io: `first_touch`, `staged_vs_in_place`.
//! * [`store`]: kvtier-store: `codec_speed`, `g3_reopen`, `g3_sync_bound`.
//! * [`engine`]: kvtier-engine: `speed`, `restore_ttft`,
//!   `layer_restore_ttft`, `idle_ttft`, `decode_beside_restore`.
//!
//! Medians and percentiles come from kvtier-bench's
//! `reporting::stats`, as every benchmark's do.

mod io;
mod store;

mod engine;

use std::error::Error;
use std::process::ExitCode;

/// What an experiment returns: done, or why it could not measure.
type Outcome = Result<(), Box<dyn Error>>;

/// One experiment: its subcommand, what it measures, and its entry, which
/// takes the arguments after the subcommand.
struct Experiment {
    name: &'static str,
    about: &'static str,
    /// It runs kvtier's engine: the process is set up as `kvtier serve`
    /// sets itself up (CPU thread count fixed, host allocator tuned)
    /// before it starts.
    engine: bool,
    run: fn(Vec<String>) -> Outcome,
}

/// Every experiment, in the order `list` prints them.
const EXPERIMENTS: &[Experiment] = &[
    Experiment {
        name: "first_touch",
        about: "fresh memory faulted in by one thread and by several",
        engine: false,
        run: io::first_touch::run,
    },
    Experiment {
        name: "staged_vs_in_place",
        about: "a model load staged through the ring against one in place",
        engine: false,
        run: io::staged_vs_in_place::run,
    },
    Experiment {
        name: "codec_speed",
        about: "each KV codec's coding and decoding on one core",
        engine: false,
        run: store::codec_speed::run,
    },
    Experiment {
        name: "g3_reopen",
        about: "G3's open after kill -9, after a clean stop, and by a scan",
        engine: false,
        run: store::g3_reopen::run,
    },
    Experiment {
        name: "g3_sync_bound",
        about: "put -> on G3 under the bounded write-back",
        engine: false,
        run: store::g3_sync_bound::run,
    },
    Experiment {
        name: "speed",
        about: "prefill and decode speed of a model directory",
        engine: true,
        run: engine::speed::run,
    },
    Experiment {
        name: "restore_ttft",
        about: "one long prompt's TTFT, recomputed and restored from G3",
        engine: true,
        run: engine::restore_ttft::run,
    },
    Experiment {
        name: "layer_restore_ttft",
        about: "a restored prefix and a new suffix: whole first vs layer by layer",
        engine: true,
        run: engine::layer_restore_ttft::run,
    },
    Experiment {
        name: "idle_ttft",
        about: "a G1-cached request's TTFT against idle time and side work",
        engine: true,
        run: engine::idle_ttft::run,
    },
    Experiment {
        name: "decode_beside_restore",
        about: "decoders' inter-token latency while long prefixes restore",
        engine: true,
        run: engine::decode_beside_restore::run,
    },
];

/// The experiments, one line each.
fn listing() -> String {
    let width = EXPERIMENTS.iter().map(|e| e.name.len()).max().unwrap_or(0);
    EXPERIMENTS
        .iter()
        .map(|e| format!("  {:width$}  {}\n", e.name, e.about))
        .collect()
}

/// The experiment named `name`.
fn find(name: &str) -> Option<&'static Experiment> {
    EXPERIMENTS.iter().find(|e| e.name == name)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(name) = args.next() else {
        eprint!(
            "usage: kvtier-lab EXPERIMENT [ARGS...]\n\nexperiments:\n{}",
            listing()
        );
        return ExitCode::FAILURE;
    };
    if matches!(name.as_str(), "list" | "help" | "--help" | "-h") {
        print!("experiments:\n{}", listing());
        return ExitCode::SUCCESS;
    }
    let Some(experiment) = find(&name) else {
        eprint!(
            "kvtier-lab: no experiment {name:?}\n\nexperiments:\n{}",
            listing()
        );
        return ExitCode::FAILURE;
    };
    if experiment.engine {
        // SAFETY: no other thread runs yet: nothing before this point in
        // main starts one.
        unsafe { kvtier_engine::fix_cpu_threads(None) };
        kvtier_engine::tune_host_allocator();
    }
    match (experiment.run)(args.collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier-lab {name}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_experiment_has_one_name_and_is_found_by_it() {
        let mut names: Vec<&str> = EXPERIMENTS.iter().map(|e| e.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), EXPERIMENTS.len());
        for e in EXPERIMENTS {
            assert!(find(e.name).is_some_and(|f| f.name == e.name));
            assert!(listing().contains(e.name));
        }
        assert!(find("no_such_experiment").is_none());
    }

    #[test]
    fn experiments_refuse_flags_they_do_not_know() {
        for name in [
            "g3_reopen",
            "g3_sync_bound",
            "layer_restore_ttft",
            "idle_ttft",
            "decode_beside_restore",
        ] {
            let e = find(name).expect("listed");
            let err = (e.run)(vec!["--no-such-flag".into()]).expect_err(name);
            assert!(err.to_string().contains("--no-such-flag"), "{name}: {err}");
        }
    }
}
