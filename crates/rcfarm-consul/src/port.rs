//! The one place a request leaves the client: [`Port`].
//!
//! Every call of [`crate::Consul`] (reads with their index, blocking reads, transactions,
//! sessions and locks) becomes one HTTP exchange in `transport`, and the exchange goes either
//! over the network (`reqwest`, production) or to a [`Port`] given with [`crate::Consul::over`]: an
//! in-memory Consul that answers in the same process, so that a test can run the real farm,
//! RC and roll workers step by step under tokio's paused clock and decide each answer's fate
//! (late, lost after it applied, never sent, older than one already seen).
//!
//! The port sits below the client's own logic on purpose: retries, the reading of an unknown
//! outcome, index regressions and the answers' decoding are the client's code and are run as
//! they are in production.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use reqwest::header::HeaderMap;
use reqwest::{Method, StatusCode};

/// One request as the client sends it.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub method: Method,
    /// Path and query, as on the wire (`/v1/kv/rc/x?index=12&wait=5000ms`).
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Consul's answer to an [`Exchange`].
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Why no answer came.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PortFailure {
    /// The request never reached Consul (a refused connection): it cannot have been applied,
    /// so even a write may be sent again.
    #[error("connection refused: {0}")]
    NotSent(String),
    /// The request may have been applied, but no answer came (a reset connection, a timeout):
    /// a write's outcome is unknown.
    #[error("no answer: {0}")]
    Lost(String),
}

/// A future answer.
pub type PortFuture =
    Pin<Box<dyn Future<Output = std::result::Result<Answer, PortFailure>> + Send>>;

/// Where a client's requests go instead of the network.
pub trait Port: Send + Sync + 'static {
    fn call(&self, request: Exchange) -> PortFuture;
}
