//! Loop devices through the kernel's own interface: `/dev/loop-control`, the `LOOP_*` ioctls of
//! `include/uapi/linux/loop.h` and the `/sys/block/loopN` attributes. No `losetup`.
//!
//! With [`copy`](super::copy), the only module of the backend with `unsafe` code: four ioctl calls, each on a file
//! descriptor this module opened and still owns, each with an argument whose layout is checked
//! against the kernel's at compile time.
//!
//! What the kernel does that callers must know (checked on Linux 6.18):
//! - `LOOP_CTL_GET_FREE` only *names* a free device; another process may bind it before us, and
//!   `LOOP_CONFIGURE` then fails with `EBUSY`. [`attach`] retries with a fresh index.
//! - `LOOP_CLR_FD` never detaches while the device is open: it sets `LO_FLAGS_AUTOCLEAR` and
//!   the kernel detaches at the last close, which for the ioctl's own caller is right after
//!   the call (synchronously, in that `close`). [`detach`] therefore waits (briefly) until the
//!   device no longer holds the same file, and says so when someone else still holds it open.
//! - With `block_size: 0` the kernel picks the logical block size: 512 bytes for buffered I/O,
//!   the backing file's direct-I/O alignment with `LO_FLAGS_DIRECT_IO`. xfs reports 4096 for a
//!   file with shared extents (a reflink copy, and its source from the first copy on) and 512
//!   for any other, so the same volume came back with other sectors after a restore or a
//!   re-bind. [`attach`] therefore always asks for [`LOGICAL_BLOCK_SIZE`], and checks sysfs
//!   `queue/logical_block_size` after binding. Asked for 512 bytes with direct I/O on such a
//!   file, 6.18 binds buffered (silently; older kernels may answer `EINVAL`).
//! - A freed index is handed out again at once: "loopN is unbound" is not a test of "our
//!   detach finished" when other processes bind loop devices.
//! - `/sys/block/loopN/loop/backing_file` shows the path as the kernel resolved it at bind time,
//!   with ` (deleted)` appended once the file is unlinked. A path match is confirmed with the
//!   device and inode numbers from `LOOP_GET_STATUS64` before a device is trusted.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

/// The loop control device.
pub const LOOP_CONTROL: &str = "/dev/loop-control";

const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// `LO_FLAGS_AUTOCLEAR`: detach at last close. pillar never sets it (exports must outlive the
/// agent); the kernel sets it itself for a deferred `LOOP_CLR_FD`.
#[cfg(any(test, feature = "test-seams"))]
pub const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// `LO_FLAGS_DIRECT_IO`: the loop device reads and writes its backing file with `O_DIRECT`,
/// so data is not cached twice (once for the loop device, once for the file).
pub const LO_FLAGS_DIRECT_IO: u32 = 16;

const LOOP_CLR_FD: libc::Ioctl = 0x4C01;
const LOOP_GET_STATUS64: libc::Ioctl = 0x4C05;
const LOOP_SET_CAPACITY: libc::Ioctl = 0x4C07;
const LOOP_CONFIGURE: libc::Ioctl = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::Ioctl = 0x4C82;

/// The logical block size of every loop device [`attach`] binds. Part of a volume's identity:
/// the nvmet namespace exports it as its LBA size, and a file system records the sector size
/// it was made with. 512 is what every device bound without direct I/O has always had, and a
/// file system made with larger sectors works on it.
pub const LOGICAL_BLOCK_SIZE: u32 = 512;

/// How many free indices [`attach`] tries before giving up on `EBUSY` races.
const ATTACH_ATTEMPTS: usize = 16;

/// `struct loop_info64` of `include/uapi/linux/loop.h`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config` of `include/uapi/linux/loop.h` (Linux 5.8+).
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

// The kernel copies exactly these many bytes; a layout mistake must not compile.
const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);
const _: () = assert!(std::mem::offset_of!(LoopInfo64, lo_flags) == 52);
const _: () = assert!(std::mem::offset_of!(LoopInfo64, lo_file_name) == 56);
const _: () = assert!(std::mem::offset_of!(LoopConfig, info) == 8);

