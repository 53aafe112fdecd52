//! The seam between the autoscaler and whatever runs instances.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tidegate_model::ProviderSpec;

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

/// A provider failed; the message says how.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ProviderError(pub String);

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
