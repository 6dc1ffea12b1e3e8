//! `rcfarm consul-dev`: the embedded Consul-compatible server on its own.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::{CliError, parse_duration_flag, shutdown_signal};
use crate::server::{Compat, EmbeddedServer, ServerConfig};

/// Its `Debug` never shows the ACL token.
#[derive(clap::Args)]
pub struct ConsulDevArgs {
    /// Address to serve the Consul HTTP API on. Loopback unless you say otherwise.
    #[arg(
        long,
        env = "RCFARM_CONSUL_DEV_LISTEN",
        default_value = "127.0.0.1:8500"
    )]
    pub listen: SocketAddr,
    /// Keep state in this directory (a write-ahead log with fsync, and snapshots). Without it,
    /// state lives in memory only, like `consul agent -dev`.
    #[arg(long, env = "RCFARM_CONSUL_DEV_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Shortest session TTL accepted (Consul's session_ttl_min). Tests use short TTLs with it.
    #[arg(long, env = "RCFARM_CONSUL_DEV_SESSION_TTL_MIN", default_value = "10s", value_parser = parse_duration_flag)]
    pub session_ttl_min: Duration,
    /// Require this ACL token on every request (except /v1/status/*).
    #[arg(long, env = "RCFARM_CONSUL_DEV_ACL_TOKEN", hide_env_values = true)]
    pub acl_token: Option<String>,
    /// The node name sessions are registered on.
    #[arg(long, default_value = "rcfarm-dev")]
    pub node_name: String,
    /// Refuse transactions with more operations (Consul < 1.14: 64, later: 128).
    #[arg(long, default_value_t = 64)]
    pub max_txn_ops: usize,
    /// Most concurrent connections from one client IP, loopback included (Consul's
    /// limits.http_max_conns_per_client; 1.x defaults to 200); the next one gets a 429 and is
    /// closed. 0 = no limit.
    #[arg(
        long,
        env = "RCFARM_CONSUL_DEV_HTTP_MAX_CONNS_PER_CLIENT",
        default_value_t = crate::server::DEFAULT_HTTP_MAX_CONNS_PER_CLIENT
    )]
    pub http_max_conns_per_client: usize,
    /// Answer as this Consul where versions differ: 0.7 (no get-or-empty/check-not-exists txn
    /// verbs, no connection limit whatever --http-max-conns-per-client says, 0.7's size limits
    /// and session JSON, legacy ACL answers; see docs/consul-backends.md) or 1.x.
    #[arg(long, env = "RCFARM_CONSUL_DEV_COMPAT", default_value = "1.x", value_parser = parse_compat)]
    pub compat: Compat,
}

impl std::fmt::Debug for ConsulDevArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The server's config shows every setting, the token hidden.
        f.debug_tuple("ConsulDevArgs")
            .field(&self.to_config())
            .finish()
    }
}

fn parse_compat(s: &str) -> Result<Compat, String> {
    s.parse()
        .map_err(|e: crate::server::UnknownCompat| e.to_string())
}

impl ConsulDevArgs {
    pub fn to_config(&self) -> ServerConfig {
        ServerConfig {
            listen: self.listen,
            data_dir: self.data_dir.clone(),
            session_ttl_min: self.session_ttl_min,
            acl_token: self.acl_token.clone(),
            node_name: self.node_name.clone(),
            max_txn_ops: self.max_txn_ops,
            http_max_conns_per_client: self.http_max_conns_per_client,
            compat: self.compat,
            ..ServerConfig::default()
        }
    }
}

/// Starts the server and says where, how reachable, and how durable it is.
pub async fn start(args: &ConsulDevArgs) -> Result<EmbeddedServer, CliError> {
    let server = EmbeddedServer::start(args.to_config())
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;
    let addr = server.addr();
    let reach = if addr.ip().is_loopback() {
        "loopback only: other machines cannot reach it (use --listen 0.0.0.0:8500 to expose it)"
            .to_string()
    } else {
        format!(
            "reachable from other machines on {}{}",
            addr.ip(),
            if args.acl_token.is_none() {
                "; anyone who can reach it can change everything (set --acl-token)"
            } else {
                ""
            }
        )
    };
    tracing::info!(
        "consul-dev serving the Consul HTTP API on {} as Consul {} ({reach})",
        server.url(),
        args.compat
    );
    match (&args.data_dir, server.recovery()) {
        (Some(dir), Some(r)) => tracing::info!(
            "state kept in {} (recovered index {}, {} records replayed{})",
            dir.display(),
            r.index,
            r.replayed,
            if r.torn_bytes > 0 {
                format!(
                    ", {} bytes of an unacknowledged torn write dropped",
                    r.torn_bytes
                )
            } else {
                String::new()
            }
        ),
        _ => tracing::info!(
            "state kept in memory only; it is lost when the server stops (use --data-dir DIR to keep it)"
        ),
    }
    // A machine-readable line on stdout, for scripts and tests that start the server on port 0.
    println!("consul-dev listening on {}", server.url());
    let _ = std::io::stdout().flush();
    Ok(server)
}

pub async fn run(args: ConsulDevArgs) -> Result<(), CliError> {
    let server = start(&args).await?;
    shutdown_signal().await;
    tracing::info!("shutting down");
    server.shutdown().await;
    Ok(())
}
