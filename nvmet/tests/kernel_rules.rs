//! One test per kernel rule of nvmet configfs (`docs/rules.md` K2-K16): the double refuses the
//! wrong order with the kernel's errno, and the planner never produces that order.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{Fixture, export, host, only, tcp_port};
use pillar_nvmet::{
    Adoption, ConfigfsDouble, Executor, HostAccess, NamespaceId, NamespaceIdentity, Op, PlanError,
    SubsystemNqn, apply, plan_acl, plan_export, plan_revalidate, plan_unexport, verify, verify_acl,
};

fn errno_of(r: std::io::Result<()>) -> i32 {
    r.expect_err("the kernel refuses this")
        .raw_os_error()
        .unwrap()
}

fn mkdir(p: &str) -> Op {
    Op::Mkdir { path: p.into() }
}
fn write(p: &str, v: &str) -> Op {
    Op::Write {
        path: p.into(),
        value: v.into(),
    }
}
fn link(target: &str, l: &str) -> Op {
    Op::Symlink {
        target: target.into(),
        link: l.into(),
    }
}

const S: &str = "subsystems/nqn.2026-11.io.pillar-csi:vol:v1";
const NS: &str = "subsystems/nqn.2026-11.io.pillar-csi:vol:v1/namespaces/1";

/// A subsystem with namespace 1 enabled on the fixture's device.
fn enabled_namespace(f: &mut Fixture) {
    let dev = f.device.display().to_string();
    for op in [
        mkdir(S),
        mkdir(NS),
        write(&format!("{NS}/device_path"), &dev),
        write(&format!("{NS}/enable"), "1"),
    ] {
        f.double.execute(&op).unwrap();
    }
}

/// Positions of the operations matching `pred` in `ops`.
fn positions(ops: &[Op], pred: impl Fn(&Op) -> bool) -> Vec<usize> {
    ops.iter()
        .enumerate()
        .filter(|(_, op)| pred(op))
        .map(|(i, _)| i)
        .collect()
}

fn is_write_to(op: &Op, attr: &str) -> bool {
    matches!(op, Op::Write { path, .. } if path.file_name().is_some_and(|n| n == attr))
}

fn is_port_link(op: &Op) -> bool {
    matches!(op, Op::Symlink { link, .. } if link.starts_with("ports"))
}

// --- identity and device path are fixed while a namespace is enabled ---------------------------

#[test]
fn double_refuses_identity_or_device_writes_on_enabled_namespace_with_ebusy() {
    let mut f = Fixture::new();
    enabled_namespace(&mut f);
    let other = f.device("disk1.img").display().to_string();
    for (attr, value) in [
        ("device_path", other.as_str()),
        ("device_uuid", "0b2c3d4e-5f60-4172-8394-a5b6c7d8e9f0"),
        ("device_nguid", "0b2c3d4e-5f60-4172-8394-a5b6c7d8e9f0"),
    ] {
        let e = errno_of(f.double.execute(&write(&format!("{NS}/{attr}"), value)));
        assert_eq!(e, libc::EBUSY, "{attr}");
    }
}

