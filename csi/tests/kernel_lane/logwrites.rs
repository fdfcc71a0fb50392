//! A file system on the kernel's `dm-log-writes` target (scenario 14) and the crash states its
//! log replays to.
//!
//! Layout, all on the lane's tmpfs: `data.img` (the logged device) and `log.img` (the log),
//! each on a loop device; `mkfs` and the empty state directory are made on the data device
//! before the log-writes target is created, so the image then is the replay's base and the log
//! holds only what happened on the mounted file system afterwards. Each crash state is the base
//! plus the log up to one point (`pillar_durable::logwrites`), written to a fresh sparse file,
//! attached to a fresh loop device and mounted (the mount recovers the journal, as the first
//! mount after a power loss does).
//!
//! Invariants:
//! - Everything set up is torn down on every path: [`LogWrites`] and [`Mounted`] unmount,
//!   remove the dm device and detach their loop devices when dropped (after a failure too).
//! - The log is read only after the dm device was removed: its super block counts the entries
//!   only once the target logged its closing mark.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use pillar_durable::logwrites::{Log, Replay};

/// The logged device's size: room for the state directory and ext4's journal.
const DATA_MIB: u64 = 32;
/// The log's size: the writes of a scenario are well under this (the target stops logging,
/// and says so in its status, when the log is full).
const LOG_MIB: u64 = 256;

/// The file system the state directory lives on.
pub(crate) const FS_TYPE: &str = "ext4";

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn sparse_file(path: &Path, bytes: u64) {
    let file = fs::File::create(path).unwrap();
    file.set_len(bytes).unwrap();
}

fn attach(path: &Path) -> String {
    run("losetup", &["-f", "--show", &path.display().to_string()])
}

fn detach(dev: &str) {
    let status = Command::new("losetup").args(["-d", dev]).status();
    if !matches!(status, Ok(s) if s.success()) {
        println!("  cleanup: losetup -d {dev}: {status:?}");
    }
}

/// Unmounts `point`, retrying for up to five seconds while it is busy: right after the agent
/// exits, the kernel may still hold files of the mount for it (an io_uring's teardown runs
/// after the process is gone, in a kernel worker). Lazily, with a line saying so, only then.
fn unmount(point: &Path) {
    if pillar_host::find_mount(point).ok().flatten().is_none() {
        return;
    }
    let mut status = Command::new("umount").arg(point).status();
    for _ in 0..50 {
        if matches!(status, Ok(s) if s.success()) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        status = Command::new("umount").arg(point).status();
    }
    if !matches!(status, Ok(s) if s.success()) {
        println!("  cleanup: umount {}: {status:?}", point.display());
        let _ = Command::new("umount").arg("-l").arg(point).status();
    }
}

/// The state directory on a mounted file system on a `dm-log-writes` device.
pub(crate) struct LogWrites {
    name: String,
    dir: PathBuf,
    data_loop: Option<String>,
    log_loop: Option<String>,
    dm: bool,
    pub(crate) mount: PathBuf,
}

impl LogWrites {
    /// Makes the file system (with an empty `state` directory) on a fresh data device, takes
    /// its image as the base, then mounts it through a new log-writes target named `name`.
    pub(crate) fn create(dir: &Path, name: &str) -> (Self, Vec<u8>) {
        fs::create_dir_all(dir).unwrap();
        let (data, log) = (dir.join("data.img"), dir.join("log.img"));
        sparse_file(&data, DATA_MIB << 20);
        sparse_file(&log, LOG_MIB << 20);
        let mut me = Self {
            name: name.to_owned(),
            dir: dir.to_owned(),
            data_loop: None,
            log_loop: None,
            dm: false,
            mount: dir.join("mnt"),
        };
        fs::create_dir_all(&me.mount).unwrap();
        let data_loop = attach(&data);
        me.data_loop = Some(data_loop.clone());
        mkfs(&data_loop);
        run(
            "mount",
            &["-t", FS_TYPE, &data_loop, &me.mount.display().to_string()],
        );
        fs::create_dir(me.mount.join("state")).unwrap();
        run("umount", &[&me.mount.display().to_string()]);
        // The loop device wrote through to the file; detach and re-attach so nothing cached
        // in the loop device differs from the base read here.
        detach(&data_loop);
        let base = fs::read(&data).unwrap();
        let data_loop = attach(&data);
        me.data_loop = Some(data_loop.clone());
        me.log_loop = Some(attach(&log));
        let sectors = (DATA_MIB << 20) / 512;
        let table = format!(
            "0 {sectors} log-writes {data_loop} {}",
            me.log_loop.as_deref().unwrap_or_default()
        );
        run("dmsetup", &["create", name, "--table", &table]);
        me.dm = true;
        run(
            "mount",
            &["-t", FS_TYPE, &me.device(), &me.mount.display().to_string()],
        );
        println!(
            "  {name}: {FS_TYPE} on log-writes({data_loop}, log on {}); base image {} MiB",
            me.log_loop.as_deref().unwrap_or_default(),
            base.len() >> 20
        );
        (me, base)
    }

