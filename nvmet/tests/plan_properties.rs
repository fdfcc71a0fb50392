//! The planner against random observed trees, not only trees it built itself.
//!
//! `convergence.rs` drives the planner through sequences of desired states on a tree the planner
//! made; here the starting tree is built with raw configfs operations, so it holds what another
//! writer, an older pillar, a crash between two steps or the kernel's own defaults leave behind:
//! subsystems with a kernel-random serial, namespaces with derived, foreign or kernel-random
//! identity (zero NGUID), enabled or not, live host links, `allow_any_host` set, shared ports and
//! hosts that have identified a subsystem. On every such tree, for every desired state:
//! - the plan applies on the kernel-faithful double without an errno (K2-K16);
//! - the read-back equals the plan's effective state, and identity was adopted exactly where the
//!   kernel forbids a rewrite (I3, I4);
//! - a second plan for the same desired state is empty (convergence);
//! - planning from the agent's model (`TargetModel`, kept current with scoped reads) gives the
//!   same plan as planning from a full read, and a scoped read-back verifies the same.
//!
//! Bounded for CI: 32 cases, each a fresh tree of three volumes.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::{Fixture, export, host, only};
use pillar_nvmet::{
    Adoption, Executor, HostAccess, NamespaceId, NamespaceIdentity, Op, PortId, PortSpec, Released,
    TargetModel, VolumeId, apply, derive_serial, observe_scope, plan_acl, plan_cut_connections,
    plan_export, plan_links, plan_release, plan_unexport, verify,
};
use proptest::prelude::*;

const VOLUMES: [&str; 3] = ["va", "vb", "vc"];

/// Port n always has the same address: ports are shared by every volume, as on a storage node.
fn port_spec(id: u16) -> PortSpec {
    PortSpec::tcp(format!("127.0.0.1:{}", 4419 + id).parse().unwrap())
}

fn ports(ids: &[u16]) -> BTreeMap<PortId, PortSpec> {
    ids.iter()
        .map(|id| (PortId::new(*id), port_spec(*id)))
        .collect()
}

/// The identity a namespace is left with in the starting tree.
#[derive(Debug, Clone, Copy)]
enum SeedIdentity {
    /// pillar's derived identity (a tree pillar made).
    Derived,
    /// Another writer's explicit UUID and NGUID.
    Foreign(u128, u128),
    /// Nothing written: the kernel's random UUID and a zero NGUID (K16).
    KernelRandom,
}

#[derive(Debug, Clone)]
struct SeedNamespace {
    identity: SeedIdentity,
    enabled: bool,
    /// A disabled namespace may point at another device; an enabled one never does (that is
    /// the planner's `LiveDeviceConflict`, a refusal by design, not a convergence case).
    other_device: bool,
}

/// One volume's subsystem in the starting tree.
#[derive(Debug, Clone)]
enum Seed {
    Absent,
    Present {
        derived_serial: bool,
        namespace: Option<SeedNamespace>,
        any_host: bool,
        hosts: Vec<u32>,
        ports: Vec<u16>,
        /// A host sent Identify: serial and model are frozen from now on (K: EINVAL), linked
        /// or not (`a_serial_frozen_by_a_host_is_not_rewritten_after_the_links_are_gone`).
        identified: bool,
    },
}

fn seed_identity() -> impl Strategy<Value = SeedIdentity> {
    prop_oneof![
        Just(SeedIdentity::Derived),
        (1u128.., 1u128..).prop_map(|(u, n)| SeedIdentity::Foreign(u, n)),
        Just(SeedIdentity::KernelRandom),
    ]
}

fn seed_namespace() -> impl Strategy<Value = SeedNamespace> {
    (seed_identity(), any::<bool>(), any::<bool>()).prop_map(|(identity, enabled, other)| {
        SeedNamespace {
            identity,
            enabled,
            other_device: other && !enabled,
        }
    })
}