impl LoopInfo64 {
    const fn zeroed() -> Self {
        Self {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; LO_KEY_SIZE],
            lo_init: [0; 2],
        }
    }
}

/// A loop operation that failed: which step, and the kernel's answer.
#[derive(Debug, thiserror::Error)]
#[error("{step} failed")]
pub struct LoopError {
    pub step: &'static str,
    #[source]
    pub source: io::Error,
}

fn step(step: &'static str) -> impl FnOnce(io::Error) -> LoopError {
    move |source| LoopError { step, source }
}

/// A loop device bound by [`attach`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    /// N of `/dev/loopN`.
    pub index: u32,
    /// Whether the device does direct I/O (sysfs `loop/dio` right after binding).
    pub direct_io: bool,
}

/// A bound loop device as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// N of `/dev/loopN`.
    pub index: u32,
    /// The backing file's path, without the kernel's ` (deleted)` suffix.
    pub backing_file: PathBuf,
    /// Whether the kernel marked the backing file as unlinked.
    pub deleted: bool,
}

/// The device node of loop device `index`.
pub fn device_path(index: u32) -> PathBuf {
    PathBuf::from(format!("/dev/loop{index}"))
}

fn sysfs_dir(index: u32) -> PathBuf {
    PathBuf::from(format!("/sys/block/loop{index}"))
}

fn open_rw(path: &Path, extra_flags: libc::c_int) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | extra_flags)
        .open(path)
}

/// Checks that `/dev/loop-control` can be opened read-write (the loop driver is there and
/// this process may use it).
pub fn check_control() -> Result<(), LoopError> {
    open_rw(Path::new(LOOP_CONTROL), 0)
        .map(drop)
        .map_err(step("open /dev/loop-control"))
}

/// Binds a free loop device to `backing` (an open read-write file; the kernel takes its own
/// reference, so the caller may close it afterwards). `name` is recorded in `lo_file_name`
/// (truncated to 63 bytes; informational only).
///
/// Whether `path` can be read with `O_DIRECT`: an aligned 4 KiB read at offset 0 succeeds.
/// A loop device bound with direct I/O over a file that cannot do it fails every I/O.
pub fn supports_direct_io(path: &Path) -> bool {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    const ALIGN: usize = 4096;
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    else {
        return false;
    };
    let mut buf = vec![0u8; 2 * ALIGN];
    let start = buf.as_ptr().align_offset(ALIGN);
    let Some(aligned) = buf.get_mut(start..start + ALIGN) else {
        return false;
    };
    file.read_at(aligned, 0).is_ok()
}

/// Binds with a logical block size of [`LOGICAL_BLOCK_SIZE`], whatever the backing file, and
/// confirms it in sysfs (a device with any other size is unbound again and the call fails).
/// Asks for direct I/O when `want_direct_io` is set and binds without it (at the same block
/// size) if the kernel refuses the flag with `EINVAL`. Never sets `LO_FLAGS_AUTOCLEAR`.
/// Retries with a fresh index when another process binds the offered device first (`EBUSY`).
pub fn attach(backing: &File, name: &Path, want_direct_io: bool) -> Result<Attached, LoopError> {
    let control = open_rw(Path::new(LOOP_CONTROL), 0).map_err(step("open /dev/loop-control"))?;
    let backing_fd = u32::try_from(backing.as_raw_fd()).map_err(|_| LoopError {
        step: "pass the backing file descriptor",
        source: io::Error::from_raw_os_error(libc::EBADF),
    })?;
    let mut info = LoopInfo64::zeroed();
    let name = name.as_os_str().as_bytes();
    let len = name.len().min(LO_NAME_SIZE - 1);
    info.lo_file_name[..len].copy_from_slice(&name[..len]);

    let mut last_busy = None;
    for _ in 0..ATTACH_ATTEMPTS {
        let index = get_free(&control)?;
        let device = open_rw(&device_path(index), 0).map_err(step("open the free loop device"))?;
        let mut flags = if want_direct_io {
            LO_FLAGS_DIRECT_IO
        } else {
            0
        };
        loop {
            info.lo_flags = flags;
            let config = LoopConfig {
                fd: backing_fd,
                // Never 0 (the kernel's choice, which follows direct I/O and the backing file).
                block_size: LOGICAL_BLOCK_SIZE,
                info,
                reserved: [0; 8],
            };
            match configure(&device, &config) {
                Ok(()) => {
                    drop(device);
                    confirm_block_size(index)?;
                    // What sysfs reports, not what was asked: a kernel may also fall back to
                    // buffered I/O silently.
                    return Ok(Attached {
                        index,
                        direct_io: direct_io(index),
                    });
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && flags != 0 => {
                    tracing::info!(
                        device = %device_path(index).display(),
                        "kernel refused direct I/O for this backing file; binding buffered"
                    );
                    flags = 0;
                }
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    tracing::debug!(index, "loop device taken between GET_FREE and CONFIGURE");
                    last_busy = Some(e);
                    break;
                }
                Err(e) => return Err(step("LOOP_CONFIGURE")(e)),
            }
        }
    }
    Err(LoopError {
        step: "LOOP_CONFIGURE (every free device was taken by someone else)",
        source: last_busy.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EBUSY)),
    })
}

