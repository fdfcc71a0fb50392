//! Attribute writes, each refused as the kernel's store function refuses it.
//!
//! [`ConfigfsDouble::admit_write`] checks a write as the store function does and answers the
//! value the kernel keeps (parsed and normalised, as a read shows it); the plain write goes to
//! the file, then the double stores that value over it (see [`crate::rules`]).
//!
//! Invariants:
//! - `device_path`, `device_uuid`, `device_nguid` on an enabled namespace: EBUSY; `resv_enable`,
//!   `buffered_io` on an enabled namespace: EINVAL; `enable` without a device: EINVAL (ENOENT
//!   for a missing one); `revalidate_size` on a disabled namespace: EINVAL.
//! - A port's `addr_*` while any subsystem is linked to it: EACCES.
//! - `attr_allow_any_host=1` while hosts are linked, and `attr_serial` / `attr_model` after a
//!   host identified the subsystem: EINVAL.
//! - A host entry's `dhchap_*` attribute of a kernel without authentication does not exist
//!   (ENOENT); a key must start `DHHC-1:<0-3>:` or be empty, a hash or group one the kernel
//!   names (EINVAL otherwise).
//! - A port's `addr_tsas` exists only where the modelled kernel has TLS for the target (ENOENT
//!   otherwise); it takes `none` or `tls1.3` on a TCP port, and `addr_treq` `not specified` is
//!   refused while it is `tls1.3` (EINVAL).
//! - An attribute the kernel does not have cannot be created (EACCES).

use std::io;
use std::path::Path;

use super::parse::{first_line, first_token, kernel_nguid, kernel_uuid, kstrtobool, kstrtou};
use super::place::{Place, classify};
use super::{ConfigfsDouble, errno};
use crate::model::{ADDR_TREQ, ADDR_TSAS, TREQ_REQUIRED, TSAS_TLS13};
use crate::model::{PORTS, SUBSYSTEMS};

impl ConfigfsDouble {
    /// Whether the kernel takes `value` into the attribute `rel`, and the value it then shows.
    pub(super) fn admit_write(&self, rel: &Path, value: &str) -> io::Result<String> {
        let path = self.at(rel)?;
        if path.is_dir() {
            return Err(errno(libc::EISDIR));
        }
        let missing_optional = match classify(rel) {
            Place::HostAttr(..) => true,
            Place::PortAttr(_, attr) => attr == ADDR_TSAS,
            _ => false,
        };
        if missing_optional && !path.is_file() {
            // The attribute does not exist (a kernel without authentication): opening it for
            // writing without O_CREAT fails.
            return Err(errno(libc::ENOENT));
        }
        if !path.is_file() {
            // configfs directories have no ->create: opening a new file fails.
            return Err(if path.parent().is_some_and(Path::is_dir) {
                errno(libc::EACCES)
            } else {
                errno(libc::ENOENT)
            });
        }
        match classify(rel) {
            Place::NamespaceAttr(_, _, attr) => self.write_namespace_attr(&path, attr, value),
            Place::SubsystemAttr(nqn, attr) => self.write_subsystem_attr(nqn, attr, value),
            Place::HostAttr(_, attr) => Self::write_host_attr(attr, value),
            Place::PortAttr(port, attr) => self.write_port_attr(port, attr, value),
            _ => Err(errno(libc::EACCES)),
        }
    }

