//! A session kept alive in the background, with prompt notice of its loss.
//!
//! Consul invalidates a session 2×TTL after its last renewal; this renewer gives up earlier, when
//! no renewal has succeeded for one TTL, so that whoever relies on the session stops acting on it
//! while Consul still honours it. A 404 on renew means Consul already dropped it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::client::Consul;
use super::error::{ConsulError, Result};
use super::types::{SessionBehavior, SessionRequest};
use crate::util::jitter_half;

/// What to create.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub name: String,
    pub ttl: Duration,
    pub lock_delay: Duration,
    pub behavior: SessionBehavior,
}

/// A live session and its renewer.
pub struct Session {
    id: String,
    name: String,
    ttl: Duration,
    consul: Consul,
    lost: CancellationToken,
    stop: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
    renewals: Arc<AtomicU64>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id)
            .field("name", &self.name)
            .finish()
    }
}

impl Session {
    /// Creates the session and starts renewing it every TTL/2.
    pub async fn create(consul: &Consul, config: &SessionConfig) -> Result<Session> {
        let sent_at = Instant::now();
        let id = consul
            .session_create(&SessionRequest {
                name: Some(config.name.clone()),
                ttl: Some(config.ttl),
                lock_delay: Some(config.lock_delay),
                behavior: Some(config.behavior),
                ..Default::default()
            })
            .await?;
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let reason = Arc::new(Mutex::new(None));
        let renewals = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(renew_loop(RenewLoop {
            consul: consul.clone(),
            id: id.clone(),
            ttl: config.ttl,
            last_ok: sent_at,
            lost: lost.clone(),
            stop: stop.clone(),
            reason: reason.clone(),
            renewals: renewals.clone(),
        }));
        tracing::info!(session = %id, name = %config.name, ttl = ?config.ttl, "created Consul session");
        Ok(Session {
            id,
            name: config.name.clone(),
            ttl: config.ttl,
            consul: consul.clone(),
            lost,
            stop,
            reason,
            renewals,
            task: Some(task),
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Cancelled the moment the session is considered lost. Derive child tokens from it for
    /// every task that must not act without the session.
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Why the session was lost, once it was.
    pub fn loss_reason(&self) -> Option<String> {
        self.reason.lock().clone()
    }

    /// Successful renewals so far.
    pub fn renewals(&self) -> u64 {
        self.renewals.load(Ordering::Relaxed)
    }

    /// Stops renewing and destroys the session, which releases (or deletes) every key it holds.
    pub async fn destroy(mut self) -> Result<()> {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        self.consul.session_destroy(&self.id).await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Without `destroy`, the session simply expires after 2×TTL.
        self.stop.cancel();
    }
}

struct RenewLoop {
    consul: Consul,
    id: String,
    ttl: Duration,
    last_ok: Instant,
    lost: CancellationToken,
    stop: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
    renewals: Arc<AtomicU64>,
}

async fn renew_loop(mut s: RenewLoop) {
    let mut next = s.last_ok + s.ttl / 2;
    loop {
        tokio::select! {
            _ = s.stop.cancelled() => return,
            _ = tokio::time::sleep_until(next) => {}
        }
        let deadline = s.last_ok + s.ttl;
        let now = Instant::now();
        if now >= deadline {
            return declare_lost(&s, "no successful renewal within the session TTL".into());
        }
        let sent_at = now;
        let attempt = tokio::select! {
            _ = s.stop.cancelled() => return,
            r = tokio::time::timeout(deadline - now, s.consul.session_renew(&s.id)) => r,
        };
        match attempt {
            Ok(Ok(entry)) => {
                s.last_ok = sent_at;
                s.renewals.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("rcfarm_session_renewals_total").increment(1);
                // Consul may raise the TTL under load; renewing on our own schedule stays safe
                // as long as we never use a longer one than we asked for.
                if let Some(ttl) = entry.ttl_duration()
                    && ttl < s.ttl
                {
                    s.ttl = ttl;
                }
                next = s.last_ok + s.ttl / 2;
            }
            Ok(Err(ConsulError::NotFound(_))) => {
                return declare_lost(
                    &s,
                    "Consul no longer knows the session (404 on renew)".into(),
                );
            }
            Ok(Err(e)) => {
                metrics::counter!("rcfarm_session_renew_failures_total").increment(1);
                let left = deadline.saturating_duration_since(Instant::now());
                tracing::warn!(session = %s.id, error = %e, time_left = ?left, "session renewal failed; retrying");
                // Retry quickly but leave room for a few attempts before the deadline.
                let retry = jitter_half(
                    (left / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)),
                );
                next = Instant::now() + retry;
            }
            Err(_elapsed) => {
                return declare_lost(
                    &s,
                    "renewal did not answer before the session TTL ran out".into(),
                );
            }
        }
    }
}

fn declare_lost(s: &RenewLoop, reason: String) {
    tracing::error!(session = %s.id, %reason, "Consul session lost");
    metrics::counter!("rcfarm_session_losses_total").increment(1);
    *s.reason.lock() = Some(reason);
    s.lost.cancel();
}
