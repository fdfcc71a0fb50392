//! Block devices and filesystems: probe, format only what is blank (rule N3), mount, bind-mount,
//! unmount, grow, statistics.
//!
//! Probing uses util-linux `blkid -p -o export`. Its exit code 2 means "nothing found", but
//! blkid also exits 2, silently, when the device does not exist or a read fails while probing.
//! So before trusting "nothing found" this module opens the device itself, checks that it is a
//! block device, reads its first and last MiB (where signatures live), and after blkid checks
//! that the path still names the same device. Only then is the device blank; any other
//! outcome is an error, never "blank".
//!
//! mkfs runs without its force flag, so mke2fs and mkfs.xfs themselves refuse to overwrite a
//! signature they recognise: a second guard behind the probe. Extra mkfs options must each start
//! with `-`, so none can be taken for the device argument.

use std::ffi::OsStr;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::mountinfo::{self, MountEntry};
use crate::{HostError, exec, sys};

/// Longest a probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest mkfs may take (discarding a large thin device takes minutes).
pub const MKFS_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Longest an online grow may take.
pub const GROW_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// How much of each end of the device the probe reads itself.
const PROBE_READ: u64 = 1 << 20;
/// Most unmounts tried on one target (mounts can be stacked).
const MAX_UNMOUNTS: u32 = 16;
/// How often an unmount refused with EBUSY is tried again, and the pause before each try.
const BUSY_RETRIES: u32 = 10;
const BUSY_PAUSE: Duration = Duration::from_millis(50);

/// mkfs.xfs's minimum filesystem size: 300 MiB.
pub const XFS_MIN_BYTES: u64 = 300 << 20;

/// A filesystem pillar can create.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FsType {
    Ext4,
    Xfs,
}

impl FsType {
    /// The name mount(2) and blkid use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ext4 => "ext4",
            Self::Xfs => "xfs",
        }
    }

    /// Parses a CSI `fs_type`; empty is not accepted here (the caller picks its default).
    pub fn parse(s: &str) -> Result<Self, HostError> {
        match s {
            "ext4" => Ok(Self::Ext4),
            "xfs" => Ok(Self::Xfs),
            _ => Err(HostError::InvalidArgument {
                what: "filesystem type",
                value: s.to_owned(),
                reason: "pillar supports ext4 and xfs",
            }),
        }
    }

    fn mkfs_program(self) -> &'static str {
        match self {
            Self::Ext4 => "mkfs.ext4",
            Self::Xfs => "mkfs.xfs",
        }
    }
}

impl fmt::Display for FsType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What blkid found on a device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Signature {
    /// `TYPE`: a filesystem, RAID member, LUKS header, swap, ...
    pub fs_type: Option<String>,
    /// `PTTYPE`: a partition table (`dos`, `gpt`, ...).
    pub pt_type: Option<String>,
    /// `USAGE`: `filesystem`, `raid`, `crypto`, `other`.
    pub usage: Option<String>,
}

impl Signature {
    /// The filesystem pillar can use, if that is what this is (a bare ext4 or xfs, no partition
    /// table).
    pub fn as_fs(&self) -> Option<FsType> {
        if self.pt_type.is_some() {
            return None;
        }
        FsType::parse(self.fs_type.as_deref()?).ok()
    }
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(t) = &self.fs_type {
            parts.push(format!("a {t} signature"));
        }
        if let Some(t) = &self.pt_type {
            parts.push(format!("a {t} partition table"));
        }
        if parts.is_empty() {
            parts.push(format!(
                "an unnamed signature (usage {})",
                self.usage.as_deref().unwrap_or("unknown")
            ));
        }
        f.write_str(&parts.join(" and "))
    }
}

/// The outcome of a probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// No filesystem, partition table or other signature, and the device was readable.
    Blank,
    Found(Signature),
}

/// What [`format_if_blank`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Formatted {
    /// The device was blank and now holds the requested filesystem.
    Formatted,
    /// The device already held this filesystem; nothing was written.
    AlreadyHad(FsType),
}

/// Filesystem usage, for NodeGetVolumeStats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeStats {
    pub bytes_total: u64,
    pub bytes_available: u64,
    pub bytes_used: u64,
    pub inodes_total: u64,
    pub inodes_free: u64,
    pub inodes_used: u64,
}