// proves I2, I3, I4
#[test]
fn planner_sets_identity_before_enable_and_never_rewrites_a_live_one() {
    let mut f = Fixture::new();
    let spec = export("v1", &f.device, HostAccess::AnyHost, tcp_port(1, 4420));
    let plan = plan_export(&f.state(), &spec).unwrap();
    let enable = positions(&plan.ops, |op| is_write_to(op, "enable"));
    for attr in ["device_path", "device_uuid", "device_nguid"] {
        let at = positions(&plan.ops, |op| is_write_to(op, attr));
        assert_eq!(at.len(), 1, "{attr} written once");
        assert!(at[0] < enable[0], "{attr} before enable");
    }
    apply(&mut f.double, &plan.ops).unwrap();
    verify(&f.state(), &plan.effective).unwrap();

    // A live namespace with the kernel's random identity (an export made before pillar set
    // identity): re-planning keeps it, adopts the pair hosts see (random UUID, zero NGUID: K16),
    // and writes nothing to it; the read-back expects exactly that pair.
    let mut f = Fixture::new();
    enabled_namespace(&mut f);
    let live = f.state().subsystems[&spec.nqn.to_string()].namespaces[&NamespaceId::VOLUME].clone();
    let spec = export("v1", &f.device, HostAccess::AnyHost, tcp_port(1, 4420));
    let plan = plan_export(&f.state(), &spec).unwrap();
    assert!(
        positions(&plan.ops, |op| is_write_to(op, "device_uuid")
            || is_write_to(op, "device_nguid"))
        .is_empty()
    );
    let live_id = NamespaceIdentity {
        uuid: live.uuid.unwrap(),
        nguid: live.nguid.unwrap(),
    };
    assert!(live_id.nguid.is_zero(), "the kernel leaves NGUID zero");
    // So is the kernel's random serial: the subsystem is unlinked now, but one with a namespace
    // may have been linked and identified before (K: a serial is frozen after Identify).
    let live_serial = f.state().subsystems[&spec.nqn.to_string()].serial.clone();
    assert_eq!(
        plan.adoptions,
        vec![
            Adoption::Serial {
                live: live_serial,
                desired: spec.serial.to_string()
            },
            Adoption::Namespace {
                nsid: NamespaceId::VOLUME,
                live: live_id,
                desired: spec.namespaces[&NamespaceId::VOLUME].identity
            }
        ]
    );
    apply(&mut f.double, &plan.ops).unwrap();
    verify(&f.state(), &plan.effective).unwrap();
    let after =
        f.state().subsystems[&spec.nqn.to_string()].namespaces[&NamespaceId::VOLUME].clone();
    assert_eq!(
        after.shown_identity(),
        Some(live_id),
        "live identity unchanged"
    );
}

// proves I3, I4 (the planner half: adoption is reported, the agent records it)
#[test]
fn planner_adopts_a_live_foreign_identity() {
    let mut f = Fixture::new();
    let dev = f.device.display().to_string();
    let foreign_uuid = "0b2c3d4e-5f60-4172-8394-a5b6c7d8e9f0";
    for op in [
        mkdir(S),
        mkdir(NS),
        write(&format!("{NS}/device_path"), &dev),
        write(&format!("{NS}/device_uuid"), foreign_uuid),
        write(&format!("{NS}/device_nguid"), foreign_uuid),
        write(&format!("{NS}/enable"), "1"),
    ] {
        f.double.execute(&op).unwrap();
    }
    let spec = export("v1", &f.device, HostAccess::AnyHost, tcp_port(1, 4420));
    let plan = plan_export(&f.state(), &spec).unwrap();
    let live = NamespaceIdentity {
        uuid: foreign_uuid.parse().unwrap(),
        nguid: foreign_uuid.parse().unwrap(),
    };
    let live_serial = f.state().subsystems[&spec.nqn.to_string()].serial.clone();
    assert_eq!(
        plan.adoptions,
        vec![
            Adoption::Serial {
                live: live_serial,
                desired: spec.serial.to_string()
            },
            Adoption::Namespace {
                nsid: NamespaceId::VOLUME,
                live,
                desired: spec.namespaces[&NamespaceId::VOLUME].identity
            }
        ]
    );
    assert_eq!(
        plan.effective.namespaces[&NamespaceId::VOLUME].identity,
        live
    );
    apply(&mut f.double, &plan.ops).unwrap();
    verify(&f.state(), &plan.effective).unwrap();
    // The read-back against the derived identity would fail: the adoption is real.
    assert!(verify(&f.state(), &spec).is_err());
}

#[test]
fn planner_refuses_to_swap_the_device_of_a_live_namespace() {
    let mut f = Fixture::new();
    enabled_namespace(&mut f);
    let other = f.device("disk1.img");
    let spec = export("v1", &other, HostAccess::AnyHost, tcp_port(1, 4420));
    let err = plan_export(&f.state(), &spec).unwrap_err();
    assert!(matches!(err, PlanError::LiveDeviceConflict { .. }), "{err}");
}

// --- enable needs a device path --------------------------------------------------------------

