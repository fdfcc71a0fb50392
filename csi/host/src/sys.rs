//! The crate's `unsafe` code besides the NVMe passthrough ioctls of `resv.rs`: thin wrappers over
//! mount(2), umount2(2), statvfs(3) and the BLKGETSIZE64 ioctl. Each wrapper turns its arguments into C strings it owns for the duration of
//! the call and returns `io::Error::last_os_error()` on failure.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::HostError;

/// A path (or other string) as a C string; a NUL byte inside is refused.
pub(crate) fn cstring(s: &OsStr) -> Result<CString, HostError> {
    CString::new(s.as_bytes()).map_err(|_| HostError::PathHasNul {
        path: Path::new(s).to_path_buf(),
    })
}

/// mount(2). `source`, `fstype` and `data` may be absent (NULL).
pub(crate) fn mount(
    source: Option<&CString>,
    target: &CString,
    fstype: Option<&CString>,
    flags: libc::c_ulong,
    data: Option<&CString>,
) -> io::Result<()> {
    let ptr = |s: Option<&CString>| s.map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every pointer is either NULL or points into a CString borrowed for the whole call,
    // so it is a valid NUL-terminated string that outlives the syscall. mount(2) accepts NULL for
    // source, fstype and data; `data` is only read as a string by the filesystems we mount
    // (ext4, xfs) or ignored (bind and remount operations).
    let rc = unsafe {
        libc::mount(
            ptr(source),
            target.as_ptr(),
            ptr(fstype),
            flags,
            ptr(data).cast::<libc::c_void>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// umount2(2).
pub(crate) fn umount2(target: &CString, flags: libc::c_int) -> io::Result<()> {
    // SAFETY: `target` is a valid NUL-terminated string that lives across the call; umount2 only
    // reads it.
    let rc = unsafe { libc::umount2(target.as_ptr(), flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// statvfs(3).
pub(crate) fn statvfs(path: &CString) -> io::Result<libc::statvfs> {
    let mut out = MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is a valid NUL-terminated string for the duration of the call and `out`
    // points to writable memory of the size of `struct statvfs`, which statvfs fills on success.
    let rc = unsafe { libc::statvfs(path.as_ptr(), out.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised the whole struct.
    Ok(unsafe { out.assume_init() })
}

/// BLKGETSIZE64 from linux/fs.h: `_IOR(0x12, 114, size_t)`, the device size in bytes as a u64.
const BLKGETSIZE64: libc::Ioctl = libc::_IOR::<u64>(0x12, 114);

/// The size in bytes of the block device open as `file`.
pub(crate) fn blkgetsize64(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: the fd is open for as long as `file` is borrowed, and BLKGETSIZE64 writes exactly
    // one u64 through the pointer, which points to a live, writable, aligned u64.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc == 0 {
        Ok(size)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// mknod(2) for a block device node (test trees only; needs CAP_MKNOD).
#[cfg(any(test, feature = "test-support"))]
pub(crate) fn mknod_block(path: &Path, major: u32, minor: u32) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let dev = libc::makedev(major, minor);
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call; mknod only reads it.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFBLK | 0o600, dev) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64"
    ))]
    fn to_u64<T: TryInto<u64>>(v: T) -> Option<u64> {
        v.try_into().ok()
    }

    #[test]
    fn blkgetsize64_has_the_kernel_value() {
        // The value linux/fs.h yields on the generic ioctl layout (x86_64, aarch64, riscv64).
        #[cfg(any(
            target_arch = "x86_64",
            target_arch = "aarch64",
            target_arch = "riscv64"
        ))]
        assert_eq!(to_u64(BLKGETSIZE64), Some(0x8008_1272));
    }

    #[test]
    fn blkgetsize64_refuses_regular_files() {
        let f = tempfile::tempfile().unwrap();
        let err = blkgetsize64(&f).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOTTY));
    }

    #[test]
    fn nul_in_path_is_refused() {
        assert!(matches!(
            cstring(OsStr::new("a\0b")),
            Err(HostError::PathHasNul { .. })
        ));
    }

    #[test]
    fn statvfs_reads_a_real_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let st = statvfs(&cstring(dir.path().as_os_str()).unwrap()).unwrap();
        assert!(st.f_blocks > 0);
        let missing = dir.path().join("missing");
        let err = statvfs(&cstring(missing.as_os_str()).unwrap()).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }
}
