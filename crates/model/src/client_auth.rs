//! Client certificates at the front door (mutual TLS): what a certificate
//! object asks of the clients its handshakes serve ([`ClientAuth`]: a CA
//! bundle and a mode), what a route asks of a request
//! ([`ClientCertPolicy`]), and what a verified client certificate says of
//! itself ([`ClientCertificate`]: its subject and fingerprint, as the
//! proxy passes them to backends).
//!
//! The CA bundle is checked as it is decoded: it parses, every
//! certificate in it is a CA certificate, and a rustls client verifier is
//! built from it once, here, so that a handshake never builds one.

use std::fmt;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer};
use rustls::server::danger::ClientCertVerifier;
use serde::{Deserialize, Serialize};

use crate::invalid::Invalid;

/// The request header that carries a verified client certificate's
/// subject to the backend (see [`ClientCertificate::subject_header`]).
pub const CLIENT_CERT_SUBJECT_HEADER: &str = "x-client-cert-subject";
/// The request header that carries the SHA-256 fingerprint of a verified
/// client certificate to the backend.
pub const CLIENT_CERT_FINGERPRINT_HEADER: &str = "x-client-cert-fingerprint";
/// Every request header whose name starts with this (case aside) is
/// removed from what a client sends before it is forwarded: only the
/// proxy sets them.
pub const CLIENT_CERT_HEADER_PREFIX: &str = "x-client-cert-";

/// Whether a handshake asks for a client certificate or demands one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuthMode {
    /// The client is asked for a certificate; one it sends must be signed
    /// by the bundle (or the handshake fails), but a client that sends
    /// none is served. Routes with `client_cert.required` refuse its
    /// requests with 403.
    Optional,
    /// The handshake fails unless the client sends a certificate the
    /// bundle signed. The default.
    #[default]
    Required,
}

/// What a TLS handshake asks of the client (`client_auth` on a
/// certificate object): the CAs whose certificates it accepts, and
/// whether one is required. Values of this type are always valid: the
/// bundle parses, holds only CA certificates, and its verifier is built.
#[derive(Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "ClientAuthWire", into = "ClientAuthWire")]
pub struct ClientAuth {
    wire: ClientAuthWire,
    /// SHA-256 of the bundle's certificates (DER, each after its length):
    /// two bundles with the same id trust the same CAs.
    ca_id: [u8; 32],
    /// SHA-256 of everything that verifies: the mode, the CAs and the
    /// revocation lists.
    id: [u8; 32],
    verifier: Arc<dyn ClientCertVerifier>,
}

/// The document as sent and stored.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename = "ClientAuth")]
struct ClientAuthWire {
    /// The CA certificates (PEM, one or more) that sign the client
    /// certificates accepted. Not a secret: read APIs show it.
    ca_pem: String,
    /// `required` (the default): no handshake without a client certificate
    /// the bundle signed; `optional`: a client may send none.
    #[serde(default)]
    mode: ClientAuthMode,
    /// Certificate revocation lists (PEM, one or more `X509 CRL` blocks)
    /// of the CAs: a client certificate a list revokes is refused. With
    /// lists given, each CA that signs client certificates needs its own
    /// (a certificate whose issuer has none is refused); only the client's
    /// own certificate is checked, and a list past its next update is
    /// still used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crl_pem: Option<String>,
}

impl ClientAuth {
    /// Whether a client must send a certificate.
    pub fn mode(&self) -> ClientAuthMode {
        self.wire.mode
    }

    /// The CA bundle, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.wire.ca_pem
    }

    /// The revocation lists, PEM, if any.
    pub fn crl_pem(&self) -> Option<&str> {
        self.wire.crl_pem.as_deref()
    }

    /// What identifies the CAs trusted: equal for two bundles of the same
    /// certificates in the same order, whatever their PEM text.
    pub fn ca_id(&self) -> &[u8; 32] {
        &self.ca_id
    }

    /// What identifies how clients are verified: equal for two settings
    /// of the same mode, CAs and revocation lists, whatever their PEM
    /// text.
    pub fn id(&self) -> &[u8; 32] {
        &self.id
    }

    /// The rustls verifier of client certificates, built once.
    pub fn verifier(&self) -> &Arc<dyn ClientCertVerifier> {
        &self.verifier
    }
}

impl PartialEq for ClientAuth {
    fn eq(&self, other: &Self) -> bool {
        self.wire == other.wire
    }
}

impl Eq for ClientAuth {}