/// Fails (after unbinding the device again, so that nothing finds and exports it) unless
/// loop device `index`, just bound, has a logical block size of [`LOGICAL_BLOCK_SIZE`].
fn confirm_block_size(index: u32) -> Result<(), LoopError> {
    let wrong = match logical_block_size(index) {
        Ok(LOGICAL_BLOCK_SIZE) => return Ok(()),
        Ok(size) => LoopError {
            step: "check the logical block size of the bound loop device",
            source: io::Error::other(format!(
                "the kernel bound /dev/loop{index} with {size}-byte sectors, not \
                 {LOGICAL_BLOCK_SIZE}: refusing a device whose LBA size differs from the volume's"
            )),
        },
        Err(e) => e,
    };
    match detach(index, Duration::from_secs(2)) {
        Ok(Detach::Done | Detach::NotBound) => {}
        Ok(outcome) => {
            tracing::warn!(
                index,
                ?outcome,
                "could not unbind a loop device with the wrong block size"
            );
        }
        Err(e) => {
            tracing::warn!(index, error = %e, "could not unbind a loop device with the wrong block size");
        }
    }
    Err(wrong)
}

/// The logical block size of loop device `index` (sysfs `queue/logical_block_size`).
pub fn logical_block_size(index: u32) -> Result<u32, LoopError> {
    let text = fs::read_to_string(sysfs_dir(index).join("queue/logical_block_size"))
        .map_err(step("read /sys/block/loopN/queue/logical_block_size"))?;
    text.trim().parse().map_err(|_| LoopError {
        step: "parse /sys/block/loopN/queue/logical_block_size",
        source: io::Error::new(io::ErrorKind::InvalidData, text.trim().to_owned()),
    })
}

fn get_free(control: &File) -> Result<u32, LoopError> {
    // SAFETY: `control` is an open descriptor of /dev/loop-control owned by this function's
    // caller for the whole call; LOOP_CTL_GET_FREE takes no argument (the 0 is ignored) and
    // touches no memory of this process.
    let ret = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE, 0 as libc::c_ulong) };
    if ret < 0 {
        return Err(step("LOOP_CTL_GET_FREE")(io::Error::last_os_error()));
    }
    u32::try_from(ret).map_err(|_| LoopError {
        step: "LOOP_CTL_GET_FREE",
        source: io::Error::other(format!("kernel returned index {ret}")),
    })
}

