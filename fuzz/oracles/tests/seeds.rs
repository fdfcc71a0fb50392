//! Writes the seed corpora of the targets whose inputs are encoded values (records, requests,
//! trees): `cargo test -p pillar-fuzz-oracles --test seeds -- --ignored`. The rewriter's seeds
//! come from `fuzz/make_seeds.py`. Seeds are small valid examples; libFuzzer mutates from there.

use std::collections::HashMap;
use std::path::Path;

use pillar_agent::fence::{self, Mark};
use pillar_agent::target::IdentityRecord;
use pillar_agent_api::v1 as api;
use pillar_csi::csi;
use prost::Message;

const VOLUME: &str = "pvc-1";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555";

fn write(target: &str, name: &str, data: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../corpus")
        .join(target);
    std::fs::create_dir_all(&dir).expect("corpus directory");
    std::fs::write(dir.join(name), data).expect("seed written");
}

fn with(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![kind];
    v.extend(body);
    v
}

#[test]
#[ignore = "writes the checked-in seed corpora"]
fn write_seed_corpora() {
    records();
    agent_requests();
    csi_requests();
    configfs();
    host_readers();
}

fn records() {
    let mark = Mark {
        volume: VOLUME.into(),
        owner_uid: "uid-a".into(),
        generation: 7,
        ended: false,
        retired_uids: vec!["uid-0".into()],
    };
    write(
        "records",
        "fence-mark",
        &with(0, &fence::encode(&mark).expect("encodes")),
    );
    let ended = Mark {
        ended: true,
        retired_uids: vec![],
        ..mark
    };
    write(
        "records",
        "fence-mark-ended",
        &with(0, &fence::encode(&ended).expect("encodes")),
    );
    let nqn = pillar_nvmet::VolumeId::parse(VOLUME)
        .expect("valid")
        .subsystem_nqn();
    let id = pillar_nvmet::NamespaceIdentity::derive(
        &nqn,
        pillar_nvmet::NamespaceId::parse("1").expect("nsid"),
    );
    let record = IdentityRecord {
        uuid: id.uuid.to_string(),
        nguid: id.nguid.to_string(),
        serial: pillar_nvmet::derive_serial(&nqn).to_string(),
    };
    write(
        "records",
        "identity",
        &with(1, &record.encode().expect("encodes")),
    );
    let stage = format!(
        r#"{{"version":1,"volume":"{VOLUME}","nqn":"{}","hostnqn":"{HOST}","traddr":"192.0.2.1","trsvcid":4420,"device":"nvme0n1","staging_path":"/var/lib/kubelet/s","mode":{{"kind":"filesystem","fs_type":"ext4"}},"phase":"mounted","reservation":true}}"#,
        nqn
    );
    write("records", "stage-fs", &with(2, stage.as_bytes()));
    let block = format!(
        r#"{{"version":1,"volume":"{VOLUME}","nqn":"{nqn}","hostnqn":"{HOST}","traddr":"::1","trsvcid":4420,"device":null,"staging_path":"/s","mode":{{"kind":"block"}},"phase":"connecting"}}"#
    );
    write("records", "stage-block", &with(2, block.as_bytes()));
}

fn token() -> Option<api::FencingToken> {
    Some(api::FencingToken {
        lifecycle_uid: "uid-a".into(),
        generation: 3,
    })
}

fn export() -> api::ExportRequest {
    api::ExportRequest {
        token: token(),
        volume_id: VOLUME.into(),
        pool: "p".into(),
        protocol: Some(api::ExportProtocol {
            service: 4420,
            acl: true,
            auth_none: true,
            tls: false,
        }),
        allowed_host_nqns: vec![HOST.into()],
        credentials: vec![],
    }
}

fn agent_requests() {
    let create = api::CreateVolumeRequest {
        token: token(),
        volume_id: VOLUME.into(),
        pool: "p".into(),
        size_bytes: 1 << 30,
        source: Some(api::ContentSource {
            source: Some(api::content_source::Source::SnapshotId("snap-1".into())),
            lifecycle_uid: "uid-s".into(),
        }),
    };
    write(
        "agent_request",
        "create-volume",
        &with(0, &create.encode_to_vec()),
    );
    let snap = api::CreateSnapshotRequest {
        token: token(),
        snapshot_id: "snap-1".into(),
        pool: "p".into(),
        source_volume_id: VOLUME.into(),
        source_lifecycle_uid: "uid-a".into(),
    };
    write(
        "agent_request",
        "create-snapshot",
        &with(1, &snap.encode_to_vec()),
    );
    let expand = api::ExpandVolumeRequest {
        token: token(),
        volume_id: VOLUME.into(),
        pool: "p".into(),
        size_bytes: 2 << 30,
    };
    write("agent_request", "expand", &with(2, &expand.encode_to_vec()));
    let grant = api::GrantInitiatorRequest {
        token: token(),
        volume_id: VOLUME.into(),
        host_nqn: HOST.into(),
        credentials: None,
    };
    write("agent_request", "grant", &with(4, &grant.encode_to_vec()));
    write(
        "agent_request",
        "export",
        &with(5, &export().encode_to_vec()),
    );
    let resync = api::ResyncExportsRequest {
        exports: vec![
            export(),
            api::ExportRequest {
                volume_id: "bad/id".into(),
                ..export()
            },
        ],
        state_epoch: "0b4c1f8e-3c2a-4d7e-9f10-2a6b5c8d9e01".into(),
    };
    write("agent_request", "resync", &with(6, &resync.encode_to_vec()));
}