    /// A namespace's attribute; identity and device only while it is disabled.
    fn write_namespace_attr(&self, path: &Path, attr: &str, value: &str) -> io::Result<String> {
        let ns_dir = path.parent().ok_or_else(|| errno(libc::EINVAL))?;
        let enabled = self.ns_enabled(ns_dir)?;
        match attr {
            "device_path" => {
                if enabled {
                    return Err(errno(libc::EBUSY));
                }
                let v = first_line(value);
                if v.is_empty() {
                    return Err(errno(libc::EINVAL));
                }
                Ok(String::from(v))
            }
            "device_uuid" => {
                if enabled {
                    return Err(errno(libc::EBUSY));
                }
                kernel_uuid(value)
            }
            "device_nguid" => {
                if enabled {
                    return Err(errno(libc::EBUSY));
                }
                kernel_nguid(value)
            }
            "enable" => {
                let on = kstrtobool(value)?;
                if on && !enabled {
                    let device = self.attr(&ns_dir.join("device_path"))?;
                    if device.is_empty() || device == "(null)" {
                        return Err(errno(libc::EINVAL));
                    }
                    if !Path::new(&device).exists() {
                        return Err(errno(libc::ENOENT));
                    }
                }
                Ok(String::from(if on { "1" } else { "0" }))
            }
            "revalidate_size" => {
                if !kstrtobool(value)? || !enabled {
                    return Err(errno(libc::EINVAL));
                }
                // Write-only in the kernel: nothing is kept.
                Ok(String::new())
            }
            "resv_enable" | "buffered_io" => {
                let on = kstrtobool(value)?;
                if enabled {
                    return Err(errno(libc::EINVAL));
                }
                Ok(String::from(if on { "1" } else { "0" }))
            }
            "ana_grpid" => {
                let g = kstrtou(value, u64::from(u32::MAX))?;
                if !(1..=128).contains(&g) {
                    return Err(errno(libc::EINVAL));
                }
                Ok(g.to_string())
            }
            _ => Err(errno(libc::EACCES)),
        }
    }

    /// A subsystem's attribute; serial and model only until a host identified it.
    fn write_subsystem_attr(&self, nqn: &str, attr: &str, value: &str) -> io::Result<String> {
        match attr {
            "attr_allow_any_host" => {
                let on = kstrtobool(value)?;
                let hosts_dir = self.root.join(SUBSYSTEMS).join(nqn).join("allowed_hosts");
                if on && !Self::dir_entries(&hosts_dir)?.is_empty() {
                    return Err(errno(libc::EINVAL));
                }
                Ok(String::from(if on { "1" } else { "0" }))
            }
            "attr_serial" => {
                let v = first_line(value);
                if self.discovered(nqn)
                    || v.is_empty()
                    || v.len() > 20
                    || !v.bytes().all(|c| (0x20..=0x7e).contains(&c))
                {
                    return Err(errno(libc::EINVAL));
                }
                // The kernel pads the serial with spaces to the full 20 characters.
                Ok(format!("{v:<20}"))
            }
            "attr_model" => {
                let v = first_line(value);
                if self.discovered(nqn)
                    || v.is_empty()
                    || v.len() > 40
                    || !v.bytes().all(|c| (0x20..=0x7e).contains(&c))
                {
                    return Err(errno(libc::EINVAL));
                }
                Ok(String::from(v))
            }
            _ => Err(errno(libc::EACCES)),
        }
    }

    /// A port's address attribute; only while no subsystem is linked to it.
    fn write_port_attr(&self, port: &str, attr: &str, value: &str) -> io::Result<String> {
        if self.port_linked(port)? {
            return Err(errno(libc::EACCES));
        }
        let v = match attr {
            "addr_trtype" => {
                let v = first_line(value);
                if !matches!(v, "rdma" | "fc" | "tcp" | "loop") {
                    return Err(errno(libc::EINVAL));
                }
                v
            }
            "addr_adrfam" => {
                let v = first_line(value);
                if !matches!(v, "ipv4" | "ipv6" | "ib" | "fc" | "loop") {
                    return Err(errno(libc::EINVAL));
                }
                v
            }
            "addr_traddr" | "addr_trsvcid" => {
                let limit = if attr == "addr_traddr" { 256 } else { 32 };
                let v = first_token(value);
                if value.len() > limit || v.is_empty() {
                    return Err(errno(libc::EINVAL));
                }
                v
            }
            ADDR_TSAS => return self.write_port_tsas(port, value),
            ADDR_TREQ => return self.write_port_treq(port, value),
            _ => return Err(errno(libc::EACCES)),
        };
        Ok(String::from(v))
    }

    fn port_attr(&self, port: &str, attr: &str) -> io::Result<String> {
        self.attr(&self.root.join(PORTS).join(port).join(attr))
    }