#[test]
fn double_refuses_enable_without_device_path_and_enables_nothing() {
    let mut f = Fixture::new();
    f.double.execute(&mkdir(S)).unwrap();
    f.double.execute(&mkdir(NS)).unwrap();
    assert_eq!(
        errno_of(f.double.execute(&write(&format!("{NS}/enable"), "1"))),
        libc::EINVAL
    );
    f.double
        .execute(&write(
            &format!("{NS}/device_path"),
            "/nonexistent/pillar-device",
        ))
        .unwrap();
    assert_eq!(
        errno_of(f.double.execute(&write(&format!("{NS}/enable"), "1"))),
        libc::ENOENT
    );
    let ns =
        &f.state().subsystems["nqn.2026-11.io.pillar-csi:vol:v1"].namespaces[&NamespaceId::VOLUME];
    assert!(!ns.enabled);
}

// --- port attributes are fixed while a subsystem is linked ------------------------------------

#[test]
fn double_refuses_port_attribute_writes_while_linked_with_eacces() {
    let mut f = Fixture::new();
    let spec = export("v1", &f.device, HostAccess::AnyHost, tcp_port(1, 4420));
    f.export(&spec);
    for (attr, v) in [
        ("addr_traddr", "127.0.0.2"),
        ("addr_trsvcid", "4421"),
        ("addr_trtype", "tcp"),
        ("addr_adrfam", "ipv4"),
    ] {
        assert_eq!(
            errno_of(f.double.execute(&write(&format!("ports/1/{attr}"), v))),
            libc::EACCES,
            "{attr}"
        );
    }
}

#[test]
fn planner_writes_port_attributes_only_on_a_new_port() {
    let mut f = Fixture::new();
    let a = export("v1", &f.device, HostAccess::AnyHost, tcp_port(1, 4420));
    f.export(&a);
    let dev2 = f.device("disk2.img");
    let b = export("v2", &dev2, HostAccess::AnyHost, tcp_port(1, 4420));
    let plan = plan_export(&f.state(), &b).unwrap();
    assert!(
        positions(&plan.ops, |op| op.path().starts_with("ports")
            && matches!(op, Op::Write { .. }))
        .is_empty()
    );
    apply(&mut f.double, &plan.ops).unwrap();
    verify(&f.state(), &plan.effective).unwrap();

    // The same port ID wanted with another address: refused, never rewritten.
    let dev3 = f.device("disk3.img");
    let c = export("v3", &dev3, HostAccess::AnyHost, tcp_port(1, 4421));
    assert!(matches!(
        plan_export(&f.state(), &c),
        Err(PlanError::PortConflict { .. })
    ));
}

#[test]
fn double_refuses_linking_a_port_with_an_incomplete_address() {
    let mut f = Fixture::new();
    f.double.execute(&mkdir(S)).unwrap();
    f.double.execute(&mkdir("ports/1")).unwrap();
    f.double
        .execute(&write("ports/1/addr_trtype", "tcp"))
        .unwrap();
    let l = link(S, "ports/1/subsystems/nqn.2026-11.io.pillar-csi:vol:v1");
    assert_eq!(errno_of(f.double.execute(&l)), libc::EINVAL);
    assert_eq!(
        errno_of(f.double.execute(&write("ports/1/addr_adrfam", "pcie"))),
        libc::EINVAL
    );
}

// --- ACL mode ----------------------------------------------------------------------------------

#[test]
fn double_refuses_illegal_acl_orders_with_einval() {
    let mut f = Fixture::new();
    let h = format!("hosts/{}", host(1));
    f.double.execute(&mkdir(S)).unwrap();
    f.double.execute(&mkdir(&h)).unwrap();
    f.double
        .execute(&write(&format!("{S}/attr_allow_any_host"), "1"))
        .unwrap();
    let l = link(&h, &format!("{S}/allowed_hosts/{}", host(1)));
    assert_eq!(
        errno_of(f.double.execute(&l)),
        libc::EINVAL,
        "link while allow_any_host=1"
    );
    f.double
        .execute(&write(&format!("{S}/attr_allow_any_host"), "0"))
        .unwrap();
    f.double.execute(&l).unwrap();
    assert_eq!(
        errno_of(
            f.double
                .execute(&write(&format!("{S}/attr_allow_any_host"), "1"))
        ),
        libc::EINVAL,
        "allow_any_host=1 while hosts are linked"
    );
}

