//! The farm's audit plumbing: the SQL connection, made in the background, and the shipper,
//! run under the farm's session (one farm ships at a time).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Farm;
use crate::audit::pace::BACKLOG_READ_EVERY;
use crate::audit::{AuditStore, BACKLOG_KEY, Backlog, Shipper};
use crate::consul::{ConsulError, QueryOptions, Session};
use crate::util::Backoff;

impl Farm {
    /// Connects to the audit database in the background, retrying: a farm serves RCs whether
    /// or not SQL is reachable (records wait in the Consul outbox).
    pub(super) fn connect_audit(&self, shutdown: &CancellationToken) {
        let Some(url) = self.config.audit_db.clone() else {
            return;
        };
        let tx = self.audit.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
            loop {
                match AuditStore::connect(url.expose()).await {
                    Ok(store) => {
                        tracing::info!(db = %store.url(), "audit database ready");
                        // `send_replace`, not `send`: with no receiver at this moment (no HTTP
                        // server, and the shipper not yet subscribed because the session is
                        // still being opened) `send` would drop the store, and this farm would
                        // never ship.
                        tx.send_replace(Some(Arc::new(store)));
                        return;
                    }
                    Err(e) => {
                        let wait = backoff.next_delay();
                        tracing::warn!(error = %e, retry_in = ?wait, "audit database unavailable; records wait in Consul");
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = tokio::time::sleep(wait) => {}
                        }
                    }
                }
            }
        });
    }

    /// Reads the outbox's size the shipper publishes, every few seconds, into the farm's pace
    /// (the shipper itself tells its own farm as it counts).
    pub(super) fn read_backlog(&self, shutdown: &CancellationToken) {
        if self.config.audit_pace.slow_at == 0 {
            return;
        }
        let consul = self.consul.clone();
        let pace = self.pace.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut denied_said = false;
            loop {
                let read = consul
                    .kv_get(
                        BACKLOG_KEY,
                        &QueryOptions {
                            stale: true,
                            ..QueryOptions::default()
                        },
                    )
                    .await;
                match read {
                    Ok((Some(e), _)) => match serde_json::from_slice::<Backlog>(e.value_bytes()) {
                        Ok(b) => pace.set_backlog(b.records, b.draining),
                        Err(err) => tracing::debug!(error = %err, "unreadable {BACKLOG_KEY}"),
                    },
                    Ok((None, _)) => pace.set_backlog(0, false),
                    Err(ConsulError::PermissionDenied(_)) if !denied_said => {
                        denied_said = true;
                        tracing::warn!(
                            "the ACL token may not read {BACKLOG_KEY}: this farm will not slow down when the audit outbox grows (give it read on rcfarm/audit-shipper)"
                        );
                    }
                    // Unreachable Consul: the last count stands.
                    Err(_) => {}
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(BACKLOG_READ_EVERY) => {}
                }
            }
        });
    }

    /// Runs the shipper under `session` until `stop`.
    pub(super) fn spawn_shipper(
        &self,
        session: &Session,
        stop: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if !self.config.ships_audit() {
            return None;
        }
        let mut store_rx = self.audit.subscribe();
        let consul = self.consul.clone();
        let session_id = session.id().to_string();
        let farm_id = self.config.farm_id.clone();
        let config = self.config.shipper.clone();
        let stats = self.shipper_stats.clone();
        let clock = self.config.clock;
        let pace = self.pace.clone();
        Some(tokio::spawn(async move {
            let store = tokio::select! {
                _ = stop.cancelled() => return,
                s = store_rx.wait_for(Option::is_some) => match s {
                    Ok(s) => s.clone(),
                    Err(_) => return,
                },
            };
            let Some(store) = store else { return };
            Shipper {
                consul,
                store,
                session: session_id.into(),
                farm_id,
                config,
                stats,
                clock,
                pace,
            }
            .run(stop)
            .await;
        }))
    }
}
