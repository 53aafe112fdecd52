//! Tidegate's autoscaler (paper S1).
//!
//! - [`decide`]: the scaling decision, a pure function of samples, counts
//!   and time (unit-tested with hand-built inputs);
//! - [`Provider`]: starts and stops instances (`process`, `command`,
//!   `webhook`);
//! - [`Autoscaler`]: the loop that samples the proxy's live statistics every
//!   second, calls `decide`, and carries the decision out through the
//!   provider and the configuration writer: new instances become backends
//!   only after their readiness probe passes; removed ones are drained first.
//!   Every decision and action is an [`Event`].

mod controller;
pub mod decide;
mod events;
mod provider;
pub mod providers;

pub use controller::{spawn, Phase, ScalingStatus, StatusBoard};
pub use events::{Coalescer, Event, EventKind, Events, Noted};
pub use provider::{
    provider_for, AnswerError, BoxFuture, Instance, Provider, ProviderError, ProviderErrorKind, SignalError,
    StartRequest,
};
