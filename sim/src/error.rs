//! Why a seed could not be run at all: a failure of the simulation's own setup, never a
//! finding about pillar (those are [`crate::Violation`]s).

/// Why a seed could not be run at all (not a finding).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot build the runtime or the world's directories")]
    Io(#[from] std::io::Error),
    #[error("the store refused the world's setup")]
    Store(#[from] pillar_state::StoreError),
    #[error("an agent failed to start")]
    Agent(#[from] pillar_agent::ServerError),
    #[error("a controller replica failed to start")]
    Controller(#[from] pillar_csi::controller::metrics::MetricsError),
    #[error("a host could not be set up: {0}")]
    Host(String),
}
