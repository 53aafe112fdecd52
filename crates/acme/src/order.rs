//! One order of a managed certificate, from the account to the issued
//! chain, with instant-acme. Every step that other instances must see (the
//! account, the challenge answers, the result) is written through the
//! configuration's change log as an `acme_state` op, so the CA may reach
//! any instance and the certificate is live on all of them once issued.

use std::time::Duration;

use instant_acme::{
    Account, AuthorizationStatus, CertificateIdentifier, ChallengeType, Identifier, NewAccount, NewOrder, OrderStatus,
    RetryPolicy,
};
use tidegate_control::Control;
use tidegate_model::{
    unix_now, AcmeAccount, AcmeSpec, AcmeState, CertName, ChallengeAnswer, ChallengeKind, ChangeSet, KeyedChain, Op,
    RenewalInfo,
};

use crate::client::{Client, RetryHint};
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
    let hint = RetryHint::default();
    let outcome = match tokio::time::timeout(ORDER_TIMEOUT, order(control, name, &acme, &hint)).await {
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
                // The CA is asked about the new certificate next.
                s.renewal_info = None;
            })
            .await
        }
        Err(OrderError::Gone) => Err(OrderError::Gone),
        Err(e) => {
            let text = e.to_string();
            let ca_wait = hint.seconds();
            tracing::warn!(certificate = %name, error = %text, ca_retry_after_s = ?ca_wait, "ACME order failed");
            let _ = write(control, name, |s| {
                s.failures = s.failures.saturating_add(1);
                s.retry_at = unix_now() + plan::retry_after(s.failures, ca_wait) as i64;
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

/// Asks the CA's renewal information (ACME ARI, RFC 9773) about the
/// certificate `name` serves, and records the window it suggests (or that
/// the CA offers none, or that the question failed and when to ask again).
pub async fn ask_renewal_info(control: &Control, name: &CertName) -> Result<(), OrderError> {
    let (acme, issued) = {
        let config = control.config();
        let m = config.state.certificates().get(name).and_then(|c| c.managed().cloned()).ok_or(OrderError::Gone)?;
        (m.acme, m.state.issued.ok_or(OrderError::Gone)?)
    };
    let now = unix_now();
    let info = match renewal_window(control, name, &acme, &issued).await {
        Ok(Some((start, end, retry_after))) => {
            let renew_at = plan::in_window(start, end, fastrand::f64(), now);
            let next_check = now + plan::renewal_info_recheck(Some(retry_after)) as i64;
            tracing::info!(certificate = %name, start, end, renew_at, "the CA's renewal information read");
            RenewalInfo::Window { start, end, renew_at, next_check }
        }
        Ok(None) => RenewalInfo::NotOffered,
        Err(OrderError::Gone) => return Err(OrderError::Gone),
        Err(e) => {
            tracing::warn!(certificate = %name, error = %e, "asking the CA's renewal information failed");
            RenewalInfo::Unanswered { next_check: now + plan::RENEWAL_INFO_RETRY as i64 }
        }
    };
    write(control, name, move |s| s.renewal_info = Some(info)).await
}

/// The CA's suggested renewal window for `issued` (Unix seconds) and its
/// `Retry-After` in seconds; None when the CA offers no renewal
/// information.
async fn renewal_window(
    control: &Control,
    name: &CertName,
    acme: &AcmeSpec,
    issued: &KeyedChain,
) -> Result<Option<(i64, i64, u64)>, OrderError> {
    let id = certificate_id(issued)?;
    let account = account(control, name, acme, &RetryHint::default()).await?;
    match account.renewal_info(&id).await {
        Ok((info, retry_after)) => {
            let window = info.suggested_window;
            Ok(Some((window.start.unix_timestamp(), window.end.unix_timestamp(), retry_after.as_secs())))
        }
        Err(instant_acme::Error::Unsupported(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The ARI identifier of the leaf of `chain`: its issuer's key identifier
/// and its serial number.
fn certificate_id(chain: &KeyedChain) -> Result<CertificateIdentifier<'static>, OrderError> {
    let leaf = chain.certified_key().cert.first().ok_or_else(|| make("certificate identifier", "an empty chain"))?;
    CertificateIdentifier::try_from(leaf).map_err(|e| make("certificate identifier", e))
}

/// The order itself: the account, the challenges, the chain.
async fn order(
    control: &Control,
    name: &CertName,
    acme: &AcmeSpec,
    hint: &RetryHint,
) -> Result<KeyedChain, OrderError> {
    let account = account(control, name, acme, hint).await?;
    let identifiers: Vec<Identifier> = acme.hosts().iter().map(|h| Identifier::Dns(h.clone())).collect();
    // A renewal names the certificate it replaces when the CA keeps
    // renewal information (RFC 9773 section 5): the CA may then exempt it
    // from its rate limits. Should the CA refuse that (the certificate
    // already replaced), the order goes again without.
    let replaces = replaced(control, name)?;
    let mut order = match replaces {
        Some(id) => match account.new_order(&NewOrder::new(&identifiers).replaces(id)).await {
            Ok(order) => order,
            Err(e) => {
                tracing::info!(certificate = %name, error = %e, "the CA refused the replacement; ordering anew");
                account.new_order(&NewOrder::new(&identifiers)).await?
            }
        },
        None => account.new_order(&NewOrder::new(&identifiers)).await?,
    };
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

/// The identifier of the certificate a new order of `name` replaces: the
/// one served, when the CA offers renewal information.
fn replaced(control: &Control, name: &CertName) -> Result<Option<CertificateIdentifier<'static>>, OrderError> {
    let config = control.config();
    let m = config.state.certificates().get(name).and_then(|c| c.managed()).ok_or(OrderError::Gone)?;
    match (&m.state.issued, &m.state.renewal_info) {
        (Some(issued), Some(info)) if info.offered() => certificate_id(issued).map(Some),
        _ => Ok(None),
    }
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
async fn account(control: &Control, name: &CertName, acme: &AcmeSpec, hint: &RetryHint) -> Result<Account, OrderError> {
    let client =
        || Client::new(acme.directory_ca(), hint.clone()).map(|c| Box::new(c) as Box<dyn instant_acme::HttpClient>);
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
