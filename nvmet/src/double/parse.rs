//! The kernel's parsers for attribute values, as the double applies them to each write.
//!
//! Invariants:
//! - A value the kernel's parser refuses is EINVAL (ERANGE for a number out of range), and the
//!   stored form is the one the kernel shows on a read (lower-case UUIDs, hyphenated NGUIDs).

use std::io;

use super::errno;

/// The kernel's kstrtobool: the first character decides; anything else is EINVAL.
pub(super) fn kstrtobool(value: &str) -> io::Result<bool> {
    match value.as_bytes().first() {
        Some(b'1' | b'y' | b'Y' | b't' | b'T') => Ok(true),
        Some(b'0' | b'n' | b'N' | b'f' | b'F') => Ok(false),
        Some(b'o' | b'O') => match value.as_bytes().get(1) {
            Some(b'n' | b'N') => Ok(true),
            Some(b'f' | b'F') => Ok(false),
            _ => Err(errno(libc::EINVAL)),
        },
        _ => Err(errno(libc::EINVAL)),
    }
}

/// kstrtou32/kstrtou16 with base 0: decimal, `0x` hex or leading-`0` octal.
pub(super) fn kstrtou(value: &str, max: u64) -> io::Result<u64> {
    let v = value.strip_suffix('\n').unwrap_or(value);
    let parsed = if let Some(hex) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16)
    } else if v.len() > 1 && v.starts_with('0') {
        u64::from_str_radix(&v[1..], 8)
    } else {
        v.parse::<u64>()
    };
    match parsed {
        Ok(n) if n <= max => Ok(n),
        Ok(_) => Err(errno(libc::ERANGE)),
        Err(_) => Err(errno(libc::EINVAL)),
    }
}

/// The kernel's uuid_is_valid: only the first 36 characters count.
pub(super) fn kernel_uuid(value: &str) -> io::Result<String> {
    let head = value.get(..36).ok_or_else(|| errno(libc::EINVAL))?;
    let ok = head.bytes().enumerate().all(|(i, c)| match i {
        8 | 13 | 18 | 23 => c == b'-',
        _ => c.is_ascii_hexdigit(),
    });
    if ok {
        Ok(head.to_ascii_lowercase())
    } else {
        Err(errno(libc::EINVAL))
    }
}

/// The kernel's NGUID parser: 16 hex pairs, each optionally followed by one '-' or ':'.
pub(super) fn kernel_nguid(value: &str) -> io::Result<String> {
    let b = value.as_bytes();
    let mut p = 0;
    let mut out = [0u8; 16];
    for byte in &mut out {
        if p + 2 > b.len() || !b[p].is_ascii_hexdigit() || !b[p + 1].is_ascii_hexdigit() {
            return Err(errno(libc::EINVAL));
        }
        let hex = std::str::from_utf8(&b[p..p + 2]).map_err(|_| errno(libc::EINVAL))?;
        *byte = u8::from_str_radix(hex, 16).map_err(|_| errno(libc::EINVAL))?;
        p += 2;
        if matches!(b.get(p), Some(b'-' | b':')) {
            p += 1;
        }
    }
    Ok(uuid::Uuid::from_bytes(out).hyphenated().to_string())
}

pub(super) fn first_line(value: &str) -> &str {
    value.split('\n').next().unwrap_or("")
}

pub(super) fn first_token(value: &str) -> &str {
    value.split_whitespace().next().unwrap_or("")
}
