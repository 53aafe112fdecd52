//! When a managed certificate needs an order, and when the next one may
//! follow a failure: pure decisions over its state and the clock (Unix
//! seconds), no IO.

use tidegate_model::Managed;

/// Why an order is placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// None was ever issued.
    First,
    /// The certificate served does not name exactly the hosts asked for
    /// (the `acme` block changed).
    HostsChanged,
    /// Its renewal time came.
    RenewalDue,
    /// The CA's renewal information (RFC 9773) asked for it earlier.
    CaSuggested,
    /// A user asked (`ctl cert renew`).
    Requested,
}

impl Why {
    /// As the log and events say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::First => "no certificate yet",
            Why::HostsChanged => "the hosts changed",
            Why::RenewalDue => "renewal is due",
            Why::CaSuggested => "the CA's renewal information suggests it",
            Why::Requested => "a renewal was requested",
        }
    }
}

/// What to do about a managed certificate now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Place an order now.
    Now(Why),
    /// Ask the CA's renewal information (RFC 9773) about the certificate
    /// served: never asked about this one, or its time to ask again came.
    AskRenewalInfo,
    /// Nothing before this time (Unix seconds): its renewal, or the end of
    /// a failure's back-off.
    At(i64),
}

/// What to do about `m` at `now`. A failure's back-off holds every order
/// but one a user asked for.
pub fn due(m: &Managed, now: i64) -> Due {
    if m.acme.on_demand().is_some() {
        // A template: the certificates it issues are ordered, not it.
        return Due::At(i64::MAX);
    }
    let s = &m.state;
    if s.renew_requested > s.renewed {
        return Due::Now(Why::Requested);
    }
    if s.failures > 0 && now < s.retry_at {
        return Due::At(s.retry_at);
    }
    if s.issued.is_none() {
        return Due::Now(Why::First);
    }
    if !m.covers_hosts() {
        return Due::Now(Why::HostsChanged);
    }
    let due_at = s.renewal_due_at();
    if now >= due_at {
        return Due::Now(if due_at < s.renew_at { Why::CaSuggested } else { Why::RenewalDue });
    }
    match s.renewal_info.as_ref().map(|r| r.next_check()) {
        None => Due::AskRenewalInfo,
        Some(Some(check)) if now >= check => Due::AskRenewalInfo,
        Some(Some(check)) => Due::At(due_at.min(check)),
        Some(None) => Due::At(due_at),
    }
}

/// The time to renew at in the window `[start, end]` a CA suggests (RFC
/// 9773, section 4.2): a uniformly random point of it (`random` in 0..1),
/// so that a CA's renewals spread over the window; now when that point
/// (or the whole window) is past.
pub fn in_window(start: i64, end: i64, random: f64, now: i64) -> i64 {
    let end = end.max(start);
    let picked = start.saturating_add(((end - start) as f64 * random.clamp(0.0, 1.0)) as i64);
    picked.max(now)
}

/// Seconds before asking a CA's renewal information again, after it
/// answered with `retry_after` (its `Retry-After`): at least a minute, at
/// most a day (RFC 9773 section 4.3 leaves the bounds to the client; a CA
/// that says "now" must not be asked in a loop, and a renewal the CA
/// brings forward should be seen the same day).
pub fn renewal_info_recheck(retry_after: Option<u64>) -> u64 {
    retry_after.unwrap_or(RENEWAL_INFO_RETRY).clamp(60, 86_400)
}

/// Seconds before asking a CA's renewal information again after the
/// question failed, or when it gave no `Retry-After`: six hours, RFC 9773's
/// suggested default.
pub const RENEWAL_INFO_RETRY: u64 = 6 * 3_600;

/// When a certificate valid from `not_before` to `not_after` is to be
/// renewed: after `fraction` of its lifetime, brought earlier by `jitter`
/// (0..1) times 2 % of the lifetime so the certificates of a fleet do not
/// all renew in the same second, and never later than [`last_margin`]
/// before it expires (nor before `now`).
pub fn renew_at(not_before: i64, not_after: i64, fraction: f64, jitter: f64, now: i64) -> i64 {
    let lifetime = (not_after - not_before).max(0);
    let planned = not_before as f64 + lifetime as f64 * fraction - lifetime as f64 * 0.02 * jitter.clamp(0.0, 1.0);
    let last = not_after - last_margin(lifetime);
    (planned as i64).min(last).max(now.min(last.max(not_before)))
}

