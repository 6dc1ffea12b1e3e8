//! The farm's HTTP server: health and readiness probes, Prometheus metrics, a JSON API over
//! RCs, farms and the audit log, and a self-contained status page.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::watch;

mod series;

use crate::audit::{AuditQuery, AuditStore, ShipperStats};
use crate::consul::Consul;
use crate::labels::Selector;
use crate::overview::{Overview, RcOverview, RollOverview};
use crate::rctask::StatusRegistry;
use crate::roll::RollStatusRegistry;

const STATUS_PAGE: &str = include_str!("status.html");

/// What the API serves from.
#[derive(Clone)]
pub struct ApiState {
    pub consul: Consul,
    pub status: Arc<StatusRegistry>,
    pub rolls: Arc<RollStatusRegistry>,
    pub ready: watch::Receiver<bool>,
    pub audit: watch::Receiver<Option<Arc<AuditStore>>>,
    pub shipper: Arc<ShipperStats>,
    pub metrics: Option<PrometheusHandle>,
}

/// A JSON error: `{"error": "…"}` with a status.
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": self.1}))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

fn unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/", get(|| async { Html(STATUS_PAGE) }))
        .route(
            "/health/live",
            get(|| async { Json(json!({"status": "alive"})) }),
        )
        .route("/health/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/rcs", get(rcs))
        .route("/v1/rcs/{id}", get(rc))
        .route("/v1/rolls", get(rolls))
        .route("/v1/rolls/{id}", get(roll))
        .route("/v1/farms", get(farms))
        .route("/v1/audit", get(audit))
        .fallback(|| async {
            ApiError(
                StatusCode::NOT_FOUND,
                "no such endpoint; see /v1/rcs, /v1/farms, /v1/audit, /metrics".into(),
            )
        })
        .with_state(state)
}

async fn ready(State(s): State<ApiState>) -> Response {
    let farm = s.status.farm();
    if *s.ready.borrow() {
        (
            StatusCode::OK,
            Json(json!({"status": "ready", "session": farm.session})),
        )
            .into_response()
    } else {
        let reason = if farm.session.is_none() {
            "no Consul session yet"
        } else {
            "initial sync not done"
        };
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not ready", "reason": reason})),
        )
            .into_response()
    }
}

async fn metrics(State(s): State<ApiState>) -> Response {
    // Gauges that are sums over this farm's RCs are computed at scrape time.
    let rcs = s.status.scrape();
    metrics::gauge!("rcfarm_pods_desired").set(rcs.desired as f64);
    metrics::gauge!("rcfarm_pods_current").set(rcs.current as f64);
    metrics::gauge!("rcfarm_pods_healthy").set(rcs.healthy as f64);
    metrics::gauge!("rcfarm_rcs_unmet").set(rcs.unmet as f64);
    metrics::gauge!("rcfarm_ready").set(if *s.ready.borrow() { 1.0 } else { 0.0 });
    let rolls = s.rolls.all();
    for (gauge, condition) in [
        ("rcfarm_rolls_failed", "Failed"),
        ("rcfarm_rolls_paused", "Paused"),
        ("rcfarm_rolls_stalled", "Stalled"),
    ] {
        metrics::gauge!(gauge)
            .set(rolls.iter().filter(|r| r.has_condition(condition)).count() as f64);
    }
    let sh = &s.shipper;
    use std::sync::atomic::Ordering::Relaxed;
    metrics::gauge!("rcfarm_audit_backlog").set(sh.backlog.load(Relaxed) as f64);
    metrics::gauge!("rcfarm_audit_backlog_oldest_seconds")
        .set(sh.oldest_age_secs.load(Relaxed) as f64);
    let c = s.consul.stats();
    metrics::gauge!("rcfarm_consul_blocking_queries").set(c.blocking_open as f64);
    match &s.metrics {
        Some(h) => {
            let mut text = h.render();
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&series::render(&rcs.noted, &rolls, chrono::Utc::now()));
            text.push_str(&series::render_watch_ages(
                &crate::consul::watch_answer_ages(),
            ));
            text.push_str(&series::render_process());
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
        }
        None => ApiError(
            StatusCode::NOT_FOUND,
            "metrics are not enabled in this process".into(),
        )
        .into_response(),
    }
}

/// The overview, with this farm's own view (conditions such as `Unmet`) of the RCs it owns.
async fn load(s: &ApiState) -> ApiResult<Overview> {
    let mut ov = Overview::load(&s.consul).await.map_err(unavailable)?;
    for r in &mut ov.rcs {
        if let Ok(id) = crate::rc::RcId::parse(&r.id)
            && let Some(local) = s.status.rc(id)
        {
            merge(r, &local);
        }
    }
    Ok(ov)
}