/// Opens `dev` read-only and checks it is a block device.
pub(crate) fn open_block_device(dev: &Path) -> Result<(File, u64), HostError> {
    let file = File::open(dev).map_err(|source| HostError::Device {
        path: dev.to_path_buf(),
        source,
    })?;
    let meta = file.metadata().map_err(|source| HostError::Device {
        path: dev.to_path_buf(),
        source,
    })?;
    if !meta.file_type().is_block_device() {
        return Err(HostError::NotBlockDevice {
            path: dev.to_path_buf(),
        });
    }
    Ok((file, meta.rdev()))
}

/// The size of block device `dev` in bytes (BLKGETSIZE64).
pub fn block_device_size(dev: &Path) -> Result<u64, HostError> {
    let (file, _) = open_block_device(dev)?;
    sys::blkgetsize64(&file).map_err(|source| HostError::DeviceSize {
        path: dev.to_path_buf(),
        source,
    })
}

/// Reads `len` bytes at `offset`, to prove the device answers reads there.
fn read_region(file: &File, dev: &Path, offset: u64, len: u64) -> Result<(), HostError> {
    let len = usize::try_from(len).map_err(|_| HostError::Probe {
        device: dev.to_path_buf(),
        detail: "probe region does not fit in memory".into(),
    })?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, offset)
        .map_err(|source| HostError::Device {
            path: dev.to_path_buf(),
            source,
        })
}

/// Parses `blkid -o export` output.
pub(crate) fn parse_blkid_export(out: &str) -> Option<Signature> {
    let mut sig = Signature::default();
    let mut devname = false;
    for line in out.lines() {
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        match key {
            "DEVNAME" => devname = true,
            "TYPE" => sig.fs_type = Some(value.to_owned()),
            "PTTYPE" => sig.pt_type = Some(value.to_owned()),
            "USAGE" => sig.usage = Some(value.to_owned()),
            _ => {}
        }
    }
    devname.then_some(sig)
}

/// Probes `dev` for any filesystem, partition table or other signature (rule N3).
pub fn probe(dev: &Path) -> Result<Probe, HostError> {
    let (file, rdev) = open_block_device(dev)?;
    let size = sys::blkgetsize64(&file).map_err(|source| HostError::DeviceSize {
        path: dev.to_path_buf(),
        source,
    })?;
    let head = size.min(PROBE_READ);
    read_region(&file, dev, 0, head)?;
    read_region(&file, dev, size - head, head)?;

    let args = [
        OsStr::new("-p"),
        OsStr::new("-o"),
        OsStr::new("export"),
        OsStr::new("--"),
        dev.as_os_str(),
    ];
    let out = exec::run("blkid", &args, PROBE_TIMEOUT)?;
    let result = match out.status.code() {
        Some(0) => match parse_blkid_export(&out.stdout) {
            Some(sig) => Probe::Found(sig),
            None => {
                return Err(HostError::Probe {
                    device: dev.to_path_buf(),
                    detail: format!(
                        "exit 0 without DEVNAME (is blkid from util-linux?): {:?}",
                        out.stdout
                    ),
                });
            }
        },
        Some(2) => {
            if !out.stdout.trim().is_empty() || !out.stderr.trim().is_empty() {
                return Err(HostError::Probe {
                    device: dev.to_path_buf(),
                    detail: format!(
                        "\"nothing found\" with output: {} {}",
                        out.stdout.trim(),
                        out.stderr.trim()
                    ),
                });
            }
            // blkid skips, silently, a path it cannot stat: make sure it saw our device.
            let still = open_block_device(dev)?.1;
            if still != rdev {
                return Err(HostError::Probe {
                    device: dev.to_path_buf(),
                    detail: "the device node changed while probing".into(),
                });
            }
            Probe::Blank
        }
        Some(8) => {
            return Err(HostError::Probe {
                device: dev.to_path_buf(),
                detail: format!("ambivalent result: {}", out.stderr.trim()),
            });
        }
        _ => return Err(exec::failed("blkid", &args, &out)),
    };
    drop(file);
    tracing::debug!(device = %dev.display(), ?result, "probed");
    Ok(result)
}

/// Whether `dev` is blank: no filesystem, partition table or other signature (rule N3). Any
/// failure to find out is an error, never `true`.
pub fn probe_blank(dev: &Path) -> Result<bool, HostError> {
    Ok(probe(dev)? == Probe::Blank)
}

