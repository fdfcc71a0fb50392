//! The agent's gRPC server is bounded (issue 22, "Bounded under load"): calls in flight,
//! connections, request message size, streams per connection and header lists; a bound hit is
//! answered RESOURCE_EXHAUSTED or UNAVAILABLE and leaves nothing applied.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use pillar_agent::Hooks;
use pillar_agent::hooks::HookPoint;
use pillar_agent::{EngineKind, serve_with_limits};
use pillar_agent::{PoolConfig, PoolKind};
use pillar_agent_api::v1 as api;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_grpc_unix::Limits;
use support::{Dirs, connect, create_req, export_req, snapshot};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic::transport::{Channel, Endpoint, Uri};

const SMALL: Limits = Limits {
    max_connections: 3,
    max_concurrent_streams: 8,
    max_in_flight: 2,
    max_request_bytes: 1024,
    handshake_timeout_secs: 10,
};

/// An agent on a plain-file pool (no loop devices) within `limits`; stopped when the sender is
/// dropped.
async fn start(dirs: &Dirs, limits: Limits, hooks: Hooks) -> tokio::sync::oneshot::Sender<()> {
    let mut config = dirs.config(EngineKind::Sync);
    config.pools = vec![PoolConfig {
        name: "p1".into(),
        kind: PoolKind::PlainFile { dir: dirs.pool() },
    }];
    config.settings.hooks = hooks;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with_limits(config, limits, async {
        let _ = stopped.await;
    }));
    stop
}

async fn channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_owned();
    Endpoint::from_static("http://agent.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let s = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(s).await?,
                ))
            }
        }))
        .await
}

/// Releases a stalled hook when dropped, so a failing test does not hang on its stall.
struct Released(std::sync::Arc<pillar_agent::hooks::Gate>);

impl Drop for Released {
    fn drop(&mut self) {
        self.0.release();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_beyond_the_in_flight_bound_is_refused_before_anything_is_done() {
    let limits = Limits {
        max_in_flight: 1,
        ..SMALL
    };
    let dirs = Dirs::new();
    let hooks = Hooks::default();
    let _stop = start(&dirs, limits, hooks.clone()).await;
    let client = connect(&dirs.socket()).await;
    client
        .clone()
        .resync_exports(api::ResyncExportsRequest {
            exports: vec![],
            ..Default::default()
        })
        .await
        .unwrap();
    client
        .clone()
        .create_volume(create_req("u1", 1, "v1", 1 << 20))
        .await
        .unwrap();
    // An export stalled inside its configfs apply: the server's one call in flight.
    let gate = Released(hooks.stall(HookPoint::ConfigfsApply));
    let export = {
        let mut c = client.clone();
        tokio::spawn(async move { c.export(export_req("u1", 2, "v1", true, &[1])).await })
    };
    let reached = tokio::task::spawn_blocking({
        let gate = std::sync::Arc::clone(&gate.0);
        move || gate.wait_reached(1, Duration::from_secs(10))
    });
    assert!(reached.await.unwrap(), "the export did not stall");

    let before = (snapshot(&dirs.state()), snapshot(&dirs.pool()));
    for _ in 0..3 {
        let status = client
            .clone()
            .create_volume(create_req("u2", 1, "v2", 1 << 20))
            .await
            .expect_err("a second call while one is in flight");
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    }
    assert_eq!(
        before,
        (snapshot(&dirs.state()), snapshot(&dirs.pool())),
        "a refused call changed something"
    );

    drop(gate);
    hooks.clear(HookPoint::ConfigfsApply);
    export.await.unwrap().unwrap();
    client
        .clone()
        .create_volume(create_req("u2", 1, "v2", 1 << 20))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_connection_beyond_the_bound_is_refused_unavailable() {
    let dirs = Dirs::new();
    let _stop = start(&dirs, SMALL, Hooks::default()).await;
    let mut held = vec![connect(&dirs.socket()).await];
    for _ in 1..SMALL.max_connections {
        let mut c = AgentClient::new(channel(&dirs.socket()).await.unwrap());
        c.health(api::HealthRequest {}).await.unwrap();
        held.push(c);
    }
    match channel(&dirs.socket()).await {
        Err(_) => {}
        Ok(c) => {
            let status = AgentClient::new(c)
                .health(api::HealthRequest {})
                .await
                .expect_err("a connection beyond the bound was served");
            assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        }
    }
    // A connection closed gives its place back.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(c) = channel(&dirs.socket()).await
            && AgentClient::new(c)
                .health(api::HealthRequest {})
                .await
                .is_ok()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no connection served after one closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_request_message_over_the_bound_is_refused_resource_exhausted() {
    let dirs = Dirs::new();
    let _stop = start(&dirs, SMALL, Hooks::default()).await;
    let mut client = connect(&dirs.socket()).await;
    let before = (snapshot(&dirs.state()), snapshot(&dirs.pool()));
    let big = "v".repeat(SMALL.max_request_bytes);
    let status = client
        .create_volume(create_req("u1", 1, &big, 1 << 20))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(before, (snapshot(&dirs.state()), snapshot(&dirs.pool())));
    client
        .create_volume(create_req("u1", 1, "v1", 1 << 20))
        .await
        .unwrap();
}

/// The server's SETTINGS: streams per connection, the per-stream window and the decoded
/// header list size the rewriter also holds to.
#[tokio::test]
async fn the_server_announces_its_stream_window_and_header_bounds() {
    let dirs = Dirs::new();
    let _stop = start(&dirs, SMALL, Hooks::default()).await;
    connect(&dirs.socket()).await;
    let mut conn = tokio::net::UnixStream::connect(dirs.socket())
        .await
        .unwrap();
    conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut header = [0_u8; 9];
    conn.read_exact(&mut header).await.unwrap();
    assert_eq!(header[3], 0x4, "the server's first frame is SETTINGS");
    let len = usize::from(header[1]) << 8 | usize::from(header[2]);
    let mut payload = vec![0; len];
    conn.read_exact(&mut payload).await.unwrap();
    let settings: Vec<(u16, u32)> = payload
        .chunks(6)
        .map(|s| {
            (
                u16::from_be_bytes([s[0], s[1]]),
                u32::from_be_bytes([s[2], s[3], s[4], s[5]]),
            )
        })
        .collect();
    for expected in [
        (0x3, SMALL.max_concurrent_streams),
        (0x4, pillar_grpc_unix::STREAM_WINDOW),
        (
            0x6,
            u32::try_from(pillar_grpc_unix::rewrite::MAX_HEADER_LIST_SIZE).unwrap(),
        ),
    ] {
        assert!(
            settings.contains(&expected),
            "{expected:?} not in {settings:?}"
        );
    }
}
