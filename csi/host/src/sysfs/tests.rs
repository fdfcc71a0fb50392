//! Tests of the sysfs reader against the fake sysfs tree.

use super::*;
use crate::fake::{FakeController, FakeNamespace, FakeSysfs};
use pillar_nvmet::{NamespaceId, VolumeId};

const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:0a0a0a0a-0000-4000-8000-00000000000a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:0b0b0b0b-0000-4000-8000-00000000000b";

fn nqn(v: &str) -> SubsystemNqn {
    VolumeId::parse(v).unwrap().subsystem_nqn()
}

fn identity(v: &str) -> NamespaceIdentity {
    NamespaceIdentity::derive(&nqn(v), NamespaceId::VOLUME)
}

fn ctrl(instance: u32, subsys: u32, host: &str) -> FakeController {
    FakeController {
        instance,
        subsys_instance: subsys,
        hostnqn: host.into(),
        traddr: "192.0.2.10".into(),
        trsvcid: 4420,
        state: "live".into(),
    }
}

fn ns(subsys: u32, ctrls: &[u32], multipath: bool, id: Option<NamespaceIdentity>) -> FakeNamespace {
    FakeNamespace {
        subsys_instance: subsys,
        head_instance: 1,
        nsid: 1,
        multipath,
        ctrl_instances: ctrls.to_vec(),
        uuid: id.map(|i| i.uuid),
        nguid: id.map(|i| i.nguid),
        size_sectors: 2 * 1024 * 1024,
    }
}

/// Two pillar volumes and one foreign subsystem, multipath on.
fn two_volumes(root: &Path) -> FakeSysfs {
    let mut f = FakeSysfs::new(root).unwrap();
    f.add_subsystem(0, nqn("vol-a").as_str()).unwrap();
    f.add_subsystem(1, nqn("vol-b").as_str()).unwrap();
    f.add_subsystem(2, "nqn.2014-08.com.example:other").unwrap();
    f.add_controller(&ctrl(0, 0, HOST_A)).unwrap();
    f.add_controller(&ctrl(1, 1, HOST_A)).unwrap();
    f.add_controller(&ctrl(2, 2, HOST_A)).unwrap();
    f.add_namespace(&ns(0, &[0], true, Some(identity("vol-a"))))
        .unwrap();
    f.add_namespace(&ns(1, &[1], true, Some(identity("vol-b"))))
        .unwrap();
    f.add_namespace(&ns(2, &[2], true, Some(identity("vol-x"))))
        .unwrap();
    f
}

#[test]
fn names() {
    for ok in ["nvme0", "nvme12", "nvme10"] {
        assert!(is_controller_name(ok), "{ok}");
    }
    // The kernel prints numbers with `%d`: `nvme00` and `nvme01` are no controllers.
    for bad in [
        "nvme",
        "nvme00",
        "nvme01",
        "nvme0n1",
        "nvme-subsys0",
        "nvme-fabrics",
        "nvmex",
        "ng0n1",
    ] {
        assert!(!is_controller_name(bad), "{bad}");
    }
    for ok in ["nvme0n1", "nvme10n12"] {
        assert!(is_namespace_name(ok), "{ok}");
    }
    for bad in [
        "nvme0c0n1",
        "nvme0n1p1",
        "nvme0n",
        "nvme0",
        "nvmen1",
        "sda",
        "nvme0n01",
        "nvme00n1",
    ] {
        assert!(!is_namespace_name(bad), "{bad}");
    }
}

