//! Scenario 8: the LVM backends (linear and thin) on device-mapper.

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_nvmet::HostNqn;
use tonic::Code;
use tonic::transport::Channel;

use crate::harness::checks::{connect_opts, host_controllers, host_device};
use crate::harness::data::pattern;
use crate::harness::gate::{Scenario, in_lane};
use crate::harness::kmsg::needles::IDENTIFIERS_CHANGED;
use crate::harness::lab::{Lab, host_paths, nqn_of};
use crate::harness::machine::{drop_caches, nvmet_is_empty, read_attr, write_attr};
use crate::harness::{ETC_HOSTID, ETC_HOSTNQN, MIB, NVMET, PORT};
use crate::lvm::{
    Lifecycle, Lv, S8_EXTENT, S8_THIN_POOL, S8_VG, ScratchVg, check_lvm_capacity, check_lvm_export,
    find_lv, listed, lvm, lvm_ok, lvs, read_at, sysfs_dev_size, vgs, write_at,
};

/// Scenario 8, one volume of one LVM pool from export to delete: export (no ACL), the host
/// connects, I/O at both ends checked on the host and in the LV, online expansion seen by the
/// host, shrink refused, the way back, delete.
#[allow(clippy::too_many_lines)]
async fn s8_volume(
    sc: &Scenario,
    lab: &mut Lab,
    agent: &mut AgentClient<Channel>,
    pool: &str,
    vol: &str,
    life: &mut Lifecycle,
) {
    let thin = pool == "thin";
    let host: HostNqn = fs::read_to_string(ETC_HOSTNQN)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let host_id: uuid::Uuid = fs::read_to_string(ETC_HOSTID)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let nqn = nqn_of(vol);
    let lv = find_lv(S8_VG, vol).expect("the LV exists");
    let (_, thin_free_before) = check_lvm_capacity(agent).await;

    let k1 = lab.kmsg.mark();
    let exported = agent
        .export(agent_api::ExportRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            protocol: Some(agent_api::ExportProtocol {
                service: u32::from(PORT),
                acl: false,
                auth_none: true,
                tls: false,
            }),
            allowed_host_nqns: vec![],
            credentials: vec![],
        })
        .await
        .expect("Export")
        .into_inner();
    assert_eq!(exported.subsystem_nqn, nqn.to_string());
    assert_eq!(
        (exported.target_address.as_str(), exported.target_service),
        ("127.0.0.1", u32::from(PORT))
    );
    assert!(!exported.identity_adopted);
    check_lvm_export(vol, &lv);
    sc.step(&format!("{pool}: {vol} exported from {} (no ACL)", lv.path));

    let ctrl = pillar_host::connect(&host_paths(), &connect_opts(vol, &host, host_id))
        .expect("the host connects");
    let dev = host_device(vol, &host);
    assert_eq!(dev.size_bytes, lv.size, "the host sees the LV's size");
    lab.kmsg.expect(
        k1,
        &["new ctrl: NQN \"", nqn.as_str(), "127.0.0.1:4420"],
        Duration::from_secs(5),
    );
    let old_size = lv.size;
    let seed = if thin { 800 } else { 700 };
    let mib = usize::try_from(MIB).unwrap();
    let head = pattern(seed, mib);
    let old_tail = pattern(seed + 1, mib);
    write_at(&dev.dev_path, 0, &head);
    write_at(&dev.dev_path, old_size - MIB, &old_tail);
    drop_caches();
    // Compared byte for byte: SHA-256 of MiBs in a debug build under TCG takes seconds.
    let same = |a: &[u8], b: &[u8]| a == b;
    let lv_path = Path::new(&lv.path);
    for (what, path) in [("host", dev.dev_path.as_path()), ("LV", lv_path)] {
        assert!(
            same(&read_at(path, 0, head.len()), &head),
            "{what}: first MiB differs"
        );
        assert!(
            same(&read_at(path, old_size - MIB, old_tail.len()), &old_tail),
            "{what}: last MiB differs"
        );
    }
    sc.step(&format!(
        "{pool}: host connected ({} -> /dev/{}, {} bytes); first and last MiB written, read back \
         through the host and from {} (page cache dropped, bytes equal)",
        ctrl.name, dev.name, dev.size_bytes, lv.path
    ));

    // Online expansion: 90 MiB + 1 byte is 96 MiB in 8 MiB extents (92 MiB in LVM's default 4).
    let k2 = lab.kmsg.mark();
    let new_size = 96 * MIB;
    let grown = agent
        .expand_volume(agent_api::ExpandVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            size_bytes: 90 * MIB + 1,
        })
        .await
        .expect("ExpandVolume")
        .into_inner();
    assert_eq!(
        grown.size_bytes, new_size,
        "expanded size rounded to the extent size"
    );
    let lv_grown = find_lv(S8_VG, vol).expect("LV");
    assert_eq!(lv_grown.size, new_size, "lvs shows the new size");
    assert_eq!(lv_grown.devnum, lv.devnum, "same device-mapper device");
    assert_eq!(
        sysfs_dev_size(&lv.devnum),
        new_size,
        "the dm device has grown"
    );
    let host_size = |d: &str| {
        read_attr(&Path::new("/sys/block").join(d).join("size"))
            .parse::<u64>()
            .unwrap_or(0)
            * 512
    };
    let start = Instant::now();
    while host_size(&dev.name) != new_size && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        host_size(&dev.name),
        new_size,
        "the host did not see the new size"
    );
    lab.kmsg.expect(
        k2,
        &[dev.name.as_str(), "detected capacity change"],
        Duration::from_secs(5),
    );
    sc.step(&format!(
        "{pool}: ExpandVolume 90 MiB + 1 -> {} bytes; lvs and the dm device show it; the host \
         sees it by itself ({:.1}s)",
        new_size,
        start.elapsed().as_secs_f64()
    ));

    let equal = agent
        .expand_volume(agent_api::ExpandVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            size_bytes: new_size - 1,
        })
        .await
        .expect("ExpandVolume to the same size after rounding")
        .into_inner();
    assert_eq!(equal.size_bytes, new_size);
    let shrink = agent
        .expand_volume(agent_api::ExpandVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
            size_bytes: old_size,
        })
        .await
        .expect_err("a shrink must be refused");
    println!("  shrink: {:?} {}", shrink.code(), shrink.message());
    assert_eq!(shrink.code(), Code::OutOfRange);
    assert_eq!(find_lv(S8_VG, vol).unwrap().size, new_size, "LV not shrunk");
    assert_eq!(host_size(&dev.name), new_size);

    let new_tail = pattern(seed + 2, mib);
    write_at(&dev.dev_path, new_size - MIB, &new_tail);
    drop_caches();
    for (what, path) in [("host", dev.dev_path.as_path()), ("LV", lv_path)] {
        assert!(
            same(&read_at(path, 0, head.len()), &head),
            "{what}: first MiB differs"
        );
        assert!(
            same(&read_at(path, old_size - MIB, old_tail.len()), &old_tail),
            "{what}: old last MiB differs"
        );
        assert!(
            same(&read_at(path, new_size - MIB, new_tail.len()), &new_tail),
            "{what}: new last MiB differs"
        );
    }
    sc.step(&format!(
        "{pool}: a request equal after rounding is a no-op; shrink refused (OUT_OF_RANGE); the new \
         last MiB written, all data read back through the host and from the LV"
    ));

    let (thin_total, thin_free_after) = check_lvm_capacity(agent).await;
    if thin {
        // Three 1 MiB writes provision 3 MiB of 64 KiB chunks. LVM rounds data_percent to the
        // nearest 0.01 %, so the pool's reported use may be up to 0.005 % of its size short.
        let used = thin_free_before - thin_free_after;
        assert!(
            used + thin_total / 20_000 >= 3 * MIB,
            "3 MiB written to a thin volume: the thin pool's free space {thin_free_before} -> \
             {thin_free_after}"
        );
        println!(
            "  thin pool: {used} bytes more in use after 3 MiB of writes ({} bytes less than \
             provisioned: LVM's rounding of data_percent)",
            (3 * MIB).saturating_sub(used)
        );
    }

    let k3 = lab.kmsg.mark();
    write_attr(
        &Path::new("/sys/class/nvme")
            .join(&ctrl.name)
            .join("delete_controller"),
        "1",
    )
    .expect("disconnect");
    let start = Instant::now();
    while !host_controllers(vol, &host).is_empty() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(host_controllers(vol, &host).is_empty(), "controller left");
    lab.kmsg.expect(
        k3,
        &[&format!("{}: Removing ctrl: NQN \"{nqn}\"", ctrl.name)],
        Duration::from_secs(10),
    );
    agent
        .unexport(agent_api::UnexportRequest {
            token: life.next(),
            volume_id: vol.into(),
        })
        .await
        .expect("Unexport");
    assert!(
        !Path::new(NVMET)
            .join("subsystems")
            .join(nqn.as_str())
            .exists(),
        "subsystem left after Unexport"
    );

    // The other LVM pool does not own this LV (linear vs thin layout) and leaves it alone.
    let other = if thin { "lin" } else { "thin" };
    let wrong = agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: other.into(),
        })
        .await
        .expect_err("DeleteVolume in the other LVM pool must be refused");
    println!(
        "  DeleteVolume in pool {other}: {:?} {}",
        wrong.code(),
        wrong.message()
    );
    assert_eq!(wrong.code(), Code::FailedPrecondition);
    assert!(
        find_lv(S8_VG, vol).is_some(),
        "LV removed through the wrong pool"
    );

    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: life.next(),
            volume_id: vol.into(),
            pool: pool.into(),
        })
        .await
        .expect("DeleteVolume");
    assert!(find_lv(S8_VG, vol).is_none(), "LV left after DeleteVolume");
    assert!(!lv_path.exists(), "{} left after DeleteVolume", lv.path);
    agent
        .delete_volume(agent_api::DeleteVolumeRequest {
            token: life.again(),
            volume_id: vol.into(),
            pool: pool.into(),
        })
        .await
        .expect("DeleteVolume retried");
    sc.step(&format!(
        "{pool}: disconnected, unexported; DeleteVolume in pool {other} refused \
         (FAILED_PRECONDITION), in {pool} the LV is gone from lvs and /dev; a retry is Ok"
    ));
}

