//! The gauges only the leader's resync loop keeps (`volumes_revoking`,
//! `agent_waiting_for_resync`) are not exported by a replica that lost the Lease (issue 22,
//! defect 15): the shipped alerts take the maximum over every replica, and a stale value on an
//! ex-leader would fire them for ever. A replica that regains the Lease counts again at once.
//! And the composition root (`pillar_csi::root`) wires an elected replica as `pillar-csi`
//! serves it: elector, resync loop, metrics, CSI socket, the Lease released at shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use pillar_agent_api::v1 as agent_api;
use pillar_csi::csi::identity_client::IdentityClient;
use pillar_csi::root::{AgentReach, ControllerBuilder, Leader, Limits};
use pillar_state::KubeStore;
use pillar_state::apiserver_double::{ApiServerDouble, HttpMethod, InjectedFailure};
use pillar_state::lease::{Elector, LeaseSettings};
use support::{AGENT, Env, Mode, StoreKind, create, host, publish, unpublish};
use tokio::time::Instant;

async fn http_get(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    out
}

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
}

/// Polls the metrics every 20 ms until `f` holds of them or `within` passes; the last text.
async fn scrape_until(
    addr: std::net::SocketAddr,
    within: Duration,
    f: impl Fn(&str) -> bool,
) -> (bool, String) {
    let start = Instant::now();
    loop {
        let text = http_get(addr).await;
        if f(&text) || start.elapsed() > within {
            return (f(&text), text);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const REVOKING: &str = "pillar_controller_volumes_revoking ";
const LEADER: &str = "pillar_controller_leader ";
const WAITING: &str = "pillar_controller_agent_waiting_for_resync{agent=\"storage-1\"} ";

// Issue 22, defect 15: the leader counts a volume whose revoke the agent refuses; it loses the
// Lease (every renewal fails), and its scrape shows no revoke pending and no agent waiting
// instead of the values its last rounds left (the shipped critical alert `max(...) > 0` would
// fire for ever after a failover); once it renews again it counts at once, not a minute later.
// On the old code the ex-leader kept exporting volumes_revoking 1 and the agent waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ex_leader_exports_no_stale_leader_gauges() {
    let env = Env::start(StoreKind::Kube, true).await;
    let double = env.double.as_ref().unwrap();
    let mut client = env.client.clone();
    client
        .create_volume(create("g-vol", Mode::SingleNodeWriter))
        .await
        .unwrap();
    client
        .controller_publish_volume(publish("g-vol", 1, Mode::SingleNodeWriter, false))
        .await
        .unwrap();
    // The agent's mark far ahead: the revoke is refused and the publication stays revoking.
    let uid = env
        .store
        .get_volume("g-vol")
        .await
        .unwrap()
        .unwrap()
        .metadata
        .uid
        .unwrap();
    agent_api::agent_client::AgentClient::new(support::channel(&env.agent.socket).await)
        .revoke_initiator(agent_api::RevokeInitiatorRequest {
            token: Some(agent_api::FencingToken {
                lifecycle_uid: uid,
                generation: 1_000_000,
            }),
            volume_id: "g-vol".into(),
            host_nqn: host(99),
        })
        .await
        .unwrap();
    client
        .controller_unpublish_volume(unpublish("g-vol", 1))
        .await
        .unwrap_err();

    // A controller replica elected on the Lease, running the resync loop, serving metrics.
    let controller = env.second_controller();
    let settings = LeaseSettings {
        lease_duration: Duration::from_millis(1500),
        renew_deadline: Duration::from_millis(1000),
        retry_period: Duration::from_millis(200),
        ..LeaseSettings::new("pillar-system", "pillar-controller", "controller-a")
    };
    let (elector, leadership) = Elector::new(double.client().unwrap(), settings).unwrap();
    let elector = tokio::spawn(elector.run(std::future::pending()));
    let _loop = controller.spawn_resync_loop(Duration::from_millis(100), leadership.clone());
    let addr = pillar_csi::controller::metrics::serve_metrics(
        "127.0.0.1:0".parse().unwrap(),
        controller.metrics(),
        std::future::pending(),
    )
    .await
    .unwrap();
    let (counted, text) = scrape_until(addr, Duration::from_secs(5), |t| {
        sample(t, LEADER) == Some(1.0) && sample(t, REVOKING) == Some(1.0)
    })
    .await;
    assert!(counted, "the leader did not count the revoke:\n{text}");

    // Every renewal fails for a while (ten of them, ~2 s): the Lease is lost after the renew
    // deadline. The last round before that saw the agent waiting for a resync.
    for _ in 0..10 {
        double.inject_failure(InjectedFailure {
            method: HttpMethod::PUT,
            path_suffix: "/leases/pillar-controller".into(),
            code: 500,
            reason: "InternalError".into(),
            message: "etcd is down".into(),
        });
    }
    let lost = Instant::now();
    while leadership.is_leader() {
        assert!(
            lost.elapsed() < Duration::from_secs(3),
            "never lost the lease"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    controller.metrics().agent_waiting(AGENT, true);
    let text = http_get(addr).await;
    assert_eq!(sample(&text, LEADER), Some(0.0), "{text}");
    assert!(
        sample(&text, REVOKING).unwrap_or(0.0) == 0.0,
        "an ex-leader exports a revoke count:\n{text}"
    );
    assert!(
        sample(&text, WAITING).unwrap_or(0.0) == 0.0,
        "an ex-leader exports an agent waiting:\n{text}"
    );

    // The failures used up, it renews again and counts at once (not a minute after its last
    // count).
    let (recounted, text) = scrape_until(addr, Duration::from_secs(5), |t| {
        sample(t, LEADER) == Some(1.0) && sample(t, REVOKING) == Some(1.0)
    })
    .await;
    assert!(recounted, "the new leader did not count again:\n{text}");
    elector.abort();
}

fn lease_holder(double: &ApiServerDouble) -> Option<String> {
    double
        .lease("pillar-system", "pillar-controller")
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_owned))
}

// The root wires an elected replica as `pillar-csi controller` does: its elector takes the
// Lease, its resync loop watches that leadership (the leader gauge reads 1), its metrics and
// CSI socket answer, and when the service stops the Lease is released before `serve` returns,
// so a standby takes over at once instead of after the lease duration. Checked against a root
// whose `serve` did not stop the elector: the holder was still "controller-a" after `serve`
// returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_elected_controller_from_the_root_leads_serves_and_releases_its_lease() {
    let double = ApiServerDouble::start().await.unwrap();
    let client = double.controller_client().unwrap();
    let settings = LeaseSettings {
        lease_duration: Duration::from_millis(1500),
        renew_deadline: Duration::from_millis(1000),
        retry_period: Duration::from_millis(200),
        ..LeaseSettings::new("pillar-system", "pillar-controller", "controller-a")
    };
    let leader = Leader::elected(Elector::new(client.clone(), settings).unwrap());
    let wired = ControllerBuilder::new(
        Arc::new(KubeStore::new(client)),
        AgentReach::network(None, false),
    )
    .resync_every(Duration::from_millis(100), leader)
    .metrics_at(Some("127.0.0.1:0".parse().unwrap()))
    .build()
    .await
    .unwrap();
    let addr = wired.metrics_addr().expect("metrics served");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("controller.sock");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn({
        let socket = socket.clone();
        async move {
            wired
                .serve(&socket, Limits::default(), async {
                    let _ = stopped.await;
                })
                .await
        }
    });

    let (leads, text) = scrape_until(addr, Duration::from_secs(5), |t| {
        sample(t, LEADER) == Some(1.0)
    })
    .await;
    assert!(leads, "the root's replica never led:\n{text}");
    assert_eq!(lease_holder(&double).as_deref(), Some("controller-a"));
    let info = IdentityClient::new(support::channel(&socket).await)
        .get_plugin_info(pillar_csi::csi::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!info.name.is_empty());

    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
    assert_eq!(
        lease_holder(&double),
        None,
        "the Lease was not released when the service stopped"
    );
}
