//! The planner, driven through random sequences of desired states on one shared target, never
//! produces an operation the (kernel-faithful) double refuses; each plan converges (read-back
//! matches, the next plan is empty); removing everything leaves an empty tree.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::{Fixture, export, only};
use pillar_nvmet::{
    HostAccess, PortId, PortSpec, SubsystemNqn, VolumeId, apply, plan_export, plan_unexport, verify,
};
use proptest::prelude::*;

/// What one volume should look like at one step.
#[derive(Debug, Clone)]
enum Want {
    Absent,
    Present {
        any_host: bool,
        hosts: Vec<u32>,
        ports: Vec<u16>,
    },
}

fn want() -> impl Strategy<Value = Want> {
    prop_oneof![
        1 => Just(Want::Absent),
        4 => (any::<bool>(), prop::collection::vec(0u32..4, 0..4), prop::collection::vec(1u16..4, 0..3))
            .prop_map(|(any_host, hosts, ports)| Want::Present { any_host, hosts, ports }),
    ]
}

/// Port n always has the same address: ports are shared by every volume.
fn ports(ids: &[u16]) -> BTreeMap<PortId, PortSpec> {
    ids.iter()
        .map(|id| {
            (
                PortId::new(*id),
                PortSpec::tcp(format!("127.0.0.1:{}", 4419 + id).parse().unwrap()),
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_desired_states_converge(steps in prop::collection::vec((0usize..3, want()), 1..25)) {
        let mut f = Fixture::new();
        let volumes = ["va", "vb", "vc"];
        let devices: Vec<_> = volumes.iter().map(|v| f.device(v)).collect();
        for (which, w) in steps {
            let volume = volumes[which];
            let nqn = VolumeId::parse(volume).unwrap().subsystem_nqn();
            match w {
                Want::Absent => {
                    let ops = plan_unexport(&f.state(), &nqn).unwrap();
                    apply(&mut f.double, &ops).unwrap();
                    prop_assert!(!f.state().subsystems.contains_key(nqn.as_str()));
                }
                Want::Present { any_host, hosts, ports: p } => {
                    let access = if any_host { HostAccess::AnyHost } else { only(&hosts) };
                    let spec = export(volume, &devices[which], access, ports(&p));
                    let plan = plan_export(&f.state(), &spec).unwrap();
                    apply(&mut f.double, &plan.ops).unwrap();
                    prop_assert!(plan.adoptions.is_empty());
                    verify(&f.state(), &plan.effective).unwrap();
                    prop_assert!(plan_export(&f.state(), &spec).unwrap().ops.is_empty());
                }
            }
        }
        for volume in volumes {
            let nqn: SubsystemNqn = VolumeId::parse(volume).unwrap().subsystem_nqn();
            f.unexport(&nqn);
        }
        let state = f.state();
        prop_assert!(state.subsystems.is_empty() && state.ports.is_empty() && state.hosts.is_empty(), "{:?}", state);
    }
}
