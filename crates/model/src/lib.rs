//! Tidegate's configuration model.
//!
//! Everything a user can say about the proxy is a value of a type in this crate:
//! [`ServiceSpec`] (a pool of backends and how to balance them), [`RouteSpec`]
//! (which requests go to which service or static directory) and [`ChangeSet`]
//! (an atomic batch of operations on them). Values are validated once, at the
//! edge, while they are parsed: a value of these types is always valid, and a
//! parse error names the field at fault.
//!
//! [`ConfigState`] is the whole configuration as persistent (structurally shared)
//! maps: applying a change set to it costs O(change), and a failed change set
//! leaves it untouched.

pub mod acme;
mod certificate;
mod change;
mod client_auth;
mod desired;
pub mod dns;
mod headers;
mod invalid;
mod listener;
mod names;
pub mod normalize;
#[cfg(test)]
mod roundtrip;
mod route;
pub mod rules;
mod schema;
mod service;
mod state;
pub mod static_root;

pub use acme::{
    AcmeAccount, AcmeSpec, AcmeState, AcmeStatus, ChallengeAnswer, ChallengeKind, DnsHook, OnDemand, RenewalInfo,
};
pub use certificate::{unix_now, CertificateInfo, CertificateInput, CertificateSpec, KeptKey, KeyedChain, Managed};
pub use change::{check_change_set, fold_field, parse_change_set, parse_json, ChangeSet, Op, ParseError};
pub use client_auth::{
    ClientAuth, ClientAuthMode, ClientCertPolicy, ClientCertificate, CLIENT_CERT_FINGERPRINT_HEADER,
    CLIENT_CERT_HEADER_PREFIX, CLIENT_CERT_SUBJECT_HEADER,
};
pub use desired::{document_paths, in_document, plan, Action, Change, Document, Kind};
pub use headers::Headers;
pub use invalid::{Invalid, Reason};
pub use listener::{ListenerSpec, DEFAULT_LISTENERS};
pub use names::{BackendAddr, BackendId, CertName, ListenerName, NameError, RouteName, RuleSetName, ServiceName};
pub use route::{HeaderMatch, HeaderRegex, HostPattern, PathPattern, RouteAction, RouteMatch, RouteSpec, StaticDir};
pub use rules::{RuleSetSpec, Step};
pub use schema::config_file_schema;
pub use service::{
    ActiveCheck, AutoscaleSpec, BackendSpec, BalanceFactor, CheckKind, ConcurrencySpec, ExternalSpec, FeedbackFormula,
    FeedbackSpec, Gammas, GangliaSource, HeaderKey, HealthSpec, LoadSources, MaxConns, NodeExporterSource, OrcaSpec,
    PassiveCheck, Percent, PolicySpec, PortRange, PrequalSpec, ProviderSpec, ProxyProtocolVersion, QueueSpec,
    ReadySpec, RetryBudget, Secret, ServiceSettings, ServiceSpec, Timeouts, UpstreamProtocol, UpstreamSpec,
    UpstreamTls, Weight, REDACTED,
};
pub use state::{ChangeError, ChangeErrorKind, ConfigState, Delta};
pub use static_root::{check_static_root, StaticRootError};