fn capability() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter.into(),
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

fn csi_requests() {
    let nqn = pillar_nvmet::VolumeId::parse(VOLUME)
        .expect("valid")
        .subsystem_nqn()
        .to_string();
    let node_id = format!("worker-1/{HOST}");
    let create = csi::CreateVolumeRequest {
        name: "pvc-0a1b2c3d".into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 1 << 30,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![capability()],
        parameters: HashMap::from([("pillar.io/pool".into(), "p".into())]),
        accessibility_requirements: Some(csi::TopologyRequirement {
            requisite: vec![csi::Topology {
                segments: HashMap::from([("topology.pillar.io/agent".into(), "a".into())]),
            }],
            preferred: vec![],
        }),
        ..Default::default()
    };
    write("csi_request", "create", &with(0, &create.encode_to_vec()));
    let snap = csi::CreateSnapshotRequest {
        source_volume_id: VOLUME.into(),
        name: "snapshot-1".into(),
        ..Default::default()
    };
    write(
        "csi_request",
        "create-snapshot",
        &with(1, &snap.encode_to_vec()),
    );
    let publish = csi::ControllerPublishVolumeRequest {
        volume_id: VOLUME.into(),
        node_id: node_id.clone(),
        volume_capability: Some(capability()),
        readonly: false,
        ..Default::default()
    };
    write("csi_request", "publish", &with(3, &publish.encode_to_vec()));
    let unpublish = csi::ControllerUnpublishVolumeRequest {
        volume_id: VOLUME.into(),
        node_id,
        ..Default::default()
    };
    write(
        "csi_request",
        "unpublish",
        &with(4, &unpublish.encode_to_vec()),
    );
    let expand = csi::ControllerExpandVolumeRequest {
        volume_id: VOLUME.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 2 << 30,
            limit_bytes: 0,
        }),
        ..Default::default()
    };
    write("csi_request", "expand", &with(5, &expand.encode_to_vec()));
    let list = csi::ListVolumesRequest {
        max_entries: 2,
        starting_token: format!("after:{VOLUME}"),
    };
    write("csi_request", "list", &with(7, &list.encode_to_vec()));
    let stage = csi::NodeStageVolumeRequest {
        volume_id: VOLUME.into(),
        staging_target_path: "/var/lib/kubelet/staging/x".into(),
        volume_capability: Some(capability()),
        publish_context: HashMap::from([
            ("pillar.io/nqn".into(), nqn),
            ("pillar.io/traddr".into(), "192.0.2.1".into()),
            ("pillar.io/trsvcid".into(), "4420".into()),
            ("pillar.io/ctrlLossTmo".into(), "-1".into()),
            ("pillar.io/reconnectDelay".into(), "2".into()),
            ("pillar.io/localDevice".into(), "/dev/loop0".into()),
            ("pillar.io/mkfsOptions".into(), r#"["-m","0"]"#.into()),
            ("pillar.io/readOnly".into(), "false".into()),
        ]),
        ..Default::default()
    };
    write(
        "csi_request",
        "node-stage",
        &with(9, &stage.encode_to_vec()),
    );
    let node_publish = csi::NodePublishVolumeRequest {
        volume_id: VOLUME.into(),
        staging_target_path: "/var/lib/kubelet/staging/x".into(),
        target_path: "/var/lib/kubelet/pods/y".into(),
        volume_capability: Some(capability()),
        ..Default::default()
    };
    write(
        "csi_request",
        "node-publish",
        &with(10, &node_publish.encode_to_vec()),
    );
    let node_expand = csi::NodeExpandVolumeRequest {
        volume_id: VOLUME.into(),
        volume_path: "/var/lib/kubelet/pods/y".into(),
        ..Default::default()
    };
    write(
        "csi_request",
        "node-expand",
        &with(12, &node_expand.encode_to_vec()),
    );
}

