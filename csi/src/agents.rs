//! Connections from the controller to storage-node agents, one cached channel per PillarAgent.
//!
//! An agent is reached at `spec.address`: `host:port` with mutual TLS (the controller's client
//! certificate, the agent's CA bundle and server name from the PillarAgent), or, only when the
//! controller was started with `--agent-insecure-plaintext` and the PillarAgent has no `tls`,
//! plaintext: `host:port` or `unix:///path` (single-machine mode, tests).
//!
//! Invariant: no connection goes without TLS unless the operator opted into plaintext. A
//! PillarAgent is an API object; whoever can write one must not be able to point the controller
//! at an unauthenticated endpoint (a unix socket inside the controller's pod included).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use pillar_agent_api::v1::agent_client::AgentClient;
use pillar_state::crd::PillarAgent;
use tokio::sync::Mutex;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Uri};

/// A client for one agent.
pub type Client = AgentClient<Channel>;

/// The controller's own TLS identity towards agents.
#[derive(Clone, Debug)]
pub struct ControllerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Why an agent could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("agent {agent} address {address:?} is invalid")]
    Address {
        agent: String,
        address: String,
        source: tonic::transport::Error,
    },
    #[error("cannot connect to agent {agent} at {address}")]
    Connect {
        agent: String,
        address: String,
        source: tonic::transport::Error,
    },
    #[error("cannot read TLS file {path}")]
    TlsFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "agent {agent} has no TLS settings and the controller does not allow plaintext \
         connections (--agent-insecure-plaintext)"
    )]
    PlaintextRefused { agent: String },
    #[error("agent {agent} has a unix socket address, which takes no TLS, and TLS settings")]
    TlsOverUnixSocket { agent: String },
    #[error("agent {agent} requires TLS but the controller has no client certificate")]
    NoClientIdentity { agent: String },
    #[error("agent {agent} cannot be dialled: {reason}")]
    Dial { agent: String, reason: String },
}

/// Opens a channel to an agent over a transport its owner provides instead of the network: the
/// deterministic simulation (`pillar-sim`) reaches its in-process agents this way. Only
/// [`Agents::with_dialer`] installs one; the controller's binaries never do.
pub type Dialer = Arc<dyn Fn(&PillarAgent) -> Result<Channel, ConnectError> + Send + Sync>;

/// Cached agent channels.
pub struct Agents {
    channels: Mutex<HashMap<String, (String, Client)>>,
    tls: Option<ControllerTls>,
    allow_plaintext: bool,
    timeout: Duration,
    dialer: Option<Dialer>,
}

impl std::fmt::Debug for Agents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agents")
            .field("tls", &self.tls)
            .field("allow_plaintext", &self.allow_plaintext)
            .field("timeout", &self.timeout)
            .field("dialer", &self.dialer.is_some())
            .finish_non_exhaustive()
    }
}

