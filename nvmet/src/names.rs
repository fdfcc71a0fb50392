//! Validated names: NVMe Qualified Names, port IDs, namespace IDs and pillar volume IDs.
//!
//! Invariants this module keeps:
//! - Every `Nqn` is at most 223 bytes, has one of the two forms of the NVMe base specification
//!   (`nqn.yyyy-mm.<reverse domain>:<string>` or `nqn.2014-08.org.nvmexpress:uuid:<uuid>`), and
//!   holds no character that would break a configfs path (`/`), a `/dev/nvme-fabrics` options
//!   line (`,`), or a log line (whitespace, control characters).
//! - A `VolumeId` maps to exactly one `SubsystemNqn` and back: the NQN is a fixed prefix followed
//!   by the volume ID, and volume IDs use a character set that is legal inside an NQN, so the map
//!   is injective by construction and [`SubsystemNqn::volume_id`] is its inverse.

use std::fmt;
use std::str::FromStr;

/// Longest NQN the NVMe specification allows, in bytes (NVMF_NQN_SIZE in Linux).
pub const NQN_MAX_LEN: usize = 223;

/// The well-known discovery subsystem NQN; never a valid subsystem to create.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Prefix of the UUID-based NQN form.
pub const UUID_NQN_PREFIX: &str = "nqn.2014-08.org.nvmexpress:uuid:";

/// Prefix of every subsystem NQN pillar creates. Subsystems without it are never touched.
pub const PILLAR_NQN_PREFIX: &str = "nqn.2026-11.io.pillar-csi:vol:";

/// Longest volume ID pillar accepts; keeps the derived NQN far below [`NQN_MAX_LEN`].
pub const VOLUME_ID_MAX_LEN: usize = 128;

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("NQN is empty")]
    EmptyNqn,
    #[error("NQN is {len} bytes long; the NVMe limit is {NQN_MAX_LEN}")]
    NqnTooLong { len: usize },
    #[error("NQN {nqn:?} does not start with \"nqn.\"")]
    NqnPrefix { nqn: String },
    #[error("NQN {nqn:?} has no valid yyyy-mm date after \"nqn.\"")]
    NqnDate { nqn: String },
    #[error("NQN {nqn:?} has no valid reverse domain name before ':'")]
    NqnDomain { nqn: String },
    #[error("NQN {nqn:?} has no ':' followed by a name")]
    NqnSuffix { nqn: String },
    #[error("NQN {nqn:?} has a malformed UUID after the uuid: prefix")]
    NqnUuid { nqn: String },
    #[error("NQN {nqn:?} contains the character {ch:?}, which pillar does not allow in NQNs")]
    NqnCharacter { nqn: String, ch: char },
    #[error("the discovery NQN cannot be used as a subsystem")]
    DiscoveryNqn,
    #[error("subsystem NQN {nqn:?} was not created by pillar (no {PILLAR_NQN_PREFIX:?} prefix)")]
    NotPillarNqn { nqn: String },
    #[error("port ID {value:?} is not a decimal number from 0 to 65535")]
    PortId { value: String },
    #[error("namespace ID {value:?} is not a decimal number from 1 to 4294967294")]
    NamespaceId { value: String },
    #[error("volume ID is empty")]
    EmptyVolumeId,
    #[error("volume ID is {len} bytes long; pillar allows at most {VOLUME_ID_MAX_LEN}")]
    VolumeIdTooLong { len: usize },
    #[error(
        "volume ID {id:?} must start with a letter or digit and contain only letters, digits, \
         '-', '_' and '.'"
    )]
    VolumeIdCharacters { id: String },
}

/// An NVMe Qualified Name, validated. See the module documentation for the rules.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nqn(String);

