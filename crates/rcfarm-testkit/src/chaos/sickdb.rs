//! Audit database faults: the run's farms ship to a PostgreSQL of the run's own
//! ([`crate::postgres::PrivatePostgres`]) through a proxy, and the chaos stops that PostgreSQL
//! for a while, or slows every chunk to it, then lets it be. The run's end checks that every
//! audit record reached SQL once all the same.

use std::time::Duration;

use rand::Rng;
use rand::rngs::StdRng;

use super::proxy::{FaultyProxy, ProxyFaults};
use crate::postgres::PrivatePostgres;

const HEALTHY: ProxyFaults = ProxyFaults {
    max_delay: Duration::ZERO,
    drop_per_mille: 0,
};

pub struct SickDb {
    pg: PrivatePostgres,
    proxy: FaultyProxy,
}

impl SickDb {
    pub async fn start() -> Result<SickDb, String> {
        let pg = PrivatePostgres::start().map_err(|e| {
            format!("audit database faults need a PostgreSQL of the run's own: {e}")
        })?;
        let proxy = FaultyProxy::start(pg.addr(), HEALTHY)
            .await
            .map_err(|e| e.to_string())?;
        Ok(SickDb { pg, proxy })
    }

    /// Where the farms (and the run's checks) connect.
    pub fn url(&self) -> String {
        format!("postgres://postgres@{}/postgres", self.proxy.addr())
    }

    /// One fault: PostgreSQL stopped for 5–20 s, or every chunk to it delayed up to 0.3–1 s for
    /// 10–20 s; then healthy again.
    pub async fn fault(&self, rng: &mut StdRng) -> Result<&'static str, String> {
        if rng.random_bool(0.5) {
            let hold = rng.random_range(5000..20000);
            tracing::info!(hold_ms = hold, "audit database stopped");
            self.pg.stop()?;
            tokio::time::sleep(Duration::from_millis(hold)).await;
            self.pg.resume()?;
            Ok("audit-db-stopped")
        } else {
            let hold = rng.random_range(10000..20000);
            let delay = Duration::from_millis(rng.random_range(300..1000));
            tracing::info!(hold_ms = hold, ?delay, "audit database slow");
            self.proxy.set_faults(ProxyFaults {
                max_delay: delay,
                drop_per_mille: 0,
            });
            tokio::time::sleep(Duration::from_millis(hold)).await;
            self.proxy.set_faults(HEALTHY);
            Ok("audit-db-slow")
        }
    }
}