/// Scenario 8 (issue 3 item 6 on a real kernel): the LVM backends on device-mapper. A VG with
/// 8 MiB extents and a thin pool on a loop device; the agent with a linear and a thin pool. For
/// each: CreateVolume rounds to the extent size and tags the LV, Export puts the LV's device in
/// configfs, the host does I/O on it, ExpandVolume grows it online, a shrink is refused, the way
/// back and DeleteVolume remove it; ListVolumes and GetCapacity agree with LVM's own reports.
/// LVs without the `pillar` tag are never listed, grown, exported or removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
#[allow(clippy::too_many_lines)]
async fn s8_lvm_backends() {
    if !in_lane() {
        return;
    }
    let sc = Scenario::start("s8_lvm_backends");
    assert_eq!(
        std::env::var("DM_DISABLE_UDEV").as_deref(),
        Ok("1"),
        "the guest has no udevd: the agent's lvm commands need DM_DISABLE_UDEV=1 \
         (tests/kernel-lane/guest/pillar.sh exports it)"
    );
    let mut lab = Lab::new("s8", false).await;
    let k0 = lab.kmsg.mark();
    // Declared after the lab, so dropped before it: after a failure the VG and its loop device
    // go before the lab's own cleanup (which would otherwise wait for the busy loop device).
    let mut vg = ScratchVg::create(
        &lab.dir.join("pv.img"),
        S8_VG,
        1 << 30,
        S8_THIN_POOL,
        256 * MIB,
    );
    let (extent, _, _) = vgs(S8_VG);
    assert_eq!(extent, S8_EXTENT);
    lvm_ok(&["lvcreate", "-L", "8M", "-n", "foreign-lin", "--yes", S8_VG]);
    lvm_ok(&[
        "lvcreate",
        "-V",
        "16M",
        "--thinpool",
        S8_THIN_POOL,
        "-n",
        "foreign-thin",
        "--addtag",
        "other",
        "--yes",
        S8_VG,
    ]);
    let foreign = |lvs: Vec<Lv>| -> Vec<Lv> {
        let mut v: Vec<Lv> = lvs
            .into_iter()
            .filter(|l| l.name.starts_with("foreign-"))
            .map(|l| Lv {
                data_percent: String::new(),
                ..l
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    };
    let foreign_before = foreign(lvs(S8_VG));
    assert_eq!(foreign_before.len(), 2, "{foreign_before:?}");
    sc.step(&format!(
        "loop device, PV, VG {S8_VG} (8 MiB extents), thin pool {S8_THIN_POOL}; LVs without \
         pillar's tag: foreign-lin (linear), foreign-thin (thin, tag other)"
    ));

    let lin_pool = format!("lin=lvm:{S8_VG}");
    let thin_pool = format!("thin=lvm-thin:{S8_VG}/{S8_THIN_POOL}");
    let mut agent = lab
        .start_agent(&["--pool", &lin_pool, "--pool", &thin_pool])
        .await;
    agent
        .resync_exports(agent_api::ResyncExportsRequest {
            exports: vec![],
            ..Default::default()
        })
        .await
        .expect("resync");
    let caps = agent
        .get_capabilities(agent_api::GetCapabilitiesRequest {})
        .await
        .expect("GetCapabilities")
        .into_inner();
    let kinds: HashMap<String, String> = caps
        .pools
        .iter()
        .map(|p| (p.name.clone(), p.kind.clone()))
        .collect();
    assert_eq!(kinds.get("lin").map(String::as_str), Some("lvm-linear"));
    assert_eq!(kinds.get("thin").map(String::as_str), Some("lvm-thin"));
    assert_eq!(caps.target, "kernel");
    sc.step("agent serving (empty resync) with pools lin (lvm-linear) and thin (lvm-thin)");

    // 40 MiB + 1 byte: 48 MiB in 8 MiB extents (44 MiB if rounded to LVM's default 4 MiB).
    let asked = 40 * MIB + 1;
    let want = 48 * MIB;
    let vols = [("lin", "kl-s8-lin"), ("thin", "kl-s8-thin")];
    let mut lives = [
        Lifecycle::new("0b9d6b1e-kernel-lane-s8-lin"),
        Lifecycle::new("0b9d6b1e-kernel-lane-s8-thin"),
    ];
    for ((pool, vol), life) in vols.iter().zip(lives.iter_mut()) {
        let created = agent
            .create_volume(agent_api::CreateVolumeRequest {
                token: life.next(),
                volume_id: (*vol).into(),
                pool: (*pool).into(),
                size_bytes: asked,
                source: None,
            })
            .await
            .expect("CreateVolume")
            .into_inner();
        assert_eq!(
            created.size_bytes, want,
            "{asked} bytes rounded up to the VG's 8 MiB extents"
        );
        let lv = find_lv(S8_VG, vol).expect("LV created");
        println!("  lvs: {lv:?}");
        assert_eq!(lv.size, want, "lvs size");
        assert_eq!(
            lv.tags,
            vec!["pillar".to_owned()],
            "the LV carries pillar's tag"
        );
        assert_eq!(lv.path, format!("/dev/{S8_VG}/{vol}"));
        assert!(Path::new(&lv.path).exists(), "{} exists", lv.path);
        assert_eq!(lv.attr.chars().nth(4), Some('a'), "LV active: {}", lv.attr);
        assert_eq!(sysfs_dev_size(&lv.devnum), want, "dm device size");
        if *pool == "thin" {
            assert_eq!(lv.pool_lv, S8_THIN_POOL, "a thin volume of the thin pool");
            assert!(lv.attr.starts_with('V'), "thin volume attr {}", lv.attr);
        } else {
            assert_eq!(lv.pool_lv, "", "a linear LV");
            assert!(lv.attr.starts_with('-'), "linear LV attr {}", lv.attr);
        }
        let retry = agent
            .create_volume(agent_api::CreateVolumeRequest {
                token: life.again(),
                volume_id: (*vol).into(),
                pool: (*pool).into(),
                size_bytes: asked,
                source: None,
            })
            .await
            .expect("CreateVolume retried")
            .into_inner();
        assert_eq!(retry.size_bytes, want);
        let other_size = agent
            .create_volume(agent_api::CreateVolumeRequest {
                token: life.next(),
                volume_id: (*vol).into(),
                pool: (*pool).into(),
                size_bytes: 64 * MIB,
                source: None,
            })
            .await
            .expect_err("CreateVolume of an existing volume with another size");
        assert_eq!(other_size.code(), Code::AlreadyExists);
        assert_eq!(find_lv(S8_VG, vol).unwrap().size, want, "not resized");
        sc.step(&format!(
            "{pool}: CreateVolume {asked} bytes -> {want} (VG extent size), LV {} tagged pillar; \
             a retry is the same volume, another size ALREADY_EXISTS",
            lv.path
        ));
    }

    let path = |vol: &str| format!("/dev/{S8_VG}/{vol}");
    let lin_row = (
        "kl-s8-lin".to_owned(),
        "lin".to_owned(),
        want,
        path("kl-s8-lin"),
    );
    let thin_row = (
        "kl-s8-thin".to_owned(),
        "thin".to_owned(),
        want,
        path("kl-s8-thin"),
    );
    assert_eq!(listed(&mut agent, "lin").await, vec![lin_row.clone()]);
    assert_eq!(listed(&mut agent, "thin").await, vec![thin_row.clone()]);
    assert_eq!(listed(&mut agent, "").await, vec![lin_row, thin_row]);
    check_lvm_capacity(&mut agent).await;
    sc.step("ListVolumes: each pool lists its own LV only (not the foreign LVs, not the thin pool); GetCapacity agrees with vgs/lvs");

    for ((pool, vol), life) in vols.iter().zip(lives.iter_mut()) {
        s8_volume(&sc, &mut lab, &mut agent, pool, vol, life).await;
    }

    // LVs without the tag: never created over, grown, exported or removed.
    for (pool, vol) in [("lin", "foreign-lin"), ("thin", "foreign-thin")] {
        let mut life = Lifecycle::new(&format!("0b9d6b1e-kernel-lane-s8-{vol}"));
        let create = agent
            .create_volume(agent_api::CreateVolumeRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: pool.into(),
                size_bytes: 8 * MIB,
                source: None,
            })
            .await
            .expect_err("CreateVolume over a foreign LV");
        println!(
            "  CreateVolume {vol}: {:?} {}",
            create.code(),
            create.message()
        );
        assert_eq!(create.code(), Code::FailedPrecondition);
        assert!(
            create.message().contains("pillar did not create it"),
            "{}",
            create.message()
        );
        let expand = agent
            .expand_volume(agent_api::ExpandVolumeRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: pool.into(),
                size_bytes: 32 * MIB,
            })
            .await
            .expect_err("ExpandVolume of a foreign LV");
        assert_eq!(
            expand.code(),
            Code::FailedPrecondition,
            "{}",
            expand.message()
        );
        let export = agent
            .export(agent_api::ExportRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: pool.into(),
                protocol: Some(agent_api::ExportProtocol {
                    service: u32::from(PORT),
                    acl: false,
                    auth_none: true,
                    tls: false,
                }),
                allowed_host_nqns: vec![],
                credentials: vec![],
            })
            .await
            .expect_err("Export of a foreign LV");
        assert_eq!(export.code(), Code::NotFound, "{}", export.message());
        assert!(nvmet_is_empty(), "a foreign LV was exported");
        let delete = agent
            .delete_volume(agent_api::DeleteVolumeRequest {
                token: life.next(),
                volume_id: vol.into(),
                pool: pool.into(),
            })
            .await
            .expect_err("DeleteVolume of a foreign LV");
        assert_eq!(
            delete.code(),
            Code::FailedPrecondition,
            "{}",
            delete.message()
        );
    }
    assert_eq!(
        foreign(lvs(S8_VG)),
        foreign_before,
        "the foreign LVs are unchanged (size, tags, layout, device)"
    );
    assert!(
        listed(&mut agent, "").await.is_empty(),
        "ListVolumes after the deletes"
    );
    check_lvm_capacity(&mut agent).await;
    assert!(nvmet_is_empty(), "nvmet state left");
    sc.step(
        "foreign LVs: CreateVolume and ExpandVolume FAILED_PRECONDITION (not pillar's), Export \
         NOT_FOUND, DeleteVolume FAILED_PRECONDITION; both LVs unchanged; ListVolumes empty",
    );

    lab.kmsg.expect_absent(k0, IDENTIFIERS_CHANGED);
    lab.agent.as_mut().unwrap().stop();
    vg.teardown()
        .expect("remove the volume group and its loop device");
    assert!(lvm(&["vgs", S8_VG]).is_err(), "volume group {S8_VG} left");
    sc.step("agent stopped; volume group, PV and loop device removed");
}
