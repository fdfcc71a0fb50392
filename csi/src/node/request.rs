//! Turning CSI requests into checked values: everything INVALID_ARGUMENT is decided here, before
//! any lock is taken or anything on the node is touched.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use pillar_host::{ConnectOptions, FsType};
use pillar_nvmet::{HostNqn, SubsystemNqn, VolumeId};
use uuid::Uuid;

use super::NodeError;
use super::config::AttachMode;
use crate::context;
use crate::csi::VolumeCapability;

/// A non-empty, valid pillar volume ID.
pub fn volume_id(id: &str) -> Result<VolumeId, NodeError> {
    if id.is_empty() {
        return Err(NodeError::MissingField("volume_id"));
    }
    VolumeId::parse(id).map_err(|source| NodeError::InvalidVolumeId {
        id: id.to_owned(),
        source,
    })
}

/// A non-empty absolute path.
pub fn path(field: &'static str, value: &str) -> Result<PathBuf, NodeError> {
    if value.is_empty() {
        return Err(NodeError::MissingField(field));
    }
    let p = Path::new(value);
    if !p.is_absolute() {
        return Err(NodeError::RelativePath {
            field,
            path: value.to_owned(),
        });
    }
    Ok(p.to_path_buf())
}

/// The path a published volume is reached at, for calls that report on it (stats, expand): a
/// path that is not absolute cannot name a mount of this host, so it is reported as not found
/// (the CSI spec's code when the volume is not at `volume_path`), after the empty check.
pub fn published_path(field: &'static str, value: &str) -> Result<PathBuf, NodeError> {
    if value.is_empty() {
        return Err(NodeError::MissingField(field));
    }
    let p = Path::new(value);
    if !p.is_absolute() {
        return Err(NodeError::VolumePathMissing {
            path: p.to_path_buf(),
        });
    }
    Ok(p.to_path_buf())
}

use crate::capability::CapabilityError;
pub(crate) use crate::capability::{Access, Capability};

/// Checks a volume capability with the parser the controller uses too.
pub fn capability(cap: Option<&VolumeCapability>) -> Result<Capability, NodeError> {
    let cap = cap.ok_or(NodeError::MissingField("volume_capability"))?;
    crate::capability::parse(cap).map_err(|e| match e {
        CapabilityError::Missing("access mode") => {
            NodeError::MissingField("volume_capability.access_mode")
        }
        CapabilityError::Missing(_) => NodeError::MissingField("volume_capability.access_type"),
        other => NodeError::UnsupportedCapability(other.to_string()),
    })
}

/// How to reach the volume's device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttachTarget {
    /// NVMe/TCP, with every connect option explicit (rule N1).
    Nvme(ConnectOptions),
    /// The single-machine mode: a local block device.
    Local {
        device: PathBuf,
        /// The export's address, when the context names one (recorded for the operator only).
        traddr: Option<IpAddr>,
        trsvcid: Option<u16>,
    },
}

/// What NodeStageVolume needs from `publish_context`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageContext {
    pub nqn: SubsystemNqn,
    pub target: AttachTarget,
    /// `FS_TYPE`, used when the capability names none.
    pub fs_type: Option<FsType>,
    /// `MKFS_OPTIONS`.
    pub mkfs_options: Vec<String>,
    /// `READ_ONLY`: the publication gives read access only, so the stage is read-only (N5).
    pub read_only: bool,
}

fn required<'a>(ctx: &'a HashMap<String, String>, key: &'static str) -> Result<&'a str, NodeError> {
    match ctx.get(key).map(String::as_str) {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(NodeError::MissingContext(key)),
    }
}

fn optional<'a>(ctx: &'a HashMap<String, String>, key: &'static str) -> Option<&'a str> {
    ctx.get(key).map(String::as_str).filter(|v| !v.is_empty())
}

