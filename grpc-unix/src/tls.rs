//! The servers' mutually authenticated TLS, done here rather than by tonic so that it runs
//! under the authority rewriter on unix sockets and the client certificate reaches the
//! services on every transport (tonic hands it over for TCP connections only).
//!
//! The configuration is tonic's: client certificates are required and verified against the
//! given CA (WebPKI rules), the server offers HTTP/2 by ALPN, the ring provider.

use std::sync::Arc;

use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
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
    let provider = Arc::new(ring::default_provider());
    let mut roots = RootCertStore::empty();
    let cas = CertificateDer::pem_slice_iter(client_ca)
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsConfigError::ClientCa)?;
    let (added, _) = roots.add_parsable_certificates(cas);
    if added == 0 {
        return Err(TlsConfigError::NoClientCa);
    }
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
            .build()
            .map_err(TlsConfigError::Verifier)?;
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsConfigError::Certificate)?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(TlsConfigError::Key)?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsConfigError::Rustls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(TlsConfigError::Rustls)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}