fn merge(r: &mut RcOverview, local: &crate::rctask::RcStatus) {
    for c in &local.conditions {
        let line = format!("{}: {}", c.kind, c.message);
        if !r.conditions.iter().any(|x| x.starts_with(&c.kind)) {
            r.conditions.push(line);
        }
    }
    if let Some(e) = &local.last_error {
        r.conditions.push(format!("Error: {e}"));
    }
}

#[derive(Deserialize)]
struct RcsQuery {
    selector: Option<String>,
}

async fn rcs(
    State(s): State<ApiState>,
    Query(q): Query<RcsQuery>,
) -> ApiResult<Json<serde_json::Value>> {
    let sel = Selector::parse(q.selector.as_deref().unwrap_or(""))
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("selector: {e}")))?;
    let ov = load(&s).await?;
    let rcs: Vec<&RcOverview> = ov.select(&sel);
    Ok(Json(
        json!({"rcs": rcs, "index": ov.index, "orphaned_pods": ov.orphans}),
    ))
}

async fn rc(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    crate::rc::RcId::parse(&id)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("RC id {e}")))?;
    let ov = load(&s).await?;
    let r = ov.rc(&id).ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            format!("replication controller {id} does not exist"),
        )
    })?;
    let local = crate::rc::RcId::parse(&id)
        .ok()
        .and_then(|i| s.status.rc(i));
    Ok(Json(json!({"rc": r, "local_status": local})))
}

/// Every rolling update, with this farm's own view (what it waits for, stalls) of the ones
/// it carries out.
async fn load_rolls(s: &ApiState) -> ApiResult<Vec<RollOverview>> {
    let mut rolls = crate::overview::load_rolls(&s.consul)
        .await
        .map_err(unavailable)?;
    for r in &mut rolls {
        if let Ok(id) = crate::rc::RcId::parse(&r.id)
            && let Some(local) = s.rolls.get(id)
        {
            r.merge(&local);
        }
    }
    Ok(rolls)
}

async fn rolls(State(s): State<ApiState>) -> ApiResult<Json<serde_json::Value>> {
    let rolls = load_rolls(&s).await?;
    Ok(Json(json!({"rolls": rolls})))
}

async fn roll(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let rid = crate::rc::RcId::parse(&id)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("rolling update id {e}")))?;
    let rolls = load_rolls(&s).await?;
    let r = rolls.into_iter().find(|r| r.id == id).ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            format!("rolling update {id} does not exist"),
        )
    })?;
    Ok(Json(json!({"roll": r, "local_status": s.rolls.get(rid)})))
}

async fn farms(State(s): State<ApiState>) -> ApiResult<Json<serde_json::Value>> {
    let ov = Overview::load(&s.consul).await.map_err(unavailable)?;
    Ok(Json(
        json!({"farms": ov.farms, "this_farm": s.status.farm()}),
    ))
}

#[derive(Deserialize, Default)]
struct AuditParams {
    rc: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    node: Option<String>,
    pod: Option<String>,
    farm: Option<String>,
    since: Option<String>,
    until: Option<String>,
    limit: Option<usize>,
    cursor: Option<String>,
}

fn parse_time(name: &str, v: &Option<String>) -> ApiResult<Option<chrono::DateTime<chrono::Utc>>> {
    v.as_deref()
        .map(|t| {
            chrono::DateTime::parse_from_rfc3339(t)
                .map(|t| t.with_timezone(&chrono::Utc))
                .map_err(|e| {
                    ApiError(
                        StatusCode::BAD_REQUEST,
                        format!("{name}: {e} (use RFC 3339, e.g. 2026-11-23T10:00:00Z)"),
                    )
                })
        })
        .transpose()
}

async fn audit(
    State(s): State<ApiState>,
    Query(p): Query<AuditParams>,
) -> ApiResult<Json<crate::audit::AuditPage>> {
    let store = s.audit.borrow().clone().ok_or_else(|| {
        let farm = s.status.farm();
        if farm.audit_shipping {
            unavailable("the audit database is not connected yet")
        } else {
            unavailable(format!(
                "this farm has no audit database to query: {}",
                farm.audit_destination
            ))
        }
    })?;
    let q = AuditQuery {
        rc_id: p.rc,
        event_type: p.event_type,
        node: p.node,
        pod_id: p.pod,
        farm_id: p.farm,
        since: parse_time("since", &p.since)?,
        until: parse_time("until", &p.until)?,
        limit: p.limit,
        cursor: p.cursor,
    };
    store.query(&q).await.map(Json).map_err(|e| match e {
        crate::audit::AuditError::BadQuery(m) => ApiError(StatusCode::BAD_REQUEST, m),
        other => unavailable(other),
    })
}

