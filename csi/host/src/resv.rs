//! NVMe reservations on a namespace block device (`/dev/nvmeXnY`), through the kernel's
//! passthrough ioctl `NVME_IOCTL_IO_CMD` (rule W9, docs/rules.md K21, K22).
//!
//! - Commands: Reservation Register (0x0D), Report (0x0E, extended data structure, so each
//!   registrant comes with its 128-bit host ID), Acquire (0x11: acquire, preempt,
//!   preempt-and-abort) and Release (0x15). Their dwords and payloads are built by pure functions
//!   ([`Command`]); the report is decoded by [`Report::decode`]; both are unit-tested against the
//!   NVMe base specification's layouts.
//! - [`plan_hold`] decides, from a report, the steps that make this host the Write Exclusive
//!   holder; [`hold_write_exclusive`] runs them and checks the result with a second report.
//! - This module holds every `unsafe` block of the reservation code: two ioctls.
//!
//! The registration key is derived from the host ID ([`key_for_host`]): the first eight bytes of
//! SHA-256("pillar-resv-key-v1" || host ID bytes), big-endian, with 0 mapped to 1 (a zero key is
//! the "no key" of the spec). It is the same on every restart of the node plugin and differs
//! between nodes, so a node recognises its own registration and a preempt names exactly the
//! holder's key. Registrants are identified by host ID in the report; the key is only what the
//! commands carry.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use uuid::Uuid;

/// NVMe opcodes of the reservation commands (NVM command set).
pub const OPC_REGISTER: u8 = 0x0D;
pub const OPC_REPORT: u8 = 0x0E;
pub const OPC_ACQUIRE: u8 = 0x11;
pub const OPC_RELEASE: u8 = 0x15;

/// Generic status "Reservation Conflict".
pub const SC_RESERVATION_CONFLICT: u8 = 0x83;
/// Generic status "Invalid Command Opcode": a target without reservations (nvmet before 6.13, or
/// a namespace without `resv_enable`) answers reservation commands with it.
pub const SC_INVALID_OPCODE: u8 = 0x01;
/// Generic status "Invalid Field in Command".
pub const SC_INVALID_FIELD: u8 = 0x02;

/// The size of the report buffer: the 64-byte extended header and 63 registrants.
const REPORT_LEN: usize = 64 * 64;

/// Reservation types (RTYPE).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResvType {
    WriteExclusive,
    ExclusiveAccess,
    WriteExclusiveRegistrantsOnly,
    ExclusiveAccessRegistrantsOnly,
    WriteExclusiveAllRegistrants,
    ExclusiveAccessAllRegistrants,
}

impl ResvType {
    /// The RTYPE value.
    pub const fn code(self) -> u8 {
        match self {
            Self::WriteExclusive => 1,
            Self::ExclusiveAccess => 2,
            Self::WriteExclusiveRegistrantsOnly => 3,
            Self::ExclusiveAccessRegistrantsOnly => 4,
            Self::WriteExclusiveAllRegistrants => 5,
            Self::ExclusiveAccessAllRegistrants => 6,
        }
    }

    /// The type for an RTYPE value; 0 (no reservation) and reserved values give `None`.
    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::WriteExclusive,
            2 => Self::ExclusiveAccess,
            3 => Self::WriteExclusiveRegistrantsOnly,
            4 => Self::ExclusiveAccessRegistrantsOnly,
            5 => Self::WriteExclusiveAllRegistrants,
            6 => Self::ExclusiveAccessAllRegistrants,
            _ => return None,
        })
    }
}

/// A completion status other than success (the status field without its phase bit, as the
/// ioctl returns it: SC in bits 7:0, SCT in 10:8, CRD 12:11, More 13, DNR 14).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NvmeStatus(pub u16);

impl NvmeStatus {
    pub const fn sc(self) -> u8 {
        (self.0 & 0xff) as u8
    }
    pub const fn sct(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }
    pub const fn dnr(self) -> bool {
        self.0 & 0x4000 != 0
    }
    /// Reservation Conflict (generic 0x83): another host holds the namespace.
    pub const fn is_reservation_conflict(self) -> bool {
        self.sct() == 0 && self.sc() == SC_RESERVATION_CONFLICT
    }
    /// The target does not implement reservations for this namespace.
    pub const fn is_unsupported(self) -> bool {
        self.sct() == 0 && (self.sc() == SC_INVALID_OPCODE || self.sc() == SC_INVALID_FIELD)
    }
}

