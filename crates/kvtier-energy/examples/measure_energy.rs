//! Start here for kvtier-energy: pick the best power meter this machine
//! has (RAPL, NVML, or the stated model when neither is readable), measure
//! a second of busy work, and price it with the cost model.
//!
//! ```text
//! cargo run --release -p kvtier-energy --example measure_energy
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use kvtier_energy::{CostModel, MeterOptions, best_meter};

fn main() -> Result<(), Box<dyn Error>> {
    let choice = best_meter(&MeterOptions::default())?;
    println!("meter: {} ({})", choice.meter.name(), choice.reason);
    let mut meter = choice.meter;
    meter.start()?;
    // One second of arithmetic on this thread: something to measure.
    let until = Instant::now() + Duration::from_secs(1);
    let mut x = 0u64;
    while Instant::now() < until {
        for i in 0..10_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
        }
    }
    let reading = meter.read()?;
    println!(
        "{}: {:.1} J, {:.1} W average (checksum {x:x})",
        reading.label(),
        reading.joules_total(),
        reading.avg_watts()
    );
    let cost = CostModel::default();
    println!(
        "an hour at that power costs ${:.4} (capex, energy, cooling: {:?})",
        cost.cost_per_hour(reading.avg_watts()),
        cost.breakdown(reading.avg_watts())
    );
    Ok(())
}