// proves W6
#[test]
fn planner_changes_acl_mode_in_the_legal_order_both_ways() {
    let mut f = Fixture::new();
    let mut spec = export("v1", &f.device, only(&[1, 2]), tcp_port(1, 4420));
    for access in [
        only(&[1, 2]),
        HostAccess::AnyHost,
        only(&[3]),
        only(&[]),
        HostAccess::AnyHost,
        only(&[1]),
    ] {
        spec.access = access;
        let plan = plan_export(&f.state(), &spec).unwrap();
        apply(&mut f.double, &plan.ops).unwrap_or_else(|e| panic!("{:?}: {e}", spec.access));
        verify(&f.state(), &plan.effective).unwrap();
        assert!(plan_export(&f.state(), &spec).unwrap().ops.is_empty());
    }
    // Hosts dropped from the ACL were removed from hosts/ once unreferenced.
    assert_eq!(
        f.state().hosts.into_iter().collect::<Vec<_>>(),
        vec![host(1).to_string()]
    );
}

// proves W6, W7, I3: an ACL change never writes identity, device, serial or ports, whatever
// identity the namespace shows; it disables the namespace when it leaves nobody admitted and
// enables it again, with the identity it kept, when a host is admitted.
#[test]
fn acl_changes_keep_a_kernel_random_identity_and_enable_only_while_a_host_is_admitted() {
    let mut f = Fixture::new();
    // What nvmet leaves when nobody writes identity: the double, like the kernel, gives the
    // namespace a random UUID and an all-zero NGUID on mkdir.
    enabled_namespace(&mut f);
    let port_ops = [
        mkdir("ports/1"),
        write("ports/1/addr_trtype", "tcp"),
        write("ports/1/addr_adrfam", "ipv4"),
        write("ports/1/addr_traddr", "127.0.0.1"),
        write("ports/1/addr_trsvcid", "4420"),
        link(S, "ports/1/subsystems/nqn.2026-11.io.pillar-csi:vol:v1"),
    ];
    for op in &port_ops {
        f.double.execute(op).unwrap();
    }
    let nqn = SubsystemNqn::parse("nqn.2026-11.io.pillar-csi:vol:v1").unwrap();
    let before = f.state();
    let ns_before = before.subsystem(&nqn).unwrap().namespaces[&NamespaceId::VOLUME].clone();
    assert!(ns_before.enabled);
    assert!(
        ns_before.nguid.unwrap().is_zero(),
        "the double leaves a zero NGUID"
    );
    assert!(
        ns_before.identity().is_none(),
        "no usable identity to rebuild a spec from"
    );
    let shown: BTreeMap<_, _> = [(NamespaceId::VOLUME, ns_before.shown_identity().unwrap())]
        .into_iter()
        .collect();

    for access in [
        only(&[1]),
        only(&[1, 2]),
        only(&[2]),
        HostAccess::AnyHost,
        only(&[]),
        only(&[]),
        only(&[1]),
        only(&[]),
        HostAccess::AnyHost,
    ] {
        let ops = plan_acl(&f.state(), &nqn, &access, &shown).unwrap();
        for op in &ops {
            let p = op.path();
            let acl_only = p.starts_with("hosts")
                || p.starts_with(format!("{S}/allowed_hosts"))
                || p == Path::new(&format!("{S}/attr_allow_any_host"))
                || p == Path::new(&format!("{S}/namespaces/1/enable"));
            assert!(acl_only, "{op} is not an ACL operation");
        }
        apply(&mut f.double, &ops).unwrap_or_else(|e| panic!("{access:?}: {e}"));
        verify_acl(&f.state(), &nqn, &access).unwrap();
        assert!(
            plan_acl(&f.state(), &nqn, &access, &shown)
                .unwrap()
                .is_empty()
        );
        let after = f.state();
        let sub = after.subsystem(&nqn).unwrap();
        let ns = &sub.namespaces[&NamespaceId::VOLUME];
        assert_eq!(
            ns.enabled,
            access.admits_a_host(),
            "{access:?}: enabled exactly while a host is admitted"
        );
        assert_eq!(
            (&ns.device_path, ns.uuid, ns.nguid),
            (&ns_before.device_path, ns_before.uuid, ns_before.nguid),
            "identity or device touched"
        );
        assert_eq!(sub.serial, before.subsystem(&nqn).unwrap().serial);
        assert_eq!(after.ports, before.ports, "ports touched");
    }
    // An ACL change needs a live subsystem; it never creates one.
    assert_eq!(
        plan_acl(
            &f.state(),
            &SubsystemNqn::parse("nqn.2026-11.io.pillar-csi:vol:absent").unwrap(),
            &only(&[1]),
            &shown,
        ),
        Err(PlanError::NoSubsystem {
            nqn: "nqn.2026-11.io.pillar-csi:vol:absent".into()
        })
    );
}