impl fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match (self.sct(), self.sc()) {
            (0, SC_INVALID_OPCODE) => "invalid command opcode",
            (0, SC_INVALID_FIELD) => "invalid field in command",
            (0, 0x04) => "data transfer error",
            (0, 0x06) => "internal error",
            (0, 0x07) => "command abort requested",
            (0, 0x0B) => "invalid namespace or format",
            (0, SC_RESERVATION_CONFLICT) => "reservation conflict",
            (0, 0x82) => "namespace not ready",
            (0, _) => "generic status",
            (1, _) => "command specific status",
            (2, _) => "media or data integrity error",
            (3, _) => "path related status",
            _ => "vendor or reserved status",
        };
        write!(
            f,
            "NVMe status {:#06x} ({name}, sct {}, sc {:#04x}{})",
            self.0,
            self.sct(),
            self.sc(),
            if self.dnr() { ", do not retry" } else { "" }
        )
    }
}

/// How one passthrough command failed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The ioctl itself failed (errno): no device, no permission, transport gone.
    #[error("the passthrough ioctl failed")]
    Ioctl(#[source] io::Error),
    /// The target completed the command with an error status.
    #[error("{0}")]
    Status(NvmeStatus),
}

impl CommandError {
    /// The NVMe status, when the target answered with one.
    pub fn status(&self) -> Option<NvmeStatus> {
        match self {
            Self::Status(s) => Some(*s),
            Self::Ioctl(_) => None,
        }
    }
}

/// Every step of the reservation code that can fail, each with its source.
#[derive(Debug, thiserror::Error)]
pub enum ResvError {
    #[error("cannot open {device:?} for reservation commands")]
    Open { device: PathBuf, source: io::Error },
    #[error("cannot read the namespace ID of {device:?}")]
    NamespaceId { device: PathBuf, source: io::Error },
    #[error("Reservation Report on {device:?} failed")]
    Report {
        device: PathBuf,
        source: CommandError,
    },
    #[error("the Reservation Report of {device:?} is malformed: {reason}")]
    DecodeReport { device: PathBuf, reason: String },
    #[error("Reservation Register of this host on {device:?} failed")]
    Register {
        device: PathBuf,
        source: CommandError,
    },
    #[error("Reservation Acquire (Write Exclusive) on {device:?} failed")]
    Acquire {
        device: PathBuf,
        source: CommandError,
    },
    #[error(
        "Reservation Acquire, preempt-and-abort of the holder key {holder_key:#018x} on {device:?} failed"
    )]
    Preempt {
        device: PathBuf,
        holder_key: u64,
        source: CommandError,
    },
    #[error("Reservation Release on {device:?} failed")]
    Release {
        device: PathBuf,
        source: CommandError,
    },
    #[error("Reservation Register (unregister) of this host on {device:?} failed")]
    Unregister {
        device: PathBuf,
        source: CommandError,
    },
    #[error(
        "after acquiring, {device:?} reports {found} instead of a Write Exclusive reservation held by this host"
    )]
    NotHeld { device: PathBuf, found: String },
}

impl ResvError {
    /// The NVMe status the target answered, if this error carries one.
    pub fn status(&self) -> Option<NvmeStatus> {
        match self {
            Self::Report { source, .. }
            | Self::Register { source, .. }
            | Self::Acquire { source, .. }
            | Self::Preempt { source, .. }
            | Self::Release { source, .. }
            | Self::Unregister { source, .. } => source.status(),
            _ => None,
        }
    }
}

/// The registration key of the host with ID `host_id` (see the module documentation).
pub fn key_for_host(host_id: &Uuid) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(b"pillar-resv-key-v1");
    hasher.update(host_id.as_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    match u64::from_be_bytes(first) {
        0 => 1,
        key => key,
    }
}

/// One reservation command: opcode, CDW10, CDW11 and the data it sends (or the length it reads).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    pub opcode: u8,
    pub cdw10: u32,
    pub cdw11: u32,
    /// Host to controller payload; empty for the report.
    pub data: Vec<u8>,
    /// Controller to host length (the report), 0 otherwise.
    pub read_len: usize,
}

/// Register actions (RREGA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterAction {
    Register,
    Unregister,
    Replace,
}

