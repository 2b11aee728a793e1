//! What an hour of inference costs, and a million tokens.
//!
//! From the product brief: the cost of an inference hour is the hardware
//! written off over its service life, plus the energy it draws, plus cooling
//! (about 40 % of the energy, i.e. PUE 1.4):
//!
//! ```text
//! usd_per_hour    = capex_usd / (service_years * 8760 h)
//!                 + (avg_watts / 1000) kW * electricity_usd_per_kwh * pue
//!                 + other_usd_per_hour
//! usd_per_Mtokens = usd_per_hour / (tokens_per_second * 3600) * 1e6
//! ```
//!
//! **The defaults are assumptions** for a small inference server, to be
//! replaced with real figures: capex 10 000 USD, 5 years of service (the
//! brief's write-off period), 0.15 USD/kWh (roughly a commercial electricity
//! tariff), PUE 1.4 (the brief's "cooling about 40 % of energy"), nothing
//! else per hour.

use serde::{Deserialize, Serialize};

use crate::EnergyError;

/// Hours in a (365-day) year.
pub const HOURS_PER_YEAR: f64 = 8760.0;

/// Cost model inputs. Deserialises from a config table; missing keys keep
/// the defaults, unknown keys are rejected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostModel {
    /// Purchase price of the machine (default 10 000 USD, assumed).
    pub capex_usd: f64,
    /// Years over which the capex is written off (default 5, from the brief).
    pub service_years: f64,
    /// Electricity price (default 0.15 USD/kWh, assumed).
    pub electricity_usd_per_kwh: f64,
    /// Power usage effectiveness: facility energy / IT energy, so cooling
    /// adds `pue - 1` of the energy (default 1.4, from the brief).
    pub pue: f64,
    /// Any other running cost per hour: space, network, support (default 0).
    pub other_usd_per_hour: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            capex_usd: 10_000.0,
            service_years: 5.0,
            electricity_usd_per_kwh: 0.15,
            pue: 1.4,
            other_usd_per_hour: 0.0,
        }
    }
}

/// One hour's cost, split by where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CostBreakdown {
    /// Capex written off per hour.
    pub capex_usd_per_hour: f64,
    /// Electricity drawn by the machine itself.
    pub energy_usd_per_hour: f64,
    /// Electricity for cooling and facility overhead: energy x (PUE - 1).
    pub cooling_usd_per_hour: f64,
    /// Other running costs.
    pub other_usd_per_hour: f64,
    /// The sum.
    pub total_usd_per_hour: f64,
}

impl CostModel {
    /// Check the inputs are usable: finite, capex and prices >= 0,
    /// service years > 0, PUE >= 1.
    pub fn validate(&self) -> Result<(), EnergyError> {
        let bad = |what: &str, v: f64| {
            Err(EnergyError::InvalidConfig(format!(
                "cost model {what}, got {v}"
            )))
        };
        for (name, v) in [
            ("capex_usd", self.capex_usd),
            ("electricity_usd_per_kwh", self.electricity_usd_per_kwh),
            ("other_usd_per_hour", self.other_usd_per_hour),
        ] {
            if !v.is_finite() || v < 0.0 {
                return bad(&format!("{name} must be a finite number >= 0"), v);
            }
        }
        if !self.service_years.is_finite() || self.service_years <= 0.0 {
            return bad("service_years must be > 0", self.service_years);
        }
        if !self.pue.is_finite() || self.pue < 1.0 {
            return bad("pue must be >= 1", self.pue);
        }
        Ok(())
    }

    /// Where an hour's money goes at an average draw of `avg_watts`.
    pub fn breakdown(&self, avg_watts: f64) -> CostBreakdown {
        let capex = self.capex_usd / (self.service_years * HOURS_PER_YEAR);
        let energy = avg_watts / 1000.0 * self.electricity_usd_per_kwh;
        let cooling = energy * (self.pue - 1.0);
        CostBreakdown {
            capex_usd_per_hour: capex,
            energy_usd_per_hour: energy,
            cooling_usd_per_hour: cooling,
            other_usd_per_hour: self.other_usd_per_hour,
            total_usd_per_hour: capex + energy + cooling + self.other_usd_per_hour,
        }
    }

