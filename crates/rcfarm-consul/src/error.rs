use super::txn::{TxnFailure, TxnOpError};

/// Everything a call to Consul can end in, other than success.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConsulError {
    /// The thing asked for does not exist (a session on renew, for instance).
    #[error("{0} not found in Consul")]
    NotFound(String),

    /// A transaction rolled back; every failed op is listed with Consul's reason.
    #[error("transaction rolled back: {}", join(.0))]
    Conflict(Vec<TxnOpError>),

    /// Consul's ACLs refused the call.
    #[error(
        "Consul denied the request: {0} (set a token with the rights it needs: CONSUL_HTTP_TOKEN or --consul-token)"
    )]
    PermissionDenied(String),

    /// Consul could not be reached or has no leader; the call may or may not have been applied
    /// if it was a write.
    #[error("Consul at {addr} is unavailable: {reason}")]
    Unavailable { addr: String, reason: String },

    /// Consul answered something this client cannot read.
    #[error("unexpected answer from Consul: {0}")]
    BadResponse(String),

    /// Refused before sending: Consul would reject it.
    #[error("transaction has {count} operations, more than Consul's limit of {limit}; split it")]
    TooManyOps { count: usize, limit: usize },

    /// A lock was requested with a session Consul does not know (expired or destroyed).
    #[error("session {0} is not valid in Consul (expired or destroyed)")]
    InvalidSession(String),

    /// Consul rejected the request as malformed or too large (400, 413, and 500s that are not
    /// about availability).
    #[error("Consul rejected the request (HTTP {status}): {body}")]
    Rejected { status: u16, body: String },

    /// The client cannot be built as configured (a CA file that cannot be read, say).
    #[error("{0}")]
    Config(String),
}

fn join(errs: &[TxnOpError]) -> String {
    errs.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl ConsulError {
    /// Whether retrying the same call later can help (only meaningful for idempotent calls).
    pub fn is_retryable(&self) -> bool {
        matches!(self, ConsulError::Unavailable { .. })
    }

    /// For a connection that failed in its TLS handshake because Consul's certificate could not
    /// be verified (an unknown CA, a name or address the certificate does not cover, an expired
    /// one) or because the port does not speak TLS: what rustls said. Retrying never helps.
    pub fn tls_problem(&self) -> Option<&str> {
        let ConsulError::Unavailable { reason, .. } = self else {
            return None;
        };
        // rustls' own wording, at the end of the reqwest error chain.
        [
            "invalid peer certificate",
            "received corrupt message",
            "received fatal alert",
            "peer sent no certificates",
        ]
        .iter()
        .find_map(|m| reason.find(m))
        .map(|i| &reason[i..])
    }

    /// For a rolled-back transaction, the failures of its ops.
    pub fn txn_failures(&self) -> impl Iterator<Item = (usize, TxnFailure)> + '_ {
        let errs: &[TxnOpError] = match self {
            ConsulError::Conflict(e) => e,
            _ => &[],
        };
        errs.iter().map(|e| (e.op_index, e.failure()))
    }

    /// True if a rolled-back transaction failed (at least) at op `op_index` for `failure`.
    pub fn failed_at(&self, op_index: usize, failure: TxnFailure) -> bool {
        self.txn_failures()
            .any(|(i, f)| i == op_index && f == failure)
    }

    /// A short label for metrics (`txn failures by reason`).
    pub fn reason_label(&self) -> &'static str {
        match self {
            ConsulError::NotFound(_) => "not_found",
            ConsulError::Conflict(errs) => match errs.first().map(TxnOpError::failure) {
                Some(TxnFailure::SessionMismatch) => "fenced",
                Some(TxnFailure::IndexStale) => "index_stale",
                Some(TxnFailure::KeyExists) => "key_exists",
                Some(TxnFailure::KeyMissing) => "key_missing",
                Some(TxnFailure::LockHeld | TxnFailure::LockDelay) => "lock_held",
                _ => "conflict",
            },
            ConsulError::PermissionDenied(_) => "permission_denied",
            ConsulError::Unavailable { .. } => "unavailable",
            ConsulError::BadResponse(_) => "bad_response",
            ConsulError::TooManyOps { .. } => "too_many_ops",
            ConsulError::InvalidSession(_) => "invalid_session",
            ConsulError::Rejected { .. } => "rejected",
            ConsulError::Config(_) => "config",
        }
    }
}

pub type Result<T, E = ConsulError> = std::result::Result<T, E>;
