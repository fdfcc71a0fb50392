//! Reaching a volume's block device: NVMe/TCP (connect, find by subsystem NQN, verify identity;
//! rules N1, N4) or, in the single-machine mode, a local block device.
//!
//! Everything here blocks; the gRPC layer calls it on a blocking thread. The same functions run
//! against the kernel's sysfs in production and in the VM tests, and against a fake sysfs tree in
//! the unit tests: only [`pillar_host::HostPaths`] differs.

use std::thread;
use std::time::{Duration, Instant};

use pillar_host::POLL_INTERVAL;
use pillar_host::{
    ConnectOptions, ControllerInfo, ControllerState, HostError, StageRecord, verify_identity,
};
use pillar_nvmet::{NamespaceId, NamespaceIdentity, SubsystemNqn, VolumeId};

use super::NodeError;
use super::config::AttachMode;
use super::device::{Condition, Device};
use super::engine::Engine;
use super::request::AttachTarget;

fn describe_states(ctrls: &[ControllerInfo]) -> String {
    if ctrls.is_empty() {
        return "no controller".into();
    }
    ctrls
        .iter()
        .map(|c| format!("{} ({})", c.name, c.state.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Engine {
    /// This host's controllers of subsystem `nqn`, in any state.
    pub(crate) fn host_controllers(
        &self,
        nqn: &SubsystemNqn,
    ) -> Result<Vec<ControllerInfo>, NodeError> {
        let all = self
            .kernel
            .controllers(nqn)
            .map_err(|source| NodeError::ListControllers {
                nqn: nqn.to_string(),
                source: Box::new(source),
            })?;
        Ok(all
            .into_iter()
            .filter(|c| c.hostnqn.as_deref() == Some(self.cfg.host_nqn.as_str()))
            .collect())
    }

    /// Attaches the device NodeStageVolume asked for.
    pub(crate) fn attach(
        &self,
        volume: &VolumeId,
        target: &AttachTarget,
    ) -> Result<Device, NodeError> {
        match target {
            AttachTarget::Nvme(opts) => self.attach_nvme(volume, opts),
            AttachTarget::Local { device, .. } => self.check_local(device),
        }
    }

    /// Rule N1: connect with this node's host NQN and host ID (or reuse this host's controller of
    /// the subsystem), find the namespace by subsystem NQN, and verify its identity before
    /// anything reads or writes the device. On failure, the controller this call created (if
    /// any) is disconnected again.
    fn attach_nvme(&self, volume: &VolumeId, opts: &ConnectOptions) -> Result<Device, NodeError> {
        let nqn = &opts.nqn;
        let existing: Vec<ControllerInfo> = self
            .host_controllers(nqn)?
            .into_iter()
            .filter(|c| {
                matches!(
                    c.state,
                    ControllerState::Live
                        | ControllerState::New
                        | ControllerState::Connecting
                        | ControllerState::Resetting
                )
            })
            .collect();
        let mut connected = false;
        if existing.is_empty() {
            tracing::info!(%nqn, "connecting");
            match self.kernel.connect(opts) {
                Ok(ctrl) => {
                    connected = true;
                    tracing::info!(%nqn, controller = %ctrl.name, "connected");
                }
                // Another controller of this host for this address and subsystem appeared
                // between the listing and the connect: use it.
                Err(HostError::AlreadyConnected { .. }) => {
                    tracing::info!(%nqn, "already connected; reusing the existing controller");
                }
                Err(source) => {
                    return Err(NodeError::Connect {
                        nqn: nqn.to_string(),
                        source: Box::new(source),
                    });
                }
            }
        } else {
            tracing::info!(%nqn, controllers = %describe_states(&existing),
                "reusing this host's controller of the subsystem");
        }
        let found = self.find_verified(volume, nqn, self.cfg.connect_timeout);
        if found.is_err() && connected {
            // Nothing of this host's for this subsystem existed before this call: undo it.
            match self.kernel.disconnect(nqn, Some(&self.cfg.host_nqn)) {
                Ok(deleted) => {
                    tracing::info!(%nqn, ?deleted, "disconnected what this stage connected");
                }
                Err(e) => tracing::warn!(%nqn, error = %e,
                    "disconnecting after a failed stage failed; unstage will retry"),
            }
        }
        found
    }

    /// Waits up to `timeout` for this host's namespace of `nqn` and a live controller, then
    /// verifies the namespace identity (rule N1).
    fn find_verified(
        &self,
        volume: &VolumeId,
        nqn: &SubsystemNqn,
        timeout: Duration,
    ) -> Result<Device, NodeError> {
        let start = Instant::now();
        let dev = self
            .kernel
            .wait_for_namespace(nqn, Some(&self.cfg.host_nqn), timeout)
            .map_err(|source| NodeError::WaitNamespace {
                nqn: nqn.to_string(),
                source: Box::new(source),
            })?;
        // With multipath the namespace head outlives its controllers: insist on a live path.
        self.wait_live(nqn, timeout.saturating_sub(start.elapsed()))?;
        let expected = NamespaceIdentity::derive(nqn, NamespaceId::VOLUME);
        verify_identity(&dev, &expected).map_err(|source| NodeError::IdentityMismatch {
            volume: volume.to_string(),
            nqn: nqn.to_string(),
            source: Box::new(source),
        })?;
        tracing::info!(%nqn, device = %dev.name, "namespace identity verified");
        Ok(Device {
            path: dev.dev_path,
            hint: dev.name,
        })
    }

    /// Waits up to `timeout` until one of this host's controllers of `nqn` is live.
    fn wait_live(&self, nqn: &SubsystemNqn, timeout: Duration) -> Result<(), NodeError> {
        let start = Instant::now();
        loop {
            let ctrls = self.host_controllers(nqn)?;
            if ctrls.iter().any(|c| c.state == ControllerState::Live) {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(NodeError::ControllerNotLive {
                    nqn: nqn.to_string(),
                    waited,
                    seen: describe_states(&ctrls),
                });
            }
            thread::sleep(POLL_INTERVAL.min(timeout - waited));
        }
    }

    /// The single-machine mode: the device must exist and be a block device.
    fn check_local(&self, device: &std::path::Path) -> Result<Device, NodeError> {
        self.kernel
            .device_size(device)
            .map_err(|source| NodeError::LocalDevice {
                path: device.to_path_buf(),
                source: Box::new(source),
            })?;
        tracing::warn!(device = %device.display(),
            "single-machine mode: using a local block device; no NVMe namespace identity check \
             is possible (rule N1 is not enforced in this mode)");
        Ok(Device {
            path: device.to_path_buf(),
            hint: device.to_string_lossy().into_owned(),
        })
    }

    /// The device of a staged volume, found again (never connecting): by NQN and verified
    /// identity for NVMe (names are reused after a disconnect, so the record's hint is not
    /// trusted), the recorded path for a local device.
    pub(crate) fn find_device(&self, record: &StageRecord) -> Result<Device, NodeError> {
        match self.cfg.attach {
            AttachMode::NvmeTcp => self.find_verified(&record.volume, &record.nqn, Duration::ZERO),
            AttachMode::LocalDevice => {
                let Some(path) = record.device.as_deref() else {
                    return Err(NodeError::NotStagedHere {
                        volume: record.volume.to_string(),
                    });
                };
                self.check_local(std::path::Path::new(path))
            }
        }
    }

    /// Rule N4: disconnects this host's controllers of `nqn`, and no others.
    pub(crate) fn detach(&self, nqn: &SubsystemNqn) -> Result<(), NodeError> {
        match self.cfg.attach {
            AttachMode::NvmeTcp => {
                let deleted = self
                    .kernel
                    .disconnect(nqn, Some(&self.cfg.host_nqn))
                    .map_err(|source| NodeError::Disconnect {
                        nqn: nqn.to_string(),
                        source: Box::new(source),
                    })?;
                tracing::info!(%nqn, ?deleted, "disconnected");
                Ok(())
            }
            AttachMode::LocalDevice => Ok(()),
        }
    }

    /// Rescans this host's live controllers of `nqn` so a grown namespace shows its new size.
    pub(crate) fn rescan(&self, nqn: &SubsystemNqn) -> Result<(), NodeError> {
        if self.cfg.attach != AttachMode::NvmeTcp {
            return Ok(());
        }
        for ctrl in self.host_controllers(nqn)? {
            if ctrl.state != ControllerState::Live {
                continue;
            }
            self.kernel
                .rescan(&ctrl.name)
                .map_err(|source| NodeError::Rescan {
                    controller: ctrl.name.clone(),
                    source: Box::new(source),
                })?;
            tracing::info!(%nqn, controller = %ctrl.name, "controller rescanned");
        }
        Ok(())
    }

    /// Whether the staged namespace is still there with the volume's identity. A live
    /// controller is not enough: after `identifiers changed` the host removes the namespace and
    /// keeps the controller.
    fn namespace_health(&self, record: &StageRecord) -> Result<(), String> {
        let devices = self
            .kernel
            .namespaces(&record.nqn, Some(&self.cfg.host_nqn))
            .map_err(|e| format!("cannot read the namespaces of {}: {e}", record.nqn))?;
        let expected = NamespaceIdentity::derive(&record.nqn, NamespaceId::VOLUME);
        let staged = match record.device.as_deref() {
            // The record holds the disk name (`nvme0n1`); accept a path too.
            Some(dev) => devices
                .iter()
                .find(|d| d.name == dev || d.dev_path.as_os_str() == dev),
            None => devices.first(),
        };
        let Some(device) = staged else {
            return Err(format!(
                "the namespace of {} staged as {} is gone from this host (removed after \
                 `identifiers changed` or a namespace removal); I/O on it fails",
                record.nqn,
                record.device.as_deref().unwrap_or("(no device)")
            ));
        };
        pillar_host::verify_identity(device, &expected).map_err(|e| {
            format!(
                "the namespace {} no longer has the volume's identity: {e}",
                device.dev_path.display()
            )
        })
    }

    /// The volume's health: abnormal when no controller of this host for its subsystem is live
    /// (NVMe), or when the local device is gone.
    pub(crate) fn condition(&self, record: &StageRecord) -> Condition {
        let abnormal = |message: String| Condition {
            abnormal: true,
            message,
        };
        match self.cfg.attach {
            AttachMode::NvmeTcp => match self.host_controllers(&record.nqn) {
                Err(e) => abnormal(format!(
                    "cannot read the controller state: {}",
                    super::error::describe(&e)
                )),
                Ok(ctrls) if ctrls.iter().any(|c| c.state == ControllerState::Live) => {
                    match self.namespace_health(record) {
                        Ok(()) => Condition {
                            abnormal: false,
                            message: format!("connected: {}", describe_states(&ctrls)),
                        },
                        Err(message) => abnormal(message),
                    }
                }
                Ok(ctrls) => abnormal(format!(
                    "no live NVMe/TCP controller of subsystem {} for this host ({}); I/O waits \
                     for a reconnect or fails",
                    record.nqn,
                    describe_states(&ctrls)
                )),
            },
            AttachMode::LocalDevice => match record.device.as_deref() {
                None => abnormal("no device recorded for this volume".into()),
                Some(dev) => match self.kernel.device_size(std::path::Path::new(dev)) {
                    Ok(_) => Condition {
                        abnormal: false,
                        message: format!("local device {dev}"),
                    },
                    Err(e) => abnormal(format!("local device {dev} is not usable: {e}")),
                },
            },
        }
    }
}
