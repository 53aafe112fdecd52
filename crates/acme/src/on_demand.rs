//! On-demand TLS: a certificate for a server name nobody configured,
//! issued during the first handshake that asks for it, when an on-demand
//! template allows the name (its patterns, its `ask` URL).
//!
//! What keeps a flood of made-up names harmless: IP addresses and names
//! that are not DNS names are refused before anything else; the `ask`
//! URL sees each name at most once per [`ANSWER_TTL`] (concurrent
//! handshakes for one name share one question), at most [`MAX_ASKING`]
//! questions are open at once, and answers are kept for at most
//! [`MAX_ANSWERS`] names; new certificates are bounded by each template's
//! `max_certificates`, by a rate ([`NEW_PER_MINUTE`]) and by how many wait
//! for issuance at once ([`MAX_PENDING`]). A name refused costs no order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidegate_control::Control;
use tidegate_model::{CertName, CertificateInput, ChangeSet, Op};
use tidegate_upstream::{parse_http_url, HttpClient, HttpOptions};
use tokio::sync::{Notify, OnceCell, Semaphore};

/// How long an `ask` answer is kept, allowed or refused.
pub const ANSWER_TTL: Duration = Duration::from_secs(600);
/// Most names whose answers are kept.
pub const MAX_ANSWERS: usize = 10_000;
/// Most `ask` questions open at once; a handshake beyond it is refused.
pub const MAX_ASKING: usize = 32;
/// Most names waiting for their first certificate at once.
pub const MAX_PENDING: usize = 16;
/// New on-demand certificates per minute, all templates together (and the
/// burst allowed).
pub const NEW_PER_MINUTE: f64 = 30.0;
/// Longest a handshake waits for its certificate.
pub const WAIT: Duration = Duration::from_secs(25);
/// Time an `ask` URL has to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// An `ask` answer for one name: when it was asked, and the answer (or
/// the question still open, which later handshakes wait for).
type Answer = (Instant, Arc<OnceCell<bool>>);

/// Issues certificates on demand; shared by every TLS handshake.
pub struct OnDemandIssuer {
    control: Control,
    wake: Arc<Notify>,
    http: HttpClient,
    answers: Mutex<HashMap<String, Answer>>,
    asking: Semaphore,
    pending: Semaphore,
    /// Tokens for new certificates, and when they were last counted.
    tokens: Mutex<(f64, Instant)>,
}

impl OnDemandIssuer {
    /// An issuer on `control`'s configuration; `wake` starts the ACME
    /// manager's next look at once (the one [`crate::spawn`] takes).
    pub fn new(control: Control, wake: Arc<Notify>) -> OnDemandIssuer {
        OnDemandIssuer {
            control,
            wake,
            http: HttpClient::new(HttpOptions::default()),
            answers: Mutex::new(HashMap::new()),
            asking: Semaphore::new(MAX_ASKING),
            pending: Semaphore::new(MAX_PENDING),
            tokens: Mutex::new((NEW_PER_MINUTE, Instant::now())),
        }
    }

