//! The certificates of a snapshot, indexed for SNI: exact names, then
//! `*.` wildcards (one label, RFC 6125), then the default certificate.

use std::collections::HashMap;
use std::sync::Arc;

use rustls::sign::CertifiedKey;
use tidegate_model::{CertName, CertificateInfo, ChallengeAnswer, ClientAuth, ConfigState};

/// What a handshake that selects a certificate serves: its chain and key,
/// and what it asks of the client's certificate.
#[derive(Debug, Clone)]
pub struct Served {
    /// The chain and key.
    pub key: Arc<CertifiedKey>,
    /// The certificate's `client_auth`, if it has one.
    pub client_auth: Option<Arc<ClientAuth>>,
}

/// Certificates by the names they serve. Rebuilt whole when a certificate
/// changes (a configuration has a handful to hundreds of them; routes and
/// services, which can be tens of thousands, are rebuilt incrementally).
#[derive(Debug, Clone, Default)]
pub struct Certificates {
    exact: HashMap<String, Served>,
    /// By the suffix a wildcard covers (`*.example.com` → `.example.com`).
    wildcard: HashMap<String, Served>,
    default: Option<Served>,
    /// Every certificate served, for status and metrics.
    all: Vec<(CertName, Arc<CertificateInfo>)>,
    /// ACME HTTP-01 answers by token.
    http01: HashMap<String, Arc<str>>,
    /// ACME TLS-ALPN-01 validation certificates by host.
    tls_alpn01: HashMap<String, Arc<CertifiedKey>>,
    /// Managed certificates, issued or not.
    managed: usize,
    /// Whether some managed certificate is an on-demand template.
    on_demand: bool,
}

impl Certificates {
    /// Indexes every certificate of `state`. When two certificates serve
    /// the same name, the one valid longest wins (so a renewed certificate
    /// can be added before the old one is deleted).
    pub fn build(state: &ConfigState) -> Certificates {
        let mut c = Certificates::default();
        let mut best: HashMap<String, i64> = HashMap::new();
        for (name, spec) in state.certificates() {
            if let Some(managed) = spec.managed() {
                c.managed += 1;
                c.on_demand |= managed.acme.on_demand().is_some();
                for answer in &managed.state.challenges {
                    match answer {
                        ChallengeAnswer::Http01 { token, key_authorization } => {
                            c.http01.insert(token.clone(), Arc::from(key_authorization.as_str()));
                        }
                        ChallengeAnswer::TlsAlpn01 { host, certificate } => {
                            c.tls_alpn01.insert(host.clone(), certificate.certified_key().clone());
                        }
                        ChallengeAnswer::Dns01 { .. } => {}
                    }
                }
            }
            let Some(served) = spec.served() else { continue };
            let (info, key) = (served.info(), served.certified_key());
            c.all.push((name.clone(), Arc::new(info.clone())));
            let served = Served { key: key.clone(), client_auth: spec.client_auth().cloned().map(Arc::new) };
            if spec.is_default() {
                c.default = Some(served.clone());
            }
            for n in &info.names {
                if best.get(n).is_some_and(|until| *until >= info.not_after) {
                    continue;
                }
                best.insert(n.clone(), info.not_after);
                match n.strip_prefix('*') {
                    Some(suffix) if suffix.starts_with('.') => {
                        c.wildcard.insert(suffix.to_string(), served.clone());
                    }
                    _ => {
                        c.exact.insert(n.clone(), served.clone());
                    }
                }
            }
        }
        c
    }

    /// The answer to an ACME HTTP-01 challenge: the key authorization for
    /// `token` (the last segment of `/.well-known/acme-challenge/TOKEN`),
    /// while an order of a managed certificate waits for it.
    pub fn http01(&self, token: &str) -> Option<&Arc<str>> {
        self.http01.get(token)
    }

    /// The validation certificate of an ACME TLS-ALPN-01 challenge for
    /// `sni` (a handshake that offers ALPN `acme-tls/1`), while an order
    /// waits for it.
    pub fn tls_alpn01(&self, sni: Option<&str>) -> Option<Arc<CertifiedKey>> {
        let name = sni?.strip_suffix('.').unwrap_or(sni?);
        self.tls_alpn01.get(&name.to_ascii_lowercase()).cloned()
    }

    /// How many certificates are managed by ACME (issued or not yet).
    pub fn managed(&self) -> usize {
        self.managed
    }

    /// The certificate for a client that asked for `sni` (or for none).
    /// The name is read as routes read a `Host`: case aside, and without
    /// one trailing dot (`app.example.` is the fully qualified form of
    /// `app.example`; RFC 6066 has clients send it without, and some do
    /// not).
    pub fn resolve(&self, sni: Option<&str>) -> Option<Arc<CertifiedKey>> {
        self.select(sni).map(|s| s.key.clone())
    }

