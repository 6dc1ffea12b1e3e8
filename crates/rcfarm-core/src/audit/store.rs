//! The SQL side of the audit log: SQLite (the embedded default, WAL) or PostgreSQL, through
//! sqlx's `Any` driver so one code path serves both. Queries are written once with numbered
//! placeholders (`?N` for SQLite, `$N` for PostgreSQL; both engines support numbered ones).

use std::collections::BTreeSet;
use std::path::Path;

use chrono::{DateTime, TimeZone, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

use super::record::AuditRecord;

/// The schema's migrations, in the binary: (version, description, SQL). Built at run time
/// rather than by sqlx's `migrate!` macro, whose proc-macro crate compiled a second copy of
/// sqlx's drivers, SQLite and rustls for the build host (67–78 CPU-seconds of the tests'
/// build from scratch, BENCHMARKS.md). What a database records is the same either way: the
/// version, the description sqlx derives from the file name (`0001_audit_log.sql`: 1, "audit
/// log") and the SHA-384 of the file (no ignored characters), so databases that earlier
/// releases migrated stay valid (`tests::migrations_record_what_earlier_releases_recorded`).
/// A migration file is never edited once released: add the next one, and a line here.
const SQLITE_MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "audit log",
    include_str!("../../../../migrations/sqlite/0001_audit_log.sql"),
)];
const POSTGRES_MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "audit log",
    include_str!("../../../../migrations/postgres/0001_audit_log.sql"),
)];

/// One engine's migrations as sqlx's migrator takes them.
#[derive(Debug)]
struct Embedded(&'static [(i64, &'static str, &'static str)]);

impl Embedded {
    fn migrations(&self) -> Vec<sqlx::migrate::Migration> {
        self.0
            .iter()
            .map(|&(version, description, sql)| {
                sqlx::migrate::Migration::new(
                    version,
                    description.into(),
                    sqlx::migrate::MigrationType::Simple,
                    sqlx::SqlStr::from_static(sql),
                    // As sqlx reads a file: a first line `-- no-transaction` opts out.
                    sql.starts_with("-- no-transaction"),
                )
            })
            .collect()
    }
}

impl sqlx::migrate::MigrationSource<'static> for Embedded {
    fn resolve(
        self,
    ) -> futures::future::BoxFuture<
        'static,
        Result<Vec<sqlx::migrate::Migration>, sqlx::error::BoxDynError>,
    > {
        Box::pin(async move { Ok(self.migrations()) })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit database {url}: {source}")]
    Db {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("audit database {url}: {message}")]
    Config { url: String, message: String },
    #[error(
        "audit database {url} has schema version {found}, newer than this rcfarm knows ({known}); upgrade rcfarm, or point --audit-db at another database"
    )]
    SchemaTooNew { url: String, found: i64, known: i64 },
    #[error("bad query: {0}")]
    BadQuery(String),
}

/// Which engine an `--audit-db` URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

/// One stored audit record, as queries return it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StoredAudit {
    pub id: String,
    pub event_type: String,
    pub timestamp: DateTime<Utc>,
    pub rc_id: Option<String>,
    pub pod_id: Option<String>,
    pub farm_id: Option<String>,
    pub details: Value,
    pub schema_version: i64,
    pub shipped_at: DateTime<Utc>,
    pub shipped_by: Option<String>,
    /// The keyset position, for cursors.
    #[serde(skip)]
    pub seq: i64,
}

