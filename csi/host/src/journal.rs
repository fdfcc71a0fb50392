//! Whether a filesystem's log (ext4's journal, XFS's log) holds changes that only a replay
//! applies: what a read-only stage must know before it mounts without replaying (rule N5).
//!
//! A byte copy of a mounted filesystem (a snapshot, a restore, a clone) carries a log the
//! kernel has not checkpointed: files fsynced shortly before the copy exist only there. A mount
//! with `noload` / `norecovery` skips the log and shows the filesystem as of its last
//! checkpoint, silently. The caller decides what to do about it; this module only reads.
//!
//! Invariant: nothing here writes to the device. ext4 is answered from the primary superblock,
//! read through a read-only descriptor. XFS is answered by xfsprogs' `xfs_logprint -t`, which
//! finds the log's head and tail with the same algorithm the kernel's log recovery uses
//! (`xlog_find_tail`) and prints `state: <CLEAN>` only when they meet; it writes nothing without
//! `-C` (libxfs opens the device read-write to look at it, but reads through its own read-only
//! descriptor). Its output after that line is a dump of the whole log, so only the first bytes
//! are kept and the tool is ended by SIGPIPE.
//!
//! Any answer other than clean or dirty (an unreadable device, a foreign superblock, a missing
//! or unexpected tool) is an error, never "clean".

use std::ffi::OsStr;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::fs::{FsType, PROBE_TIMEOUT, open_block_device};
use crate::{HostError, exec};

/// The ext4 superblock: its offset on the device and the fields read here (ext4 disk layout).
const EXT4_SUPERBLOCK: u64 = 1024;
const EXT4_SUPERBLOCK_LEN: usize = 1024;
const EXT4_MAGIC_AT: usize = 0x38;
const EXT4_MAGIC: u16 = 0xEF53;
const EXT4_INCOMPAT_AT: usize = 0x60;
/// `EXT4_FEATURE_INCOMPAT_RECOVER`: set while mounted with a journal, cleared by a clean
/// unmount or a freeze; what `dumpe2fs -h` shows as `needs_recovery`.
const EXT4_INCOMPAT_RECOVER: u32 = 0x0004;
/// How much of `xfs_logprint -t` is read: its head/tail line comes within the first few lines.
const LOGPRINT_KEEP: u64 = 64 * 1024;

/// Whether the log of filesystem `fs` on `dev` needs recovery (a replay) before the filesystem
/// shows every change its writer made durable. Never writes to `dev`.
pub fn log_needs_recovery(dev: &Path, fs: FsType) -> Result<bool, HostError> {
    let dirty = match fs {
        FsType::Ext4 => ext4_needs_recovery(dev)?,
        FsType::Xfs => xfs_log_dirty(dev)?,
    };
    tracing::debug!(device = %dev.display(), %fs, dirty, "checked the filesystem's log");
    Ok(dirty)
}

fn ext4_needs_recovery(dev: &Path) -> Result<bool, HostError> {
    let (file, _) = open_block_device(dev)?;
    let mut sb = [0u8; EXT4_SUPERBLOCK_LEN];
    file.read_exact_at(&mut sb, EXT4_SUPERBLOCK)
        .map_err(|source| HostError::Device {
            path: dev.to_path_buf(),
            source,
        })?;
    parse_ext4_superblock(&sb).map_err(|detail| HostError::LogState {
        device: dev.to_path_buf(),
        fs: FsType::Ext4,
        detail,
    })
}

/// `needs_recovery` from the bytes of an ext4 superblock.
pub(crate) fn parse_ext4_superblock(sb: &[u8; EXT4_SUPERBLOCK_LEN]) -> Result<bool, String> {
    let magic = u16::from_le_bytes([sb[EXT4_MAGIC_AT], sb[EXT4_MAGIC_AT + 1]]);
    if magic != EXT4_MAGIC {
        return Err(format!(
            "no ext4 superblock (magic {magic:#06x}, expected {EXT4_MAGIC:#06x})"
        ));
    }
    let mut incompat = [0u8; 4];
    incompat.copy_from_slice(&sb[EXT4_INCOMPAT_AT..EXT4_INCOMPAT_AT + 4]);
    Ok(u32::from_le_bytes(incompat) & EXT4_INCOMPAT_RECOVER != 0)
}

fn xfs_log_dirty(dev: &Path) -> Result<bool, HostError> {
    // Only a block device, as everywhere else in this crate.
    drop(open_block_device(dev)?);
    let args = [OsStr::new("-t"), OsStr::new("--"), dev.as_os_str()];
    let out = exec::run_capped("xfs_logprint", &args, PROBE_TIMEOUT, LOGPRINT_KEEP)?;
    match parse_logprint_state(&out.stdout) {
        Some(dirty) => Ok(dirty),
        // Without the state line the exit status and stderr say why.
        None if !out.status.success() => Err(exec::failed("xfs_logprint", &args, &out)),
        None => Err(HostError::LogState {
            device: dev.to_path_buf(),
            fs: FsType::Xfs,
            detail: format!(
                "xfs_logprint printed no log state: {:?}",
                out.stdout.lines().take(8).collect::<Vec<_>>()
            ),
        }),
    }
}

/// The log's state from `xfs_logprint -t`'s line `log tail: T head: H state: <CLEAN|DIRTY>`:
/// `Some(true)` when dirty. Both the words and the numbers must agree (clean means head ==
/// tail); anything else is `None`.
pub(crate) fn parse_logprint_state(stdout: &str) -> Option<bool> {
    let line = stdout
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("log tail:"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let ["log", "tail:", tail, "head:", head, "state:", state] = words.as_slice() else {
        return None;
    };
    let tail: i64 = tail.parse().ok()?;
    let head: i64 = head.parse().ok()?;
    match *state {
        "<CLEAN>" if head == tail => Some(false),
        "<DIRTY>" if head != tail => Some(true),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprint_states_are_read_strictly() {
        let dump = "xfs_logprint:\n    data device: 0x706\n    log device: 0x706 daddr: 327728 \
                    length: 131072\n\n    log tail: 2 head: 8 state: <DIRTY>\n\n\nLOG REC AT";
        assert_eq!(parse_logprint_state(dump), Some(true));
        assert_eq!(
            parse_logprint_state("    log tail: 14 head: 14 state: <CLEAN>\n"),
            Some(false)
        );
        for bad in [
            "",
            "xfs_logprint:\n",
            "    log tail: 2 head: 8 state: <CLEAN>",
            "    log tail: 8 head: 8 state: <DIRTY>",
            "    log tail: x head: 8 state: <DIRTY>",
            "    log tail: 2 head: 8 state: <UNKNOWN>",
            "    log tail: 2 head: 8",
        ] {
            assert_eq!(parse_logprint_state(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ext4_recover_flag_is_read_from_the_superblock() {
        let mut sb = [0u8; EXT4_SUPERBLOCK_LEN];
        assert!(parse_ext4_superblock(&sb).is_err());
        sb[EXT4_MAGIC_AT..EXT4_MAGIC_AT + 2].copy_from_slice(&EXT4_MAGIC.to_le_bytes());
        sb[EXT4_INCOMPAT_AT..EXT4_INCOMPAT_AT + 4].copy_from_slice(&0x2c2u32.to_le_bytes());
        assert_eq!(parse_ext4_superblock(&sb), Ok(false));
        sb[EXT4_INCOMPAT_AT..EXT4_INCOMPAT_AT + 4].copy_from_slice(&0x2c6u32.to_le_bytes());
        assert_eq!(parse_ext4_superblock(&sb), Ok(true));
    }
}
