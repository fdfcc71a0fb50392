//! Planning one export: the subsystem and its serial, the namespaces, the ACL, the ports, in
//! the order the kernel accepts (the rules are the planner's, listed in its module docs).
//!
//! Invariants:
//! - The identity of an enabled namespace and the serial of a subsystem a host may have
//!   identified are never rewritten: they are adopted, and the plan says so (I4).
//! - A namespace is configured fully before it is enabled, and enabled only while its subsystem
//!   admits a host (W7); `resv_enable` is written before `enable`, probed, never guessed (W9).
//! - The subsystem is linked to its ports last, once fully configured.

use std::collections::BTreeSet;

use super::{
    Adoption, ExportPlan, Op, PlanError, ns_dir, plan_access, port_dir, push_host_cleanup,
    push_port_cleanup, push_port_link, subsys_dir, write,
};
use crate::model::{
    ExportSpec, NamespaceSpec, NamespaceState, SUBSYSTEMS, SubsystemState, TargetState,
};
use crate::names::{NamespaceId, PortId};

/// Plans the changes that make `observed` hold `spec` (creating, repairing or updating it).
pub fn plan_export(observed: &TargetState, spec: &ExportSpec) -> Result<ExportPlan, PlanError> {
    let nqn = spec.nqn.as_str();
    if !spec.nqn.is_pillar() {
        return Err(PlanError::ForeignSubsystem {
            nqn: nqn.to_owned(),
        });
    }
    let mut plan = ExportPlan {
        ops: Vec::new(),
        adoptions: Vec::new(),
        effective: spec.clone(),
        replan_after: None,
        live_without_reservations: Vec::new(),
    };
    let existing = observed.subsystem(&spec.nqn);
    let empty = Default::default();
    let current = existing.unwrap_or(&empty);
    let linked_ports: BTreeSet<PortId> = observed.ports_linking(nqn).collect();

    // 1. The subsystem and its serial, before any port link.
    plan_subsystem(existing, spec, &linked_ports, &mut plan);

    // 2. Namespaces: configure fully, then enable while some host is admitted; disable while
    //    none is (W7). Never touch a live one's identity or device. Before the ACL changes, so
    //    the first admitted host finds the namespace enabled when it connects.
    plan_namespaces(observed, current, spec, &mut plan)?;

    // 3. Host access, in the order the kernel accepts.
    let host_ops = plan_access(
        observed,
        nqn,
        current.allow_any_host,
        &current.allowed_hosts,
        &spec.access,
    );
    plan.ops.extend(host_ops);

    // 4. Ports last: the subsystem becomes reachable only once fully configured.
    for (port, want) in &spec.ports {
        push_port_link(
            observed,
            nqn,
            *port,
            Some(want),
            &linked_ports,
            &mut plan.ops,
        )?;
    }
    for port in &linked_ports {
        if !spec.ports.contains_key(port) {
            plan.ops.push(Op::Unlink {
                path: port_dir(*port).join(SUBSYSTEMS).join(nqn),
            });
            push_port_cleanup(observed, *port, nqn, &mut plan.ops);
        }
    }
    push_host_cleanup(
        observed,
        nqn,
        &current.allowed_hosts,
        &spec.access,
        &mut plan.ops,
    );
    Ok(plan)
}

/// Step 1 of [`plan_export`]: the subsystem, and its serial unless a host may have identified
/// it (then the live serial is adopted).
fn plan_subsystem(
    existing: Option<&SubsystemState>,
    spec: &ExportSpec,
    linked_ports: &BTreeSet<PortId>,
    plan: &mut ExportPlan,
) {
    let sdir = subsys_dir(spec.nqn.as_str());
    let empty = SubsystemState::default();
    let current = existing.unwrap_or(&empty);
    if existing.is_none() {
        plan.ops.push(Op::Mkdir { path: sdir.clone() });
    }
    if current.serial != spec.serial.as_str() {
        if existing.is_some_and(|sub| serial_may_be_frozen(sub, linked_ports)) {
            plan.adoptions.push(Adoption::Serial {
                live: current.serial.clone(),
                desired: spec.serial.to_string(),
            });
            plan.effective.serial = crate::identity::Serial::parse(&current.serial)
                .unwrap_or_else(|_| spec.serial.clone());
        } else {
            plan.ops
                .push(write(sdir.join("attr_serial"), spec.serial.as_str()));
        }
    }
}

/// Step 2 of [`plan_export`]: each namespace `spec` names (enabled ones kept as they are, new
/// or disabled ones configured), and those it does not name removed.
fn plan_namespaces(
    observed: &TargetState,
    current: &SubsystemState,
    spec: &ExportSpec,
    plan: &mut ExportPlan,
) -> Result<(), PlanError> {
    let nqn = spec.nqn.as_str();
    let admitted = spec.access.admits_a_host();
    for (nsid, want) in &spec.namespaces {
        match current.namespaces.get(nsid) {
            Some(live) if live.enabled => {
                plan_live_namespace(nqn, *nsid, live, want, admitted, plan)?;
            }
            found => plan_namespace(observed, nqn, *nsid, found, want, admitted, plan),
        }
    }
    for (nsid, live) in &current.namespaces {
        if !spec.namespaces.contains_key(nsid) {
            let dir = ns_dir(nqn, *nsid);
            if live.enabled {
                plan.ops.push(write(dir.join("enable"), "0"));
            }
            plan.ops.push(Op::Rmdir { path: dir });
        }
    }
    Ok(())
}