impl fmt::Debug for ClientAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientAuth").field("mode", &self.wire.mode).field("ca_id", &hex(&self.ca_id)).finish()
    }
}

impl From<ClientAuth> for ClientAuthWire {
    fn from(c: ClientAuth) -> Self {
        c.wire
    }
}

impl TryFrom<ClientAuthWire> for ClientAuth {
    type Error = Invalid;

    fn try_from(wire: ClientAuthWire) -> Result<Self, Invalid> {
        const FIELD: &str = "ca_pem";
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(wire.ca_pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| Invalid::unreadable(FIELD, format!("not PEM certificates ({e})")))?;
        if certs.is_empty() {
            return Err(Invalid::unreadable(FIELD, "no CERTIFICATE block found"));
        }
        let mut roots = rustls::RootCertStore::empty();
        let mut digest = Vec::with_capacity(certs.iter().map(|c| c.len() + 4).sum::<usize>());
        for (i, c) in certs.iter().enumerate() {
            let (_, parsed) = x509_parser::parse_x509_certificate(c.as_ref()).map_err(|e| {
                Invalid::unreadable(FIELD, format!("certificate {i} is not an X.509 certificate ({e})"))
            })?;
            if !parsed.is_ca() {
                return Err(Invalid::unreadable(
                    FIELD,
                    format!(
                        "certificate {i} ({}) is not a CA certificate (its basic constraints do not say CA), \
                         so it cannot sign client certificates",
                        parsed.subject()
                    ),
                ));
            }
            roots.add(c.clone()).map_err(|e| {
                Invalid::unreadable(FIELD, format!("certificate {i} is not a usable CA certificate ({e})"))
            })?;
            digest.extend_from_slice(&(c.len() as u32).to_be_bytes());
            digest.extend_from_slice(c.as_ref());
        }
        let ca_id = sha256(&digest);
        digest.push(wire.mode as u8);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut builder = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
        if let Some(pem) = &wire.crl_pem {
            let crls = revocation_lists(pem)?;
            for crl in &crls {
                digest.extend_from_slice(&(crl.len() as u32).to_be_bytes());
                digest.extend_from_slice(crl.as_ref());
            }
            builder = builder.with_crls(crls).only_check_end_entity_revocation();
        }
        let builder = match wire.mode {
            ClientAuthMode::Optional => builder.allow_unauthenticated(),
            ClientAuthMode::Required => builder,
        };
        let verifier = builder.build().map_err(|e| match e {
            rustls::server::VerifierBuilderError::InvalidCrl(e) => {
                Invalid::unreadable("crl_pem", format!("not a usable revocation list ({e:?})"))
            }
            other => Invalid::unreadable(FIELD, format!("no client verifier from it ({other})")),
        })?;
        Ok(ClientAuth { ca_id, id: sha256(&digest), wire, verifier })
    }
}

/// The revocation lists of a PEM text, at least one; errors name
/// `crl_pem`.
fn revocation_lists(pem: &str) -> Result<Vec<CertificateRevocationListDer<'static>>, Invalid> {
    const FIELD: &str = "crl_pem";
    let crls: Vec<CertificateRevocationListDer<'static>> = CertificateRevocationListDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| Invalid::unreadable(FIELD, format!("not PEM revocation lists ({e})")))?;
    if crls.is_empty() {
        return Err(Invalid::unreadable(FIELD, "no X509 CRL block found"));
    }
    Ok(crls)
}

/// What a route asks of a request's client certificate (`client_cert` on
/// a route). The default asks nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientCertPolicy {
    /// Requests must come over a connection whose client certificate was
    /// verified by the `client_auth` of the certificate that serves the
    /// request's host (the one its SNI name would select); others get 403.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub required: bool,
    /// The verified certificate's subject and fingerprint are passed to
    /// the backend in `X-Client-Cert-Subject` and
    /// `X-Client-Cert-Fingerprint` (when the connection has one). Clients'
    /// own headers of these names are always removed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forward_headers: bool,
}

impl ClientCertPolicy {
    /// Whether it asks nothing (the default).
    pub fn is_default(&self) -> bool {
        *self == ClientCertPolicy::default()
    }
}

/// What a verified client certificate says of itself, read once per
/// connection, ready for the headers sent to backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCertificate {
    /// The subject's distinguished name (RFC 4514 order and form), with
    /// bytes that cannot be in a header value percent-encoded (`%XX`, and
    /// `%` itself as `%25`).
    pub subject: http::HeaderValue,
    /// The SHA-256 of the certificate (DER), 64 lowercase hex digits.
    pub fingerprint: http::HeaderValue,
}