// proves W7, I1: a disabled namespace that does not show the identity the caller expects (or
// has no device) is never enabled by an ACL change: the grant is refused, nothing is written.
#[test]
fn a_grant_does_not_enable_a_namespace_showing_another_identity() {
    let mut f = Fixture::new();
    let spec = export("v1", &f.device.clone(), only(&[]), tcp_port(1, 4420));
    f.export(&spec);
    let ns = f.state().subsystems[spec.nqn.as_str()].namespaces[&NamespaceId::VOLUME].clone();
    assert!(!ns.enabled, "exported to nobody: disabled");
    let derived: BTreeMap<_, _> = spec
        .namespaces
        .iter()
        .map(|(nsid, ns)| (*nsid, ns.identity))
        .collect();
    let other: BTreeMap<_, _> = [(
        NamespaceId::VOLUME,
        NamespaceIdentity::derive(
            &SubsystemNqn::parse("nqn.2026-11.io.pillar-csi:vol:other").unwrap(),
            NamespaceId::VOLUME,
        ),
    )]
    .into_iter()
    .collect();
    assert_eq!(
        plan_acl(&f.state(), &spec.nqn, &only(&[1]), &other),
        Err(PlanError::NamespaceNotReady {
            nqn: spec.nqn.to_string(),
            nsid: NamespaceId::VOLUME
        })
    );
    let ops = plan_acl(&f.state(), &spec.nqn, &only(&[1]), &derived).unwrap();
    assert_eq!(
        ops.first(),
        Some(&write(&format!("{S}/namespaces/1/enable"), "1")),
        "enabled before the first host is linked"
    );
}

// --- serial after discovery --------------------------------------------------------------------

#[test]
fn double_refuses_serial_and_model_changes_after_a_host_identified() {
    let mut f = Fixture::new();
    f.double.execute(&mkdir(S)).unwrap();
    f.double
        .execute(&write(&format!("{S}/attr_serial"), "abc"))
        .unwrap();
    assert_eq!(
        f.state().subsystems["nqn.2026-11.io.pillar-csi:vol:v1"].serial,
        "abc"
    );
    assert_eq!(
        std::fs::read_to_string(f.double.root().join(S).join("attr_serial"))
            .unwrap()
            .len(),
        21,
        "space-padded"
    );
    assert_eq!(
        errno_of(
            f.double
                .execute(&write(&format!("{S}/attr_serial"), &"x".repeat(21)))
        ),
        libc::EINVAL
    );
    f.double
        .host_identifies("nqn.2026-11.io.pillar-csi:vol:v1")
        .unwrap();
    assert_eq!(
        errno_of(f.double.execute(&write(&format!("{S}/attr_serial"), "def"))),
        libc::EINVAL
    );
    assert_eq!(
        errno_of(
            f.double
                .execute(&write(&format!("{S}/attr_model"), "pillar"))
        ),
        libc::EINVAL
    );
}

