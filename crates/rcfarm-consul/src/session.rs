//! A session kept alive in the background, with prompt notice of its loss.
//!
//! Consul invalidates a session 2×TTL after its last renewal, and a new raft leader restarts
//! every session's timer at 2×TTL when it takes over (`initializeSessionTimers`). So renewals
//! that fail for a while (an election: "No cluster leader") do not mean the session is gone,
//! and giving it up then would hand every lock it holds to another farm for nothing. After one
//! TTL without a successful renewal the session is *in doubt*: its holder stops taking on new
//! work and reports itself not ready, and renewing goes on. It is lost only when Consul says so
//! (404 on renew), which it does at the first renewal that reaches a leader after the session
//! expired. Acting in doubt is safe because every write made under the session is fenced by it
//! (`check-session` in the same transaction): a write under an expired session fails.
//!
//! A 404 is believed only from a Consul whose state has reached the session's creation. A
//! restarted Consul 0.7 server answers as leader before it has applied its own log again, and
//! for that moment it knows none of the sessions created since its last snapshot (seen on the
//! 0.7.0 binary under load: a farm gave up a session the restarted server then kept). So on a
//! 404 the renewer reads the session (`/v1/session/info`): absent at an index at or past the
//! session's `CreateIndex`, it is gone; absent at a lower index, Consul is still catching up,
//! and renewing goes on, in doubt, for at most one more TTL (a Consul that came back empty or
//! from an older backup never catches up; the new leader's timers give the session 2×TTL).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::client::Consul;
use super::error::{ConsulError, Result};
use super::types::{
    QueryMeta, QueryOptions, SessionBehavior, SessionEntry, SessionId, SessionRequest,
};
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
    id: SessionId,
    name: String,
    ttl: Duration,
    consul: Consul,
    lost: CancellationToken,
    stop: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
    renewals: Arc<AtomicU64>,
    doubt: tokio::sync::watch::Receiver<bool>,
    /// Fires when the renewer has stopped.
    done: Option<tokio::sync::oneshot::Receiver<()>>,
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
        let id: SessionId = consul
            .session_create(&SessionRequest {
                name: Some(config.name.clone()),
                ttl: Some(config.ttl),
                lock_delay: Some(config.lock_delay),
                behavior: Some(config.behavior),
                ..Default::default()
            })
            .await?
            .into();
        // Its `CreateIndex`, against which a later 404 is judged (see the module's doc). A
        // session that has not learnt it (this read failed, and no renewal has answered yet)
        // believes the first 404, as before.
        let create_index = match read_info(consul, &id, config.ttl).await {
            Ok((Some(entry), _)) => entry.create_index,
            _ => 0,
        };
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let reason = Arc::new(Mutex::new(None));
        let renewals = Arc::new(AtomicU64::new(0));
        let (doubt_tx, doubt) = tokio::sync::watch::channel(false);
        let done = start_renewer(RenewLoop {
            consul: consul.clone(),
            id: id.to_string(),
            ttl: config.ttl,
            last_ok: sent_at,
            lost: lost.clone(),
            stop: stop.clone(),
            reason: reason.clone(),
            renewals: renewals.clone(),
            doubt: doubt_tx,
            doubt_since: None,
            create_index,
            unknown_since: None,
        });
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
            doubt,
            done: Some(done),
        })
    }

    pub fn id(&self) -> &SessionId {
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

    /// True while no renewal has succeeded for a TTL and Consul has not said the session is
    /// gone: it may still hold (an election resets session timers), or may have expired.
    pub fn doubt(&self) -> tokio::sync::watch::Receiver<bool> {
        self.doubt.clone()
    }

    /// Successful renewals so far.
    pub fn renewals(&self) -> u64 {
        self.renewals.load(Ordering::Relaxed)
    }

    /// Stops renewing and destroys the session, which releases (or deletes) every key it holds.
    pub async fn destroy(mut self) -> Result<()> {
        self.stop.cancel();
        if let Some(done) = self.done.take() {
            let _ = done.await;
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
    doubt: tokio::sync::watch::Sender<bool>,
    doubt_since: Option<Instant>,
    /// The session's `CreateIndex`, read after its creation or reported by a renewal (0: not
    /// known).
    create_index: u64,
    /// Since when Consul has answered 404 without its state having reached the session's
    /// creation (see the module's doc).
    unknown_since: Option<Instant>,
}

/// What a read of the session says after a 404 on renew.
enum Unknown {
    /// Absent from a state at or past its creation (or its creation is not known): gone.
    Gone,
    /// Absent from a state before its creation (`index`): Consul is catching up.
    Behind { index: u64 },
    /// Listed after all (a renewal raced a leader change): renew again.
    Present,
    /// The read failed.
    Unread(String),
}

impl RenewLoop {
    fn enter_doubt(&mut self, why: &str) {
        if self.doubt_since.is_none() {
            self.doubt_since = Some(Instant::now());
            self.doubt.send_replace(true);
            metrics::counter!("rcfarm_session_doubts_total").increment(1);
            tracing::warn!(session = %self.id, ttl = ?self.ttl, %why, "no successful session renewal within the TTL: the session is in doubt; renewing on until Consul answers (a new leader restarts session timers)");
        }
    }

    /// After a 404 on renew: does Consul's state reach the session's creation?
    async fn read_after_404(&self) -> Unknown {
        if self.create_index == 0 {
            return Unknown::Gone;
        }
        match read_info(&self.consul, &self.id, self.ttl).await {
            Ok((Some(_), _)) => Unknown::Present,
            Ok((None, meta)) if meta.index < self.create_index => {
                Unknown::Behind { index: meta.index }
            }
            Ok((None, _)) => Unknown::Gone,
            Err(e) => Unknown::Unread(e),
        }
    }

    fn leave_doubt(&mut self) {
        if let Some(since) = self.doubt_since.take() {
            self.doubt.send_replace(false);
            tracing::info!(session = %self.id, in_doubt = ?since.elapsed(), "session renewed: it held");
        }
    }
}

/// Starts the renewer on a thread of its own, with a runtime and a Consul client (so its own
/// connection) of its own; the returned receiver fires when it has stopped.
///
/// Not a task on the caller's runtime: a farm's workers can be busy for seconds at a time
/// (decoding a watch answer of a million pod labels, building the views from it), and a renewal
/// that waits for a worker is a session lost for nothing, with every RC it held stopped and
/// claimed again (a million pods on the embedded server: every farm lost its session, each
/// renewal "no answer within 2.5 s"). On its own thread the renewal waits only for the
/// kernel's scheduler, which wakes a thread that mostly sleeps promptly.
///
/// Over a [`crate::Port`] (an in-memory Consul, in the caller's runtime and on its clock) the
/// renewer is a task of the caller's runtime instead, on the same client: a thread of its own
/// would renew on the wall clock, past the port.
fn start_renewer(mut r: RenewLoop) -> tokio::sync::oneshot::Receiver<()> {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    if r.consul.inner.port.is_some() {
        tokio::spawn(
            async move {
                renew_loop(r).await;
                let _ = done_tx.send(());
            }
            .instrument(tracing::Span::current()),
        );
        return done_rx;
    }
    let (id, lost, reason) = (r.id.clone(), r.lost.clone(), r.reason.clone());
    let span = tracing::Span::current();
    let spawned = std::thread::Builder::new()
        .name("session-renewer".into())
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(
                    async move {
                        // Connections are driven by the runtime that opened them: a client
                        // shared with the farm's runtime would leave renewals to its workers.
                        match Consul::new(r.consul.inner.cfg.clone()) {
                            Ok(own) => r.consul = own,
                            Err(e) => {
                                tracing::warn!(error = %e, "the session renewer could not build a Consul client of its own; renewing over the farm's")
                            }
                        }
                        renew_loop(r).await
                    }
                    .instrument(span),
                ),
                Err(e) => declare_lost(&r, format!("cannot start the session renewer: {e}")),
            }
            let _ = done_tx.send(());
        });
    if let Err(e) = spawned {
        // The thread (and the loop in it) was never started: the session cannot be kept.
        mark_lost(
            &id,
            &lost,
            &reason,
            format!("cannot start the session renewer's thread: {e}"),
        );
    }
    done_rx
}