impl Nqn {
    /// Validates `s` as an NQN.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        if s.is_empty() {
            return Err(NameError::EmptyNqn);
        }
        if s.len() > NQN_MAX_LEN {
            return Err(NameError::NqnTooLong { len: s.len() });
        }
        if let Some(ch) = s
            .chars()
            .find(|c| c.is_whitespace() || c.is_control() || *c == '/' || *c == ',')
        {
            return Err(NameError::NqnCharacter {
                nqn: s.to_owned(),
                ch,
            });
        }
        let err = |make: fn(String) -> NameError| make(s.to_owned());
        let Some(rest) = s.strip_prefix("nqn.") else {
            return Err(err(|nqn| NameError::NqnPrefix { nqn }));
        };
        if let Some(uuid) = s.strip_prefix(UUID_NQN_PREFIX) {
            return if is_hyphenated_uuid(uuid) {
                Ok(Self(s.to_owned()))
            } else {
                Err(err(|nqn| NameError::NqnUuid { nqn }))
            };
        }
        let date = rest
            .get(..7)
            .ok_or_else(|| err(|nqn| NameError::NqnDate { nqn }))?;
        if !is_year_month(date) || rest.as_bytes().get(7) != Some(&b'.') {
            return Err(err(|nqn| NameError::NqnDate { nqn }));
        }
        let after_date = &rest[8..];
        let (domain, suffix) = after_date
            .split_once(':')
            .ok_or_else(|| err(|nqn| NameError::NqnSuffix { nqn }))?;
        if !is_reverse_domain(domain) {
            return Err(err(|nqn| NameError::NqnDomain { nqn }));
        }
        if suffix.is_empty() {
            return Err(err(|nqn| NameError::NqnSuffix { nqn }));
        }
        Ok(Self(s.to_owned()))
    }

    /// The NQN as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn is_year_month(date: &str) -> bool {
    let b = date.as_bytes();
    b.len() == 7
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[5..].iter().all(u8::is_ascii_digit)
        && matches!(
            &date[5..],
            "01" | "02" | "03" | "04" | "05" | "06" | "07" | "08" | "09" | "10" | "11" | "12"
        )
}

fn is_reverse_domain(domain: &str) -> bool {
    let mut labels = 0;
    for label in domain.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return false;
        }
        labels += 1;
    }
    labels >= 2
}

fn is_hyphenated_uuid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

impl fmt::Display for Nqn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Nqn {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The NQN of an NVMe subsystem (a target-side export). Never the discovery NQN.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SubsystemNqn(Nqn);

impl SubsystemNqn {
    /// Validates `s` as a subsystem NQN.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        if s == DISCOVERY_NQN {
            return Err(NameError::DiscoveryNqn);
        }
        Nqn::parse(s).map(Self)
    }

    /// The subsystem NQN pillar uses for `volume`.
    pub fn for_volume(volume: &VolumeId) -> Self {
        // The prefix is a valid NQN head and volume IDs only use NQN-legal characters, and
        // VOLUME_ID_MAX_LEN keeps the total far below NQN_MAX_LEN, so this cannot fail.
        Self(Nqn(format!("{PILLAR_NQN_PREFIX}{}", volume.as_str())))
    }

    /// The volume this subsystem belongs to, if pillar created it.
    pub fn volume_id(&self) -> Result<VolumeId, NameError> {
        let id = self
            .as_str()
            .strip_prefix(PILLAR_NQN_PREFIX)
            .ok_or_else(|| NameError::NotPillarNqn {
                nqn: self.to_string(),
            })?;
        VolumeId::parse(id)
    }

    /// Whether pillar created (and so may change) this subsystem.
    pub fn is_pillar(&self) -> bool {
        self.volume_id().is_ok()
    }

    /// The NQN as text.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Display for SubsystemNqn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for SubsystemNqn {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The NQN of an NVMe host (an initiator), as sent in `hostnqn=` on connect.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostNqn(Nqn);

impl HostNqn {
    /// Validates `s` as a host NQN.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        if s == DISCOVERY_NQN {
            return Err(NameError::DiscoveryNqn);
        }
        Nqn::parse(s).map(Self)
    }

    /// The NQN as text.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Display for HostNqn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for HostNqn {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// An nvmet port ID: the numeric name of a directory under `ports/` (a u16 in the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortId(u16);

impl PortId {
    /// A port ID from its number.
    pub const fn new(id: u16) -> Self {
        Self(id)
    }

