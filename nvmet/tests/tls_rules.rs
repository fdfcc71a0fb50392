//! TLS 1.3 for NVMe/TCP on ports (`docs/rules.md` K31): the double has `addr_tsas` where the
//! kernel has TLS for the target and refuses what the kernel refuses, and the planner makes a
//! TLS port with its secure channel written after the transport.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Fixture, export, only};
use pillar_nvmet::{
    ADDR_TREQ, ADDR_TSAS, ConfigfsDouble, Executor, Op, PlanError, PortId, PortSpec, observe,
    plan_export,
};

fn errno_of(r: std::io::Result<()>) -> i32 {
    r.expect_err("the kernel refuses this")
        .raw_os_error()
        .unwrap()
}

fn write(port: &str, attr: &str, value: &str) -> Op {
    Op::Write {
        path: format!("ports/{port}/{attr}").into(),
        value: value.into(),
    }
}

fn mkdir_port(double: &mut ConfigfsDouble, port: &str) {
    double
        .execute(&Op::Mkdir {
            path: format!("ports/{port}").into(),
        })
        .unwrap();
}

fn attr(double: &ConfigfsDouble, port: &str, attr: &str) -> String {
    std::fs::read_to_string(double.root().join("ports").join(port).join(attr))
        .unwrap()
        .trim_end()
        .to_owned()
}

fn tls_port(id: u16, svc: u16) -> std::collections::BTreeMap<PortId, PortSpec> {
    [(
        PortId::new(id),
        PortSpec::tcp(format!("127.0.0.1:{svc}").parse().unwrap()).with_tls(),
    )]
    .into_iter()
    .collect()
}

// proves K31
#[test]
fn the_double_takes_the_secure_channel_as_the_kernel_does() {
    let mut f = Fixture::new();
    let d = &mut f.double;
    mkdir_port(d, "1");
    // No transport yet: tsas is refused (`nvmet_addr_tsas_store` wants TCP).
    assert_eq!(
        errno_of(d.execute(&write("1", ADDR_TSAS, "tls1.3"))),
        libc::EINVAL
    );
    d.execute(&write("1", "addr_trtype", "tcp")).unwrap();
    assert_eq!(attr(d, "1", ADDR_TSAS), "none");
    assert_eq!(attr(d, "1", ADDR_TREQ), "not specified");
    assert_eq!(
        errno_of(d.execute(&write("1", ADDR_TSAS, "tls1.2"))),
        libc::EINVAL
    );
    d.execute(&write("1", ADDR_TSAS, "tls1.3")).unwrap();
    // TLS makes an unspecified requirement `required`, and `not specified` is refused then.
    assert_eq!(attr(d, "1", ADDR_TREQ), "required");
    assert_eq!(
        errno_of(d.execute(&write("1", ADDR_TREQ, "not specified"))),
        libc::EINVAL
    );
    d.execute(&write("1", ADDR_TREQ, "not required")).unwrap();
    d.execute(&write("1", ADDR_TREQ, "required")).unwrap();
    // Writing the transport again resets the secure channel.
    d.execute(&write("1", "addr_trtype", "tcp")).unwrap();
    assert_eq!(attr(d, "1", ADDR_TSAS), "none");
    d.execute(&write("1", ADDR_TSAS, "none")).unwrap();
    assert_eq!(attr(d, "1", ADDR_TREQ), "not specified");
}

// proves K31
#[test]
fn a_kernel_without_tls_has_no_secure_channel_attribute() {
    let dir = tempfile::tempdir().unwrap();
    let mut old = ConfigfsDouble::create(dir.path().join("nvmet"))
        .unwrap()
        .without_tls();
    mkdir_port(&mut old, "1");
    old.execute(&write("1", "addr_trtype", "tcp")).unwrap();
    assert!(!old.root().join("ports/1").join(ADDR_TSAS).exists());
    assert_eq!(
        errno_of(old.execute(&write("1", ADDR_TSAS, "tls1.3"))),
        libc::ENOENT
    );
    // `addr_treq` is older than TLS (6.1 has it), and takes no TLS rule there.
    old.execute(&write("1", ADDR_TREQ, "not specified"))
        .unwrap();
    let port = &observe(old.root()).unwrap().ports[&PortId::new(1)];
    assert_eq!(port.tsas, None);
    assert!(!port.tls());
}

// proves K31
#[test]
fn a_tls_port_is_made_with_its_secure_channel_and_never_shared_with_a_plain_one() {
    let mut f = Fixture::new();
    let spec = export("pvc-tls", &f.device, only(&[1]), tls_port(4420, 4420));
    let plan = f.export(&spec);
    let writes: Vec<String> = plan
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Write { path, value } if path.starts_with("ports") => Some(format!(
                "{}={value}",
                path.file_name().unwrap().to_string_lossy()
            )),
            _ => None,
        })
        .collect();
    let at = |name: &str| writes.iter().position(|w| w.starts_with(name)).unwrap();
    assert!(at("addr_trtype") < at("addr_tsas=tls1.3"));
    assert!(at("addr_tsas") < at("addr_treq=required"));
    let state = f.state();
    let port = &state.ports[&PortId::new(4420)];
    assert!(port.tls() && port.matches(&tls_port(4420, 4420)[&PortId::new(4420)]));
    // The port is shared: a plain export on the same port is a conflict, never a rewrite.
    let plain = export(
        "pvc-plain",
        &f.device,
        only(&[2]),
        common::tcp_port(4420, 4420),
    );
    let err = plan_export(&state, &plain).unwrap_err();
    assert!(
        matches!(err, PlanError::PortConflict { ref found, .. } if found.ends_with("tls1.3")),
        "{err}"
    );
    // And the other way round.
    let mut g = Fixture::new();
    g.export(&export(
        "pvc-plain",
        &g.device,
        only(&[2]),
        common::tcp_port(4420, 4420),
    ));
    let err = plan_export(&g.state(), &spec).unwrap_err();
    assert!(
        matches!(err, PlanError::PortConflict { ref wanted, .. } if wanted.ends_with("tls1.3")),
        "{err}"
    );
}