// proves the double is faithful to K (serial frozen by Identify): the kernel keeps "a host
// identified this subsystem" in the subsystem itself (`subsys_discovered`), so it goes with the
// subsystem's rmdir; a subsystem made again under the same name takes a serial and a model.
// On the old double the marker outlived the subsystem and the write was refused (EINVAL).
#[test]
fn a_subsystem_made_again_after_its_removal_takes_a_serial_again() {
    let mut f = Fixture::new();
    let nqn = "nqn.2026-11.io.pillar-csi:vol:v1";
    f.double.execute(&mkdir(S)).unwrap();
    f.double.host_identifies(nqn).unwrap();
    assert_eq!(
        errno_of(f.double.execute(&write(&format!("{S}/attr_serial"), "abc"))),
        libc::EINVAL
    );
    f.double.execute(&Op::Rmdir { path: S.into() }).unwrap();
    f.double.execute(&mkdir(S)).unwrap();
    f.double
        .execute(&write(&format!("{S}/attr_serial"), "abc"))
        .unwrap();
    f.double
        .execute(&write(&format!("{S}/attr_model"), "pillar"))
        .unwrap();
    assert_eq!(f.state().subsystems[nqn].serial, "abc");
}

// proves I1 (serial half)
#[test]
fn planner_sets_serial_before_the_first_port_link_and_adopts_a_live_one() {
    let mut f = Fixture::new();
    let spec = export("v1", &f.device, HostAccess::AnyHost, tcp_port(1, 4420));
    let plan = plan_export(&f.state(), &spec).unwrap();
    let serial = positions(&plan.ops, |op| is_write_to(op, "attr_serial"));
    let identity = positions(&plan.ops, |op| {
        ["device_uuid", "device_nguid"]
            .iter()
            .any(|a| is_write_to(op, a))
    });
    let first_link = positions(&plan.ops, is_port_link)[0];
    assert!(
        serial.iter().chain(&identity).all(|i| *i < first_link),
        "identity before first port link"
    );
    apply(&mut f.double, &plan.ops).unwrap();

    // Live (port-linked, identified) subsystem with another serial: adopted, not rewritten.
    f.double
        .execute(&Op::Unlink {
            path: "ports/1/subsystems/nqn.2026-11.io.pillar-csi:vol:v1".into(),
        })
        .unwrap();
    f.double
        .execute(&write(&format!("{S}/attr_serial"), "kernelrandom"))
        .unwrap();
    f.double
        .execute(&link(
            S,
            "ports/1/subsystems/nqn.2026-11.io.pillar-csi:vol:v1",
        ))
        .unwrap();
    f.double
        .host_identifies("nqn.2026-11.io.pillar-csi:vol:v1")
        .unwrap();
    let plan = plan_export(&f.state(), &spec).unwrap();
    assert!(positions(&plan.ops, |op| is_write_to(op, "attr_serial")).is_empty());
    assert!(
        matches!(&plan.adoptions[..], [Adoption::Serial { live, .. }] if live == "kernelrandom")
    );
    apply(&mut f.double, &plan.ops).unwrap();
    verify(&f.state(), &plan.effective).unwrap();
}

// --- reservations --------------------------------------------------------------------------------

#[test]
fn double_refuses_resv_enable_on_an_enabled_namespace_with_einval() {
    let dir = tempfile::tempdir().unwrap();
    let device = dir.path().join("d");
    std::fs::write(&device, b"").unwrap();
    let mut d = ConfigfsDouble::create(dir.path().join("nvmet"))
        .unwrap()
        .with_reservations();
    d.execute(&mkdir(S)).unwrap();
    d.execute(&mkdir(NS)).unwrap();
    d.execute(&write(&format!("{NS}/resv_enable"), "1"))
        .unwrap();
    d.execute(&write(
        &format!("{NS}/device_path"),
        &device.display().to_string(),
    ))
    .unwrap();
    d.execute(&write(&format!("{NS}/enable"), "1")).unwrap();
    assert_eq!(
        errno_of(d.execute(&write(&format!("{NS}/resv_enable"), "0"))),
        libc::EINVAL
    );
}

// --- readlink gives relative paths -------------------------------------------------------------