/// Describes every metric rcfarm exports (the HELP lines) and registers the unlabelled ones at
/// zero, so a scrape shows them before their first event.
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    let counters = [
        ("rcfarm_converge_passes_total", "RC convergence passes"),
        (
            "rcfarm_rc_pass_errors_total",
            "RC passes that failed (retried with backoff)",
        ),
        (
            "rcfarm_pods_scheduled_total",
            "pods scheduled (intent and labels written)",
        ),
        ("rcfarm_pods_unscheduled_total", "pods unscheduled"),
        (
            "rcfarm_fenced_writes_total",
            "writes refused by fencing: the farm no longer held the RC's lock",
        ),
        (
            "rcfarm_stale_plans_total",
            "writes refused because the RC changed after the plan was made",
        ),
        (
            "rcfarm_desires_unmet_total",
            "times an RC's desires became unmet",
        ),
        ("rcfarm_session_renewals_total", "Consul session renewals"),
        (
            "rcfarm_session_renew_failures_total",
            "failed session renewals (retried)",
        ),
        ("rcfarm_session_losses_total", "Consul sessions lost"),
        ("rcfarm_audit_shipped_total", "audit records shipped to SQL"),
        (
            "rcfarm_roll_steps_total",
            "rolling update steps: replicas moved from an old RC to a new one",
        ),
        ("rcfarm_roll_completions_total", "rolling updates completed"),
        (
            "rcfarm_roll_reverts_total",
            "failed rolling updates the farm reverted (--auto-revert)",
        ),
        (
            "rcfarm_roll_stalls_total",
            "times a rolling update was reported stalled",
        ),
        (
            "rcfarm_roll_pass_errors_total",
            "rolling update passes that failed (retried with backoff)",
        ),
        (
            "rcfarm_removals_granted_total",
            "pod removals (unschedules, replacements) the farm's --max-removals budget granted",
        ),
        (
            "rcfarm_removals_held_total",
            "times an RC's or a roll's removals began to be held (RemovalsHeld)",
        ),
        (
            "rcfarm_claim_conflicts_total",
            "claim transactions refused because another session took a lock first",
        ),
        (
            "rcfarm_failsafe_trips_total",
            "times the RC tree went empty or all to 0 replicas (FailsafeTripped)",
        ),
    ];
    for (name, help) in counters {
        describe_counter!(name, help);
        metrics::counter!(name).absolute(0);
    }
    describe_counter!(
        "rcfarm_consul_requests_total",
        "Consul HTTP requests, by endpoint"
    );
    describe_counter!(
        "rcfarm_consul_request_errors_total",
        "failed Consul requests, by endpoint and reason"
    );
    describe_counter!(
        "rcfarm_claims_total",
        "RCs and rolling updates this farm claimed (took the lock of), by kind"
    );
    describe_counter!(
        "rcfarm_rcs_released_total",
        "RCs and rolling updates this farm gave up (handed over), by kind"
    );
    // Labelled series that alerts and the dashboard read exist at zero from the start, so a
    // rate over them is 0 rather than no data.
    for kind in ["RCs", "rolling updates"] {
        metrics::counter!("rcfarm_claims_total", "kind" => kind).absolute(0);
        metrics::counter!("rcfarm_rcs_released_total", "kind" => kind).absolute(0);
    }
    for endpoint in ["kv", "txn", "session", "status"] {
        metrics::counter!("rcfarm_consul_requests_total", "endpoint" => endpoint).absolute(0);
        for reason in ["unavailable", "rate_limited", "permission_denied"] {
            metrics::counter!("rcfarm_consul_request_errors_total", "endpoint" => endpoint, "reason" => reason)
                .absolute(0);
        }
    }
    describe_counter!(
        "rcfarm_consul_txn_total",
        "Consul transactions, by outcome (committed, fenced, index_stale, …)"
    );
    describe_counter!(
        "rcfarm_consul_watch_reconnects_total",
        "blocking-query errors that made a watch reconnect, by watch"
    );
    describe_counter!(
        "rcfarm_rc_invalid_total",
        "invalid RC records reported, by kind of problem"
    );
    describe_counter!(
        "rcfarm_roll_invalid_total",
        "invalid rolling update records reported, by kind of problem"
    );
    describe_counter!(
        "rcfarm_rc_warnings_total",
        "RC records served with an unusual field (a strategy P2 reads as static), by field"
    );
    let gauges = [
        ("rcfarm_owned_rcs", "RCs this farm owns"),
        ("rcfarm_fair_share", "this farm's fair share of the RCs"),
        ("rcfarm_live_farms", "live farms seen"),
        (
            "rcfarm_assignment_rule",
            "the rule assigning RCs to farms: the oldest rule the live farms offer (--assignment-rule)",
        ),
        ("rcfarm_pods_desired", "pods desired by this farm's RCs"),
        ("rcfarm_pods_current", "pods current for this farm's RCs"),
        (
            "rcfarm_pods_healthy",
            "pods of this farm's RCs whose health checks pass",
        ),
        (
            "rcfarm_rcs_unmet",
            "this farm's RCs whose desires are unmet",
        ),
        (
            "rcfarm_ready",
            "1 when the farm holds a session and has synced",
        ),
        (
            "rcfarm_audit_shipper",
            "1 while this farm ships the audit log",
        ),
        (
            "rcfarm_audit_backlog",
            "audit records waiting in the Consul outbox",
        ),
        (
            "rcfarm_audit_backlog_oldest_seconds",
            "age of the oldest audit record waiting",
        ),
        (
            "rcfarm_consul_blocking_queries",
            "blocking queries this farm has open",
        ),
        ("rcfarm_rolls", "rolling updates in Consul"),
        (
            "rcfarm_owned_rolls",
            "rolling updates this farm carries out",
        ),
        (
            "rcfarm_rolls_stalled",
            "rolling updates this farm carries out that are stalled",
        ),
        (
            "rcfarm_rolls_failed",
            "rolling updates this farm holds that failed (their progress deadline passed)",
        ),
        (
            "rcfarm_rolls_paused",
            "rolling updates this farm carries out that an operator paused",
        ),
        (
            "rcfarm_removals_held",
            "RCs and rolls of this farm whose removals are held (RemovalsHeld)",
        ),
        (
            "rcfarm_failsafe_tripped",
            "1 while the farm removes nothing: the RC tree went empty or all to 0 (FailsafeTripped)",
        ),
        ("rcfarm_rcs", "RCs in Consul, as this farm sees them"),
        (
            "rcfarm_rcs_unowned",
            "RCs in Consul whose lock no session holds, as this farm sees them",
        ),
        (
            "rcfarm_orphaned_pods",
            "pods whose label names an RC that no longer exists: nothing manages them (an RC deleted with --force, by P2's CLI or a KV write)",
        ),
        (
            "rcfarm_transfer_timeout_seconds",
            "this farm's node transfer timeout (--transfer-timeout): a transfer older rolls back",
        ),
    ];
    for (name, help) in gauges {
        describe_gauge!(name, help);
        metrics::gauge!(name).set(0.0);
    }
    describe_gauge!(
        "rcfarm_consul_blocking_queries_open",
        "blocking queries open (client-side)"
    );
    let histograms = [
        (
            "rcfarm_consul_request_duration_seconds",
            "Consul request latency (blocking queries excluded), by endpoint",
        ),
        (
            "rcfarm_transfer_duration_seconds",
            "node transfers, from start to completion or rollback, by outcome",
        ),
        (
            "rcfarm_roll_step_duration_seconds",
            "time between a rolling update's steps (from the farm taking it on, for the first)",
        ),
        (
            "rcfarm_roll_duration_seconds",
            "rolling updates, from the completing farm taking them on to completion",
        ),
        (
            "rcfarm_converge_pass_seconds",
            "duration of RC convergence passes",
        ),
        (
            "rcfarm_audit_ship_stage_seconds",
            "audit shipping, by stage: list (the outbox), read, store (SQL), delete (one batch each)",
        ),
    ];
    for (name, help) in histograms {
        describe_histogram!(name, metrics::Unit::Seconds, help);
    }
    // Registered before their first event, so dashboards and alerts find them from the start.
    for outcome in ["completed", "rolled_back"] {
        let _ = metrics::histogram!("rcfarm_transfer_duration_seconds", "outcome" => outcome);
    }
    let _ = metrics::histogram!("rcfarm_roll_step_duration_seconds");
    let _ = metrics::histogram!("rcfarm_roll_duration_seconds");
    let _ = metrics::histogram!("rcfarm_converge_pass_seconds");
}