fn parsed<T: std::str::FromStr>(key: &'static str, value: &str) -> Result<T, NodeError>
where
    T::Err: std::fmt::Display,
{
    value
        .parse()
        .map_err(|e: T::Err| NodeError::InvalidContext {
            key,
            value: value.to_owned(),
            reason: e.to_string(),
        })
}

/// The DH-HMAC-CHAP secrets a stage of `volume` connects with (W10): `None` when the publish
/// context says the export requires no authentication; the node's secrets from `secrets`
/// otherwise, refused (FAILED_PRECONDITION) when missing. Errors never carry a secret.
pub fn stage_auth(
    volume: &VolumeId,
    ctx: &HashMap<String, String>,
    secrets: &HashMap<String, String>,
) -> Result<Option<pillar_host::ConnectAuth>, NodeError> {
    use pillar_nvmet::DhchapSecret;
    match optional(ctx, context::AUTH) {
        Some("none") => return Ok(None),
        Some("dhchap") => {}
        Some(other) => {
            return Err(NodeError::InvalidContext {
                key: context::AUTH,
                value: other.to_owned(),
                reason: "must be \"dhchap\" or \"none\"".into(),
            });
        }
        None => return Err(NodeError::MissingContext(context::AUTH)),
    }
    let secret = |key: &'static str| -> Result<Option<DhchapSecret>, NodeError> {
        optional(secrets, key)
            .map(|v| {
                DhchapSecret::parse(v).map_err(|e| NodeError::InvalidSecret {
                    key,
                    reason: e.to_string(),
                })
            })
            .transpose()
    };
    let host = secret(context::SECRET_DHCHAP)?.ok_or_else(|| NodeError::MissingSecret {
        volume: volume.to_string(),
        key: context::SECRET_DHCHAP,
    })?;
    Ok(Some(pillar_host::ConnectAuth {
        secret: host,
        ctrl_secret: secret(context::SECRET_DHCHAP_CTRL)?,
    }))
}

/// The TLS PSK a stage connects with: `None` unless the publish context requires TLS; then
/// derived from the node's DH-HMAC-CHAP secret for this host and subsystem (the agent derives
/// the same one), refused (FAILED_PRECONDITION) without authentication, since there is no
/// secret to derive it from.
pub fn stage_tls(
    volume: &VolumeId,
    ctx: &HashMap<String, String>,
    opts: &ConnectOptions,
) -> Result<Option<pillar_nvmet::TlsPsk>, NodeError> {
    match optional(ctx, context::TLS) {
        None | Some("none") => return Ok(None),
        Some("required") => {}
        Some(other) => {
            return Err(NodeError::InvalidContext {
                key: context::TLS,
                value: other.to_owned(),
                reason: "must be \"required\" or \"none\"".into(),
            });
        }
    }
    let auth = opts.auth.as_ref().ok_or_else(|| NodeError::MissingSecret {
        volume: volume.to_string(),
        key: context::SECRET_DHCHAP,
    })?;
    Ok(Some(pillar_nvmet::TlsPsk::derive(
        &auth.secret,
        &opts.hostnqn,
        &opts.nqn,
    )))
}

/// N5: whether a stage with `cap` and the publication's context `ctx` is read-only. A
/// read-only publication (a reader-only access mode, or the controller's `READ_ONLY` key for a
/// publication made readonly) stages read-only on every node.
pub fn stage_read_only(cap: &Capability, ctx: &StageContext) -> bool {
    cap.reader_only() || ctx.read_only
}