/// Step 2 of [`plan_export`] for an enabled namespace: its device must be the one wanted
/// (refused otherwise), a live identity is adopted (I4), and it is disabled when no host is
/// admitted (W7).
fn plan_live_namespace(
    nqn: &str,
    nsid: NamespaceId,
    live: &NamespaceState,
    want: &NamespaceSpec,
    admitted: bool,
    plan: &mut ExportPlan,
) -> Result<(), PlanError> {
    let live_path = live.device_path.clone().unwrap_or_default();
    if live_path != want.device_path {
        return Err(PlanError::LiveDeviceConflict {
            nqn: nqn.to_owned(),
            nsid,
            live: live_path.display().to_string(),
            desired: want.device_path.display().to_string(),
        });
    }
    // I4: whatever identity hosts see is kept, the kernel's random UUID with a
    // zero NGUID included.
    if let Some(live_id) = live.shown_identity().filter(|id| *id != want.identity) {
        plan.adoptions.push(Adoption::Namespace {
            nsid,
            live: live_id,
            desired: want.identity,
        });
        if let Some(ns) = plan.effective.namespaces.get_mut(&nsid) {
            ns.identity = live_id;
        }
    }
    if live.resv_enable == Some(false) {
        plan.live_without_reservations.push(nsid);
    }
    if !admitted {
        // The kernel returns from this write only when every command in flight
        // on the namespace has completed; identity and device stay configured.
        plan.ops.push(write(ns_dir(nqn, nsid).join("enable"), "0"));
    }
    Ok(())
}

/// Step 2 of [`plan_export`] for a namespace that is new or disabled: made, configured
/// (device, identity, reservations) and enabled when some host is admitted.
fn plan_namespace(
    observed: &TargetState,
    nqn: &str,
    nsid: NamespaceId,
    found: Option<&NamespaceState>,
    want: &NamespaceSpec,
    admitted: bool,
    plan: &mut ExportPlan,
) {
    let dir = ns_dir(nqn, nsid);
    // W9, K6, K21: reservations on where the kernel has them, before `enable`.
    // `Some(true)`: write `resv_enable=1`; `Some(false)`: nothing to write (already
    // on, or a kernel without it); `None`: a new namespace on a tree with nothing to
    // probe, so the caller re-plans once the directory exists.
    let resv = match found {
        Some(ns) => ns.resv_enable.map(|on| !on),
        None => observed.reservations(),
    };
    let ops = &mut plan.ops;
    if found.is_none() {
        ops.push(Op::Mkdir { path: dir.clone() });
        if resv.is_none() && plan.replan_after.is_none() {
            plan.replan_after = Some(ops.len() - 1);
        }
    }
    let found = found.cloned().unwrap_or_default();
    if found.device_path.as_deref() != Some(want.device_path.as_path()) {
        ops.push(write(
            dir.join("device_path"),
            want.device_path.display().to_string(),
        ));
    }
    if found.uuid != Some(want.identity.uuid) {
        ops.push(write(
            dir.join("device_uuid"),
            want.identity.uuid.hyphenated().to_string(),
        ));
    }
    if found.nguid != Some(want.identity.nguid) {
        ops.push(write(
            dir.join("device_nguid"),
            want.identity.nguid.to_string(),
        ));
    }
    if resv == Some(true) {
        ops.push(write(dir.join("resv_enable"), "1"));
    }
    if admitted {
        ops.push(write(dir.join("enable"), "1"));
    }
}

/// Whether a host may have identified the subsystem `sub`, so that the kernel refuses a new
/// serial (K: `attr_serial` after Identify is EINVAL, until the subsystem is removed). configfs
/// shows neither the identification nor a port link that is gone: a subsystem linked once and
/// unlinked since (an unexport interrupted after its first step, a cut whose link back failed)
/// looks like one never linked. pillar writes the serial right after the subsystem's mkdir,
/// before anything else, so only a subsystem as its mkdir left it (no namespace, no host, no
/// `allow_any_host`, no port link: the state a crash between the mkdir and the serial write
/// leaves) is certainly unseen; the serial of any other is kept (adopted, and recorded by the
/// agent with the rest of the identity, I4).
fn serial_may_be_frozen(sub: &SubsystemState, linked: &BTreeSet<PortId>) -> bool {
    !linked.is_empty()
        || sub.allow_any_host
        || !sub.allowed_hosts.is_empty()
        || !sub.namespaces.is_empty()
}
