//! W9 at the target: `resv_enable=1` before `enable` wherever the kernel has the attribute, probed
//! from a namespace directory; never written on an enabled namespace (K6) nor on a kernel without
//! it. Run on the double with and without reservations.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Fixture, export, only, tcp_port};
use pillar_nvmet::{
    Executor, NamespaceId, Op, VolumeId, apply, observe, plan_export, plan_unexport, verify,
};
use proptest::prelude::*;

const NS1: &str = "namespaces/1";

fn is_resv_write(op: &Op) -> bool {
    matches!(op, Op::Write { path, .. } if path.ends_with("resv_enable"))
}

fn nqn(volume: &str) -> String {
    VolumeId::parse(volume).unwrap().subsystem_nqn().to_string()
}

/// The observed `resv_enable` of `volume`'s namespace 1.
fn resv_of(f: &Fixture, volume: &str) -> Option<bool> {
    let state = f.state();
    state.subsystems[&nqn(volume)].namespaces[&NamespaceId::VOLUME].resv_enable
}

/// How `volume`'s namespace is found before its export.
#[derive(Debug, Clone, Copy)]
enum Start {
    Absent,
    /// Created (directory only, not enabled): a crash between mkdir and enable.
    Disabled,
    /// Enabled by an earlier writer that did not turn reservations on.
    EnabledWithout,
}

/// Builds `start` for `volume` with raw operations (not the planner).
fn build(f: &mut Fixture, volume: &str, start: Start) {
    let s = format!("subsystems/{}", nqn(volume));
    let n = format!("{s}/{NS1}");
    let mut ops = vec![];
    if !matches!(start, Start::Absent) {
        ops.push(Op::Mkdir { path: s.into() });
        ops.push(Op::Mkdir {
            path: n.clone().into(),
        });
    }
    if matches!(start, Start::EnabledWithout) {
        ops.push(Op::Write {
            path: format!("{n}/device_path").into(),
            value: f.device(volume).display().to_string(),
        });
        ops.push(Op::Write {
            path: format!("{n}/enable").into(),
            value: "1".into(),
        });
    }
    apply(&mut f.double, &ops).unwrap();
}

fn start() -> impl Strategy<Value = Start> {
    prop_oneof![
        Just(Start::Absent),
        Just(Start::Disabled),
        Just(Start::EnabledWithout)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    // proves W9 (reservations on before enable where the kernel has them, probed from a
    // namespace directory) and K6 (never written on an enabled namespace: the double refuses it
    // with EINVAL, so such a plan fails to apply), on kernels with and without reservations, from
    // arbitrary starts of three volumes exported in turn.
    #[test]
    fn resv_enable_is_written_before_enable_exactly_where_the_kernel_has_it(
        reservations in any::<bool>(),
        starts in prop::collection::vec(start(), 3),
    ) {
        let mut f = if reservations { Fixture::with_reservations() } else { Fixture::new() };
        let volumes = ["r1", "r2", "r3"];
        for (v, s) in volumes.iter().zip(&starts) {
            build(&mut f, v, *s);
        }
        for (v, s) in volumes.iter().zip(&starts) {
            let device = f.device(v);
            let spec = export(v, &device, only(&[1]), tcp_port(1, 4420));
            let before = f.state();
            let first = plan_export(&before, &spec).unwrap();
            // A re-plan is asked for only when nothing in the tree can be probed.
            prop_assert_eq!(first.replan_after.is_some(), before.reservations().is_none());
            let plan = f.export(&spec);
            let all: Vec<&Op> = match first.replan_after {
                Some(at) => first.ops[..=at].iter().chain(&plan.ops).collect(),
                None => plan.ops.iter().collect(),
            };
            let resv_writes: Vec<usize> = all.iter().enumerate()
                .filter(|(_, op)| is_resv_write(op)).map(|(i, _)| i).collect();
            let enable = all.iter().position(|op| matches!(op, Op::Write { path, value } if path.ends_with("enable") && !path.ends_with("resv_enable") && value == "1"));
            let was_enabled = matches!(s, Start::EnabledWithout);
            if reservations && !was_enabled {
                prop_assert_eq!(resv_writes.len(), 1, "{:?}", all);
                prop_assert!(enable.is_some_and(|e| resv_writes[0] < e), "resv_enable after enable: {:?}", all);
                prop_assert_eq!(resv_of(&f, v), Some(true));
            } else {
                prop_assert!(resv_writes.is_empty(), "{:?}", all);
                prop_assert_eq!(resv_of(&f, v), if reservations { Some(false) } else { None });
            }
            // A live namespace without reservations keeps running without them, and says so.
            prop_assert_eq!(
                plan.live_without_reservations.contains(&NamespaceId::VOLUME),
                reservations && was_enabled
            );
            verify(&f.state(), &plan.effective).unwrap();
            let again = plan_export(&f.state(), &spec).unwrap();
            prop_assert!(again.ops.is_empty(), "{:?}", again.ops);
            prop_assert_eq!(again.replan_after, None);
        }
        for v in volumes {
            let ops = plan_unexport(&f.state(), &VolumeId::parse(v).unwrap().subsystem_nqn()).unwrap();
            apply(&mut f.double, &ops).unwrap();
        }
        prop_assert!(observe(f.double.root()).unwrap().subsystems.is_empty());
    }
}

// proves W9 (the whole plan applied without the re-plan still gives a correct export: on a
// kernel with reservations the namespace then runs without them, never with a refused write).
#[test]
fn a_plan_applied_whole_on_an_unprobed_tree_exports_without_reservations() {
    let mut f = Fixture::with_reservations();
    let spec = export("r1", &f.device, only(&[1]), tcp_port(1, 4420));
    let plan = plan_export(&f.state(), &spec).unwrap();
    assert!(plan.replan_after.is_some());
    assert!(!plan.ops.iter().any(is_resv_write));
    apply(&mut f.double, &plan.ops).unwrap();
    verify(&f.state(), &plan.effective).unwrap();
    assert_eq!(resv_of(&f, "r1"), Some(false));
    let again = plan_export(&f.state(), &spec).unwrap();
    assert!(again.ops.is_empty());
    assert_eq!(again.live_without_reservations, vec![NamespaceId::VOLUME]);
}

// proves K6 (the double, like the kernel, refuses resv_enable on an enabled namespace), so the
// property above can fail.
#[test]
fn the_double_refuses_resv_enable_written_after_enable() {
    let mut f = Fixture::with_reservations();
    let spec = export("r1", &f.device, only(&[1]), tcp_port(1, 4420));
    f.export(&spec);
    let path = format!("subsystems/{}/{NS1}/resv_enable", nqn("r1"));
    let err = f
        .double
        .execute(&Op::Write {
            path: path.into(),
            value: "1".into(),
        })
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
}
