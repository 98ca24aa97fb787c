//! Cluster identities: a cluster CA, one certificate per node or coordinator with its id as
//! the certificate's DNS name, and the mutual-TLS configurations of the QUIC endpoints
//! (../shared/CONVENTIONS.md "Auth": `--certs DIR` holds `ca.pem`, `ID.pem`, `ID.key`).
//!
//! Both sides authenticate: a node accepts only clients whose certificate chains to the
//! cluster CA and names an allowed coordinator id ([`peer_id`]), checked before any frame is
//! read; a coordinator connects to a node under the node's id as TLS server name, so a
//! certificate for any other id fails the handshake. There is no "skip verification" path.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::cluster::check_id;

/// ALPN of the cluster protocol (a peer speaking anything else fails the handshake).
pub const ALPN: &[u8] = b"ternfleet/1";
/// QUIC keep-alive: a silent connection still carries a packet this often.
pub const KEEP_ALIVE: Duration = Duration::from_millis(500);
/// QUIC idle timeout: a connection that hears nothing this long is closed. Longer than
/// several keep-alives; shorter than anything a user would call a hang. Per-call deadlines
/// (the coordinator's step deadline) detect a stalled node sooner.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest packet path-MTU discovery tries (see `transport`): 10 of them fit one 64 KB
/// segmentation-offload send.
pub const MTU_UPPER_BOUND: u16 = 6_500;

/// Errors making or loading identities.
#[derive(Debug, thiserror::Error)]
pub enum MtlsError {
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("{0}")]
    Invalid(String),
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Tls(String),
}

fn file_err(path: &Path, msg: impl Into<String>) -> MtlsError {
    MtlsError::File {
        path: path.to_owned(),
        msg: msg.into(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, MtlsError> {
    std::fs::read(path).map_err(|e| file_err(path, format!("cannot read it: {e}")))
}

/// Writes `data` to `path`, refusing to replace an existing file; `private`: mode 0600.
fn write_new(path: &Path, data: &str, private: bool) -> Result<(), MtlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    if private {
        o.mode(0o600);
    }
    let mut f = o.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            file_err(path, "already exists (not replaced; remove it first)")
        } else {
            file_err(path, format!("cannot create it: {e}"))
        }
    })?;
    f.write_all(data.as_bytes())
        .map_err(|e| file_err(path, format!("cannot write it: {e}")))
}

fn validity(p: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::days(1);
    p.not_after = now + time::Duration::days(days);
}

/// `ternfleet certs init`: a new cluster CA in `dir` (`ca.pem`, `ca.key`, valid 10 years).
/// Refuses to replace an existing CA.
pub fn init_ca(dir: &Path) -> Result<PathBuf, MtlsError> {
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, format!("cannot create it: {e}")))?;
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "ternfleet cluster CA");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut p, 3650);
    let cert = p.self_signed(&key)?;
    let ca = dir.join("ca.pem");
    write_new(&dir.join("ca.key"), &key.serialize_pem(), true)?;
    write_new(&ca, &cert.pem(), false)?;
    Ok(ca)
}

/// `ternfleet certs issue`: a certificate for `id` signed by the CA in `dir` (`ID.pem`,
/// `ID.key`, valid 2 years; usable as TLS server and client). The id is the certificate's
/// DNS name and common name.
pub fn issue(dir: &Path, id: &str) -> Result<(PathBuf, PathBuf), MtlsError> {
    check_id(id).map_err(MtlsError::Invalid)?;
    if id == "ca" {
        return Err(MtlsError::Invalid(
            "id \"ca\" is the cluster CA's file name; choose another".into(),
        ));
    }
    let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    let ca_text = String::from_utf8(read(&ca_pem)?).map_err(|_| file_err(&ca_pem, "not PEM"))?;
    let key_text = String::from_utf8(read(&ca_key)?).map_err(|_| file_err(&ca_key, "not PEM"))?;
    let ca_key = KeyPair::from_pem(&key_text)
        .map_err(|e| file_err(&ca_key, format!("not a private key: {e}")))?;
    let ca = CertificateParams::from_ca_cert_pem(&ca_text)
        .map_err(|e| file_err(&ca_pem, format!("not a CA certificate: {e}")))?
        .self_signed(&ca_key)?;
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(vec![id.to_string()])?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, id);
    p.distinguished_name = dn;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    validity(&mut p, 730);
    let cert = p.signed_by(&key, &ca, &ca_key)?;
    let (pem, kp) = (dir.join(format!("{id}.pem")), dir.join(format!("{id}.key")));
    write_new(&kp, &key.serialize_pem(), true)?;
    write_new(&pem, &cert.pem(), false)?;
    Ok((pem, kp))
}