/// How mkfs of one filesystem reads its short options: which letters take an argument, and
/// which are refused.
struct MkfsGrammar {
    /// Letters followed by an argument (in the same element, or the next one).
    with_argument: &'static str,
    /// Letters that take no argument.
    plain: &'static str,
    /// Refused letters, and why.
    refused: &'static [(char, &'static str)],
}

impl FsType {
    fn mkfs_grammar(self) -> MkfsGrammar {
        match self {
            // mke2fs(8).
            Self::Ext4 => MkfsGrammar {
                with_argument: "bCdeEgGiIJlLmMNoOrtTUz",
                plain: "cDjKnqvV",
                refused: &[
                    ('F', "forcing mkfs would defeat the blank-device check"),
                    ('S', "writes superblocks over an existing filesystem"),
                    ('d', "copies files from the node's own filesystem"),
                    ('z', "writes an undo file on the node's own filesystem"),
                    ('l', "reads a file from the node's own filesystem"),
                ],
            },
            // mkfs.xfs(8).
            Self::Xfs => MkfsGrammar {
                with_argument: "bdilLmnrs",
                plain: "KNqV",
                refused: &[
                    ('f', "forcing mkfs would defeat the blank-device check"),
                    (
                        'p',
                        "copies files named in a file of the node's own filesystem",
                    ),
                    (
                        'c',
                        "reads a configuration file from the node's own filesystem",
                    ),
                ],
            },
        }
    }

    /// The smallest device mkfs makes this filesystem on, where pillar enforces one: mkfs.xfs
    /// refuses a data section under 300 MiB ("Filesystem must be larger than 300MB"; exactly
    /// 300 MiB is accepted, 512 bytes less is not: xfsprogs 6.1). ext4 has none here.
    pub fn min_device_bytes(self) -> Option<u64> {
        match self {
            Self::Ext4 => None,
            Self::Xfs => Some(XFS_MIN_BYTES),
        }
    }

    /// The mount option that lets this filesystem mount while another copy of it (same
    /// filesystem UUID: a clone or a restore is a byte copy of its source) is mounted on the
    /// node. XFS refuses a second mount of a UUID without `nouuid`; ext4 does not check. The
    /// same device mounted twice is still one superblock, so this only admits distinct devices.
    pub fn duplicate_uuid_option(self) -> Option<&'static str> {
        match self {
            Self::Ext4 => None,
            Self::Xfs => Some("nouuid"),
        }
    }

    /// The mount option that keeps a read-only mount from replaying the filesystem's log: a
    /// replay writes to the device, which a node sharing a volume read-only must never do (N5).
    pub fn no_log_replay_option(self) -> &'static str {
        match self {
            Self::Ext4 => "noload",
            Self::Xfs => "norecovery",
        }
    }
}

/// Checks mkfs extra options the way mkfs itself reads them (getopt short options: `-qL name`,
/// `-Lname`, `-E nodiscard`): every letter known, none refused (force, superblock rewrite, host
/// files), every argument where mkfs expects one, and no positional argument (a device or a
/// size). Long options are refused.
fn check_mkfs_options(fs: FsType, options: &[String]) -> Result<(), HostError> {
    let grammar = fs.mkfs_grammar();
    let mut args = options.iter();
    while let Some(opt) = args.next() {
        let bad = |reason: &str| HostError::MkfsOption {
            value: opt.clone(),
            reason: reason.to_owned(),
        };
        if opt.contains('\0') {
            return Err(bad("contains a NUL byte"));
        }
        let Some(letters) = opt.strip_prefix('-').filter(|l| !l.is_empty()) else {
            return Err(bad(
                "each mkfs option must start with '-' (e.g. -Lname); positional arguments are refused",
            ));
        };
        if letters.starts_with('-') {
            return Err(bad("long options are refused"));
        }
        for (i, letter) in letters.char_indices() {
            if let Some((_, why)) = grammar.refused.iter().find(|(l, _)| *l == letter) {
                return Err(bad(&format!("-{letter} {why}")));
            }
            if grammar.with_argument.contains(letter) {
                // The rest of this element is the argument, or else the next element is.
                if i + letter.len_utf8() == letters.len() && args.next().is_none() {
                    return Err(bad(&format!("-{letter} needs an argument")));
                }
                break;
            }
            if !grammar.plain.contains(letter) {
                return Err(bad(&format!(
                    "-{letter} is not an option of mkfs.{}",
                    fs.as_str()
                )));
            }
        }
    }
    Ok(())
}

