//! Where a path lies in the nvmet tree: the one classification every operation of the double
//! decides by.
//!
//! Invariants:
//! - A path is classified from its components alone (no file system access); anything that is
//!   not a place configfs has is [`Place::Other`], which every operation refuses.

use std::path::{Component, Path};

use crate::model::{HOSTS, PORTS, SUBSYSTEMS};

/// Where a path lies in the nvmet tree.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Place<'a> {
    TopGroup,
    Subsystem(&'a str),
    SubsystemAttr(&'a str, &'a str),
    SubsystemDefaultGroup,
    Namespace(&'a str, &'a str),
    NamespaceAttr(&'a str, &'a str, &'a str),
    AllowedHostLink(&'a str, &'a str),
    Port(&'a str),
    PortAttr(&'a str, &'a str),
    PortDefaultGroup,
    PortSubsystemLink(&'a str, &'a str),
    PortChild,
    Host(&'a str),
    HostAttr(&'a str, &'a str),
    Other,
}

pub(super) fn classify(path: &Path) -> Place<'_> {
    let parts: Vec<&str> = path
        .components()
        .map(|c| match c {
            Component::Normal(s) => s.to_str().unwrap_or("\u{0}"),
            _ => "\u{0}",
        })
        .collect();
    match parts.as_slice() {
        [SUBSYSTEMS] | [PORTS] | [HOSTS] => Place::TopGroup,
        [SUBSYSTEMS, s] => Place::Subsystem(s),
        [SUBSYSTEMS, _, "namespaces" | "allowed_hosts" | "passthru"] => {
            Place::SubsystemDefaultGroup
        }
        [SUBSYSTEMS, s, a] => Place::SubsystemAttr(s, a),
        [SUBSYSTEMS, s, "namespaces", n] => Place::Namespace(s, n),
        [SUBSYSTEMS, s, "namespaces", n, a] => Place::NamespaceAttr(s, n, a),
        [SUBSYSTEMS, s, "allowed_hosts", h] => Place::AllowedHostLink(s, h),
        [PORTS, p] => Place::Port(p),
        [PORTS, _, "subsystems" | "referrals" | "ana_groups"] => Place::PortDefaultGroup,
        [PORTS, p, a] => Place::PortAttr(p, a),
        [PORTS, p, "subsystems", s] => Place::PortSubsystemLink(p, s),
        [PORTS, _, "ana_groups", "1"] => Place::PortDefaultGroup,
        [PORTS, ..] => Place::PortChild,
        [HOSTS, h] => Place::Host(h),
        [HOSTS, h, a] => Place::HostAttr(h, a),
        _ => Place::Other,
    }
}
