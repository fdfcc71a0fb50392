//! The CustomResourceDefinitions and the objects' wire format.

use kube::CustomResourceExt;
use serde_json::json;

use crate::condition::ACL_DISABLED;
use crate::crd::{
    AccessMode, Condition, ConditionStatus, PillarAgent, PillarProtocol, PillarProtocolSpec,
    PillarVolumeState, PillarVolumeStateStatus, PublishedNode, crds_yaml,
};

#[test]
fn checked_in_crds_match_the_generated_ones() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/base/crds.yaml");
    let checked_in = std::fs::read_to_string(path).expect("deploy/base/crds.yaml");
    assert!(
        checked_in == crds_yaml().unwrap(),
        "deploy/base/crds.yaml is stale: regenerate it with \
         `cargo run -p pillar-state --bin crdgen > deploy/base/crds.yaml`"
    );
}

#[test]
fn crds_are_cluster_scoped_with_safe_short_names() {
    // Core short names (kubectl api-resources) that must not be shadowed.
    let core = [
        "cs", "cm", "ep", "ev", "limits", "ns", "no", "pvc", "pv", "po", "rc", "quota", "sa",
        "svc", "crd", "crds", "ds", "deploy", "rs", "sts", "hpa", "cj", "csr", "ing", "netpol",
        "pdb", "pc", "psp", "sc", "ep", "vol", "agent", "proto",
    ];
    for (crd, plural, short) in [
        (PillarVolumeState::crd(), "pillarvolumestates", "pillarvol"),
        (
            crate::crd::PillarSnapshotState::crd(),
            "pillarsnapshotstates",
            "pillarsnap",
        ),
        (PillarAgent::crd(), "pillaragents", "pillaragent"),
        (PillarProtocol::crd(), "pillarprotocols", "pillarproto"),
    ] {
        assert_eq!(crd.spec.group, "pillar-csi.io");
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.plural, plural);
        let shorts = crd.spec.names.short_names.clone().unwrap();
        assert_eq!(shorts, [short]);
        assert!(shorts.iter().all(|s| !core.contains(&s.as_str())));
        assert_eq!(crd.spec.versions.len(), 1);
        assert_eq!(crd.spec.versions[0].name, "v1alpha1");
    }
    let vol = PillarVolumeState::crd();
    let version = &vol.spec.versions[0];
    assert!(version.subresources.as_ref().unwrap().status.is_some());
    let columns: Vec<_> = version
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| (c.name.as_str(), c.json_path.as_str()))
        .collect();
    assert_eq!(
        columns,
        [
            ("Agent", ".spec.agent"),
            ("Size", ".spec.sizeBytes"),
            ("Nodes", ".status.publishedNodes[*].node"),
            ("Generation", ".status.publicationGeneration"),
            (
                "AclDisabled",
                ".status.conditions[?(@.type==\"AclDisabled\")].status"
            ),
            (
                "AuthDisabled",
                ".status.conditions[?(@.type==\"AuthDisabled\")].status"
            ),
            (
                "Revoking",
                ".status.conditions[?(@.type==\"Revoking\")].status"
            ),
            ("Deleting", ".status.deleting"),
            ("Age", ".metadata.creationTimestamp"),
        ]
    );
    // proves W6 (visible acl: false): conditions are a list map keyed by type, each with the
    // required fields of metav1.Condition.
    let schema = serde_json::to_value(&version.schema).unwrap();
    let conditions = &schema["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"];
    assert_eq!(conditions["x-kubernetes-list-type"], "map", "{conditions}");
    assert_eq!(conditions["x-kubernetes-list-map-keys"], json!(["type"]));
    let mut required: Vec<_> = conditions["items"]["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    required.sort_unstable();
    assert_eq!(required, ["lastTransitionTime", "reason", "status", "type"]);
    assert_eq!(
        conditions["items"]["properties"]["status"]["enum"],
        json!(["True", "False", "Unknown"])
    );
    // PillarAgent's status (what the resync loop saw) is a subresource: an operator's spec
    // edit never overwrites it; PillarProtocol has none.
    assert!(
        PillarAgent::crd().spec.versions[0]
            .subresources
            .as_ref()
            .is_some_and(|s| s.status.is_some())
    );
    assert!(
        PillarProtocol::crd().spec.versions[0]
            .subresources
            .as_ref()
            .is_none_or(|s| s.status.is_none())
    );
}