/// Creates filesystem `fs` on `dev`, which must be blank (rule N3): it is probed first, and a
/// device with any signature is refused with [`HostError::ExistingSignature`]. Afterwards the
/// device is probed again and must show the new filesystem.
pub fn mkfs(dev: &Path, fs: FsType, extra_options: &[String]) -> Result<(), HostError> {
    check_mkfs_options(fs, extra_options)?;
    if let Probe::Found(found) = probe(dev)? {
        return Err(HostError::ExistingSignature {
            device: dev.to_path_buf(),
            found,
            requested: fs,
        });
    }
    let mut args: Vec<&OsStr> = vec![OsStr::new("-q")];
    args.extend(extra_options.iter().map(OsStr::new));
    args.push(OsStr::new("--"));
    args.push(dev.as_os_str());
    tracing::info!(device = %dev.display(), %fs, ?extra_options, "creating filesystem");
    let out = exec::run(fs.mkfs_program(), &args, MKFS_TIMEOUT)?;
    if !out.status.success() {
        // Its error line, not its usage text: this reaches the CO as NodeStage's message.
        return Err(exec::failed_briefly(fs.mkfs_program(), &args, &out));
    }
    match probe(dev)? {
        Probe::Found(sig) if sig.as_fs() == Some(fs) => Ok(()),
        Probe::Found(sig) => Err(HostError::FormatNotVisible {
            device: dev.to_path_buf(),
            found: Some(sig),
            requested: fs,
        }),
        Probe::Blank => Err(HostError::FormatNotVisible {
            device: dev.to_path_buf(),
            found: None,
            requested: fs,
        }),
    }
}

/// Rule N3: formats `dev` with `fs` only if it is blank. A device that already holds `fs` is
/// left untouched; one holding anything else is refused with [`HostError::ExistingSignature`].
pub fn format_if_blank(
    dev: &Path,
    fs: FsType,
    extra_options: &[String],
) -> Result<Formatted, HostError> {
    check_mkfs_options(fs, extra_options)?;
    match probe(dev)? {
        Probe::Blank => {
            mkfs(dev, fs, extra_options)?;
            Ok(Formatted::Formatted)
        }
        Probe::Found(sig) if sig.as_fs() == Some(fs) => Ok(Formatted::AlreadyHad(fs)),
        Probe::Found(found) => Err(HostError::ExistingSignature {
            device: dev.to_path_buf(),
            found,
            requested: fs,
        }),
    }
}

/// mount(2) flags and the filesystem data string from CSI mount options.
fn split_mount_options(
    readonly: bool,
    options: &[String],
) -> Result<(libc::c_ulong, Option<String>), HostError> {
    let mut flags: libc::c_ulong = if readonly { libc::MS_RDONLY } else { 0 };
    let mut data = Vec::new();
    for opt in options {
        let bad = |reason| HostError::InvalidArgument {
            what: "mount option",
            value: opt.clone(),
            reason,
        };
        if opt.is_empty() || opt.contains(',') || opt.contains('\0') {
            return Err(bad("must be one non-empty option without ',' or NUL"));
        }
        let flag = match opt.as_str() {
            "defaults" => 0,
            "ro" => libc::MS_RDONLY,
            "rw" if readonly => return Err(bad("conflicts with a read-only mount")),
            "rw" => 0,
            "nosuid" => libc::MS_NOSUID,
            "nodev" => libc::MS_NODEV,
            "noexec" => libc::MS_NOEXEC,
            "sync" => libc::MS_SYNCHRONOUS,
            "dirsync" => libc::MS_DIRSYNC,
            "noatime" => libc::MS_NOATIME,
            "nodiratime" => libc::MS_NODIRATIME,
            "relatime" => libc::MS_RELATIME,
            "strictatime" => libc::MS_STRICTATIME,
            "lazytime" => libc::MS_LAZYTIME,
            "bind" | "rbind" | "remount" | "move" | "shared" | "rshared" | "slave" | "rslave"
            | "private" | "rprivate" | "unbindable" | "runbindable" => {
                return Err(bad("changes what kind of mount this is"));
            }
            _ => {
                data.push(opt.as_str());
                0
            }
        };
        flags |= flag;
    }
    let data = (!data.is_empty()).then(|| data.join(","));
    Ok((flags, data))
}