    /// Parses the decimal directory name of a port.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        let err = || NameError::PortId {
            value: s.to_owned(),
        };
        if s.is_empty()
            || !s.bytes().all(|c| c.is_ascii_digit())
            || (s.len() > 1 && s.starts_with('0'))
        {
            return Err(err());
        }
        s.parse::<u16>().map(Self).map_err(|_| err())
    }

    /// The port number.
    pub const fn get(self) -> u16 {
        self.0
    }
}

impl fmt::Display for PortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// An NVMe namespace ID: 1 to 0xFFFF_FFFE (0 is invalid, 0xFFFF_FFFF means "all").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespaceId(u32);

impl NamespaceId {
    /// The namespace every pillar volume uses: one subsystem per volume, one namespace each.
    pub const VOLUME: Self = Self(1);

    /// Validates a namespace number.
    pub fn new(id: u32) -> Result<Self, NameError> {
        if id == 0 || id == u32::MAX {
            return Err(NameError::NamespaceId {
                value: id.to_string(),
            });
        }
        Ok(Self(id))
    }

    /// Parses the decimal directory name of a namespace.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        let err = || NameError::NamespaceId {
            value: s.to_owned(),
        };
        if s.is_empty()
            || !s.bytes().all(|c| c.is_ascii_digit())
            || (s.len() > 1 && s.starts_with('0'))
        {
            return Err(err());
        }
        let n = s.parse::<u32>().map_err(|_| err())?;
        Self::new(n).map_err(|_| err())
    }

    /// The namespace number.
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A pillar volume ID: safe as a file name, a configfs directory name and inside an NQN.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeId(String);

impl VolumeId {
    /// Validates `s` as a volume ID.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        if s.is_empty() {
            return Err(NameError::EmptyVolumeId);
        }
        if s.len() > VOLUME_ID_MAX_LEN {
            return Err(NameError::VolumeIdTooLong { len: s.len() });
        }
        let bytes = s.as_bytes();
        let ok = bytes[0].is_ascii_alphanumeric()
            && bytes
                .iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
        if !ok {
            return Err(NameError::VolumeIdCharacters { id: s.to_owned() });
        }
        Ok(Self(s.to_owned()))
    }

    /// The ID as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The subsystem NQN of this volume.
    pub fn subsystem_nqn(&self) -> SubsystemNqn {
        SubsystemNqn::for_volume(self)
    }
}

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Looks a volume up by its text in a set of IDs without validating and copying the text
/// first. The derived `Hash`, `Eq` and `Ord` are the inner `String`'s, which are `str`'s, as
/// `Borrow` requires.
impl std::borrow::Borrow<str> for VolumeId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl FromStr for VolumeId {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_both_nqn_forms() {
        for ok in [
            "nqn.2014-08.com.example:nvme:nvm-subsystem-sn-d78432",
            "nqn.2026-11.io.pillar-csi:vol:pvc-1",
            "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6",
        ] {
            Nqn::parse(ok).unwrap();
        }
    }

    #[test]
    fn rejects_malformed_nqns_with_a_reason() {
        let long = format!("nqn.2014-08.com.example:{}", "x".repeat(200));
        type Check = fn(&NameError) -> bool;
        let cases: &[(&str, Check)] = &[
            ("", |e| matches!(e, NameError::EmptyNqn)),
            (&long, |e| matches!(e, NameError::NqnTooLong { len: 224 })),
            ("iqn.2014-08.com.example:x", |e| {
                matches!(e, NameError::NqnPrefix { .. })
            }),
            ("nqn.14-08.com.example:x", |e| {
                matches!(e, NameError::NqnDate { .. })
            }),
            ("nqn.2014-13.com.example:x", |e| {
                matches!(e, NameError::NqnDate { .. })
            }),
            ("nqn.2014-08com.example:x", |e| {
                matches!(e, NameError::NqnDate { .. })
            }),
            ("nqn.2014-08.com.example", |e| {
                matches!(e, NameError::NqnSuffix { .. })
            }),
            ("nqn.2014-08.com.example:", |e| {
                matches!(e, NameError::NqnSuffix { .. })
            }),
            ("nqn.2014-08.com..example:x", |e| {
                matches!(e, NameError::NqnDomain { .. })
            }),
            ("nqn.2014-08.-com.example:x", |e| {
                matches!(e, NameError::NqnDomain { .. })
            }),
            ("nqn.2014-08.localhost:x", |e| {
                matches!(e, NameError::NqnDomain { .. })
            }),
            ("nqn.2014-08.org.nvmexpress:uuid:not-a-uuid", |e| {
                matches!(e, NameError::NqnUuid { .. })
            }),
            ("nqn.2014-08.com.example:a/b", |e| {
                matches!(e, NameError::NqnCharacter { ch: '/', .. })
            }),
            ("nqn.2014-08.com.example:a,b", |e| {
                matches!(e, NameError::NqnCharacter { ch: ',', .. })
            }),
            ("nqn.2014-08.com.example:a b", |e| {
                matches!(e, NameError::NqnCharacter { ch: ' ', .. })
            }),
            ("nqn.2014-08.com.example:a\n", |e| {
                matches!(e, NameError::NqnCharacter { .. })
            }),
        ];
        for (input, expected) in cases {
            let err = Nqn::parse(input).unwrap_err();
            assert!(expected(&err), "{input:?} gave {err:?}");
        }
    }

