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

use pillar_nvmet::{TargetState, observe, observe_scope};

use crate::tree;

/// Most entries one input makes: the time of one run stays small.
const MAX_ENTRIES: usize = 64;

pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let dir = tree::scratch("pillar-fuzz-configfs-");
    let root = dir.path().join("nvmet");
    for top in ["hosts", "subsystems", "ports"] {
        fs::create_dir_all(root.join(top)).expect("the top directories");
    }
    for line in text.lines().take(MAX_ENTRIES) {
        tree::build(&root, line);
    }
    if !tree::links_harmless(dir.path(), &root) {
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
