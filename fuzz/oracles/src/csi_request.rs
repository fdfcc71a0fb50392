//! The CSI edge: what the controller (`pillar_csi::controller::fuzzing`, the per-RPC request
//! parsers) and the node plugin (`pillar_csi::node::fuzzing`, the field parsers its handlers
//! apply in order) make of a request a client sends: IDs, capacity, capabilities, parameters,
//! topology, the node ID, page tokens, publish context.
//!
//! The first input byte chooses the RPC; the rest is the request's protobuf encoding, decoded
//! with prost as tonic does. Properties:
//! - No panic; a refusal carries the code CSI asks for: INVALID_ARGUMENT, but ABORTED for a
//!   page token never issued, NOT_FOUND for an unparsable node ID on unpublish and for a
//!   relative path of a volume reported on.
//! - What is accepted is what was sent: IDs equal the text sent, a node ID re-formats to the
//!   text sent, a page token is the one the controller issues for the entry it names, a
//!   volume ID for a name is the name itself or the name's hash, and the same for every retry.
//! - A size range accepted is satisfiable: the size created fits it.
//! - A stage context accepted is one the kernel is given whole: the subsystem is the volume's,
//!   the connect options pass their own check.

use std::collections::HashMap;
use std::path::Path;

use pillar_csi::controller::fuzzing::{self as controller, VolumeRef};
use pillar_csi::csi;
use pillar_csi::node::fuzzing::{self as node, AttachTarget};
use pillar_csi::node::{AttachMode, NodeError};
use pillar_nvmet::HostNqn;
use prost::Message;
use tonic::Code;

const HOST_NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555";

pub fn check(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    // A decode error is prost's answer (tonic's INVALID_ARGUMENT), not pillar's.
    let _ = match which % 13 {
        0 => csi::CreateVolumeRequest::decode(body).map(create),
        1 => csi::CreateSnapshotRequest::decode(body).map(|r| create_snapshot(&r)),
        2 => csi::DeleteVolumeRequest::decode(body)
            .map(|r| volume_ref(controller::delete(&r), &r.volume_id)),
        3 => csi::ControllerPublishVolumeRequest::decode(body).map(|r| publish(&r)),
        4 => csi::ControllerUnpublishVolumeRequest::decode(body).map(|r| unpublish(&r)),
        5 => csi::ControllerExpandVolumeRequest::decode(body).map(|r| expand(&r)),
        6 => csi::ValidateVolumeCapabilitiesRequest::decode(body).map(|r| validate(&r)),
        7 => csi::ListVolumesRequest::decode(body).map(|r| {
            page(controller::list(&r), &r.starting_token, r.max_entries);
        }),
        8 => csi::ListSnapshotsRequest::decode(body).map(|r| {
            page(
                controller::list_snapshots(&r),
                &r.starting_token,
                r.max_entries,
            );
        }),
        9 => csi::NodeStageVolumeRequest::decode(body).map(|r| node_stage(&r)),
        10 => csi::NodePublishVolumeRequest::decode(body).map(|r| {
            node_volume(&r.volume_id);
            node_path("target_path", &r.target_path);
            node_capability(r.volume_capability.as_ref());
            node_path("staging_target_path", &r.staging_target_path);
        }),
        11 => csi::NodeUnstageVolumeRequest::decode(body).map(|r| {
            node_volume(&r.volume_id);
            node_path("staging_target_path", &r.staging_target_path);
        }),
        _ => csi::NodeExpandVolumeRequest::decode(body).map(|r| {
            node_volume(&r.volume_id);
            published_path(&r.volume_path);
            node_capability(r.volume_capability.as_ref());
        }),
    };
}

fn controller_refused(e: &pillar_csi::controller::ControllerError, allowed: &[Code]) {
    let code = pillar_csi::controller::code_of(e);
    assert!(allowed.contains(&code), "{code:?}: {e}");
}

fn volume_ref(r: Result<VolumeRef, pillar_csi::controller::ControllerError>, sent: &str) {
    match r {
        Ok(VolumeRef::Pillar(v)) => assert_eq!(v.as_str(), sent),
        Ok(VolumeRef::Unknown(s)) => assert_eq!(s, sent),
        Err(e) => {
            assert!(sent.is_empty(), "{sent:?} refused: {e}");
            controller_refused(&e, &[Code::InvalidArgument]);
        }
    }
}

/// The volume (or snapshot) ID for a name: the name itself or its hash, the same every time.
fn id_for_name(name: &str, got: &pillar_nvmet::VolumeId) {
    let again = controller::volume_id_for_name(name).expect("accepted once, accepted again");
    assert_eq!(&again, got, "a retry of {name:?} names another volume");
    let hashed = got
        .as_str()
        .strip_prefix("pillar-")
        .is_some_and(|h| h.len() == 32);
    assert!(got.as_str() == name || hashed, "{name:?} -> {got}");
}

fn create(r: csi::CreateVolumeRequest) {
    let sent = r.clone();
    match controller::create(r) {
        Ok(c) => {
            id_for_name(&sent.name, &c.volume);
            assert!(
                c.size.fits(c.size.size()),
                "{:?} does not fit its own size",
                c.size
            );
            assert_eq!(c.parameters, sent.parameters);
            assert_eq!(c.topology, sent.accessibility_requirements);
        }
        Err(e) => controller_refused(&e, &[Code::InvalidArgument]),
    }
}

fn create_snapshot(r: &csi::CreateSnapshotRequest) {
    match controller::create_snapshot(r) {
        Ok((snapshot, source)) => {
            id_for_name(&r.name, &snapshot);
            volume_ref(Ok(source), &r.source_volume_id);
        }
        Err(e) => controller_refused(&e, &[Code::InvalidArgument]),
    }
}

