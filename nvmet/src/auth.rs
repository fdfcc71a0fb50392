//! NVMe in-band authentication (DH-HMAC-CHAP) on the target's host entries.
//!
//! A host entry `hosts/<hostnqn>` of a kernel built with `CONFIG_NVME_TARGET_AUTH` has four
//! attributes: `dhchap_key` (the secret the host proves), `dhchap_ctrl_key` (the secret the
//! target proves back: bidirectional authentication), `dhchap_hash` and `dhchap_dhgroup`. A host
//! entry whose `dhchap_key` is set admits that host only after it authenticated; an entry
//! without one admits it on its NQN alone. A kernel without authentication has none of the four
//! (docs/rules.md K29, K30).
//!
//! Invariants:
//! - A [`DhchapSecret`] is always well formed, in the representation the kernel and nvme-cli
//!   use: `DHHC-1:<hh>:<base64 of key + CRC-32 of key, little endian>:` with `hh` 00 (the key is
//!   used as is) or 01/02/03 (transformed with SHA-256/384/512, the key then being 32/48/64
//!   bytes), and a key of 32, 48 or 64 bytes (`nvme_auth_extract_key`).
//! - A secret never reaches a log, an error message or a `Debug` output: both print
//!   `<redacted>`; [`crate::Op`]'s `Display` and `Debug` redact writes to the key attributes.
//! - The keys are written before the host entry is linked into any `allowed_hosts` (the plan's
//!   order), so no window admits the host on its NQN alone.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::model::{HOSTS, ObserveError, read_attr};
use crate::names::HostNqn;
use crate::plan::Op;

pub use crate::model::{DHCHAP_CTRL_KEY, DHCHAP_DHGROUP, DHCHAP_HASH, DHCHAP_KEY};

/// Why a secret or an authentication setting was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("a DH-HMAC-CHAP secret must start with \"DHHC-1:\"")]
    Prefix,
    #[error("a DH-HMAC-CHAP secret's transform must be 00, 01, 02 or 03")]
    Transform,
    #[error("a DH-HMAC-CHAP secret's key is not base64")]
    Base64,
    #[error("a DH-HMAC-CHAP secret's key must be 32, 48 or 64 bytes, found {0}")]
    KeyLength(usize),
    #[error(
        "a DH-HMAC-CHAP secret's transform {transform:02} needs a {wanted}-byte key, found {found}"
    )]
    TransformLength {
        transform: u8,
        wanted: usize,
        found: usize,
    },
    #[error("a DH-HMAC-CHAP secret's CRC-32 does not match its key")]
    Crc,
    #[error("unknown DH-HMAC-CHAP hash {0:?} (hmac(sha256), hmac(sha384), hmac(sha512))")]
    Hash(String),
    #[error("unknown DH group {0:?} (null, ffdhe2048, ffdhe3072, ffdhe4096, ffdhe6144, ffdhe8192)")]
    DhGroup(String),
    #[error("cannot read random bytes for a secret: {0}")]
    Random(String),
}

/// A well-formed DH-HMAC-CHAP secret (see the module invariants). Its text leaves only through
/// [`DhchapSecret::expose`], to the kernel or a store.
#[derive(Clone, PartialEq, Eq)]
pub struct DhchapSecret(String);

impl fmt::Debug for DhchapSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DhchapSecret(<redacted>)")
    }
}

impl fmt::Display for DhchapSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl DhchapSecret {
    /// Parses and checks a secret as the kernel's `nvme_auth_extract_key` does (trailing
    /// newline and the final `:` optional).
    pub fn parse(text: &str) -> Result<Self, AuthError> {
        let text = text.strip_suffix('\n').unwrap_or(text);
        let rest = text.strip_prefix("DHHC-1:").ok_or(AuthError::Prefix)?;
        let (hh, b64) = rest.split_at_checked(2).ok_or(AuthError::Transform)?;
        let transform = match hh {
            "00" => 0,
            "01" => 1,
            "02" => 2,
            "03" => 3,
            _ => return Err(AuthError::Transform),
        };
        let b64 = b64.strip_prefix(':').ok_or(AuthError::Transform)?;
        let b64 = b64.strip_suffix(':').unwrap_or(b64);
        let raw = base64_decode(b64).ok_or(AuthError::Base64)?;
        let key_len = raw.len().checked_sub(4).ok_or(AuthError::KeyLength(0))?;
        if ![32, 48, 64].contains(&key_len) {
            return Err(AuthError::KeyLength(key_len));
        }
        if transform != 0 {
            let wanted = 16 + 16 * usize::from(transform);
            if key_len != wanted {
                return Err(AuthError::TransformLength {
                    transform,
                    wanted,
                    found: key_len,
                });
            }
        }
        let (key, crc) = raw.split_at(key_len);
        if crc32(key).to_le_bytes() != crc {
            return Err(AuthError::Crc);
        }
        Ok(Self(format!("DHHC-1:{hh}:{b64}:")))
    }