#[test]
fn controllers_of_one_subsystem_only() {
    let dir = tempfile::tempdir().unwrap();
    let f = two_volumes(dir.path());
    let ctrls = controllers_for(f.paths(), &nqn("vol-b")).unwrap();
    assert_eq!(ctrls.len(), 1);
    let c = &ctrls[0];
    assert_eq!(c.name, "nvme1");
    assert_eq!(c.instance, 1);
    assert_eq!(c.state, ControllerState::Live);
    assert_eq!(c.hostnqn.as_deref(), Some(HOST_A));
    assert_eq!(c.transport.as_deref(), Some("tcp"));
    assert_eq!(c.address_field("traddr"), Some("192.0.2.10"));
    assert_eq!(c.address_field("trsvcid"), Some("4420"));
    assert_eq!(c.address_field("nope"), None);
    assert!(controller_live(f.paths(), "nvme1").unwrap());
    f.set_state(1, "connecting").unwrap();
    assert!(!controller_live(f.paths(), "nvme1").unwrap());
    assert!(!controller_live(f.paths(), "nvme9").unwrap());
    assert!(
        controllers_for(f.paths(), &nqn("vol-none"))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn no_nvme_modules_means_nothing_found() {
    let dir = tempfile::tempdir().unwrap();
    let paths = HostPaths::under(dir.path());
    assert!(controllers_for(&paths, &nqn("vol-a")).unwrap().is_empty());
    assert!(namespaces_for(&paths, &nqn("vol-a")).unwrap().is_empty());
    assert!(
        disconnect_subsystem(&paths, &nqn("vol-a"), None)
            .unwrap()
            .is_empty()
    );
}

// proves N1 (finding by subsystem NQN): multipath on, the disk hangs under the subsystem and
// the hidden per-path disk is not offered.
#[test]
fn multipath_namespace_is_found_by_nqn() {
    let dir = tempfile::tempdir().unwrap();
    let f = two_volumes(dir.path());
    assert!(f.paths().sys.join("block/nvme0c0n1").exists());
    let found = namespaces_for(f.paths(), &nqn("vol-b")).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    let d = &found[0];
    assert_eq!(d.name, "nvme1n1");
    assert_eq!(d.dev_path, f.paths().dev.join("nvme1n1"));
    assert_eq!(d.parent, NamespaceParent::Subsystem("nvme-subsys1".into()));
    assert_eq!(d.uuid, Some(identity("vol-b").uuid));
    assert_eq!(d.nguid, Some(identity("vol-b").nguid));
    assert_eq!(d.size_bytes, 1024 * 1024 * 1024);
    assert_eq!(d.nsid, Some(1));
    verify_identity(d, &identity("vol-b")).unwrap();
}

// proves N1 with multipath off: the disk is named after the controller and hangs under it.
#[test]
fn non_multipath_namespace_is_found_under_its_controller() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(dir.path()).unwrap();
    f.add_subsystem(0, nqn("vol-a").as_str()).unwrap();
    f.add_subsystem(1, nqn("vol-b").as_str()).unwrap();
    f.add_controller(&ctrl(0, 0, HOST_A)).unwrap();
    f.add_controller(&ctrl(3, 1, HOST_A)).unwrap();
    f.add_controller(&ctrl(4, 1, HOST_B)).unwrap();
    f.add_namespace(&ns(0, &[0], false, Some(identity("vol-a"))))
        .unwrap();
    f.add_namespace(&ns(1, &[3, 4], false, Some(identity("vol-b"))))
        .unwrap();

    let all = namespaces_for(f.paths(), &nqn("vol-b")).unwrap();
    let names: Vec<_> = all.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["nvme3n1", "nvme4n1"]);
    let host_b = HostNqn::parse(HOST_B).unwrap();
    let mine = namespaces_for_host(f.paths(), &nqn("vol-b"), Some(&host_b)).unwrap();
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].name, "nvme4n1");
    assert_eq!(mine[0].parent, NamespaceParent::Controller("nvme4".into()));
    verify_identity(&mine[0], &identity("vol-b")).unwrap();
    // Without a host filter two disks match: waiting refuses to guess.
    let err = wait_for_namespace(f.paths(), &nqn("vol-b"), None, Duration::ZERO).unwrap_err();
    assert!(
        matches!(err, HostError::AmbiguousNamespace { .. }),
        "{err:?}"
    );
    let dev = wait_for_namespace(f.paths(), &nqn("vol-b"), Some(&host_b), Duration::ZERO).unwrap();
    assert_eq!(dev.name, "nvme4n1");
}