/// Acquire actions (RACQA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireAction {
    Acquire,
    Preempt,
    PreemptAndAbort,
}

impl Command {
    /// Reservation Register: CDW10 RREGA (2:0), IEKEY (3), CPTPL (31:30) = 0 (no change);
    /// data CRKEY, NRKEY (8 bytes each, little-endian).
    pub fn register(action: RegisterAction, ignore_existing: bool, current: u64, new: u64) -> Self {
        let rrega = match action {
            RegisterAction::Register => 0,
            RegisterAction::Unregister => 1,
            RegisterAction::Replace => 2,
        };
        let mut data = Vec::with_capacity(16);
        data.extend_from_slice(&current.to_le_bytes());
        data.extend_from_slice(&new.to_le_bytes());
        Self {
            opcode: OPC_REGISTER,
            cdw10: rrega | (u32::from(ignore_existing) << 3),
            cdw11: 0,
            data,
            read_len: 0,
        }
    }

    /// Reservation Acquire: CDW10 RACQA (2:0), IEKEY (3) = 0, RTYPE (15:8); data CRKEY, PRKEY.
    pub fn acquire(action: AcquireAction, rtype: ResvType, current: u64, preempt: u64) -> Self {
        let racqa = match action {
            AcquireAction::Acquire => 0,
            AcquireAction::Preempt => 1,
            AcquireAction::PreemptAndAbort => 2,
        };
        let mut data = Vec::with_capacity(16);
        data.extend_from_slice(&current.to_le_bytes());
        data.extend_from_slice(&preempt.to_le_bytes());
        Self {
            opcode: OPC_ACQUIRE,
            cdw10: racqa | (u32::from(rtype.code()) << 8),
            cdw11: 0,
            data,
            read_len: 0,
        }
    }

    /// Reservation Release: CDW10 RRELA (2:0) = 0 (release), IEKEY (3) = 0, RTYPE (15:8); data
    /// CRKEY.
    pub fn release(rtype: ResvType, current: u64) -> Self {
        Self {
            opcode: OPC_RELEASE,
            cdw10: u32::from(rtype.code()) << 8,
            cdw11: 0,
            data: current.to_le_bytes().to_vec(),
            read_len: 0,
        }
    }

    /// Reservation Report with the extended data structure: CDW10 NUMD (0-based dwords),
    /// CDW11 EDS (bit 0).
    pub fn report(len: usize) -> Self {
        let dwords = u32::try_from(len / 4).unwrap_or(u32::MAX).max(1);
        Self {
            opcode: OPC_REPORT,
            cdw10: dwords - 1,
            cdw11: 1,
            data: Vec::new(),
            read_len: len,
        }
    }
}

/// One registered controller of the extended report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registrant {
    pub cntlid: u16,
    /// RCSTS bit 0: this controller's host holds the reservation.
    pub holds: bool,
    pub key: u64,
    pub host_id: Uuid,
}

/// A decoded Reservation Report (extended data structure).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub generation: u32,
    /// The reservation held, if any.
    pub rtype: Option<ResvType>,
    pub registrants: Vec<Registrant>,
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

impl Report {
    /// Decodes an extended Reservation Status data structure: a 64-byte header (GEN 3:0, RTYPE 4,
    /// REGCTL 6:5, PTPLS 9) and REGCTL 64-byte Registered Controller extended data structures
    /// (CNTLID 1:0, RCSTS 2, RKEY 15:8, HOSTID 31:16). A header announcing more registrants than
    /// the buffer holds is an error, not a truncated list.
    pub fn decode(buf: &[u8]) -> Result<Self, String> {
        if buf.len() < 64 {
            return Err(format!(
                "{} bytes, shorter than the 64-byte header",
                buf.len()
            ));
        }
        let generation = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let rtype = match buf[4] {
            0 => None,
            code => Some(
                ResvType::from_code(code)
                    .ok_or_else(|| format!("reserved reservation type {code}"))?,
            ),
        };
        let count = usize::from(le_u16(buf, 5));
        let need = 64 + count * 64;
        if buf.len() < need {
            return Err(format!(
                "{count} registrants announced, but only {} bytes returned",
                buf.len()
            ));
        }
        let registrants = (0..count)
            .map(|i| {
                let e = &buf[64 + i * 64..128 + i * 64];
                let mut key = [0u8; 8];
                key.copy_from_slice(&e[8..16]);
                let mut id = [0u8; 16];
                id.copy_from_slice(&e[16..32]);
                Registrant {
                    cntlid: le_u16(e, 0),
                    holds: e[2] & 1 != 0,
                    key: u64::from_le_bytes(key),
                    host_id: Uuid::from_bytes(id),
                }
            })
            .collect();
        Ok(Self {
            generation,
            rtype,
            registrants,
        })
    }