/// Filters of an audit query; all given ones must hold. Newest first.
#[derive(Debug, Clone, Default)]
pub struct AuditQuery {
    pub rc_id: Option<String>,
    pub event_type: Option<String>,
    pub node: Option<String>,
    pub pod_id: Option<String>,
    pub farm_id: Option<String>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// Page size (1..=1000, default 50).
    pub limit: Option<usize>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// A page of results and the cursor of the next one (`None` at the end).
#[derive(Debug, Clone, Serialize)]
pub struct AuditPage {
    pub records: Vec<StoredAudit>,
    pub next_cursor: Option<String>,
}

fn nanos(t: DateTime<Utc>) -> i64 {
    t.timestamp_nanos_opt().unwrap_or(if t.timestamp() < 0 {
        i64::MIN
    } else {
        i64::MAX
    })
}

fn from_nanos(n: i64) -> DateTime<Utc> {
    Utc.timestamp_nanos(n)
}

/// A cursor is the (ts, seq) of the last record of a page.
fn encode_cursor(ts: i64, seq: i64) -> String {
    format!("{ts}_{seq}")
}

fn decode_cursor(c: &str) -> Result<(i64, i64), AuditError> {
    let bad = || {
        AuditError::BadQuery(format!(
            "invalid cursor {c:?}: pass the next_cursor of a previous page"
        ))
    };
    let (a, b) = c.split_once('_').ok_or_else(bad)?;
    Ok((a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?))
}

/// A value bound to a query.
enum Arg {
    I64(i64),
    Str(String),
    OptStr(Option<String>),
    Bytes(Vec<u8>),
}

/// SQL text with numbered placeholders for the engine, and its arguments.
struct Sql {
    engine: Engine,
    text: String,
    args: Vec<Arg>,
}

impl Sql {
    fn new(engine: Engine, text: &str) -> Sql {
        Sql {
            engine,
            text: text.to_string(),
            args: Vec::new(),
        }
    }

    fn push(&mut self, s: &str) -> &mut Self {
        self.text.push_str(s);
        self
    }

    /// Appends a placeholder bound to `a`.
    fn bind(&mut self, a: Arg) -> &mut Self {
        self.args.push(a);
        let n = self.args.len();
        match self.engine {
            // Anonymous: SQLite keeps a numbered placeholder's name in a list that
            // `sqlite3_bind_parameter_name` walks, and sqlx asks for each argument's name as
            // it binds it, so `?N` made binding a 4,000-argument insert quadratic (a third of
            // all farms' CPU when farms started on 2,000 RCs: BENCHMARKS.md). Arguments are
            // pushed in order, so `?` binds the same.
            Engine::Sqlite => self.text.push('?'),
            Engine::Postgres => self.text.push_str(&format!("${n}")),
        }
        self
    }

    fn query(&self) -> sqlx::query::Query<'_, sqlx::Any, sqlx::any::AnyArguments> {
        // The text is built only from literal fragments and numbered placeholders; every value
        // is bound, never spliced in.
        let mut q = sqlx::query(sqlx::AssertSqlSafe(self.text.as_str()));
        for a in &self.args {
            q = match a {
                Arg::I64(v) => q.bind(*v),
                Arg::Str(v) => q.bind(v.as_str()),
                Arg::OptStr(v) => q.bind(v.as_deref()),
                Arg::Bytes(v) => q.bind(v.as_slice()),
            };
        }
        q
    }
}

/// Fields worth indexing, read from a record's details.
struct Extracted {
    rc_id: Option<String>,
    pod_id: Option<String>,
    farm_id: Option<String>,
    nodes: BTreeSet<String>,
}

fn extract(r: &AuditRecord) -> Extracted {
    let d = &r.event_details;
    let s = |k: &str| {
        d.get(k)
            .and_then(Value::as_str)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    };
    let mut nodes = BTreeSet::new();
    if let Some(Value::Array(a)) = d.get("nodes") {
        nodes.extend(a.iter().filter_map(Value::as_str).map(str::to_string));
    }
    for k in ["old_node", "new_node", "node"] {
        if let Some(n) = s(k) {
            nodes.insert(n);
        }
    }
    Extracted {
        // A roll is named by its new RC: its records are found with that RC's.
        rc_id: s("replication_controller_id").or_else(|| s("rolling_update_id")),
        pod_id: s("pod_id"),
        farm_id: s("farm_id"),
        nodes,
    }
}

