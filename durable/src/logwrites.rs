//! The log of the kernel's `dm-log-writes` target, read and replayed: every state a power loss
//! may leave on a real file system, as the kernel's block layer saw its writes.
//!
//! The format (the kernel's `Documentation/admin-guide/device-mapper/log-writes.rst`): the log
//! device starts with a super block (`magic`, `version`, `nr_entries`, all little-endian u64,
//! then `sectorsize` u32), padded to one `sectorsize` block. Entries follow one after the
//! other: a header block (`sector`, `nr_sectors`, `flags`, `data_len`, little-endian u64, with a
//! mark's text after them in the same block), then `nr_sectors` blocks of the data written
//! (none for a discard or a mark). `sector` and `nr_sectors` count `sectorsize` blocks of the
//! logged device. Flags: FLUSH, FUA, DISCARD, MARK (and METADATA, informative).
//!
//! The target logs a write only once a flush covering it completed (or at once for FUA), so
//! replaying the log up to a FLUSH or FUA entry gives what the disk held when that flush
//! returned, and up to a MARK what it held at least when the mark was sent (writes completed
//! but not yet flushed are logged after the next flush, and may be lost).
//!
//! Invariants:
//! - [`Log::parse`] accepts only a complete log: the magic and version, a sector size of at
//!   least 512 and a power of two, `nr_entries` entries each wholly inside the bytes read, no
//!   unknown flag, marks as text. Anything else is an error, never a shorter log.
//! - [`Replay`] applies entries strictly in log order; [`Replay::points`] lists every FLUSH,
//!   FUA and MARK entry; replaying to a point applies that entry and everything before it.

use std::collections::BTreeSet;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The log's magic number (`WRITE_LOG_MAGIC`).
pub const MAGIC: u64 = 0x006a_7366_7773_6872;
/// The log format version this reader knows.
pub const VERSION: u64 = 1;

/// An entry's flags (`LOG_*_FLAG`).
pub mod flag {
    pub const FLUSH: u64 = 1 << 0;
    pub const FUA: u64 = 1 << 1;
    pub const DISCARD: u64 = 1 << 2;
    pub const MARK: u64 = 1 << 3;
    pub const METADATA: u64 = 1 << 4;
    pub(super) const KNOWN: u64 = FLUSH | FUA | DISCARD | MARK | METADATA;
}

/// Why a log could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("the log is {len} bytes: too short for its super block")]
    NoSuper { len: usize },
    #[error("bad magic {0:#x}: not a dm-log-writes log")]
    Magic(u64),
    #[error("log version {0} (this reader knows {VERSION})")]
    Version(u64),
    #[error("sector size {0} is not a power of two of at least 512")]
    SectorSize(u32),
    #[error("entry {index} at byte {offset} runs past the end of the log ({len} bytes)")]
    Truncated { index: u64, offset: u64, len: usize },
    #[error("entry {index} has unknown flags {flags:#x}")]
    Flags { index: u64, flags: u64 },
    #[error("entry {index} carries {data_len} bytes of inline data, which only a mark may")]
    InlineData { index: u64, data_len: u64 },
    #[error("entry {index} is a mark whose text is not UTF-8 or does not fit its block")]
    MarkText { index: u64 },
    #[error("entry {index} writes sectors {sector}+{nr_sectors}, past the device's {device}")]
    OutOfRange {
        index: u64,
        sector: u64,
        nr_sectors: u64,
        device: u64,
    },
    #[error("reading or writing a replay image")]
    Io(#[from] io::Error),
}

/// One logged write, flush, discard or mark.
#[derive(Clone, PartialEq, Eq)]
pub struct Entry {
    /// First block written (in `sectorsize` blocks of the logged device).
    pub sector: u64,
    /// Blocks written (or discarded).
    pub nr_sectors: u64,
    pub flags: u64,
    /// The data written (`nr_sectors` blocks), empty for a flush, a discard and a mark.
    pub data: Vec<u8>,
    /// A mark's text.
    pub mark: Option<String>,
}

impl Entry {
    /// Whether the entry is a point a crash state is taken at: a FLUSH, a FUA or a MARK.
    pub fn is_point(&self) -> bool {
        self.flags & (flag::FLUSH | flag::FUA | flag::MARK) != 0
    }
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("sector", &self.sector)
            .field("nr_sectors", &self.nr_sectors)
            .field("flags", &self.flags)
            .field("data_bytes", &self.data.len())
            .field("mark", &self.mark)
            .finish()
    }
}

/// A parsed log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Log {
    pub sectorsize: u32,
    pub entries: Vec<Entry>,
}

fn le64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

