//! NVMe in-band authentication on host entries (`docs/rules.md` K29, K30, W10): the double
//! holds the kernel's `dhchap_*` attributes where the kernel has them and refuses what the
//! kernel refuses, and the planner writes a host's keys before anything links it.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use common::{Fixture, export, host, only, tcp_port};
use pillar_nvmet::{
    AuthPlanError, ConfigfsDouble, DHCHAP_CTRL_KEY, DHCHAP_DHGROUP, DHCHAP_HASH, DHCHAP_KEY,
    DhGroup, DhchapHash, DhchapSecret, Executor, HostAccess, HostAuth, ObservedHostAuth, Op, apply,
    auth_supported_by_entries, host_attr, observe_host_auth, plan_acl, plan_host_auth,
};

fn errno_of(r: std::io::Result<()>) -> i32 {
    r.expect_err("the kernel refuses this")
        .raw_os_error()
        .unwrap()
}

fn write(path: std::path::PathBuf, value: &str) -> Op {
    Op::Write {
        path,
        value: value.into(),
    }
}

fn auth() -> HostAuth {
    HostAuth {
        secret: DhchapSecret::generate().unwrap(),
        ctrl_secret: Some(DhchapSecret::generate().unwrap()),
        hash: DhchapHash::Sha256,
        dhgroup: DhGroup::Ffdhe2048,
    }
}

// proves K29
#[test]
fn host_entries_have_the_auth_attributes_only_where_the_kernel_has_authentication() {
    let mut f = Fixture::new();
    let h = host(1).to_string();
    f.double
        .execute(&Op::Mkdir {
            path: format!("hosts/{h}").into(),
        })
        .unwrap();
    let root = f.double.root().to_owned();
    assert!(matches!(
        observe_host_auth(&root, &h).unwrap(),
        ObservedHostAuth::Entry { ref hash, ref dhgroup, .. }
            if hash == "hmac(sha256)" && dhgroup == "null"
    ));
    assert_eq!(auth_supported_by_entries(&root).unwrap(), Some(true));

    let dir = tempfile::tempdir().unwrap();
    let mut old = ConfigfsDouble::create(dir.path().join("nvmet"))
        .unwrap()
        .without_auth();
    assert_eq!(auth_supported_by_entries(old.root()).unwrap(), None);
    old.execute(&Op::Mkdir {
        path: format!("hosts/{h}").into(),
    })
    .unwrap();
    assert_eq!(
        observe_host_auth(old.root(), &h).unwrap(),
        ObservedHostAuth::Unsupported
    );
    assert_eq!(auth_supported_by_entries(old.root()).unwrap(), Some(false));
    let secret = DhchapSecret::generate().unwrap();
    for attr in [DHCHAP_KEY, DHCHAP_CTRL_KEY, DHCHAP_HASH, DHCHAP_DHGROUP] {
        let value = if attr == DHCHAP_HASH {
            "hmac(sha256)"
        } else {
            secret.expose()
        };
        assert_eq!(
            errno_of(old.execute(&write(host_attr(&h, attr), value))),
            libc::ENOENT,
            "{attr}"
        );
    }
    // A handle opened later on the same root models the same kernel.
    let again = ConfigfsDouble::create(dir.path().join("nvmet")).unwrap();
    let mut again = again;
    assert_eq!(
        errno_of(again.execute(&write(host_attr(&h, DHCHAP_KEY), secret.expose()))),
        libc::ENOENT
    );
}

// proves K30
#[test]
fn the_double_stores_keys_and_names_as_the_kernel_does() {
    let mut f = Fixture::new();
    let h = host(1).to_string();
    f.double
        .execute(&Op::Mkdir {
            path: format!("hosts/{h}").into(),
        })
        .unwrap();
    let good = DhchapSecret::generate().unwrap();
    let body = good.expose()["DHHC-1:00:".len()..].to_owned();
    // What 7.2 refuses at the write (measured, `s15_dhchap`): no prefix, a transform over 3.
    for bad in ["secret", "DHHC-1:04:AAAA:", "DHHC-1:x:AAAA:", "DHHC-1:00:"] {
        for attr in [DHCHAP_KEY, DHCHAP_CTRL_KEY] {
            assert_eq!(
                errno_of(f.double.execute(&write(host_attr(&h, attr), bad))),
                libc::EINVAL,
                "{attr} = {bad}"
            );
        }
    }
    // The key's body is checked only when a host authenticates (7.2 takes these at the
    // write): a short key, a SHA-384 transform of a 32-byte key, a flipped CRC bit. Such a key
    // authenticates nobody, not even a host presenting exactly it.
    let mut chars: Vec<char> = good.expose().chars().collect();
    let i = "DHHC-1:00:".len() + 2;
    chars[i] = if chars[i] == 'A' { 'B' } else { 'A' };
    let flipped: String = chars.into_iter().collect();
    let device = f.device.clone();
    let spec = export("v1", &device, only(&[1]), tcp_port(4420, 4420));
    f.export(&spec);
    for odd in [
        "DHHC-1:00:AAAAAAAA:".to_owned(),
        format!("DHHC-1:02:{body}"),
        flipped,
    ] {
        f.double
            .execute(&write(host_attr(&h, DHCHAP_KEY), &odd))
            .unwrap();
        assert_eq!(
            errno_of(
                f.double
                    .host_connects_with_secret(spec.nqn.as_str(), &h, 4420, Some(&odd))
            ),
            libc::EACCES,
            "{odd}"
        );
    }
    for (attr, bad) in [
        (DHCHAP_HASH, "sha256"),
        (DHCHAP_HASH, "hmac(md5)"),
        (DHCHAP_DHGROUP, "ffdhe1024"),
    ] {
        assert_eq!(
            errno_of(f.double.execute(&write(host_attr(&h, attr), bad))),
            libc::EINVAL,
            "{attr} = {bad}"
        );
    }
    f.double
        .execute(&write(host_attr(&h, DHCHAP_KEY), good.expose()))
        .unwrap();
    f.double
        .execute(&write(host_attr(&h, DHCHAP_HASH), "hmac(sha512)"))
        .unwrap();
    f.double
        .execute(&write(host_attr(&h, DHCHAP_DHGROUP), "ffdhe4096"))
        .unwrap();
    let ObservedHostAuth::Entry {
        key, hash, dhgroup, ..
    } = observe_host_auth(f.double.root(), &h).unwrap()
    else {
        panic!("an entry with attributes");
    };
    assert_eq!(key.0, good.expose());
    assert_eq!(
        (hash.as_str(), dhgroup.as_str()),
        ("hmac(sha512)", "ffdhe4096")
    );
    // An empty write clears the key.
    f.double
        .execute(&write(host_attr(&h, DHCHAP_KEY), ""))
        .unwrap();
    assert!(matches!(
        observe_host_auth(f.double.root(), &h).unwrap(),
        ObservedHostAuth::Entry { ref key, .. } if key.0.is_empty()
    ));
}

