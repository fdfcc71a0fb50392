//! TLS 1.3 for NVMe/TCP: a port's secure channel attributes, the PSK a host and the target
//! share, and the kernel keyring (`.nvme`) both take it from.
//!
//! A port of a kernel built with TLS for the NVMe/TCP target (`CONFIG_NVME_TARGET_TCP_TLS`,
//! Linux >= 6.7) has `addr_tsas` (`none` or `tls1.3`, written after `addr_trtype`, which resets
//! it) and `addr_treq` (`required` refuses a host that does not start TLS). The handshake is
//! done in user space by `tlshd` (ktls-utils) on both ends: the host's kernel hands it the PSK
//! by key serial, the target's kernel hands it the `.nvme` keyring, where it finds the PSK by
//! the identity the host sent. Debian's 6.1 has no `addr_tsas` (docs/rules.md K31).
//!
//! Invariants:
//! - The PSK of a host and a subsystem is derived from the host's DH-HMAC-CHAP secret
//!   (HMAC-SHA-256 keyed with the secret, over a pillar label and both NQNs): whoever may hold
//!   the secret (the node, the agent granting it) can compute it, nobody else, and no second
//!   secret has to be stored or delivered. One PSK per host and subsystem, as the identity the
//!   kernel looks up is (`NVMe0R01 <hostnqn> <subsysnqn>`: retained, SHA-256).
//! - A [`TlsPsk`]'s key never reaches a log, an error or a `Debug` output.
//! - Keys go into the kernel's `.nvme` keyring only, which each call links into the calling
//!   thread's keyring first: the caller then possesses the keys in it (the kernel grants their
//!   search, read and invalidation to a possessor only; a key made by `add_key` gives other
//!   processes of the same user nothing but `view`), without touching any other thread's or
//!   process's keyrings. Per call, because keyrings live in a thread's credentials: a process
//!   keyring made on one thread of a multi-threaded agent is not seen by its other threads.

use std::ffi::CString;
use std::fmt;
use std::io;

use sha2::{Digest, Sha256};

use crate::auth::DhchapSecret;
use crate::names::{HostNqn, SubsystemNqn};

/// The label the PSK derivation starts with, so the key is never the secret's own MAC of
/// anything DH-HMAC-CHAP computes.
const DERIVATION_LABEL: &[u8] = b"pillar-csi.io nvme-tcp tls psk v1";

/// The TLS PSK of one host and one subsystem, with the identity the kernel looks it up by.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsPsk {
    identity: String,
    key: [u8; 32],
}

impl fmt::Debug for TlsPsk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsPsk")
            .field("identity", &self.identity)
            .field("key", &"<redacted>")
            .finish()
    }
}

impl TlsPsk {
    /// The PSK `host` uses with `subsystem`, derived from the host's DH-HMAC-CHAP secret.
    pub fn derive(secret: &DhchapSecret, host: &HostNqn, subsystem: &SubsystemNqn) -> Self {
        let mut msg = Vec::with_capacity(DERIVATION_LABEL.len() + 512);
        msg.extend_from_slice(DERIVATION_LABEL);
        for part in [host.as_str(), subsystem.as_str()] {
            msg.push(0);
            msg.extend_from_slice(part.as_bytes());
        }
        Self {
            identity: psk_identity(host, subsystem),
            key: hmac_sha256(secret.expose().as_bytes(), &msg),
        }
    }