impl Log {
    /// Reads a whole log (see the module documentation for what is refused).
    pub fn parse(bytes: &[u8]) -> Result<Self, LogError> {
        if bytes.len() < 28 {
            return Err(LogError::NoSuper { len: bytes.len() });
        }
        let magic = le64(bytes, 0);
        if magic != MAGIC {
            return Err(LogError::Magic(magic));
        }
        let version = le64(bytes, 8);
        if version != VERSION {
            return Err(LogError::Version(version));
        }
        let nr_entries = le64(bytes, 16);
        let sectorsize = u32::from_le_bytes([bytes[24], bytes[25], bytes[26], bytes[27]]);
        if sectorsize < 512 || !sectorsize.is_power_of_two() {
            return Err(LogError::SectorSize(sectorsize));
        }
        let block = u64::from(sectorsize);
        let mut entries = Vec::new();
        let mut offset = block;
        for index in 0..nr_entries {
            let (start, len) = (offset, bytes.len());
            let truncated = move || LogError::Truncated {
                index,
                offset: start,
                len,
            };
            let header = slice(bytes, offset, block).ok_or_else(truncated)?;
            let (sector, nr_sectors) = (le64(header, 0), le64(header, 8));
            let (flags, data_len) = (le64(header, 16), le64(header, 24));
            if flags & !flag::KNOWN != 0 {
                return Err(LogError::Flags { index, flags });
            }
            offset += block;
            let mut entry = Entry {
                sector,
                nr_sectors,
                flags,
                data: Vec::new(),
                mark: None,
            };
            if flags & flag::MARK != 0 {
                let text = usize::try_from(data_len)
                    .ok()
                    .and_then(|n| header.get(32..32 + n))
                    .and_then(|t| std::str::from_utf8(t).ok())
                    .ok_or(LogError::MarkText { index })?;
                entry.mark = Some(text.to_owned());
            } else if data_len != 0 {
                return Err(LogError::InlineData { index, data_len });
            } else if flags & flag::DISCARD == 0 {
                let len = nr_sectors.checked_mul(block).ok_or_else(truncated)?;
                entry.data = slice(bytes, offset, len).ok_or_else(truncated)?.to_vec();
                offset += len;
            }
            entries.push(entry);
        }
        Ok(Self {
            sectorsize,
            entries,
        })
    }

    /// Reads the log from the file or device at `path` (its whole length).
    pub fn read(path: &Path) -> Result<Self, LogError> {
        Self::parse(&std::fs::read(path)?)
    }

    /// Counts by kind: (entries, writes, flushes or FUAs, marks).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let count = |f: u64| self.entries.iter().filter(|e| e.flags & f != 0).count();
        let writes = self.entries.iter().filter(|e| !e.data.is_empty()).count();
        (
            self.entries.len(),
            writes,
            count(flag::FLUSH | flag::FUA),
            count(flag::MARK),
        )
    }
}

fn slice(bytes: &[u8], offset: u64, len: u64) -> Option<&[u8]> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    bytes.get(start..end)
}

/// A device image being replayed: a base (what the device held when logging started) and the
/// log's entries applied one after the other.
#[derive(Clone)]
pub struct Replay {
    log: Log,
    image: Vec<u8>,
    /// Blocks of `block_size` that hold anything but zeros in `image` (a superset).
    nonzero: BTreeSet<u64>,
    /// Entries applied so far.
    applied: usize,
}

/// The unit [`Replay::write_image`] writes in: zero blocks are left as holes.
const IMAGE_BLOCK: usize = 4096;

impl fmt::Debug for Replay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replay")
            .field("entries", &self.log.entries.len())
            .field("applied", &self.applied)
            .field("image_bytes", &self.image.len())
            .finish()
    }
}

impl Replay {
    /// A replay of `log` onto a copy of `base`.
    pub fn new(log: Log, base: Vec<u8>) -> Self {
        let nonzero = base
            .chunks(IMAGE_BLOCK)
            .enumerate()
            .filter(|(_, c)| c.iter().any(|&b| b != 0))
            .map(|(i, _)| i as u64)
            .collect();
        Self {
            log,
            image: base,
            nonzero,
            applied: 0,
        }
    }

    pub fn log(&self) -> &Log {
        &self.log
    }

    /// The indices of the entries a crash state is taken at ([`Entry::is_point`]).
    pub fn points(&self) -> Vec<usize> {
        (self.log.entries.iter().enumerate())
            .filter(|(_, e)| e.is_point())
            .map(|(i, _)| i)
            .collect()
    }

    /// Applies the entries up to and including `index` (which must not be behind what was
    /// applied already: a replay only moves forward).
    pub fn advance_to(&mut self, index: usize) -> Result<(), LogError> {
        while self.applied <= index && self.applied < self.log.entries.len() {
            self.apply(self.applied)?;
            self.applied += 1;
        }
        Ok(())
    }