/// The audit database.
#[derive(Clone)]
pub struct AuditStore {
    pool: AnyPool,
    engine: Engine,
    url: String,
}

impl std::fmt::Debug for AuditStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditStore")
            .field("engine", &self.engine)
            .field("url", &redact(&self.url))
            .finish_non_exhaustive()
    }
}

/// Normalises an `--audit-db` value: `sqlite://path`, `sqlite:path`, or a bare path for SQLite
/// (created if missing); `postgres://…` or `postgresql://…` for PostgreSQL.
pub fn parse_url(url: &str) -> Result<(Engine, String), AuditError> {
    let config = |m: &str| AuditError::Config {
        url: redact(url),
        message: m.to_string(),
    };
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok((Engine::Postgres, url.to_string()));
    }
    let path = if let Some(p) = url.strip_prefix("sqlite://") {
        p
    } else if let Some(p) = url.strip_prefix("sqlite:") {
        p
    } else if url.contains("://") {
        return Err(config(
            "unsupported scheme: use sqlite://PATH or postgres://USER@HOST/DB",
        ));
    } else {
        url
    };
    let (path, query) = match path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path, None),
    };
    if path.is_empty() {
        return Err(config("no SQLite file given: use sqlite://PATH"));
    }
    if path != ":memory:"
        && let Some(parent) = Path::new(path).parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent)
            .map_err(|e| config(&format!("cannot create {}: {e}", parent.display())))?;
    }
    let query = query
        .map(str::to_string)
        .unwrap_or_else(|| "mode=rwc".to_string());
    Ok((Engine::Sqlite, format!("sqlite://{path}?{query}")))
}

