//! The agent's gRPC edge: what its handlers (`pillar_agent::grpc`) make of the fields a client
//! (the controller, or whoever reaches the socket) sends, through the field parsers the
//! handlers use (`pillar_agent::grpc::fuzzing`).
//!
//! The first input byte chooses the request; the rest is its protobuf encoding, decoded with
//! prost as tonic does (bytes prost refuses never reach pillar). Properties:
//! - No panic; every refusal is INVALID_ARGUMENT, decided before anything runs.
//! - What is accepted is what was sent: a volume ID, snapshot ID or host NQN equals the text
//!   sent; a size is the bytes sent, between 1 and `MAX_VOLUME_BYTES`; a port is the one sent.
//! - A resync refuses each bad export alone: the others still parse.

use pillar_agent::backend::{ContentSource, MAX_VOLUME_BYTES};
use pillar_agent::grpc::fuzzing as edge;
use pillar_agent::service::AgentError;
use pillar_agent_api::v1 as api;
use pillar_nvmet::VolumeId;
use prost::Message;
use tonic::Code;

pub fn check(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    // A decode error is prost's answer (tonic's INVALID_ARGUMENT), not pillar's.
    let _ = match which % 8 {
        0 => api::CreateVolumeRequest::decode(body).map(|r| create_volume(&r)),
        1 => api::CreateSnapshotRequest::decode(body).map(|r| create_snapshot(&r)),
        2 => api::ExpandVolumeRequest::decode(body).map(|r| {
            accepted(edge::volume_id(&r.volume_id), &r.volume_id);
            size(r.size_bytes);
        }),
        3 => api::DeleteVolumeRequest::decode(body)
            .map(|r| accepted(edge::volume_id(&r.volume_id), &r.volume_id)),
        4 => api::GrantInitiatorRequest::decode(body).map(|r| {
            accepted(edge::volume_id(&r.volume_id), &r.volume_id);
            host(&r.host_nqn);
        }),
        5 => api::ExportRequest::decode(body).map(export),
        6 => {
            api::ResyncExportsRequest::decode(body).map(|r| r.exports.into_iter().for_each(export))
        }
        _ => api::DeleteSnapshotRequest::decode(body).map(|r| {
            accepted(
                edge::snapshot_id("snapshot_id", &r.snapshot_id),
                &r.snapshot_id,
            );
        }),
    };
}

/// A refusal is INVALID_ARGUMENT; an accepted ID is the text sent.
fn accepted(parsed: Result<VolumeId, AgentError>, sent: &str) {
    match parsed {
        Ok(v) => assert_eq!(v.as_str(), sent, "accepted as something else"),
        Err(e) => refused(&e),
    }
}

fn refused(e: &AgentError) {
    assert_eq!(edge::code(e), Code::InvalidArgument, "{e}");
}

fn size(raw: u64) {
    match edge::size(raw) {
        Ok(bytes) => {
            assert_eq!(bytes, raw);
            assert!((1..=MAX_VOLUME_BYTES).contains(&bytes), "{bytes}");
        }
        Err(e) => {
            refused(&e);
            assert!(raw == 0 || raw > MAX_VOLUME_BYTES, "{raw} refused");
        }
    }
}

fn host(raw: &str) {
    match edge::host_nqn("host_nqn", raw) {
        Ok(h) => assert_eq!(h.as_str(), raw, "accepted as something else"),
        Err(e) => refused(&e),
    }
}

fn create_volume(r: &api::CreateVolumeRequest) {
    accepted(edge::volume_id(&r.volume_id), &r.volume_id);
    size(r.size_bytes);
    match edge::content_source(r.source.clone()) {
        Ok(None) => assert!(r.source.is_none()),
        Ok(Some((source, uid))) => {
            let sent = r.source.as_ref().expect("a source was sent");
            assert_eq!(uid, sent.lifecycle_uid);
            assert!(!uid.is_empty());
            use api::content_source::Source as S;
            match (source, &sent.source) {
                (ContentSource::Snapshot(id), Some(S::SnapshotId(s)))
                | (ContentSource::Volume(id), Some(S::VolumeId(s))) => assert_eq!(id.as_str(), s),
                (got, sent) => panic!("{got:?} parsed from {sent:?}"),
            }
        }
        Err(e) => refused(&e),
    }
}

fn create_snapshot(r: &api::CreateSnapshotRequest) {
    accepted(
        edge::snapshot_id("snapshot_id", &r.snapshot_id),
        &r.snapshot_id,
    );
    accepted(
        edge::snapshot_id("source_volume_id", &r.source_volume_id),
        &r.source_volume_id,
    );
}

fn export(r: api::ExportRequest) {
    let sent = r.clone();
    match edge::export_request(r) {
        Ok(e) => {
            assert_eq!(e.volume.as_str(), sent.volume_id);
            assert_eq!(e.pool, sent.pool);
            let protocol = sent.protocol.expect("a protocol was sent");
            assert_eq!(u32::from(e.protocol.service.get()), protocol.service);
            assert_eq!(e.protocol.acl, protocol.acl);
            assert!(
                e.allowed_hosts
                    .iter()
                    .all(|h| sent.allowed_host_nqns.iter().any(|s| s == h.as_str()))
            );
            assert!(
                sent.allowed_host_nqns
                    .iter()
                    .all(|s| e.allowed_hosts.iter().any(|h| h.as_str() == s))
            );
            let token = sent.token.map(|t| (t.lifecycle_uid, t.generation));
            assert_eq!(e.token.map(|t| (t.uid, t.generation)), token);
        }
        Err(e) => refused(&e),
    }
}
