//! NodeExpandVolume in the simulation, step by step and without faults: the kernel double
//! shows a grown namespace only once rescanned, the real node plugin grows the filesystem and
//! answers the codes kubelet expects, and invariant 9 catches a node expansion that is
//! acknowledged but not kept, or claims more than the device holds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;

use pillar_csi::controller::volume_id_for_name;
use pillar_csi::csi::volume_capability::access_mode::Mode;
use pillar_csi::node::Kernel;
use pillar_csi::{context, csi};
use pillar_nvmet::SubsystemNqn;
use pillar_state::StateStore;

use crate::chaos::{Chaos, Knobs};
use crate::host::{Publication, SharedHost, lock_host};
use crate::invariants::{Invariant, Violation};
use crate::kernel::{Broken, filesystem_bytes_in};
use crate::ops::{acknowledge_node_expansion, capability};
use crate::world::{Config, World, host, temp_root};

const MIB: u64 = 1 << 20;

/// Runs `test` on a fault-free world, as a seed runs: one paused current-thread runtime, the
/// agents' blocking work on it.
fn on_a_world<F>(test: impl FnOnce(World) -> F)
where
    F: std::future::Future<Output = ()>,
{
    let _claim = pillar_agent::blocking::claim_thread(pillar_agent::blocking::Deferral::default);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let dir = temp_root().unwrap();
    let chaos = Chaos::new(7, Knobs::default());
    chaos.disable();
    let config = Config::default();
    runtime.block_on(async {
        let w = World::build(&config, &chaos, dir.path()).await.unwrap();
        w.replicas[0].resync_waiting_agents().await;
        test(w).await;
    });
    runtime.shutdown_background();
}

fn id(name: &str) -> String {
    volume_id_for_name(name).unwrap().to_string()
}

/// The host of `node`, `variant` and its node ID.
fn host_of(w: &World, node: u32, variant: u32) -> (usize, SharedHost, String) {
    let index = usize::try_from((node - 1) * 2 + variant).unwrap();
    (
        index,
        Arc::clone(&w.hosts[index]),
        format!("node-{node}/{}", host(node, variant)),
    )
}

async fn create(w: &World, name: &str) {
    let req = csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: i64::try_from(16 * MIB).unwrap(),
            limit_bytes: 0,
        }),
        volume_capabilities: vec![capability(Mode::SingleNodeWriter)],
        parameters: HashMap::from([(
            pillar_csi::controller::params::AGENT.to_owned(),
            "storage-0".to_owned(),
        )]),
        ..Default::default()
    };
    w.replicas[0].create_volume(req).await.unwrap();
}