#[test]
fn status_is_camel_case_on_the_wire() {
    let status = PillarVolumeStateStatus {
        published_nodes: vec![PublishedNode {
            node: "n1".into(),
            host_nqn: "nqn.x".into(),
            access_mode: AccessMode::MultiNodeReaderOnly,
            readonly: true,
            revoking: false,
            recorded_generation: 0,
        }],
        publication_generation: 3,
        deleting: false,
        conditions: vec![Condition::new(
            ACL_DISABLED,
            ConditionStatus::True,
            "ProtocolAclOff",
            "m",
            Some(2),
            "2026-01-01T00:00:00Z",
        )],
    };
    assert_eq!(
        serde_json::to_value(&status).unwrap(),
        json!({
            "publishedNodes": [{
                "node": "n1", "hostNqn": "nqn.x", "accessMode": "MultiNodeReaderOnly",
                "readonly": true, "revoking": false, "recordedGeneration": 0
            }],
            "publicationGeneration": 3,
            "deleting": false,
            "conditions": [{
                "type": "AclDisabled", "status": "True", "observedGeneration": 2,
                "lastTransitionTime": "2026-01-01T00:00:00Z", "reason": "ProtocolAclOff",
                "message": "m"
            }]
        })
    );
    // An absent list or counter reads as empty / zero, never as an error.
    let empty: PillarVolumeStateStatus = serde_json::from_value(json!({})).unwrap();
    assert_eq!(empty, PillarVolumeStateStatus::default());
    // A record written before `deleting` and `recordedGeneration` existed still reads: not
    // deleting, and recorded at generation 0 (an unpublish of it names generation 0 too).
    let old: PillarVolumeStateStatus = serde_json::from_value(json!({
        "publishedNodes": [{
            "node": "n1", "hostNqn": "nqn.x", "accessMode": "SingleNodeWriter",
            "readonly": false, "revoking": false
        }],
        "publicationGeneration": 7
    }))
    .unwrap();
    assert!(!old.deleting);
    assert_eq!(old.published_nodes[0].recorded_generation, 0);
}

#[test]
fn access_modes_have_no_rwx() {
    // proves W3: no record can carry MULTI_NODE_MULTI_WRITER
    let err = serde_json::from_value::<AccessMode>(json!("MultiNodeMultiWriter"));
    assert!(err.is_err());
    let schema = serde_json::to_value(PillarVolumeState::crd()).unwrap();
    let modes = &schema["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["accessMode"]["enum"];
    assert_eq!(
        modes,
        &json!([
            "SingleNodeWriter",
            "SingleNodeSingleWriter",
            "SingleNodeMultiWriter",
            "SingleNodeReaderOnly",
            "MultiNodeReaderOnly",
            "MultiNodeSingleWriter"
        ])
    );
    assert!(AccessMode::MultiNodeReaderOnly.is_multi_node());
    assert!(!AccessMode::SingleNodeWriter.is_multi_node());
}

// proves W6's default: the ACL is on unless the PillarProtocol turns it off
#[test]
fn protocol_defaults() {
    for value in [json!({}), json!({ "nvmeTcp": {} })] {
        let spec: PillarProtocolSpec = serde_json::from_value(value).unwrap();
        let t = spec.nvme_tcp;
        assert_eq!(t.port, 4420);
        assert!(t.acl);
        assert_eq!(t.ctrl_loss_tmo, 600);
        assert_eq!(t.reconnect_delay, 10);
        assert_eq!(t.fs_type.as_str(), "ext4");
        assert!(t.mkfs_options.is_empty());
    }
    // The API server applies the same defaults from the schema.
    let crd = serde_json::to_value(PillarProtocol::crd()).unwrap();
    let props = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["nvmeTcp"]["properties"];
    assert_eq!(props["port"]["default"], 4420);
    assert_eq!(props["acl"]["default"], true);
    assert_eq!(props["ctrlLossTmo"]["default"], 600);
    assert_eq!(props["reconnectDelay"]["default"], 10);
    assert_eq!(props["fsType"]["default"], "ext4");
    assert_eq!(props["fsType"]["enum"], json!(["ext4", "xfs"]));
}
