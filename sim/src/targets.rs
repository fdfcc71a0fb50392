//! The storage side a host reaches, as the hosts and their kernel double share it: each
//! agent's target (its NVMe address, name and configfs double) and the NVMe reservations the
//! targets hold. Its own module so that the host and its kernel double both import it and
//! neither imports the other's types back.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Each agent's target: its NVMe address, its name and its configfs double's root.
pub type Targets = Arc<BTreeMap<IpAddr, (String, PathBuf)>>;

/// The NVMe reservations of every target: per (agent, subsystem NQN) the key of the host that
/// holds Write Exclusive. Kernel memory: an agent's node losing power loses its entries.
#[derive(Debug, Default)]
pub struct Reservations(Mutex<BTreeMap<(String, String), u64>>);

impl Reservations {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<(String, String), u64>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The holder's key of `nqn` at `agent`.
    pub fn holder(&self, agent: &str, nqn: &str) -> Option<u64> {
        self.lock()
            .get(&(agent.to_owned(), nqn.to_owned()))
            .copied()
    }

    /// `key` holds `nqn` at `agent` (an acquire, or a preempt-and-abort).
    pub fn set(&self, agent: &str, nqn: &str, key: u64) {
        self.lock().insert((agent.to_owned(), nqn.to_owned()), key);
    }

    /// `key` releases `nqn` at `agent`; whether it held it.
    pub fn release(&self, agent: &str, nqn: &str, key: u64) -> bool {
        let mut held = self.lock();
        let at = (agent.to_owned(), nqn.to_owned());
        if held.get(&at) == Some(&key) {
            held.remove(&at);
            return true;
        }
        false
    }

    /// The target of `agent` lost its memory.
    pub fn forget(&self, agent: &str) {
        self.lock().retain(|(a, _), _| a != agent);
    }
}