    fn apply(&mut self, index: usize) -> Result<(), LogError> {
        let entry = &self.log.entries[index];
        let block = u64::from(self.log.sectorsize);
        let device = self.image.len() as u64 / block;
        let out_of_range = || LogError::OutOfRange {
            index: index as u64,
            sector: entry.sector,
            nr_sectors: entry.nr_sectors,
            device,
        };
        let end = entry.sector.checked_add(entry.nr_sectors);
        if end.is_none_or(|end| end > device) {
            return Err(out_of_range());
        }
        let start = usize::try_from(entry.sector * block).map_err(|_| out_of_range())?;
        let len = usize::try_from(entry.nr_sectors * block).map_err(|_| out_of_range())?;
        let range = &mut self.image[start..start + len];
        if entry.flags & flag::DISCARD != 0 {
            // What a discarded range reads as is the device's business; zeros are what a
            // replay onto a fresh sparse file gives, and a file system must not read it.
            range.fill(0);
        } else if !entry.data.is_empty() {
            range.copy_from_slice(&entry.data);
            let first = start / IMAGE_BLOCK;
            let last = (start + len).div_ceil(IMAGE_BLOCK);
            self.nonzero.extend((first..last).map(|b| b as u64));
        }
        Ok(())
    }

    /// The image as replayed so far.
    pub fn image(&self) -> &[u8] {
        &self.image
    }

    /// Writes the image to a new file at `path` (its zero blocks as holes), for a loop device.
    pub fn write_image(&self, path: &Path) -> Result<(), LogError> {
        let file = File::create_new(path)?;
        file.set_len(self.image.len() as u64)?;
        for &b in &self.nonzero {
            let start = usize::try_from(b).unwrap_or(usize::MAX) * IMAGE_BLOCK;
            if let Some(chunk) = self
                .image
                .get(start..(start + IMAGE_BLOCK).min(self.image.len()))
                && chunk.iter().any(|&x| x != 0)
            {
                file.write_all_at(chunk, start as u64)?;
            }
        }
        file.sync_all()?;
        Ok(())
    }
}

/// A log built by hand, as the kernel writes one (tests of readers and of the replay).
#[derive(Clone, Debug)]
pub struct LogBuilder {
    sectorsize: u32,
    entries: Vec<Entry>,
}

impl LogBuilder {
    pub fn new(sectorsize: u32) -> Self {
        Self {
            sectorsize,
            entries: Vec::new(),
        }
    }

    /// A write of `data` (whole blocks) at block `sector`, with extra `flags` (FUA, FLUSH).
    #[must_use]
    pub fn write(mut self, sector: u64, data: &[u8], flags: u64) -> Self {
        let block = self.sectorsize as usize;
        assert_eq!(data.len() % block, 0, "whole blocks only");
        self.entries.push(Entry {
            sector,
            nr_sectors: (data.len() / block) as u64,
            flags,
            data: data.to_vec(),
            mark: None,
        });
        self
    }

    #[must_use]
    pub fn flush(mut self) -> Self {
        self.entries.push(Entry {
            sector: 0,
            nr_sectors: 0,
            flags: flag::FLUSH,
            data: Vec::new(),
            mark: None,
        });
        self
    }

    #[must_use]
    pub fn discard(mut self, sector: u64, nr_sectors: u64) -> Self {
        self.entries.push(Entry {
            sector,
            nr_sectors,
            flags: flag::DISCARD,
            data: Vec::new(),
            mark: None,
        });
        self
    }

    #[must_use]
    pub fn mark(mut self, text: &str) -> Self {
        self.entries.push(Entry {
            sector: 0,
            nr_sectors: 0,
            flags: flag::MARK,
            data: Vec::new(),
            mark: Some(text.to_owned()),
        });
        self
    }

    /// The log's bytes, laid out as the kernel lays them out.
    pub fn build(&self) -> Vec<u8> {
        let block = self.sectorsize as usize;
        let mut out = vec![0u8; block];
        out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..16].copy_from_slice(&VERSION.to_le_bytes());
        out[16..24].copy_from_slice(&(self.entries.len() as u64).to_le_bytes());
        out[24..28].copy_from_slice(&self.sectorsize.to_le_bytes());
        for e in &self.entries {
            let mut header = vec![0u8; block];
            header[0..8].copy_from_slice(&e.sector.to_le_bytes());
            header[8..16].copy_from_slice(&e.nr_sectors.to_le_bytes());
            header[16..24].copy_from_slice(&e.flags.to_le_bytes());
            let text = e.mark.as_deref().unwrap_or("").as_bytes();
            header[24..32].copy_from_slice(&(text.len() as u64).to_le_bytes());
            header[32..32 + text.len()].copy_from_slice(text);
            out.extend_from_slice(&header);
            out.extend_from_slice(&e.data);
        }
        out
    }
}
