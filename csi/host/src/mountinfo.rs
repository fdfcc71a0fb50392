//! Parsing `/proc/self/mountinfo` (proc(5)):
//!
//! `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`
//!
//! mount ID, parent ID, major:minor, root, mount point, per-mount options, zero or more optional
//! fields ended by `-`, filesystem type, source, per-superblock options. Paths escape space, tab,
//! newline and backslash as `\040`, `\011`, `\012`, `\134`.

use std::ffi::OsString;
use std::fs;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use crate::HostError;

/// Where the calling process's mount table is.
pub const SELF_MOUNTINFO: &str = "/proc/self/mountinfo";

/// One line of mountinfo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u64,
    pub parent_id: u64,
    pub major: u32,
    pub minor: u32,
    /// The directory of the filesystem mounted here (`/` unless a bind of a subdirectory).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`, `ro`, `nosuid`, `relatime`, ...).
    pub mount_options: String,
    pub fs_type: String,
    /// The mount source (`/dev/nvme0n1`, `tmpfs`, ...).
    pub source: String,
    pub super_options: String,
}

impl MountEntry {
    /// Whether this mount is read-only (per-mount `ro`).
    pub fn is_readonly(&self) -> bool {
        self.mount_options.split(',').any(|o| o == "ro")
    }
}

/// Parses a whole mountinfo text.
pub fn parse(text: &str) -> Result<Vec<MountEntry>, HostError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(i, l)| {
            parse_line(l).ok_or_else(|| HostError::ParseMountInfo {
                line_no: i + 1,
                line: l.to_owned(),
            })
        })
        .collect()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    let mut fields = line.split(' ');
    let mount_id = fields.next()?.parse().ok()?;
    let parent_id = fields.next()?.parse().ok()?;
    let (major, minor) = fields.next()?.split_once(':')?;
    let root = unescape(fields.next()?)?;
    let mount_point = unescape(fields.next()?)?;
    let mount_options = fields.next()?.to_owned();
    // Optional fields up to the separator.
    loop {
        let f = fields.next()?;
        if f == "-" {
            break;
        }
    }
    let fs_type = fields.next()?.to_owned();
    let source = fields.next()?;
    let super_options = fields.next()?.to_owned();
    if fields.next().is_some() {
        return None;
    }
    Some(MountEntry {
        mount_id,
        parent_id,
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
        root,
        mount_point,
        mount_options,
        fs_type,
        source: String::from_utf8_lossy(unescape_bytes(source)?.as_slice()).into_owned(),
        super_options,
    })
}

fn unescape(s: &str) -> Option<PathBuf> {
    Some(PathBuf::from(OsString::from_vec(unescape_bytes(s)?)))
}

/// Undoes the kernel's octal escapes (`\ooo`).
fn unescape_bytes(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            let digits = b.get(i + 1..i + 4)?;
            if !digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                return None;
            }
            let v = digits
                .iter()
                .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
            out.push(u8::try_from(v).ok()?);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

/// Reads and parses a mountinfo file (normally [`SELF_MOUNTINFO`]).
pub fn read(path: &Path) -> Result<Vec<MountEntry>, HostError> {
    let text = fs::read_to_string(path).map_err(|source| HostError::ReadMountInfo {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text)
}

/// The mount points showing the same directory of the same filesystem as `like` (its binds),
/// `like` itself included.
pub fn binds_of<'a>(
    entries: &'a [MountEntry],
    like: &'a MountEntry,
) -> impl Iterator<Item = &'a Path> + 'a {
    entries
        .iter()
        .filter(move |e| (e.major, e.minor) == (like.major, like.minor) && e.root == like.root)
        .map(|e| e.mount_point.as_path())
}

/// The mount points a device file `/dev/<name>` is bind-mounted on (block publications).
pub fn device_binds<'a>(
    entries: &'a [MountEntry],
    name: &'a str,
) -> impl Iterator<Item = &'a Path> + 'a {
    entries
        .iter()
        .filter(move |e| e.fs_type == "devtmpfs" && e.root == Path::new("/").join(name))
        .map(|e| e.mount_point.as_path())
}

/// The topmost mount at exactly `mount_point` (already canonical), if any.
pub fn find<'a>(entries: &'a [MountEntry], mount_point: &Path) -> Option<&'a MountEntry> {
    entries.iter().rev().find(|e| e.mount_point == mount_point)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_of_a_filesystem_and_of_a_device_are_found() {
        let table = parse(
            "\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
30 22 259:0 / /stage/v1 rw,relatime - ext4 /dev/nvme0n1 rw
31 22 259:0 / /pods/a/mount rw,relatime - ext4 /dev/nvme0n1 rw
32 22 259:0 /lost+found /elsewhere rw,relatime - ext4 /dev/nvme0n1 rw
33 22 0:5 /nvme1n1 /pods/b/dev rw,nosuid - devtmpfs udev rw
34 22 0:5 /nvme1n1p1 /pods/c/dev rw,nosuid - devtmpfs udev rw
",
        )
        .unwrap();
        let stage = find(&table, Path::new("/stage/v1")).unwrap();
        let binds: Vec<&Path> = binds_of(&table, stage).collect();
        assert_eq!(binds, [Path::new("/stage/v1"), Path::new("/pods/a/mount")]);
        let devs: Vec<&Path> = device_binds(&table, "nvme1n1").collect();
        assert_eq!(devs, [Path::new("/pods/b/dev")]);
    }

    const SAMPLE: &str = "\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
36 22 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 shared:7 - ext3 /dev/root rw,errors=continue
40 22 259:0 / /var/lib/kubelet/plugins/pillar/staging ro,relatime - xfs /dev/nvme0n1 ro,attr2,inode64
41 22 259:0 / /var/lib/kubelet/plugins/pillar/staging rw,relatime - xfs /dev/nvme0n1 rw,attr2
";

    #[test]
    fn parses_fields_escapes_and_optional_fields() {
        let m = parse(SAMPLE).unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m[0].mount_point, Path::new("/"));
        assert_eq!(m[1].mount_point, Path::new("/mnt/with space"));
        assert_eq!(m[1].root, Path::new("/mnt1"));
        assert_eq!(m[1].fs_type, "ext3");
        assert_eq!(m[1].source, "/dev/root");
        assert_eq!(m[1].super_options, "rw,errors=continue");
        assert_eq!((m[2].major, m[2].minor), (259, 0));
        assert!(m[2].is_readonly());
        assert!(!m[3].is_readonly());
    }

    #[test]
    fn find_returns_the_topmost_mount() {
        let m = parse(SAMPLE).unwrap();
        let top = find(&m, Path::new("/var/lib/kubelet/plugins/pillar/staging")).unwrap();
        assert_eq!(top.mount_id, 41);
        assert!(find(&m, Path::new("/var/lib/kubelet")).is_none());
        assert!(find(&m, Path::new("/mnt/with\\040space")).is_none());
    }

    #[test]
    fn malformed_lines_are_errors() {
        for bad in [
            "x 1 1:1 / / rw - ext4 /dev/a rw",
            "1 1 11 / / rw - ext4 /dev/a rw",
            "1 1 1:1 / / rw shared:1 ext4 /dev/a rw",
            "1 1 1:1 /\\09 / rw - ext4 /dev/a rw",
            "1 1 1:1 / / rw - ext4 /dev/a rw extra",
        ] {
            assert!(
                matches!(
                    parse(bad),
                    Err(HostError::ParseMountInfo { line_no: 1, .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn reads_this_process_table() {
        let m = read(Path::new(SELF_MOUNTINFO)).unwrap();
        assert!(find(&m, Path::new("/")).is_some());
    }
}