impl ClientCertificate {
    /// Reads the leaf certificate of a verified chain (DER). `None` when it
    /// does not parse as X.509 (the verifier has parsed it already, so this
    /// does not happen for a verified one).
    pub fn read(der: &[u8]) -> Option<ClientCertificate> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let subject = header_safe(&rfc4514(cert.subject()));
        let fingerprint = http::HeaderValue::from_str(&hex(&sha256(der))).ok()?;
        Some(ClientCertificate { subject: http::HeaderValue::from_str(&subject).ok()?, fingerprint })
    }
}

/// A distinguished name as RFC 4514 writes it: the most specific RDN
/// first (the reverse of the order in the certificate), `,` between RDNs.
fn rfc4514(name: &x509_parser::x509::X509Name<'_>) -> String {
    let mut rdns: Vec<String> = name
        .iter()
        .map(|rdn| {
            rdn.iter()
                .map(|atv| {
                    let key = x509_parser::objects::oid2abbrev(atv.attr_type(), x509_parser::objects::oid_registry())
                        .map_or_else(|_| atv.attr_type().to_id_string(), str::to_string);
                    let value =
                        atv.as_str().map_or_else(|_| format!("#{}", hex(atv.attr_value().data)), escape_rfc4514);
                    format!("{key}={value}")
                })
                .collect::<Vec<_>>()
                .join("+")
        })
        .collect();
    rdns.reverse();
    rdns.join(",")
}

