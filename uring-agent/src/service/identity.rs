//! The identity an export's namespaces must show (I1-I4), and the plan edits of the test-only
//! modes.
//!
//! Invariants:
//! - The expected identity is the adopted one on record, else the derived one; only the
//!   test-only kernel-random mode takes whatever the namespace shows.
//! - The test-only modes only drop writes from a plan ([`strip_writes`]); they never add one.

use std::collections::BTreeMap;

use pillar_nvmet::{ExportSpec, HostAccess, NamespaceId, NamespaceIdentity, VolumeId, volume_export};

use super::{Agent, AgentError};
use crate::target::IdentityRecord;

impl Agent {
    /// The identity each namespace of `volume` must show before a grant enables it: the
    /// adopted identity on record, else the derived one; in the test-only kernel-random mode,
    /// whatever the namespace shows.
    pub(super) fn expected_identities(
        &self,
        volume: &VolumeId,
        sub: &pillar_nvmet::SubsystemState,
    ) -> Result<BTreeMap<NamespaceId, NamespaceIdentity>, AgentError> {
        if self.settings.kernel_random_identity {
            return Ok(sub
                .namespaces
                .iter()
                .filter_map(|(nsid, ns)| Some((*nsid, ns.shown_identity()?)))
                .collect());
        }
        let mut spec = volume_export(volume, "", HostAccess::AnyHost, BTreeMap::new());
        if let Some(record) = self.target.identity_record(volume)? {
            apply_record(&mut spec, &record);
        }
        Ok(spec
            .namespaces
            .into_iter()
            .map(|(nsid, ns)| (nsid, ns.identity))
            .collect())
    }
}

pub(super) fn apply_record(spec: &mut ExportSpec, record: &IdentityRecord) {
    if let (Ok(id), Some(ns)) = (
        record.namespace(),
        spec.namespaces.get_mut(&NamespaceId::VOLUME),
    ) {
        ns.identity = id;
    }
    if let Ok(serial) = pillar_nvmet::Serial::parse(&record.serial) {
        spec.serial = serial;
    }
}

pub(super) fn record_of(effective: &ExportSpec) -> IdentityRecord {
    let ns = effective.namespaces.get(&NamespaceId::VOLUME);
    IdentityRecord {
        uuid: ns.map(|n| n.identity.uuid.to_string()).unwrap_or_default(),
        nguid: ns.map(|n| n.identity.nguid.to_string()).unwrap_or_default(),
        serial: effective.serial.to_string(),
    }
}

/// Attributes the test-only modes leave out of a plan: namespace enable/disable (the ACL-only
/// revoke) and identity (the kernel-random mode).
pub(super) const ENABLE: &[&str] = &["enable"];
pub(super) const IDENTITY: &[&str] = &["device_uuid", "device_nguid", "attr_serial"];

/// Drops the writes of the attributes `names` from a plan.
pub(super) fn strip_writes(ops: Vec<pillar_nvmet::Op>, names: &[&str]) -> Vec<pillar_nvmet::Op> {
    ops.into_iter()
        .filter(|op| {
            !matches!(op, pillar_nvmet::Op::Write { path, .. }
                if path.file_name().is_some_and(|n| names.iter().any(|x| n == *x)))
        })
        .collect()
}