/// One process's cluster identity, loaded from `--certs DIR`.
#[derive(Debug)]
pub struct Identity {
    pub id: String,
    ca: Vec<CertificateDer<'static>>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity {
            id: self.id.clone(),
            ca: self.ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, MtlsError> {
    let pem = read(path)?;
    let v = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(path, format!("not PEM certificates: {e}")))?;
    if v.is_empty() {
        return Err(file_err(path, "no certificate in the file"));
    }
    Ok(v)
}

impl Identity {
    /// Loads `DIR/ca.pem`, `DIR/ID.pem`, `DIR/ID.key` and checks that the certificate names
    /// `id` (a certificate issued for another id is refused here, not at the first call).
    pub fn load(dir: &Path, id: &str) -> Result<Identity, MtlsError> {
        check_id(id).map_err(MtlsError::Invalid)?;
        let ca = certs(&dir.join("ca.pem"))?;
        let cert_path = dir.join(format!("{id}.pem"));
        let chain = certs(&cert_path).map_err(|e| match e {
            MtlsError::File { path, msg } => MtlsError::File {
                path,
                msg: format!(
                    "{msg} (issue it: ternfleet certs issue --dir {} --name {id})",
                    dir.display()
                ),
            },
            e => e,
        })?;
        let key_path = dir.join(format!("{id}.key"));
        let key = PrivateKeyDer::from_pem_slice(&read(&key_path)?)
            .map_err(|e| file_err(&key_path, format!("not a PEM private key: {e}")))?;
        if !cert_names(&chain[0], id) {
            return Err(file_err(
                &cert_path,
                format!("the certificate does not name {id:?}"),
            ));
        }
        Ok(Identity {
            id: id.to_string(),
            ca,
            chain,
            key,
        })
    }

    fn roots(&self) -> Result<rustls::RootCertStore, MtlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for c in &self.ca {
            roots
                .add(c.clone())
                .map_err(|e| MtlsError::Tls(format!("cluster CA: {e}")))?;
        }
        Ok(roots)
    }

    /// The QUIC server configuration of a node: TLS 1.3, a client certificate from the
    /// cluster CA required.
    pub fn server_config(&self) -> Result<quinn::ServerConfig, MtlsError> {
        let tls = |e: rustls::Error| MtlsError::Tls(e.to_string());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(self.roots()?),
            provider.clone(),
        )
        .build()
        .map_err(|e| MtlsError::Tls(e.to_string()))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls)?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        let q = quinn::crypto::rustls::QuicServerConfig::try_from(cfg)
            .map_err(|e| MtlsError::Tls(e.to_string()))?;
        let mut s = quinn::ServerConfig::with_crypto(Arc::new(q));
        s.transport_config(Arc::new(transport()?));
        Ok(s)
    }

    /// The QUIC client configuration of a coordinator: TLS 1.3, the node's certificate must
    /// chain to the cluster CA (and name the node: the server name of each connection).
    pub fn client_config(&self) -> Result<quinn::ClientConfig, MtlsError> {
        let tls = |e: rustls::Error| MtlsError::Tls(e.to_string());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls)?;
        quic_client(cfg)
    }
}

/// A QUIC client configuration around a rustls one: our ALPN and transport settings.
fn quic_client(mut cfg: rustls::ClientConfig) -> Result<quinn::ClientConfig, MtlsError> {
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    let q = quinn::crypto::rustls::QuicClientConfig::try_from(cfg)
        .map_err(|e| MtlsError::Tls(e.to_string()))?;
    let mut c = quinn::ClientConfig::new(Arc::new(q));
    c.transport_config(Arc::new(transport()?));
    Ok(c)
}

impl Identity {
    /// A client configuration that accepts any server whose certificate chains to the
    /// cluster CA, whatever id it names: for `--join ADDR`, where the member at ADDR is not
    /// known by id yet. The chain, validity dates and TLS 1.3 signatures are checked as
    /// usual; only the name check is left to the caller, who must check the id the peer
    /// claims with [`peer_id`] before trusting it.
    pub fn client_config_any_member(&self) -> Result<quinn::ClientConfig, MtlsError> {
        let tls = |e: rustls::Error| MtlsError::Tls(e.to_string());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(self.roots()?),
            provider.clone(),
        )
        .build()
        .map_err(|e| MtlsError::Tls(e.to_string()))?;
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyMember(inner)))
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls)?;
        quic_client(cfg)
    }
}