/// ControllerPublish to `node_id` in `mode`, then the kubelet's NodeStage with the node's
/// secrets.
async fn publish_and_stage(w: &World, host: &SharedHost, vol: &str, node_id: &str, mode: Mode) {
    let cap = capability(mode);
    let answer = w.replicas[0]
        .publish(csi::ControllerPublishVolumeRequest {
            volume_id: vol.into(),
            node_id: node_id.into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    let publication = Publication {
        context: answer.publish_context,
        capability: cap,
        readonly: false,
    };
    let (node, host_nqn) = node_id.split_once('/').unwrap();
    let c = w.store.node_credentials(node, host_nqn).await.unwrap();
    let secrets = HashMap::from([
        (context::SECRET_DHCHAP.to_owned(), c.secret),
        (context::SECRET_DHCHAP_CTRL.to_owned(), c.ctrl_secret),
    ]);
    w.fabric
        .stage(host, vol, &publication, &secrets)
        .await
        .unwrap();
}

/// ControllerExpandVolume to `bytes`: answered with `node_expansion_required`.
async fn controller_expand(w: &World, vol: &str, bytes: u64) {
    let answer = w.replicas[0]
        .expand(csi::ControllerExpandVolumeRequest {
            volume_id: vol.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: i64::try_from(bytes).unwrap(),
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(u64::try_from(answer.capacity_bytes).unwrap(), bytes);
    assert!(answer.node_expansion_required);
}

/// NodeExpandVolume as the kubelet sends it at the staging path, its answer acknowledged as the
/// simulation's kubelet does.
async fn node_expand(
    w: &World,
    index: usize,
    host: &SharedHost,
    vol: &str,
    bytes: u64,
) -> Result<u64, String> {
    let cap = capability(Mode::SingleNodeWriter);
    let answered = w.fabric.expand(host, vol, None, &cap, bytes).await?;
    acknowledge_node_expansion(
        host,
        index,
        &w.store,
        &w.node_expansions,
        vol.to_owned(),
        answered,
    );
    Ok(answered)
}

/// The size the host's device of `vol` shows.
fn device_size(host: &SharedHost, vol: &str) -> u64 {
    let h = lock_host(host);
    let nqn = SubsystemNqn::parse(&h.staged()[vol].nqn).unwrap();
    let found = h.kernel().namespaces(&nqn, None).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    found[0].size_bytes
}

/// The filesystem's size on `vol`'s disk (its pool file on storage-0).
fn filesystem_bytes(w: &World, vol: &str) -> Option<u64> {
    filesystem_bytes_in(&w.agents[0].pool.join(format!("{vol}.img"))).unwrap()
}

fn expect_violation(w: &mut World) -> Violation {
    w.check().unwrap().expect("invariant 9 breaks")
}

// The kernel double behaves as the kernel where NodeExpandVolume relies on it: a namespace the
// target grew keeps its old size on the host until a rescan; the plugin rescans, grows the
// filesystem to the new size and answers it; invariant 9 holds.
#[test]
fn a_node_expansion_rescans_grows_the_filesystem_and_is_kept() {
    on_a_world(|mut w| async move {
        let vol = id("vol-0");
        create(&w, "vol-0").await;
        let (index, host, node_id) = host_of(&w, 1, 0);
        publish_and_stage(&w, &host, &vol, &node_id, Mode::SingleNodeWriter).await;
        assert_eq!(filesystem_bytes(&w, &vol), Some(16 * MIB));
        controller_expand(&w, &vol, 20 * MIB).await;
        // The target grew; the host has not scanned it yet.
        let staged = lock_host(&host).staged()[&vol].clone();
        assert_eq!(lock_host(&host).namespace_bytes(&staged), Some(20 * MIB));
        assert_eq!(device_size(&host, &vol), 16 * MIB);
        assert_eq!(
            node_expand(&w, index, &host, &vol, 20 * MIB).await,
            Ok(20 * MIB)
        );
        assert_eq!(device_size(&host, &vol), 20 * MIB);
        assert_eq!(filesystem_bytes(&w, &vol), Some(20 * MIB));
        assert!(w.check().unwrap().is_none());
        // Kubelet's retry answers the same, and the expansion outlives an agent crash.
        assert_eq!(
            node_expand(&w, index, &host, &vol, 20 * MIB).await,
            Ok(20 * MIB)
        );
        w.agents[0].crash(false).await;
        w.agents[0].start().await.unwrap();
        assert!(w.check().unwrap().is_none());
    });
}

// NodeExpandVolume answers the CSI codes kubelet expects: NOT_FOUND where the volume is not
// staged; FAILED_PRECONDITION for a read-only stage (kubelet then lets the pod's mount go on),
// whose filesystem is not written (N5); UNAVAILABLE while the device is smaller than asked
// (kubelet retries).
#[test]
fn node_expansion_answers_the_codes_kubelet_expects() {
    on_a_world(|w| async move {
        let vol = id("vol-0");
        create(&w, "vol-0").await;
        let (index, writer, writer_id) = host_of(&w, 1, 0);
        let (ro_index, reader, reader_id) = host_of(&w, 2, 0);
        let err = node_expand(&w, ro_index, &reader, &vol, 20 * MIB)
            .await
            .unwrap_err();
        assert!(err.starts_with("NotFound:"), "{err}");
        // A writer formats the volume, then leaves it to readers.
        publish_and_stage(&w, &writer, &vol, &writer_id, Mode::SingleNodeWriter).await;
        let err = node_expand(&w, index, &writer, &vol, 20 * MIB)
            .await
            .unwrap_err();
        assert!(err.starts_with("Unavailable:"), "{err}");
        w.fabric.unstage(&writer, &vol).unwrap();
        w.replicas[0]
            .unpublish(csi::ControllerUnpublishVolumeRequest {
                volume_id: vol.clone(),
                node_id: writer_id,
                ..Default::default()
            })
            .await
            .unwrap();
        publish_and_stage(&w, &reader, &vol, &reader_id, Mode::MultiNodeReaderOnly).await;
        assert!(lock_host(&reader).staged()[&vol].read_only);
        controller_expand(&w, &vol, 20 * MIB).await;
        let err = node_expand(&w, ro_index, &reader, &vol, 20 * MIB)
            .await
            .unwrap_err();
        assert!(
            err.starts_with("FailedPrecondition:") && err.contains("read-only"),
            "{err}"
        );
        assert_eq!(filesystem_bytes(&w, &vol), Some(16 * MIB));
    });
}

// proves invariant 9 (an acknowledged node expansion is never lost): a kernel whose grow
// answers success and grows nothing makes the plugin acknowledge a capacity the filesystem
// does not hold; the check reports it.
#[test]
fn invariant_9_catches_an_expansion_acknowledged_without_growing() {
    on_a_world(|mut w| async move {
        let vol = id("vol-0");
        create(&w, "vol-0").await;
        let (index, host, node_id) = host_of(&w, 1, 0);
        publish_and_stage(&w, &host, &vol, &node_id, Mode::SingleNodeWriter).await;
        controller_expand(&w, &vol, 20 * MIB).await;
        lock_host(&host).kernel().set_broken(Broken::GrowIsNoop);
        assert_eq!(
            node_expand(&w, index, &host, &vol, 20 * MIB).await,
            Ok(20 * MIB)
        );
        assert_eq!(filesystem_bytes(&w, &vol), Some(16 * MIB));
        let v = expect_violation(&mut w);
        assert_eq!(v.invariant, Invariant::NodeExpansionKept, "{v}");
        assert!(v.detail.contains("holds Some(16777216)"), "{v}");
    });
}

// proves invariant 9 (a node expansion never claims more than the device holds): a device
// showing more than its namespace holds makes the plugin answer that; the check reports it.
#[test]
fn invariant_9_catches_an_expansion_claiming_more_than_the_device_holds() {
    on_a_world(|mut w| async move {
        let vol = id("vol-0");
        create(&w, "vol-0").await;
        let (index, host, node_id) = host_of(&w, 1, 0);
        publish_and_stage(&w, &host, &vol, &node_id, Mode::SingleNodeWriter).await;
        controller_expand(&w, &vol, 20 * MIB).await;
        lock_host(&host).kernel().set_broken(Broken::SizeOverstated);
        assert_eq!(
            node_expand(&w, index, &host, &vol, 20 * MIB).await,
            Ok(21 * MIB)
        );
        let v = expect_violation(&mut w);
        assert_eq!(v.invariant, Invariant::NodeExpansionKept, "{v}");
        assert!(v.detail.contains("namespace held 20971520"), "{v}");
    });
}