/// Escapes an attribute value as RFC 4514, section 2.4 says.
fn escape_rfc4514(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    let last = v.chars().count().saturating_sub(1);
    for (i, c) in v.chars().enumerate() {
        let special = matches!(c, '"' | '+' | ',' | ';' | '<' | '>' | '\\')
            || (i == 0 && (c == '#' || c == ' '))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `text` with every byte that may not be in a header value (outside
/// visible ASCII and space), and `%`, as `%XX`.
fn header_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Lowercase hex.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256, by the ring provider rustls uses (its hash is reached through
/// a TLS 1.3 suite, which `tls13()` always gives).
fn sha256(data: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    if let Some(suite) = rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256.tls13() {
        let digest = suite.common.hash_provider.hash(data);
        out.copy_from_slice(&digest.as_ref()[..32]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca(name: &str) -> (rcgen::Certificate, (rcgen::KeyPair, rcgen::CertificateParams)) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        (params.self_signed(&key).unwrap(), (key, params))
    }

    fn parse(json: serde_json::Value) -> Result<ClientAuth, crate::ParseError> {
        crate::parse_json::<ClientAuth>(json.to_string().as_bytes())
    }

    #[test]
    fn a_ca_bundle_decodes_and_round_trips() {
        let (a, _) = ca("CA A");
        let (b, _) = ca("CA B");
        let bundle = format!("{}{}", a.pem(), b.pem());
        let auth = parse(serde_json::json!({ "ca_pem": bundle, "mode": "optional" })).unwrap();
        assert_eq!(auth.mode(), ClientAuthMode::Optional);
        assert!(!auth.verifier().client_auth_mandatory());
        let json = serde_json::to_value(&auth).unwrap();
        assert_eq!(json, serde_json::json!({ "ca_pem": bundle, "mode": "optional" }));
        let again: ClientAuth = serde_json::from_value(json).unwrap();
        assert_eq!(again, auth);
        assert_eq!(again.ca_id(), auth.ca_id());
        let required = parse(serde_json::json!({ "ca_pem": bundle })).unwrap();
        assert_eq!(required.mode(), ClientAuthMode::Required, "required is the default");
        assert!(required.verifier().client_auth_mandatory());
        assert_eq!(required.ca_id(), auth.ca_id(), "the same CAs, whatever the mode");
        assert_ne!(required.id(), auth.id(), "verified otherwise");
        // The same certificates in other PEM text trust the same CAs.
        let reflowed = parse(serde_json::json!({ "ca_pem": format!("\n{}\n{}", a.pem(), b.pem()) })).unwrap();
        assert_eq!(reflowed.ca_id(), required.ca_id());
        let only_a = parse(serde_json::json!({ "ca_pem": a.pem() })).unwrap();
        assert_ne!(only_a.ca_id(), required.ca_id());
    }

    #[test]
    fn bad_bundles_name_the_field() {
        for (pem, says) in [
            ("garbage".to_string(), "no CERTIFICATE block found"),
            ("-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n".to_string(), "not PEM"),
            (
                "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_string(),
                "certificate 0 is not an X.509 certificate",
            ),
        ] {
            let err = parse(serde_json::json!({ "ca_pem": pem })).unwrap_err().to_string();
            assert!(err.starts_with("ca_pem: ") && err.contains(says), "{pem:?}: {err}");
        }
        // A leaf is no CA.
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["a.example".to_string()]).unwrap().self_signed(&key).unwrap();
        let (a, _) = ca("CA A");
        let err = parse(serde_json::json!({ "ca_pem": format!("{}{}", a.pem(), leaf.pem()) })).unwrap_err();
        assert!(err.to_string().starts_with("ca_pem: certificate 1 ("), "{err}");
        assert!(err.to_string().contains("is not a CA certificate"), "{err}");
        let err = parse(serde_json::json!({ "ca_pem": a.pem(), "mode": "sometimes" })).unwrap_err();
        assert!(err.to_string().starts_with("mode: "), "{err}");
        for (crl, says) in [
            ("nothing".to_string(), "crl_pem: no X509 CRL block found"),
            ("-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n".to_string(), "crl_pem: not a usable"),
        ] {
            let err = parse(serde_json::json!({ "ca_pem": a.pem(), "crl_pem": crl })).unwrap_err().to_string();
            assert!(err.starts_with(says), "{err}");
        }
        let err = parse(serde_json::json!({ "ca_pem": a.pem(), "crl": "x" })).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn revocation_lists_decode_and_count_in_the_id() {
        let (a, a_key) = ca("CA A");
        let crl = rcgen::CertificateRevocationListParams {
            this_update: rcgen::date_time_ymd(2024, 1, 1),
            next_update: rcgen::date_time_ymd(2099, 1, 1),
            crl_number: rcgen::SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: vec![rcgen::RevokedCertParams {
                serial_number: rcgen::SerialNumber::from(7u64),
                revocation_time: rcgen::date_time_ymd(2024, 1, 1),
                reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                invalidity_date: None,
            }],
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        }
        .signed_by(&rcgen::Issuer::from_params(&a_key.1, &a_key.0))
        .unwrap();
        let with = parse(serde_json::json!({ "ca_pem": a.pem(), "crl_pem": crl.pem().unwrap() })).unwrap();
        let without = parse(serde_json::json!({ "ca_pem": a.pem() })).unwrap();
        assert_eq!(with.crl_pem(), Some(crl.pem().unwrap().as_str()));
        assert_eq!(with.ca_id(), without.ca_id());
        assert_ne!(with.id(), without.id());
        assert_eq!(serde_json::to_value(&with).unwrap()["crl_pem"], crl.pem().unwrap());
        assert!(serde_json::to_value(&without).unwrap().get("crl_pem").is_none());
    }

    #[test]
    fn a_client_certificate_reads_as_header_values() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(rcgen::DnType::OrganizationName, "Shop, Inc.");
        params.distinguished_name.push(rcgen::DnType::CommonName, "client \u{e9}1");
        let cert = params.self_signed(&key).unwrap();
        let read = ClientCertificate::read(cert.der()).unwrap();
        // RFC 4514 writes the RDNs last to first.
        let (_, parsed) = x509_parser::parse_x509_certificate(cert.der()).unwrap();
        let in_cert: Vec<String> =
            parsed.subject().iter().map(|r| format!("{:?}", r.iter().next().unwrap().attr_type())).collect();
        let expected = match in_cert.first().map(String::as_str) {
            Some(first) if first.contains("2.5.4.3") => "O=Shop\\, Inc.,CN=client %C3%A91",
            _ => "CN=client %C3%A91,O=Shop\\, Inc.",
        };
        assert_eq!(read.subject, expected, "{in_cert:?}");
        assert_eq!(read.fingerprint.len(), 64);
        assert!(read.fingerprint.to_str().unwrap().bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(read.fingerprint.to_str().unwrap(), hex(&sha256(cert.der())));
        assert_eq!(ClientCertificate::read(b"junk"), None);
    }

    #[test]
    fn a_route_policy_defaults_to_nothing() {
        let p: ClientCertPolicy = serde_json::from_str("{}").unwrap();
        assert!(p.is_default());
        let p: ClientCertPolicy = serde_json::from_str(r#"{"required": true}"#).unwrap();
        assert!(p.required && !p.forward_headers);
        assert_eq!(serde_json::to_string(&p).unwrap(), r#"{"required":true}"#);
        assert!(serde_json::from_str::<ClientCertPolicy>(r#"{"require": true}"#).is_err());
    }
}
