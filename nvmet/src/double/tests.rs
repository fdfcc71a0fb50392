//! Unit tests of the double's parts that no kernel rule test reaches directly.

use std::path::Path;

use super::parse::{kernel_nguid, kernel_uuid, kstrtobool, kstrtou};
use super::place::{Place, classify};
use super::record::{decode_op, encode_op};
use crate::plan::Op;

#[test]
fn classify_paths() {
    assert_eq!(classify(Path::new("subsystems/x")), Place::Subsystem("x"));
    assert_eq!(
        classify(Path::new("subsystems/x/namespaces/1/enable")),
        Place::NamespaceAttr("x", "1", "enable")
    );
    assert_eq!(
        classify(Path::new("ports/1/subsystems/x")),
        Place::PortSubsystemLink("1", "x")
    );
    assert_eq!(
        classify(Path::new("ports/1/subsystems")),
        Place::PortDefaultGroup
    );
    assert_eq!(classify(Path::new("hosts/h")), Place::Host("h"));
    assert_eq!(classify(Path::new("elsewhere")), Place::Other);
}

#[test]
fn recorded_ops_round_trip_any_value() {
    for op in [
        Op::Mkdir {
            path: "subsystems/x".into(),
        },
        Op::Write {
            path: "a/b".into(),
            value: "tab\there\nnew\\line\\t".into(),
        },
        Op::Symlink {
            target: "hosts/h".into(),
            link: "subsystems/x/allowed_hosts/h".into(),
        },
        Op::Unlink { path: "p".into() },
        Op::Rmdir { path: "q".into() },
    ] {
        assert_eq!(decode_op(&encode_op(&op)).unwrap(), op);
    }
}

#[test]
fn kernel_parsers() {
    assert!(kstrtobool("1\n").unwrap());
    assert!(!kstrtobool("0").unwrap());
    assert!(kstrtobool("").is_err());
    assert!(kstrtobool("2").is_err());
    assert_eq!(kstrtou("0x10", 1000).unwrap(), 16);
    assert_eq!(kstrtou("010", 1000).unwrap(), 8);
    assert!(kstrtou("x", 1000).is_err());
    assert_eq!(
        kernel_nguid("00:11:22:33:44:55:66:77:88:99:aa:bb:cc:dd:ee:ff").unwrap(),
        "00112233-4455-6677-8899-aabbccddeeff"
    );
    assert!(kernel_nguid("0011").is_err());
    assert_eq!(
        kernel_uuid("6A1F3C2E-1B7D-4D2A-9C3E-0F1E2D3C4B5A\n").unwrap(),
        "6a1f3c2e-1b7d-4d2a-9c3e-0f1e2d3c4b5a"
    );
    assert!(kernel_uuid("6a1f3c2e1b7d4d2a9c3e0f1e2d3c4b5a").is_err());
}
