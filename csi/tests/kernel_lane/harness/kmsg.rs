//! The kernel log: reading `/dev/kmsg` and waiting for lines in it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

/// Reads `/dev/kmsg` from the moment it was opened; every line read is kept and echoed.
pub(crate) struct Kmsg {
    file: File,
    lines: Vec<String>,
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
                    let text = record.split_once(';').map_or(&*record, |(_, t)| t);
                    let text = text.lines().next().unwrap_or("").to_owned();
                    println!("    kmsg| {text}");
                    self.lines.push(text);
                }
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    println!("    kmsg| (records overwritten before they were read)");
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

    /// The first line at or after `from` containing every one of `needles`.
    pub(crate) fn find(&mut self, from: usize, needles: &[&str]) -> Option<String> {
        self.poll();
        self.lines[from.min(self.lines.len())..]
            .iter()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .cloned()
    }

    pub(crate) fn count(&mut self, from: usize, needle: &str) -> usize {
        self.poll();
        self.lines[from.min(self.lines.len())..]
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits for a line at or after `from` containing all `needles`; panics after `timeout`.
    pub(crate) fn expect(&mut self, from: usize, needles: &[&str], timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(line) = self.find(from, needles) {
                println!("  kernel log has {needles:?}: {line}");
                return line;
            }
            assert!(
                start.elapsed() < timeout,
                "no kernel log line with {needles:?} within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub(crate) fn expect_absent(&mut self, from: usize, needle: &str) {
        if let Some(line) = self.find(from, &[needle]) {
            panic!("kernel log has {needle:?}, which must not happen: {line}");
        }
        println!("  kernel log has no {needle:?}");
    }
}