fn seed() -> impl Strategy<Value = Seed> {
    prop_oneof![
        1 => Just(Seed::Absent),
        4 => (
            any::<bool>(),
            prop::option::of(seed_namespace()),
            any::<bool>(),
            prop::collection::btree_set(0u32..4, 0..3),
            prop::collection::btree_set(1u16..4, 0..3),
            any::<bool>(),
        )
            .prop_map(|(derived_serial, namespace, any_host, hosts, ports, identified)| {
                let ports: Vec<u16> = ports.into_iter().collect();
                // The kernel refuses host links while allow_any_host=1.
                let hosts: Vec<u32> = if any_host { Vec::new() } else { hosts.into_iter().collect() };
                // A host can have identified any subsystem it could reach once: linked now, or
                // linked before and unlinked since (an interrupted unexport, a failed cut); not
                // one exactly as its mkdir left it.
                let reachable =
                    any_host || !hosts.is_empty() || namespace.is_some() || !ports.is_empty();
                Seed::Present {
                    derived_serial,
                    namespace,
                    any_host,
                    hosts,
                    identified: identified && reachable,
                    ports,
                }
            }),
    ]
}

/// What one volume should look like. pillar always exports on at least one port.
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
        4 => (
            any::<bool>(),
            prop::collection::vec(0u32..4, 0..4),
            prop::collection::btree_set(1u16..4, 1..3),
        )
            .prop_map(|(any_host, hosts, ports)| Want::Present {
                any_host,
                hosts,
                ports: ports.into_iter().collect(),
            }),
    ]
}

fn mkdir(path: impl Into<PathBuf>) -> Op {
    Op::Mkdir { path: path.into() }
}

fn write(path: impl Into<PathBuf>, value: impl Into<String>) -> Op {
    Op::Write {
        path: path.into(),
        value: value.into(),
    }
}

fn link(target: impl Into<PathBuf>, link: impl Into<PathBuf>) -> Op {
    Op::Symlink {
        target: target.into(),
        link: link.into(),
    }
}