    /// The key in hex, for the configfs double's stand-in keyring only (tests).
    pub fn key_hex(&self) -> String {
        self.key.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The key's description in the keyring: the PSK identity the host presents.
    pub fn identity(&self) -> &str {
        &self.identity
    }
}

/// The identity the kernel's host looks up first for a retained SHA-256 PSK
/// (`nvme_tls_psk_default`), and the target's `tlshd` by the name the host sent.
pub fn psk_identity(host: &HostNqn, subsystem: &SubsystemNqn) -> String {
    format!("NVMe0R01 {host} {subsystem}")
}

/// HMAC-SHA-256 (RFC 2104), over the workspace's SHA-256.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| k.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

/// `KEY_SPEC_THREAD_KEYRING`: the calling thread's keyring (made on first use).
const KEY_SPEC_THREAD_KEYRING: libc::c_long = -1;
const KEYCTL_LINK: libc::c_long = 8;
const KEYCTL_SEARCH: libc::c_long = 10;
const KEYCTL_INVALIDATE: libc::c_long = 21;

/// The kernel's `.nvme` keyring: `None` when the kernel has none (no NVMe keyring module, no
/// TLS).
pub fn nvme_keyring() -> io::Result<Option<i32>> {
    let keys = match std::fs::read_to_string("/proc/keys") {
        Ok(k) => k,
        // A kernel without keys support has no TLS for NVMe either.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(find_keyring(&keys, ".nvme"))
}

/// Links `keyring` into the calling thread's keyring, so that this thread possesses it and the
/// keys in it (linking it again changes nothing).
fn possess(keyring: i32) -> io::Result<()> {
    // SAFETY: KEYCTL_LINK takes two key serials by value; no memory is passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_keyctl,
            KEYCTL_LINK,
            libc::c_long::from(keyring),
            KEY_SPEC_THREAD_KEYRING,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The serial of the keyring named `name` in `/proc/keys` text.
fn find_keyring(proc_keys: &str, name: &str) -> Option<i32> {
    proc_keys.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (serial, kind, desc) = (fields.first()?, fields.get(7)?, fields.get(8)?);
        let desc = desc.strip_suffix(':').unwrap_or(desc);
        (*kind == "keyring" && desc == name)
            .then(|| u32::from_str_radix(serial, 16).ok())
            .flatten()
            .and_then(|s| i32::try_from(s).ok())
    })
}

/// Adds `psk` to `keyring` (or replaces the key of the same identity there) and answers its
/// serial, which a host passes at connect (`tls_key=`).
pub fn add_psk(keyring: i32, psk: &TlsPsk) -> io::Result<i32> {
    possess(keyring)?;
    let kind = c"psk";
    let desc = CString::new(psk.identity.as_str())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: the type and description are NUL-terminated strings and the payload a buffer of
    // the given length, all alive for the call; the kernel copies them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_add_key,
            kind.as_ptr(),
            desc.as_ptr(),
            psk.key.as_ptr(),
            psk.key.len(),
            libc::c_long::from(keyring),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    i32::try_from(rc).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
}

/// Invalidates the PSK of `identity` in `keyring`, if there is one: the key is gone from
/// every keyring at once. Answers whether one was found.
pub fn remove_psk(keyring: i32, identity: &str) -> io::Result<bool> {
    possess(keyring)?;
    let kind = c"psk";
    let desc = CString::new(identity).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: the type and description are NUL-terminated strings alive for the call; no
    // destination keyring (0).
    let found = unsafe {
        libc::syscall(
            libc::SYS_keyctl,
            KEYCTL_SEARCH,
            libc::c_long::from(keyring),
            kind.as_ptr(),
            desc.as_ptr(),
            0 as libc::c_long,
        )
    };
    if found < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOKEY | libc::EKEYREVOKED | libc::EKEYEXPIRED) => Ok(false),
            _ => Err(e),
        };
    }
    // SAFETY: KEYCTL_INVALIDATE takes one key serial by value.
    let rc = unsafe { libc::syscall(libc::SYS_keyctl, KEYCTL_INVALIDATE, found) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2 of RFC 4231.
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block is hashed first.
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn the_psk_is_per_host_and_subsystem_and_follows_the_secret() {
        let secret = DhchapSecret::generate().unwrap();
        let other = DhchapSecret::generate().unwrap();
        let h1 =
            HostNqn::parse("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001")
                .unwrap();
        let h2 =
            HostNqn::parse("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000002")
                .unwrap();
        let s1 = crate::VolumeId::parse("pvc-1").unwrap().subsystem_nqn();
        let s2 = crate::VolumeId::parse("pvc-2").unwrap().subsystem_nqn();
        let a = TlsPsk::derive(&secret, &h1, &s1);
        assert_eq!(a, TlsPsk::derive(&secret, &h1, &s1));
        assert_eq!(a.identity(), format!("NVMe0R01 {h1} {s1}"));
        assert_ne!(a.key, TlsPsk::derive(&secret, &h2, &s1).key);
        assert_ne!(a.key, TlsPsk::derive(&secret, &h1, &s2).key);
        assert_ne!(a.key, TlsPsk::derive(&other, &h1, &s1).key);
        let shown = format!("{a:?}");
        assert!(shown.contains("<redacted>") && !shown.contains(&hex(&a.key)));
    }

    #[test]
    fn the_nvme_keyring_is_found_in_proc_keys() {
        let keys = "\
0a1b2c3d I--Q---     1 perm 3f010000     0     0 user      foo: 3
1e2d3c4b I------     1 perm 1f0f0000     0     0 keyring   .nvme: 2
0000002a I------     1 perm 1f0f0000     0     0 keyring   .nvmex: empty
";
        assert_eq!(find_keyring(keys, ".nvme"), Some(0x1e2d_3c4b));
        assert_eq!(find_keyring(keys, ".nfs"), None);
        assert_eq!(find_keyring("", ".nvme"), None);
    }
}
