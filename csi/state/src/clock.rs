//! The wall clock behind the times the controller writes (condition transitions, an agent's
//! last resync), injectable so that the simulation's seed, not the machine, decides them.
//!
//! Invariants:
//! - [`SystemClock`] is the machine's clock; production uses nothing else.
//! - [`TokioClock`] moves only with tokio's clock: under a paused runtime (the simulation) the
//!   same seed gives the same times, and an interval the controller waits on and the times it
//!   records agree.

use std::fmt;

pub use k8s_openapi::jiff::Timestamp;

/// Where the controller reads the time of day.
pub trait WallClock: Send + Sync + fmt::Debug {
    /// Now.
    fn now(&self) -> Timestamp;
}

/// The machine's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl WallClock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A wall clock that starts at `epoch` and moves with tokio's clock.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    epoch: Timestamp,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// A clock reading `epoch` now, and `epoch` plus tokio's elapsed time later.
    pub fn starting_at(epoch: Timestamp) -> Self {
        Self {
            epoch,
            start: tokio::time::Instant::now(),
        }
    }
}

impl WallClock for TokioClock {
    fn now(&self) -> Timestamp {
        let elapsed = self.start.elapsed();
        // Beyond jiff's range only after ~10,000 years of simulated time: stays at the epoch.
        self.epoch.checked_add(elapsed).unwrap_or(self.epoch)
    }
}

/// `at` as a condition's `lastTransitionTime`: RFC 3339 in UTC, whole seconds (the precision of
/// `metav1.Time`).
pub fn condition_time(at: Timestamp) -> String {
    at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tokio_clock_moves_with_tokio_time_only() {
        let epoch: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let clock = TokioClock::starting_at(epoch);
        assert_eq!(condition_time(clock.now()), "2026-01-01T00:00:00Z");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(condition_time(clock.now()), "2026-01-01T00:01:01Z");
    }

    #[test]
    fn the_system_clock_reads_rfc3339_in_whole_seconds() {
        let t = condition_time(SystemClock.now());
        assert!(t.ends_with('Z') && !t.contains('.'), "{t}");
        assert!(t.parse::<Timestamp>().is_ok(), "{t}");
    }
}
