//! Optional TLS for the HTTP and gRPC APIs (`--tls-cert`, `--tls-key`): rustls on the ring
//! provider. The certificate chain and key are read once at start-up (a bad file stops the
//! server before it binds). HTTP: handshakes run in their own tasks with a deadline (at most
//! 256 at once), so a slow or broken client never holds up the others, and a failed handshake (plain HTTP sent to the
//! TLS port, a client that does not trust the certificate) only closes that connection. gRPC:
//! tonic's own TLS with the same files.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; further connections wait in the listen backlog.
const MAX_HANDSHAKES: usize = 256;

/// The PEM files of the API's identity, checked.
#[derive(Clone)]
pub struct TlsFiles {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    config: Arc<rustls::ServerConfig>,
}

impl TlsFiles {
    /// Reads and checks a certificate chain (leaf first) and its private key.
    pub fn load(cert: &Path, key: &Path) -> Result<TlsFiles> {
        let cert_pem = std::fs::read(cert)
            .with_context(|| format!("--tls-cert {}: cannot read it", cert.display()))?;
        let key_pem = std::fs::read(key)
            .with_context(|| format!("--tls-key {}: cannot read it", key.display()))?;
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| {
                format!("--tls-cert {}: not a PEM certificate chain", cert.display())
            })?;
        if chain.is_empty() {
            bail!("--tls-cert {}: no certificate in the file", cert.display());
        }
        let private = PrivateKeyDer::from_pem_slice(&key_pem).with_context(|| {
            format!(
                "--tls-key {}: no PEM private key in the file",
                key.display()
            )
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .with_context(|| {
                format!(
                    "--tls-cert {} / --tls-key {}: the key does not match the certificate or is not usable",
                    cert.display(),
                    key.display()
                )
            })?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsFiles {
            cert_pem,
            key_pem,
            config: Arc::new(config),
        })
    }

    /// tonic's TLS settings for the gRPC API.
    pub fn grpc(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(
            &self.cert_pem,
            &self.key_pem,
        ))
    }

    /// Wraps a bound listener: `accept` yields connections whose handshake has completed.
    pub fn listener(&self, listener: TcpListener) -> std::io::Result<TlsListener> {
        let local = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(self.config.clone());
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let task = tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!("accepting an HTTPS connection: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let handshake =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                    drop(slot);
                    match handshake {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake with {peer} failed: {e}"),
                        Err(_) => tracing::debug!("TLS handshake with {peer} timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, local, task })
    }
}

/// HTTPS connections for `axum::serve`.
pub struct TlsListener {
    rx: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task never ends while the listener lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
