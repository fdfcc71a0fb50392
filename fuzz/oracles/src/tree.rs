//! Trees of files, directories and symlinks built in a temporary directory from a fuzz input,
//! for the targets whose parsers read a kernel file system (configfs, sysfs). Nothing is ever
//! made through a link, and a tree is only read when every link in it stays inside the
//! temporary directory or names nothing that exists: a fuzz input never reaches outside.
//!
//! The input is a text of lines, each one entry: `d PATH` a directory, `f PATH VALUE` an
//! attribute file holding VALUE and a newline, `l PATH TARGET` a symlink. Paths are relative
//! and made of plain names.

use std::fs;
use std::path::{Component, Path, PathBuf};

/// A fresh temporary directory, in memory where the machine has `/dev/shm`.
pub(crate) fn scratch(prefix: &str) -> tempfile::TempDir {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .expect("a temporary directory")
}

/// Makes one entry; a line that is not one, or would reach outside, is skipped.
pub(crate) fn build(root: &Path, line: &str) {
    let mut words = line.splitn(3, ' ');
    let (Some(kind), Some(path)) = (words.next(), words.next()) else {
        return;
    };
    let rest = words.next().unwrap_or("");
    let Some(path) = inside(root, path) else {
        return;
    };
    let Some(parent) = path.parent() else { return };
    if !real_dirs(root, parent) {
        return;
    }
    if fs::symlink_metadata(&path).is_ok() {
        return;
    }
    let _ = match kind {
        "d" => fs::create_dir(&path),
        "f" => fs::write(&path, format!("{rest}\n")),
        "l" if !rest.is_empty() && !rest.contains('\0') => std::os::unix::fs::symlink(rest, &path),
        _ => return,
    };
}

/// `path` under `root` when it is relative and made of plain names only.
fn inside(root: &Path, path: &str) -> Option<PathBuf> {
    let p = Path::new(path);
    let plain = !path.is_empty()
        && !path.contains('\0')
        && p.components().all(|c| matches!(c, Component::Normal(_)));
    plain.then(|| root.join(p))
}

/// Creates the directories of `dir` under `root`; false when one of them is not a directory
/// of its own (a symlink or a file): nothing is ever made through a link.
fn real_dirs(root: &Path, dir: &Path) -> bool {
    let Ok(rel) = dir.strip_prefix(root) else {
        return false;
    };
    let mut at = root.to_path_buf();
    for part in rel.components() {
        at.push(part);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_dir() => {}
            Ok(_) => return false,
            Err(_) => {
                if fs::create_dir(&at).is_err() {
                    return false;
                }
            }
        }
    }
    true
}

/// Whether every link of the tree reads as the readers assume and stays harmless: its target,
/// walked from the link's directory, passes through no link (so the lexical resolution the
/// readers apply is the real one), and it ends inside the temporary directory or names
/// nothing that exists. Checked once the whole tree is built, since a later link could change
/// what an earlier target resolves to.
pub(crate) fn links_harmless(tree: &Path, dir: &Path) -> bool {
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    for entry in entries {
        let Ok(entry) = entry else { return false };
        let path = entry.path();
        let Ok(meta) = fs::symlink_metadata(&path) else {
            return false;
        };
        let ok = if meta.file_type().is_symlink() {
            fs::read_link(&path).is_ok_and(|t| target_harmless(tree, dir, &t))
        } else if meta.is_dir() {
            links_harmless(tree, &path)
        } else {
            true
        };
        if !ok {
            return false;
        }
    }
    true
}

fn target_harmless(tree: &Path, dir: &Path, target: &Path) -> bool {
    let mut at = if target.is_absolute() {
        PathBuf::new()
    } else {
        dir.to_path_buf()
    };
    for part in target.components() {
        match part {
            Component::ParentDir => {
                at.pop();
            }
            Component::CurDir => {}
            other => {
                at.push(other);
                if fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
                    return false;
                }
            }
        }
    }
    at.starts_with(tree) || fs::symlink_metadata(&at).is_err()
}
