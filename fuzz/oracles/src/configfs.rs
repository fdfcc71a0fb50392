//! The nvmet configfs readers (`pillar_nvmet::observe`, `observe_scope`): what the agent makes
//! of the tree the kernel (or whoever wrote under it) shows, attribute files, directory
//! listings and link targets.
//!
//! The input is a text of lines, each one entry of a tree built in a temporary directory:
//! `d PATH` a directory, `f PATH VALUE` an attribute file holding VALUE and a newline,
//! `l PATH TARGET` a symlink. Paths are relative and never pass through a symlink; a link whose
//! target leaves the tree is made only when that target does not exist, so nothing outside is
//! ever read or written. Properties:
//! - No panic: either an error or a state.
//! - A state holds only names: every host and subsystem a link names is one path component,
//!   and a serial carries no padding.
//! - The scoped read agrees with the full read, for every subsystem and for one that does not
//!   exist: the same subsystem, hosts and port attributes, and a port linking the subsystem in
//!   the scoped read links it in the full one.

use std::fs;
use std::path::{Component, Path, PathBuf};

use pillar_nvmet::{TargetState, observe, observe_scope};

/// Most entries one input makes: the time of one run stays small.
const MAX_ENTRIES: usize = 64;

pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = tempfile::Builder::new()
        .prefix("pillar-fuzz-configfs-")
        .tempdir_in(base)
        .expect("a temporary directory");
    let root = dir.path().join("nvmet");
    for top in ["hosts", "subsystems", "ports"] {
        fs::create_dir_all(root.join(top)).expect("the top directories");
    }
    for line in text.lines().take(MAX_ENTRIES) {
        build(&root, line);
    }
    if !links_harmless(dir.path(), &root) {
        return;
    }
    let Ok(full) = observe(&root) else {
        return;
    };
    names_only(&full);
    let absent = "nqn.2014-08.org.example:absent".to_owned();
    for nqn in full.subsystems.keys().chain([&absent]) {
        let scoped = observe_scope(&root, nqn)
            .unwrap_or_else(|e| panic!("the full read succeeded, the scoped one of {nqn}: {e}"));
        agree(&full, &scoped, nqn);
    }
}

/// Makes one entry; a line that is not one, or would reach outside, is skipped.
fn build(root: &Path, line: &str) {
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
fn links_harmless(tree: &Path, dir: &Path) -> bool {
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

fn names_only(state: &TargetState) {
    let name = |n: &str| !n.is_empty() && n != "." && n != ".." && !n.contains('/');
    for (nqn, s) in &state.subsystems {
        assert!(s.allowed_hosts.iter().all(|h| name(h)), "{nqn}: {s:?}");
        assert!(!s.serial.ends_with(' '), "{nqn}: serial {:?}", s.serial);
    }
    for (id, p) in &state.ports {
        assert!(p.subsystems.iter().all(|n| name(n)), "port {id}: {p:?}");
    }
}

fn agree(full: &TargetState, scoped: &TargetState, nqn: &str) {
    assert_eq!(
        scoped.subsystems.get(nqn),
        full.subsystems.get(nqn),
        "{nqn}"
    );
    assert!(scoped.subsystems.keys().all(|k| k == nqn), "{nqn}");
    assert_eq!(scoped.hosts, full.hosts);
    assert_eq!(
        scoped.ports.keys().collect::<Vec<_>>(),
        full.ports.keys().collect::<Vec<_>>()
    );
    for (id, s) in &scoped.ports {
        let f = &full.ports[id];
        let attrs = |p: &pillar_nvmet::PortState| {
            (
                p.trtype.clone(),
                p.adrfam.clone(),
                p.traddr.clone(),
                p.trsvcid.clone(),
                p.referrals,
            )
        };
        assert_eq!(attrs(s), attrs(f), "port {id}");
        if s.subsystems.contains(nqn) {
            assert!(
                f.subsystems.contains(nqn),
                "port {id} links {nqn} only when scoped"
            );
        }
    }
}
