//! The node plugin's side of the delivery: at a NodeStageVolume whose publish context requires
//! DH-HMAC-CHAP (`pillar.io/auth: dhchap`) and whose `secrets` carry no node secret, ask the
//! controller's credentials endpoint for this node's pair, with the node plugin's projected
//! ServiceAccount token, and stage with what it answered.
//!
//! Invariants:
//! - Fail closed: an endpoint that cannot be reached, answers late or refuses, a token or CA
//!   file that cannot be read, or an answer for another node or host NQN or with a malformed
//!   secret fails the stage (the node's `CredentialsNotDelivered`, naming the missing secret;
//!   UNAVAILABLE where a retry may help, FAILED_PRECONDITION otherwise), before anything of the
//!   stage is done: never a connect without the secret.
//! - The controller's certificate is checked against the CA file, for the server name given
//!   (or the endpoint's host); the token and the CA are read again at every request (kubelet
//!   rotates the token; the CA may rotate), nothing is cached: a rotated pair is taken at the
//!   next stage.
//! - Bounded: the token file is read up to [`MAX_TOKEN_BYTES`], the answer decoded up to
//!   [`MAX_ANSWER_BYTES`], the whole exchange within the configured timeout.
//! - Never logs the token or a secret.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pillar_nvmet::{DhchapSecret, HostNqn, VolumeId};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

use super::proto::GetNodeCredentialsRequest;
use super::proto::node_credentials_client::NodeCredentialsClient;
use crate::context;

/// The largest token file read (a projected token is about 1 KiB).
pub const MAX_TOKEN_BYTES: u64 = 64 * 1024;
/// The largest answer decoded (two secrets and two names).
pub const MAX_ANSWER_BYTES: usize = 16 * 1024;

/// Where the projected token is mounted (deploy/base/node.yaml).
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/pillar-csi.io/node-credentials/token";
/// Where the CA that signed the endpoint's certificate is mounted (deploy/base/node.yaml).
pub const DEFAULT_CA_FILE: &str = "/etc/pillar/credentials-ca/ca.crt";

/// The node plugin's flags for the endpoint.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "Credentials endpoint (this node's DH-HMAC-CHAP pair)")]
pub struct ClientArgs {
    /// The controller's credentials endpoint (`https://HOST:PORT`). Unset: a stage that
    /// requires DH-HMAC-CHAP needs its secret in NodeStageVolume's `secrets`.
    #[arg(long, env = "PILLAR_CREDENTIALS_ENDPOINT")]
    pub credentials_endpoint: Option<String>,
    /// The DNS name the endpoint's certificate must carry (default: the endpoint's host).
    #[arg(long)]
    pub credentials_server_name: Option<String>,
    /// The CA (PEM) that checks the endpoint's certificate.
    #[arg(long, default_value = DEFAULT_CA_FILE)]
    pub credentials_ca: PathBuf,
    /// The node plugin's projected ServiceAccount token (audience
    /// `pillar-csi.io/node-credentials`), read at every request.
    #[arg(long, default_value = DEFAULT_TOKEN_FILE)]
    pub credentials_token_file: PathBuf,
    /// Seconds one request may take, connect included.
    #[arg(long, default_value_t = 10)]
    pub credentials_timeout_secs: u64,
}

impl ClientArgs {
    /// The client these flags describe; `None` when no endpoint was given.
    pub fn client(&self) -> Option<CredentialsClient> {
        self.credentials_endpoint
            .as_ref()
            .map(|endpoint| CredentialsClient {
                endpoint: endpoint.clone(),
                server_name: self.credentials_server_name.clone(),
                ca_file: self.credentials_ca.clone(),
                token_file: self.credentials_token_file.clone(),
                timeout: Duration::from_secs(self.credentials_timeout_secs),
            })
    }
}

/// Why this node's pair was not delivered.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("cannot read the node plugin's ServiceAccount token file {path}")]
    Token {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the token file {path} is empty or larger than {MAX_TOKEN_BYTES} bytes")]
    TokenSize { path: PathBuf },
    #[error("cannot read the CA file {path} that checks the controller's certificate")]
    Ca {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the credentials endpoint {endpoint:?} is not an https URL with a host")]
    Endpoint { endpoint: String },
    #[error("cannot reach the controller's credentials endpoint {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the controller's credentials endpoint answered {code:?}: {message}")]
    Refused { code: tonic::Code, message: String },
    #[error(
        "the controller answered the pair of node {node:?} host NQN {host_nqn:?}; this node is \
         {own_node:?} with host NQN {own_nqn:?}"
    )]
    OtherHost {
        node: String,
        host_nqn: String,
        own_node: String,
        own_nqn: String,
    },
    #[error("the controller answered a malformed {key}: {reason}")]
    Malformed { key: &'static str, reason: String },
}