    fn device(&self) -> String {
        format!("/dev/mapper/{}", self.name)
    }

    /// The agent's state directory on the logged file system.
    pub(crate) fn state(&self) -> PathBuf {
        self.mount.join("state")
    }

    /// Logs a mark: the log entries before it hold at least what the disk held now.
    pub(crate) fn mark(&self, text: &str) {
        run("dmsetup", &["message", &self.name, "0", "mark", text]);
    }

    /// Unmounts, removes the target (which logs its closing mark and the super block's final
    /// count) and reads the log.
    pub(crate) fn finish(&mut self) -> Log {
        unmount(&self.mount);
        let status = run("dmsetup", &["status", &self.name]);
        assert!(
            !status.contains("logging_disabled"),
            "the log-writes target stopped logging (log full or an I/O error): {status}"
        );
        run("dmsetup", &["remove", &self.name]);
        self.dm = false;
        for dev in [self.data_loop.take(), self.log_loop.take()]
            .into_iter()
            .flatten()
        {
            detach(&dev);
        }
        let log = Log::read(&self.dir.join("log.img")).expect("the dm-log-writes log parses");
        let _ = fs::remove_file(self.dir.join("log.img"));
        let _ = fs::remove_file(self.dir.join("data.img"));
        log
    }
}

impl Drop for LogWrites {
    fn drop(&mut self) {
        unmount(&self.mount);
        if self.dm {
            let status = Command::new("dmsetup")
                .args(["remove", &self.name])
                .status();
            println!("  cleanup: dmsetup remove {}: {status:?}", self.name);
        }
        for dev in [self.data_loop.take(), self.log_loop.take()]
            .into_iter()
            .flatten()
        {
            detach(&dev);
        }
    }
}

fn mkfs(dev: &str) {
    // Everything initialised now (no lazy init thread writing later), nothing discarded; 4 KiB
    // blocks as on a node's disk (mke2fs would pick 1 KiB for so small a file system).
    run(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-b",
            "4096",
            "-E",
            "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
            dev,
        ],
    );
}

/// One crash state, mounted: the replay's image on a fresh loop device.
pub(crate) struct Mounted {
    image: PathBuf,
    dev: Option<String>,
    pub(crate) mount: PathBuf,
}

impl Mounted {
    /// Writes the replay's image to `dir/state.img` and mounts it on `dir/mnt`; the mount's
    /// error (a state the file system cannot mount) otherwise.
    pub(crate) fn mount(replay: &Replay, dir: &Path) -> Result<Self, String> {
        fs::create_dir_all(dir.join("mnt")).unwrap();
        let image = dir.join("state.img");
        let _ = fs::remove_file(&image);
        replay
            .write_image(&image)
            .expect("write the replayed image");
        let dev = attach(&image);
        let me = Self {
            image,
            dev: Some(dev.clone()),
            mount: dir.join("mnt"),
        };
        let out = Command::new("mount")
            .args(["-t", FS_TYPE, &dev, &me.mount.display().to_string()])
            .output()
            .unwrap();
        if out.status.success() {
            Ok(me)
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
        }
    }

    pub(crate) fn state(&self) -> PathBuf {
        self.mount.join("state")
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        unmount(&self.mount);
        if let Some(dev) = self.dev.take() {
            detach(&dev);
        }
        let _ = fs::remove_file(&self.image);
    }
}
