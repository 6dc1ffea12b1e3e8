//! `rcctl audit …`: query the audit log in SQL, prune it.

use chrono::{DateTime, Utc};

use super::Ctx;
use super::output::{Table, json};
use crate::audit::{AuditQuery, AuditStore};
use crate::cli::CliError;

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct AuditArgs {
    #[command(subcommand)]
    action: Option<AuditAction>,
    #[command(flatten)]
    query: QueryArgs,
}

#[derive(Debug, clap::Subcommand)]
enum AuditAction {
    /// Delete records older than a given age.
    Prune {
        /// Age: `90d`, `12h`, `30m` (or any Go duration).
        #[arg(long)]
        older_than: String,
        #[command(flatten)]
        db: DbArg,
    },
}

#[derive(Debug, clap::Args)]
struct DbArg {
    /// The audit database the farms ship to (their --audit-db): sqlite://PATH or
    /// postgres://USER@HOST/DB. Default: rcfarm-data/audit.db if it exists.
    #[arg(long, env = "RCFARM_AUDIT_DB", hide_env_values = true)]
    audit_db: Option<crate::audit::store::DbUrl>,
}

#[derive(Debug, clap::Args)]
struct QueryArgs {
    /// Only events of this RC.
    #[arg(long)]
    rc: Option<String>,
    /// Only this event type (e.g. REPLICATION_CONTROLLER_RETARGET).
    #[arg(long = "type")]
    event_type: Option<String>,
    /// Only events naming this node.
    #[arg(long)]
    node: Option<String>,
    /// Only events of this pod id.
    #[arg(long)]
    pod: Option<String>,
    /// Only events by this farm.
    #[arg(long)]
    farm: Option<String>,
    /// From this time on: RFC 3339 (2026-11-23T10:00:00Z) or an age (2h, 7d).
    #[arg(long)]
    since: Option<String>,
    /// Before this time: RFC 3339 or an age.
    #[arg(long)]
    until: Option<String>,
    /// Events per page (1-1000).
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// Continue from a previous page's cursor.
    #[arg(long)]
    cursor: Option<String>,
    #[command(flatten)]
    db: DbArg,
}

/// Where audit records go when no live farm ships them to SQL (`--audit-shipping off`), for
/// an operator who wonders why the database stays empty. From the farm registry (what the
/// farms' `/v1/farms` shows); `None` when a farm ships, or none is live, or Consul is away.
pub(super) async fn shipping_note(ctx: &Ctx) -> Option<String> {
    let farms = ctx.overview_farms().await.ok()?;
    if farms.is_empty() || farms.iter().any(|f| f.audit_shipping) {
        return None;
    }
    let ids: Vec<&str> = farms.iter().map(|f| f.farm_id.as_str()).collect();
    Some(format!(
        "audit records are left in Consul audit_logs/ for an external consumer ({} {}: --audit-shipping off); no farm ships them to this database",
        if ids.len() == 1 { "this farm" } else { "farms" },
        ids.join(", ")
    ))
}

/// An age like `90d`, `12h`, or any Go duration.
fn parse_age(s: &str) -> Result<chrono::Duration, CliError> {
    let bad = || CliError::Usage(format!("{s:?}: give an age like 90d, 12h or 30m"));
    let std = if let Some(d) = s.strip_suffix('d').and_then(|d| d.parse::<u64>().ok()) {
        std::time::Duration::from_secs(d * 86_400)
    } else if let Some(w) = s.strip_suffix('w').and_then(|w| w.parse::<u64>().ok()) {
        std::time::Duration::from_secs(w * 7 * 86_400)
    } else {
        crate::cli::parse_duration_flag(s).map_err(|_| bad())?
    };
    chrono::Duration::from_std(std).map_err(|_| bad())
}

fn parse_time(s: &str) -> Result<DateTime<Utc>, CliError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    Ok(Utc::now() - parse_age(s)?)
}

async fn open(db: &DbArg) -> Result<AuditStore, CliError> {
    let url = match &db.audit_db {
        Some(u) => u.expose().to_string(),
        None if std::path::Path::new("rcfarm-data/audit.db").exists() => {
            "sqlite://rcfarm-data/audit.db".to_string()
        }
        None => {
            return Err(CliError::Usage(
                "no audit database given: pass --audit-db (or set RCFARM_AUDIT_DB) to the farms' --audit-db, e.g. sqlite://rcfarm-data/audit.db".into(),
            ));
        }
    };
    AuditStore::connect(&url)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))
}

pub async fn run(ctx: &Ctx, args: AuditArgs) -> Result<(), CliError> {
    match args.action {
        Some(AuditAction::Prune { older_than, db }) => {
            let cutoff = Utc::now() - parse_age(&older_than)?;
            let store = open(&db).await?;
            let n = store
                .prune(cutoff)
                .await
                .map_err(|e| CliError::Failed(e.to_string()))?;
            if ctx.json {
                json(&serde_json::json!({"pruned": n, "older_than": cutoff.to_rfc3339()}))
            } else {
                println!(
                    "pruned {n} audit records older than {}",
                    cutoff.to_rfc3339()
                );
                Ok(())
            }
        }
        None => query(ctx, args.query).await,
    }
}

async fn query(ctx: &Ctx, a: QueryArgs) -> Result<(), CliError> {
    let q = AuditQuery {
        rc_id: a.rc.clone(),
        event_type: a.event_type.clone(),
        node: a.node.clone(),
        pod_id: a.pod.clone(),
        farm_id: a.farm.clone(),
        since: a.since.as_deref().map(parse_time).transpose()?,
        until: a.until.as_deref().map(parse_time).transpose()?,
        limit: Some(a.limit),
        cursor: a.cursor.clone(),
    };
    if let Some(note) = shipping_note(ctx).await {
        eprintln!("{note}");
    }
    let store = open(&a.db).await?;
    let page = store.query(&q).await.map_err(|e| match e {
        crate::audit::AuditError::BadQuery(m) => CliError::Usage(m),
        other => CliError::Failed(other.to_string()),
    })?;
    if ctx.json {
        return json(&page);
    }
    let mut t = Table::new(&["TIME", "EVENT", "RC", "POD", "FARM", "DETAILS"]);
    for r in &page.records {
        t.row(vec![
            r.timestamp
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            r.event_type.clone(),
            r.rc_id.clone().unwrap_or_else(|| "-".into()),
            r.pod_id.clone().unwrap_or_else(|| "-".into()),
            r.farm_id.clone().unwrap_or_else(|| "-".into()),
            summarize(&r.details),
        ]);
    }
    if t.is_empty() {
        println!("no audit events match");
    } else {
        t.print();
    }
    if let Some(c) = page.next_cursor {
        eprintln!("more: repeat with --cursor {c}");
    }
    Ok(())
}

/// A one-line summary of event details.
pub fn summarize(d: &serde_json::Value) -> String {
    let mut parts = Vec::new();
    for k in [
        "farm_id",
        "actor",
        "node",
        "set",
        "removed",
        "nodes",
        "old_node",
        "new_node",
        "reason",
        "rollback_reason",
        "problem",
        "changes",
    ] {
        if let Some(v) = d.get(k).filter(|v| !v.is_null()) {
            parts.push(format!("{k}={}", v));
        }
    }
    parts.join(" ")
}
