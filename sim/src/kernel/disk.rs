//! The disk under a host's kernel double: what a filesystem tool writes is a small header at
//! the start of the namespace's backing file (the agent's pool file), its type, size and log
//! state; I/O through a device needs its controller live and the reservation not held by
//! another host.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use pillar_host::{FsType, HostError};

use super::{SimKernel, device_err};

/// The header a filesystem leaves at the start of its device.
const HEADER: usize = 64;
const MAGIC: &str = "SIMFS";

/// A filesystem's header on the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Fs {
    pub(super) fs: FsType,
    pub(super) bytes: u64,
    pub(super) dirty: bool,
}

/// A file's length (0 when it cannot be read: a namespace whose file is gone shows nothing).
pub(super) fn file_len(file: &Path) -> u64 {
    std::fs::metadata(file).map(|m| m.len()).unwrap_or(0)
}

/// The filesystem header at the start of `file`: `Ok(None)` when there is none, `Err(())`
/// when it is torn.
fn read_header(file: &Path) -> std::io::Result<Result<Option<Fs>, ()>> {
    let mut buf = [0u8; HEADER];
    std::fs::File::open(file).and_then(|mut f| f.read(&mut buf))?;
    let text = String::from_utf8_lossy(&buf);
    let mut parts = text.trim_end_matches('\0').split_whitespace();
    if parts.next() != Some(MAGIC) {
        return Ok(Ok(None));
    }
    let fs = parts.next().and_then(|f| FsType::parse(f).ok());
    let bytes = parts.next().and_then(|b| b.parse().ok());
    let dirty = parts.next() == Some("dirty");
    Ok(match (fs, bytes) {
        (Some(fs), Some(bytes)) => Ok(Some(Fs { fs, bytes, dirty })),
        _ => Err(()),
    })
}

/// The size of the filesystem on the disk whose backing file is `file` (a volume's pool file),
/// read from the disk, not through any host: `None` when it holds no filesystem (or a torn
/// header). For invariant 9.
pub fn filesystem_bytes_in(file: &Path) -> std::io::Result<Option<u64>> {
    Ok(read_header(file)?.ok().flatten().map(|f| f.bytes))
}

/// Writes `fs`'s header at the start of `file`.
fn write_header(file: &Path, fs: Fs) -> std::io::Result<()> {
    let line = format!(
        "{MAGIC} {} {} {}\n",
        fs.fs,
        fs.bytes,
        if fs.dirty { "dirty" } else { "clean" }
    );
    let mut buf = [0u8; HEADER];
    buf[..line.len().min(HEADER)].copy_from_slice(&line.as_bytes()[..line.len().min(HEADER)]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .and_then(|mut f| {
            f.seek(SeekFrom::Start(0))?;
            f.write_all(&buf)
        })
}

impl SimKernel {
    pub(super) fn read_fs(&self, dev: &Path) -> Result<Option<Fs>, HostError> {
        let (_, file) = self.backing(dev)?;
        read_header(&file)
            .map_err(|source| HostError::Device {
                path: dev.to_path_buf(),
                source,
            })?
            .map_err(|()| HostError::Probe {
                device: dev.to_path_buf(),
                detail: "a torn filesystem header".into(),
            })
    }

    /// Writes `fs`'s header through the device: refused where another host holds the
    /// reservation (Write Exclusive).
    pub(super) fn write_fs(&self, dev: &Path, fs: Fs) -> Result<(), HostError> {
        let (c, file) = self.backing(dev)?;
        if self
            .reservations
            .holder(&c.agent, &c.nqn)
            .is_some_and(|k| k != self.key)
        {
            return Err(device_err(dev, libc::EBADE));
        }
        write_header(&file, fs).map_err(|source| HostError::Device {
            path: dev.to_path_buf(),
            source,
        })
    }
}
