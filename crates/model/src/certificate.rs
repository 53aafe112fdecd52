//! TLS certificates as configuration. A certificate object is either
//! uploaded (a chain and its private key, checked as they are decoded: the
//! chain parses, the key parses and matches the first certificate, with the
//! names it serves read once) or managed (an `acme` block: Tidegate obtains
//! and renews it, see [`crate::acme`]). Expiry is checked where changes
//! come in ([`crate::parse_change_set`], [`CertificateSpec::check_incoming`]),
//! not on every decode: a stored certificate that expires later still
//! loads, so Tidegate still starts (and reports it) instead of refusing its
//! own data directory.

use std::fmt;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

use crate::acme::{AcmeSpec, AcmeState, AcmeStateWire};
use crate::client_auth::ClientAuth;
use crate::invalid::{Invalid, Reason};

/// A certificate chain and its private key, checked: the chain parses and
/// the key matches its first certificate. An uploaded certificate is one;
/// so is one ACME issued.
#[derive(Clone)]
pub struct KeyedChain {
    cert_pem: String,
    key_pem: String,
    info: Arc<CertificateInfo>,
    key: Arc<rustls::sign::CertifiedKey>,
}

impl KeyedChain {
    /// Checks a PEM chain and its PEM key; errors name `cert_pem` or
    /// `key_pem`.
    pub fn new(cert_pem: String, key_pem: String) -> Result<KeyedChain, Invalid> {
        let certified = key_pair(&cert_pem, &key_pem, ("cert_pem", "key_pem"))?;
        let info = inspect(&certified.cert)?;
        Ok(KeyedChain { cert_pem, key_pem, info: Arc::new(info), key: Arc::new(certified) })
    }

    /// An ACME TLS-ALPN-01 validation certificate and its key (RFC 8737):
    /// checked as [`KeyedChain::new`] does, except that the key is not
    /// matched through a certificate parser, which refuses the critical
    /// `acmeIdentifier` extension such a certificate must carry; the key
    /// and the certificate are made together by the ACME manager.
    pub fn validation(cert_pem: String, key_pem: String) -> Result<KeyedChain, Invalid> {
        let chain = chain(&cert_pem, "cert_pem")?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| Invalid::unreadable("key_pem", format!("not a PEM private key ({e})")))?;
        let signer = rustls::crypto::ring::default_provider()
            .key_provider
            .load_private_key(key)
            .map_err(|e| Invalid::unreadable("key_pem", format!("unsupported or malformed key ({e})")))?;
        let info = inspect(&chain)?;
        let certified = rustls::sign::CertifiedKey::new(chain, signer);
        Ok(KeyedChain { cert_pem, key_pem, info: Arc::new(info), key: Arc::new(certified) })
    }

    /// The chain and key, ready for a TLS handshake.
    pub fn certified_key(&self) -> &Arc<rustls::sign::CertifiedKey> {
        &self.key
    }

    /// What the certificate says of itself.
    pub fn info(&self) -> &CertificateInfo {
        &self.info
    }

    /// The chain, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The key, PEM (secret: never shown).
    pub(crate) fn key_pem(&self) -> &str {
        &self.key_pem
    }
}

impl PartialEq for KeyedChain {
    fn eq(&self, other: &Self) -> bool {
        self.cert_pem == other.cert_pem && self.key_pem == other.key_pem
    }
}

impl Eq for KeyedChain {}

impl fmt::Debug for KeyedChain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedChain")
            .field("names", &self.info.names)
            .field("not_after", &self.info.not_after)
            .finish_non_exhaustive()
    }
}

/// A TLS certificate object (`PUT /v1/certificates/{name}`): uploaded (a
/// chain and key) or managed by ACME. Values of this type are always
/// valid.
#[derive(Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "CertificateWire", into = "CertificateWire")]
pub struct CertificateSpec {
    source: Source,
    default: bool,
    client_auth: Option<ClientAuth>,
    /// Serialized with the secrets replaced by [`crate::REDACTED`] (read
    /// APIs), and a managed certificate as its `acme` block alone.
    redacted: bool,
}

#[derive(Clone, PartialEq, Eq)]
enum Source {
    Uploaded(KeyedChain),
    Managed(Arc<Managed>),
}