    #[test]
    fn exactly_223_bytes_is_accepted() {
        let head = "nqn.2014-08.com.example:";
        let nqn = format!("{head}{}", "x".repeat(NQN_MAX_LEN - head.len()));
        assert_eq!(nqn.len(), 223);
        Nqn::parse(&nqn).unwrap();
    }

    #[test]
    fn discovery_nqn_is_no_subsystem_or_host() {
        assert_eq!(
            SubsystemNqn::parse(DISCOVERY_NQN),
            Err(NameError::DiscoveryNqn)
        );
        assert_eq!(HostNqn::parse(DISCOVERY_NQN), Err(NameError::DiscoveryNqn));
    }

    #[test]
    fn port_and_namespace_ids() {
        assert_eq!(PortId::parse("1").unwrap().get(), 1);
        assert_eq!(PortId::parse("65535").unwrap().get(), 65535);
        for bad in ["", "65536", "-1", "01", "1a", " 1", "0x10"] {
            assert!(PortId::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(NamespaceId::parse("1").unwrap(), NamespaceId::VOLUME);
        assert_eq!(NamespaceId::parse("4294967294").unwrap().get(), 0xFFFF_FFFE);
        for bad in ["0", "4294967295", "4294967296", "", "01", "x"] {
            assert!(NamespaceId::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn volume_ids_reject_path_tricks() {
        for bad in ["../x", "..", ".", "a/b", "-a", "_a", "a b", "a\0", "é", ""] {
            assert!(VolumeId::parse(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            VolumeId::parse(&"a".repeat(129)),
            Err(NameError::VolumeIdTooLong { len: 129 })
        ));
        VolumeId::parse(&"a".repeat(128)).unwrap();
        VolumeId::parse("pvc-6f1c0b1e-93c5-4c43-9d1a-0d1c6b7f2a10").unwrap();
    }

    #[test]
    fn foreign_subsystems_are_not_pillars() {
        let foreign = SubsystemNqn::parse("nqn.2014-08.com.example:vol:pvc-1").unwrap();
        assert!(!foreign.is_pillar());
        let bad_suffix = SubsystemNqn::parse(&format!("{PILLAR_NQN_PREFIX}..")).unwrap();
        assert!(!bad_suffix.is_pillar());
    }

    proptest! {
        // The volume -> NQN map is injective and invertible, and always yields a valid NQN.
        #[test]
        fn volume_nqn_map_round_trips(id in "[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}") {
            let volume = VolumeId::parse(&id).unwrap();
            let nqn = volume.subsystem_nqn();
            prop_assert!(SubsystemNqn::parse(nqn.as_str()).is_ok());
            prop_assert_eq!(nqn.volume_id().unwrap(), volume);
        }

        #[test]
        fn distinct_volumes_get_distinct_nqns(
            a in "[a-z0-9][a-z0-9._-]{0,20}",
            b in "[a-z0-9][a-z0-9._-]{0,20}",
        ) {
            let na = VolumeId::parse(&a).unwrap().subsystem_nqn();
            let nb = VolumeId::parse(&b).unwrap().subsystem_nqn();
            prop_assert_eq!(a == b, na == nb);
        }
    }
}