/// Mounts filesystem `fs` on `dev` at `target` (which must exist).
pub fn mount(
    dev: &Path,
    target: &Path,
    fs: FsType,
    readonly: bool,
    options: &[String],
) -> Result<(), HostError> {
    let (flags, data) = split_mount_options(readonly, options)?;
    let c_dev = sys::cstring(dev.as_os_str())?;
    let c_target = sys::cstring(target.as_os_str())?;
    let c_fs = sys::cstring(OsStr::new(fs.as_str()))?;
    let c_data = data
        .as_deref()
        .map(OsStr::new)
        .map(sys::cstring)
        .transpose()?;
    tracing::info!(
        device = %dev.display(), target = %target.display(), %fs, readonly, data = ?data,
        "mounting"
    );
    sys::mount(Some(&c_dev), &c_target, Some(&c_fs), flags, c_data.as_ref()).map_err(|source| {
        HostError::Mount {
            source_path: dev.to_path_buf(),
            target: target.to_path_buf(),
            fs: fs.as_str().to_owned(),
            source,
        }
    })
}

/// Per-mount flags of the mount at `path` that a bind remount must keep.
fn kept_flags(path: &std::ffi::CString) -> io::Result<libc::c_ulong> {
    let st = sys::statvfs(path)?;
    let f = st.f_flag;
    let mut flags = 0;
    for (st_flag, ms_flag) in [
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if f & st_flag != 0 {
            flags |= ms_flag;
        }
    }
    Ok(flags)
}

/// Bind-mounts `src` on `target` (both existing; files for block volumes, directories for
/// filesystems). A read-only bind needs a second, remounting call; if that fails the bind is
/// undone, so a writable bind is never left where a read-only one was asked for.
pub fn bind_mount(src: &Path, target: &Path, readonly: bool) -> Result<(), HostError> {
    let c_src = sys::cstring(src.as_os_str())?;
    let c_target = sys::cstring(target.as_os_str())?;
    tracing::info!(src = %src.display(), target = %target.display(), readonly, "bind mounting");
    sys::mount(Some(&c_src), &c_target, None, libc::MS_BIND, None).map_err(|source| {
        HostError::Mount {
            source_path: src.to_path_buf(),
            target: target.to_path_buf(),
            fs: "bind".into(),
            source,
        }
    })?;
    if !readonly {
        return Ok(());
    }
    let remount = kept_flags(&c_target).and_then(|kept| {
        sys::mount(
            None,
            &c_target,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | kept,
            None,
        )
    });
    if let Err(source) = remount {
        if let Err(e) = sys::umount2(&c_target, 0) {
            tracing::error!(target = %target.display(), error = %e,
                "undoing a bind mount that could not be made read-only failed");
        }
        return Err(HostError::ReadonlyRemount {
            target: target.to_path_buf(),
            source,
        });
    }
    Ok(())
}