    /// Obtains a certificate for `name` (lowercase, no trailing dot) if a
    /// template allows it; true once one serves it, within [`WAIT`].
    pub async fn obtain(&self, name: String) -> bool {
        if !tidegate_model::acme::issuable(&name) {
            return false;
        }
        let config = self.control.config();
        let Some((template, spec)) = config
            .state
            .certificates()
            .iter()
            .find(|(_, c)| c.managed().and_then(|m| m.acme.on_demand()).is_some_and(|od| od.matches(&name)))
        else {
            return false;
        };
        let Some(m) = spec.managed() else { return false };
        let Some(od) = m.acme.on_demand() else { return false };
        let Ok(cert_name) = CertName::new(&format!("{template}.{name}")) else { return false };
        if !config.state.certificates().contains_key(&cert_name) {
            if let Some(ask) = &od.ask {
                if !self.allowed(ask, &name).await {
                    return false;
                }
            }
            let prefix = format!("{template}.");
            let issued = config.state.certificates().keys().filter(|n| n.as_str().starts_with(&prefix)).count();
            if issued >= od.max_certificates as usize {
                tracing::warn!(%template, %name, max = od.max_certificates, "on-demand template is full; no certificate");
                return false;
            }
            let Ok(_permit) = self.pending.try_acquire() else { return false };
            if !self.take_token() {
                tracing::warn!(%name, "on-demand certificates come faster than 30 a minute; refused");
                return false;
            }
            let Ok(acme) = m.acme.for_host(&name) else { return false };
            let input = CertificateInput::Managed { acme, default: false, client_auth: spec.client_auth().cloned() };
            let op = Op::PutCertificate { name: cert_name.clone(), spec: Box::new(input) };
            if let Err(e) = self.control.submit(ChangeSet { if_revision: None, ops: vec![op] }).await {
                tracing::warn!(%name, error = %e, "on-demand certificate not recorded");
                return false;
            }
            tracing::info!(certificate = %cert_name, "on-demand certificate asked for");
            self.wake.notify_one();
            return self.served(&name).await;
        }
        // Its first order failed and waits out its back-off: no handshake
        // waits for it meanwhile.
        let failing = config.state.certificates().get(&cert_name).and_then(|c| c.managed()).is_some_and(|m| {
            m.state.issued.is_none() && m.state.failures > 0 && m.state.retry_at > tidegate_model::unix_now()
        });
        if failing {
            return false;
        }
        self.served(&name).await
    }

    /// Waits, at most [`WAIT`], until a certificate serves `name`.
    async fn served(&self, name: &str) -> bool {
        let snapshots = self.control.snapshots();
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if !snapshots.load().certificates().wants_on_demand(name) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Whether `ask` allows `name`: asked once per [`ANSWER_TTL`], the
    /// handshakes for one name sharing the question.
    async fn allowed(&self, ask: &str, name: &str) -> bool {
        let cell = {
            let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            if answers.len() >= MAX_ANSWERS && !answers.contains_key(name) {
                answers.retain(|_, (at, _)| now.duration_since(*at) < ANSWER_TTL);
                if answers.len() >= MAX_ANSWERS {
                    return false;
                }
            }
            let entry = answers.entry(name.to_string()).or_insert_with(|| (now, Arc::new(OnceCell::new())));
            if now.duration_since(entry.0) >= ANSWER_TTL {
                *entry = (now, Arc::new(OnceCell::new()));
            }
            entry.1.clone()
        };
        *cell
            .get_or_init(|| async {
                let Ok(_permit) = self.asking.try_acquire() else { return false };
                let Ok(uri) = parse_http_url(&format!("{ask}?domain={name}")) else { return false };
                let answer = self.http.get(&uri, "tidegate-on-demand", &[], ASK_TIMEOUT, 4096).await;
                tracing::debug!(%name, allowed = answer.is_ok(), "on-demand ask");
                answer.is_ok()
            })
            .await
    }

    /// Takes a token for a new certificate, if the rate allows it.
    fn take_token(&self) -> bool {
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(tokens.1).as_secs_f64() * NEW_PER_MINUTE / 60.0;
        *tokens = ((tokens.0 + refill).min(NEW_PER_MINUTE), now);
        if tokens.0 >= 1.0 {
            tokens.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

impl std::fmt::Debug for OnDemandIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let answers = self.answers.lock().map_or(0, |a| a.len());
        f.debug_struct("OnDemandIssuer").field("answers", &answers).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_dns_names_are_issued_for() {
        for ok in ["shop.example", "a-b.c.example", "x1.example"] {
            assert!(tidegate_model::acme::issuable(ok), "{ok}");
        }
        for bad in ["10.0.0.1", "localhost", "a..example", "-a.example", "Shop.example", "a_b.example", "1.2.3.4"] {
            assert!(!tidegate_model::acme::issuable(bad), "{bad}");
        }
    }
}