#[test]
fn host_filter_applies_to_multipath_disks() {
    let dir = tempfile::tempdir().unwrap();
    let f = two_volumes(dir.path());
    let host_a = HostNqn::parse(HOST_A).unwrap();
    let host_b = HostNqn::parse(HOST_B).unwrap();
    assert_eq!(
        namespaces_for_host(f.paths(), &nqn("vol-a"), Some(&host_a))
            .unwrap()
            .len(),
        1
    );
    assert!(
        namespaces_for_host(f.paths(), &nqn("vol-a"), Some(&host_b))
            .unwrap()
            .is_empty()
    );
}

// proves N1: another volume's device, a device without a UUID or NGUID, and the kernel's
// NGUID-in-the-uuid-file fallback are all refused.
#[test]
fn identity_mismatches_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(dir.path()).unwrap();
    let id = identity("vol-a");
    let cases: [(Option<Uuid>, Option<Nguid>); 4] = [
        (Some(identity("vol-b").uuid), Some(id.nguid)),
        (Some(id.uuid), Some(identity("vol-b").nguid)),
        (None, Some(id.nguid)),
        (None, None),
    ];
    for (i, (uuid, nguid)) in cases.into_iter().enumerate() {
        let i = u32::try_from(i).unwrap();
        let v = format!("vol-{i}");
        f.add_subsystem(i, nqn(&v).as_str()).unwrap();
        f.add_controller(&ctrl(i, i, HOST_A)).unwrap();
        let mut n = ns(i, &[i], true, None);
        n.uuid = uuid;
        n.nguid = nguid;
        f.add_namespace(&n).unwrap();
        let found = namespaces_for(f.paths(), &nqn(&v)).unwrap();
        assert_eq!(found.len(), 1);
        let err = verify_identity(&found[0], &id).unwrap_err();
        assert!(matches!(err, HostError::IdentityMismatch { .. }), "{err:?}");
        assert_eq!(err.class(), crate::ErrorClass::FailedPrecondition);
    }
    // The fallback case: the kernel shows the NGUID in `uuid`; that is not a UUID.
    let fallback = namespaces_for(f.paths(), &nqn("vol-2")).unwrap();
    let uuid_file = fs::read_to_string(f.paths().sys.join("block/nvme2n1/uuid")).unwrap();
    assert_eq!(uuid_file, format!("{}\n", id.nguid));
    assert_eq!(fallback[0].uuid, None);
    let none = namespaces_for(f.paths(), &nqn("vol-3")).unwrap();
    assert_eq!((none[0].uuid, none[0].nguid), (None, None));
}

#[test]
fn malformed_identity_is_an_error_not_a_match() {
    let dir = tempfile::tempdir().unwrap();
    let f = two_volumes(dir.path());
    fs::write(f.paths().sys.join("block/nvme0n1/nguid"), "zz\n").unwrap();
    let err = namespaces_for(f.paths(), &nqn("vol-a")).unwrap_err();
    assert!(matches!(err, HostError::ParseSysfs { .. }), "{err:?}");
}