async fn renew_loop(mut s: RenewLoop) {
    let mut next = s.last_ok + s.ttl / 2;
    loop {
        tokio::select! {
            _ = s.stop.cancelled() => return,
            _ = tokio::time::sleep_until(next) => {}
        }
        let now = Instant::now();
        let deadline = s.last_ok + s.ttl;
        if now >= deadline {
            s.enter_doubt("renewals failing");
        }
        // An attempt may take what is left of the TTL, and at least a few seconds once in
        // doubt (an answer, even late, is what ends the doubt).
        let limit = deadline
            .saturating_duration_since(now)
            .max(Duration::from_secs(2).min(s.ttl / 2));
        let sent_at = now;
        let attempt = tokio::select! {
            _ = s.stop.cancelled() => return,
            r = tokio::time::timeout(limit, s.consul.session_renew(&s.id)) => r,
        };
        let failure = match attempt {
            Ok(Ok(entry)) => {
                s.last_ok = sent_at;
                s.unknown_since = None;
                s.create_index = s.create_index.max(entry.create_index);
                s.renewals.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("rcfarm_session_renewals_total").increment(1);
                // Consul may raise the TTL under load; renewing on our own schedule stays safe
                // as long as we never use a longer one than we asked for.
                if let Some(ttl) = entry.ttl_duration()
                    && ttl < s.ttl
                {
                    s.ttl = ttl;
                }
                s.leave_doubt();
                next = s.last_ok + s.ttl / 2;
                continue;
            }
            Ok(Err(ConsulError::NotFound(_))) => {
                let gone = "Consul no longer knows the session (404 on renew)";
                let since = *s.unknown_since.get_or_insert(sent_at);
                let why = match s.read_after_404().await {
                    Unknown::Gone => return declare_lost(&s, gone.into()),
                    Unknown::Present => {
                        "404 on renew, yet Consul lists the session: renewing again".to_string()
                    }
                    Unknown::Behind { index } => format!(
                        "404 on renew from a Consul whose sessions are at index {index}, before this session's creation at {}: a server still applying its log (a restart)",
                        s.create_index
                    ),
                    Unknown::Unread(e) => format!("404 on renew, and the session unread: {e}"),
                };
                if since.elapsed() >= s.ttl {
                    return declare_lost(
                        &s,
                        format!("{gone}, for a whole TTL since the first: {why}"),
                    );
                }
                // Possibly gone: take on nothing new while it is settled.
                s.enter_doubt(&why);
                why
            }
            Ok(Err(e)) => e.to_string(),
            Err(_elapsed) => format!("no answer within {limit:?}"),
        };
        metrics::counter!("rcfarm_session_renew_failures_total").increment(1);
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            s.enter_doubt(&failure);
        }
        tracing::warn!(session = %s.id, error = %failure, time_left = ?left, in_doubt = s.doubt_since.is_some(), "session renewal failed; retrying");
        // Retry quickly but leave room for a few attempts before the deadline; in doubt, about
        // once a second.
        let retry = if left.is_zero() {
            Duration::from_secs(1)
        } else {
            (left / 4).clamp(Duration::from_millis(50), Duration::from_secs(1))
        };
        next = Instant::now() + jitter_half(retry);
        if !left.is_zero() {
            // Say "in doubt" when the TTL runs out, not at the next attempt after it.
            next = next.min(deadline);
        }
    }
}

/// `/v1/session/info` for `id`, given at most 2 s (and no more than the TTL): a renewer must
/// not wait on a read longer than on a renewal.
async fn read_info(
    consul: &Consul,
    id: &str,
    ttl: Duration,
) -> std::result::Result<(Option<SessionEntry>, QueryMeta), String> {
    tokio::time::timeout(
        Duration::from_secs(2).min(ttl),
        consul.session_info(id, &QueryOptions::default()),
    )
    .await
    .map_err(|_| "no answer to the session read".to_string())?
    .map_err(|e| e.to_string())
}

fn declare_lost(s: &RenewLoop, reason: String) {
    mark_lost(&s.id, &s.lost, &s.reason, reason);
}

fn mark_lost(id: &str, lost: &CancellationToken, why: &Mutex<Option<String>>, reason: String) {
    tracing::error!(session = %id, %reason, "Consul session lost");
    metrics::counter!("rcfarm_session_losses_total").increment(1);
    *why.lock() = Some(reason);
    lost.cancel();
}
