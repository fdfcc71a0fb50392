//! The JSON reports of `lvs`, `vgs` and the thin pool (`--reportformat json --units b
//! --nosuffix`): sizes are exact byte counts, as strings, parsed here without floats.

use serde::Deserialize;

use super::{BackendError, Capacity, LV_NAME_MAX, TAG};

#[derive(Debug, Deserialize)]
pub(super) struct Report<T> {
    pub(super) report: Vec<T>,
}

#[derive(Debug, Deserialize)]
pub(super) struct LvSection {
    #[serde(default)]
    pub(super) lv: Vec<LvRow>,
}

#[derive(Debug, Deserialize)]
pub(super) struct SnapshotSection {
    #[serde(default)]
    pub(super) lv: Vec<SnapshotRow>,
}

#[derive(Debug, Deserialize)]
pub(super) struct SnapshotRow {
    pub(super) lv_name: String,
    pub(super) lv_size: String,
    #[serde(default)]
    pub(super) lv_tags: String,
    #[serde(default)]
    pub(super) lv_time: String,
}

#[derive(Debug, Deserialize)]
pub(super) struct VgSection {
    #[serde(default)]
    pub(super) vg: Vec<VgRow>,
}

#[derive(Debug, Clone, Deserialize)]
pub(super) struct LvRow {
    pub(super) lv_name: String,
    #[serde(default)]
    pub(super) lv_path: String,
    pub(super) lv_size: String,
    #[serde(default)]
    pub(super) lv_tags: String,
    #[serde(default)]
    pub(super) lv_attr: String,
    #[serde(default)]
    pub(super) pool_lv: String,
}

#[derive(Debug, Deserialize)]
pub(super) struct ThinPoolRow {
    pub(super) lv_name: String,
    pub(super) lv_size: String,
    #[serde(default)]
    pub(super) data_percent: String,
}

#[derive(Debug, Deserialize)]
pub(super) struct ThinPoolSection {
    #[serde(default)]
    pub(super) lv: Vec<ThinPoolRow>,
}

#[derive(Debug, Deserialize)]
pub(super) struct VgRow {
    pub(super) vg_name: String,
    pub(super) vg_extent_size: String,
    pub(super) vg_size: String,
    pub(super) vg_free: String,
}

impl LvRow {
    pub(super) fn tagged(&self) -> bool {
        self.lv_tags.split(',').any(|t| t == TAG)
    }

    /// The 5th `lv_attr` character is the state; `a` is active.
    pub(super) fn active(&self) -> bool {
        self.lv_attr.chars().nth(4) == Some('a')
    }
}

pub(super) fn vg_capacity(vg: &VgRow) -> Result<Capacity, BackendError> {
    Ok(Capacity {
        total_bytes: parse_bytes("vgs vg_size", &vg.vg_size)?,
        available_bytes: parse_bytes("vgs vg_free", &vg.vg_free)?,
    })
}

pub(super) fn report_args(command: &str, fields: &str, target: &str) -> Vec<String> {
    [
        command,
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "-o",
        fields,
        target,
    ]
    .map(String::from)
    .to_vec()
}

pub(super) fn parse_report<T: for<'de> Deserialize<'de>>(
    what: &'static str,
    stdout: &[u8],
) -> Result<T, BackendError> {
    serde_json::from_slice(stdout).map_err(|source| BackendError::Report { what, source })
}

pub(super) fn parse_bytes(what: &'static str, value: &str) -> Result<u64, BackendError> {
    value.trim().parse().map_err(|_| BackendError::ReportValue {
        what,
        value: value.to_owned(),
    })
}

/// The most of `total` that LVM's `percent` (a decimal such as `"12.34"`) can stand for, without
/// floating point. LVM rounds to the nearest unit of the last digit printed, so the real use can
/// be half a unit higher: counting that half unit never under-reports use (never over-reports
/// free space).
pub(super) fn percent_of(total: u64, percent: &str) -> Option<u64> {
    let percent = percent.trim();
    let (int, frac) = percent.split_once('.').unwrap_or((percent, ""));
    if int.is_empty()
        || !int.bytes().all(|c| c.is_ascii_digit())
        || !frac.bytes().all(|c| c.is_ascii_digit())
        || frac.len() > 6
    {
        return None;
    }
    let scale = 10u128.pow(u32::try_from(frac.len()).ok()?);
    let int: u128 = int.parse().ok()?;
    let frac: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    let scaled = int.checked_mul(scale)?.checked_add(frac)?;
    if scaled > 100 * scale {
        return None;
    }
    // (scaled + 1/2) / (100 * scale), capped at the whole.
    let used = (u128::from(total) * (2 * scaled + 1))
        .div_ceil(200 * scale)
        .min(u128::from(total));
    u64::try_from(used).ok()
}

/// A VG or LV name LVM accepts: `[A-Za-z0-9+_.-]`, not starting with `-`, not `.` or `..`.
pub(super) fn is_lvm_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= LV_NAME_MAX
        && name != "."
        && name != ".."
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'_' | b'.' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_without_floats() {
        // "12.34" stands for up to 12.345 %.
        assert_eq!(percent_of(1_000_000, "12.34"), Some(123_450));
        assert_eq!(
            percent_of(1_000_000, "0.00"),
            Some(50),
            "0.00 may hide up to 0.005 %"
        );
        assert_eq!(percent_of(10_000, "100.00"), Some(10_000));
        assert_eq!(percent_of(3, "50"), Some(2)); // rounded up: never under-report use
        // Measured on a real thin pool: 3 MiB used of 256 MiB printed as 1.17 %.
        assert!(percent_of(256 << 20, "1.17").is_some_and(|u| u >= 3 << 20));
        assert_eq!(percent_of(u64::MAX, "100.00"), Some(u64::MAX));
        for bad in ["", "x", "-1", "100.01", "1.2.3", ".5", "1e3"] {
            assert_eq!(percent_of(100, bad), None, "{bad:?}");
        }
    }

    #[test]
    fn lvm_names() {
        assert!(is_lvm_name("vg0"));
        assert!(is_lvm_name("data+1_x.y-z"));
        for bad in ["", ".", "..", "-vg", "vg/0", "vg 0", "vé"] {
            assert!(!is_lvm_name(bad), "{bad:?}");
        }
    }
}
