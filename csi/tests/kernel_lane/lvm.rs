//! LVM helpers for scenario 8: `lvm` by argv, reports, the scratch volume group, fencing
//! lifecycles and the checks of LVM exports and capacity.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pillar_agent_api::v1 as agent_api;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_nvmet::derive_serial;
use tonic::transport::Channel;

use crate::harness::checks::{configfs_identity, token};
use crate::harness::lab::{identity_of, nqn_of};
use crate::harness::machine::{disconnect_all_controllers, names, nvmet_teardown_all, read_attr};
use crate::harness::{MIB, NVMET, PORT};

/// Scenario 8's scratch volume group, on a loop device over a sparse file in guest RAM.
pub(crate) const S8_VG: &str = "pillar-s8";
/// Its thin pool.
pub(crate) const S8_THIN_POOL: &str = "tp";
/// Its extent size: 8 MiB, not LVM's default 4 MiB, so a backend that rounded to the default
/// instead of the VG's extent size would show.
pub(crate) const S8_EXTENT: u64 = 8 * MIB;

/// Runs `lvm ARGS` by argv (as the agent does) without udev: the guest has no udevd, and with
/// `DM_DISABLE_UDEV` libdevmapper and LVM create `/dev/mapper/*` and `/dev/<vg>/<lv>`
/// themselves (without it `lvcreate` fails: "/dev/<vg>/<lv>: not found: device not cleared").
pub(crate) fn lvm(args: &[&str]) -> Result<String, String> {
    let out = Command::new("lvm")
        .args(args)
        .env("LC_ALL", "C")
        .env("DM_DISABLE_UDEV", "1")
        .env("LVM_SUPPRESS_FD_WARNINGS", "1")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("spawn lvm: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "lvm {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

pub(crate) fn lvm_ok(args: &[&str]) -> String {
    let out = lvm(args).unwrap_or_else(|e| panic!("{e}"));
    println!("  lvm {}", args.join(" "));
    out
}

/// One LV as `lvs --reportformat json --units b --nosuffix` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lv {
    pub(crate) name: String,
    pub(crate) path: String,
    pub(crate) size: u64,
    pub(crate) tags: Vec<String>,
    pub(crate) attr: String,
    pub(crate) pool_lv: String,
    pub(crate) data_percent: String,
    /// `major:minor` of its device-mapper device (`-1:-1` when inactive).
    pub(crate) devnum: String,
}

pub(crate) fn report_rows(json: &str, section: &str) -> Vec<serde_json::Value> {
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("lvm JSON report: {e}: {json}"));
    v["report"]
        .as_array()
        .expect("report array")
        .iter()
        .flat_map(|s| s[section].as_array().cloned().unwrap_or_default())
        .collect()
}

pub(crate) fn field(row: &serde_json::Value, name: &str) -> String {
    row[name]
        .as_str()
        .unwrap_or_else(|| panic!("lvm report row without {name}: {row}"))
        .to_owned()
}

/// Every (visible) LV of `vg`.
pub(crate) fn lvs(vg: &str) -> Vec<Lv> {
    let json = lvm(&[
        "lvs",
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "-o",
        "lv_name,lv_path,lv_size,lv_tags,lv_attr,pool_lv,data_percent,lv_kernel_major,lv_kernel_minor",
        vg,
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    report_rows(&json, "lv")
        .iter()
        .map(|r| Lv {
            name: field(r, "lv_name"),
            path: field(r, "lv_path"),
            size: field(r, "lv_size").parse().expect("lv_size in bytes"),
            tags: field(r, "lv_tags")
                .split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
                .collect(),
            attr: field(r, "lv_attr"),
            pool_lv: field(r, "pool_lv"),
            data_percent: field(r, "data_percent"),
            devnum: format!(
                "{}:{}",
                field(r, "lv_kernel_major"),
                field(r, "lv_kernel_minor")
            ),
        })
        .collect()
}

pub(crate) fn find_lv(vg: &str, name: &str) -> Option<Lv> {
    lvs(vg).into_iter().find(|l| l.name == name)
}

/// (extent size, size, free) of `vg`, in bytes.
pub(crate) fn vgs(vg: &str) -> (u64, u64, u64) {
    let json = lvm(&[
        "vgs",
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "-o",
        "vg_name,vg_extent_size,vg_size,vg_free",
        vg,
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    let rows = report_rows(&json, "vg");
    let row = rows
        .iter()
        .find(|r| field(r, "vg_name") == vg)
        .unwrap_or_else(|| panic!("vgs has no {vg}: {json}"));
    let n = |f: &str| field(row, f).parse::<u64>().expect("bytes");
    (n("vg_extent_size"), n("vg_size"), n("vg_free"))
}

/// The most a thin pool of `total` bytes with `data_percent` (e.g. "1.23", rounded by LVM to
/// the nearest 0.01 %) can use: half a unit more, rounded up, capped at the whole.
pub(crate) fn percent_used(total: u64, percent: &str) -> u64 {
    let (int, frac) = percent.split_once('.').unwrap_or((percent, ""));
    let scale = 10u128.pow(u32::try_from(frac.len()).unwrap());
    let frac: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().expect("data_percent")
    };
    let scaled = int.parse::<u128>().expect("data_percent") * scale + frac;
    let used = (u128::from(total) * (2 * scaled + 1)).div_ceil(200 * scale);
    u64::try_from(used.min(u128::from(total))).unwrap()
}

/// `major:minor` of a device node.
pub(crate) fn devnum_of(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let rdev = fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .rdev();
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
    let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
    format!("{major}:{minor}")
}

/// Size in bytes of the block device `major:minor`, from sysfs.
pub(crate) fn sysfs_dev_size(devnum: &str) -> u64 {
    read_attr(&Path::new("/sys/dev/block").join(devnum).join("size"))
        .parse::<u64>()
        .unwrap_or(0)
        * 512
}

pub(crate) fn write_at(dev: &Path, offset: u64, data: &[u8]) {
    let f = OpenOptions::new()
        .write(true)
        .open(dev)
        .unwrap_or_else(|e| panic!("open {}: {e}", dev.display()));
    f.write_all_at(data, offset)
        .unwrap_or_else(|e| panic!("write {} at {offset}: {e}", dev.display()));
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", dev.display()));
}

pub(crate) fn read_at(dev: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = File::open(dev).unwrap_or_else(|e| panic!("open {}: {e}", dev.display()));
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset)
        .unwrap_or_else(|e| panic!("read {} at {offset}: {e}", dev.display()));
    buf
}

/// A volume group with a thin pool on a loop device over a sparse file. Removed (VG, PV, loop
/// device, file) by [`teardown`](Self::teardown), or when dropped after a failure (then the
/// NVMe/TCP controllers and nvmet state go first, so nothing holds an LV open).
pub(crate) struct ScratchVg {
    vg: String,
    file: PathBuf,
    loop_dev: Option<String>,
    done: bool,
}

impl ScratchVg {
    pub(crate) fn create(
        file: &Path,
        vg: &str,
        size: u64,
        thin_pool: &str,
        thin_pool_size: u64,
    ) -> Self {
        if lvm(&["vgs", vg]).is_ok() {
            println!("  a volume group {vg} is left over: removing it");
            let _ = lvm(&["vgremove", "-ff", "-y", vg]);
        }
        File::create(file)
            .and_then(|f| f.set_len(size))
            .unwrap_or_else(|e| panic!("sparse file {}: {e}", file.display()));
        let mut me = Self {
            vg: vg.to_owned(),
            file: file.to_owned(),
            loop_dev: None,
            done: false,
        };
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .expect("run losetup");
        assert!(
            out.status.success(),
            "losetup --find --show {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        println!(
            "  {dev} over {} ({} MiB, sparse)",
            file.display(),
            size / MIB
        );
        me.loop_dev = Some(dev.clone());
        lvm_ok(&["pvcreate", "-y", &dev]);
        lvm_ok(&["vgcreate", "-s", &format!("{}M", S8_EXTENT / MIB), vg, &dev]);
        lvm_ok(&[
            "lvcreate",
            "--type",
            "thin-pool",
            "-L",
            &format!("{}M", thin_pool_size / MIB),
            "-n",
            thin_pool,
            "--yes",
            vg,
        ]);
        me
    }

    /// Removes the VG (all its LVs), the PV label, the loop device and the file.
    pub(crate) fn teardown(&mut self) -> Result<(), String> {
        self.done = true;
        let mut errors = Vec::new();
        if let Err(e) = lvm(&["vgremove", "-ff", "-y", &self.vg]) {
            errors.push(e);
        }
        if let Some(dev) = self.loop_dev.take() {
            if let Err(e) = lvm(&["pvremove", "-y", &dev]) {
                errors.push(e);
            }
            let status = Command::new("losetup").arg("-d").arg(&dev).status();
            if !matches!(&status, Ok(s) if s.success()) {
                errors.push(format!("losetup -d {dev}: {status:?}"));
            }
            let backing = Path::new("/sys/block")
                .join(dev.trim_start_matches("/dev/"))
                .join("loop/backing_file");
            let start = Instant::now();
            while backing.exists() && start.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(100));
            }
            if backing.exists() {
                errors.push(format!("{dev} is still bound to {}", read_attr(&backing)));
            }
        }
        if let Err(e) = fs::remove_file(&self.file) {
            errors.push(format!("rm {}: {e}", self.file.display()));
        }
        println!(
            "  removed volume group {}, its PV, loop device and file: errors {errors:?}",
            self.vg
        );
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

impl Drop for ScratchVg {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        disconnect_all_controllers();
        if let Err(e) = nvmet_teardown_all() {
            println!("  cleanup: nvmet teardown: {e}");
        }
        if let Err(e) = self.teardown() {
            println!("  cleanup: {e}");
        }
    }
}

/// One lifecycle's fencing tokens: every call at the next generation.
pub(crate) struct Lifecycle {
    uid: String,
    generation: u64,
}

impl Lifecycle {
    pub(crate) fn new(uid: &str) -> Self {
        Self {
            uid: uid.to_owned(),
            generation: 0,
        }
    }

    pub(crate) fn next(&mut self) -> Option<agent_api::FencingToken> {
        self.generation += 1;
        token(&self.uid, self.generation)
    }

    /// The last token again: a retry.
    pub(crate) fn again(&self) -> Option<agent_api::FencingToken> {
        token(&self.uid, self.generation)
    }
}

/// The export of an LV in configfs: its device path, the LV's device-mapper device behind it,
/// the derived identity, enabled, any host (no ACL), linked to the port.
pub(crate) fn check_lvm_export(volume: &str, lv: &Lv) {
    let nqn = nqn_of(volume);
    let sub = Path::new(NVMET).join("subsystems").join(nqn.as_str());
    let ns = sub.join("namespaces/1");
    let device_path = read_attr(&ns.join("device_path"));
    assert_eq!(
        device_path, lv.path,
        "configfs device_path is the LV's device"
    );
    assert_eq!(
        devnum_of(Path::new(&device_path)),
        lv.devnum,
        "{device_path} is the LV's device-mapper device"
    );
    let want = identity_of(volume);
    let (uuid, nguid, serial) = configfs_identity(volume);
    assert_eq!(uuid, want.uuid.to_string(), "configfs device_uuid");
    assert_eq!(nguid, want.nguid.to_string(), "configfs device_nguid");
    assert_eq!(
        serial,
        derive_serial(&nqn).to_string(),
        "configfs attr_serial"
    );
    assert_eq!(read_attr(&ns.join("enable")), "1", "namespace enabled");
    assert_eq!(
        read_attr(&sub.join("attr_allow_any_host")),
        "1",
        "acl false: allow_any_host is 1"
    );
    assert!(
        names(&sub.join("allowed_hosts")).is_empty(),
        "no allowed_hosts"
    );
    let port = Path::new(NVMET).join(format!("ports/{PORT}"));
    assert_eq!(read_attr(&port.join("addr_traddr")), "127.0.0.1");
    assert!(
        port.join("subsystems").join(nqn.as_str()).exists(),
        "subsystem not linked to port {PORT}"
    );
    println!(
        "  configfs: {nqn} device_path {device_path} ({} = dm {}), uuid {uuid}, nguid {nguid}, serial {serial}, any host, port {PORT}",
        fs::canonicalize(&device_path).map_or_else(|e| e.to_string(), |p| p.display().to_string()),
        lv.devnum
    );
}

/// GetCapacity of both LVM pools against LVM's own reports: linear is the VG's size and free
/// space, thin the thin pool's data size less what `data_percent` says is used. Returns the thin
/// pool's (total, available) bytes.
pub(crate) async fn check_lvm_capacity(agent: &mut AgentClient<Channel>) -> (u64, u64) {
    let cap = |pool: &str| agent_api::GetCapacityRequest { pool: pool.into() };
    let lin = agent
        .get_capacity(cap("lin"))
        .await
        .expect("GetCapacity lin")
        .into_inner();
    let (_, vg_size, vg_free) = vgs(S8_VG);
    assert_eq!(
        (lin.total_bytes, lin.available_bytes),
        (vg_size, vg_free),
        "lin capacity is the VG's size and free space"
    );
    assert!(lin.available_bytes < lin.total_bytes);
    let thin = agent
        .get_capacity(cap("thin"))
        .await
        .expect("GetCapacity thin")
        .into_inner();
    let tp = find_lv(S8_VG, S8_THIN_POOL).expect("thin pool");
    let used = percent_used(tp.size, &tp.data_percent);
    assert_eq!(
        (thin.total_bytes, thin.available_bytes),
        (tp.size, tp.size - used),
        "thin capacity is the pool's data size less data_percent ({}%)",
        tp.data_percent
    );
    println!(
        "  GetCapacity: lin {} of {} bytes free (vgs), thin {} of {} bytes free (data_percent {}%)",
        lin.available_bytes,
        lin.total_bytes,
        thin.available_bytes,
        thin.total_bytes,
        tp.data_percent
    );
    (thin.total_bytes, thin.available_bytes)
}

/// ListVolumes of `pool` ("" for all) as (volume, pool, size, device path).
pub(crate) async fn listed(
    agent: &mut AgentClient<Channel>,
    pool: &str,
) -> Vec<(String, String, u64, String)> {
    let mut v: Vec<_> = agent
        .list_volumes(agent_api::ListVolumesRequest { pool: pool.into() })
        .await
        .expect("ListVolumes")
        .into_inner()
        .volumes
        .into_iter()
        .map(|v| (v.volume_id, v.pool, v.size_bytes, v.device_path))
        .collect();
    v.sort();
    v
}
