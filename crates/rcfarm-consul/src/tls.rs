//! TLS to Consul as Consul's own CLI does it: the CAs to trust (`CONSUL_CACERT`, `CONSUL_CAPATH`),
//! a client certificate for clusters run with `verify_incoming` (`CONSUL_CLIENT_CERT`,
//! `CONSUL_CLIENT_KEY`), the name to check Consul's certificate against
//! (`CONSUL_TLS_SERVER_NAME`) and whether to check it at all (`CONSUL_HTTP_SSL_VERIFY`).
//!
//! Everything that can be checked without Consul is checked when the client is built, so a
//! mistake stops a farm at start naming the file: a certificate or key that does not parse, a key
//! that is not the certificate's, a certificate already expired. What only Consul can say (it
//! wants a certificate, or refuses the one given) comes back from a handshake as a bare alert;
//! [`HandshakeSeen`] keeps what the server asked for so that the error can say why.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::error::{ConsulError, Result};

/// The TLS settings of a Consul client. All optional: without any, `https://` addresses are
/// checked against the system's roots, as a browser would.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM file of the CA(s) that sign Consul's certificate (`CONSUL_CACERT`). When set, only
    /// these are trusted. Wins over [`TlsConfig::ca_path`], as in Consul's CLI.
    pub ca_file: Option<PathBuf>,
    /// A directory of PEM files of trusted CAs (`CONSUL_CAPATH`); every file must hold one.
    pub ca_path: Option<PathBuf>,
    /// PEM certificate (chain) presented to Consul (`CONSUL_CLIENT_CERT`).
    pub client_cert: Option<PathBuf>,
    /// PEM private key of [`TlsConfig::client_cert`] (`CONSUL_CLIENT_KEY`).
    pub client_key: Option<PathBuf>,
    /// Check Consul's certificate against this name instead of the address's host
    /// (`CONSUL_TLS_SERVER_NAME`), e.g. `server.dc1.consul` when connecting by IP.
    pub server_name: Option<String>,
    /// Accept any certificate (`CONSUL_HTTP_SSL_VERIFY=false`). For tests only: anyone on the
    /// path can then read the token and rewrite every answer.
    pub skip_verify: bool,
}

/// What the client says each setting is called, for error messages.
const CA_FILE: &str = "--consul-ca-file / CONSUL_CACERT";
const CA_PATH: &str = "--consul-ca-path / CONSUL_CAPATH";
const CLIENT_CERT: &str = "--consul-client-cert / CONSUL_CLIENT_CERT";
const CLIENT_KEY: &str = "--consul-client-key / CONSUL_CLIENT_KEY";

fn config_err(msg: String) -> ConsulError {
    ConsulError::Config(msg)
}

fn read(path: &Path, what: &str, flag: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        config_err(format!(
            "the {what} {} ({flag}): cannot read it: {e}",
            path.display()
        ))
    })
}

/// The certificates of one PEM file; an error naming it when it has none.
fn pem_certs(path: &Path, what: &str, flag: &str) -> Result<Vec<CertificateDer<'static>>> {
    let pem = read(path, what, flag)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| {
            config_err(format!(
                "the {what} {} ({flag}): not a PEM file: {e:?}",
                path.display()
            ))
        })?;
    if certs.is_empty() {
        return Err(config_err(format!(
            "the {what} {} ({flag}): no PEM certificate (\"-----BEGIN CERTIFICATE-----\") in it",
            path.display()
        )));
    }
    Ok(certs)
}

impl TlsConfig {
    /// The CAs to trust instead of the system's, or `None` to use the system's.
    fn roots(&self) -> Result<Option<rustls::RootCertStore>> {
        let certs = if let Some(file) = &self.ca_file {
            pem_certs(file, "Consul CA file", CA_FILE)?
        } else if let Some(dir) = &self.ca_path {
            let entries = std::fs::read_dir(dir).map_err(|e| {
                config_err(format!(
                    "the Consul CA directory {} ({CA_PATH}): cannot read it: {e}",
                    dir.display()
                ))
            })?;
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            let mut certs = Vec::new();
            for f in &files {
                certs.extend(pem_certs(f, "CA file in the Consul CA directory", CA_PATH)?);
            }
            if certs.is_empty() {
                return Err(config_err(format!(
                    "the Consul CA directory {} ({CA_PATH}) holds no certificate file",
                    dir.display()
                )));
            }
            certs
        } else {
            return Ok(None);
        };
        let mut store = rustls::RootCertStore::empty();
        for c in certs {
            store.add(c).map_err(|e| {
                config_err(format!(
                    "a CA certificate in {} cannot be used: {e}",
                    self.ca_file
                        .as_ref()
                        .or(self.ca_path.as_ref())
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                ))
            })?;
        }
        Ok(Some(store))
    }