    /// This host's registration (any of its controllers).
    pub fn registration_of(&self, host_id: &Uuid) -> Option<&Registrant> {
        self.registrants.iter().find(|r| r.host_id == *host_id)
    }

    /// The holder of the reservation, if one is held.
    pub fn holder(&self) -> Option<&Registrant> {
        self.rtype?;
        self.registrants.iter().find(|r| r.holds)
    }

    /// Whether `host_id` holds a Write Exclusive reservation.
    pub fn held_by(&self, host_id: &Uuid) -> bool {
        self.rtype == Some(ResvType::WriteExclusive)
            && self.holder().is_some_and(|h| h.host_id == *host_id)
    }

    fn describe(&self) -> String {
        match (self.rtype, self.holder()) {
            (None, _) => "no reservation".into(),
            (Some(t), Some(h)) => format!("{t:?} held by host {} (key {:#018x})", h.host_id, h.key),
            (Some(t), None) => format!("{t:?} with no holder listed"),
        }
    }
}

/// One step towards holding the reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Register this host's key.
    Register,
    /// This host is registered under another key: replace it (IEKEY).
    ReplaceKey,
    /// This host holds another type: release it first.
    Release(ResvType),
    /// Nobody holds it: acquire Write Exclusive.
    Acquire,
    /// Another host holds it: preempt and abort it (its key).
    PreemptAndAbort { holder_key: u64 },
}

/// The steps that make `host_id` (with `key`) the Write Exclusive holder, given `report`.
/// Empty when it already is. With `preempt` false, a reservation held by another host is left
/// alone and `Err` carries that holder (re-acquiring after a target restart never takes a
/// reservation from anyone).
pub fn plan_hold(
    report: &Report,
    host_id: &Uuid,
    key: u64,
    preempt: bool,
) -> Result<Vec<Step>, Registrant> {
    let mine = report.registration_of(host_id);
    if report.held_by(host_id) && mine.is_some_and(|r| r.key == key) {
        return Ok(Vec::new());
    }
    let mut steps = Vec::new();
    match mine {
        None => steps.push(Step::Register),
        Some(r) if r.key != key => steps.push(Step::ReplaceKey),
        Some(_) => {}
    }
    match (report.rtype, report.holder()) {
        (Some(t), Some(h)) if h.host_id == *host_id => {
            // Held by us: of another type, release and acquire Write Exclusive; of this type
            // (under a key just replaced, which keeps the holder) nothing more.
            if t != ResvType::WriteExclusive {
                steps.push(Step::Release(t));
                steps.push(Step::Acquire);
            }
        }
        (Some(_), Some(h)) => {
            if !preempt {
                return Err(h.clone());
            }
            steps.push(Step::PreemptAndAbort { holder_key: h.key });
        }
        _ => steps.push(Step::Acquire),
    }
    Ok(steps)
}

/// What [`hold_write_exclusive`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Held {
    /// The namespace has no reservations (the target answered the report with an unsupported
    /// status).
    Unsupported(NvmeStatus),
    /// This host already held it: nothing was sent but the report.
    AlreadyHeld,
    /// This host holds it now; `preempted` is the key of the host pushed out, if any.
    Acquired { preempted: Option<u64> },
}