    /// A new random 32-byte secret, used as is (transform 00), from the kernel's CSPRNG.
    pub fn generate() -> Result<Self, AuthError> {
        let mut key = [0u8; 32];
        let mut filled = 0;
        while filled < key.len() {
            filled +=
                rustix::rand::getrandom(&mut key[filled..], rustix::rand::GetRandomFlags::empty())
                    .map_err(|e| AuthError::Random(e.to_string()))?;
        }
        Ok(Self::from_key(&key))
    }

    /// The secret of `key` (32, 48 or 64 bytes), transform 00.
    fn from_key(key: &[u8]) -> Self {
        let mut raw = key.to_vec();
        raw.extend_from_slice(&crc32(key).to_le_bytes());
        Self(format!("DHHC-1:00:{}:", base64_encode(&raw)))
    }

    /// The secret's text, for the kernel (configfs, the fabrics connect options) and the
    /// secret stores only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// The HMAC of DH-HMAC-CHAP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DhchapHash {
    #[default]
    Sha256,
    Sha384,
    Sha512,
}

impl DhchapHash {
    /// The name the kernel reads and shows in `dhchap_hash`.
    pub fn kernel_name(self) -> &'static str {
        match self {
            Self::Sha256 => "hmac(sha256)",
            Self::Sha384 => "hmac(sha384)",
            Self::Sha512 => "hmac(sha512)",
        }
    }

    /// Parses a kernel name (or the short `sha256`, `sha384`, `sha512`).
    pub fn parse(text: &str) -> Result<Self, AuthError> {
        match text.trim_end_matches('\n') {
            "hmac(sha256)" | "sha256" => Ok(Self::Sha256),
            "hmac(sha384)" | "sha384" => Ok(Self::Sha384),
            "hmac(sha512)" | "sha512" => Ok(Self::Sha512),
            other => Err(AuthError::Hash(other.to_owned())),
        }
    }
}

/// The Diffie-Hellman group of DH-HMAC-CHAP (`null`: no DH exchange).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DhGroup {
    Null,
    #[default]
    Ffdhe2048,
    Ffdhe3072,
    Ffdhe4096,
    Ffdhe6144,
    Ffdhe8192,
}

impl DhGroup {
    /// The name the kernel reads and shows in `dhchap_dhgroup`.
    pub fn kernel_name(self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Ffdhe2048 => "ffdhe2048",
            Self::Ffdhe3072 => "ffdhe3072",
            Self::Ffdhe4096 => "ffdhe4096",
            Self::Ffdhe6144 => "ffdhe6144",
            Self::Ffdhe8192 => "ffdhe8192",
        }
    }

    /// Parses a kernel name.
    pub fn parse(text: &str) -> Result<Self, AuthError> {
        Ok(match text.trim_end_matches('\n') {
            "null" => Self::Null,
            "ffdhe2048" => Self::Ffdhe2048,
            "ffdhe3072" => Self::Ffdhe3072,
            "ffdhe4096" => Self::Ffdhe4096,
            "ffdhe6144" => Self::Ffdhe6144,
            "ffdhe8192" => Self::Ffdhe8192,
            other => return Err(AuthError::DhGroup(other.to_owned())),
        })
    }
}

/// What one host entry must hold for its host to authenticate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostAuth {
    /// The secret the host proves.
    pub secret: DhchapSecret,
    /// The secret the target proves back; `None`: unidirectional.
    pub ctrl_secret: Option<DhchapSecret>,
    pub hash: DhchapHash,
    pub dhgroup: DhGroup,
}

/// A host entry's authentication attributes as read from configfs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ObservedHostAuth {
    /// The entry does not exist.
    NoEntry,
    /// The entry exists and has no `dhchap_key` attribute: a kernel without authentication.
    Unsupported,
    /// The entry's attributes (secrets as the kernel shows them, redacted in `Debug`).
    Entry {
        key: ShownSecret,
        ctrl_key: ShownSecret,
        hash: String,
        dhgroup: String,
    },
}

/// A key attribute's text as the kernel shows it (empty when unset), kept out of `Debug`.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct ShownSecret(pub String);