/// A managed certificate: what the user asked for, and what Tidegate
/// learned while obtaining it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Managed {
    /// The `acme` block.
    pub acme: AcmeSpec,
    /// The manager's state (account, issued certificate, challenges).
    pub state: AcmeState,
}

/// What a certificate says of itself (the read APIs show this, never the key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct CertificateInfo {
    /// The DNS names it serves: its subject alternative names (or its
    /// common name when it has none), lowercase; `*.example.com` for a
    /// wildcard.
    pub names: Vec<String>,
    /// The subject's distinguished name.
    pub subject: String,
    /// The issuer's distinguished name.
    pub issuer: String,
    /// Start of validity, seconds since the Unix epoch.
    pub not_before: i64,
    /// End of validity, seconds since the Unix epoch.
    pub not_after: i64,
    /// Certificates in the chain (the first is the server's own).
    pub chain_length: usize,
}

/// The document as sent and stored: `cert_pem` and `key_pem` (uploaded),
/// or `acme` (managed; `acme_state` is written by Tidegate only).
#[derive(Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct CertificateWire {
    /// The certificate chain, PEM: the server's certificate first, then
    /// intermediates. Not with `acme`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cert_pem: Option<String>,
    /// The private key of the first certificate, PEM (PKCS#8, PKCS#1 or
    /// SEC1). Read back as `"(redacted)"`; given as `"(redacted)"`, the
    /// certificate keeps the key it has. Not with `acme`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key_pem: Option<String>,
    /// Served to clients that send no SNI name, or one no certificate has.
    #[serde(default)]
    default: bool,
    /// Obtain and renew the certificate through ACME instead (see
    /// docs/tls.md, "Automatic certificates").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    acme: Option<AcmeSpec>,
    /// What Tidegate's ACME manager keeps (stored form only; never given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    acme_state: Option<AcmeStateWire>,
    /// Client certificates the handshakes this certificate serves ask for
    /// (mutual TLS): a CA bundle and a mode; none asked when absent. The
    /// default certificate's applies to clients with no or an unknown SNI
    /// name (docs/tls.md, "Client certificates").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    client_auth: Option<ClientAuth>,
}

impl CertificateSpec {
    /// An uploaded certificate.
    pub fn uploaded(chain: KeyedChain, default: bool, client_auth: Option<ClientAuth>) -> CertificateSpec {
        CertificateSpec { source: Source::Uploaded(chain), default, client_auth, redacted: false }
    }

    /// What its handshakes ask of clients' certificates, if anything.
    pub fn client_auth(&self) -> Option<&ClientAuth> {
        self.client_auth.as_ref()
    }

    /// The chain and key served now: the uploaded one, or the one ACME
    /// issued last (`None` while a managed certificate has none yet).
    pub fn served(&self) -> Option<&KeyedChain> {
        match &self.source {
            Source::Uploaded(c) => Some(c),
            Source::Managed(m) => m.state.issued.as_ref(),
        }
    }

    /// The chain and key, ready for a TLS handshake (see [`Self::served`]).
    pub fn certified_key(&self) -> Option<&Arc<rustls::sign::CertifiedKey>> {
        self.served().map(KeyedChain::certified_key)
    }

    /// What the certificate served says of itself.
    pub fn info(&self) -> Option<&CertificateInfo> {
        self.served().map(KeyedChain::info)
    }

    /// The ACME block and state of a managed certificate.
    pub fn managed(&self) -> Option<&Managed> {
        match &self.source {
            Source::Managed(m) => Some(m),
            Source::Uploaded(_) => None,
        }
    }

    /// Whether it is served to clients with no (or an unknown) SNI name.
    pub fn is_default(&self) -> bool {
        self.default
    }

    /// The chain served, PEM.
    pub fn cert_pem(&self) -> Option<&str> {
        self.served().map(KeyedChain::cert_pem)
    }

    /// What a certificate coming in must be besides well formed: not
    /// expired by `now` (Unix seconds), and reachable: one that names no
    /// DNS host can only be served as the default, since no SNI name
    /// selects it. A certificate not valid yet is taken (its issuer's clock
    /// may run a little ahead of ours); `GET` shows its dates. A managed
    /// certificate's hosts were checked as it was decoded.
    pub fn check_incoming(&self, now: i64) -> Result<(), Invalid> {
        match &self.source {
            Source::Uploaded(c) => check_incoming(c.info(), self.default, now),
            Source::Managed(_) => Ok(()),
        }
    }