#[test]
fn links_read_back_relative_and_resolve_to_their_targets() {
    let mut f = Fixture::new();
    let spec = export("v1", &f.device, only(&[1]), tcp_port(1, 4420));
    f.export(&spec);
    let port_link = f
        .double
        .root()
        .join("ports/1/subsystems")
        .join(spec.nqn.as_str());
    let raw = std::fs::read_link(&port_link).unwrap();
    assert!(
        raw.is_relative() && raw.starts_with(".."),
        "{}",
        raw.display()
    );
    let state = f.state();
    assert!(
        state.ports[&pillar_nvmet::PortId::new(1)]
            .subsystems
            .contains(spec.nqn.as_str())
    );
    assert!(
        state.subsystems[spec.nqn.as_str()]
            .allowed_hosts
            .contains(host(1).as_str())
    );
}

// --- removal order ----------------------------------------------------------------------------

#[test]
fn double_refuses_rmdir_of_busy_or_non_empty_items() {
    let mut f = Fixture::new();
    let spec = export("v1", &f.device, only(&[1]), tcp_port(1, 4420));
    f.export(&spec);
    let rmdir = |p: &str| Op::Rmdir {
        path: PathBuf::from(p),
    };
    assert_eq!(
        errno_of(f.double.execute(&rmdir(S))),
        libc::EBUSY,
        "subsystem linked from a port"
    );
    assert_eq!(
        errno_of(f.double.execute(&rmdir(&format!("hosts/{}", host(1))))),
        libc::EBUSY,
        "host linked"
    );
    assert_eq!(
        errno_of(f.double.execute(&rmdir("ports/1"))),
        libc::ENOTEMPTY,
        "port with a subsystem"
    );
    assert_eq!(
        errno_of(f.double.execute(&rmdir(&format!("{S}/namespaces")))),
        libc::EPERM,
        "default group"
    );
    f.double
        .execute(&Op::Unlink {
            path: Path::new("ports/1/subsystems").join(spec.nqn.as_str()),
        })
        .unwrap();
    assert_eq!(
        errno_of(f.double.execute(&rmdir(S))),
        libc::ENOTEMPTY,
        "subsystem with namespaces"
    );
    assert_eq!(
        errno_of(f.double.execute(&mkdir(&format!("{S}/allowed_hosts/x")))),
        libc::EPERM,
        "no mkdir there"
    );
}

#[test]
fn unexport_removes_everything_in_reverse_order() {
    let mut f = Fixture::new();
    let spec = export("v1", &f.device, only(&[1, 2]), tcp_port(1, 4420));
    f.export(&spec);
    let ops = plan_unexport(&f.state(), &spec.nqn).unwrap();
    apply(&mut f.double, &ops).unwrap();
    let state = f.state();
    assert!(
        state.subsystems.is_empty() && state.ports.is_empty() && state.hosts.is_empty(),
        "{state:?}"
    );
    assert!(
        plan_unexport(&f.state(), &spec.nqn).unwrap().is_empty(),
        "unexport is idempotent"
    );
}

#[test]
fn unexport_keeps_shared_hosts_and_ports() {
    let mut f = Fixture::new();
    let a = export("v1", &f.device, only(&[1, 2]), tcp_port(1, 4420));
    let dev2 = f.device("disk2.img");
    let b = export("v2", &dev2, only(&[2]), tcp_port(1, 4420));
    for spec in [&a, &b] {
        f.export(spec);
    }
    f.unexport(&a.nqn);
    let state = f.state();
    assert_eq!(
        state.hosts.iter().collect::<Vec<_>>(),
        vec![host(2).as_str()]
    );
    assert_eq!(state.ports.len(), 1);
    verify(&state, &b).unwrap();
}

// --- growth ------------------------------------------------------------------------------------