impl fmt::Debug for ShownSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("<unset>")
        } else {
            f.write_str("<redacted>")
        }
    }
}

/// Reads the authentication attributes of `hosts/<host>` under the nvmet root `root`.
pub fn observe_host_auth(root: &Path, host: &str) -> Result<ObservedHostAuth, ObserveError> {
    let dir = root.join(HOSTS).join(host);
    match std::fs::symlink_metadata(&dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(ObservedHostAuth::NoEntry);
        }
        Err(source) => return Err(ObserveError::ListDir { path: dir, source }),
        Ok(_) => {}
    }
    let key_path = dir.join(DHCHAP_KEY);
    match std::fs::symlink_metadata(&key_path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(ObservedHostAuth::Unsupported);
        }
        Err(source) => {
            return Err(ObserveError::ReadAttribute {
                path: key_path,
                source,
            });
        }
        Ok(_) => {}
    }
    Ok(ObservedHostAuth::Entry {
        key: ShownSecret(read_attr(&key_path)?),
        ctrl_key: ShownSecret(read_attr(&dir.join(DHCHAP_CTRL_KEY))?),
        hash: read_attr(&dir.join(DHCHAP_HASH))?,
        dhgroup: read_attr(&dir.join(DHCHAP_DHGROUP))?,
    })
}

/// Whether the kernel under `root` has authentication, from the attributes of any host entry:
/// `None` when there is no host entry to look at (never decided from a kernel version).
pub fn auth_supported_by_entries(root: &Path) -> Result<Option<bool>, ObserveError> {
    let dir = root.join(HOSTS);
    let first = crate::model::first_entry_except(&dir, None)
        .map_err(|source| ObserveError::ListDir { path: dir, source })?;
    let Some(host) = first else {
        return Ok(None);
    };
    Ok(match observe_host_auth(root, &host)? {
        ObservedHostAuth::NoEntry => None,
        ObservedHostAuth::Unsupported => Some(false),
        ObservedHostAuth::Entry { .. } => Some(true),
    })
}

/// Why a host entry cannot be given its authentication.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthPlanError {
    #[error(
        "the kernel has no NVMe in-band authentication (host entry {host} has no dhchap_key: \
         CONFIG_NVME_TARGET_AUTH is not set); an export that requires DH-HMAC-CHAP cannot be \
         served here (set `auth: none` on the PillarProtocol to opt out, visibly)"
    )]
    Unsupported { host: String },
}

/// Plans the host entry of `host` to hold `want`: creates the entry when missing, then writes
/// hash, DH group, controller key and host key where they differ from what it shows (the host
/// key last: an entry whose host key is set requires authentication). `observed` is
/// [`observe_host_auth`]'s answer; for a missing entry the writes follow its mkdir (the caller
/// has checked the kernel has authentication, see [`auth_supported_by_entries`]).
pub fn plan_host_auth(
    host: &HostNqn,
    observed: &ObservedHostAuth,
    want: &HostAuth,
) -> Result<Vec<Op>, AuthPlanError> {
    let dir = Path::new(HOSTS).join(host.as_str());
    let ctrl = want.ctrl_secret.as_ref().map_or("", DhchapSecret::expose);
    let mut ops = Vec::new();
    let (key, ctrl_key, hash, dhgroup) = match observed {
        ObservedHostAuth::Unsupported => {
            return Err(AuthPlanError::Unsupported {
                host: host.to_string(),
            });
        }
        ObservedHostAuth::NoEntry => {
            ops.push(Op::Mkdir { path: dir.clone() });
            ("", "", "", "")
        }
        ObservedHostAuth::Entry {
            key,
            ctrl_key,
            hash,
            dhgroup,
        } => (
            key.0.as_str(),
            ctrl_key.0.as_str(),
            hash.as_str(),
            dhgroup.as_str(),
        ),
    };
    let write = |attr: &str, value: &str| Op::Write {
        path: dir.join(attr),
        value: value.to_owned(),
    };
    if hash != want.hash.kernel_name() {
        ops.push(write(DHCHAP_HASH, want.hash.kernel_name()));
    }
    if dhgroup != want.dhgroup.kernel_name() {
        ops.push(write(DHCHAP_DHGROUP, want.dhgroup.kernel_name()));
    }
    if !same_secret(ctrl_key, ctrl) {
        ops.push(write(DHCHAP_CTRL_KEY, ctrl));
    }
    if !same_secret(key, want.secret.expose()) {
        ops.push(write(DHCHAP_KEY, want.secret.expose()));
    }
    Ok(ops)
}