impl FetchError {
    /// UNAVAILABLE where a retry may get the pair (the endpoint or the API server is down,
    /// busy or slow), FAILED_PRECONDITION where it is refused or wrong until someone acts.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Self::Connect { .. }
            | Self::Refused {
                code:
                    Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::ResourceExhausted
                    | Code::Cancelled
                    | Code::Aborted
                    | Code::Unknown,
                ..
            } => Code::Unavailable,
            _ => Code::FailedPrecondition,
        }
    }
}

/// A pair as the controller answered it, checked.
#[derive(Clone, PartialEq, Eq)]
pub struct Delivered {
    /// The node's secret (`DHHC-1:...`).
    pub secret: String,
    /// The controller secret, where the pair has one.
    pub ctrl_secret: Option<String>,
}

impl std::fmt::Debug for Delivered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivered").finish_non_exhaustive()
    }
}

/// The node plugin's client of the controller's credentials endpoint.
#[derive(Clone, Debug)]
pub struct CredentialsClient {
    /// `https://HOST:PORT`.
    pub endpoint: String,
    /// The name the certificate must carry; the endpoint's host when `None`.
    pub server_name: Option<String>,
    pub ca_file: PathBuf,
    pub token_file: PathBuf,
    pub timeout: Duration,
}

fn read_token(path: &Path) -> Result<String, FetchError> {
    let err = |source| FetchError::Token {
        path: path.to_path_buf(),
        source,
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(err)?
        .take(MAX_TOKEN_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(err)?;
    let token = text.trim();
    if token.is_empty() || text.len() as u64 > MAX_TOKEN_BYTES {
        return Err(FetchError::TokenSize {
            path: path.to_path_buf(),
        });
    }
    Ok(token.to_owned())
}

impl CredentialsClient {
    /// This node's pair, for the stage of `volume` (named in the controller's log).
    pub async fn fetch(
        &self,
        node: &str,
        host_nqn: &HostNqn,
        volume: &VolumeId,
    ) -> Result<Delivered, FetchError> {
        let token = read_token(&self.token_file)?;
        let ca = std::fs::read(&self.ca_file).map_err(|source| FetchError::Ca {
            path: self.ca_file.clone(),
            source,
        })?;
        let bad_endpoint = || FetchError::Endpoint {
            endpoint: self.endpoint.clone(),
        };
        let uri: tonic::transport::Uri = self.endpoint.parse().map_err(|_| bad_endpoint())?;
        let host = match (uri.scheme_str(), uri.host()) {
            (Some("https"), Some(host)) => host.trim_start_matches('[').trim_end_matches(']'),
            _ => return Err(bad_endpoint()),
        };
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .domain_name(self.server_name.as_deref().unwrap_or(host));
        let connect_err = |source| FetchError::Connect {
            endpoint: self.endpoint.clone(),
            source,
        };
        let channel = Endpoint::from(uri.clone())
            .connect_timeout(self.timeout)
            .timeout(self.timeout)
            .tls_config(tls)
            .map_err(connect_err)?
            .connect()
            .await
            .map_err(connect_err)?;
        let answer = NodeCredentialsClient::new(channel)
            .max_decoding_message_size(MAX_ANSWER_BYTES)
            .get_node_credentials(GetNodeCredentialsRequest {
                token,
                node: node.to_owned(),
                host_nqn: host_nqn.to_string(),
                volume_id: volume.to_string(),
            })
            .await
            .map_err(|s| FetchError::Refused {
                code: s.code(),
                message: s.message().to_owned(),
            })?
            .into_inner();
        if answer.node != node || answer.host_nqn != host_nqn.as_str() {
            return Err(FetchError::OtherHost {
                node: answer.node,
                host_nqn: answer.host_nqn,
                own_node: node.to_owned(),
                own_nqn: host_nqn.to_string(),
            });
        }
        let checked = |key: &'static str, v: &str| {
            DhchapSecret::parse(v)
                .map(|_| ())
                .map_err(|e| FetchError::Malformed {
                    key,
                    reason: e.to_string(),
                })
        };
        checked(context::SECRET_DHCHAP, &answer.dhchap_secret)?;
        let ctrl_secret = Some(answer.dhchap_ctrl_secret).filter(|s| !s.is_empty());
        if let Some(ctrl) = &ctrl_secret {
            checked(context::SECRET_DHCHAP_CTRL, ctrl)?;
        }
        Ok(Delivered {
            secret: answer.dhchap_secret,
            ctrl_secret,
        })
    }
}