    /// Whether both serve the same private key (compared, never shown).
    pub fn same_key(&self, other: &CertificateSpec) -> bool {
        self.served().map(KeyedChain::key_pem) == other.served().map(KeyedChain::key_pem)
    }

    /// The spec as read APIs show it: secrets replaced by
    /// [`crate::REDACTED`] when serialized, and a managed certificate as
    /// what a user gives (its `acme` block and default flag; its state is
    /// in `GET /v1/certificates`).
    pub fn redacted(&self) -> CertificateSpec {
        CertificateSpec { redacted: true, ..self.clone() }
    }

    /// This managed certificate with `state` (the `acme_state` op).
    pub(crate) fn with_state(&self, state: AcmeState) -> Option<CertificateSpec> {
        let m = self.managed()?;
        let managed = Managed { acme: m.acme.clone(), state };
        Some(CertificateSpec {
            source: Source::Managed(Arc::new(managed)),
            default: self.default,
            client_auth: self.client_auth.clone(),
            redacted: false,
        })
    }
}

/// See [`CertificateSpec::check_incoming`].
fn check_incoming(info: &CertificateInfo, default: bool, now: i64) -> Result<(), Invalid> {
    if info.not_after < now {
        return Err(Invalid::new("cert_pem", Reason::Expired { not_after: info.not_after }));
    }
    if info.names.is_empty() && !default {
        return Err(Invalid::conflict(
            "default",
            "cert_pem",
            "the certificate names no DNS host (no DNS subject alternative name and no \
             common name), so no SNI name selects it; make it the default certificate \
             (\"default\": true) or use one issued for the names it must serve",
        ));
    }
    Ok(())
}

/// A certificate as a change (`put_certificate`, `PUT
/// /v1/certificates/{name}`) or a declarative document gives it: a chain
/// and its key; a chain with `key_pem` given as `"(redacted)"`, the
/// placeholder read APIs show (an exported configuration applied back, or
/// a renewed chain for the same key), which keeps the key the certificate
/// of that name has; or an `acme` block.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "CertificateWire", into = "CertificateWire")]
pub enum CertificateInput {
    /// Chain and key, checked.
    Whole(CertificateSpec),
    /// A chain that keeps the current key.
    KeepKey(KeptKey),
    /// A managed certificate: what ACME is to obtain. Put over a managed
    /// certificate of the same name, it keeps that one's state (its
    /// account and the certificate it serves until a new one is issued).
    Managed {
        /// The `acme` block.
        acme: AcmeSpec,
        /// Served to clients with no (or an unknown) SNI name.
        default: bool,
        /// Client certificates its handshakes ask for.
        client_auth: Option<ClientAuth>,
    },
}

/// A chain (parsed and read, not yet matched with a key) and its default
/// flag, to go with the key the configuration already has.
#[derive(Clone, PartialEq, Eq)]
pub struct KeptKey {
    cert_pem: String,
    default: bool,
    client_auth: Option<ClientAuth>,
    info: Arc<CertificateInfo>,
}

impl CertificateInput {
    /// Whether it keeps the current key (its key was the placeholder).
    pub fn keeps_key(&self) -> bool {
        matches!(self, CertificateInput::KeepKey(_))
    }

    /// What the certificate says of itself (`None` for a managed one).
    pub fn info(&self) -> Option<&CertificateInfo> {
        match self {
            CertificateInput::Whole(spec) => spec.info(),
            CertificateInput::KeepKey(k) => Some(&k.info),
            CertificateInput::Managed { .. } => None,
        }
    }

    /// Whether it is to be served to clients with no (or an unknown) SNI name.
    pub fn is_default(&self) -> bool {
        match self {
            CertificateInput::Whole(spec) => spec.is_default(),
            CertificateInput::KeepKey(k) => k.default,
            CertificateInput::Managed { default, .. } => *default,
        }
    }

    /// See [`CertificateSpec::check_incoming`].
    pub fn check_incoming(&self, now: i64) -> Result<(), Invalid> {
        match self.info() {
            Some(info) => check_incoming(info, self.is_default(), now),
            None => Ok(()),
        }
    }