impl AuditStore {
    /// Connects, refuses a schema newer than this binary's, and applies pending migrations.
    pub async fn connect(url: &str) -> Result<AuditStore, AuditError> {
        sqlx::any::install_default_drivers();
        let (engine, normalized) = parse_url(url)?;
        let shown = redact(url);
        let db = |source| AuditError::Db {
            url: shown.clone(),
            source,
        };
        let sqlite = engine == Engine::Sqlite;
        let pool = AnyPoolOptions::new()
            .max_connections(if sqlite { 4 } else { 8 })
            .acquire_timeout(std::time::Duration::from_secs(10))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if sqlite {
                        // SQLite's page cache is 2 MiB by default: every record's id and
                        // indexes are random inserts into B-trees of the whole log, which past
                        // a few hundred thousand records spilled and re-read pages for each
                        // batch. 64 MiB per connection holds their inner pages.
                        sqlx::Executor::execute(&mut *conn, "PRAGMA cache_size = -65536").await?;
                        // A multi-row insert inside a transaction keeps a statement journal
                        // (to undo just that statement): in a temporary file by default, which
                        // doubled the page writes of every batch. In memory it is a copy.
                        sqlx::Executor::execute(&mut *conn, "PRAGMA temp_store = MEMORY").await?;
                    }
                    Ok(())
                })
            })
            .connect(&normalized)
            .await
            .map_err(db)?;
        let store = AuditStore {
            pool,
            engine,
            url: shown.clone(),
        };
        // Farms starting together would race to migrate one SQLite file (PostgreSQL migrations
        // take an advisory lock of their own): serialise them with a lock file beside it.
        let _guard = match (engine, sqlite_path(&normalized)) {
            (Engine::Sqlite, Some(path)) => Some(lock_file(&path, &shown).await?),
            _ => None,
        };
        if engine == Engine::Sqlite {
            // WAL lets readers (rcctl, the HTTP API) work while the shipper writes.
            sqlx::query("PRAGMA journal_mode=WAL")
                .execute(&store.pool)
                .await
                .map_err(db)?;
        }
        store.migrate().await?;
        Ok(store)
    }

    fn migrations(&self) -> Embedded {
        Embedded(match self.engine {
            Engine::Sqlite => SQLITE_MIGRATIONS,
            Engine::Postgres => POSTGRES_MIGRATIONS,
        })
    }

    async fn migrate(&self) -> Result<(), AuditError> {
        let db = |source| AuditError::Db {
            url: redact(&self.url),
            source,
        };
        let known = self.migrations().0.iter().map(|m| m.0).max().unwrap_or(0);
        let table_exists = match self.engine {
            Engine::Sqlite => {
                "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'"
            }
            Engine::Postgres => {
                "SELECT COUNT(*) FROM information_schema.tables WHERE table_name = '_sqlx_migrations'"
            }
        };
        let exists: i64 = sqlx::query(table_exists)
            .fetch_one(&self.pool)
            .await
            .map_err(db)?
            .try_get(0)
            .map_err(db)?;
        if exists > 0 {
            let found: Option<i64> = sqlx::query("SELECT MAX(version) FROM _sqlx_migrations")
                .fetch_one(&self.pool)
                .await
                .map_err(db)?
                .try_get(0)
                .map_err(db)?;
            if let Some(found) = found
                && found > known
            {
                return Err(AuditError::SchemaTooNew {
                    url: redact(&self.url),
                    found,
                    known,
                });
            }
        }
        sqlx::migrate::Migrator::new(self.migrations())
            .await
            .map_err(|e| db(e.into()))?
            .run(&self.pool)
            .await
            .map_err(|e| db(e.into()))?;
        if self.engine == Engine::Sqlite {
            // Gather planner statistics where they are missing or stale (cheap when they are not).
            sqlx::query("PRAGMA optimize")
                .execute(&self.pool)
                .await
                .map_err(db)?;
        }
        Ok(())
    }

    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// The URL with any password hidden.
    /// Where the store is, for messages: the URL with its secrets hidden ([`redact`]).
    pub fn url(&self) -> String {
        redact(&self.url)
    }

    /// The highest schema version applied.
    pub async fn schema_version(&self) -> Result<i64, AuditError> {
        let v: Option<i64> = sqlx::query("SELECT MAX(version) FROM _sqlx_migrations")
            .fetch_one(&self.pool)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(|source| AuditError::Db {
                url: redact(&self.url),
                source,
            })?;
        Ok(v.unwrap_or(0))
    }

    /// Inserts records; a record already stored (same uuid) is skipped, so shipping the same
    /// record twice stores it once. Returns how many were new.
    pub async fn insert(
        &self,
        records: &[AuditRecord],
        shipped_by: &str,
    ) -> Result<usize, AuditError> {
        let db = |source| AuditError::Db {
            url: redact(&self.url),
            source,
        };
        let now = nanos(Utc::now());
        let mut tx = self.pool.begin().await.map_err(db)?;
        let mut inserted = 0;
        let mut nodes: Vec<(String, String)> = Vec::new();
        for chunk in records.chunks(400) {
            let mut sql = Sql::new(
                self.engine,
                "INSERT INTO audit_events (id, event_type, ts, rc_id, pod_id, farm_id, details, schema_version, shipped_at, shipped_by) VALUES ",
            );
            for (i, r) in chunk.iter().enumerate() {
                let x = extract(r);
                let id = r.id.to_string();
                nodes.extend(x.nodes.into_iter().map(|n| (n, id.clone())));
                sql.push(if i == 0 { "(" } else { ", (" });
                sql.bind(Arg::Str(id)).push(", ");
                sql.bind(Arg::Str(r.event_type.clone())).push(", ");
                sql.bind(Arg::I64(nanos(r.timestamp))).push(", ");
                sql.bind(Arg::OptStr(x.rc_id)).push(", ");
                sql.bind(Arg::OptStr(x.pod_id)).push(", ");
                sql.bind(Arg::OptStr(x.farm_id)).push(", ");
                sql.bind(Arg::Str(r.event_details.to_string())).push(", ");
                sql.bind(Arg::I64(r.schema_version)).push(", ");
                sql.bind(Arg::I64(now)).push(", ");
                sql.bind(Arg::Str(shipped_by.to_string())).push(")");
            }
            // No RETURNING: the node rows below find their events by id, so nothing needs
            // reading back (measured: no faster either way; it is simpler).
            sql.push(" ON CONFLICT (id) DO NOTHING");
            let done = sql.query().execute(&mut *tx).await.map_err(db)?;
            inserted += done.rows_affected() as usize;
        }
        // The nodes each record names, joined to the record's row for its seq and ts. A record
        // stored before (shipped twice) finds its node rows there already: DO NOTHING.
        for chunk in nodes.chunks(1_000) {
            let mut sql = Sql::new(
                self.engine,
                "INSERT INTO audit_event_nodes (node, ts, event_seq) SELECT v.column1, e.ts, e.seq FROM (VALUES ",
            );
            for (i, (node, id)) in chunk.iter().enumerate() {
                sql.push(if i == 0 { "(" } else { ", (" });
                sql.bind(Arg::Str(node.clone())).push(", ");
                sql.bind(Arg::Str(id.clone())).push(")");
            }
            // `WHERE true`: without a WHERE, SQLite's parser cannot tell the upsert's ON from a
            // join's (its documented ambiguity of INSERT … SELECT … ON CONFLICT).
            sql.push(
                ") AS v JOIN audit_events e ON e.id = v.column2 WHERE true ON CONFLICT DO NOTHING",
            );
            sql.query().execute(&mut *tx).await.map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        Ok(inserted)
    }

    /// Keeps records that could not be parsed, verbatim.
    pub async fn insert_dead_letters(
        &self,
        items: &[(String, Vec<u8>, String)],
    ) -> Result<(), AuditError> {
        let db = |source| AuditError::Db {
            url: redact(&self.url),
            source,
        };
        let now = nanos(Utc::now());
        for (key, value, reason) in items {
            let mut sql = Sql::new(
                self.engine,
                "INSERT INTO audit_dead_letters (key, value, reason, shipped_at) VALUES (",
            );
            sql.bind(Arg::Str(key.clone())).push(", ");
            sql.bind(Arg::Bytes(value.clone())).push(", ");
            sql.bind(Arg::Str(reason.clone())).push(", ");
            sql.bind(Arg::I64(now))
                .push(") ON CONFLICT (key) DO NOTHING");
            sql.query().execute(&self.pool).await.map_err(db)?;
        }
        Ok(())
    }

    /// Dead letters: `(key, reason)`.
    pub async fn dead_letters(&self) -> Result<Vec<(String, String)>, AuditError> {
        let rows = sqlx::query("SELECT key, reason FROM audit_dead_letters ORDER BY key")
            .fetch_all(&self.pool)
            .await
            .map_err(|source| AuditError::Db {
                url: redact(&self.url),
                source,
            })?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|source| AuditError::Db {
                url: redact(&self.url),
                source,
            })
    }

    fn filtered(&self, q: &AuditQuery, select: &str) -> Result<Sql, AuditError> {
        let mut sql = Sql::new(self.engine, select);
        if let Some(node) = &q.node {
            sql.push(" JOIN audit_event_nodes n ON n.event_seq = e.seq AND n.node = ");
            sql.bind(Arg::Str(node.clone()));
        }
        sql.push(" WHERE 1 = 1");
        // SQLite plans without statistics and may scan a whole index that merely matches the
        // ORDER BY (900,000 rows for "this RC's retargets"). Only the most selective filter's
        // index stays usable there; a unary `+` hides the others from the planner.
        let lead = ["rc_id", "pod_id", "farm_id", "event_type"]
            .into_iter()
            .zip([&q.rc_id, &q.pod_id, &q.farm_id, &q.event_type])
            .find(|(_, v)| v.is_some())
            .map(|(c, _)| c)
            .filter(|_| q.node.is_none());
        let engine = self.engine;
        let mut eq = |col: &str, v: &Option<String>| {
            if let Some(v) = v {
                let hide = engine == Engine::Sqlite && lead != Some(col);
                sql.push(&format!(" AND {}e.{col} = ", if hide { "+" } else { "" }));
                sql.bind(Arg::Str(v.clone()));
            }
        };
        eq("rc_id", &q.rc_id);
        eq("event_type", &q.event_type);
        eq("pod_id", &q.pod_id);
        eq("farm_id", &q.farm_id);
        if let Some(t) = q.since {
            sql.push(" AND e.ts >= ");
            sql.bind(Arg::I64(nanos(t)));
        }
        if let Some(t) = q.until {
            sql.push(" AND e.ts < ");
            sql.bind(Arg::I64(nanos(t)));
        }
        Ok(sql)
    }

    /// One page of records, newest first. Paging by keyset (event time, then insertion order)
    /// is stable: records shipped while paging never shift or repeat what a page showed.
    pub async fn query(&self, q: &AuditQuery) -> Result<AuditPage, AuditError> {
        let limit = q.limit.unwrap_or(50);
        if !(1..=1000).contains(&limit) {
            return Err(AuditError::BadQuery(format!(
                "limit {limit}: use 1 to 1000"
            )));
        }
        let mut sql = self.filtered(
            q,
            "SELECT e.seq, e.id, e.event_type, e.ts, e.rc_id, e.pod_id, e.farm_id, e.details, e.schema_version, e.shipped_at, e.shipped_by FROM audit_events e",
        )?;
        // With a node filter, order by the node table's own copy of (ts, seq): its index then
        // yields the newest rows first and the LIMIT stops the scan.
        let (ts_col, seq_col) = if q.node.is_some() {
            ("n.ts", "n.event_seq")
        } else {
            ("e.ts", "e.seq")
        };
        if let Some(c) = &q.cursor {
            let (ts, seq) = decode_cursor(c)?;
            sql.push(&format!(" AND ({ts_col} < "));
            sql.bind(Arg::I64(ts));
            sql.push(&format!(" OR ({ts_col} = "));
            sql.bind(Arg::I64(ts));
            sql.push(&format!(" AND {seq_col} < "));
            sql.bind(Arg::I64(seq));
            sql.push("))");
        }
        sql.push(&format!(" ORDER BY {ts_col} DESC, {seq_col} DESC LIMIT "));
        sql.bind(Arg::I64(limit as i64 + 1));
        let rows = sql
            .query()
            .fetch_all(&self.pool)
            .await
            .map_err(|source| AuditError::Db {
                url: redact(&self.url),
                source,
            })?;
        let mut records: Vec<StoredAudit> = rows
            .iter()
            .map(row_to_audit)
            .collect::<Result<_, _>>()
            .map_err(|source| AuditError::Db {
                url: redact(&self.url),
                source,
            })?;
        let next_cursor = if records.len() > limit {
            records.truncate(limit);
            records
                .last()
                .map(|r| encode_cursor(nanos(r.timestamp), r.seq))
        } else {
            None
        };
        Ok(AuditPage {
            records,
            next_cursor,
        })
    }

    /// How many records match (ignoring paging).
    pub async fn count(&self, q: &AuditQuery) -> Result<u64, AuditError> {
        let sql = self.filtered(q, "SELECT COUNT(*) FROM audit_events e")?;
        let n: i64 = sql
            .query()
            .fetch_one(&self.pool)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(|source| AuditError::Db {
                url: redact(&self.url),
                source,
            })?;
        Ok(n as u64)
    }

    /// Deletes records older than `cutoff`; returns how many.
    pub async fn prune(&self, cutoff: DateTime<Utc>) -> Result<u64, AuditError> {
        let db = |source| AuditError::Db {
            url: redact(&self.url),
            source,
        };
        let mut tx = self.pool.begin().await.map_err(db)?;
        let mut nodes = Sql::new(self.engine, "DELETE FROM audit_event_nodes WHERE ts < ");
        nodes.bind(Arg::I64(nanos(cutoff)));
        nodes.query().execute(&mut *tx).await.map_err(db)?;
        let mut events = Sql::new(self.engine, "DELETE FROM audit_events WHERE ts < ");
        events.bind(Arg::I64(nanos(cutoff)));
        let n = events
            .query()
            .execute(&mut *tx)
            .await
            .map_err(db)?
            .rows_affected();
        tx.commit().await.map_err(db)?;
        Ok(n)
    }

    /// Refreshes the planner's statistics.
    pub async fn analyze(&self) -> Result<(), AuditError> {
        sqlx::query("ANALYZE")
            .execute(&self.pool)
            .await
            .map_err(|source| AuditError::Db {
                url: redact(&self.url),
                source,
            })?;
        Ok(())
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

fn row_to_audit(r: &AnyRow) -> Result<StoredAudit, sqlx::Error> {
    let details: String = r.try_get(7)?;
    Ok(StoredAudit {
        seq: r.try_get(0)?,
        id: r.try_get(1)?,
        event_type: r.try_get(2)?,
        timestamp: from_nanos(r.try_get(3)?),
        rc_id: r.try_get(4)?,
        pod_id: r.try_get(5)?,
        farm_id: r.try_get(6)?,
        details: serde_json::from_str(&details).unwrap_or(Value::String(details)),
        schema_version: r
            .try_get::<i64, _>(8)
            .or_else(|_| r.try_get::<i32, _>(8).map(i64::from))?,
        shipped_at: from_nanos(r.try_get(9)?),
        shipped_by: r.try_get(10)?,
    })
}

/// The file of a normalised `sqlite://PATH?…` URL (none for `:memory:`).
fn sqlite_path(normalized: &str) -> Option<std::path::PathBuf> {
    let path = normalized.strip_prefix("sqlite://")?.split('?').next()?;
    (path != ":memory:").then(|| std::path::PathBuf::from(path))
}

/// Holds an exclusive lock on `<db>.lock` until dropped.
async fn lock_file(db: &Path, url: &str) -> Result<std::fs::File, AuditError> {
    let lock_path = db.with_extension("lock");
    let url = url.to_string();
    tokio::task::spawn_blocking(move || {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)?;
        f.lock()?;
        Ok::<_, std::io::Error>(f)
    })
    .await
    .map_err(|e| AuditError::Config {
        url: redact(&url),
        message: e.to_string(),
    })?
    .map_err(|e| AuditError::Config {
        url: redact(&url),
        message: format!("cannot lock the migration lock file: {e}"),
    })
}