    /// The client certificate and key, checked: both given, both parse, the key is the
    /// certificate's, and the certificate is valid now.
    fn client_identity(&self, provider: &CryptoProvider) -> Result<Option<ClientIdentity>> {
        let (cert_path, key_path) = match (&self.client_cert, &self.client_key) {
            (None, None) => return Ok(None),
            (Some(c), Some(k)) => (c, k),
            (Some(c), None) => {
                return Err(config_err(format!(
                    "a client certificate ({}) is given without its key: give the key with {CLIENT_KEY}",
                    c.display()
                )));
            }
            (None, Some(k)) => {
                return Err(config_err(format!(
                    "a client key ({}) is given without its certificate: give the certificate with {CLIENT_CERT}",
                    k.display()
                )));
            }
        };
        let chain = pem_certs(cert_path, "client certificate", CLIENT_CERT)?;
        let key_pem = read(key_path, "client key", CLIENT_KEY)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            config_err(format!(
                "the client key {} ({CLIENT_KEY}): no PEM private key in it ({e:?})",
                key_path.display()
            ))
        })?;
        let info = CertInfo::parse(&chain[0]).map_err(|e| {
            config_err(format!(
                "the client certificate {} ({CLIENT_CERT}): cannot parse it: {e}",
                cert_path.display()
            ))
        })?;
        let now = chrono::Utc::now().timestamp();
        if now > info.not_after {
            return Err(config_err(format!(
                "the client certificate {} ({CLIENT_CERT}) expired on {}; Consul refuses an \
                 expired certificate: give a current one",
                cert_path.display(),
                fmt_time(info.not_after)
            )));
        }
        if now < info.not_before {
            return Err(config_err(format!(
                "the client certificate {} ({CLIENT_CERT}) is not valid before {}; check the \
                 clock of this machine or of the CA that issued it",
                cert_path.display(),
                fmt_time(info.not_before)
            )));
        }
        let key = CertifiedKey::from_der(chain, key, provider).map_err(|e| {
            let why = match e {
                rustls::Error::InconsistentKeys(_) => {
                    "it is not the key of that certificate".into()
                }
                other => format!("it cannot be used: {other}"),
            };
            config_err(format!(
                "the client key {} ({CLIENT_KEY}) does not fit the client certificate {}: {why}",
                key_path.display(),
                cert_path.display()
            ))
        })?;
        Ok(Some(ClientIdentity {
            key: Arc::new(key),
            path: cert_path.clone(),
            issuer: info.issuer,
        }))
    }

    /// The rustls configuration for these settings, and the record of what servers ask.
    pub(super) fn build(&self) -> Result<BuiltTls> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server_name = match &self.server_name {
            None => None,
            Some(n) => Some(ServerName::try_from(n.clone()).map_err(|_| {
                config_err(format!(
                    "--consul-tls-server-name / CONSUL_TLS_SERVER_NAME {n:?}: not a DNS name or IP address"
                ))
            })?),
        };
        let inner: Arc<dyn ServerCertVerifier> = match self.roots()? {
            Some(roots) => {
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| config_err(format!("the Consul CAs cannot be used: {e}")))?
            }
            None => Arc::new(
                rustls_platform_verifier::Verifier::new(provider.clone()).map_err(|e| {
                    config_err(format!(
                        "the system's CA certificates cannot be loaded: {e}"
                    ))
                })?,
            ),
        };
        let identity = self.client_identity(&provider)?;
        let seen = Arc::new(HandshakeSeen {
            offered: identity
                .as_ref()
                .map(|i| (i.path.clone(), i.issuer.clone())),
            ..Default::default()
        });
        let verifier = Arc::new(Verifier {
            inner,
            server_name,
            skip: self.skip_verify,
        });
        let resolver = Arc::new(Resolver {
            key: identity.map(|i| i.key),
            seen: seen.clone(),
        });
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| config_err(format!("TLS versions: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_cert_resolver(resolver);
        // As reqwest offers by default: HTTP/2 where Consul speaks it, else HTTP/1.1.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(BuiltTls { config, seen })
    }
}

pub(super) struct BuiltTls {
    pub config: rustls::ClientConfig,
    pub seen: Arc<HandshakeSeen>,
}

struct ClientIdentity {
    key: Arc<CertifiedKey>,
    path: PathBuf,
    issuer: String,
}

/// The parts of a certificate the error messages need.
struct CertInfo {
    issuer: String,
    not_before: i64,
    not_after: i64,
}