/// Makes this host (`host_id`, `key`) the Write Exclusive holder of the namespace at `device`
/// (rule W9): report, register, acquire or preempt-and-abort a holder (only with `preempt`),
/// then report again to check. A target without reservations gives [`Held::Unsupported`].
pub fn hold_write_exclusive(
    device: &Path,
    host_id: &Uuid,
    key: u64,
    preempt: bool,
) -> Result<Held, ResvError> {
    let ns = Namespace::open(device)?;
    let report = match ns.report() {
        Err(ResvError::Report {
            source: CommandError::Status(s),
            ..
        }) if s.is_unsupported() => return Ok(Held::Unsupported(s)),
        other => other?,
    };
    let steps = plan_hold(&report, host_id, key, preempt).map_err(|holder| ResvError::NotHeld {
        device: device.to_owned(),
        found: format!(
            "Write Exclusive held by host {} (key {:#018x}), not preempted here",
            holder.host_id, holder.key
        ),
    })?;
    if steps.is_empty() {
        return Ok(Held::AlreadyHeld);
    }
    let mut preempted = None;
    for step in steps {
        let at = device.to_owned();
        match step {
            Step::Register => ns
                .run(&Command::register(RegisterAction::Register, false, 0, key))
                .map_err(|source| ResvError::Register { device: at, source })?,
            Step::ReplaceKey => ns
                .run(&Command::register(RegisterAction::Replace, true, 0, key))
                .map_err(|source| ResvError::Register { device: at, source })?,
            Step::Release(t) => ns
                .run(&Command::release(t, key))
                .map_err(|source| ResvError::Release { device: at, source })?,
            Step::Acquire => ns
                .run(&Command::acquire(
                    AcquireAction::Acquire,
                    ResvType::WriteExclusive,
                    key,
                    0,
                ))
                .map_err(|source| ResvError::Acquire { device: at, source })?,
            Step::PreemptAndAbort { holder_key } => {
                ns.run(&Command::acquire(
                    AcquireAction::PreemptAndAbort,
                    ResvType::WriteExclusive,
                    key,
                    holder_key,
                ))
                .map_err(|source| ResvError::Preempt {
                    device: at,
                    holder_key,
                    source,
                })?;
                preempted = Some(holder_key);
            }
        }
    }
    let after = ns.report()?;
    if !after.held_by(host_id) {
        return Err(ResvError::NotHeld {
            device: device.to_owned(),
            found: after.describe(),
        });
    }
    Ok(Held::Acquired { preempted })
}

/// Releases this host's reservation (if it holds one) and unregisters its key (if registered),
/// as the report shows them. Returns whether anything was sent. A target without reservations is
/// Ok(false).
pub fn release_and_unregister(device: &Path, host_id: &Uuid) -> Result<bool, ResvError> {
    let ns = Namespace::open(device)?;
    let report = match ns.report() {
        Err(ResvError::Report {
            source: CommandError::Status(s),
            ..
        }) if s.is_unsupported() => return Ok(false),
        other => other?,
    };
    let Some(mine) = report.registration_of(host_id) else {
        return Ok(false);
    };
    let holding = report.holder().is_some_and(|h| h.host_id == *host_id);
    if let (Some(t), true) = (report.rtype, holding) {
        ns.run(&Command::release(t, mine.key))
            .map_err(|source| ResvError::Release {
                device: device.to_owned(),
                source,
            })?;
    }
    ns.run(&Command::register(
        RegisterAction::Unregister,
        false,
        mine.key,
        0,
    ))
    .map_err(|source| ResvError::Unregister {
        device: device.to_owned(),
        source,
    })?;
    Ok(true)
}

/// Reads the extended Reservation Report of the namespace at `device`.
pub fn report(device: &Path) -> Result<Report, ResvError> {
    Namespace::open(device)?.report()
}

/// `struct nvme_passthru_cmd` of linux/nvme_ioctl.h (72 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct PassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}

/// `NVME_IOCTL_ID`: `_IO('N', 0x40)`, returns the namespace ID of the block device.
const NVME_IOCTL_ID: libc::Ioctl = libc::_IO(b'N' as u32, 0x40);
/// `NVME_IOCTL_IO_CMD`: `_IOWR('N', 0x43, struct nvme_passthru_cmd)`.
const NVME_IOCTL_IO_CMD: libc::Ioctl = libc::_IOWR::<PassthruCmd>(b'N' as u32, 0x43);

/// An open namespace block device and its namespace ID.
struct Namespace {
    file: File,
    nsid: u32,
    path: PathBuf,
}

