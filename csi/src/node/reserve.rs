//! Rule W9 at the node: the stager of a single-writer volume holds the namespace's NVMe Write
//! Exclusive reservation, keyed by its host ID, where the target has reservations.
//!
//! - NodeStage (read-write, single node, NVMe): register this host's key
//!   ([`pillar_host::resv::key_for_host`]) and acquire Write Exclusive; a reservation another
//!   host holds is preempted and aborted. The controller lets a node stage only after
//!   ControllerPublish recorded it and revoked every other single-writer publication (W1, W2,
//!   W4), so any other holder is stale. A stage that already holds it sends only the report.
//!   Any failure fails the stage (closed).
//! - Support is decided by the Reservation Report itself, not Identify Namespace's `rescap`: the
//!   report is the first command the stage needs anyway (it names the holder to preempt), and
//!   its answer comes from the very code that would process the register and acquire. A target
//!   without reservations (nvmet before 6.13, or a namespace without `resv_enable`) answers it
//!   with Invalid Opcode / Invalid Field: the stage goes on without a reservation and says so
//!   once per process at info.
//! - After a target restart the reservation is gone (nvmet keeps none through a namespace
//!   re-creation). The holder takes it back on NodeGetVolumeStats (kubelet calls it
//!   periodically; only while no other operation holds the volume, so it never races an
//!   unstage's release) and on a repeated NodeStage, both without preempting: a reservation
//!   another host holds by then is reported as an abnormal volume condition, never taken from
//!   it.
//! - NodeUnstage: release and unregister, best effort; the publication records and the ACL stay
//!   the durable fence.

use std::sync::atomic::{AtomicBool, Ordering};

use pillar_host::StageRecord;
use pillar_host::resv::{self, Held};
use pillar_nvmet::VolumeId;

use super::NodeError;
use super::config::AttachMode;
use super::device::Device;
use super::engine::Engine;

/// Set once "no reservations on this target" has been logged by this process.
static UNSUPPORTED_LOGGED: AtomicBool = AtomicBool::new(false);

impl Engine {
    fn key(&self) -> u64 {
        resv::key_for_host(&self.cfg.host_id)
    }

    /// NodeStage: hold the Write Exclusive reservation on `device`, preempting a stale holder.
    pub(crate) fn reserve(&self, volume: &VolumeId, device: &Device) -> Result<(), NodeError> {
        if self.cfg.attach != AttachMode::NvmeTcp {
            return Ok(());
        }
        let held = self
            .kernel
            .hold_write_exclusive(&device.path, &self.cfg.host_id, self.key(), true)
            .map_err(|source| NodeError::Reservation {
                volume: volume.to_string(),
                source: Box::new(source),
            })?;
        log_held(&held, true);
        Ok(())
    }

    /// After a target restart: take the reservation back if nobody holds it. Never preempts.
    /// `None` when all is well (held, or no reservations on this target); otherwise what the
    /// volume condition should say.
    pub(crate) fn reassert(&self, record: &StageRecord) -> Option<String> {
        if !record.reservation || self.cfg.attach != AttachMode::NvmeTcp {
            return None;
        }
        let device = match self.find_device(record) {
            Ok(d) => d,
            Err(e) => {
                return Some(format!(
                    "cannot check the NVMe reservation: {}",
                    super::describe(&e)
                ));
            }
        };
        match self
            .kernel
            .hold_write_exclusive(&device.path, &self.cfg.host_id, self.key(), false)
        {
            Ok(held) => {
                log_held(&held, false);
                None
            }
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "this host does not hold the volume's NVMe reservation");
                Some(format!(
                    "this host does not hold the volume's NVMe Write Exclusive reservation: {}",
                    crate::error_chain(&e)
                ))
            }
        }
    }

    /// NodeUnstage: release and unregister, best effort (logged, never an error).
    pub(crate) fn unreserve(&self, record: &StageRecord) {
        if !record.reservation || self.cfg.attach != AttachMode::NvmeTcp {
            return;
        }
        let device = match self.find_device(record) {
            Ok(d) => d,
            Err(e) => {
                tracing::info!(reason = %super::describe(&e), "device gone; no reservation to release");
                return;
            }
        };
        match self
            .kernel
            .release_and_unregister(&device.path, &self.cfg.host_id)
        {
            Ok(true) => tracing::info!("NVMe reservation released and key unregistered"),
            Ok(false) => tracing::debug!("no NVMe reservation or registration to release"),
            Err(e) => tracing::warn!(error = %crate::error_chain(&e),
                "releasing the NVMe reservation failed; the records and the ACL still fence the volume"),
        }
    }
}

fn log_held(held: &Held, stage: bool) {
    match held {
        Held::Unsupported(status) => {
            if !UNSUPPORTED_LOGGED.swap(true, Ordering::Relaxed) {
                tracing::info!(%status, "the target has no NVMe reservations for this namespace; staging without them (logged once)");
            }
        }
        Held::AlreadyHeld => tracing::debug!("NVMe Write Exclusive reservation already held"),
        Held::Acquired {
            preempted: Some(key),
        } => tracing::warn!(
            preempted_key = format_args!("{key:#018x}"),
            "NVMe Write Exclusive reservation taken by preempt-and-abort from a stale holder"
        ),
        Held::Acquired { preempted: None } if stage => {
            tracing::info!("NVMe Write Exclusive reservation acquired")
        }
        Held::Acquired { preempted: None } => tracing::warn!(
            "NVMe Write Exclusive reservation acquired again (the target forgot it: restarted?)"
        ),
    }
}