impl Agents {
    /// A pool of agent connections.
    pub fn new(tls: Option<ControllerTls>, allow_plaintext: bool, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            channels: Mutex::new(HashMap::new()),
            tls,
            allow_plaintext,
            timeout,
            dialer: None,
        })
    }

    /// A pool whose every connection is opened by `dialer` (an in-process transport); TLS and
    /// addresses are the dialer's business.
    pub fn with_dialer(dialer: Dialer) -> Arc<Self> {
        Arc::new(Self {
            channels: Mutex::new(HashMap::new()),
            tls: None,
            allow_plaintext: false,
            timeout: Duration::ZERO,
            dialer: Some(dialer),
        })
    }

    /// A client for `agent`, reusing the channel while its address is unchanged.
    pub async fn client(&self, agent: &PillarAgent) -> Result<Client, ConnectError> {
        let name = agent.metadata.name.clone().unwrap_or_default();
        let address = agent.spec.address.clone();
        let mut channels = self.channels.lock().await;
        if let Some((known, client)) = channels.get(&name)
            && *known == address
        {
            return Ok(client.clone());
        }
        let client = self.connect(&name, agent).await?;
        channels.insert(name, (address, client.clone()));
        Ok(client)
    }

    /// Drops a cached channel (after a transport error).
    pub async fn forget(&self, agent: &str) {
        self.channels.lock().await.remove(agent);
    }

    async fn connect(&self, name: &str, agent: &PillarAgent) -> Result<Client, ConnectError> {
        if let Some(dialer) = &self.dialer {
            return Ok(AgentClient::new(dialer(agent)?));
        }
        let address = agent.spec.address.clone();
        let connect_err = |source| ConnectError::Connect {
            agent: name.to_owned(),
            address: address.clone(),
            source,
        };
        if let Some(path) = address.strip_prefix("unix://") {
            if agent.spec.tls.is_some() {
                return Err(ConnectError::TlsOverUnixSocket {
                    agent: name.to_owned(),
                });
            }
            if !self.allow_plaintext {
                return Err(ConnectError::PlaintextRefused {
                    agent: name.to_owned(),
                });
            }
            let path = PathBuf::from(path);
            let channel = Endpoint::from_static("http://agent.invalid")
                .timeout(self.timeout)
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(TokioIo::new(
                            tokio::net::UnixStream::connect(path).await?,
                        ))
                    }
                }))
                .await
                .map_err(connect_err)?;
            return Ok(AgentClient::new(channel));
        }
        let (scheme, tls) = match (&agent.spec.tls, &self.tls) {
            (Some(agent_tls), Some(mine)) => {
                let read = |path: &PathBuf| {
                    std::fs::read(path).map_err(|source| ConnectError::TlsFile {
                        path: path.clone(),
                        source,
                    })
                };
                let ca = PathBuf::from(&agent_tls.ca_bundle_path);
                let config = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(read(&ca)?))
                    .identity(Identity::from_pem(read(&mine.cert)?, read(&mine.key)?))
                    .domain_name(agent_tls.server_name.clone());
                ("https", Some(config))
            }
            (Some(_), None) => {
                return Err(ConnectError::NoClientIdentity {
                    agent: name.to_owned(),
                });
            }
            (None, _) if self.allow_plaintext => ("http", None),
            (None, _) => {
                return Err(ConnectError::PlaintextRefused {
                    agent: name.to_owned(),
                });
            }
        };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|source| ConnectError::Address {
                agent: name.to_owned(),
                address: address.clone(),
                source,
            })?
            .timeout(self.timeout)
            .connect_timeout(self.timeout);
        if let Some(tls) = tls {
            endpoint = endpoint.tls_config(tls).map_err(connect_err)?;
        }
        Ok(AgentClient::new(
            endpoint.connect().await.map_err(connect_err)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use pillar_state::crd::{AgentTls, PillarAgentSpec};

    use super::*;

    fn agent(address: &str, tls: Option<AgentTls>) -> PillarAgent {
        PillarAgent::new(
            "storage-1",
            PillarAgentSpec {
                node: "storage-1".into(),
                address: address.into(),
                tls,
                pools: Vec::new(),
                nvme_address: "192.0.2.1".into(),
                topology: Default::default(),
            },
        )
    }

    // A PillarAgent cannot point the controller at a unix socket without TLS unless the operator
    // opted into plaintext, and a unix address with TLS settings is refused rather than silently
    // used in plaintext.
    #[tokio::test]
    async fn plaintext_needs_the_opt_in_for_unix_sockets_too() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("agent.sock");
        let _listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        let address = format!("unix://{}", socket.display());
        let strict = Agents::new(None, false, Duration::from_secs(1));
        assert!(matches!(
            strict.client(&agent(&address, None)).await,
            Err(ConnectError::PlaintextRefused { .. })
        ));
        assert!(matches!(
            strict.client(&agent("192.0.2.1:9000", None)).await,
            Err(ConnectError::PlaintextRefused { .. })
        ));
        let tls = AgentTls {
            server_name: "storage-1".into(),
            ca_bundle_path: "/nonexistent".into(),
        };
        let relaxed = Agents::new(None, true, Duration::from_secs(1));
        assert!(matches!(
            relaxed.client(&agent(&address, Some(tls))).await,
            Err(ConnectError::TlsOverUnixSocket { .. })
        ));
        assert!(relaxed.client(&agent(&address, None)).await.is_ok());
    }
}