    /// USD per hour at an average draw of `avg_watts`.
    pub fn cost_per_hour(&self, avg_watts: f64) -> f64 {
        self.breakdown(avg_watts).total_usd_per_hour
    }

    /// USD per million tokens at `avg_watts` and `tokens_per_second`;
    /// `None` when no tokens are produced.
    pub fn cost_per_million_tokens(&self, avg_watts: f64, tokens_per_second: f64) -> Option<f64> {
        (tokens_per_second.is_finite() && tokens_per_second > 0.0)
            .then(|| self.cost_per_hour(avg_watts) / (tokens_per_second * 3600.0) * 1e6)
    }

    /// USD of electricity (cooling included) for `joules` of IT energy.
    pub fn energy_cost_usd(&self, joules: f64) -> f64 {
        joules / 3.6e6 * self.electricity_usd_per_kwh * self.pue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn worked_example_with_defaults() {
        // Defaults: 10 000 USD over 5 years, 0.15 USD/kWh, PUE 1.4.
        // At 200 W and 50 tok/s:
        //   capex   = 10 000 / (5 * 8760)      = 0.228310502... USD/h
        //   energy  = 0.2 kW * 0.15            = 0.030 USD/h
        //   cooling = 0.030 * 0.4              = 0.012 USD/h
        //   total                              = 0.270310502... USD/h
        //   tokens  = 50 * 3600                = 180 000 per hour
        //   per 1M  = 0.270310502 / 180 000 * 1e6 = 1.501725... USD
        let m = CostModel::default();
        let b = m.breakdown(200.0);
        assert!(close(b.capex_usd_per_hour, 10_000.0 / 43_800.0));
        assert!(close(b.energy_usd_per_hour, 0.030));
        assert!(close(b.cooling_usd_per_hour, 0.012));
        let hour = 10_000.0 / 43_800.0 + 0.042;
        assert!(close(m.cost_per_hour(200.0), hour));
        assert!((m.cost_per_hour(200.0) - 0.270_310_502).abs() < 1e-9);
        let per_m = m.cost_per_million_tokens(200.0, 50.0).unwrap();
        assert!((per_m - 1.501_725_01).abs() < 1e-6, "{per_m}");
        assert_eq!(m.cost_per_million_tokens(200.0, 0.0), None);
    }

    #[test]
    fn pue_scales_energy_only() {
        let base = CostModel {
            capex_usd: 0.0,
            pue: 1.0,
            ..CostModel::default()
        };
        let cooled = CostModel {
            pue: 2.0,
            ..base.clone()
        };
        // 1 kW for an hour at 0.15 USD/kWh: 0.15, doubled by PUE 2.
        assert!(close(base.cost_per_hour(1000.0), 0.15));
        assert!(close(cooled.cost_per_hour(1000.0), 0.30));
        // 3.6 MJ = 1 kWh.
        assert!(close(cooled.energy_cost_usd(3.6e6), 0.30));
    }

    #[test]
    fn overrides_from_json_and_validation() {
        let m: CostModel =
            serde_json::from_str(r#"{"capex_usd": 250000, "pue": 1.2, "other_usd_per_hour": 1}"#)
                .unwrap();
        assert_eq!(m.capex_usd, 250_000.0);
        assert_eq!(m.service_years, 5.0);
        assert!(m.validate().is_ok());
        // 250 000 / 43 800 + 1 = 6.70776... USD/h at 0 W.
        assert!(close(m.cost_per_hour(0.0), 250_000.0 / 43_800.0 + 1.0));
        assert!(serde_json::from_str::<CostModel>(r#"{"capex": 1}"#).is_err());
        let bad = CostModel {
            pue: 0.9,
            ..CostModel::default()
        };
        assert!(matches!(bad.validate(), Err(EnergyError::InvalidConfig(_))));
        let bad = CostModel {
            service_years: 0.0,
            ..CostModel::default()
        };
        assert!(bad.validate().is_err());
    }
}