impl Namespace {
    fn open(device: &Path) -> Result<Self, ResvError> {
        // Read-only suffices for the ioctl (the kernel checks CAP_SYS_ADMIN, not the open mode).
        let file = OpenOptions::new()
            .read(true)
            .open(device)
            .map_err(|source| ResvError::Open {
                device: device.to_owned(),
                source,
            })?;
        // SAFETY: the fd is open for as long as `file` lives; NVME_IOCTL_ID takes no argument
        // and only returns a value.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), NVME_IOCTL_ID) };
        let nsid =
            u32::try_from(rc)
                .ok()
                .filter(|n| *n != 0)
                .ok_or_else(|| ResvError::NamespaceId {
                    device: device.to_owned(),
                    source: if rc < 0 {
                        io::Error::last_os_error()
                    } else {
                        io::Error::other(format!("namespace ID {rc}"))
                    },
                })?;
        Ok(Self {
            file,
            nsid,
            path: device.to_owned(),
        })
    }

    fn report(&self) -> Result<Report, ResvError> {
        let cmd = Command::report(REPORT_LEN);
        let mut buf = vec![0u8; REPORT_LEN];
        self.submit(&cmd, &mut buf)
            .map_err(|source| ResvError::Report {
                device: self.path.clone(),
                source,
            })?;
        Report::decode(&buf).map_err(|reason| ResvError::DecodeReport {
            device: self.path.clone(),
            reason,
        })
    }

    fn run(&self, cmd: &Command) -> Result<(), CommandError> {
        let mut data = cmd.data.clone();
        self.submit(cmd, &mut data)
    }

