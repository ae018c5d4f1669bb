//! glmflash-operator: reconciles `GlmFlashDeployment` objects (crate `glmflash-crds`) into
//! a pack-store Job and a glmflash-node server on one GPU node.
//!
//! - [`controller`]: `Context`, `reconcile` inside a finalizer, `error_policy` with backoff;
//! - [`builders`]: pure builders of every owned object (Jobs, Deployment, Services,
//!   ServiceMonitor, dashboard ConfigMap);
//! - [`placement`]: which node fits (labels, GPU product, taints, free GPU and memory);
//! - [`scrape`]: live figures for status from the server's `/metrics`;
//! - [`metrics`] and [`http`]: the operator's own `/metrics`, `/healthz`, `/readyz`;
//! - [`run`]: watches, leader election and the controller loop used by `main`;
//! - [`activator`]: the `activator` subcommand, a proxy in front of one deployment that
//!   wakes it on demand and keeps sessions on one replica.
//!
//! The server's metric names, which [`scrape`] reads and the chart's dashboards and alerts
//! query, are the contract crate [`glmflash_metric_names`], shared with glmflash-node.

pub mod activator;
pub mod builders;
pub mod controller;
mod error;
pub mod http;
pub mod metrics;
pub mod placement;
pub mod run;
pub mod scrape;

#[cfg(test)]
mod fixtures;

pub use error::{Error, Result};