#[test]
fn revalidate_size_only_on_an_enabled_namespace() {
    let mut f = Fixture::new();
    f.double.execute(&mkdir(S)).unwrap();
    f.double.execute(&mkdir(NS)).unwrap();
    assert_eq!(
        errno_of(
            f.double
                .execute(&write(&format!("{NS}/revalidate_size"), "1"))
        ),
        libc::EINVAL
    );
    let nqn = "nqn.2026-11.io.pillar-csi:vol:v1".parse().unwrap();
    assert!(matches!(
        plan_revalidate(&f.state(), &nqn, NamespaceId::VOLUME),
        Err(PlanError::NotEnabled { .. })
    ));
    let dev = f.device.display().to_string();
    f.double
        .execute(&write(&format!("{NS}/device_path"), &dev))
        .unwrap();
    f.double
        .execute(&write(&format!("{NS}/enable"), "1"))
        .unwrap();
    let ops = plan_revalidate(&f.state(), &nqn, NamespaceId::VOLUME).unwrap();
    assert_eq!(ops, vec![write(&format!("{NS}/revalidate_size"), "1")]);
    apply(&mut f.double, &ops).unwrap();
}

// --- the planner never touches what pillar did not create ------------------------------------

#[test]
fn foreign_subsystems_are_refused() {
    let f = Fixture::new();
    let mut spec = export("v1", &f.device, HostAccess::AnyHost, tcp_port(1, 4420));
    spec.nqn = "nqn.2014-08.com.example:other".parse().unwrap();
    assert!(matches!(
        plan_export(&f.state(), &spec),
        Err(PlanError::ForeignSubsystem { .. })
    ));
    assert!(matches!(
        plan_unexport(&f.state(), &spec.nqn),
        Err(PlanError::ForeignSubsystem { .. })
    ));
}

// --- fencing at the target: controllers outlive an ACL change, not a port unlink --------------

// proves K17, K18 (modelled by the double) and W7 at the planner: removing a host from
// allowed_hosts leaves its live controller working; the cut the agent runs after it (unlink the
// subsystem from its port, link it back) deletes the controllers, the revoked host is refused on
// reconnect, and the recorded operations are exactly the ACL change then the cut.
#[test]
fn an_acl_change_keeps_live_controllers_and_the_cut_removes_them() {
    let mut f = Fixture::new();
    let spec = export("v1", &f.device.clone(), only(&[1, 2]), tcp_port(1, 4420));
    f.export(&spec);
    let nqn = spec.nqn.as_str().to_owned();
    let (h1, h2) = (host(1).to_string(), host(2).to_string());
    assert_eq!(
        errno_of(f.double.host_connects(&nqn, &h1, 2)),
        libc::ENOENT,
        "not reachable through a port it is not linked to"
    );
    f.double.host_connects(&nqn, &h1, 1).unwrap();
    f.double.host_connects(&nqn, &h2, 1).unwrap();
    f.double.record_ops().unwrap();

    let derived: BTreeMap<_, _> = spec
        .namespaces
        .iter()
        .map(|(nsid, ns)| (*nsid, ns.identity))
        .collect();
    let acl = plan_acl(&f.state(), &spec.nqn, &only(&[2]), &derived).unwrap();
    apply(&mut f.double, &acl).unwrap();
    assert_eq!(
        f.double.controllers(&nqn).unwrap(),
        vec![(1, h1.clone()), (1, h2.clone())],
        "dropping the allowed_hosts link deletes no controller"
    );
    let cut = pillar_nvmet::plan_cut_connections(&f.state(), &spec.nqn, &spec.ports).unwrap();
    apply(&mut f.double, &cut).unwrap();
    assert!(f.double.controllers(&nqn).unwrap().is_empty());
    assert_eq!(errno_of(f.double.host_connects(&nqn, &h1, 1)), libc::EACCES);
    f.double.host_connects(&nqn, &h2, 1).unwrap();

    let port_link = PathBuf::from(format!("ports/1/subsystems/{nqn}"));
    assert_eq!(
        f.double.recorded_ops().unwrap(),
        vec![
            Op::Unlink {
                path: Path::new(S).join("allowed_hosts").join(&h1)
            },
            Op::Rmdir {
                path: Path::new("hosts").join(&h1)
            },
            Op::Unlink {
                path: port_link.clone()
            },
            Op::Symlink {
                target: S.into(),
                link: port_link
            },
        ]
    );
}