/// The CA's verifier with only its server-name check waived (rustls checks the chain first,
/// then the name: a name error means the chain was good).
#[derive(Debug)]
struct AnyMember(Arc<rustls::client::WebPkiServerVerifier>);

impl rustls::client::danger::ServerCertVerifier for AnyMember {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::CertificateError as C;
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                C::NotValidForName | C::NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Keep-alive, idle timeout and stream limits, set explicitly on both sides.
fn transport() -> Result<quinn::TransportConfig, MtlsError> {
    let mut t = quinn::TransportConfig::default();
    t.keep_alive_interval(Some(KEEP_ALIVE));
    t.max_idle_timeout(Some(
        IDLE_TIMEOUT
            .try_into()
            .map_err(|e| MtlsError::Tls(format!("idle timeout: {e}")))?,
    ));
    // A coordinator sends one call per layer per step, plus status polls: 64 streams in
    // flight is plenty and bounds what one connection can make a node buffer (64 × the
    // stream window, and the connection window over all of them).
    t.max_concurrent_bidi_streams(64u32.into());
    t.max_concurrent_uni_streams(64u32.into());
    t.stream_receive_window((16u32 << 20).into());
    t.receive_window((64u32 << 20).into());
    // Path MTU discovery above Ethernet's 1,500 bytes where the path allows (loopback,
    // jumbo-frame LANs): a layer's results (64 KB for one decode token of a 2,048-wide model)
    // then cross in ~11 packets instead of ~45, each an encryption and a share of the
    // acknowledgements. The endpoints must accept such datagrams (`net::MAX_UDP_PAYLOAD`).
    // Capped at MTU_UPPER_BOUND so a segmentation-offload batch (quinn sends up to 10
    // packets in one GSO syscall) stays under the kernel's 64 KB per send: above it the send
    // fails with EMSGSIZE, which quinn drops silently (it expects that of MTU probes) — a
    // 9,000-byte MTU lost a third of all packets on loopback and fell to a few calls a second.
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MTU_UPPER_BOUND);
    t.mtu_discovery_config(Some(mtu));
    Ok(t)
}

/// Whether a DER certificate is valid for DNS name `id` (its subject alternative names).
pub fn cert_names(cert: &CertificateDer<'_>, id: &str) -> bool {
    let Ok(ee) = webpki::EndEntityCert::try_from(cert) else {
        return false;
    };
    let Ok(name) = ServerName::try_from(id) else {
        return false;
    };
    ee.verify_is_valid_for_subject_name(&name).is_ok()
}

/// The id of a connected peer: the first of `allowed` its (already CA-verified) certificate
/// names, or an error saying what it presented.
pub fn peer_id(conn: &quinn::Connection, allowed: &[String]) -> Result<String, String> {
    let Some(any) = conn.peer_identity() else {
        return Err("no client certificate".into());
    };
    let Ok(chain) = any.downcast::<Vec<CertificateDer<'static>>>() else {
        return Err("peer identity is not a certificate chain".into());
    };
    let Some(leaf) = chain.first() else {
        return Err("empty certificate chain".into());
    };
    allowed
        .iter()
        .find(|id| cert_names(leaf, id))
        .cloned()
        .ok_or_else(|| format!("the certificate names none of the allowed ids {allowed:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_name_their_id_and_nothing_is_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        init_ca(dir.path()).unwrap();
        let e = init_ca(dir.path()).unwrap_err().to_string();
        assert!(e.contains("already exists"), "{e}");
        issue(dir.path(), "n1").unwrap();
        issue(dir.path(), "coordinator").unwrap();
        let id = Identity::load(dir.path(), "n1").unwrap();
        assert!(cert_names(&id.chain[0], "n1"));
        assert!(!cert_names(&id.chain[0], "n2"));
        assert!(issue(dir.path(), "n1")
            .unwrap_err()
            .to_string()
            .contains("already exists"));
        assert!(issue(dir.path(), "Bad_Id").is_err());
        // A certificate copied under another id's name is refused at load.
        std::fs::copy(dir.path().join("n1.pem"), dir.path().join("n2.pem")).unwrap();
        std::fs::copy(dir.path().join("n1.key"), dir.path().join("n2.key")).unwrap();
        let e = Identity::load(dir.path(), "n2").unwrap_err().to_string();
        assert!(e.contains("does not name \"n2\""), "{e}");
        let e = Identity::load(dir.path(), "n3").unwrap_err().to_string();
        assert!(e.contains("certs issue"), "{e}");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dir.path().join("ca.key"))
                .unwrap()
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        id.server_config().unwrap();
        id.client_config().unwrap();
    }
}
