//! CreateVolume sizes a volume so the node can make its filesystem (issue 21): mkfs.xfs refuses
//! anything under 300 MiB, so an XFS volume smaller than that was created and then failed every
//! NodeStage. Through the controller's real gRPC service and a real agent (file pool), on the
//! embedded store.

#![allow(clippy::unwrap_used)]

mod support;

use pillar_csi::csi;
use pillar_state::crd::{FsType, NvmeTcp, PillarProtocolSpec};
use support::{Env, Mode, StoreKind, cap, create};
use tonic::Code;

const MIB: i64 = 1 << 20;
/// mkfs.xfs's minimum (xfsprogs 6.1 here: 300 MiB makes a filesystem, 300 MiB - 512 does not).
const XFS_MIN: i64 = 300 * MIB;

fn with_fs(name: &str, fs_type: &str, required: i64, limit: i64) -> csi::CreateVolumeRequest {
    let mut c = cap(Mode::SingleNodeWriter);
    if let Some(csi::volume_capability::AccessType::Mount(m)) = c.access_type.as_mut() {
        m.fs_type = fs_type.into();
    }
    csi::CreateVolumeRequest {
        capacity_range: Some(csi::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }),
        volume_capabilities: vec![c],
        ..create(name, Mode::SingleNodeWriter)
    }
}

fn block(name: &str, required: i64) -> csi::CreateVolumeRequest {
    let mut req = with_fs(name, "", required, 0);
    req.volume_capabilities[0].access_type = Some(csi::volume_capability::AccessType::Block(
        csi::volume_capability::BlockVolume {},
    ));
    req
}

fn on_protocol(mut req: csi::CreateVolumeRequest, protocol: &str) -> csi::CreateVolumeRequest {
    req.parameters
        .insert("pillar.io/protocol".into(), protocol.into());
    req
}

async fn capacity(env: &Env, req: csi::CreateVolumeRequest) -> Result<i64, tonic::Status> {
    let mut client = env.client.clone();
    let v = client
        .create_volume(req)
        .await?
        .into_inner()
        .volume
        .unwrap();
    Ok(v.capacity_bytes)
}

async fn recorded_size(env: &Env, volume: &str) -> Option<u64> {
    env.store
        .get_volume(volume)
        .await
        .unwrap()
        .map(|v| v.spec.size_bytes)
}

// Issue 21, defect 2: an XFS volume (the capability's fs_type, or the protocol's fsType when
// the capability names none) is rounded up to mkfs.xfs's minimum where limit_bytes allows, and
// refused with OUT_OF_RANGE (nothing recorded) where it does not; ext4 and block volumes keep
// their size. On the old code the 100 MiB XFS volume was created with 100 MiB.
#[tokio::test]
async fn an_xfs_volume_is_created_at_least_as_large_as_mkfs_xfs_needs() {
    let env = Env::start(StoreKind::Embedded, true).await;
    env.store
        .create_protocol(
            "nvme-xfs",
            PillarProtocolSpec {
                nvme_tcp: NvmeTcp {
                    fs_type: FsType::Xfs,
                    ..NvmeTcp::default()
                },
            },
        )
        .await
        .unwrap();
    let on_default = |req| on_protocol(req, "nvme-tcp");

    let got = capacity(&env, on_default(with_fs("x-small", "xfs", 100 * MIB, 0)))
        .await
        .unwrap();
    assert_eq!(got, XFS_MIN);
    assert_eq!(recorded_size(&env, "x-small").await, Some(XFS_MIN as u64));
    // The retry finds the same volume.
    let again = capacity(&env, on_default(with_fs("x-small", "xfs", 100 * MIB, 0)))
        .await
        .unwrap();
    assert_eq!(again, XFS_MIN);
    // Within a limit that allows it.
    let got = capacity(&env, on_default(with_fs("x-limit", "xfs", MIB, 400 * MIB)))
        .await
        .unwrap();
    assert_eq!(got, XFS_MIN);
    // The protocol's fsType decides when the capability names none.
    let got = capacity(
        &env,
        on_protocol(with_fs("x-proto", "", 64 * MIB, 0), "nvme-xfs"),
    )
    .await
    .unwrap();
    assert_eq!(got, XFS_MIN);
    // A limit below the minimum: OUT_OF_RANGE, and nothing recorded.
    let err = capacity(
        &env,
        on_default(with_fs("x-tight", "xfs", 100 * MIB, 200 * MIB)),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{}", err.message());
    assert!(
        err.message().contains("xfs") && err.message().contains(&XFS_MIN.to_string()),
        "{}",
        err.message()
    );
    assert_eq!(recorded_size(&env, "x-tight").await, None);

    // ext4, and block volumes even on an XFS protocol, keep the size asked for.
    let got = capacity(
        &env,
        on_protocol(with_fs("e-small", "ext4", 100 * MIB, 0), "nvme-xfs"),
    )
    .await
    .unwrap();
    assert_eq!(got, 100 * MIB);
    let got = capacity(&env, on_protocol(block("b-small", 100 * MIB), "nvme-xfs"))
        .await
        .unwrap();
    assert_eq!(got, 100 * MIB);
}