fn configfs() {
    let sub = "nqn.2024-01.io.pillar:pvc-1";
    let host = HOST;
    let tree = format!(
        "d hosts/{host}
f subsystems/{sub}/attr_allow_any_host 0
f subsystems/{sub}/attr_serial 0123456789abcdef    
l subsystems/{sub}/allowed_hosts/{host} ../../../hosts/{host}
f subsystems/{sub}/namespaces/1/device_path /dev/loop0
f subsystems/{sub}/namespaces/1/device_uuid 6a1e0c9e-34f4-4c1e-9d55-0f2b4a8d7e11
f subsystems/{sub}/namespaces/1/device_nguid 6a1e0c9e-34f4-4c1e-9d55-0f2b4a8d7e11
f subsystems/{sub}/namespaces/1/enable 1
f subsystems/{sub}/namespaces/1/resv_enable 1
f ports/4420/addr_trtype tcp
f ports/4420/addr_adrfam ipv4
f ports/4420/addr_traddr 192.0.2.1
f ports/4420/addr_trsvcid 4420
d ports/4420/referrals
l ports/4420/subsystems/{sub} ../../../subsystems/{sub}
"
    );
    write("configfs", "one-export", tree.as_bytes());
    let any = format!(
        "f subsystems/{sub}/attr_allow_any_host 1
f subsystems/{sub}/attr_serial s
d subsystems/{sub}/allowed_hosts
f subsystems/{sub}/namespaces/1/device_path (null)
f subsystems/{sub}/namespaces/1/device_uuid 
f subsystems/{sub}/namespaces/1/device_nguid 00000000-0000-0000-0000-000000000000
f subsystems/{sub}/namespaces/1/enable 0
f ports/1/addr_trtype tcp
f ports/1/addr_adrfam ipv6
f ports/1/addr_traddr ::1
f ports/1/addr_trsvcid 4421
l ports/1/subsystems/{sub} ../../../subsystems/{sub}
l ports/1/subsystems/other ../../../subsystems/{sub}
"
    );
    write("configfs", "any-host-two-links", any.as_bytes());
}

fn host_readers() {
    let sub = "nqn.2024-01.io.pillar:pvc-1";
    let ctl = "devices/virtual/nvme-fabrics/ctl";
    let subsys = "devices/virtual/nvme-subsystem/nvme-subsys0";
    let attrs = |name: &str| {
        format!(
            "f {ctl}/{name}/subsysnqn {sub}\nf {ctl}/{name}/state live\nf {ctl}/{name}/transport tcp\n\
             f {ctl}/{name}/hostnqn {HOST}\nf {ctl}/{name}/address traddr=192.0.2.1,trsvcid=4420\n\
             l class/nvme/{name} ../../{ctl}/{name}\n"
        )
    };
    let disk = |name: &str, parent: &str| {
        format!(
            "l block/{name}/device ../../{parent}\nf block/{name}/size 2097152\n\
             f block/{name}/uuid 6a1e0c9e-34f4-4c1e-9d55-0f2b4a8d7e11\n\
             f block/{name}/nguid 6a1e0c9e-34f4-4c1e-9d55-0f2b4a8d7e11\n\
             f block/{name}/nsid 1\nf block/{name}/dev 259:0\nf block/{name}/hidden 0\n"
        )
    };
    // Multipath on: the disk hangs under the subsystem, which links its controller.
    let multipath = format!(
        "{}f {subsys}/subsysnqn {sub}\nl {subsys}/nvme0 ../../nvme-fabrics/ctl/nvme0\n{}",
        attrs("nvme0"),
        disk("nvme0n1", subsys)
    );
    write("host_readers", "sysfs-multipath", multipath.as_bytes());
    // Multipath off: the disk hangs under the controller; a hidden path disk beside it.
    let single = format!(
        "{}{}f block/nvme1c1n1/hidden 1\n",
        attrs("nvme1"),
        disk("nvme1n1", &format!("{ctl}/nvme1"))
    );
    write("host_readers", "sysfs-controller-parent", single.as_bytes());
    let mounts = "36 25 259:0 / /var/lib/kubelet/plugins/kubernetes.io/csi/pillar.csi.io/x/globalmount \
                  rw,relatime shared:1 - ext4 /dev/nvme0n1 rw\n\
                  37 36 259:0 /dir\\040with\\040space /mnt/b ro master:2 - xfs /dev/nvme0n1 ro,nouuid\n";
    write("host_readers", "mountinfo", mounts.as_bytes());
    write("host_readers", "connect-reply", b"instance=3,cntlid=17\n");
    write(
        "host_readers",
        "blkid",
        b"DEVNAME=/dev/nvme0n1\nUUID=0a1b\nBLOCK_SIZE=4096\nTYPE=xfs\nUSAGE=filesystem\n",
    );
    write(
        "host_readers",
        "logprint",
        b"xfs_logprint:\n    data device: 0x10300\nlog tail: 2 head: 2 state: <CLEAN>\n",
    );
    let mut sb = vec![0u8; 1024];
    sb[0x38..0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
    sb[0x60] = 0x04 | 0x40;
    write("host_readers", "ext4-superblock-recover", &sb);
    let mut report = vec![0u8; 64 + 2 * 64];
    report[0..4].copy_from_slice(&7u32.to_le_bytes());
    report[4] = 1;
    report[5..7].copy_from_slice(&2u16.to_le_bytes());
    let registrants = [(1u16, true, 0x1111u64, 0x10u8), (2, false, 0x2222, 0x11)];
    for (i, (cntlid, holds, key, host)) in registrants.into_iter().enumerate() {
        let e = &mut report[64 + i * 64..128 + i * 64];
        e[0..2].copy_from_slice(&cntlid.to_le_bytes());
        e[2] = u8::from(holds);
        e[8..16].copy_from_slice(&key.to_le_bytes());
        e[16..32].copy_from_slice(&[host; 16]);
    }
    write("host_readers", "resv-report-two", &report);
}