#[test]
fn wait_times_out_naming_what_it_saw() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(dir.path()).unwrap();
    f.add_subsystem(0, nqn("vol-a").as_str()).unwrap();
    let mut c = ctrl(0, 0, HOST_A);
    c.state = "connecting".into();
    f.add_controller(&c).unwrap();
    let start = Instant::now();
    let err =
        wait_for_namespace(f.paths(), &nqn("vol-a"), None, Duration::from_millis(300)).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(300));
    match &err {
        HostError::NamespaceNotFound { seen, .. } => {
            assert!(seen.contains("nvme0 (connecting"), "{seen}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(err.class(), crate::ErrorClass::NotFound);
}

#[test]
fn wait_sees_a_namespace_that_appears_later() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = FakeSysfs::new(dir.path()).unwrap();
    f.add_subsystem(0, nqn("vol-a").as_str()).unwrap();
    f.add_controller(&ctrl(0, 0, HOST_A)).unwrap();
    let paths = f.paths().clone();
    let adder = thread::spawn(move || {
        thread::sleep(Duration::from_millis(250));
        f.add_namespace(&ns(0, &[0], true, Some(identity("vol-a"))))
            .unwrap();
    });
    let start = Instant::now();
    let dev = wait_for_namespace(&paths, &nqn("vol-a"), None, Duration::from_secs(10)).unwrap();
    adder.join().unwrap();
    assert!(start.elapsed() >= Duration::from_millis(250));
    assert_eq!(dev.name, "nvme0n1");
    verify_identity(&dev, &identity("vol-a")).unwrap();
}

#[test]
fn wait_needs_the_device_node() {
    let dir = tempfile::tempdir().unwrap();
    let f = two_volumes(dir.path());
    fs::remove_file(f.paths().dev.join("nvme0n1")).unwrap();
    let err =
        wait_for_namespace(f.paths(), &nqn("vol-a"), None, Duration::from_millis(150)).unwrap_err();
    assert!(
        matches!(err, HostError::NamespaceNotFound { .. }),
        "{err:?}"
    );
    // A node that is not a block device, or another block device, is refused outright.
    fs::write(f.paths().dev.join("nvme0n1"), "").unwrap();
    let err = wait_for_namespace(f.paths(), &nqn("vol-a"), None, Duration::ZERO).unwrap_err();
    assert!(matches!(err, HostError::NotBlockDevice { .. }), "{err:?}");
    fs::remove_file(f.paths().dev.join("nvme0n1")).unwrap();
    crate::sys::mknod_block(&f.paths().dev.join("nvme0n1"), 1, 3).unwrap();
    let err = wait_for_namespace(f.paths(), &nqn("vol-a"), None, Duration::ZERO).unwrap_err();
    assert!(matches!(err, HostError::StaleDeviceNode { .. }), "{err:?}");
}

// proves N4: only the named subsystem's controllers are deleted, and with a host NQN only
// that host's.
#[test]
fn disconnect_touches_only_that_subsystem() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = two_volumes(dir.path());
    f.add_controller(&ctrl(3, 1, HOST_B)).unwrap();
    let host_b = HostNqn::parse(HOST_B).unwrap();

    let deleted = disconnect_subsystem(f.paths(), &nqn("vol-b"), Some(&host_b)).unwrap();
    assert_eq!(deleted, ["nvme3"]);
    assert_eq!(f.deletes_requested(), [3]);

    let deleted = disconnect_subsystem(f.paths(), &nqn("vol-b"), None).unwrap();
    assert_eq!(deleted, ["nvme1", "nvme3"]);
    assert_eq!(f.deletes_requested(), [1, 3]);
    // vol-a (nvme0) and the foreign subsystem (nvme2) were never touched.
    assert!(
        disconnect_subsystem(f.paths(), &nqn("vol-none"), None)
            .unwrap()
            .is_empty()
    );
    assert_eq!(f.deletes_requested(), [1, 3]);
}

#[test]
fn disconnect_skips_a_controller_that_vanished() {
    let dir = tempfile::tempdir().unwrap();
    let f = two_volumes(dir.path());
    let attr = f.paths().sys.join("class/nvme/nvme0/delete_controller");
    fs::remove_file(&attr).unwrap();
    assert!(
        disconnect_subsystem(f.paths(), &nqn("vol-a"), None)
            .unwrap()
            .is_empty()
    );
    // And it never creates the attribute.
    assert!(!attr.exists());
}

#[test]
fn disconnect_failure_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let f = two_volumes(dir.path());
    let attr = f.paths().sys.join("class/nvme/nvme0/delete_controller");
    fs::remove_file(&attr).unwrap();
    fs::create_dir(&attr).unwrap(); // opening a directory for writing fails with EISDIR
    let err = disconnect_subsystem(f.paths(), &nqn("vol-a"), None).unwrap_err();
    assert!(matches!(err, HostError::DeleteController { .. }), "{err:?}");
}

#[test]
fn rescan_writes_the_attribute() {
    let dir = tempfile::tempdir().unwrap();
    let f = two_volumes(dir.path());
    rescan_controller(f.paths(), "nvme1").unwrap();
    let attr = f.paths().sys.join("class/nvme/nvme1/rescan_controller");
    assert_eq!(fs::read_to_string(attr).unwrap(), "1");
    assert!(rescan_controller(f.paths(), "../x").is_err());
    assert!(matches!(
        rescan_controller(f.paths(), "nvme7"),
        Err(HostError::RescanController { .. })
    ));
}
