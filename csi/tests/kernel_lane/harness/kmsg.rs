//! The kernel log: reading `/dev/kmsg` and waiting for lines in it, and the needles (the kernel's
//! wording of the events the scenarios look for), shared so that one event is matched the same
//! way wherever it is expected or must be absent.
//!
//! Records can be lost: when the kernel overwrites records this reader has not read yet, the
//! next read fails with EPIPE and reading resumes at the oldest record still held. Every loss is
//! kept with its position (and the number of records lost, from the gap in the sequence
//! numbers), and a check that relies on a line NOT being there ([`Kmsg::expect_absent`],
//! [`Kmsg::expect_absent_any`], [`Kmsg::assert_no_loss`]) fails when its window has a loss: the
//! line it must not see could be the one that was lost.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

use pillar_nvmet::{HostNqn, SubsystemNqn};

/// The kernel's wording of the events the scenarios check: a needle set is a list of strings a
/// line must all contain.
pub(crate) mod needles {
    use super::{HostNqn, SubsystemNqn};

    /// The host found another namespace identity on reconnect and dropped the namespace
    /// (`nvme nvmeN: identifiers changed for nsid 1`).
    pub(crate) const IDENTIFIERS_CHANGED: &[&str] = &["identifiers changed for nsid"];

    /// The target refused a connect of `host` to subsystem `nqn` (nvmet: `connect by host <host>
    /// for subsystem <nqn> not allowed`).
    pub(crate) fn not_allowed(host: &HostNqn, nqn: &SubsystemNqn) -> Vec<String> {
        vec![
            "connect by host".into(),
            format!("{host} "),
            "for subsystem".into(),
            format!("{nqn} "),
            "not allowed".into(),
        ]
    }

    /// The filesystem or the block layer on disk `dev` (`nvme0n1`) reported a failure: any one
    /// of these needle sets. ext4's own errors (`EXT4-fs error (device nvme0n1): ...`), ext4
    /// messages naming an error (`EXT4-fs (nvme0n1): I/O error while writing superblock`,
    /// `... error -5`), ext4 warnings (`EXT4-fs warning (device nvme0n1): ext4_end_bio: I/O
    /// error 10 ...`) and the block and buffer layers' I/O errors (`I/O error, dev nvme0n1,
    /// sector ...`, `Buffer I/O error on dev nvme0n1, ...`).
    pub(crate) fn fs_failure(dev: &str) -> Vec<Vec<String>> {
        vec![
            vec!["EXT4-fs error".into(), format!("(device {dev})")],
            vec!["EXT4-fs warning".into(), format!("(device {dev})")],
            vec![format!("EXT4-fs ({dev}):"), "error".into()],
            vec!["I/O error".into(), format!("dev {dev}")],
        ]
    }
}

/// A loss of records: `at` is the number of lines read before it, `records` how many records
/// the sequence numbers say were lost (0 when unknown: EPIPE without a later record yet).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Loss {
    pub(crate) at: usize,
    pub(crate) records: u64,
}

/// Reads `/dev/kmsg` from the moment it was opened; every line read is kept and echoed.
pub(crate) struct Kmsg {
    file: File,
    lines: Vec<String>,
    losses: Vec<Loss>,
    last_seq: Option<u64>,
}

fn contains_all<S: AsRef<str>>(line: &str, needles: &[S]) -> bool {
    needles.iter().all(|n| line.contains(n.as_ref()))
}

impl Kmsg {
    pub(crate) fn open() -> Self {
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open("/dev/kmsg")
            .expect("open /dev/kmsg");
        file.seek(SeekFrom::End(0))
            .expect("seek /dev/kmsg to its end");
        Self {
            file,
            lines: Vec::new(),
            losses: Vec::new(),
            last_seq: None,
        }
    }

