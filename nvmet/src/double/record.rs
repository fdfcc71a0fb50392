//! The record of applied operations: a line per operation, on disk under the double's private
//! directory so every handle on the same root records.
//!
//! Invariants:
//! - Only operations that succeeded are recorded, in the order they were applied.
//! - Any value survives the record (`\`, tab and newline are escaped).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::{ConfigfsDouble, OPS_LOG, PRIVATE_DIR};
use crate::plan::Op;

impl ConfigfsDouble {
    /// Starts recording the operations applied to this tree (by any handle on it), dropping
    /// what was recorded before.
    pub fn record_ops(&self) -> io::Result<()> {
        fs::write(self.root.join(PRIVATE_DIR).join(OPS_LOG), b"")
    }

    /// The operations applied since [`Self::record_ops`], in order; only those that succeeded.
    pub fn recorded_ops(&self) -> io::Result<Vec<Op>> {
        let text = fs::read_to_string(self.root.join(PRIVATE_DIR).join(OPS_LOG))?;
        text.lines().map(decode_op).collect()
    }

    pub(super) fn record(&self, op: &Op) -> io::Result<()> {
        let log = self.root.join(PRIVATE_DIR).join(OPS_LOG);
        if !log.exists() {
            return Ok(());
        }
        let mut file = fs::OpenOptions::new().append(true).open(log)?;
        io::Write::write_all(&mut file, format!("{}\n", encode_op(op)).as_bytes())
    }
}

/// One recorded operation per line: a verb and tab-separated fields, with `\`, tab and newline
/// escaped so any value survives.
pub(super) fn encode_op(op: &Op) -> String {
    fn esc(s: &str) -> String {
        s.replace('\\', "\\\\")
            .replace('\t', "\\t")
            .replace('\n', "\\n")
    }
    let p = |path: &Path| esc(&path.to_string_lossy());
    match op {
        Op::Mkdir { path } => format!("mkdir\t{}", p(path)),
        Op::Write { path, value } => format!("write\t{}\t{}", p(path), esc(value)),
        Op::Symlink { target, link } => format!("symlink\t{}\t{}", p(target), p(link)),
        Op::Unlink { path } => format!("unlink\t{}", p(path)),
        Op::Rmdir { path } => format!("rmdir\t{}", p(path)),
    }
}

pub(super) fn decode_op(line: &str) -> io::Result<Op> {
    fn unesc(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                match chars.next() {
                    Some('t') => out.push('\t'),
                    Some('n') => out.push('\n'),
                    Some(other) => out.push(other),
                    None => out.push('\\'),
                }
            } else {
                out.push(c);
            }
        }
        out
    }
    let fields: Vec<String> = line.split('\t').map(unesc).collect();
    let path = |i: usize| fields.get(i).map(PathBuf::from);
    let op = match fields.first().map(String::as_str) {
        Some("mkdir") => path(1).map(|path| Op::Mkdir { path }),
        Some("write") => path(1).zip(fields.get(2)).map(|(path, value)| Op::Write {
            path,
            value: value.clone(),
        }),
        Some("symlink") => path(1)
            .zip(path(2))
            .map(|(target, link)| Op::Symlink { target, link }),
        Some("unlink") => path(1).map(|path| Op::Unlink { path }),
        Some("rmdir") => path(1).map(|path| Op::Rmdir { path }),
        _ => None,
    };
    op.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad op record {line:?}"),
        )
    })
}