    /// `addr_tsas`, as `nvmet_addr_tsas_store` takes it on a kernel with TLS for the target:
    /// a TCP port only, `none` or `tls1.3` (its effect on `addr_treq` completes the write).
    fn write_port_tsas(&self, port: &str, value: &str) -> io::Result<String> {
        let v = first_line(value);
        if self.port_attr(port, "addr_trtype")? != "tcp" || !matches!(v, "none" | TSAS_TLS13) {
            return Err(errno(libc::EINVAL));
        }
        Ok(String::from(v))
    }

    /// `addr_treq`, as `nvmet_addr_treq_store` takes it: `not specified` is refused on a TLS
    /// port.
    fn write_port_treq(&self, port: &str, value: &str) -> io::Result<String> {
        let v = first_line(value);
        if !matches!(v, "not specified" | TREQ_REQUIRED | "not required") {
            return Err(errno(libc::EINVAL));
        }
        let tls = self.tls_modelled() && self.port_attr(port, ADDR_TSAS)? == TSAS_TLS13;
        if tls && v == "not specified" {
            return Err(errno(libc::EINVAL));
        }
        Ok(String::from(v))
    }

    /// After a write completed, its effect on other port attributes: `addr_trtype` resets the
    /// secure channel (`none` for TCP), as `nvmet_addr_trtype_store` does; `addr_tsas` `tls1.3`
    /// turns an unspecified `addr_treq` into `required`, `none` makes it `not specified`, as
    /// `nvmet_addr_tsas_store` does.
    pub(super) fn port_write_done(&self, rel: &Path, value: &str) -> io::Result<()> {
        let Place::PortAttr(port, attr) = classify(rel) else {
            return Ok(());
        };
        let dir = self.root.join(PORTS).join(port);
        match attr {
            "addr_trtype" if self.tls_modelled() => {
                let tsas = if value == "tcp" { "none" } else { "" };
                self.set(&dir.join(ADDR_TSAS), tsas)
            }
            ADDR_TSAS if value == TSAS_TLS13 => {
                if self.attr(&dir.join(ADDR_TREQ))? == "not specified" {
                    self.set(&dir.join(ADDR_TREQ), TREQ_REQUIRED)?;
                }
                Ok(())
            }
            ADDR_TSAS => self.set(&dir.join(ADDR_TREQ), "not specified"),
            _ => Ok(()),
        }
    }

    /// A host entry's authentication attribute, as `nvmet_auth_set_key`,
    /// `nvmet_host_dhchap_hash_store` and `nvmet_host_dhchap_dhgroup_store` take it.
    fn write_host_attr(attr: &str, value: &str) -> io::Result<String> {
        use crate::auth::{DHCHAP_CTRL_KEY, DHCHAP_DHGROUP, DHCHAP_HASH, DHCHAP_KEY};
        let v = value.strip_suffix('\n').unwrap_or(value);
        match attr {
            DHCHAP_KEY | DHCHAP_CTRL_KEY => {
                if v.is_empty() {
                    return Ok(String::new());
                }
                // What the store checks on the lane's 7.2 (`s15_dhchap`): the prefix and a
                // transform of 0-3 (`sscanf("DHHC-1:%hhd:%*s")`); the key itself (base64,
                // length, CRC) only when a host authenticates, so a malformed one is taken here
                // and fails every connect (`host_connects_with_secret`).
                let rest = v
                    .strip_prefix("DHHC-1:")
                    .ok_or_else(|| errno(libc::EINVAL))?;
                let (hh, body) = rest.split_once(':').ok_or_else(|| errno(libc::EINVAL))?;
                let transform: u8 = hh.parse().map_err(|_| errno(libc::EINVAL))?;
                if transform > 3 || body.trim().is_empty() {
                    return Err(errno(libc::EINVAL));
                }
                Ok(String::from(v))
            }
            DHCHAP_HASH => {
                let hash = crate::auth::DhchapHash::parse(v).map_err(|_| errno(libc::EINVAL))?;
                if !v.starts_with("hmac(") {
                    return Err(errno(libc::EINVAL));
                }
                Ok(String::from(hash.kernel_name()))
            }
            DHCHAP_DHGROUP => {
                let group = crate::auth::DhGroup::parse(v).map_err(|_| errno(libc::EINVAL))?;
                Ok(String::from(group.kernel_name()))
            }
            _ => Err(errno(libc::EACCES)),
        }
    }
}
