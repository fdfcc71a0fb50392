//! The servers' mutually authenticated TLS, done here rather than by tonic so that it runs
//! under the authority rewriter on unix sockets and the client certificate reaches the
//! services on every transport (tonic hands it over for TCP connections only).
//!
//! The configuration is tonic's: client certificates are required and verified against the
//! given CA (WebPKI rules), the server offers HTTP/2 by ALPN, the ring provider. A server whose
//! clients prove who they are otherwise (the controller's credentials endpoint: a node's
//! ServiceAccount token) is served without client certificates ([`server_config`],
//! [`TlsFiles::load_server_only`]).
//!
//! [`TlsFiles`] serves from PEM files and reads them again when they change (a rotated
//! Kubernetes Secret, cert-manager's renewal): each accepted connection gets the configuration
//! of the files as they are then. Invariants: a server never starts without a configuration
//! that loads; a change that does not load (a half-written key, a certificate without its key)
//! leaves the last good configuration in use and is logged, and is tried again only when the
//! files change again; a connection keeps the configuration it was accepted with.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the server certificate is not PEM")]
    Certificate(#[source] tokio_rustls::rustls::pki_types::pem::Error),
    #[error("the server private key is not a PEM key")]
    Key(#[source] tokio_rustls::rustls::pki_types::pem::Error),
    #[error("the client CA is not PEM")]
    ClientCa(#[source] tokio_rustls::rustls::pki_types::pem::Error),
    #[error("the client CA holds no certificate this can use")]
    NoClientCa,
    #[error("the client certificate verifier")]
    Verifier(#[source] tokio_rustls::rustls::server::VerifierBuilderError),
    #[error("rustls refused the configuration")]
    Rustls(#[source] tokio_rustls::rustls::Error),
}

/// A server configuration presenting `cert`/`key` (PEM) and requiring a client certificate
/// signed by `client_ca` (PEM).
pub fn mtls_server_config(
    cert: &[u8],
    key: &[u8],
    client_ca: &[u8],
) -> Result<Arc<ServerConfig>, TlsConfigError> {
    build_config(cert, key, Some(client_ca))
}

/// A server configuration presenting `cert`/`key` (PEM) that asks no client certificate: for
/// a service whose callers authenticate in the call itself.
pub fn server_config(cert: &[u8], key: &[u8]) -> Result<Arc<ServerConfig>, TlsConfigError> {
    build_config(cert, key, None)
}

fn build_config(
    cert: &[u8],
    key: &[u8],
    client_ca: Option<&[u8]>,
) -> Result<Arc<ServerConfig>, TlsConfigError> {
    let provider = Arc::new(ring::default_provider());
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsConfigError::Certificate)?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(TlsConfigError::Key)?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(TlsConfigError::Rustls)?;
    let builder = match client_ca {
        Some(client_ca) => builder.with_client_cert_verifier(client_verifier(client_ca, provider)?),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(TlsConfigError::Rustls)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

fn client_verifier(
    client_ca: &[u8],
    provider: Arc<tokio_rustls::rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn tokio_rustls::rustls::server::danger::ClientCertVerifier>, TlsConfigError> {
    let mut roots = RootCertStore::empty();
    let cas = CertificateDer::pem_slice_iter(client_ca)
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsConfigError::ClientCa)?;
    let (added, _) = roots.add_parsable_certificates(cas);
    if added == 0 {
        return Err(TlsConfigError::NoClientCa);
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(TlsConfigError::Verifier)
}

/// Where a server's TLS configuration comes from at each accepted connection.
#[derive(Clone, Debug)]
pub enum TlsSource {
    /// One configuration for the server's life.
    Fixed(Arc<ServerConfig>),
    /// The files' configuration, read again when they change.
    Files(Arc<TlsFiles>),
}

impl TlsSource {
    /// The configuration a connection accepted now is served with.
    pub fn current(&self) -> Arc<ServerConfig> {
        match self {
            Self::Fixed(config) => Arc::clone(config),
            Self::Files(files) => files.current(),
        }
    }
}

impl From<Arc<ServerConfig>> for TlsSource {
    fn from(config: Arc<ServerConfig>) -> Self {
        Self::Fixed(config)
    }
}

/// A TLS configuration read from a certificate, a key and (for mutual TLS) a client CA in PEM
/// files, and read again when one of them changes (see the module docs).
#[derive(Debug)]
pub struct TlsFiles {
    /// Certificate, key, and the client CA where client certificates are required, in that
    /// order.
    paths: Vec<PathBuf>,
    loaded: Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    /// The files as last seen, loaded or not.
    seen: Vec<Stamp>,
    /// The last configuration that loaded.
    config: Arc<ServerConfig>,
    /// How many times the files changed and loaded.
    reloads: u64,
}

/// What tells a file's content changed without reading it: a Secret volume swaps a symlink to
/// a new file (another inode), an editor or `cp` rewrites in place (mtime, length).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
}

fn stamp(path: &Path) -> Result<Stamp, TlsConfigError> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).map_err(|source| TlsConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Stamp {
        dev: meta.dev(),
        ino: meta.ino(),
        len: meta.len(),
        modified: meta.modified().ok(),
    })
}

impl TlsFiles {
    /// Reads the files; an error when they do not make a configuration (the server must not
    /// start then).
    pub fn load(
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
        client_ca: impl Into<PathBuf>,
    ) -> Result<Self, TlsConfigError> {
        Self::from_paths(vec![cert.into(), key.into(), client_ca.into()])
    }

    /// As [`Self::load`], for a server that asks no client certificate ([`server_config`]).
    pub fn load_server_only(
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Result<Self, TlsConfigError> {
        Self::from_paths(vec![cert.into(), key.into()])
    }

    fn from_paths(paths: Vec<PathBuf>) -> Result<Self, TlsConfigError> {
        let (seen, config) = Self::read(&paths)?;
        Ok(Self {
            paths,
            loaded: Mutex::new(Loaded {
                seen,
                config,
                reloads: 0,
            }),
        })
    }

    /// How many times a change of the files was loaded since [`Self::load`].
    pub fn reloads(&self) -> u64 {
        self.lock().reloads
    }

    /// The configuration of the files as they are now, or the last one that loaded.
    pub fn current(&self) -> Arc<ServerConfig> {
        let mut loaded = self.lock();
        let now = self
            .paths
            .iter()
            .map(|p| stamp(p))
            .collect::<Result<Vec<_>, _>>();
        match now {
            Ok(now) if now[..] == loaded.seen[..] => {}
            Ok(_) => match Self::read(&self.paths) {
                Ok((seen, config)) => {
                    tracing::info!(cert = %self.paths[0].display(), "TLS material changed: reloaded");
                    loaded.seen = seen;
                    loaded.config = config;
                    loaded.reloads += 1;
                }
                Err(e) => {
                    tracing::warn!(
                        error = %chain(&e),
                        "TLS material changed but does not load; serving with the previous"
                    );
                    // Not tried again until the files change again.
                    if let Ok(seen) = self.stamps() {
                        loaded.seen = seen;
                    }
                }
            },
            // A file gone for a moment (a non-atomic replacement): keep serving.
            Err(e) => {
                tracing::warn!(error = %chain(&e), "TLS material unreadable; serving with the previous")
            }
        }
        Arc::clone(&loaded.config)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Loaded> {
        self.loaded.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stamps(&self) -> Result<Vec<Stamp>, TlsConfigError> {
        self.paths.iter().map(|p| stamp(p)).collect()
    }

    /// Stamps taken before the reads: a change during the reads shows as a change next time.
    fn read(paths: &[PathBuf]) -> Result<(Vec<Stamp>, Arc<ServerConfig>), TlsConfigError> {
        let seen = paths
            .iter()
            .map(|p| stamp(p))
            .collect::<Result<Vec<_>, _>>()?;
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|source| TlsConfigError::Read {
                path: path.clone(),
                source,
            })
        };
        let files = paths.iter().map(read).collect::<Result<Vec<_>, _>>()?;
        // Certificate and key always; the client CA where one was given.
        let config = build_config(&files[0], &files[1], files.get(2).map(Vec::as_slice))?;
        Ok((seen, config))
    }
}

/// An error with its sources, for a log line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
