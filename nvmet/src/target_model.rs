//! An in-memory model of the whole target, so an operation on one export reads from the kernel
//! only what it touches ([`crate::observe_scope`]) and still plans with what the planner knows
//! about the rest of the tree.
//!
//! What the planner asks about subsystems other than the one it plans for is existence only:
//! whether some other subsystem links a host entry (host cleanup), whether some other subsystem
//! is linked on a port (port cleanup), and whether any namespace shows `resv_enable` (the
//! reservation probe). [`TargetModel::view`] answers those with one witness each, taken from the
//! model, and everything about the planned subsystem, the ports and the host entries from the
//! latest scoped read of the kernel. So a plan from a view equals the plan from a full read
//! whenever the model is current.
//!
//! Invariants the caller keeps (the agent's `Target`):
//! - the model is loaded from a full [`crate::observe`] while no change runs, and reloaded after
//!   any failed or unverified change;
//! - every change to subsystem S is followed by a scoped read of S folded in with
//!   [`TargetModel::refresh`] before anyone plans a change that removes a shared entry (a host
//!   entry or a port), so those decisions see every subsystem as the kernel holds it.
//!
//! A subsystem changed behind pillar's back is seen when an operation on it reads it; a change
//! elsewhere that the model misses can only make a cleanup `rmdir` fail (the kernel refuses to
//! remove a port that still links a subsystem), which reloads the model.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{PortState, TargetState};

/// The model: the whole tree, and which subsystems link each host entry.
#[derive(Clone, Debug, Default)]
pub struct TargetModel {
    state: TargetState,
    host_links: BTreeMap<String, BTreeSet<String>>,
}

impl TargetModel {
    /// A model of `full`, read with [`crate::observe`].
    pub fn new(full: TargetState) -> Self {
        let mut host_links: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (name, sub) in &full.subsystems {
            for host in &sub.allowed_hosts {
                host_links
                    .entry(host.clone())
                    .or_default()
                    .insert(name.clone());
            }
        }
        Self {
            state: full,
            host_links,
        }
    }

    /// The whole modelled tree.
    pub fn state(&self) -> &TargetState {
        &self.state
    }

    /// Folds in a scoped read of `nqn` ([`crate::observe_scope`]): the subsystem (present or
    /// gone), each port's attributes and link to `nqn` (ports gone from the kernel leave the
    /// model), a witness link the model did not know, and the host entries.
    pub fn refresh(&mut self, nqn: &str, scoped: &TargetState) {
        if let Some(old) = self.state.subsystems.remove(nqn) {
            for host in &old.allowed_hosts {
                if let Some(links) = self.host_links.get_mut(host) {
                    links.remove(nqn);
                    if links.is_empty() {
                        self.host_links.remove(host);
                    }
                }
            }
        }
        if let Some(sub) = scoped.subsystems.get(nqn) {
            for host in &sub.allowed_hosts {
                self.host_links
                    .entry(host.clone())
                    .or_default()
                    .insert(nqn.to_owned());
            }
            self.state.subsystems.insert(nqn.to_owned(), sub.clone());
        }
        self.state
            .ports
            .retain(|id, _| scoped.ports.contains_key(id));
        for (id, seen) in &scoped.ports {
            let port = self.state.ports.entry(*id).or_default();
            let mut links = std::mem::take(&mut port.subsystems);
            links.remove(nqn);
            links.extend(seen.subsystems.iter().cloned());
            *port = PortState {
                subsystems: links,
                ..seen.clone_attributes()
            };
        }
        self.state.hosts.clone_from(&scoped.hosts);
    }

    /// Whether some subsystem links the host entry `host`, as the model holds it: as of each
    /// subsystem's latest scoped read folded in.
    pub fn host_linked(&self, host: &str) -> bool {
        self.host_links.contains_key(host)
    }

    /// The state to plan `nqn` with: the subsystem, the ports and the host entries as the model
    /// holds them (current after a [`refresh`](Self::refresh) of `nqn`), and one witness for
    /// each question the planner asks about the rest (see the module docs).
    pub fn view(&self, nqn: &str) -> TargetState {
        self.view_with_hosts(nqn, &BTreeSet::new())
    }

    /// [`view`](Self::view), with a witness for each host of `hosts` too (a subsystem other
    /// than `nqn` linking it, if any): to decide whether host entries `nqn` no longer links
    /// are still used ([`crate::plan_release`]).
    pub fn view_with_hosts(&self, nqn: &str, hosts: &BTreeSet<String>) -> TargetState {
        let mut view = TargetState {
            hosts: self.state.hosts.clone(),
            ..TargetState::default()
        };
        let own = self.state.subsystems.get(nqn);
        let mut witnesses = BTreeSet::new();
        let own_hosts = own.into_iter().flat_map(|sub| sub.allowed_hosts.iter());
        for host in own_hosts.chain(hosts) {
            if let Some(other) = self
                .host_links
                .get(host)
                .and_then(|links| links.iter().find(|s| *s != nqn))
            {
                witnesses.insert(other.clone());
            }
        }
        // The reservation probe: any namespace of this kernel shows whether it has them.
        if let Some((name, _)) = self
            .state
            .subsystems
            .iter()
            .find(|(_, s)| !s.namespaces.is_empty())
        {
            witnesses.insert(name.clone());
        }
        for name in witnesses {
            if let Some(sub) = self.state.subsystems.get(&name) {
                view.subsystems.insert(name, sub.clone());
            }
        }
        if let Some(sub) = own {
            view.subsystems.insert(nqn.to_owned(), sub.clone());
        }
        for (id, port) in &self.state.ports {
            let mut links = BTreeSet::new();
            if port.subsystems.contains(nqn) {
                links.insert(nqn.to_owned());
            }
            if let Some(other) = port.subsystems.iter().find(|s| *s != nqn) {
                links.insert(other.clone());
            }
            view.ports.insert(
                *id,
                PortState {
                    subsystems: links,
                    ..port.clone_attributes()
                },
            );
        }
        view
    }
}

impl PortState {
    /// The port without its links.
    fn clone_attributes(&self) -> PortState {
        PortState {
            trtype: self.trtype.clone(),
            adrfam: self.adrfam.clone(),
            traddr: self.traddr.clone(),
            trsvcid: self.trsvcid.clone(),
            tsas: self.tsas.clone(),
            treq: self.treq.clone(),
            subsystems: BTreeSet::new(),
            referrals: self.referrals,
        }
    }
}