    /// The certificate this input makes, given the one of the same name
    /// the configuration has (`current`). `Err` (naming `key_pem`) when it
    /// keeps a key and there is none, or the key kept does not match the
    /// new chain.
    pub fn resolve(&self, current: Option<&CertificateSpec>) -> Result<CertificateSpec, Invalid> {
        match self {
            CertificateInput::Whole(spec) => Ok(spec.clone()),
            CertificateInput::Managed { acme, default, client_auth } => {
                let state = current.and_then(CertificateSpec::managed).map(|m| m.state.clone()).unwrap_or_default();
                let managed = Managed { acme: acme.clone(), state };
                Ok(CertificateSpec {
                    source: Source::Managed(Arc::new(managed)),
                    default: *default,
                    client_auth: client_auth.clone(),
                    redacted: false,
                })
            }
            CertificateInput::KeepKey(k) => {
                let Some(current) = current.and_then(|c| match &c.source {
                    Source::Uploaded(chain) => Some(chain),
                    Source::Managed(_) => None,
                }) else {
                    return Err(Invalid::rule(
                        "key_pem",
                        format!(
                            "{:?} is the placeholder read APIs show, and there is no uploaded certificate of \
                             this name whose key it could keep; give the key",
                            crate::REDACTED
                        ),
                    ));
                };
                let chain = KeyedChain::new(k.cert_pem.clone(), current.key_pem.clone()).map_err(|e| {
                    match e.field.as_str() {
                        "key_pem" => Invalid::new("key_pem", Reason::KeptKey(Box::new(e.reason))),
                        _ => e,
                    }
                })?;
                Ok(CertificateSpec::uploaded(chain, k.default, k.client_auth.clone()))
            }
        }
    }

    /// As read APIs (the watch stream) show it: never the key.
    pub fn redacted(&self) -> CertificateInput {
        match self {
            CertificateInput::Whole(spec) => CertificateInput::Whole(spec.redacted()),
            CertificateInput::KeepKey(_) | CertificateInput::Managed { .. } => self.clone(),
        }
    }
}

impl From<CertificateSpec> for CertificateInput {
    fn from(spec: CertificateSpec) -> Self {
        match &spec.source {
            Source::Managed(m) => CertificateInput::Managed {
                acme: m.acme.clone(),
                default: spec.default,
                client_auth: spec.client_auth.clone(),
            },
            Source::Uploaded(_) => CertificateInput::Whole(spec),
        }
    }
}

impl fmt::Debug for CertificateInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CertificateInput::Whole(spec) => spec.fmt(f),
            CertificateInput::KeepKey(k) => f
                .debug_struct("CertificateInput::KeepKey")
                .field("names", &k.info.names)
                .field("not_after", &k.info.not_after)
                .field("default", &k.default)
                .finish(),
            CertificateInput::Managed { acme, default, .. } => f
                .debug_struct("CertificateInput::Managed")
                .field("hosts", &acme.hosts())
                .field("default", default)
                .finish(),
        }
    }
}

impl From<CertificateInput> for CertificateWire {
    fn from(c: CertificateInput) -> Self {
        match c {
            CertificateInput::Whole(spec) => spec.into(),
            CertificateInput::KeepKey(k) => CertificateWire {
                cert_pem: Some(k.cert_pem),
                key_pem: Some(crate::REDACTED.to_string()),
                default: k.default,
                acme: None,
                acme_state: None,
                client_auth: k.client_auth,
            },
            CertificateInput::Managed { acme, default, client_auth } => CertificateWire {
                cert_pem: None,
                key_pem: None,
                default,
                acme: Some(acme),
                acme_state: None,
                client_auth,
            },
        }
    }
}

impl TryFrom<CertificateWire> for CertificateInput {
    type Error = Invalid;

    fn try_from(wire: CertificateWire) -> Result<Self, Invalid> {
        if wire.acme_state.is_some() {
            return Err(Invalid::rule(
                "acme_state",
                "is written by Tidegate's ACME manager, not given; put the acme block alone",
            ));
        }
        if wire.key_pem.as_deref() != Some(crate::REDACTED) {
            return CertificateSpec::try_from(wire).map(CertificateInput::from);
        }
        let cert_pem = wire.cert_pem.ok_or_else(|| Invalid::rule("cert_pem", "a key needs its chain"))?;
        let info = inspect(&chain(&cert_pem, "cert_pem")?)?;
        Ok(CertificateInput::KeepKey(KeptKey {
            cert_pem,
            default: wire.default,
            client_auth: wire.client_auth,
            info: Arc::new(info),
        }))
    }
}

