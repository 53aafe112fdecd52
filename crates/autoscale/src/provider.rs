//! The seam between the autoscaler and whatever runs instances.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tidegate_model::ProviderSpec;
use tidegate_upstream::{ErrorChain, HttpError};

pub use crate::providers::{AnswerError, SignalError};

/// A boxed future, so `Provider` can be used as a trait object.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One running instance of a service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Instance {
    /// The autoscaler's id for it; also its backend id.
    pub id: String,
    /// Where it serves, `host:port`.
    pub addr: String,
    /// The provider's own reference (a pid, a VM id), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
}

/// What to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartRequest {
    /// The service the instance belongs to.
    pub service: String,
    /// The id the autoscaler gives it.
    pub id: String,
}

/// A provider failed: which provider for which service, doing what, and
/// why (shown as `context: kind`, as the events and the log say it).
#[derive(Debug, thiserror::Error)]
#[error("{context}: {kind}")]
pub struct ProviderError {
    /// The provider, the service and the action, as the log says them:
    /// `start script for web`, `process provider for web`, `webhook for
    /// web`, `stopping web/web-00002a`.
    pub context: String,
    /// Why.
    pub kind: ProviderErrorKind,
}

impl ProviderError {
    /// A failure of `kind` in `context`.
    pub fn new(context: impl Into<String>, kind: ProviderErrorKind) -> ProviderError {
        ProviderError { context: context.into(), kind }
    }

    /// Whether the provider may have started an instance although the
    /// start failed: the script or the webhook did not answer in time, or
    /// the connection failed after the request was sent. The autoscaler
    /// then asks the provider to stop that id, so nothing runs unknown to
    /// it; after a refusal (an exit status, a 4xx, a bad answer) nothing
    /// was started and nothing is stopped.
    pub fn may_have_started(&self) -> bool {
        match &self.kind {
            ProviderErrorKind::TimedOut { .. } | ProviderErrorKind::NotStartedInTime { .. } => true,
            // Sent (or possibly sent) and not answered in full; a
            // connection that never opened sent nothing.
            ProviderErrorKind::Http { source, .. } => match &**source {
                HttpError::Exchange(e) => !e.is_connect(),
                HttpError::Timeout(_) | HttpError::Body(_) | HttpError::TooLarge { .. } => true,
                _ => false,
            },
            _ => false,
        }
    }
}

/// Why a provider failed.
#[derive(Debug, thiserror::Error)]
pub enum ProviderErrorKind {
    /// The provider has nothing to run (`no program configured`).
    #[error("no {0} configured")]
    NotConfigured(&'static str),
    /// The program could not be started.
    #[error("{doing} {program:?}: {source}")]
    Spawn {
        /// `running` (a script) or `starting` (an instance).
        doing: &'static str,
        /// The program.
        program: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// A script ran past its time limit; its process group was killed.
    #[error("{program:?} timed out after {} s (killed): {stderr}", .after.as_secs_f64())]
    TimedOut {
        /// The program.
        program: String,
        /// The limit.
        after: std::time::Duration,
        /// The first line of its stderr.
        stderr: String,
    },
    /// A script could not be waited for.
    #[error("{program:?} could not be waited for: {source}")]
    Wait {
        /// The program.
        program: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// A script exited with a failure status.
    #[error("{program:?} failed ({status}): {stderr}")]
    Exited {
        /// The program.
        program: String,
        /// How it exited.
        status: std::process::ExitStatus,
        /// The first line of its stderr.
        stderr: String,
    },
    /// An answer (a script's output, a webhook's body) that does not say
    /// what it must; the error names the field.
    #[error("{what} ({error})")]
    BadAnswer {
        /// Which answer: `bad output`, `bad start answer`, `bad list answer`.
        what: &'static str,
        /// What is wrong with it.
        error: AnswerError,
    },
    /// A webhook answered a status that is not a success (or a 202
    /// without a URL to poll).
    #[error("{what} answered {status}: {body}")]
    Status {
        /// The request: `start`, `list`, `stop of ID`, `polling URL`.
        what: String,
        /// The status.
        status: http::StatusCode,
        /// The first line of its body.
        body: String,
    },
    /// A 202 to a start whose body does not give the URL to poll.
    #[error("202 without {{\"poll\": URL}}: {0}")]
    NoPollUrl(serde_json::Error),
    /// A webhook request that could not be made or answered.
    #[error("{method} {uri}: {}", ErrorChain(&**.source))]
    Http {
        /// The method.
        method: http::Method,
        /// The URL.
        uri: String,
        /// Why it failed.
        source: Box<HttpError>,
    },
    /// A webhook URL (configured, or given to poll) that is not one.
    #[error(transparent)]
    Url(HttpError),
    /// A webhook start accepted (202) whose instance did not come up in
    /// time.
    #[error("instance {id} not started within {} s ({last})", .after.as_secs_f64())]
    NotStartedInTime {
        /// The instance.
        id: String,
        /// The time allowed.
        after: std::time::Duration,
        /// What the last poll said.
        last: String,
    },
    /// A file or directory of the provider could not be created or opened.
    #[error("{doing} {}: {source}", .path.display())]
    Io {
        /// `creating`, `opening`.
        doing: &'static str,
        /// The file or directory.
        path: std::path::PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// An instance of that id runs already.
    #[error("instance {0} already runs")]
    AlreadyRuns(String),
    /// Every port of the range is taken.
    #[error("no free port in {from}-{to}")]
    NoFreePort {
        /// First port of the range.
        from: u16,
        /// Last port of the range.
        to: u16,
    },
    /// The started process has no pid (it exited at once).
    #[error("the child has no pid")]
    NoPid,
    /// An instance's process group could not be stopped.
    #[error(transparent)]
    Signal(#[from] SignalError),
}

/// Starts, stops and lists instances. Implementations: `process` (local
/// processes, the embedded default), `command` (user scripts), `webhook`
/// (an infrastructure service over HTTP). Docker and Kubernetes fit the
/// same shape.
pub trait Provider: Send + Sync {
    /// Starts one instance and says where it will listen. It need not be
    /// ready yet: the autoscaler probes it before sending traffic.
    fn start(&self, req: StartRequest) -> BoxFuture<'_, Result<Instance, ProviderError>>;

    /// Stops an instance: gracefully, then forcibly after the provider's
    /// grace period.
    fn stop<'a>(&'a self, instance: &'a Instance) -> BoxFuture<'a, Result<(), ProviderError>>;

    /// Instances the provider knows to be running for this service
    /// (used to adopt or clean up instances after a restart).
    fn list(&self) -> BoxFuture<'_, Result<Vec<Instance>, ProviderError>>;

    /// Whether the instance still runs: `Some(false)` once the provider
    /// knows it exited, `None` when it cannot tell.
    fn alive<'a>(&'a self, instance: &'a Instance) -> BoxFuture<'a, Option<bool>>;
}

/// The provider for a service's `autoscale.provider`; `state_dir` is where
/// providers keep what they need to adopt instances after a restart.
pub fn provider_for(spec: &ProviderSpec, service: &str, state_dir: &Path) -> Arc<dyn Provider> {
    crate::providers::build(spec, service, state_dir)
}
