//! A writer that logs every acknowledged write (scenario 9): 4 KiB records with sequence numbers,
//! written with O_DIRECT and `fdatasync` in place over a file whose blocks were allocated and
//! written before, so each record is pure data I/O at a known place of the backing file (its
//! physical offset, read with FIEMAP). The writer keeps the time of every acknowledgement and of
//! its first failures, and which record is in flight, so a test can tell which writes the host
//! had acknowledged when, and whether a later one ever reached the device.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::data::pattern;

pub(crate) const RECORD: usize = 4096;
pub(crate) const MAX_FAILURES: usize = 3;
const MAGIC: &[u8; 8] = b"PILLSEQ\0";

/// Record `seq` as the writer writes it: magic, sequence number, then a pattern of `seq`.
pub(crate) fn record(seq: u64) -> Vec<u8> {
    let mut r = Vec::with_capacity(RECORD);
    r.extend_from_slice(MAGIC);
    r.extend_from_slice(&seq.to_le_bytes());
    r.extend_from_slice(&pattern(0x5E9_0000 + seq, RECORD - 16)[..RECORD - 16]);
    r
}

/// One extent of a file: `len` bytes at file offset `logical` live at `physical` on the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Extent {
    pub(crate) logical: u64,
    pub(crate) physical: u64,
    pub(crate) len: u64,
}

/// The extents of `file` (FS_IOC_FIEMAP, after a sync so nothing is delayed or unwritten).
pub(crate) fn extents(file: &File) -> Vec<Extent> {
    const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
    const FIEMAP_FLAG_SYNC: u32 = 1;
    const MAX: usize = 64;
    // struct fiemap (32 bytes) followed by MAX struct fiemap_extent (56 bytes each), as u64s.
    let mut buf = vec![0u64; (32 + 56 * MAX) / 8];
    buf[1] = u64::MAX; // fm_length
    buf[2] = u64::from(FIEMAP_FLAG_SYNC); // fm_flags; fm_mapped_extents is the kernel's answer
    buf[3] = MAX as u64; // fm_extent_count, fm_reserved
    // SAFETY: `buf` is a zeroed, 8-byte aligned struct fiemap with room for `fm_extent_count`
    // extents after it; the kernel writes at most that many and only into `buf`.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, buf.as_mut_ptr()) };
    assert_eq!(r, 0, "FIEMAP: {}", std::io::Error::last_os_error());
    let mapped = (buf[2] >> 32) as usize;
    assert!(
        mapped < MAX,
        "file too fragmented for the test ({mapped} extents)"
    );
    (0..mapped)
        .map(|i| {
            let e = &buf[4 + i * 7..4 + (i + 1) * 7];
            let flags = (e[5] & 0xffff_ffff) as u32;
            // Not UNKNOWN, DELALLOC, ENCODED, DATA_INLINE or UNWRITTEN: data at a fixed place.
            assert_eq!(flags & 0xA0E, 0, "extent {i} flags {flags:#x}");
            Extent {
                logical: e[0],
                physical: e[1],
                len: e[2],
            }
        })
        .collect()
}

/// Where record `seq` lives on the device.
pub(crate) fn physical_of(extents: &[Extent], seq: u64) -> u64 {
    let at = seq * RECORD as u64;
    let e = extents
        .iter()
        .find(|e| e.logical <= at && at < e.logical + e.len)
        .unwrap_or_else(|| panic!("record {seq} is in no extent"));
    e.physical + (at - e.logical)
}

/// What the writer did so far.
#[derive(Clone, Debug, Default)]
pub(crate) struct SeqLog {
    /// (sequence number, when its fdatasync returned), in order.
    pub(crate) acks: Vec<(u64, Instant)>,
    /// Failed writes, in order: sequence number, when, the error. After a failure the writer
    /// tries the next record, up to [`MAX_FAILURES`] failures.
    pub(crate) failures: Vec<(u64, Instant, String)>,
    /// The record being written and since when (None between records and once stopped).
    pub(crate) in_flight: Option<(u64, Instant)>,
    pub(crate) done: bool,
}

impl SeqLog {
    /// The first failed write.
    pub(crate) fn failed(&self) -> Option<&(u64, Instant, String)> {
        self.failures.first()
    }

    /// The longest time between two acknowledgements, and the record after that gap.
    pub(crate) fn longest_gap(&self) -> Option<(Duration, u64)> {
        self.acks
            .windows(2)
            .map(|w| (w[1].1 - w[0].1, w[1].0))
            .max_by_key(|(gap, _)| *gap)
    }

    /// The last record acknowledged strictly before `t`.
    pub(crate) fn last_acked_before(&self, t: Instant) -> Option<u64> {
        self.acks
            .iter()
            .rev()
            .find(|(_, at)| *at < t)
            .map(|(s, _)| *s)
    }
}

/// The writer: records 0, 1, 2, ... of `path` in place, each followed by fdatasync, with a short
/// pause between them, until stopped, out of records, or a write fails.
pub(crate) struct SeqWriter {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<SeqLog>>,
}

impl SeqWriter {
    /// Writes `records` zeroed records to a new file, makes them durable, returns the file's
    /// extents (physical places of the records) and starts the writer on it.
    pub(crate) fn prepare_and_start(path: &Path, records: u64) -> (Self, Vec<Extent>) {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        f.write_all(&vec![
            0u8;
            RECORD
                * usize::try_from(records)
                    .expect("a test-sized file")
        ])
        .and_then(|()| f.sync_all())
        .expect("write and sync the log file");
        let ext = extents(&f);
        drop(f);
        (Self::start(path, 0, records), ext)
    }

    /// Starts the writer on records `0..records` at byte offset `base` of an existing `path` (a
    /// file or a block device).
    pub(crate) fn start(path: &Path, base: u64, records: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(SeqLog::default()));
        let (s, l, p) = (Arc::clone(&stop), Arc::clone(&log), path.to_owned());
        std::thread::spawn(move || {
            // O_DIRECT wants a 4 KiB-aligned buffer: the aligned 4 KiB inside 8 KiB.
            let mut raw = vec![0u8; 2 * RECORD];
            let off = raw.as_ptr().align_offset(RECORD);
            let buf = &mut raw[off..off + RECORD];
            let f = match OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&p)
            {
                Ok(f) => f,
                Err(e) => {
                    let mut g = l.lock().unwrap();
                    g.failures.push((0, Instant::now(), format!("open: {e}")));
                    g.done = true;
                    return;
                }
            };
            for seq in 0..records {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                buf.copy_from_slice(&record(seq));
                l.lock().unwrap().in_flight = Some((seq, Instant::now()));
                let r = f
                    .write_all_at(buf, base + seq * RECORD as u64)
                    .and_then(|()| f.sync_data());
                let now = Instant::now();
                let mut g = l.lock().unwrap();
                g.in_flight = None;
                match r {
                    Ok(()) => g.acks.push((seq, now)),
                    Err(e) => {
                        g.failures.push((seq, now, e.to_string()));
                        if g.failures.len() >= MAX_FAILURES {
                            break;
                        }
                    }
                }
                drop(g);
                std::thread::sleep(Duration::from_millis(10));
            }
            l.lock().unwrap().done = true;
        });
        Self { stop, log }
    }

    pub(crate) fn log(&self) -> SeqLog {
        self.log.lock().unwrap().clone()
    }

    /// Asks the writer to stop after the record in flight (a blocked one stays blocked).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Drop for SeqWriter {
    fn drop(&mut self) {
        self.stop();
    }
}
