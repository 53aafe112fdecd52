//! One order of a managed certificate, from the account to the issued
//! chain, with instant-acme. Every step that other instances must see (the
//! account, the challenge answers, the result) is written through the
//! configuration's change log as an `acme_state` op, so the CA may reach
//! any instance and the certificate is live on all of them once issued.

use std::time::Duration;

use instant_acme::{
    Account, AuthorizationStatus, ChallengeType, Identifier, NewAccount, NewOrder, OrderStatus, RetryPolicy,
};
use tidegate_control::Control;
use tidegate_model::{
    unix_now, AcmeAccount, AcmeSpec, AcmeState, CertName, ChallengeAnswer, ChallengeKind, ChangeSet, KeyedChain, Op,
};

use crate::client::Client;
use crate::plan::{self, Why};

/// Why an order failed (its text is the certificate's `last_error`).
#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    /// The certificate was deleted, or is no longer managed.
    #[error("the certificate is gone or no longer managed")]
    Gone,
    /// The CA or the exchange with it failed.
    #[error("ACME: {0}")]
    Acme(#[from] instant_acme::Error),
    /// The HTTPS client could not be built from `directory_ca_pem`.
    #[error("directory_ca_pem: {0}")]
    Trust(#[from] rustls::Error),
    /// The CA offers no challenge of the configured kind for a host.
    #[error("the CA offers no {kind} challenge for {host}")]
    NoChallenge {
        /// The challenge kind configured.
        kind: &'static str,
        /// The host.
        host: String,
    },
    /// The CA refused an authorization or the order.
    #[error("the CA refused the order: {0}")]
    Refused(String),
    /// The DNS hook failed.
    #[error("dns_hook: {0}")]
    Hook(String),
    /// A certificate or key could not be made.
    #[error("making the {what}: {detail}")]
    Make {
        /// What was being made.
        what: &'static str,
        /// Why it failed.
        detail: String,
    },
    /// The configuration could not be written.
    #[error("writing the certificate's state: {0}")]
    Write(String),
    /// The order took longer than [`ORDER_TIMEOUT`].
    #[error("the order took longer than 10 minutes")]
    Timeout,
}

/// Longest one order may take, from the account to the chain.
pub const ORDER_TIMEOUT: Duration = Duration::from_secs(600);

/// How long to wait for the CA to validate and to issue.
const POLL: RetryPolicy =
    RetryPolicy::new().initial_delay(Duration::from_millis(250)).backoff(1.5).timeout(Duration::from_secs(180));

/// Places one order for the managed certificate `name` and records its
/// outcome (issued, or failed with its back-off) in the configuration.
pub async fn run(control: &Control, name: &CertName, why: Why) -> Result<(), OrderError> {
    let (acme, requested) = {
        let config = control.config();
        let m = config.state.certificates().get(name).and_then(|c| c.managed().cloned()).ok_or(OrderError::Gone)?;
        (m.acme, m.state.renew_requested)
    };
    tracing::info!(certificate = %name, hosts = ?acme.hosts(), reason = why.as_str(), "ACME order starts");
    write(control, name, |s| {
        s.ordering_since = unix_now().max(1);
        s.orders += 1;
    })
    .await?;
    let outcome = match tokio::time::timeout(ORDER_TIMEOUT, order(control, name, &acme)).await {
        Ok(outcome) => outcome,
        Err(_) => Err(OrderError::Timeout),
    };
    let dns_records: Vec<(String, String)> = current_dns_records(control, name);
    let result = match outcome {
        Ok(issued) => {
            let info = issued.info().clone();
            let at = plan::renew_at(info.not_before, info.not_after, acme.renew_after(), fastrand::f64(), unix_now());
            tracing::info!(certificate = %name, not_after = info.not_after, renew_at = at, "ACME certificate issued");
            write(control, name, |s| {
                s.issued = Some(issued.clone());
                s.challenges.clear();
                s.renewed = s.renewed.max(requested);
                s.renew_at = at;
                s.issued_at = unix_now();
                s.failures = 0;
                s.retry_at = 0;
                s.last_error = None;
                s.ordering_since = 0;
            })
            .await
        }
        Err(OrderError::Gone) => Err(OrderError::Gone),
        Err(e) => {
            let text = e.to_string();
            tracing::warn!(certificate = %name, error = %text, "ACME order failed");
            let _ = write(control, name, |s| {
                s.failures = s.failures.saturating_add(1);
                s.retry_at = unix_now() + plan::retry_after(s.failures, None) as i64;
                s.last_error = Some(text.clone());
                s.challenges.clear();
                // A renewal asked for is answered by this attempt, failed
                // or not: the back-off then holds the next one.
                s.renewed = s.renewed.max(requested);
                s.ordering_since = 0;
            })
            .await;
            Err(e)
        }
    };
    if let Some(hook) = acme.dns_hook() {
        for (record, value) in dns_records {
            if let Err(e) = crate::hook::run(hook, "clear", &record, &value).await {
                tracing::warn!(certificate = %name, %record, error = %e, "the DNS hook did not remove the record");
            }
        }
    }
    result
}

/// The DNS records the order in progress set (to remove them after).
fn current_dns_records(control: &Control, name: &CertName) -> Vec<(String, String)> {
    let config = control.config();
    let Some(m) = config.state.certificates().get(name).and_then(|c| c.managed().cloned()) else {
        return Vec::new();
    };
    m.state
        .challenges
        .iter()
        .filter_map(|c| match c {
            ChallengeAnswer::Dns01 { record, value } => Some((record.clone(), value.clone())),
            _ => None,
        })
        .collect()
}

/// The order itself: the account, the challenges, the chain.
async fn order(control: &Control, name: &CertName, acme: &AcmeSpec) -> Result<KeyedChain, OrderError> {
    let account = account(control, name, acme).await?;
    let identifiers: Vec<Identifier> = acme.hosts().iter().map(|h| Identifier::Dns(h.clone())).collect();
    let mut order = account.new_order(&NewOrder::new(&identifiers)).await?;
    let kind = match acme.challenge() {
        ChallengeKind::Http01 => ChallengeType::Http01,
        ChallengeKind::TlsAlpn01 => ChallengeType::TlsAlpn01,
        ChallengeKind::Dns01 => ChallengeType::Dns01,
    };
    // First the answers, published to every instance; then the CA is told
    // to look.
    let mut answers = Vec::new();
    let mut authorizations = order.authorizations();
    while let Some(authz) = authorizations.next().await {
        let mut authz = authz?;
        match authz.status {
            AuthorizationStatus::Valid => continue,
            AuthorizationStatus::Pending => {}
            other => return Err(OrderError::Refused(format!("authorization {:?}", other))),
        }
        let host = authz.identifier().to_string();
        let challenge = authz
            .challenge(kind.clone())
            .ok_or_else(|| OrderError::NoChallenge { kind: acme.challenge().as_str(), host: host.clone() })?;
        let key_authorization = challenge.key_authorization();
        answers.push(match acme.challenge() {
            ChallengeKind::Http01 => ChallengeAnswer::Http01 {
                token: challenge.token.clone(),
                key_authorization: key_authorization.as_str().to_string(),
            },
            ChallengeKind::TlsAlpn01 => ChallengeAnswer::TlsAlpn01 {
                certificate: validation_certificate(&host, key_authorization.digest().as_ref())?,
                host,
            },
            ChallengeKind::Dns01 => ChallengeAnswer::Dns01 {
                record: format!("_acme-challenge.{}.", host.trim_start_matches("*.")),
                value: key_authorization.dns_value(),
            },
        });
    }
    let published = answers.clone();
    write(control, name, move |s| s.challenges = published.clone()).await?;
    if let Some(hook) = acme.dns_hook() {
        for answer in &answers {
            if let ChallengeAnswer::Dns01 { record, value } = answer {
                crate::hook::run(hook, "set", record, value).await.map_err(OrderError::Hook)?;
            }
        }
        tokio::time::sleep(Duration::from_secs(hook.wait_s.into())).await;
    }
    let mut authorizations = order.authorizations();
    while let Some(authz) = authorizations.next().await {
        let mut authz = authz?;
        if authz.status != AuthorizationStatus::Pending {
            continue;
        }
        if let Some(mut challenge) = authz.challenge(kind.clone()) {
            challenge.set_ready().await?;
        }
    }
    let status = order.poll_ready(&POLL).await?;
    if status != OrderStatus::Ready {
        return Err(OrderError::Refused(refusal(&mut order).await.unwrap_or_else(|| format!("order {status:?}"))));
    }
    let key = rcgen::KeyPair::generate().map_err(|e| make("certificate key", e))?;
    let mut params = rcgen::CertificateParams::new(acme.hosts().to_vec()).map_err(|e| make("request", e))?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    let csr = params.serialize_request(&key).map_err(|e| make("request", e))?;
    order.finalize_csr(csr.der()).await?;
    let chain = order.poll_certificate(&POLL).await?;
    KeyedChain::new(chain, key.serialize_pem()).map_err(|e| make("issued certificate", e))
}

/// What the CA said of a refused authorization, when it said something.
async fn refusal(order: &mut instant_acme::Order) -> Option<String> {
    let mut authorizations = order.authorizations();
    while let Some(Ok(mut authz)) = authorizations.next().await {
        if authz.status == AuthorizationStatus::Invalid {
            let host = authz.identifier().to_string();
            let detail = authz
                .refresh()
                .await
                .ok()
                .and_then(|state| state.challenges.iter().find_map(|c| c.error.as_ref().map(|e| e.to_string())));
            return Some(format!("{host}: {}", detail.unwrap_or_else(|| "authorization invalid".into())));
        }
    }
    None
}

fn make(what: &'static str, e: impl std::fmt::Display) -> OrderError {
    OrderError::Make { what, detail: e.to_string() }
}

/// The account to order with: the one stored for this directory, or a new
/// one (recorded at once, so a failed order does not create another).
async fn account(control: &Control, name: &CertName, acme: &AcmeSpec) -> Result<Account, OrderError> {
    let client = || Client::new(acme.directory_ca()).map(|c| Box::new(c) as Box<dyn instant_acme::HttpClient>);
    let stored = {
        let config = control.config();
        // Any managed certificate's account for the same directory and
        // contact will do: one account per CA, not per certificate.
        let own = config.state.certificates().get(name).and_then(|c| c.managed()).and_then(|m| m.state.account.clone());
        own.filter(|a| a.directory == acme.directory()).or_else(|| {
            config.state.certificates().values().filter_map(|c| c.managed()).find_map(|m| {
                m.state
                    .account
                    .clone()
                    .filter(|a| a.directory == acme.directory() && m.acme.contact() == acme.contact())
            })
        })
    };
    if let Some(stored) = stored {
        if let Ok(credentials) = serde_json::from_str(&stored.credentials) {
            let account = Account::builder_with_http(client()?).from_credentials(credentials).await?;
            return Ok(account);
        }
    }
    let contact: Vec<&str> = acme.contact().into_iter().collect();
    let new = NewAccount { contact: &contact, terms_of_service_agreed: true, only_return_existing: false };
    let (account, credentials) =
        Account::builder_with_http(client()?).create(&new, acme.directory().to_string(), None).await?;
    let credentials = serde_json::to_string(&credentials).map_err(|e| make("account", e))?;
    let record = AcmeAccount { directory: acme.directory().to_string(), credentials };
    write(control, name, move |s| s.account = Some(record.clone())).await?;
    Ok(account)
}

/// The self-signed certificate a TLS-ALPN-01 validation is answered with
/// (RFC 8737, section 3): the host as its only name, and the SHA-256 of
/// the key authorization in a critical `acmeIdentifier` extension.
fn validation_certificate(host: &str, digest: &[u8]) -> Result<KeyedChain, OrderError> {
    let key = rcgen::KeyPair::generate().map_err(|e| make("validation key", e))?;
    let mut params =
        rcgen::CertificateParams::new(vec![host.to_string()]).map_err(|e| make("validation certificate", e))?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.custom_extensions = vec![rcgen::CustomExtension::new_acme_identifier(digest)];
    let cert = params.self_signed(&key).map_err(|e| make("validation certificate", e))?;
    KeyedChain::validation(cert.pem(), key.serialize_pem()).map_err(|e| make("validation certificate", e))
}

/// Applies `change` to the current state of the managed certificate
/// `name` and writes it (`acme_state`).
async fn write(control: &Control, name: &CertName, change: impl Fn(&mut AcmeState)) -> Result<(), OrderError> {
    // A concurrent change of the configuration may pass ours: read, change
    // and write again (the op keeps what users own, `renew_requested`).
    for _ in 0..5 {
        let (mut state, revision) = {
            let config = control.config();
            let m = config.state.certificates().get(name).and_then(|c| c.managed().cloned()).ok_or(OrderError::Gone)?;
            (m.state, config.revision)
        };
        change(&mut state);
        let op = Op::AcmeState { name: name.clone(), state: Box::new(state) };
        match control.submit(ChangeSet { if_revision: Some(revision), ops: vec![op] }).await {
            Ok(_) => return Ok(()),
            // A stale revision: read again. The certificate deleted or
            // turned into an uploaded one: the order has nothing to do.
            Err(tidegate_control::SubmitError::Rejected(e)) if e.field.as_deref() == Some("if_revision") => continue,
            Err(tidegate_control::SubmitError::Rejected(_)) => return Err(OrderError::Gone),
            Err(e) => return Err(OrderError::Write(e.to_string())),
        }
    }
    Err(OrderError::Write("the configuration kept changing".into()))
}