/// Reads and checks the stage keys of `publish_context` for `volume`.
pub fn stage_context(
    volume: &VolumeId,
    ctx: &HashMap<String, String>,
    mode: &AttachMode,
    hostnqn: &HostNqn,
    hostid: Uuid,
) -> Result<StageContext, NodeError> {
    let nqn = context_nqn(volume, ctx)?;
    let target = match mode {
        AttachMode::NvmeTcp => AttachTarget::Nvme(nvme_target(ctx, &nqn, hostnqn, hostid)?),
        AttachMode::LocalDevice => local_target(ctx)?,
    };
    let fs_type = optional(ctx, context::FS_TYPE)
        .map(|v| {
            FsType::parse(v).map_err(|e| NodeError::InvalidContext {
                key: context::FS_TYPE,
                value: v.to_owned(),
                reason: e.to_string(),
            })
        })
        .transpose()?;
    let mkfs_options = match optional(ctx, context::MKFS_OPTIONS) {
        None => Vec::new(),
        Some(v) => {
            serde_json::from_str::<Vec<String>>(v).map_err(|e| NodeError::InvalidContext {
                key: context::MKFS_OPTIONS,
                value: v.to_owned(),
                reason: format!("expected a JSON array of strings: {e}"),
            })?
        }
    };
    let read_only = match optional(ctx, context::READ_ONLY) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(NodeError::InvalidContext {
                key: context::READ_ONLY,
                value: other.to_owned(),
                reason: "must be \"true\" or \"false\"".into(),
            });
        }
    };
    Ok(StageContext {
        nqn,
        target,
        fs_type,
        mkfs_options,
        read_only,
    })
}

/// The context's subsystem NQN, which must be the volume's own.
fn context_nqn(
    volume: &VolumeId,
    ctx: &HashMap<String, String>,
) -> Result<SubsystemNqn, NodeError> {
    let nqn_text = required(ctx, context::NQN)?;
    let nqn = SubsystemNqn::parse(nqn_text).map_err(|e| NodeError::InvalidContext {
        key: context::NQN,
        value: nqn_text.to_owned(),
        reason: e.to_string(),
    })?;
    let expected = volume.subsystem_nqn();
    if nqn != expected {
        return Err(NodeError::NqnMismatch {
            volume: volume.to_string(),
            expected: expected.to_string(),
            found: nqn.to_string(),
        });
    }
    Ok(nqn)
}

/// The NVMe/TCP connect options the context names, checked.
fn nvme_target(
    ctx: &HashMap<String, String>,
    nqn: &SubsystemNqn,
    hostnqn: &HostNqn,
    hostid: Uuid,
) -> Result<ConnectOptions, NodeError> {
    let opts = ConnectOptions {
        traddr: parsed(context::TRADDR, required(ctx, context::TRADDR)?)?,
        trsvcid: parsed(context::TRSVCID, required(ctx, context::TRSVCID)?)?,
        nqn: nqn.clone(),
        hostnqn: hostnqn.clone(),
        hostid,
        ctrl_loss_tmo: parsed(
            context::CTRL_LOSS_TMO,
            required(ctx, context::CTRL_LOSS_TMO)?,
        )?,
        reconnect_delay: parsed(
            context::RECONNECT_DELAY,
            required(ctx, context::RECONNECT_DELAY)?,
        )?,
        // Set by the caller from the request's secrets (`stage_auth`, `stage_tls`), after this
        // line may have been shown in an error.
        auth: None,
        tls: None,
    };
    if opts.ctrl_loss_tmo < -1 {
        return Err(NodeError::InvalidContext {
            key: context::CTRL_LOSS_TMO,
            value: opts.ctrl_loss_tmo.to_string(),
            reason: "must be -1 (forever) or a number of seconds".into(),
        });
    }
    opts.validate().map_err(|e| NodeError::InvalidContext {
        key: "connect options",
        value: opts.options_line(),
        reason: e.to_string(),
    })?;
    Ok(opts)
}