// proves W10
#[test]
fn the_plan_sets_the_keys_before_the_acl_links_the_host_and_only_the_keyed_host_connects() {
    let mut f = Fixture::new();
    let h = host(1);
    let device = f.device.clone();
    let spec = export("v1", &device, only(&[]), tcp_port(4420, 4420));
    f.export(&spec);
    let want = auth();
    let root = f.double.root().to_owned();
    let observed = observe_host_auth(&root, h.as_str()).unwrap();
    let ops = plan_host_auth(&h, &observed, &want).unwrap();
    assert!(matches!(ops.first(), Some(Op::Mkdir { .. })));
    assert_eq!(
        ops.last(),
        Some(&write(
            host_attr(h.as_str(), DHCHAP_KEY),
            want.secret.expose()
        ))
    );
    apply(&mut f.double, &ops).unwrap();
    // The ACL plan finds the entry and only links it.
    let access = HostAccess::Only(BTreeSet::from([h.clone()]));
    let expected = spec
        .namespaces
        .iter()
        .map(|(n, ns)| (*n, ns.identity))
        .collect();
    let acl = plan_acl(&f.state(), &spec.nqn, &access, &expected).unwrap();
    assert!(!acl.iter().any(|op| matches!(op, Op::Mkdir { .. })));
    apply(&mut f.double, &acl).unwrap();
    // Applied: nothing more to plan.
    let observed = observe_host_auth(&root, h.as_str()).unwrap();
    assert_eq!(plan_host_auth(&h, &observed, &want).unwrap(), vec![]);

    let nqn = spec.nqn.as_str();
    let other = DhchapSecret::generate().unwrap();
    assert_eq!(
        errno_of(f.double.host_connects(nqn, h.as_str(), 4420)),
        libc::EACCES
    );
    assert_eq!(
        errno_of(
            f.double
                .host_connects_with_secret(nqn, h.as_str(), 4420, Some(other.expose()))
        ),
        libc::EACCES
    );
    f.double
        .host_connects_with_secret(nqn, h.as_str(), 4420, Some(want.secret.expose()))
        .unwrap();

    // Rotation: only the keys are written; the new secret connects, the old one no longer.
    let rotated = auth();
    let ops = plan_host_auth(&h, &observed, &rotated).unwrap();
    assert_eq!(
        ops,
        vec![
            write(
                host_attr(h.as_str(), DHCHAP_CTRL_KEY),
                rotated.ctrl_secret.as_ref().unwrap().expose()
            ),
            write(host_attr(h.as_str(), DHCHAP_KEY), rotated.secret.expose()),
        ]
    );
    apply(&mut f.double, &ops).unwrap();
    assert_eq!(
        errno_of(f.double.host_connects_with_secret(
            nqn,
            h.as_str(),
            4420,
            Some(want.secret.expose())
        )),
        libc::EACCES
    );
    f.double
        .host_connects_with_secret(nqn, h.as_str(), 4420, Some(rotated.secret.expose()))
        .unwrap();
}

// proves W10
#[test]
fn a_kernel_without_authentication_gets_no_plan() {
    let dir = tempfile::tempdir().unwrap();
    let mut old = ConfigfsDouble::create(dir.path().join("nvmet"))
        .unwrap()
        .without_auth();
    let h = host(2);
    old.execute(&Op::Mkdir {
        path: format!("hosts/{h}").into(),
    })
    .unwrap();
    let observed = observe_host_auth(old.root(), h.as_str()).unwrap();
    assert!(matches!(
        plan_host_auth(&h, &observed, &auth()),
        Err(AuthPlanError::Unsupported { .. })
    ));
}