    /// Reads every record logged since the last call.
    pub(crate) fn poll(&mut self) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match self.file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    let record = String::from_utf8_lossy(&buf[..n]);
                    // "<prio>,<seq>,<usec>,<flags>;<text>\n< continuation lines>"
                    let (prefix, text) = record.split_once(';').unwrap_or(("", &record));
                    let seq = prefix.split(',').nth(1).and_then(|s| s.parse::<u64>().ok());
                    if let (Some(seq), Some(last)) = (seq, self.last_seq)
                        && seq > last + 1
                    {
                        let records = seq - last - 1;
                        println!("    kmsg| ({records} record(s) lost before this one)");
                        // An EPIPE just noted at this position gets its count.
                        match self.losses.last_mut() {
                            Some(l) if l.at == self.lines.len() && l.records == 0 => {
                                l.records = records;
                            }
                            _ => self.losses.push(Loss {
                                at: self.lines.len(),
                                records,
                            }),
                        }
                    }
                    if seq.is_some() {
                        self.last_seq = seq;
                    }
                    let text = text.lines().next().unwrap_or("").to_owned();
                    println!("    kmsg| {text}");
                    self.lines.push(text);
                }
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    println!("    kmsg| (records overwritten before they were read)");
                    self.losses.push(Loss {
                        at: self.lines.len(),
                        records: 0,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("reading /dev/kmsg: {e}"),
            }
        }
    }

    /// The position after everything logged so far.
    pub(crate) fn mark(&mut self) -> usize {
        self.poll();
        self.lines.len()
    }

    /// The losses at or after `from` (a loss at `from` itself counts: its records may have been
    /// logged after the mark).
    pub(crate) fn losses_since(&mut self, from: usize) -> Vec<Loss> {
        self.poll();
        self.losses
            .iter()
            .filter(|l| l.at >= from)
            .copied()
            .collect()
    }

    /// Panics when records were lost at or after `from`: `what` relies on seeing every line.
    pub(crate) fn assert_no_loss(&mut self, from: usize, what: &str) {
        let losses = self.losses_since(from);
        assert!(
            losses.is_empty(),
            "kernel log records were lost in the window of a check that needs every line \
             ({what}): {losses:?}"
        );
    }

    /// The first line at or after `from` containing every one of `needles`.
    pub(crate) fn find<S: AsRef<str>>(&mut self, from: usize, needles: &[S]) -> Option<String> {
        self.poll();
        self.lines[from.min(self.lines.len())..]
            .iter()
            .find(|l| contains_all(l, needles))
            .cloned()
    }

    /// The position of the last line at or after `from` containing every one of `needles`.
    pub(crate) fn last_position<S: AsRef<str>>(
        &mut self,
        from: usize,
        needles: &[S],
    ) -> Option<usize> {
        self.poll();
        let from = from.min(self.lines.len());
        self.lines[from..]
            .iter()
            .rposition(|l| contains_all(l, needles))
            .map(|i| from + i)
    }

    /// The first line at or after `from` matching any one of the needle sets.
    pub(crate) fn find_any<S: AsRef<str>>(
        &mut self,
        from: usize,
        sets: &[Vec<S>],
    ) -> Option<String> {
        self.poll();
        self.lines[from.min(self.lines.len())..]
            .iter()
            .find(|l| sets.iter().any(|n| contains_all(l, n)))
            .cloned()
    }

    /// How many lines at or after `from` contain every one of `needles`. A lower bound when
    /// records were lost (a check that needs an upper bound
    /// must also call [`Kmsg::assert_no_loss`]).
    pub(crate) fn count<S: AsRef<str>>(&mut self, from: usize, needles: &[S]) -> usize {
        self.poll();
        self.lines[from.min(self.lines.len())..]
            .iter()
            .filter(|l| contains_all(l, needles))
            .count()
    }

    /// Waits for a line at or after `from` containing all `needles`; panics after `timeout`.
    pub(crate) fn expect<S: AsRef<str> + std::fmt::Debug>(
        &mut self,
        from: usize,
        needles: &[S],
        timeout: Duration,
    ) -> String {
        let start = Instant::now();
        loop {
            if let Some(line) = self.find(from, needles) {
                println!("  kernel log has {needles:?}: {line}");
                return line;
            }
            if start.elapsed() >= timeout {
                let losses = self.losses_since(from);
                panic!(
                    "no kernel log line with {needles:?} within {timeout:?} (records lost in \
                     the window: {losses:?})"
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// No line at or after `from` contains all `needles`, and no record of that window was
    /// lost (a lost record could be the line).
    pub(crate) fn expect_absent<S: AsRef<str> + std::fmt::Debug>(
        &mut self,
        from: usize,
        needles: &[S],
    ) {
        if let Some(line) = self.find(from, needles) {
            panic!("kernel log has {needles:?}, which must not happen: {line}");
        }
        self.assert_no_loss(from, &format!("no line with {needles:?}"));
        println!("  kernel log has no {needles:?} (no record lost in the window)");
    }

    /// No line at or after `from` matches any of the needle sets; no record lost there.
    pub(crate) fn expect_absent_any<S: AsRef<str> + std::fmt::Debug>(
        &mut self,
        from: usize,
        sets: &[Vec<S>],
    ) {
        if let Some(line) = self.find_any(from, sets) {
            panic!("kernel log has a line matching {sets:?}, which must not happen: {line}");
        }
        self.assert_no_loss(from, &format!("no line matching {sets:?}"));
        println!("  kernel log has no line matching {sets:?} (no record lost in the window)");
    }
}
