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
//!
//! Also read from the superblock, and for the same kind of copy: the filesystem's own size
//! ([`filesystem_bytes`]). A restore or clone made larger than its source carries the source's
//! filesystem, smaller than its device, until something grows it.

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
/// `s_blocks_count_lo`, `s_log_block_size` (block size = 1024 << it), `s_blocks_count_hi`
/// (read with `EXT4_FEATURE_INCOMPAT_64BIT`).
const EXT4_BLOCKS_LO_AT: usize = 0x04;
const EXT4_LOG_BLOCK_SIZE_AT: usize = 0x18;
const EXT4_BLOCKS_HI_AT: usize = 0x150;
const EXT4_INCOMPAT_64BIT: u32 = 0x0080;
/// The XFS superblock (sector 0, big-endian): `sb_magicnum`, `sb_blocksize`, `sb_dblocks`.
const XFS_MAGIC: u32 = 0x5846_5342;
const XFS_SUPERBLOCK_LEN: usize = 16;
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

/// The size of the filesystem `fs` on `dev` in bytes, as its superblock records it. Never
/// writes to `dev`; a superblock of another kind is an error.
pub fn filesystem_bytes(dev: &Path, fs: FsType) -> Result<u64, HostError> {
    let size = match fs {
        FsType::Ext4 => ext4_bytes(&read_at::<EXT4_SUPERBLOCK_LEN>(dev, EXT4_SUPERBLOCK)?),
        FsType::Xfs => xfs_bytes(&read_at::<XFS_SUPERBLOCK_LEN>(dev, 0)?),
    };
    size.map_err(|detail| HostError::Superblock {
        device: dev.to_path_buf(),
        fs,
        detail,
    })
}

fn read_at<const N: usize>(dev: &Path, offset: u64) -> Result<[u8; N], HostError> {
    let (file, _) = open_block_device(dev)?;
    let mut buf = [0u8; N];
    file.read_exact_at(&mut buf, offset)
        .map_err(|source| HostError::Device {
            path: dev.to_path_buf(),
            source,
        })?;
    Ok(buf)
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(crate) fn ext4_bytes(sb: &[u8; EXT4_SUPERBLOCK_LEN]) -> Result<u64, String> {
    let magic = u16::from_le_bytes([sb[EXT4_MAGIC_AT], sb[EXT4_MAGIC_AT + 1]]);
    if magic != EXT4_MAGIC {
        return Err(format!("no ext4 superblock (magic {magic:#06x})"));
    }
    let mut blocks = u64::from(le32(sb, EXT4_BLOCKS_LO_AT));
    if le32(sb, EXT4_INCOMPAT_AT) & EXT4_INCOMPAT_64BIT != 0 {
        blocks |= u64::from(le32(sb, EXT4_BLOCKS_HI_AT)) << 32;
    }
    let log = le32(sb, EXT4_LOG_BLOCK_SIZE_AT);
    // ext4 blocks are 1 KiB to 64 KiB.
    if log > 6 {
        return Err(format!("block size 1024 << {log} out of range"));
    }
    blocks
        .checked_mul(1024 << log)
        .ok_or_else(|| format!("{blocks} blocks of {} bytes overflow", 1024 << log))
}

pub(crate) fn xfs_bytes(sb: &[u8; XFS_SUPERBLOCK_LEN]) -> Result<u64, String> {
    let be32 = |at: usize| u32::from_be_bytes([sb[at], sb[at + 1], sb[at + 2], sb[at + 3]]);
    if be32(0) != XFS_MAGIC {
        return Err(format!("no XFS superblock (magic {:#010x})", be32(0)));
    }
    let block = be32(4);
    // XFS blocks are 512 bytes to 64 KiB, a power of two.
    if !(512..=65536).contains(&block) || !block.is_power_of_two() {
        return Err(format!("block size {block} out of range"));
    }
    let mut dblocks = [0u8; 8];
    dblocks.copy_from_slice(&sb[8..16]);
    let dblocks = u64::from_be_bytes(dblocks);
    dblocks
        .checked_mul(u64::from(block))
        .ok_or_else(|| format!("{dblocks} blocks of {block} bytes overflow"))
}

fn ext4_needs_recovery(dev: &Path) -> Result<bool, HostError> {
    let sb = read_at::<EXT4_SUPERBLOCK_LEN>(dev, EXT4_SUPERBLOCK)?;
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

    /// The superblock of a filesystem made by the real mkfs in a file of `size` bytes, then the
    /// file made larger (as a restore larger than its source is): the size read is mkfs's.
    fn superblock_of<const N: usize>(mkfs: &[&str], size: u64, offset: u64) -> [u8; N] {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("fs.img");
        let file = std::fs::File::create(&img).unwrap();
        file.set_len(size).unwrap();
        let out = std::process::Command::new(mkfs[0])
            .args(&mkfs[1..])
            .arg(&img)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        file.set_len(4 * size).unwrap();
        let mut sb = [0u8; N];
        std::fs::File::open(&img)
            .unwrap()
            .read_exact_at(&mut sb, offset)
            .unwrap();
        sb
    }

    // proves N6 (the size a stage compares with its device)
    #[test]
    fn the_filesystem_size_is_read_from_the_superblock() {
        let mib = 1 << 20;
        let ext4 = superblock_of::<EXT4_SUPERBLOCK_LEN>(&["mkfs.ext4", "-q", "-F"], 64 * mib, 1024);
        assert_eq!(ext4_bytes(&ext4), Ok(64 * mib));
        let small = superblock_of::<EXT4_SUPERBLOCK_LEN>(
            &["mkfs.ext4", "-q", "-F", "-b", "1024", "-O", "^64bit"],
            8 * mib,
            1024,
        );
        assert_eq!(ext4_bytes(&small), Ok(8 * mib));
        let xfs = superblock_of::<XFS_SUPERBLOCK_LEN>(&["mkfs.xfs", "-q", "-f"], 320 * mib, 0);
        assert_eq!(xfs_bytes(&xfs), Ok(320 * mib));
        // Each refuses the other's superblock, and nothing at all.
        assert!(ext4_bytes(&[0; EXT4_SUPERBLOCK_LEN]).is_err());
        assert!(xfs_bytes(&[0; XFS_SUPERBLOCK_LEN]).is_err());
        let mut first = [0u8; XFS_SUPERBLOCK_LEN];
        first.copy_from_slice(&ext4[..XFS_SUPERBLOCK_LEN]);
        assert!(xfs_bytes(&first).is_err());
    }

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