impl PartialEq for CertificateSpec {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source && self.default == other.default && self.client_auth == other.client_auth
    }
}

impl Eq for CertificateSpec {}

impl fmt::Debug for CertificateSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("CertificateSpec");
        match &self.source {
            Source::Uploaded(c) => d.field("names", &c.info.names).field("not_after", &c.info.not_after),
            Source::Managed(m) => d.field("acme_hosts", &m.acme.hosts()).field("issued", &m.state.issued.is_some()),
        };
        d.field("default", &self.default).field("client_auth", &self.client_auth).finish_non_exhaustive()
    }
}

impl From<CertificateSpec> for CertificateWire {
    fn from(c: CertificateSpec) -> Self {
        let secret = |s: &str| if c.redacted { crate::REDACTED.to_string() } else { s.to_string() };
        match &c.source {
            Source::Uploaded(chain) => CertificateWire {
                cert_pem: Some(chain.cert_pem.clone()),
                key_pem: Some(secret(&chain.key_pem)),
                default: c.default,
                acme: None,
                acme_state: None,
                client_auth: c.client_auth.clone(),
            },
            Source::Managed(m) => CertificateWire {
                cert_pem: None,
                key_pem: None,
                default: c.default,
                acme: Some(m.acme.clone()),
                acme_state: (!c.redacted).then(|| m.state.to_wire(false)),
                client_auth: c.client_auth.clone(),
            },
        }
    }
}

impl TryFrom<CertificateWire> for CertificateSpec {
    type Error = Invalid;

    fn try_from(wire: CertificateWire) -> Result<Self, Invalid> {
        let source = match (wire.acme, wire.cert_pem, wire.key_pem) {
            (Some(acme), None, None) => {
                let state = match wire.acme_state {
                    Some(s) => AcmeState::try_from(s)?,
                    None => AcmeState::default(),
                };
                Source::Managed(Arc::new(Managed { acme, state }))
            }
            (Some(_), Some(_), _) => {
                return Err(Invalid::conflict("cert_pem", "acme", "give a chain and key, or an acme block, not both"))
            }
            (Some(_), None, Some(_)) => {
                return Err(Invalid::conflict("key_pem", "acme", "give a chain and key, or an acme block, not both"))
            }
            (None, cert, key) => {
                if wire.acme_state.is_some() {
                    return Err(Invalid::rule("acme_state", "only a managed certificate (with acme) has one"));
                }
                let cert =
                    cert.ok_or_else(|| Invalid::rule("cert_pem", "missing: give cert_pem and key_pem, or acme"))?;
                let key = key.ok_or_else(|| Invalid::rule("key_pem", "missing: give the chain's private key"))?;
                Source::Uploaded(KeyedChain::new(cert, key)?)
            }
        };
        Ok(CertificateSpec { source, default: wire.default, client_auth: wire.client_auth, redacted: false })
    }
}

/// A PEM certificate chain and the PEM private key of its first
/// certificate, checked: both parse and the key matches. Errors start with
/// the field at fault, `fields` being the names of the chain's and the
/// key's.
pub(crate) fn key_pair(
    cert_pem: &str,
    key_pem: &str,
    fields: (&str, &str),
) -> Result<rustls::sign::CertifiedKey, Invalid> {
    let (cert_field, key_field) = fields;
    let chain = chain(cert_pem, cert_field)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| Invalid::unreadable(key_field, format!("not a PEM private key ({e})")))?;
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(chain, key, &provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => Invalid::new(key_field, Reason::KeyMismatch),
        other => Invalid::unreadable(key_field, format!("unsupported or malformed key ({other})")),
    })
}

/// The certificates of a PEM chain, at least one; errors name `field`.
pub(crate) fn chain(pem: &str, field: &str) -> Result<Vec<CertificateDer<'static>>, Invalid> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| Invalid::unreadable(field, format!("not a PEM certificate chain ({e})")))?;
    if chain.is_empty() {
        return Err(Invalid::unreadable(field, "no CERTIFICATE block found"));
    }
    Ok(chain)
}