/// The single-machine mode's local device the context names.
fn local_target(ctx: &HashMap<String, String>) -> Result<AttachTarget, NodeError> {
    let device = required(ctx, context::LOCAL_DEVICE)?;
    if !Path::new(device).is_absolute() {
        return Err(NodeError::InvalidContext {
            key: context::LOCAL_DEVICE,
            value: device.to_owned(),
            reason: "must be an absolute path".into(),
        });
    }
    Ok(AttachTarget::Local {
        device: PathBuf::from(device),
        traddr: optional(ctx, context::TRADDR)
            .map(|v| parsed(context::TRADDR, v))
            .transpose()?,
        trsvcid: optional(ctx, context::TRSVCID)
            .map(|v| parsed(context::TRSVCID, v))
            .transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use pillar_host::StageMode;

    use super::*;
    use crate::csi::volume_capability::access_mode::Mode;
    use crate::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};

    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0a0a0a0a-0000-4000-8000-00000000000a";

    fn cap(mode: Mode, access: Option<AccessType>) -> VolumeCapability {
        VolumeCapability {
            access_type: access,
            access_mode: Some(AccessMode { mode: mode.into() }),
        }
    }

    fn mount(fs: &str) -> Option<AccessType> {
        Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        }))
    }

    #[test]
    fn tls_is_asked_by_the_context_and_the_psk_derived_from_the_node_pair() {
        let volume = VolumeId::parse("pvc-t").unwrap();
        let secret = pillar_nvmet::DhchapSecret::generate().unwrap();
        let mut opts = ConnectOptions {
            traddr: "127.0.0.1".parse().unwrap(),
            trsvcid: 4420,
            nqn: volume.subsystem_nqn(),
            hostnqn: HostNqn::parse(HOST).unwrap(),
            hostid: Uuid::from_u128(1),
            ctrl_loss_tmo: 600,
            reconnect_delay: 10,
            auth: None,
            tls: None,
        };
        let ctx = |v: Option<&str>| -> HashMap<String, String> {
            v.map(|v| (context::TLS.to_owned(), v.to_owned()))
                .into_iter()
                .collect()
        };
        assert_eq!(stage_tls(&volume, &ctx(None), &opts).unwrap(), None);
        assert_eq!(stage_tls(&volume, &ctx(Some("none")), &opts).unwrap(), None);
        assert!(matches!(
            stage_tls(&volume, &ctx(Some("yes")), &opts),
            Err(NodeError::InvalidContext { .. })
        ));
        // Without the node's pair there is nothing to derive the PSK from: refused.
        assert!(matches!(
            stage_tls(&volume, &ctx(Some("required")), &opts),
            Err(NodeError::MissingSecret { .. })
        ));
        opts.auth = Some(pillar_host::ConnectAuth {
            secret: secret.clone(),
            ctrl_secret: None,
        });
        let psk = stage_tls(&volume, &ctx(Some("required")), &opts)
            .unwrap()
            .expect("a PSK");
        // The agent derives the same from the same pair (`install_psks`).
        assert_eq!(
            psk,
            pillar_nvmet::TlsPsk::derive(&secret, &opts.hostnqn, &opts.nqn)
        );
    }

    #[test]
    fn capabilities() {
        let c = capability(Some(&cap(Mode::SingleNodeWriter, mount("")))).unwrap();
        assert_eq!(
            c.stage_mode(FsType::Xfs),
            StageMode::Filesystem {
                fs_type: FsType::Xfs
            }
        );
        assert!(!c.reader_only());
        let c = capability(Some(&cap(Mode::MultiNodeReaderOnly, mount("ext4")))).unwrap();
        assert!(c.reader_only());
        assert_eq!(
            c.stage_mode(FsType::Xfs),
            StageMode::Filesystem {
                fs_type: FsType::Ext4
            }
        );
        let block = Some(AccessType::Block(BlockVolume {}));
        assert!(
            capability(Some(&cap(Mode::SingleNodeSingleWriter, block.clone())))
                .unwrap()
                .is_block()
        );
        for bad in [
            cap(Mode::MultiNodeMultiWriter, block.clone()),
            cap(Mode::Unknown, block),
            cap(Mode::SingleNodeWriter, mount("btrfs")),
            cap(Mode::SingleNodeWriter, None),
            VolumeCapability {
                access_type: mount(""),
                access_mode: None,
            },
        ] {
            let err = capability(Some(&bad)).unwrap_err();
            assert_eq!(
                super::super::code_of(&err),
                tonic::Code::InvalidArgument,
                "{bad:?}"
            );
        }
        assert!(capability(None).is_err());
    }

    fn ctx(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    mod properties {
        //! Bounded for CI: 512 cases per property.
        use proptest::prelude::*;
        use tonic::Code;

        use super::super::*;
        use crate::node::code_of;

        const KEYS: [&str; 9] = [
            context::NQN,
            context::TRADDR,
            context::TRSVCID,
            context::CTRL_LOSS_TMO,
            context::RECONNECT_DELAY,
            context::LOCAL_DEVICE,
            context::FS_TYPE,
            context::MKFS_OPTIONS,
            context::READ_ONLY,
        ];

        /// Values near what the controller sends, and anything at all.
        fn value(nqn: String) -> impl Strategy<Value = String> {
            prop_oneof![
                any::<String>(),
                Just(nqn),
                "(-?[0-9]{1,6})|(19[0-9]\\.0\\.2\\.[0-9]{1,3})|(::[0-9])",
                "(true|false|ext4|xfs|btrfs|/dev/loop[0-9]|\\[\"-m0\"\\]|\\[1\\])",
                Just(String::new()),
            ]
        }

        fn context_map(volume: &VolumeId) -> impl Strategy<Value = HashMap<String, String>> {
            let nqn = volume.subsystem_nqn().to_string();
            // A valid context for either mode, then a few keys overwritten or removed, so both
            // the accept and every reject branch are reached.
            let good: HashMap<String, String> = [
                (context::NQN, nqn.as_str()),
                (context::TRADDR, "192.0.2.10"),
                (context::TRSVCID, "4420"),
                (context::CTRL_LOSS_TMO, "-1"),
                (context::RECONNECT_DELAY, "2"),
                (context::LOCAL_DEVICE, "/dev/loop0"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
            let edits = (0..KEYS.len(), prop::option::of(value(nqn.clone())));
            prop::collection::vec(edits, 0..4).prop_map(move |edits| {
                let mut ctx = good.clone();
                for (k, v) in edits {
                    match v {
                        Some(v) => ctx.insert(KEYS[k].to_owned(), v),
                        None => ctx.remove(KEYS[k]),
                    };
                }
                ctx
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

            // proves N1 at the edge: the field parsers every node call runs never panic,
            // accept only what they document and refuse everything else as INVALID_ARGUMENT
            // (NOT_FOUND for a relative volume_path, the spec's code for a volume not there).
            #[test]
            fn field_parsers_never_panic_and_answer_the_right_code(raw in prop_oneof![any::<String>(), "/?[a-zA-Z0-9._/-]{0,40}"]) {
                match volume_id(&raw) {
                    Ok(v) => prop_assert_eq!(v.as_str(), raw.as_str()),
                    Err(e) => prop_assert_eq!(code_of(&e), Code::InvalidArgument),
                }
                match path("target_path", &raw) {
                    Ok(p) => prop_assert!(p.is_absolute() && p == Path::new(&raw)),
                    Err(e) => prop_assert_eq!(code_of(&e), Code::InvalidArgument),
                }
                match published_path("volume_path", &raw) {
                    Ok(p) => prop_assert!(p.is_absolute()),
                    Err(e) => prop_assert_eq!(
                        code_of(&e),
                        if raw.is_empty() { Code::InvalidArgument } else { Code::NotFound }
                    ),
                }
            }

            // proves N1: whatever publish_context holds, the stage context parser never panics;
            // an accepted context names this volume's own NQN, connects with this node's host
            // NQN and host ID and valid options, and a refusal is INVALID_ARGUMENT.
            #[test]
            fn stage_contexts_never_panic_and_accept_only_this_volume(
                ctx in context_map(&VolumeId::parse("pvc-1").unwrap()),
                local in any::<bool>(),
            ) {
                let vol = VolumeId::parse("pvc-1").unwrap();
                let host = HostNqn::parse(super::HOST).unwrap();
                let id = Uuid::from_u128(7);
                let mode = if local { AttachMode::LocalDevice } else { AttachMode::NvmeTcp };
                match stage_context(&vol, &ctx, &mode, &host, id) {
                    Ok(sc) => {
                        prop_assert_eq!(&sc.nqn, &vol.subsystem_nqn());
                        match sc.target {
                            AttachTarget::Nvme(o) => {
                                prop_assert!(!local);
                                prop_assert_eq!(&o.hostnqn, &host);
                                prop_assert_eq!(o.hostid, id);
                                prop_assert_eq!(&o.nqn, &sc.nqn);
                                prop_assert!(o.ctrl_loss_tmo >= -1);
                                prop_assert!(o.validate().is_ok());
                            }
                            AttachTarget::Local { device, .. } => {
                                prop_assert!(local && device.is_absolute());
                            }
                        }
                        prop_assert_eq!(sc.read_only, ctx.get(context::READ_ONLY).map(String::as_str) == Some("true"));
                    }
                    Err(e) => prop_assert_eq!(code_of(&e), Code::InvalidArgument, "{:?}", e),
                }
            }
        }
    }

    // proves N1: the connect options carry this node's host NQN and host ID, and the NQN must be
    // the volume's own.
    #[test]
    fn stage_context_for_nvme() {
        let vol = VolumeId::parse("pvc-1").unwrap();
        let host = HostNqn::parse(HOST).unwrap();
        let id = Uuid::from_u128(7);
        let nqn = vol.subsystem_nqn().to_string();
        let good = [
            (context::NQN, nqn.as_str()),
            (context::TRADDR, "192.0.2.10"),
            (context::TRSVCID, "4420"),
            (context::CTRL_LOSS_TMO, "-1"),
            (context::RECONNECT_DELAY, "2"),
            (context::MKFS_OPTIONS, "[\"-m0\"]"),
        ];
        let sc = stage_context(&vol, &ctx(&good), &AttachMode::NvmeTcp, &host, id).unwrap();
        match sc.target {
            AttachTarget::Nvme(o) => {
                assert_eq!(o.hostnqn, host);
                assert_eq!(o.hostid, id);
                assert_eq!(o.ctrl_loss_tmo, -1);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(sc.mkfs_options, ["-m0"]);
        for i in 0..5 {
            let mut partial = good.to_vec();
            partial.remove(i);
            let err =
                stage_context(&vol, &ctx(&partial), &AttachMode::NvmeTcp, &host, id).unwrap_err();
            assert!(matches!(err, NodeError::MissingContext(_)), "{err:?}");
        }
        let other = VolumeId::parse("pvc-2").unwrap();
        let err = stage_context(&other, &ctx(&good), &AttachMode::NvmeTcp, &host, id).unwrap_err();
        assert!(matches!(err, NodeError::NqnMismatch { .. }), "{err:?}");
        for (key, bad) in [
            (context::TRADDR, "host.example"),
            (context::TRSVCID, "0"),
            (context::CTRL_LOSS_TMO, "-2"),
            (context::RECONNECT_DELAY, "0"),
            (context::MKFS_OPTIONS, "-m0"),
            (context::FS_TYPE, "ntfs"),
        ] {
            let mut m = ctx(&good);
            m.insert(key.to_owned(), bad.to_owned());
            let err = stage_context(&vol, &m, &AttachMode::NvmeTcp, &host, id).unwrap_err();
            assert!(
                matches!(err, NodeError::InvalidContext { .. }),
                "{key}: {err:?}"
            );
        }
    }
}