    /// What a client that asked for `sni` (or for none) is served: the
    /// certificate [`Certificates::resolve`] picks, with its `client_auth`.
    pub fn select(&self, sni: Option<&str>) -> Option<&Served> {
        sni.and_then(|name| self.named(name)).or(self.default.as_ref())
    }

    /// The certificate that serves `name` by name (exact, then wildcard),
    /// not the default.
    fn named(&self, name: &str) -> Option<&Served> {
        let name = name.strip_suffix('.').unwrap_or(name);
        let lower;
        let name = if name.bytes().any(|b| b.is_ascii_uppercase()) {
            lower = name.to_ascii_lowercase();
            lower.as_str()
        } else {
            name
        };
        self.exact.get(name).or_else(|| name.find('.').and_then(|dot| self.wildcard.get(&name[dot..])))
    }

    /// Whether a handshake for `sni` may get a certificate issued on demand:
    /// an on-demand template exists and no certificate serves the name
    /// (the default aside). The templates' own rules (patterns, the ask
    /// URL, limits) are the ACME manager's to apply.
    pub fn wants_on_demand(&self, sni: &str) -> bool {
        self.on_demand && self.named(sni).is_none()
    }

    /// The `client_auth` of every certificate the index serves (repeated:
    /// once per name that selects it).
    pub fn client_auths(&self) -> impl Iterator<Item = &Arc<ClientAuth>> {
        self.default
            .iter()
            .chain(self.exact.values())
            .chain(self.wildcard.values())
            .filter_map(|s| s.client_auth.as_ref())
    }

    /// Every certificate: its name and what it says of itself.
    pub fn all(&self) -> &[(CertName, Arc<CertificateInfo>)] {
        &self.all
    }

    /// Whether there is no certificate at all (none served, none managed).
    pub fn is_empty(&self) -> bool {
        self.all.is_empty() && self.managed == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_op(name: &str, names: &[&str], default: bool) -> serde_json::Value {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        let cert = params.self_signed(&key).unwrap();
        serde_json::json!({ "op": "put_certificate", "name": name,
            "spec": { "cert_pem": cert.pem(), "key_pem": key.serialize_pem(), "default": default } })
    }

    #[test]
    fn sni_picks_exact_then_wildcard_then_default() {
        let ops = serde_json::json!({ "ops": [
            cert_op("a", &["a.example"], false),
            cert_op("wild", &["*.example"], false),
            cert_op("fallback", &["fallback.example"], true),
        ]});
        let cs = tidegate_model::parse_change_set(ops.to_string().as_bytes()).unwrap();
        let (state, _) = ConfigState::default().apply(&cs, 0).unwrap();
        let c = Certificates::build(&state);
        let key_of = |n: &str| state.certificates().get(n).unwrap().certified_key().unwrap().clone();
        let same = |a: Option<Arc<CertifiedKey>>, b: &str| a.is_some_and(|a| Arc::ptr_eq(&a, &key_of(b)));
        assert!(same(c.resolve(Some("a.example")), "a"));
        assert!(same(c.resolve(Some("A.Example")), "a"), "case-insensitive");
        assert!(same(c.resolve(Some("a.example.")), "a"), "one trailing dot");
        assert!(same(c.resolve(Some("b.example.")), "wild"), "one trailing dot, wildcard");
        assert!(same(c.resolve(Some("a.example..")), "fallback"), "only one dot");
        assert!(same(c.resolve(Some("b.example")), "wild"));
        assert!(same(c.resolve(Some("x.b.example")), "fallback"), "a wildcard covers one label");
        assert!(same(c.resolve(None), "fallback"));
        assert_eq!(c.all().len(), 3);
    }

    #[test]
    fn a_selected_certificate_brings_its_client_auth() {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let mut mtls = cert_op("m", &["m.example"], false);
        mtls["spec"]["client_auth"] = serde_json::json!({ "ca_pem": ca.pem() });
        let ops = serde_json::json!({ "ops": [mtls, cert_op("fallback", &["fallback.example"], true)] });
        let cs = tidegate_model::parse_change_set(ops.to_string().as_bytes()).unwrap();
        let (state, _) = ConfigState::default().apply(&cs, 0).unwrap();
        let c = Certificates::build(&state);
        let auth = c.select(Some("M.example.")).and_then(|s| s.client_auth.clone()).expect("m asks");
        assert_eq!(auth.mode(), tidegate_model::ClientAuthMode::Required);
        assert!(c.select(Some("other.example")).is_some_and(|s| s.client_auth.is_none()), "the default asks nothing");
    }
}
