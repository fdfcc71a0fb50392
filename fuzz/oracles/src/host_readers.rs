//! The node's readers of what the kernel and the tools print (`pillar-host`): `/proc`'s
//! mountinfo, the connect reply of `/dev/nvme-fabrics`, `blkid -o export`, `xfs_logprint -t`'s
//! log state, an ext4 superblock, an NVMe Reservation Report, and the sysfs tree of NVMe
//! controllers and namespace disks. A node plugin acts on these (which device is the volume,
//! whether it may be formatted, whose reservation holds), so a misread is a wrong device or a
//! second writer, not only a crash.
//!
//! The raw input goes to the binary decoders; as text, to each text parser whole and line by
//! line, and as a sysfs tree (the lines of [`crate::tree`]) under `<sys>/class/nvme` and
//! `<sys>/block`. Properties:
//! - No panic, whatever the bytes.
//! - What a parser accepts is what the input says: a connect reply's controller is named after
//!   its instance; a log state or an ext4 "needs recovery" agrees with the words or bits it was
//!   read from; a device number re-reads the same from its canonical form; a controller state
//!   prints back as read; a Reservation Report holds exactly the registrants the buffer has room
//!   for and announces.
//! - mountinfo is read line by line: the whole text parses to the lines' entries, in order.
//! - The sysfs readers agree with themselves: every controller is an `nvme<N>` whose instance is
//!   N; a namespace disk listed for a subsystem is a namespace name, not hidden, a whole number
//!   of sectors, under that device directory; the disks reachable from one host NQN are among
//!   the subsystem's disks; the same tree reads the same twice.

use std::fs;
use std::path::Path;

use pillar_host::readers_fuzzing as readers;
use pillar_host::{
    ControllerState, HostPaths, mountinfo, namespaces_for, namespaces_for_host, resv,
};
use pillar_nvmet::{HostNqn, SubsystemNqn};

use crate::tree;

/// Most tree entries one input makes: the time of one run stays small.
const MAX_ENTRIES: usize = 64;

pub fn check(data: &[u8]) {
    binary(data);
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    text_parsers(text);
    for line in text.lines().take(MAX_ENTRIES) {
        text_parsers(line);
    }
    mountinfo_is_line_by_line(text);
    sysfs(text);
}

fn binary(data: &[u8]) {
    let mut sb = [0u8; 1024];
    let n = data.len().min(sb.len());
    sb[..n].copy_from_slice(&data[..n]);
    if let Ok(recover) = readers::ext4_needs_recovery(&sb) {
        assert_eq!(u16::from_le_bytes([sb[0x38], sb[0x39]]), 0xEF53, "magic");
        assert_eq!(recover, sb[0x60] & 0x04 != 0, "RECOVER bit");
    }
    if let Ok(report) = resv::Report::decode(data) {
        let announced = usize::from(u16::from_le_bytes([data[5], data[6]]));
        assert_eq!(report.registrants.len(), announced);
        assert!(data.len() >= 64 + 64 * announced);
        assert_eq!(report.rtype.is_none(), data[4] == 0);
        if let Some(holder) = report.holder() {
            assert!(report.registration_of(&holder.host_id).is_some());
        }
    }
}

fn text_parsers(text: &str) {
    if let Ok(c) = readers::parse_reply(text) {
        assert_eq!(c.name, format!("nvme{}", c.instance));
        let canonical = format!("instance={},cntlid={}\n", c.instance, c.cntlid);
        let again = readers::parse_reply(&canonical).expect("the canonical reply parses");
        assert_eq!((again.instance, again.cntlid), (c.instance, c.cntlid));
    }
    if let Some(sig) = readers::blkid_export(text) {
        assert!(text.contains("DEVNAME="));
        for v in [&sig.fs_type, &sig.pt_type, &sig.usage]
            .into_iter()
            .flatten()
        {
            assert!(text.contains(v.as_str()), "{v:?} is not in the input");
        }
    }
    if let Some(dirty) = readers::xfs_log_dirty(text) {
        let word = if dirty { "<DIRTY>" } else { "<CLEAN>" };
        assert!(text.contains(word), "{word} read from a text without it");
    }
    if let Some((major, minor)) = readers::devnum(text) {
        assert_eq!(
            readers::devnum(&format!("{major}:{minor}")),
            Some((major, minor))
        );
        assert!(text.contains(':'));
    }
    assert_eq!(ControllerState::parse(text).as_str(), text);
}

