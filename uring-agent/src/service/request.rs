//! What the agent's operations take and answer: requests arrive parsed (typed volume IDs, host
//! NQNs, ports, sizes), so nothing here is checked again.
//!
//! Invariants:
//! - A [`VolumeSize`] is 1 byte to [`MAX_VOLUME_BYTES`]: a size the backends accept.
//! - [`AgentSettings`]' test-only switches are off in production; they exist to show what the
//!   rules they turn off prevent.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU16;

use pillar_nvmet::{HostAuth, HostNqn, SubsystemNqn, VolumeId};

use super::AgentError;
use crate::backend::MAX_VOLUME_BYTES;
use crate::fence::Token;
use crate::hooks::Hooks;

/// Whether the agent serves exports yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    WaitingForResync,
    Serving,
    /// The state directory was lost (C6): every mutating call is refused until a resync
    /// carrying the current state epoch re-seeds the marks.
    StateLost,
}

/// How hosts reach an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protocol {
    /// The TCP service hosts connect to; also the nvmet port ID.
    pub service: NonZeroU16,
    pub acl: bool,
    /// With `acl`: every admitted host must authenticate (DH-HMAC-CHAP, W10).
    pub auth: bool,
    /// Hosts must connect over TLS 1.3 with their PSK (only with `auth`).
    pub tls: bool,
}

/// A volume size the backends accept: 1 byte to [`MAX_VOLUME_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeSize(u64);

impl VolumeSize {
    /// `bytes` as a volume size, or `None` when it is 0 or above [`MAX_VOLUME_BYTES`].
    pub fn new(bytes: u64) -> Option<Self> {
        (bytes != 0 && bytes <= MAX_VOLUME_BYTES).then_some(Self(bytes))
    }

    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

/// One export as the controller wants it.
#[derive(Clone, Debug)]
pub struct ExportRequest {
    pub token: Option<Token>,
    pub volume: VolumeId,
    pub pool: String,
    pub protocol: Protocol,
    /// With `acl`, the hosts admitted from the start.
    pub allowed_hosts: BTreeSet<HostNqn>,
    /// With `acl` and `auth`, the credentials of each allowed host.
    pub credentials: BTreeMap<HostNqn, HostAuth>,
}

/// The result of an export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    pub nqn: SubsystemNqn,
    pub address: SocketAddr,
    pub identity_adopted: bool,
}

/// One volume's outcome in a resync.
#[derive(Debug)]
pub struct ResyncOutcome {
    pub volume: VolumeId,
    pub result: Result<Exported, AgentError>,
}

/// What ListExports reports.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    pub volume: VolumeId,
    pub nqn: String,
    pub device_path: String,
    pub acl: bool,
    pub allowed_hosts: Vec<String>,
    pub services: Vec<u16>,
    pub enabled: bool,
}

/// Settings the agent needs besides its parts.
#[derive(Clone, Debug)]
pub struct AgentSettings {
    /// Where hosts connect (the `addr_traddr` of every port this agent creates).
    pub nvme_address: IpAddr,
    /// Test-only: leave namespace identity and serial to the kernel (random), to show what
    /// stable identity prevents. Never for production.
    pub kernel_random_identity: bool,
    /// Test-only: a revoke only removes the host from the ACL (no namespace drain, no cut of
    /// live connections), to show what W7 prevents. Never for production.
    pub unsafe_revoke_acl_only: bool,
    /// Test hooks; inert unless a `fault-injection` build arms them.
    pub hooks: Hooks,
}
