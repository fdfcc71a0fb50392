//! EmbeddedStore on disk: durability, corruption, locking.

use std::fs;
use std::path::Path;

use crate::crd::{PillarVolumeState, PillarVolumeStateStatus};
use crate::embedded::{EmbeddedError, EmbeddedStore};
use crate::store::{Revision, StateStore, StoreError};
use crate::test_support::{agent_spec, protocol_spec, volume_spec};

fn rv(v: &PillarVolumeState) -> u64 {
    v.metadata
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap()
}

fn gen_status(generation: u64) -> PillarVolumeStateStatus {
    PillarVolumeStateStatus {
        published_nodes: vec![],
        publication_generation: generation,
        deleting: false,
        conditions: vec![],
    }
}

// proves W1: the record survives a restart (here: the single-machine controller's)
#[tokio::test]
async fn reopen_sees_the_same_objects_and_resource_versions() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let (vols, agents, protos) = {
        let store = EmbeddedStore::open(&dir).await.unwrap();
        let v = store
            .create_volume("vol-a", volume_spec("vol-a"))
            .await
            .unwrap();
        store
            .replace_volume_status("vol-a", &Revision::of(&v).unwrap(), gen_status(4))
            .await
            .unwrap();
        store
            .create_volume("vol-b", volume_spec("vol-b"))
            .await
            .unwrap();
        store
            .create_agent("agent-1", agent_spec("n1"))
            .await
            .unwrap();
        store
            .create_protocol("nvme-tcp", protocol_spec())
            .await
            .unwrap();
        (
            store.list_volumes().await.unwrap(),
            store.list_agents().await.unwrap(),
            store.list_protocols().await.unwrap(),
        )
    };
    let store = EmbeddedStore::open(&dir).await.unwrap();
    assert_eq!(store.list_volumes().await.unwrap(), vols);
    assert_eq!(store.list_agents().await.unwrap(), agents);
    assert_eq!(store.list_protocols().await.unwrap(), protos);
    assert_eq!(
        store.get_volume("vol-a").await.unwrap().unwrap().status,
        Some(gen_status(4))
    );
    let max_before = vols.iter().map(rv).max().unwrap();
    let c = store
        .create_volume("vol-c", volume_spec("vol-c"))
        .await
        .unwrap();
    assert!(rv(&c) > max_before);
}

// proves F3 (single-machine): resourceVersions are never handed out twice, even after a delete
// and a restart
#[tokio::test]
async fn resource_versions_are_not_reused_after_delete_and_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let deleted_rv = {
        let store = EmbeddedStore::open(&dir).await.unwrap();
        store
            .create_volume("vol-a", volume_spec("vol-a"))
            .await
            .unwrap();
        let b = store
            .create_volume("vol-b", volume_spec("vol-b"))
            .await
            .unwrap();
        let b = store
            .replace_volume_status("vol-b", &Revision::of(&b).unwrap(), gen_status(1))
            .await
            .unwrap();
        store
            .delete_volume("vol-b", &Revision::of(&b).unwrap())
            .await
            .unwrap();
        rv(&b)
    };
    let store = EmbeddedStore::open(&dir).await.unwrap();
    let b = store
        .create_volume("vol-b", volume_spec("vol-b"))
        .await
        .unwrap();
    assert!(rv(&b) > deleted_rv, "{} <= {deleted_rv}", rv(&b));
}

fn record(dir: &Path, name: &str) -> std::path::PathBuf {
    dir.join("volumes").join(format!("{name}.json"))
}

#[tokio::test]
async fn a_corrupt_record_is_an_error_never_a_default() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let store = EmbeddedStore::open(&dir).await.unwrap();
    store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let good = store
        .create_volume("vol-b", volume_spec("vol-b"))
        .await
        .unwrap();

    for garbage in [
        &b"{\"apiVersion\": \"pillar-csi.io/v1alpha1\", \"kind\""[..],
        b"",
        b"null",
    ] {
        fs::write(record(&dir, "vol-a"), garbage).unwrap();
        let err = store.get_volume("vol-a").await.unwrap_err();
        assert!(
            matches!(err, StoreError::Embedded(EmbeddedError::Corrupt { .. })),
            "{err:?}"
        );
        let err = store.list_volumes().await.unwrap_err();
        assert!(matches!(err, StoreError::Embedded(_)), "{err:?}");
        // A write to it fails too rather than starting from a guess.
        let err = store
            .replace_volume_status(
                "vol-a",
                &Revision {
                    uid: "u".into(),
                    resource_version: "1".into(),
                },
                gen_status(1),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Embedded(_)), "{err:?}");
    }
    // A record that parses but belongs to another name.
    fs::copy(record(&dir, "vol-b"), record(&dir, "vol-a")).unwrap();
    let err = store.get_volume("vol-a").await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Embedded(EmbeddedError::Inconsistent { .. })
        ),
        "{err:?}"
    );
    assert_eq!(store.get_volume("vol-b").await.unwrap().unwrap(), good);
}

#[tokio::test]
async fn a_corrupt_or_missing_counter_fails_open() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    {
        let store = EmbeddedStore::open(&dir).await.unwrap();
        store
            .create_volume("vol-a", volume_spec("vol-a"))
            .await
            .unwrap();
    }
    fs::write(dir.join("resource-version"), "seven").unwrap();
    let err = EmbeddedStore::open(&dir).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Embedded(EmbeddedError::CorruptCounter { .. })
        ),
        "{err:?}"
    );
    fs::remove_file(dir.join("resource-version")).unwrap();
    let err = EmbeddedStore::open(&dir).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Embedded(EmbeddedError::MissingCounter { .. })
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn only_one_opener_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let first = EmbeddedStore::open(&dir).await.unwrap();
    let err = EmbeddedStore::open(&dir).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Embedded(EmbeddedError::Locked { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains("in use"), "{err}");
    // Clones share the lock; dropping every handle releases it.
    let clone = first.clone();
    drop(first);
    assert!(EmbeddedStore::open(&dir).await.is_err());
    drop(clone);
    EmbeddedStore::open(&dir).await.unwrap();
}

#[tokio::test]
async fn records_are_kubernetes_shaped_json_and_no_temporary_files_remain() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let store = EmbeddedStore::open(&dir).await.unwrap();
    let v = store
        .create_volume("vol-a", volume_spec("vol-a"))
        .await
        .unwrap();
    let v = store
        .replace_volume_status("vol-a", &Revision::of(&v).unwrap(), gen_status(2))
        .await
        .unwrap();
    let on_disk: serde_json::Value =
        serde_json::from_slice(&fs::read(record(&dir, "vol-a")).unwrap()).unwrap();
    assert_eq!(on_disk["apiVersion"], "pillar-csi.io/v1alpha1");
    assert_eq!(on_disk["kind"], "PillarVolumeState");
    assert_eq!(on_disk["metadata"]["uid"], v.metadata.uid.clone().unwrap());
    assert_eq!(on_disk["status"]["publicationGeneration"], 2);
    assert_eq!(
        fs::read_to_string(dir.join("resource-version")).unwrap(),
        rv(&v).to_string()
    );
    for sub in ["", "volumes", "agents", "protocols"] {
        for entry in fs::read_dir(dir.join(sub)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            assert!(!name.ends_with(".tmp"), "temporary file left: {sub}/{name}");
        }
    }
}