fn mountinfo_is_line_by_line(text: &str) {
    let Ok(whole) = mountinfo::parse(text) else {
        return;
    };
    let mut by_line = Vec::new();
    for line in text.lines() {
        match mountinfo::parse(line) {
            Ok(entries) => by_line.extend(entries),
            Err(e) => panic!("the whole text parsed, its line {line:?} alone: {e}"),
        }
    }
    assert_eq!(whole, by_line);
}

fn sysfs(text: &str) {
    let dir = tree::scratch("pillar-fuzz-sysfs-");
    let sys = dir.path().join("sys");
    for top in ["class/nvme", "block", "devices"] {
        fs::create_dir_all(sys.join(top)).expect("the top directories");
    }
    for line in text.lines().take(MAX_ENTRIES) {
        tree::build(&sys, line);
    }
    if !tree::links_harmless(dir.path(), &sys) {
        return;
    }
    let paths = HostPaths {
        dev: dir.path().join("dev"),
        sys,
    };
    let Ok(controllers) = readers::all_controllers(&paths) else {
        return;
    };
    for c in &controllers {
        assert_eq!(c.name, format!("nvme{}", c.instance), "{c:?}");
        assert_eq!(c.subsysnqn, c.subsysnqn.trim_end(), "{c:?}");
    }
    assert_eq!(
        readers::all_controllers(&paths).ok().as_ref(),
        Some(&controllers),
        "the same tree read twice"
    );
    let absent = "nqn.2014-08.org.example:absent";
    let nqns = controllers.iter().map(|c| c.subsysnqn.as_str());
    for nqn in nqns.chain([absent]) {
        let Ok(nqn) = nqn.parse::<SubsystemNqn>() else {
            continue;
        };
        namespaces_agree(&paths, &nqn, &controllers);
    }
}

fn namespaces_agree(
    paths: &HostPaths,
    nqn: &SubsystemNqn,
    controllers: &[pillar_host::ControllerInfo],
) {
    let Ok(all) = namespaces_for(paths, nqn) else {
        return;
    };
    for d in &all {
        assert!(readers::is_namespace_name(&d.name), "{d:?}");
        assert_eq!(d.dev_path, paths.dev.join(&d.name), "{d:?}");
        assert_eq!(d.size_bytes % 512, 0, "{d:?}");
        let hidden = paths.sys.join("block").join(&d.name).join("hidden");
        let hidden = fs::read_to_string(hidden).unwrap_or_default();
        assert_ne!(hidden.trim_end(), "1", "a hidden disk listed: {d:?}");
        assert!(
            Path::new(&paths.sys.join("block").join(&d.name)).is_dir(),
            "{d:?}"
        );
    }
    let hosts = controllers.iter().filter_map(|c| c.hostnqn.as_deref());
    for host in hosts {
        let Ok(host) = host.parse::<HostNqn>() else {
            continue;
        };
        if let Ok(reachable) = namespaces_for_host(paths, nqn, Some(&host)) {
            for d in &reachable {
                assert!(
                    all.contains(d),
                    "reachable from {host} but not listed: {d:?}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checked-in sysfs seeds are trees the readers find a disk in: the target starts from
    /// inputs that reach the namespace checks, not only the early returns.
    #[test]
    fn the_sysfs_seeds_reach_a_namespace_disk() {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus/host_readers");
        let nqn: SubsystemNqn = "nqn.2024-01.io.pillar:pvc-1".parse().unwrap();
        for seed in ["sysfs-multipath", "sysfs-controller-parent"] {
            let text = fs::read_to_string(corpus.join(seed)).unwrap();
            let dir = tree::scratch("pillar-fuzz-sysfs-seed-");
            let sys = dir.path().join("sys");
            for top in ["class/nvme", "block", "devices"] {
                fs::create_dir_all(sys.join(top)).unwrap();
            }
            for line in text.lines() {
                tree::build(&sys, line);
            }
            assert!(tree::links_harmless(dir.path(), &sys), "{seed}");
            let paths = HostPaths {
                dev: dir.path().join("dev"),
                sys,
            };
            let controllers = readers::all_controllers(&paths).unwrap();
            assert_eq!(controllers.len(), 1, "{seed}: {controllers:?}");
            let disks = namespaces_for(&paths, &nqn).unwrap();
            assert_eq!(disks.len(), 1, "{seed}: {disks:?}");
            let host: HostNqn = controllers[0].hostnqn.as_deref().unwrap().parse().unwrap();
            assert_eq!(
                namespaces_for_host(&paths, &nqn, Some(&host)).unwrap(),
                disks,
                "{seed}"
            );
        }
    }
}
