//! Where a volume may live: an agent's topology segments against a CreateVolume's
//! accessibility requirements, and the capacity a topology segment can reach.
//!
//! Invariant: a volume is placed only on an agent reachable from one of the request's requisite
//! topologies, when it names any: every segment of the agent (`PillarAgent.spec.topology`) is in
//! that topology with the same value. An agent without segments is reachable from every node.
//! Preferred topologies order the choice; without any, agents are taken by name.

use std::collections::{BTreeMap, HashMap};

use pillar_state::crd::PillarAgent;

use crate::csi;

/// Whether a volume on an agent with `segments` is reachable from a node in `node`.
pub(super) fn reachable_from(
    segments: &BTreeMap<String, String>,
    node: &HashMap<String, String>,
) -> bool {
    segments.iter().all(|(k, v)| node.get(k) == Some(v))
}

/// The agents a request allows, most preferred first: those reachable from a requisite
/// topology (every agent when none is required), first the ones reachable from each preferred
/// topology in its order, then the rest; ties by name.
pub(super) fn rank<'a>(
    agents: &'a [PillarAgent],
    requirement: Option<&csi::TopologyRequirement>,
) -> Vec<&'a PillarAgent> {
    let mut sorted: Vec<&PillarAgent> = agents.iter().collect();
    sorted.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let Some(req) = requirement else {
        return sorted;
    };
    let allowed: Vec<&PillarAgent> = sorted
        .into_iter()
        .filter(|a| {
            req.requisite.is_empty()
                || req
                    .requisite
                    .iter()
                    .any(|t| reachable_from(&a.spec.topology, &t.segments))
        })
        .collect();
    let mut ranked: Vec<&PillarAgent> = Vec::with_capacity(allowed.len());
    for preferred in &req.preferred {
        for a in &allowed {
            if reachable_from(&a.spec.topology, &preferred.segments)
                && !ranked.iter().any(|r| r.metadata.name == a.metadata.name)
            {
                ranked.push(a);
            }
        }
    }
    for a in allowed {
        if !ranked.iter().any(|r| r.metadata.name == a.metadata.name) {
            ranked.push(a);
        }
    }
    ranked
}

/// The CSI topology of a volume with `segments` (none: reachable from every node).
pub(super) fn accessible(segments: &BTreeMap<String, String>) -> Vec<csi::Topology> {
    if segments.is_empty() {
        return Vec::new();
    }
    vec![csi::Topology {
        segments: segments
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use pillar_state::crd::PillarAgentSpec;

    fn agent(name: &str, zone: Option<&str>) -> PillarAgent {
        let mut a = PillarAgent::new(
            name,
            PillarAgentSpec {
                node: name.into(),
                address: "unix:///x".into(),
                tls: None,
                pools: Vec::new(),
                nvme_address: "10.0.0.1".into(),
                topology: BTreeMap::new(),
            },
        );
        if let Some(z) = zone {
            a.spec.topology.insert("zone".into(), z.into());
        }
        a
    }

    fn topo(pairs: &[(&str, &str)]) -> csi::Topology {
        csi::Topology {
            segments: pairs
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        }
    }

    fn names(v: &[&PillarAgent]) -> Vec<String> {
        v.iter().map(|a| a.metadata.name.clone().unwrap()).collect()
    }

    #[test]
    fn only_reachable_agents_are_allowed_and_preferred_ones_come_first() {
        let agents = [
            agent("a", Some("z1")),
            agent("b", Some("z2")),
            agent("c", None),
            agent("d", Some("z2")),
        ];
        assert_eq!(names(&rank(&agents, None)), ["a", "b", "c", "d"]);
        let req = csi::TopologyRequirement {
            requisite: vec![topo(&[("zone", "z2"), ("pillar.io/node", "n1")])],
            preferred: vec![],
        };
        // z1's agent is never offered to a node in z2; the unzoned one is reachable from all.
        assert_eq!(names(&rank(&agents, Some(&req))), ["b", "c", "d"]);
        let req = csi::TopologyRequirement {
            requisite: vec![topo(&[("zone", "z1")]), topo(&[("zone", "z2")])],
            preferred: vec![topo(&[("zone", "z2")]), topo(&[("zone", "z1")])],
        };
        assert_eq!(names(&rank(&agents, Some(&req))), ["b", "c", "d", "a"]);
        // A node that reports no zone reaches only the unzoned agent.
        let req = csi::TopologyRequirement {
            requisite: vec![topo(&[("pillar.io/node", "n1")])],
            preferred: vec![],
        };
        assert_eq!(names(&rank(&agents, Some(&req))), ["c"]);
    }
}