/// Reads names and validity from the first certificate of `chain`.
fn inspect(chain: &[CertificateDer<'_>]) -> Result<CertificateInfo, Invalid> {
    use x509_parser::extensions::GeneralName;
    let first = chain.first().ok_or_else(|| Invalid::unreadable("cert_pem", "no CERTIFICATE block found"))?;
    let (_, cert) = x509_parser::parse_x509_certificate(first.as_ref())
        .map_err(|e| Invalid::unreadable("cert_pem", format!("not an X.509 certificate ({e})")))?;
    let mut names: Vec<String> = match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::DNSName(d) => Some(d.to_ascii_lowercase()),
                _ => None,
            })
            .collect(),
        Ok(None) => Vec::new(),
        Err(e) => return Err(Invalid::unreadable("cert_pem", format!("malformed subject alternative names ({e})"))),
    };
    if names.is_empty() {
        names.extend(cert.subject().iter_common_name().filter_map(|cn| cn.as_str().ok()).map(str::to_ascii_lowercase));
    }
    names.sort();
    names.dedup();
    Ok(CertificateInfo {
        names,
        subject: cert.subject().to_string(),
        issuer: cert.issuer().to_string(),
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
        chain_length: chain.len(),
    })
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(names: &[&str]) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn parse(cert: &str, key: &str) -> Result<CertificateSpec, crate::ParseError> {
        crate::parse_json::<CertificateSpec>(
            serde_json::json!({ "cert_pem": cert, "key_pem": key, "default": true }).to_string().as_bytes(),
        )
    }

    fn wire(cert: &str, key: &str) -> CertificateWire {
        CertificateWire {
            cert_pem: Some(cert.into()),
            key_pem: Some(key.into()),
            default: false,
            acme: None,
            acme_state: None,
            client_auth: None,
        }
    }

    #[test]
    fn a_valid_pair_decodes_with_its_names() {
        let (cert, key) = pair(&["a.example", "*.B.example"]);
        let spec = parse(&cert, &key).unwrap();
        assert_eq!(spec.info().unwrap().names, vec!["*.b.example", "a.example"]);
        assert!(spec.is_default());
        assert!(spec.info().unwrap().not_after > unix_now());
        let json = serde_json::to_string(&spec).unwrap();
        let again: CertificateSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(again, spec, "round-trips");
        assert!(!format!("{spec:?}").contains("PRIVATE"), "Debug never shows the key");
        let shown = serde_json::to_string(&spec.redacted()).unwrap();
        assert!(!shown.contains("PRIVATE") && shown.contains(crate::REDACTED), "{shown}");
    }

    #[test]
    fn bad_input_names_the_field() {
        let (cert, key) = pair(&["a.example"]);
        let (_, other_key) = pair(&["a.example"]);
        let err = parse(&cert, &other_key).unwrap_err().to_string();
        assert!(err.starts_with("key_pem: the key does not match"), "{err}");
        let err = parse("garbage", &key).unwrap_err().to_string();
        assert!(err.starts_with("cert_pem:"), "{err}");
        let err = parse(&cert, "garbage").unwrap_err().to_string();
        assert!(err.starts_with("key_pem:"), "{err}");
        // The typed refusal names the field and the kind.
        let err = CertificateSpec::try_from(wire(&cert, &other_key)).unwrap_err();
        assert_eq!((err.field.as_str(), &err.reason), ("key_pem", &Reason::KeyMismatch));
        let err = CertificateSpec::try_from(wire("garbage", &key)).unwrap_err();
        assert!(matches!((err.field.as_str(), err.reason), ("cert_pem", Reason::Malformed { value: None, .. })));
        let mut params = rcgen::CertificateParams::new(vec!["old.example".to_string()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let old_key = rcgen::KeyPair::generate().unwrap();
        let old = params.self_signed(&old_key).unwrap();
        let old = parse(&old.pem(), &old_key.serialize_pem()).expect("an expired pair still decodes (stored data)");
        let err = old.check_incoming(unix_now()).unwrap_err();
        assert_eq!(err.field, "cert_pem");
        assert_eq!(err.reason, Reason::Expired { not_after: old.info().unwrap().not_after });
        assert!(err.to_string().starts_with("cert_pem: the certificate expired"), "{err}");
    }

    #[test]
    fn client_auth_is_checked_kept_and_shown() {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let (cert, key) = pair(&["a.example"]);
        let doc = |key: &str, ca_pem: &str| {
            serde_json::json!({ "cert_pem": cert, "key_pem": key, "client_auth": { "ca_pem": ca_pem, "mode": "optional" } })
                .to_string()
        };
        let spec = crate::parse_json::<CertificateSpec>(doc(&key, &ca.pem()).as_bytes()).unwrap();
        let auth = spec.client_auth().expect("client_auth kept");
        assert_eq!(auth.mode(), crate::ClientAuthMode::Optional);
        // Read APIs show the bundle (not a secret), never the key.
        let shown = serde_json::to_value(spec.redacted()).unwrap();
        assert_eq!(shown["client_auth"]["ca_pem"], ca.pem());
        assert_eq!(shown["key_pem"], crate::REDACTED);
        // Without it, nothing is asked and nothing is written.
        let plain = parse(&cert, &key).unwrap();
        assert!(plain.client_auth().is_none());
        assert!(serde_json::to_value(&plain).unwrap().get("client_auth").is_none());
        // A bad bundle is refused naming the field.
        let err = crate::parse_json::<CertificateSpec>(doc(&key, "nope").as_bytes()).unwrap_err();
        assert!(err.to_string().starts_with("client_auth.ca_pem: no CERTIFICATE block found"), "{err}");
        // A chain that keeps the current key keeps the client_auth it gives.
        let input: CertificateInput = serde_json::from_str(&doc(crate::REDACTED, &ca.pem())).unwrap();
        let resolved = input.resolve(Some(&plain)).unwrap();
        assert_eq!(resolved.client_auth(), Some(auth));
        assert_eq!(serde_json::to_value(&input).unwrap()["client_auth"]["mode"], "optional");
    }

    #[test]
    fn a_kept_key_is_refused_by_kind() {
        let (cert, _) = pair(&["a.example"]);
        let (other_cert, other_key) = pair(&["a.example"]);
        let input = CertificateInput::try_from(wire(&cert, crate::REDACTED)).unwrap();
        let err = input.resolve(None).unwrap_err();
        assert!(matches!((err.field.as_str(), &err.reason), ("key_pem", Reason::Rule(_))), "{err:?}");
        let current = CertificateSpec::try_from(wire(&other_cert, &other_key)).unwrap();
        let err = input.resolve(Some(&current)).unwrap_err();
        assert_eq!(err.reason, Reason::KeptKey(Box::new(Reason::KeyMismatch)));
        assert_eq!(
            err.to_string(),
            "key_pem: the key kept from the current certificate: the key does not match the certificate"
        );
    }

    #[test]
    fn a_certificate_naming_no_host_must_be_the_default() {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let spec = |default: bool| {
            crate::parse_json::<CertificateSpec>(
                serde_json::json!({ "cert_pem": cert.pem(), "key_pem": key.serialize_pem(), "default": default })
                    .to_string()
                    .as_bytes(),
            )
            .unwrap()
        };
        assert!(spec(true).info().unwrap().names.is_empty());
        assert_eq!(spec(true).check_incoming(unix_now()), Ok(()));
        let err = spec(false).check_incoming(unix_now()).unwrap_err();
        assert!(matches!(&err.reason, Reason::Conflict { with, .. } if with == "cert_pem"), "{err:?}");
        assert!(err.to_string().starts_with("default: the certificate names no DNS host"), "{err}");
        // Named ones need not be the default; not valid yet is taken.
        let mut later = rcgen::CertificateParams::new(vec!["soon.example".to_string()]).unwrap();
        later.not_before = rcgen::date_time_ymd(2090, 1, 1);
        later.not_after = rcgen::date_time_ymd(2091, 1, 1);
        let later = later.self_signed(&key).unwrap();
        let later = crate::parse_json::<CertificateSpec>(
            serde_json::json!({ "cert_pem": later.pem(), "key_pem": key.serialize_pem() }).to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(later.check_incoming(unix_now()), Ok(()));
    }
}