/// The absolute, symlink-free form of `path` as mountinfo shows it, without touching `path`'s
/// own inode (a shut-down filesystem answers EIO there). `None` if the parent does not exist.
fn resolve(path: &Path) -> Result<Option<PathBuf>, HostError> {
    let (dir, name) = match path.file_name() {
        Some(name) => {
            let parent = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            (parent, Some(name))
        }
        None => (path, None),
    };
    match std::fs::canonicalize(dir) {
        Ok(p) => Ok(Some(match name {
            Some(n) => p.join(n),
            None => p,
        })),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(HostError::ResolvePath {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The topmost mount at `path`, from `/proc/self/mountinfo`.
pub fn find_mount(path: &Path) -> Result<Option<MountEntry>, HostError> {
    let Some(resolved) = resolve(path)? else {
        return Ok(None);
    };
    let table = mountinfo::read(Path::new(mountinfo::SELF_MOUNTINFO))?;
    Ok(mountinfo::find(&table, &resolved).cloned())
}

/// Whether something is mounted exactly at `path` (from `/proc/self/mountinfo`).
pub fn is_mountpoint(path: &Path) -> Result<bool, HostError> {
    Ok(find_mount(path)?.is_some())
}

/// Unmounts everything stacked at `target`. Idempotent: nothing mounted (or no such path) is
/// success.
pub fn unmount(target: &Path) -> Result<(), HostError> {
    let c_target = sys::cstring(target.as_os_str())?;
    let mut busy = 0;
    let mut attempts = 0;
    while attempts < MAX_UNMOUNTS {
        if !is_mountpoint(target)? {
            return Ok(());
        }
        tracing::info!(target = %target.display(), "unmounting");
        match sys::umount2(&c_target, 0) {
            Ok(()) => attempts += 1,
            // Not (or no longer) a mount point: the next check decides.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => {
                attempts += 1;
            }
            // A holder about to go: a child between fork and exec still holding a descriptor
            // of a file under the mount, a probe. Wait a little; a lasting holder still fails.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && busy < BUSY_RETRIES => {
                busy += 1;
                tracing::info!(target = %target.display(), attempt = busy, "mount point busy; trying again");
                std::thread::sleep(BUSY_PAUSE);
            }
            Err(source) => {
                return Err(HostError::Unmount {
                    target: target.to_path_buf(),
                    source,
                });
            }
        }
    }
    if is_mountpoint(target)? {
        return Err(HostError::StillMounted {
            target: target.to_path_buf(),
            attempts: MAX_UNMOUNTS,
        });
    }
    Ok(())
}

/// Grows the filesystem on `dev`, mounted at `mount_path`, to fill the device (online).
pub fn grow_filesystem(dev: &Path, mount_path: &Path, fs: FsType) -> Result<(), HostError> {
    tracing::info!(device = %dev.display(), mount = %mount_path.display(), %fs, "growing filesystem");
    match fs {
        FsType::Ext4 => exec::run_ok("resize2fs", &[dev.as_os_str()], GROW_TIMEOUT)?,
        FsType::Xfs => exec::run_ok(
            "xfs_growfs",
            &[OsStr::new("-d"), mount_path.as_os_str()],
            GROW_TIMEOUT,
        )?,
    };
    Ok(())
}

/// statvfs fields are u64 on 64-bit Linux and may be narrower elsewhere.
fn widen<T: Into<u64>>(v: T) -> u64 {
    v.into()
}

/// Capacity and inode usage of the filesystem holding `path` (statvfs).
pub fn volume_stats(path: &Path) -> Result<VolumeStats, HostError> {
    let c_path = sys::cstring(path.as_os_str())?;
    let st = sys::statvfs(&c_path).map_err(|source| HostError::Statvfs {
        path: path.to_path_buf(),
        source,
    })?;
    let frsize = widen(st.f_frsize);
    let blocks = widen(st.f_blocks);
    let bfree = widen(st.f_bfree);
    let bavail = widen(st.f_bavail);
    let files = widen(st.f_files);
    let ffree = widen(st.f_ffree);
    Ok(VolumeStats {
        bytes_total: blocks.saturating_mul(frsize),
        bytes_available: bavail.saturating_mul(frsize),
        bytes_used: blocks.saturating_sub(bfree).saturating_mul(frsize),
        inodes_total: files,
        inodes_free: ffree,
        inodes_used: files.saturating_sub(ffree),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_type_names() {
        assert_eq!(FsType::parse("ext4").unwrap(), FsType::Ext4);
        assert_eq!(FsType::parse("xfs").unwrap(), FsType::Xfs);
        for bad in ["", "ext3", "XFS", "btrfs"] {
            assert!(FsType::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(serde_json::to_string(&FsType::Xfs).unwrap(), "\"xfs\"");
    }

    #[test]
    fn blkid_export_parsing() {
        let sig = parse_blkid_export(
            "DEVNAME=/dev/loop0\nUUID=1234\nBLOCK_SIZE=4096\nTYPE=ext4\nUSAGE=filesystem\n",
        )
        .unwrap();
        assert_eq!(sig.as_fs(), Some(FsType::Ext4));
        let pt = parse_blkid_export("DEVNAME=/dev/loop0\nPTTYPE=dos\n").unwrap();
        assert_eq!(pt.as_fs(), None);
        assert_eq!(pt.to_string(), "a dos partition table");
        let ext3 = parse_blkid_export("DEVNAME=x\nTYPE=ext3\n").unwrap();
        assert_eq!(ext3.as_fs(), None);
        assert!(parse_blkid_export("TYPE=ext4\n").is_none());
    }

    // proves N3: options that could force mkfs, rewrite an existing filesystem, read the
    // node's files or smuggle in a device argument are refused, however they are spelled. The
    // old check compared whole elements with a list, so `-qF` got through.
    #[test]
    fn mkfs_options_are_parsed_as_mkfs_parses_them() {
        let ok = |fs, opts: &[&str]| {
            let opts: Vec<String> = opts.iter().map(|s| (*s).to_owned()).collect();
            check_mkfs_options(fs, &opts).unwrap_or_else(|e| panic!("{opts:?}: {e}"));
        };
        ok(FsType::Ext4, &["-m0", "-Lvol", "-Enodiscard"]);
        ok(FsType::Ext4, &["-q", "-L", "vol", "-E", "nodiscard"]);
        // An argument may look like an option: `-L -F` labels the filesystem "-F".
        ok(FsType::Ext4, &["-L", "-F"]);
        ok(FsType::Ext4, &["-jqm", "1"]);
        ok(FsType::Xfs, &["-Lvol", "-d", "agcount=4", "-K"]);
        let refused = |fs, opts: &[&str]| {
            let opts: Vec<String> = opts.iter().map(|s| (*s).to_owned()).collect();
            assert!(
                matches!(
                    check_mkfs_options(fs, &opts),
                    Err(HostError::MkfsOption { .. })
                ),
                "{fs:?} {opts:?}"
            );
        };
        for bad in [
            &["-F"][..],
            &["-qF"],
            &["-Fq"],
            &["-jF"],
            &["-S"],
            &["-qS"],
            &["-d", "/etc"],
            &["-z/tmp/undo"],
            &["--force"],
            &["/dev/sda"],
            &["label"],
            &["-L"],
            &["-q", "1024"],
            &[""],
            &["-"],
            &["--"],
            &["-Y"],
        ] {
            refused(FsType::Ext4, bad);
        }
        for bad in [
            &["-f"][..],
            &["-qf"],
            &["-fq"],
            &["-p", "proto"],
            &["-c", "options=x"],
        ] {
            refused(FsType::Xfs, bad);
        }
    }

    #[test]
    fn mount_options_split_into_flags_and_data() {
        let (flags, data) = split_mount_options(
            false,
            &[
                "noatime".into(),
                "discard".into(),
                "nodev".into(),
                "errors=remount-ro".into(),
            ],
        )
        .unwrap();
        assert_eq!(flags, libc::MS_NOATIME | libc::MS_NODEV);
        assert_eq!(data.as_deref(), Some("discard,errors=remount-ro"));
        let (flags, data) = split_mount_options(true, &[]).unwrap();
        assert_eq!(flags, libc::MS_RDONLY);
        assert_eq!(data, None);
        let (flags, _) = split_mount_options(false, &["ro".into()]).unwrap();
        assert_eq!(flags, libc::MS_RDONLY);
        for bad in ["a,b", "", "bind", "remount", "rshared"] {
            assert!(
                split_mount_options(false, &[bad.into()]).is_err(),
                "{bad:?}"
            );
        }
        assert!(split_mount_options(true, &["rw".into()]).is_err());
    }

    // proves N3: a path that is not a block device is an error, never "blank" (blkid alone
    // would answer "nothing found" for a missing path).
    #[test]
    fn probe_refuses_what_is_not_a_block_device() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let err = probe_blank(&missing).unwrap_err();
        assert!(matches!(err, HostError::Device { .. }), "{err:?}");
        assert_eq!(err.class(), crate::ErrorClass::NotFound);
        let file = dir.path().join("file");
        std::fs::write(&file, vec![0u8; 4096]).unwrap();
        assert!(matches!(
            probe_blank(&file),
            Err(HostError::NotBlockDevice { .. })
        ));
        assert!(matches!(
            block_device_size(&file),
            Err(HostError::NotBlockDevice { .. })
        ));
        assert!(matches!(
            format_if_blank(&file, FsType::Ext4, &[]),
            Err(HostError::NotBlockDevice { .. })
        ));
    }

    #[test]
    fn mountpoint_checks() {
        assert!(is_mountpoint(Path::new("/")).unwrap());
        assert!(is_mountpoint(Path::new("/proc")).unwrap());
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_mountpoint(dir.path()).unwrap());
        assert!(!is_mountpoint(&dir.path().join("missing/deeper")).unwrap());
        unmount(&dir.path().join("missing")).unwrap();
        unmount(dir.path()).unwrap();
    }

    #[test]
    fn stats_of_a_real_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let s = volume_stats(dir.path()).unwrap();
        assert!(s.bytes_total > 0);
        assert!(s.bytes_available <= s.bytes_total);
        assert!(s.bytes_used <= s.bytes_total);
        assert!(matches!(
            volume_stats(&dir.path().join("missing")),
            Err(HostError::Statvfs { .. })
        ));
    }
}