fn publish(r: &csi::ControllerPublishVolumeRequest) {
    match controller::publish(r) {
        Ok(p) => {
            volume_ref(Ok(p.volume), &r.volume_id);
            assert_eq!(p.node_id, r.node_id);
            if let Ok(n) = p.node {
                assert_eq!(format!("{}/{}", n.node, n.host_nqn), r.node_id);
            }
            assert_eq!(p.readonly, r.readonly);
        }
        Err(e) => controller_refused(&e, &[Code::InvalidArgument]),
    }
}

fn unpublish(r: &csi::ControllerUnpublishVolumeRequest) {
    match controller::unpublish(r) {
        Ok(u) => {
            volume_ref(Ok(u.volume), &r.volume_id);
            match u.node {
                None => assert!(r.node_id.is_empty()),
                Some(n) => assert!(r.node_id.starts_with(&format!("{n}/"))),
            }
        }
        Err(e) => controller_refused(&e, &[Code::InvalidArgument, Code::NotFound]),
    }
}

fn expand(r: &csi::ControllerExpandVolumeRequest) {
    match controller::expand(r) {
        Ok(e) => {
            volume_ref(Ok(e.volume), &r.volume_id);
            let sent = r.capacity_range.as_ref().map_or(0, |c| c.required_bytes);
            assert_eq!(i128::from(e.required), i128::from(sent.max(1)));
        }
        Err(e) => controller_refused(&e, &[Code::InvalidArgument]),
    }
}

fn validate(r: &csi::ValidateVolumeCapabilitiesRequest) {
    match controller::validate(r) {
        Ok((volume, caps)) => {
            volume_ref(Ok(volume), &r.volume_id);
            assert_eq!(caps.len(), r.volume_capabilities.len());
        }
        Err(e) => controller_refused(&e, &[Code::InvalidArgument]),
    }
}

fn page(
    r: Result<controller::Page, pillar_csi::controller::ControllerError>,
    token: &str,
    max: i32,
) {
    match r {
        Ok(p) => {
            match p.after {
                None => assert!(token.is_empty()),
                Some(after) => assert_eq!(controller::page_token(after.as_str()), token),
            }
            assert_eq!(i64::try_from(p.max).ok(), Some(i64::from(max)));
        }
        Err(e) => controller_refused(&e, &[Code::InvalidArgument, Code::Aborted]),
    }
}

fn node_refused(e: &NodeError, allowed: &[Code]) {
    let code = pillar_csi::node::code_of(e);
    assert!(allowed.contains(&code), "{code:?}: {e}");
}

fn node_volume(sent: &str) -> Option<pillar_nvmet::VolumeId> {
    match node::volume_id(sent) {
        Ok(v) => {
            assert_eq!(v.as_str(), sent);
            Some(v)
        }
        Err(e) => {
            node_refused(&e, &[Code::InvalidArgument]);
            None
        }
    }
}

fn node_path(field: &'static str, sent: &str) {
    match node::path(field, sent) {
        Ok(p) => assert!(p == Path::new(sent) && p.is_absolute(), "{p:?}"),
        Err(e) => node_refused(&e, &[Code::InvalidArgument]),
    }
}

fn published_path(sent: &str) {
    match node::published_path("volume_path", sent) {
        Ok(p) => assert!(p == Path::new(sent) && p.is_absolute(), "{p:?}"),
        Err(e) => node_refused(&e, &[Code::InvalidArgument, Code::NotFound]),
    }
}

fn node_capability(cap: Option<&csi::VolumeCapability>) {
    if let Err(e) = node::capability(cap) {
        node_refused(&e, &[Code::InvalidArgument]);
    }
}

fn node_stage(r: &csi::NodeStageVolumeRequest) {
    let volume = node_volume(&r.volume_id);
    node_path("staging_target_path", &r.staging_target_path);
    node_capability(r.volume_capability.as_ref());
    let Some(volume) = volume else { return };
    let host = HostNqn::parse(HOST_NQN).expect("a valid host NQN");
    for mode in [AttachMode::NvmeTcp, AttachMode::LocalDevice] {
        let hostid = uuid::Uuid::from_u128(1);
        match node::stage_context(&volume, &r.publish_context, &mode, &host, hostid) {
            Ok(ctx) => stage_context_accepted(&volume, &r.publish_context, &ctx),
            Err(e) => node_refused(&e, &[Code::InvalidArgument]),
        }
    }
}

fn stage_context_accepted(
    volume: &pillar_nvmet::VolumeId,
    sent: &HashMap<String, String>,
    ctx: &node::StageContext,
) {
    use pillar_csi::context as key;
    assert_eq!(ctx.nqn, volume.subsystem_nqn());
    let read_only = sent.get(key::READ_ONLY).map(String::as_str) == Some("true");
    assert_eq!(ctx.read_only, read_only);
    if let AttachTarget::Nvme(opts) = &ctx.target {
        assert!(opts.validate().is_ok(), "{opts:?}");
        assert!(opts.ctrl_loss_tmo >= -1);
        assert_eq!(opts.nqn, ctx.nqn);
        assert_eq!(
            sent.get(key::TRADDR).map(|a| a.parse().ok()),
            Some(Some(opts.traddr))
        );
    }
    if ctx.mkfs_options.is_empty() {
        let given = sent.get(key::MKFS_OPTIONS).map_or("", String::as_str);
        assert!(
            given.is_empty() || given.trim_start().starts_with('['),
            "{given:?}"
        );
    }
}