impl CertInfo {
    fn parse(der: &CertificateDer<'_>) -> std::result::Result<CertInfo, String> {
        use x509_parser::prelude::FromDer;
        let (_, cert) = x509_parser::certificate::X509Certificate::from_der(der.as_ref())
            .map_err(|e| e.to_string())?;
        let validity = cert.validity();
        Ok(CertInfo {
            issuer: cert.issuer().to_string(),
            not_before: validity.not_before.timestamp(),
            not_after: validity.not_after.timestamp(),
        })
    }
}

fn fmt_time(unix: i64) -> String {
    chrono::DateTime::from_timestamp(unix, 0)
        .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_else(|| unix.to_string())
}

/// A distinguished name as Consul's server sent it among the CAs it accepts (DER, with or
/// without the outer SEQUENCE, depending on who encoded it).
fn dn_to_string(der: &[u8]) -> String {
    use x509_parser::prelude::FromDer;
    if let Ok((_, name)) = x509_parser::x509::X509Name::from_der(der) {
        return name.to_string();
    }
    let wrapped = rustls::DistinguishedName::in_sequence(der);
    match x509_parser::x509::X509Name::from_der(wrapped.as_ref()) {
        Ok((_, name)) => name.to_string(),
        Err(_) => hex::encode(der),
    }
}

/// What the servers this client talked to asked of it, and what it offered.
#[derive(Debug, Default)]
pub(super) struct HandshakeSeen {
    /// The client certificate configured, and its issuer.
    offered: Option<(PathBuf, String)>,
    /// Set once a server asked for a client certificate: the issuers it accepts.
    asked: Mutex<Option<Vec<String>>>,
}

impl HandshakeSeen {
    /// Why a handshake that failed on an alert from Consul failed, from what Consul asked for;
    /// `None` when nothing was asked (the alert has another cause).
    pub(super) fn explain(&self) -> Option<String> {
        let accepted = self.asked.lock().clone()?;
        let accepts = if accepted.is_empty() {
            String::new()
        } else {
            format!(
                "; it accepts certificates issued by {}",
                accepted
                    .iter()
                    .map(|a| format!("\"{a}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        Some(match &self.offered {
            None => format!(
                "Consul requires a client certificate (verify_incoming) and none was given: give \
                 one with {CLIENT_CERT} and {CLIENT_KEY}{accepts}"
            ),
            Some((path, issuer)) => {
                let foreign = !accepted.is_empty() && !accepted.contains(issuer);
                format!(
                    "Consul refused the client certificate {} (issued by \"{issuer}\"){}{accepts}",
                    path.display(),
                    if foreign {
                        ": it is not issued by a CA Consul trusts"
                    } else {
                        ": its CA is one Consul lists, so check that it is still valid and made \
                         for client authentication"
                    }
                )
            }
        })
    }
}

/// Hands the configured certificate to servers that ask, noting that they asked.
#[derive(Debug)]
struct Resolver {
    key: Option<Arc<CertifiedKey>>,
    seen: Arc<HandshakeSeen>,
}

impl ResolvesClientCert for Resolver {
    fn resolve(
        &self,
        root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        let accepted = root_hint_subjects.iter().map(|s| dn_to_string(s)).collect();
        *self.seen.asked.lock() = Some(accepted);
        self.key.clone()
    }

    fn has_certs(&self) -> bool {
        // True even without a certificate, so that a server's request is seen (and explained).
        true
    }
}

/// Checks Consul's certificate against the configured name (or the address's host), or not at
/// all with `skip`.
#[derive(Debug)]
struct Verifier {
    inner: Arc<dyn ServerCertVerifier>,
    server_name: Option<ServerName<'static>>,
    skip: bool,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if self.skip {
            return Ok(ServerCertVerified::assertion());
        }
        let name = self.server_name.as_ref().unwrap_or(server_name);
        self.inner
            .verify_server_cert(end_entity, intermediates, name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }

    fn requires_raw_public_keys(&self) -> bool {
        false
    }
}

/// Whether a transport error's text is a TLS alert from the peer (the handshake reached Consul
/// and Consul refused it), as rustls words it.
pub(super) fn is_peer_alert(reason: &str) -> bool {
    reason.contains("received fatal alert")
        || reason.contains("peer sent no certificates")
        || reason.contains("CertificateRequired")
}

/// What to do about a TLS failure (the text of [`super::ConsulError::tls_problem`]), unless the
/// failure already says it.
pub fn tls_advice(problem: &str) -> &'static str {
    if problem.contains("client certificate") {
        ""
    } else if problem.contains("not valid for name") {
        " (connect by a name Consul's certificate holds, or give one of its names with \
         --consul-tls-server-name / CONSUL_TLS_SERVER_NAME)"
    } else {
        " (give the CA that signs Consul's certificate with --consul-ca-file / CONSUL_CACERT, and \
         check that the address is Consul's HTTPS port)"
    }
}