/// Whether a shown key equals a wanted one (an unset one shows empty; a set one may lack the
/// final `:`).
fn same_secret(shown: &str, wanted: &str) -> bool {
    shown.trim_end_matches(':') == wanted.trim_end_matches(':')
}

/// The path of a host entry's attribute, for tests and read-backs.
pub fn host_attr(host: &str, attr: &str) -> PathBuf {
    Path::new(HOSTS).join(host).join(attr)
}

/// CRC-32 (IEEE 802.3, reflected, as the kernel's `~crc32(~0, ..)`).
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xEDB8_8320 & mask);
        }
    }
    !crc
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(B64[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// RFC 4648 base64 with `=` padding (the kernel's `base64_decode`); `None` on anything else.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    if bytes.is_empty() || !bytes.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for (i, quad) in bytes.chunks(4).enumerate() {
        let last = i == bytes.len() / 4 - 1;
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            let v = B64.iter().position(|&x| x == c)?;
            n = (n << 6) | u32::try_from(v).ok()?;
        }
        n <<= 6 * pad;
        let [_, a, b, c] = n.to_be_bytes();
        let three = [a, b, c];
        out.extend_from_slice(&three[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    // A secret made by `nvme gen-dhchap-key` would do as well; this one is built from a known
    // key so the test does not depend on a tool.
    fn known() -> DhchapSecret {
        DhchapSecret::from_key(&[7u8; 32])
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn base64_round_trips_every_length() {
        for len in 0u8..70 {
            let data: Vec<u8> = (0..len).map(|i| i.wrapping_mul(37)).collect();
            if len == 0 {
                continue;
            }
            assert_eq!(base64_decode(&base64_encode(&data)).unwrap(), data);
        }
        assert!(base64_decode("abc").is_none());
        assert!(base64_decode("a=bc").is_none());
    }

    // proves K30
    #[test]
    fn secrets_parse_as_the_kernel_extracts_them() {
        let s = known();
        assert!(s.expose().starts_with("DHHC-1:00:"));
        assert_eq!(DhchapSecret::parse(s.expose()).unwrap(), s);
        let no_colon = s.expose().trim_end_matches(':');
        assert_eq!(DhchapSecret::parse(no_colon).unwrap(), s);
        assert_eq!(
            DhchapSecret::parse(&format!("{}\n", s.expose())).unwrap(),
            s
        );
        let generated = DhchapSecret::generate().unwrap();
        assert_ne!(generated, s);
        assert!(DhchapSecret::parse(generated.expose()).is_ok());
        // Refused: prefix, transform, base64, length, transform length, CRC.
        assert_eq!(
            DhchapSecret::parse("DHHC-2:00:AAAA:"),
            Err(AuthError::Prefix)
        );
        let body = &s.expose()["DHHC-1:00:".len()..];
        assert_eq!(
            DhchapSecret::parse(&format!("DHHC-1:04:{body}")),
            Err(AuthError::Transform)
        );
        assert_eq!(
            DhchapSecret::parse("DHHC-1:00:not base64!:"),
            Err(AuthError::Base64)
        );
        let short = base64_encode(&[1u8; 20]);
        assert_eq!(
            DhchapSecret::parse(&format!("DHHC-1:00:{short}:")),
            Err(AuthError::KeyLength(16))
        );
        assert!(matches!(
            DhchapSecret::parse(&format!("DHHC-1:02:{body}")),
            Err(AuthError::TransformLength { wanted: 48, .. })
        ));
        assert!(DhchapSecret::parse(&format!("DHHC-1:01:{body}")).is_ok());
        let mut raw = base64_decode(body.trim_end_matches(':')).unwrap();
        raw[0] ^= 1;
        assert_eq!(
            DhchapSecret::parse(&format!("DHHC-1:00:{}:", base64_encode(&raw))),
            Err(AuthError::Crc)
        );
    }

    #[test]
    fn secrets_never_show_in_debug_or_display() {
        let s = known();
        let body = &s.expose()["DHHC-1:00:".len()..30];
        let auth = HostAuth {
            secret: s.clone(),
            ctrl_secret: Some(s.clone()),
            hash: DhchapHash::Sha256,
            dhgroup: DhGroup::Ffdhe2048,
        };
        for text in [format!("{s}"), format!("{s:?}"), format!("{auth:?}")] {
            assert!(!text.contains(body), "{text}");
        }
        let op = Op::Write {
            path: host_attr("h", DHCHAP_KEY),
            value: s.expose().to_owned(),
        };
        for text in [format!("{op}"), format!("{op:?}")] {
            assert!(!text.contains(body), "{text}");
        }
    }
}