/// Builds `seed` for `volume` with raw operations, in an order the kernel accepts, without the
/// planner: the starting tree must not depend on the code under test.
fn build(f: &mut Fixture, volume: &str, device: &std::path::Path, seed: &Seed) {
    let Seed::Present {
        derived_serial,
        namespace,
        any_host,
        hosts,
        ports: seed_ports,
        identified,
    } = seed
    else {
        return;
    };
    let nqn = VolumeId::parse(volume).unwrap().subsystem_nqn();
    let s = format!("subsystems/{nqn}");
    let mut ops = vec![mkdir(&s)];
    if *derived_serial {
        ops.push(write(
            format!("{s}/attr_serial"),
            derive_serial(&nqn).as_str(),
        ));
    }
    if *any_host {
        ops.push(write(format!("{s}/attr_allow_any_host"), "1"));
    }
    let state = f.state();
    for h in hosts {
        let name = host(*h).to_string();
        if !state.hosts.contains(&name) {
            ops.push(mkdir(format!("hosts/{name}")));
        }
        ops.push(link(
            format!("hosts/{name}"),
            format!("{s}/allowed_hosts/{name}"),
        ));
    }
    if let Some(ns) = namespace {
        let n = format!("{s}/namespaces/1");
        ops.push(mkdir(&n));
        let path = if ns.other_device {
            f.device(&format!("{volume}-other"))
        } else {
            device.to_path_buf()
        };
        ops.push(write(
            format!("{n}/device_path"),
            path.display().to_string(),
        ));
        match ns.identity {
            SeedIdentity::Derived => {
                let id = NamespaceIdentity::derive(&nqn, NamespaceId::VOLUME);
                ops.push(write(
                    format!("{n}/device_uuid"),
                    id.uuid.hyphenated().to_string(),
                ));
                ops.push(write(format!("{n}/device_nguid"), id.nguid.to_string()));
            }
            SeedIdentity::Foreign(u, g) => {
                ops.push(write(
                    format!("{n}/device_uuid"),
                    uuid::Uuid::from_u128(u).hyphenated().to_string(),
                ));
                ops.push(write(
                    format!("{n}/device_nguid"),
                    uuid::Uuid::from_u128(g).hyphenated().to_string(),
                ));
            }
            SeedIdentity::KernelRandom => {}
        }
        if ns.enabled {
            ops.push(write(format!("{n}/enable"), "1"));
        }
    }
    for p in seed_ports {
        let dir = format!("ports/{p}");
        if !state.ports.contains_key(&PortId::new(*p)) {
            ops.push(mkdir(&dir));
            for (attr, value) in port_spec(*p).attributes() {
                ops.push(write(format!("{dir}/{attr}"), value));
            }
        }
        ops.push(link(&s, format!("{dir}/subsystems/{nqn}")));
    }
    apply(&mut f.double, &ops).unwrap();
    if *identified {
        f.double.host_identifies(nqn.as_str()).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    // proves K2-K16 (plans obey every kernel rule the double enforces), I2, I3, I4 (identity set
    // before enable, never rewritten live, a live foreign identity adopted), W6 (the ACL reads
    // back as asked) and convergence, from arbitrary starting trees.
    #[test]
    fn every_plan_applies_reads_back_and_converges(
        seeds in prop::collection::vec(seed(), 3),
        wants in prop::collection::vec(want(), 3),
    ) {
        let mut f = Fixture::new();
        let devices: Vec<_> = VOLUMES.iter().map(|v| f.device(v)).collect();
        for ((volume, device), seed) in VOLUMES.iter().zip(&devices).zip(&seeds) {
            build(&mut f, volume, device, seed);
        }
        let mut model = TargetModel::new(f.state());
        for (i, want) in wants.iter().enumerate() {
            let volume = VOLUMES[i];
            let nqn = VolumeId::parse(volume).unwrap().subsystem_nqn();
            let before = f.state();
            // The agent plans from its model at the cost of a scoped read (issue 11): same plans.
            model.refresh(nqn.as_str(), &observe_scope(f.double.root(), nqn.as_str()).unwrap());
            let view = model.view(nqn.as_str());
            prop_assert_eq!(plan_unexport(&view, &nqn), plan_unexport(&before, &nqn));
            // Whether a released port or host entry is still used: the same answer.
            let released = Released {
                ports: before.ports.keys().copied().collect(),
                hosts: before.hosts.clone(),
            };
            prop_assert_eq!(
                plan_release(&model.view_with_hosts(nqn.as_str(), &released.hosts), &released),
                plan_release(&before, &released)
            );
            for links in [BTreeMap::new(), ports(&[1, 3])] {
                prop_assert_eq!(plan_cut_connections(&view, &nqn, &links), plan_cut_connections(&before, &nqn, &links));
                prop_assert_eq!(plan_links(&view, &nqn, &links), plan_links(&before, &nqn, &links));
            }
            for access in [HostAccess::AnyHost, only(&[]), only(&[0, 3])] {
                let expected = BTreeMap::new();
                prop_assert_eq!(
                    plan_acl(&view, &nqn, &access, &expected),
                    plan_acl(&before, &nqn, &access, &expected)
                );
            }
            match want {
                Want::Absent => {
                    let ops = plan_unexport(&before, &nqn).unwrap();
                    apply(&mut f.double, &ops).map_err(|e| TestCaseError::fail(format!("{e}: {e:?}")))?;
                    model.refresh(nqn.as_str(), &observe_scope(f.double.root(), nqn.as_str()).unwrap());
                    let after = f.state();
                    prop_assert!(!after.subsystems.contains_key(nqn.as_str()));
                    prop_assert!(after.ports_linking(nqn.as_str()).next().is_none());
                    prop_assert!(plan_unexport(&after, &nqn).unwrap().is_empty());
                }
                Want::Present { any_host, hosts, ports: p } => {
                    let access = if *any_host { HostAccess::AnyHost } else { only(hosts) };
                    let spec = export(volume, &devices[i], access, ports(p));
                    let plan = plan_export(&before, &spec).unwrap();
                    prop_assert_eq!(&plan_export(&view, &spec).unwrap(), &plan);
                    apply(&mut f.double, &plan.ops)
                        .map_err(|e| TestCaseError::fail(format!("{e}: {e:?}\nseed {:?}", seeds[i])))?;
                    let scoped = observe_scope(f.double.root(), nqn.as_str()).unwrap();
                    verify(&scoped, &plan.effective)
                        .map_err(|e| TestCaseError::fail(format!("scoped: {e:?}")))?;
                    model.refresh(nqn.as_str(), &scoped);
                    let after = f.state();
                    verify(&after, &plan.effective)
                        .map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
                    // Adopted exactly where a rewrite is or may be forbidden: an enabled
                    // namespace with other identity; another serial on any subsystem but one
                    // exactly as its mkdir left it (configfs does not show whether a host
                    // identified it while it was linked).
                    let live = before.subsystem(&nqn);
                    let ns_live = live
                        .and_then(|s| s.namespaces.get(&NamespaceId::VOLUME))
                        .filter(|ns| ns.enabled);
                    let expect_ns = ns_live.is_some_and(|ns| {
                        ns.shown_identity() != Some(spec.namespaces[&NamespaceId::VOLUME].identity)
                    });
                    let expect_serial = live.is_some_and(|s| {
                        s.serial != spec.serial.as_str() && !bare(s, &before, nqn.as_str())
                    });
                    let got_ns = plan.adoptions.iter().any(|a| matches!(a, Adoption::Namespace { .. }));
                    let got_serial = plan.adoptions.iter().any(|a| matches!(a, Adoption::Serial { .. }));
                    prop_assert_eq!((got_ns, got_serial), (expect_ns, expect_serial), "{:?}", plan.adoptions);
                    // After a namespace adoption the caller plans with `plan.effective` (the
                    // agent records it durably before applying): once the namespace is disabled
                    // (nobody admitted, W7) configfs alone no longer says its identity was seen,
                    // and a plan from the derived spec would write the derived identity.
                    if !got_ns {
                        let same = plan_export(&after, &spec).unwrap();
                        prop_assert!(same.ops.is_empty(), "second plan not empty: {:?}", same.ops);
                    }
                    let again = plan_export(&after, &plan.effective).unwrap();
                    prop_assert!(again.ops.is_empty(), "second plan not empty: {:?}", again.ops);
                    prop_assert!(again.adoptions.is_empty(), "{:?}", again.adoptions);
                }
            }
        }
        // Whatever the start, tearing every volume down leaves nothing of pillar's.
        for volume in VOLUMES {
            let nqn = VolumeId::parse(volume).unwrap().subsystem_nqn();
            f.unexport(&nqn);
        }
        let state = f.state();
        prop_assert!(state.subsystems.is_empty() && state.ports.is_empty() && state.hosts.is_empty(), "{:?}", state);
    }
}

/// Whether `sub` is exactly as its mkdir left it: the only subsystem whose serial the planner
/// rewrites.
fn bare(sub: &pillar_nvmet::SubsystemState, state: &pillar_nvmet::TargetState, nqn: &str) -> bool {
    !sub.allow_any_host
        && sub.allowed_hosts.is_empty()
        && sub.namespaces.is_empty()
        && state.ports_linking(nqn).next().is_none()
}

/// A host identified a subsystem whose serial is not the derived one (a kernel-random serial from
/// a crash between mkdir and the serial write, or an older writer) while it was linked; then the
/// subsystem was unlinked from every port (an unexport interrupted after its first step, or an
/// operator). The serial is frozen in the kernel (EINVAL on write), but nothing in configfs says
/// so. The old planner adopted a serial only while the subsystem was port-linked: it planned the
/// rewrite and the kernel refused, so the export could not be restored without removing the
/// subsystem (the same on the second plan after an export that dropped every port of a
/// subsystem with an adopted serial). Now only a subsystem exactly as its mkdir left it gets a
/// new serial; this one's is adopted.
// proves I3 (serial half): never rewrite identity a host has seen.
#[test]
fn a_serial_frozen_by_a_host_is_not_rewritten_after_the_links_are_gone() {
    let mut f = Fixture::new();
    let device = f.device("va");
    let seed = Seed::Present {
        derived_serial: false,
        namespace: Some(SeedNamespace {
            identity: SeedIdentity::Derived,
            enabled: true,
            other_device: false,
        }),
        any_host: false,
        hosts: vec![1],
        ports: vec![1],
        identified: true,
    };
    build(&mut f, "va", &device, &seed);
    let nqn = VolumeId::parse("va").unwrap().subsystem_nqn();
    f.double
        .execute(&Op::Unlink {
            path: format!("ports/1/subsystems/{nqn}").into(),
        })
        .unwrap();
    let spec = export("va", &device, only(&[1]), ports(&[1]));
    let plan = plan_export(&f.state(), &spec).unwrap();
    apply(&mut f.double, &plan.ops).expect("the planner must not rewrite a frozen serial");
}
