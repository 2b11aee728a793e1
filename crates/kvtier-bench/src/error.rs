//! Benchmark errors.

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Bad configuration, caught before any work starts.
    #[error("bad benchmark configuration: {0}")]
    Config(String),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] kvtier_engine::EngineError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] kvtier_store::StoreError),
    /// The energy meter failed.
    #[error(transparent)]
    Energy(#[from] kvtier_energy::EnergyError),
    /// The target failed.
    #[error("target: {0}")]
    Target(String),
}