    /// Sends `cmd` with `buf` as its data buffer (written to the device, or filled by it).
    fn submit(&self, cmd: &Command, buf: &mut [u8]) -> Result<(), CommandError> {
        let data_len = u32::try_from(buf.len())
            .map_err(|_| CommandError::Ioctl(io::Error::from_raw_os_error(libc::EINVAL)))?;
        let mut raw = PassthruCmd {
            opcode: cmd.opcode,
            nsid: self.nsid,
            addr: buf.as_mut_ptr() as u64,
            data_len,
            cdw10: cmd.cdw10,
            cdw11: cmd.cdw11,
            ..PassthruCmd::default()
        };
        // SAFETY: the fd is open for as long as `self.file` lives. `raw` is a live, writable
        // `struct nvme_passthru_cmd` (same layout, checked by a test) for the whole call; its
        // `addr` points to `buf`, which is borrowed mutably for the call and is exactly
        // `data_len` bytes long, so the kernel reads or writes only inside it. No metadata
        // buffer is passed (`metadata` 0, `metadata_len` 0).
        let rc = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                NVME_IOCTL_IO_CMD,
                &mut raw as *mut PassthruCmd,
            )
        };
        match rc {
            0 => Ok(()),
            r if r < 0 => Err(CommandError::Ioctl(io::Error::last_os_error())),
            status => Err(CommandError::Status(NvmeStatus(
                u16::try_from(status).unwrap_or(u16::MAX),
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: Uuid = Uuid::from_u128(0x1111_2222_3333_4444_5555_6666_7777_8888);
    const OTHER: Uuid = Uuid::from_u128(0x9999_aaaa_bbbb_cccc_dddd_eeee_ffff_0000);

    // proves W9 (the ioctl's struct and number are the kernel's: a wrong size would make every
    // command fail with ENOTTY on a real kernel)
    #[test]
    fn the_passthrough_struct_and_ioctl_numbers_are_the_kernels() {
        assert_eq!(std::mem::size_of::<PassthruCmd>(), 72);
        assert_eq!(std::mem::offset_of!(PassthruCmd, addr), 24);
        assert_eq!(std::mem::offset_of!(PassthruCmd, data_len), 36);
        assert_eq!(std::mem::offset_of!(PassthruCmd, cdw10), 40);
        assert_eq!(std::mem::offset_of!(PassthruCmd, result), 68);
        #[cfg(any(
            target_arch = "x86_64",
            target_arch = "aarch64",
            target_arch = "riscv64"
        ))]
        {
            // `Ioctl` is c_ulong on glibc and c_int on musl: compare through u64 either way.
            fn to_u64<T: TryInto<u64>>(v: T) -> Option<u64> {
                v.try_into().ok()
            }
            assert_eq!(to_u64(NVME_IOCTL_IO_CMD), Some(0xC048_4E43));
            assert_eq!(to_u64(NVME_IOCTL_ID), Some(0x4E40));
        }
    }

    // proves W9 (command encoding per the NVMe base specification)
    #[test]
    fn register_encodes_rrega_iekey_and_both_keys_little_endian() {
        let c = Command::register(RegisterAction::Register, false, 0, 0x0102_0304_0506_0708);
        assert_eq!((c.opcode, c.cdw10, c.cdw11), (0x0D, 0, 0));
        assert_eq!(c.data, [0, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1]);
        let c = Command::register(RegisterAction::Unregister, false, 0xAB, 0);
        assert_eq!(c.cdw10, 1);
        assert_eq!(&c.data[..8], &[0xAB, 0, 0, 0, 0, 0, 0, 0]);
        let c = Command::register(RegisterAction::Replace, true, 0, 5);
        assert_eq!(c.cdw10, 0b1010);
        assert_eq!(c.read_len, 0);
    }

    // proves W9
    #[test]
    fn acquire_release_and_report_encode_their_dwords() {
        let c = Command::acquire(AcquireAction::Acquire, ResvType::WriteExclusive, 7, 0);
        assert_eq!((c.opcode, c.cdw10), (0x11, 0x100));
        assert_eq!(c.data.len(), 16);
        let c = Command::acquire(
            AcquireAction::PreemptAndAbort,
            ResvType::WriteExclusive,
            7,
            0x1122_3344_5566_7788,
        );
        assert_eq!(c.cdw10, 0x102);
        assert_eq!(&c.data[..8], &7u64.to_le_bytes());
        assert_eq!(
            &c.data[8..],
            &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]
        );
        let c = Command::acquire(AcquireAction::Preempt, ResvType::ExclusiveAccess, 7, 9);
        assert_eq!(c.cdw10, 0x201);
        let c = Command::release(ResvType::WriteExclusive, 7);
        assert_eq!((c.opcode, c.cdw10, c.data.len()), (0x15, 0x100, 8));
        let c = Command::report(4096);
        assert_eq!(
            (c.opcode, c.cdw10, c.cdw11, c.read_len),
            (0x0E, 1023, 1, 4096)
        );
        assert!(c.data.is_empty());
    }

    /// An extended report built by hand from the spec's byte layout.
    fn report_bytes(generation: u32, rtype: u8, regs: &[(u16, bool, u64, Uuid)]) -> Vec<u8> {
        let mut b = vec![0u8; 64 + 64 * regs.len()];
        b[0..4].copy_from_slice(&generation.to_le_bytes());
        b[4] = rtype;
        b[5..7].copy_from_slice(&u16::try_from(regs.len()).unwrap().to_le_bytes());
        b[9] = 0; // PTPLS
        for (i, (cntlid, holds, key, id)) in regs.iter().enumerate() {
            let e = 64 + 64 * i;
            b[e..e + 2].copy_from_slice(&cntlid.to_le_bytes());
            b[e + 2] = u8::from(*holds);
            b[e + 8..e + 16].copy_from_slice(&key.to_le_bytes());
            b[e + 16..e + 32].copy_from_slice(id.as_bytes());
        }
        b
    }

    // proves W9 (report decoding: holder, keys, host IDs)
    #[test]
    fn an_extended_report_decodes_into_holder_keys_and_host_ids() {
        let mut buf = report_bytes(
            42,
            1,
            &[
                (3, false, 0xAAAA, ME),
                (7, true, 0xBBBB_CCCC_DDDD_EEEE, OTHER),
            ],
        );
        buf.resize(4096, 0);
        let r = Report::decode(&buf).unwrap();
        assert_eq!(r.generation, 42);
        assert_eq!(r.rtype, Some(ResvType::WriteExclusive));
        assert_eq!(r.registrants.len(), 2);
        assert_eq!(
            r.holder(),
            Some(&Registrant {
                cntlid: 7,
                holds: true,
                key: 0xBBBB_CCCC_DDDD_EEEE,
                host_id: OTHER
            })
        );
        assert_eq!(r.registration_of(&ME).map(|m| m.key), Some(0xAAAA));
        assert!(r.held_by(&OTHER) && !r.held_by(&ME));

        let none = Report::decode(&report_bytes(1, 0, &[])).unwrap();
        assert_eq!((none.rtype, none.holder()), (None, None));
    }

    // proves W9, C4 (a malformed report is an error, never a guess)
    #[test]
    fn a_short_or_reserved_report_is_an_error() {
        assert!(Report::decode(&[0u8; 63]).is_err());
        let mut b = report_bytes(1, 1, &[(1, true, 1, ME)]);
        b.truncate(100);
        assert!(Report::decode(&b).is_err());
        assert!(Report::decode(&report_bytes(1, 9, &[])).is_err());
    }

    // proves W9 (status decoding: reservation conflict 0x83, unsupported, do-not-retry)
    #[test]
    fn statuses_decode() {
        let conflict = NvmeStatus(0x4083);
        assert!(conflict.is_reservation_conflict() && conflict.dnr());
        assert!(!conflict.is_unsupported());
        assert!(conflict.to_string().contains("reservation conflict"));
        assert!(NvmeStatus(0x4001).is_unsupported());
        assert!(NvmeStatus(0x0002).is_unsupported());
        assert!(!NvmeStatus(0x0183).is_reservation_conflict());
        assert_eq!(NvmeStatus(0x0283).sct(), 2);
    }

    // proves W9 (the key: deterministic per host, distinct between hosts, never zero)
    #[test]
    fn keys_are_stable_per_host_and_differ_between_hosts() {
        assert_eq!(key_for_host(&ME), key_for_host(&ME));
        assert_ne!(key_for_host(&ME), key_for_host(&OTHER));
        assert_ne!(key_for_host(&ME), 0);
        assert_ne!(key_for_host(&Uuid::nil()), 0);
    }

    fn rep(rtype: u8, regs: &[(u16, bool, u64, Uuid)]) -> Report {
        Report::decode(&report_bytes(1, rtype, regs)).unwrap()
    }

    // proves W9 (the stage's decision table)
    #[test]
    fn plan_hold_decides_every_case() {
        let k = key_for_host(&ME);
        // Nothing registered, nothing held: register and acquire.
        assert_eq!(
            plan_hold(&rep(0, &[]), &ME, k, true),
            Ok(vec![Step::Register, Step::Acquire])
        );
        // Already the WE holder with our key: nothing (a retried NodeStage).
        assert_eq!(
            plan_hold(&rep(1, &[(1, true, k, ME)]), &ME, k, true),
            Ok(vec![])
        );
        // Registered but not holding, nobody holds: acquire.
        assert_eq!(
            plan_hold(&rep(0, &[(1, false, k, ME)]), &ME, k, true),
            Ok(vec![Step::Acquire])
        );
        // A stale holder: register, then preempt-and-abort its key.
        assert_eq!(
            plan_hold(&rep(1, &[(2, true, 0xDEAD, OTHER)]), &ME, k, true),
            Ok(vec![
                Step::Register,
                Step::PreemptAndAbort { holder_key: 0xDEAD }
            ])
        );
        // Without preempt (re-acquiring after a target restart), another holder is left alone.
        assert_eq!(
            plan_hold(&rep(1, &[(2, true, 0xDEAD, OTHER)]), &ME, k, false).map_err(|h| h.host_id),
            Err(OTHER)
        );
        // We hold another type: release it and acquire WE.
        assert_eq!(
            plan_hold(&rep(2, &[(1, true, k, ME)]), &ME, k, true),
            Ok(vec![
                Step::Release(ResvType::ExclusiveAccess),
                Step::Acquire
            ])
        );
        // Holding WE under another key: replace the key, nothing more.
        assert_eq!(
            plan_hold(&rep(1, &[(1, true, 5, ME)]), &ME, k, true),
            Ok(vec![Step::ReplaceKey])
        );
        // Registered under another key: replace the key, then acquire.
        assert_eq!(
            plan_hold(&rep(0, &[(1, false, 5, ME)]), &ME, k, true),
            Ok(vec![Step::ReplaceKey, Step::Acquire])
        );
    }

    // proves W9 (a device that is not an NVMe namespace fails at the namespace-ID step, with its
    // source, and nothing is sent)
    #[test]
    fn a_regular_file_fails_at_the_namespace_id_step() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let err = hold_write_exclusive(f.path(), &ME, 1, true).unwrap_err();
        assert!(
            matches!(&err, ResvError::NamespaceId { source, .. } if source.raw_os_error() == Some(libc::ENOTTY)),
            "{err:?}"
        );
        let err = super::report(Path::new("/nonexistent/nvme0n1")).unwrap_err();
        assert!(matches!(err, ResvError::Open { .. }), "{err:?}");
    }
}