fn configure(device: &File, config: &LoopConfig) -> io::Result<()> {
    // SAFETY: `device` is an open loop block device owned by the caller for the whole call.
    // LOOP_CONFIGURE reads exactly size_of::<LoopConfig>() bytes from the pointer, which points
    // to a live, initialised, #[repr(C)] struct whose size and field offsets are asserted
    // against the kernel's `struct loop_config` above; the kernel does not keep the pointer.
    let ret = unsafe {
        libc::ioctl(
            device.as_raw_fd(),
            LOOP_CONFIGURE,
            std::ptr::from_ref::<LoopConfig>(config),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Tells the kernel to re-read the backing file's size (after it grew).
pub fn set_capacity(index: u32) -> Result<(), LoopError> {
    let device = open_rw(&device_path(index), 0).map_err(step("open the loop device"))?;
    // SAFETY: `device` is an open loop block device owned by this function; LOOP_SET_CAPACITY
    // takes no argument (the 0 is ignored) and touches no memory of this process.
    let ret = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_SET_CAPACITY, 0 as libc::c_ulong) };
    if ret < 0 {
        return Err(step("LOOP_SET_CAPACITY")(io::Error::last_os_error()));
    }
    Ok(())
}

/// The `(st_dev, st_ino)` of the file loop device `index` is bound to, as `stat(2)` reports
/// them. `ENXIO` means the device is not bound.
pub fn backing_identity(index: u32) -> Result<(u64, u64), LoopError> {
    let device = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(device_path(index))
        .map_err(step("open the loop device"))?;
    let info = status(&device).map_err(step("LOOP_GET_STATUS64"))?;
    Ok((info.lo_device, info.lo_inode))
}

fn status(device: &File) -> io::Result<LoopInfo64> {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: `device` is an open loop block device borrowed for the whole call.
    // LOOP_GET_STATUS64 writes exactly size_of::<LoopInfo64>() bytes through the pointer, which
    // points to a live, exclusively borrowed #[repr(C)] struct whose layout is asserted against
    // the kernel's `struct loop_info64` above; every bit pattern is valid for its integer
    // fields.
    let ret = unsafe {
        libc::ioctl(
            device.as_raw_fd(),
            LOOP_GET_STATUS64,
            std::ptr::from_mut::<LoopInfo64>(&mut info),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(info)
}

/// What [`detach`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detach {
    /// The device is unbound.
    Done,
    /// The device was not bound in the first place.
    NotBound,
    /// Someone else holds the device open: the kernel will detach it at their last close
    /// (it set `LO_FLAGS_AUTOCLEAR`), but it is still bound now.
    Deferred,
    /// Someone holds the device exclusively (a mounted file system, device-mapper...):
    /// nothing was changed.
    Busy,
}

/// Unbinds loop device `index`, waiting up to `wait` in all for exclusive holders to let go
/// and for the kernel to finish.
///
/// Completion is judged by the backing file's identity, not by the index being free: another
/// process may bind the freed index at once.
pub fn detach(index: u32, wait: Duration) -> Result<Detach, LoopError> {
    let deadline = Instant::now() + wait;
    // O_EXCL on a block device fails with EBUSY while anyone holds it exclusively; then a
    // LOOP_CLR_FD would only arm a deferred detach under a mounted file system. Short
    // exclusive holds happen (a process forked while some thread had the device open keeps
    // that descriptor until it execs), so EBUSY is retried until the deadline.
    let device = loop {
        match open_rw(&device_path(index), libc::O_EXCL) {
            Ok(device) => break device,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                if Instant::now() >= deadline {
                    return Ok(Detach::Busy);
                }
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Detach::NotBound),
            Err(e) => return Err(step("open the loop device")(e)),
        }
    };
    let bound_to = match status(&device) {
        Ok(info) => (info.lo_device, info.lo_inode),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Ok(Detach::NotBound),
        Err(e) => return Err(step("LOOP_GET_STATUS64")(e)),
    };
    // SAFETY: `device` is an open loop block device owned by this function; LOOP_CLR_FD takes
    // no argument (the 0 is ignored) and touches no memory of this process.
    let ret = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CLR_FD, 0 as libc::c_ulong) };
    if ret < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(Detach::NotBound);
        }
        return Err(step("LOOP_CLR_FD")(e));
    }
    // The kernel detaches at the last close; ours is this one unless someone else has the
    // device open.
    drop(device);
    loop {
        match backing_identity(index) {
            Ok(identity) if identity == bound_to => {}
            // Unbound, or already bound again to another file.
            Ok(_) => return Ok(Detach::Done),
            Err(e) if matches!(e.source.raw_os_error(), Some(libc::ENXIO | libc::ENOENT)) => {
                return Ok(Detach::Done);
            }
            Err(e) => return Err(e),
        }
        if Instant::now() >= deadline {
            return Ok(Detach::Deferred);
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Whether loop device `index` is bound to a file (its sysfs `loop/` directory exists).
#[cfg(any(test, feature = "test-seams"))]
pub fn is_bound(index: u32) -> bool {
    sysfs_dir(index).join("loop").exists()
}

/// The size of block device `loopN` in bytes, from sysfs.
pub fn size_bytes(index: u32) -> Result<u64, LoopError> {
    let path = sysfs_dir(index).join("size");
    let text = fs::read_to_string(&path).map_err(step("read /sys/block/loopN/size"))?;
    let sectors: u64 = text.trim().parse().map_err(|_| LoopError {
        step: "parse /sys/block/loopN/size",
        source: io::Error::new(io::ErrorKind::InvalidData, text.trim().to_owned()),
    })?;
    sectors.checked_mul(512).ok_or_else(|| LoopError {
        step: "parse /sys/block/loopN/size",
        source: io::Error::new(io::ErrorKind::InvalidData, "size overflows u64"),
    })
}

/// Whether loop device `index` does direct I/O to its backing file (sysfs `loop/dio`).
pub fn direct_io(index: u32) -> bool {
    fs::read_to_string(sysfs_dir(index).join("loop/dio")).is_ok_and(|s| s.trim() == "1")
}

/// Every bound loop device with its backing file, from `/sys/block/loop*/loop/backing_file`.
/// Devices that unbind while being read are skipped.
pub fn bindings() -> Result<Vec<Binding>, LoopError> {
    let mut found = Vec::new();
    let entries = fs::read_dir("/sys/block").map_err(step("list /sys/block"))?;
    for entry in entries {
        let entry = entry.map_err(step("list /sys/block"))?;
        let name = entry.file_name();
        let Some(index) = name
            .to_str()
            .and_then(|n| n.strip_prefix("loop"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let raw = match fs::read(entry.path().join("loop/backing_file")) {
            Ok(raw) => raw,
            // Unbound devices have no loop/ directory. A device unbinding while we read
            // answers ENODEV (seen on 6.18 with tests detaching in parallel) or ENXIO.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT | libc::ENXIO | libc::ENODEV)
                ) =>
            {
                continue;
            }
            Err(e) => return Err(step("read /sys/block/loopN/loop/backing_file")(e)),
        };
        let mut raw = raw.as_slice();
        if let Some(stripped) = raw.strip_suffix(b"\n") {
            raw = stripped;
        }
        let (raw, deleted) = match raw.strip_suffix(b" (deleted)") {
            Some(stripped) => (stripped, true),
            None => (raw, false),
        };
        if raw.is_empty() {
            continue;
        }
        found.push(Binding {
            index,
            backing_file: PathBuf::from(OsStr::from_bytes(raw)),
            deleted,
        });
    }
    found.sort_by_key(|b| b.index);
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_uapi_header() {
        // include/uapi/linux/loop.h: 'L' << 8 | nr, no _IOC direction or size bits.
        assert_eq!(LOOP_CLR_FD, 0x4C01);
        assert_eq!(LOOP_GET_STATUS64, 0x4C05);
        assert_eq!(LOOP_SET_CAPACITY, 0x4C07);
        assert_eq!(LOOP_CONFIGURE, 0x4C0A);
        assert_eq!(LOOP_CTL_GET_FREE, 0x4C82);
    }

    #[test]
    fn device_paths() {
        assert_eq!(device_path(7), PathBuf::from("/dev/loop7"));
    }
}
