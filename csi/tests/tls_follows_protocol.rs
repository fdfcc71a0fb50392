//! `tls: required` on the PillarProtocol (issue 25 item 2) reaches the storage node and the
//! node: the export's port speaks TLS 1.3 only, the publish context tells the node to connect
//! with TLS (and nothing secret), and the admitted node's PSK is in the storage node's keyring
//! (the configfs double's stand-in), equal to what the node derives from its own pair.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pillar_nvmet::{HostNqn, TlsPsk};
use pillar_state::crd::ProtocolTls;
use pillar_state::store::Revision;
use support::{Env, Mode, StoreKind, create, host, node_secret, publish};

#[tokio::test]
async fn tls_required_makes_a_tls_port_and_tells_the_node() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    let proto = env.store.get_protocol("nvme-tcp").await.unwrap().unwrap();
    let mut spec = proto.spec.clone();
    spec.nvme_tcp.tls = ProtocolTls::Required;
    env.store
        .replace_protocol_spec("nvme-tcp", &Revision::of(&proto).unwrap(), spec)
        .await
        .unwrap();
    env.client
        .create_volume(create("sealed", Mode::SingleNodeWriter))
        .await
        .unwrap();
    let ctx = env
        .client
        .controller_publish_volume(publish("sealed", 1, Mode::SingleNodeWriter, false))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert_eq!(
        ctx.get("pillar.io/tls").map(String::as_str),
        Some("required")
    );
    assert!(
        ctx.values().all(|v| !v.contains("DHHC-1")),
        "no secret in the publish context"
    );
    let configfs = &env.agent.configfs;
    let attr = |a: &str| {
        std::fs::read_to_string(configfs.join("ports/4420").join(a))
            .unwrap()
            .trim()
            .to_owned()
    };
    assert_eq!(attr("addr_tsas"), "tls1.3");
    assert_eq!(attr("addr_treq"), "required");
    let h = HostNqn::parse(&host(1)).unwrap();
    let secret =
        pillar_nvmet::DhchapSecret::parse(&node_secret(&env, 1).expect("the node's pair")).unwrap();
    let psk = TlsPsk::derive(
        &secret,
        &h,
        &pillar_nvmet::VolumeId::parse("sealed")
            .unwrap()
            .subsystem_nqn(),
    );
    let stored = std::fs::read_to_string(configfs.join(".double/keyring").join(psk.identity()))
        .expect("the node's PSK in the storage node's keyring");
    assert_eq!(stored, psk.key_hex());
}