/// How long before its expiry a certificate of `lifetime` seconds is
/// renewed at the latest: a day, or a quarter of its lifetime when that is
/// shorter (short-lived certificates: a 6-day one keeps its day, one of a
/// few hours or seconds, as a test CA issues, still renews before it
/// expires instead of at once and over again).
pub fn last_margin(lifetime: i64) -> i64 {
    86_400.min(lifetime.max(0) / 4)
}

/// Seconds to wait before the next order after `failures` failed in a row
/// (at least 1): one minute, doubling, at most a day. Let's Encrypt allows
/// 5 failed validations per host per hour, so the first few retries stay
/// under it and a broken setup settles at one order a day. A CA's own
/// `Retry-After` (`hint`), when longer, wins.
pub fn retry_after(failures: u32, hint: Option<u64>) -> u64 {
    let own = 60u64.saturating_mul(1 << failures.saturating_sub(1).min(11)).min(86_400);
    own.max(hint.unwrap_or(0).min(7 * 86_400))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::{CertificateInput, CertificateSpec, KeyedChain};

    const DAY: i64 = 86_400;

    fn managed(hosts: &[&str], issued_for: Option<&[&str]>) -> CertificateSpec {
        let acme = serde_json::json!({"hosts": hosts, "directory": "https://ca.example/dir", "challenge": "http-01"});
        let input: CertificateInput = serde_json::from_value(serde_json::json!({ "acme": acme })).unwrap();
        let spec = input.resolve(None).unwrap();
        match issued_for {
            None => spec,
            Some(names) => {
                let key = rcgen::KeyPair::generate().unwrap();
                let cert = rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                    .unwrap()
                    .self_signed(&key)
                    .unwrap();
                let mut state = spec.managed().unwrap().state.clone();
                state.issued = Some(KeyedChain::new(cert.pem(), key.serialize_pem()).unwrap());
                state.renew_at = 1_000 * DAY;
                state.renewal_info = Some(tidegate_model::RenewalInfo::NotOffered);
                with_state(&spec, state)
            }
        }
    }

    fn with_state(spec: &CertificateSpec, state: tidegate_model::AcmeState) -> CertificateSpec {
        let mut cs = tidegate_model::ConfigState::default();
        let name = tidegate_model::CertName::new("c").unwrap();
        let put = tidegate_model::Op::PutCertificate {
            name: name.clone(),
            spec: Box::new(CertificateInput::Whole(spec.clone())),
        };
        let set = tidegate_model::Op::AcmeState { name: name.clone(), state: Box::new(state) };
        (cs, _) = cs.apply(&tidegate_model::ChangeSet { if_revision: None, ops: vec![put, set] }, 1).unwrap();
        (**cs.certificates().get("c").unwrap()).clone()
    }

    #[test]
    fn an_order_is_due_for_each_reason() {
        let first = managed(&["a.example"], None);
        assert_eq!(due(first.managed().unwrap(), 0), Due::Now(Why::First));
        let valid = managed(&["a.example", "b.example"], Some(&["b.example", "a.example"]));
        assert_eq!(due(valid.managed().unwrap(), 10), Due::At(1_000 * DAY));
        assert_eq!(due(valid.managed().unwrap(), 1_000 * DAY), Due::Now(Why::RenewalDue));
        let moved = managed(&["a.example", "c.example"], Some(&["a.example"]));
        assert_eq!(due(moved.managed().unwrap(), 10), Due::Now(Why::HostsChanged));
        let mut state = valid.managed().unwrap().state.clone();
        state.failures = 2;
        state.retry_at = 500;
        let failing = with_state(&valid, state.clone());
        assert_eq!(due(failing.managed().unwrap(), 10), Due::At(500), "a failure's back-off holds");
        state.renew_requested = 1;
        let asked = with_state(&valid, state);
        // The op keeps the current renew_requested (only users raise it).
        assert_eq!(due(asked.managed().unwrap(), 10), Due::At(500));
        let mut cs = tidegate_model::ConfigState::default();
        let name = tidegate_model::CertName::new("c").unwrap();
        let ops = vec![
            tidegate_model::Op::PutCertificate { name: name.clone(), spec: Box::new(CertificateInput::Whole(failing)) },
            tidegate_model::Op::RenewCertificate { name },
        ];
        (cs, _) = cs.apply(&tidegate_model::ChangeSet { if_revision: None, ops }, 1).unwrap();
        let requested = cs.certificates().get("c").unwrap();
        assert_eq!(due(requested.managed().unwrap(), 10), Due::Now(Why::Requested), "a request skips the back-off");
    }

    #[test]
    fn the_cas_renewal_information_is_asked_and_can_bring_the_renewal_forward() {
        use tidegate_model::RenewalInfo;
        let valid = managed(&["a.example"], Some(&["a.example"]));
        let mut state = valid.managed().unwrap().state.clone();
        state.renewal_info = None;
        let never_asked = with_state(&valid, state.clone());
        assert_eq!(due(never_asked.managed().unwrap(), 10), Due::AskRenewalInfo, "a new certificate is asked about");
        // A window earlier than the certificate's own time: renewal then,
        // and the CA asked again meanwhile.
        state.renewal_info = Some(RenewalInfo::Window { start: 100, end: 200, renew_at: 150, next_check: 120 });
        let advised = with_state(&valid, state.clone());
        let m = advised.managed().unwrap();
        assert_eq!(due(m, 10), Due::At(120), "the next question comes first");
        assert_eq!(due(m, 120), Due::AskRenewalInfo);
        assert_eq!(due(m, 150), Due::Now(Why::CaSuggested));
        // A window later than its own time changes nothing.
        state.renewal_info =
            Some(RenewalInfo::Window { start: 2_000 * DAY, end: 2_001 * DAY, renew_at: 2_000 * DAY, next_check: DAY });
        let later = with_state(&valid, state.clone());
        assert_eq!(due(later.managed().unwrap(), 10), Due::At(DAY));
        assert_eq!(due(later.managed().unwrap(), 1_000 * DAY), Due::Now(Why::RenewalDue));
        // A failed question is asked again later; a CA without it never.
        state.renewal_info = Some(RenewalInfo::Unanswered { next_check: 500 });
        let unanswered = with_state(&valid, state.clone());
        assert_eq!(due(unanswered.managed().unwrap(), 10), Due::At(500));
        state.renewal_info = Some(RenewalInfo::NotOffered);
        let none = with_state(&valid, state);
        assert_eq!(due(none.managed().unwrap(), 999 * DAY), Due::At(1_000 * DAY));
    }

    #[test]
    fn a_point_in_the_window_is_picked_at_random_or_now_when_past() {
        assert_eq!(in_window(100, 200, 0.0, 0), 100);
        assert_eq!(in_window(100, 200, 0.5, 0), 150);
        assert_eq!(in_window(100, 200, 1.0, 0), 200);
        assert_eq!(in_window(100, 200, 0.2, 170), 170, "a point already past: now");
        assert_eq!(in_window(100, 200, 0.9, 500), 500, "a window already past: now");
        assert_eq!(in_window(200, 100, 0.5, 0), 200, "an inverted window is its start");
        assert_eq!(renewal_info_recheck(Some(0)), 60, "a CA saying now is not asked in a loop");
        assert_eq!(renewal_info_recheck(Some(10 * 86_400)), 86_400);
        assert_eq!(renewal_info_recheck(None), 6 * 3_600);
    }

    #[test]
    fn renewal_comes_after_its_fraction_less_jitter_and_before_expiry() {
        let (nb, na) = (0, 90 * DAY);
        assert_eq!(renew_at(nb, na, 2.0 / 3.0, 0.0, 0), 60 * DAY);
        let jittered = renew_at(nb, na, 2.0 / 3.0, 1.0, 0);
        assert!((58 * DAY..60 * DAY).contains(&jittered), "{jittered}");
        assert_eq!(renew_at(0, 10 * DAY, 0.95, 0.0, 0), 9 * DAY, "never later than a day before expiry");
        assert_eq!(renew_at(nb, na, 0.5, 0.0, 80 * DAY), 80 * DAY, "past its time: now");
        assert_eq!(renew_at(nb, na, 0.5, 0.0, 95 * DAY), na - DAY, "never after expiry's eve");
        assert_eq!(renew_at(nb, na, 0.5, 0.0, 50 * DAY), 50 * DAY, "never in the past");
        // Short-lived certificates keep a quarter of their lifetime.
        assert_eq!(renew_at(0, 6 * DAY, 0.95, 0.0, 0), 5 * DAY, "a 6-day certificate keeps its day");
        assert_eq!(renew_at(1_000, 1_020, 0.5, 0.0, 1_000), 1_010, "a 20 s one renews half way");
        assert_eq!(renew_at(1_000, 1_020, 0.95, 0.0, 1_000), 1_015, "and 5 s before it expires at the latest");
    }

    #[test]
    fn back_off_doubles_to_a_day_and_honours_the_ca() {
        assert_eq!(retry_after(1, None), 60);
        assert_eq!(retry_after(2, None), 120);
        assert_eq!(retry_after(5, None), 960);
        assert_eq!(retry_after(40, None), 86_400);
        assert_eq!(retry_after(1, Some(3_600)), 3_600);
        assert_eq!(retry_after(1, Some(u64::MAX)), 7 * 86_400);
    }
}