/// An `--audit-db` URL kept for connecting: its `Debug` and `Display` show it [`redact`]ed, so
/// a config that holds it can be printed.
#[derive(Clone, PartialEq, Eq)]
pub struct DbUrl(String);

impl DbUrl {
    pub fn new(url: impl Into<String>) -> Self {
        DbUrl(url.into())
    }

    /// The URL itself, with its password: for connecting, never for printing.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for DbUrl {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(DbUrl::new(s))
    }
}

impl std::fmt::Debug for DbUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", redact(&self.0))
    }
}

impl std::fmt::Display for DbUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

/// Query parameters of a database URL that carry a secret (PostgreSQL's `password` and
/// `sslpassword`, and the spellings other drivers use).
const SECRET_PARAMS: &[&str] = &[
    "password",
    "sslpassword",
    "passwd",
    "pass",
    "pwd",
    "secret",
    "token",
];

/// Hides the secrets of a database URL: the password of its user info (`user:***@host`) and
/// the values of password-like query parameters (`?password=***`). Anything that is not a URL
/// is left as it is; what cannot be parsed is hidden whole after the scheme rather than risked.
pub fn redact(url: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (url, None),
    };
    let head = match head.find("://") {
        Some(s) => {
            let rest = &head[s + 3..];
            // The user info ends at the last '@' before the path.
            let authority_end = rest.find('/').unwrap_or(rest.len());
            match rest[..authority_end].rfind('@') {
                Some(at) => {
                    let creds = &rest[..at];
                    let user = creds.split_once(':').map_or(creds, |(u, _)| u);
                    let hidden = if creds.contains(':') {
                        format!("{user}:***")
                    } else {
                        user.to_string()
                    };
                    format!("{}{hidden}{}", &head[..s + 3], &rest[at..])
                }
                None => head.to_string(),
            }
        }
        None => head.to_string(),
    };
    match query {
        None => head,
        Some(q) => {
            let params: Vec<String> = q
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if SECRET_PARAMS.iter().any(|s| k.eq_ignore_ascii_case(s)) => {
                        format!("{k}=***")
                    }
                    _ => p.to_string(),
                })
                .collect();
            format!("{head}?{}", params.join("&"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(parse_url("postgres://u@h/db").unwrap().0, Engine::Postgres);
        let (e, u) = parse_url("sqlite::memory:").unwrap();
        assert_eq!(
            (e, u.as_str()),
            (Engine::Sqlite, "sqlite://:memory:?mode=rwc")
        );
        assert!(parse_url("mysql://x").is_err());
        assert!(parse_url("sqlite://").is_err());
        assert_eq!(
            redact("postgres://me:secret@h/db"),
            "postgres://me:***@h/db"
        );
        assert_eq!(redact("postgres://me@h/db"), "postgres://me@h/db");
        // Passwords in the query, any case, beside parameters that are no secret.
        assert_eq!(
            redact("postgres://me@h/db?sslmode=require&password=s3cret&PassWord=x"),
            "postgres://me@h/db?sslmode=require&password=***&PassWord=***"
        );
        assert_eq!(
            redact("mysql://root:hunter2@db:3306/x?sslpassword=k"),
            "mysql://root:***@db:3306/x?sslpassword=***"
        );
        // An '@' in the password, and a path with '@' after the host.
        assert_eq!(
            redact("postgres://me:p@ss@h/db@x"),
            "postgres://me:***@h/db@x"
        );
        assert_eq!(
            redact("sqlite:///var/lib/rcfarm/audit.db"),
            "sqlite:///var/lib/rcfarm/audit.db"
        );
        assert_eq!(redact("/tmp/audit.db"), "/tmp/audit.db");
    }

    /// What a migrated database records of each migration, as earlier releases (sqlx's
    /// `migrate!` over `migrations/`) recorded it: a database they made must validate.
    #[test]
    fn migrations_record_what_earlier_releases_recorded() {
        let recorded = |e: Embedded| {
            e.migrations()
                .into_iter()
                .map(|m| {
                    (
                        m.version,
                        m.description.to_string(),
                        m.no_tx,
                        hex::encode(&*m.checksum),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            recorded(Embedded(SQLITE_MIGRATIONS)),
            [(
                1,
                "audit log".to_string(),
                false,
                "b157f9b0f3d0995146a267a25aaf56c5bd849ff1f36f39ee8e7263bda3ce03225b18e78e464e35e67a07c413bbd583b6".to_string()
            )]
        );
        assert_eq!(
            recorded(Embedded(POSTGRES_MIGRATIONS)),
            [(
                1,
                "audit log".to_string(),
                false,
                "968eaaf9cd10300b153676703661a3132976912f825fa8e363d9b177b8ad0db95eaf49f994bb5f319bc3b58759c10b2b".to_string()
            )]
        );
    }

    #[test]
    fn cursors_round_trip() {
        assert_eq!(decode_cursor(&encode_cursor(-5, 7)).unwrap(), (-5, 7));
        assert!(decode_cursor("nope").is_err());
    }
}
