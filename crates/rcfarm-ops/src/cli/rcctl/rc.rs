//! `rcctl rc …` and `rcctl farms`.

use std::time::{Duration, Instant};

use super::audit::summarize;
use super::output::{Table, json, parse_pairs, print_txn};
use super::{Ctx, RcCommand, consul_failed, parse_id, read_manifest};
use crate::cli::CliError;
use crate::farm::claims::Rule;
use crate::labels::Selector;
use crate::overview::RcOverview;
use crate::rc::{AllocationStrategy, Mutation, NewRc, RcStore, RcStoreError, Written};

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum StrategyArg {
    /// Only nodes the selector matches.
    #[value(alias = "static_strategy")]
    Static,
    /// May allocate more nodes from the scheduler and move pods off ineligible nodes.
    #[value(alias = "dynamic_strategy")]
    Dynamic,
}

impl From<StrategyArg> for AllocationStrategy {
    fn from(s: StrategyArg) -> Self {
        match s {
            StrategyArg::Static => AllocationStrategy::Static,
            StrategyArg::Dynamic => AllocationStrategy::Dynamic,
        }
    }
}

use super::rc_actor as actor;

fn store_failed(e: RcStoreError) -> CliError {
    match e {
        RcStoreError::Consul(c) => consul_failed(c),
        RcStoreError::NotFound(id) => CliError::Failed(format!(
            "replication controller {id} does not exist (see `rcctl rc list`)"
        )),
        RcStoreError::BadChange(p) => CliError::Usage(format!("refusing the change: {p}")),
        other => CliError::Failed(other.to_string()),
    }
}

/// Reports a write: the transaction for a dry run, a line (or JSON) otherwise.
fn report(ctx: &Ctx, w: &Written, dry_run: bool, what: &str) -> Result<(), CliError> {
    if dry_run {
        return print_txn(&w.ops);
    }
    if ctx.json {
        let rc = w.rc.as_ref().map(|rc| serde_json::json!({"id": rc.id, "modify_index": rc.modify_index, "record": rc.raw}));
        return json(&serde_json::json!({"result": what, "changed": w.committed, "rc": rc}));
    }
    if w.committed {
        println!("{what}");
    } else {
        println!("{what} (nothing to change)");
    }
    Ok(())
}

pub async fn run(ctx: &Ctx, cmd: RcCommand) -> Result<(), CliError> {
    let store = RcStore::new(ctx.consul.clone());
    match cmd {
        RcCommand::Create {
            manifest,
            node_selector,
            replicas,
            pod_labels,
            rc_labels,
            strategy,
            disabled,
            dry,
        } => {
            Selector::parse(&node_selector)
                .map_err(|e| CliError::Usage(format!("--node-selector: {e}")))?;
            let new = NewRc {
                manifest: read_manifest(&manifest)?,
                node_selector,
                pod_labels: parse_pairs(&pod_labels, "--pod-label")?,
                replicas_desired: replicas,
                strategy: strategy.into(),
                rc_labels: parse_pairs(&rc_labels, "--rc-label")?,
                disabled,
            };
            let w = store
                .create(new, &actor(), dry.dry_run)
                .await
                .map_err(store_failed)?;
            let id = w.rc.as_ref().map(|r| r.id.to_string()).unwrap_or_default();
            if !dry.dry_run && !ctx.json {
                println!("{id}");
                return Ok(());
            }
            report(ctx, &w, dry.dry_run, &format!("created {id}"))
        }
        RcCommand::List { selector } => list(ctx, &selector).await,
        RcCommand::History { id } => super::roll::history(ctx, &id).await,
        RcCommand::Show { id, audit_db } => {
            show(ctx, &id, audit_db.as_ref().map(|u| u.expose())).await
        }
        RcCommand::Scale {
            id,
            replicas,
            wait,
            timeout,
            dry,
        } => {
            let rid = parse_id(&id)?;
            let w = store
                .mutate(rid, &Mutation::SetReplicas(replicas), &actor(), dry.dry_run)
                .await
                .map_err(store_failed)?;
            report(ctx, &w, dry.dry_run, &format!("{rid} scaled to {replicas}"))?;
            if wait && !dry.dry_run {
                wait_converged(ctx, &id, replicas, timeout).await?;
            }
            Ok(())
        }
        RcCommand::Enable { id, dry } => {
            mutate(ctx, &store, &id, Mutation::Enable, dry.dry_run, "enabled").await
        }
        RcCommand::Disable { id, dry } => {
            mutate(ctx, &store, &id, Mutation::Disable, dry.dry_run, "disabled").await
        }
        RcCommand::Delete { id, force, dry } => {
            let rid = parse_id(&id)?;
            let (w, left) = store
                .delete(rid, force, &actor(), dry.dry_run)
                .await
                .map_err(store_failed)?;
            let what = if left.is_empty() {
                format!("deleted {rid}")
            } else {
                let n = left.len();
                format!(
                    "deleted {rid} (--force): its {n} pod{} on {} {} left running, managed by nothing; `rcctl node list` marks {} ORPHANED. To stop one, delete its intent/<node>/<pod-id> and labels/pod/<node>/<pod-id> keys",
                    if n == 1 { "" } else { "s" },
                    left.join(", "),
                    if n == 1 { "is" } else { "are" },
                    if n == 1 { "it" } else { "them" },
                )
            };
            report(ctx, &w, dry.dry_run, &what)
        }
        RcCommand::Restart {
            id,
            opts,
            wait,
            dry,
        } => {
            let rid = parse_id(&id)?;
            let rc = store.get(rid).await.map_err(store_failed)?.ok_or_else(|| {
                CliError::Usage(format!(
                    "replication controller {rid} does not exist (rcctl rc list)"
                ))
            })?;
            let at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
            let manifest = rc
                .manifest
                .restarted(&at)
                .map_err(|e| CliError::Usage(format!("cannot restart {rid}: {e}")))?;
            super::roll::start(
                ctx,
                crate::roll::RollStore::new(ctx.consul.clone()),
                rid,
                manifest,
                opts,
                wait,
                dry,
            )
            .await
        }
        RcCommand::SetManifest { id, manifest, dry } => {
            let text = read_manifest(&manifest)?;
            mutate(
                ctx,
                &store,
                &id,
                Mutation::SetManifest(text),
                dry.dry_run,
                "manifest set",
            )
            .await
        }
        RcCommand::SetSelector { id, selector, dry } => {
            Selector::parse(&selector).map_err(|e| CliError::Usage(format!("selector: {e}")))?;
            mutate(
                ctx,
                &store,
                &id,
                Mutation::SetNodeSelector(selector),
                dry.dry_run,
                "node selector set",
            )
            .await
        }
        RcCommand::SetStrategy { id, strategy, dry } => {
            let s = AllocationStrategy::from(strategy);
            mutate(
                ctx,
                &store,
                &id,
                Mutation::SetStrategy(s),
                dry.dry_run,
                &format!("allocation strategy set to {}", s.as_str()),
            )
            .await
        }
    }
}

async fn mutate(
    ctx: &Ctx,
    store: &RcStore,
    id: &str,
    m: Mutation,
    dry_run: bool,
    what: &str,
) -> Result<(), CliError> {
    let rid = parse_id(id)?;
    let w = store
        .mutate(rid, &m, &actor(), dry_run)
        .await
        .map_err(store_failed)?;
    report(ctx, &w, dry_run, &format!("{rid} {what}"))
}

fn cell(o: &Option<String>) -> String {
    o.clone().unwrap_or_else(|| "-".into())
}

async fn list(ctx: &Ctx, selector: &str) -> Result<(), CliError> {
    let sel = Selector::parse(selector).map_err(|e| CliError::Usage(format!("-l: {e}")))?;
    let ov = ctx.overview().await?;
    let rcs: Vec<&RcOverview> = ov.select(&sel);
    if ctx.json {
        return json(&rcs);
    }
    let mut t = Table::new(&[
        "ID",
        "POD",
        "DESIRED/CURRENT/HEALTHY",
        "OWNER",
        "DISABLED",
        "CONDITIONS",
    ]);
    for r in rcs {
        t.row(vec![
            r.id.clone(),
            cell(&r.pod_id),
            format!(
                "{}/{}/{}",
                r.desired.map_or("?".to_string(), |d| d.to_string()),
                r.current,
                r.healthy.map_or("-".to_string(), |h| h.to_string())
            ),
            cell(&r.owner_farm),
            if r.disabled {
                "yes".into()
            } else {
                "no".into()
            },
            if r.conditions.is_empty() {
                "Ready".into()
            } else {
                r.conditions.join("; ")
            },
        ]);
    }
    if t.is_empty() {
        println!(
            "no replication controllers{}",
            if selector.is_empty() {
                String::new()
            } else {
                format!(" match {selector:?}")
            }
        );
    } else {
        t.print();
    }
    Ok(())
}

async fn show(ctx: &Ctx, id: &str, audit_db: Option<&str>) -> Result<(), CliError> {
    let rid = parse_id(id)?;
    let ov = ctx.overview().await?;
    let r = ov.rc(id).ok_or_else(|| {
        CliError::Failed(format!(
            "replication controller {rid} does not exist (see `rcctl rc list`)"
        ))
    })?;
    let (entry, _) = ctx
        .consul
        .kv_get(&rid.key(), &Default::default())
        .await
        .map_err(consul_failed)?;
    let record: serde_json::Value = entry
        .as_ref()
        .and_then(|e| serde_json::from_slice(e.value_bytes()).ok())
        .unwrap_or(serde_json::Value::Null);
    let events = recent_events(ctx, id, audit_db).await;
    if ctx.json {
        return json(&serde_json::json!({"rc": r, "record": record, "recent_events": events}));
    }
    println!("ID:             {}", r.id);
    println!("Pod id:         {}", cell(&r.pod_id));
    println!(
        "Desired:        {}",
        r.desired.map_or("?".to_string(), |d| d.to_string())
    );
    println!(
        "Current:        {} on {}",
        r.current,
        if r.nodes.is_empty() {
            "no nodes".into()
        } else {
            r.nodes.join(", ")
        }
    );
    println!(
        "Healthy:        {}",
        r.healthy
            .map_or("- (nothing reports this pod's health)".to_string(), |h| h
                .to_string())
    );
    println!(
        "Node selector:  {}",
        if r.node_selector.is_empty() {
            "(every node)"
        } else {
            &r.node_selector
        }
    );
    println!("Strategy:       {}", r.strategy);
    println!("Disabled:       {}", r.disabled);
    println!(
        "Owner:          {}",
        r.owner_farm
            .clone()
            .or_else(|| r.owner_session.clone())
            .unwrap_or_else(|| "none".into())
    );
    println!(
        "Conditions:     {}",
        if r.conditions.is_empty() {
            "Ready".into()
        } else {
            r.conditions.join("; ")
        }
    );
    println!("Pod labels:     {}", fmt_labels(&r.pod_labels));
    println!("RC labels:      {}", fmt_labels(&r.rc_labels));
    if let Some(m) = record.get("manifest").and_then(|m| m.as_str()) {
        println!("Manifest:");
        for l in m.lines() {
            println!("  {l}");
        }
    }
    println!("Recent audit events:");
    match events {
        Ok(evs) if evs.is_empty() => println!("  (none)"),
        Ok(evs) => {
            for e in evs {
                println!(
                    "  {}  {}  {}",
                    e["timestamp"].as_str().unwrap_or(""),
                    e["event_type"].as_str().unwrap_or(""),
                    summarize(&e["event_details"])
                );
            }
        }
        Err(why) => println!("  ({why})"),
    }
    Ok(())
}

fn fmt_labels(l: &crate::labels::LabelSet) -> String {
    if l.is_empty() {
        return "-".into();
    }
    l.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The RC's latest audit events: from SQL if `audit_db` is given, and from the Consul outbox
/// (records not shipped yet).
async fn recent_events(
    ctx: &Ctx,
    id: &str,
    audit_db: Option<&str>,
) -> Result<Vec<serde_json::Value>, String> {
    let mut events: Vec<serde_json::Value> = Vec::new();
    if let Some(url) = audit_db {
        let store = crate::audit::AuditStore::connect(url)
            .await
            .map_err(|e| e.to_string())?;
        let page = store
            .query(&crate::audit::AuditQuery {
                rc_id: Some(id.to_string()),
                limit: Some(10),
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())?;
        events.extend(page.records.iter().map(|r| {
            serde_json::json!({"id": r.id, "timestamp": r.timestamp.to_rfc3339(), "event_type": r.event_type, "event_details": r.details})
        }));
    }
    if let Ok((entries, _)) = ctx
        .consul
        .kv_list(crate::audit::AUDIT_PREFIX, &Default::default())
        .await
    {
        for e in entries {
            if let Ok(r) = crate::audit::AuditRecord::from_kv(&e.key, e.value_bytes())
                && r.event_details
                    .get("replication_controller_id")
                    .and_then(|v| v.as_str())
                    == Some(id)
                && !events.iter().any(|x| x["id"] == r.id.to_string())
            {
                events.push(serde_json::json!({"id": r.id.to_string(), "timestamp": r.timestamp.to_rfc3339(), "event_type": r.event_type, "event_details": r.event_details}));
            }
        }
    }
    events.sort_by(|a, b| b["timestamp"].as_str().cmp(&a["timestamp"].as_str()));
    events.truncate(10);
    if events.is_empty() && audit_db.is_none() {
        return Err("none in the Consul outbox; pass --audit-db (or RCFARM_AUDIT_DB) to read shipped events".into());
    }
    Ok(events)
}

/// Polls until the RC runs `replicas` pods, owned, with no transfer in flight.
async fn wait_converged(
    ctx: &Ctx,
    id: &str,
    replicas: u64,
    timeout: Duration,
) -> Result<(), CliError> {
    let started = Instant::now();
    let mut last = String::new();
    loop {
        let ov = ctx.overview().await?;
        let r = ov
            .rc(id)
            .ok_or_else(|| CliError::Failed(format!("replication controller {id} disappeared")))?;
        let line = format!(
            "{}/{} pods{}{}",
            r.current,
            replicas,
            r.owner_farm
                .as_ref()
                .map(|f| format!(", owner {f}"))
                .unwrap_or_else(|| ", no owner yet".into()),
            if r.conditions.is_empty() {
                String::new()
            } else {
                format!(" [{}]", r.conditions.join("; "))
            }
        );
        if line != last && !ctx.json {
            eprintln!("  {line}");
            last = line;
        }
        if r.current as u64 == replicas && r.owner_farm.is_some() && r.transfer.is_none() {
            if !ctx.json {
                eprintln!("converged in {:.1}s", started.elapsed().as_secs_f64());
            }
            return Ok(());
        }
        if started.elapsed() >= timeout {
            return Err(CliError::Failed(format!(
                "not converged after {}s: {}/{} pods. See `rcctl rc show {id}` (is a farm running? are enough nodes labelled?)",
                timeout.as_secs(),
                r.current,
                replicas
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub async fn farms(ctx: &Ctx) -> Result<(), CliError> {
    let ov = ctx.overview().await?;
    if ctx.json {
        return json(&ov.farms);
    }
    if ov.farms.is_empty() {
        println!("no live farms (start one with `rcfarm serve`)");
        return Ok(());
    }
    let mut t = Table::new(&[
        "FARM",
        "HOST",
        "OWNED",
        "FAIR SHARE",
        "RC SELECTOR",
        "HTTP",
        "SESSION",
    ]);
    for f in &ov.farms {
        t.row(vec![
            f.farm_id.clone(),
            f.hostname.clone(),
            f.owned.to_string(),
            f.fair_share.to_string(),
            if f.rc_selector.is_empty() {
                "(all)".into()
            } else {
                f.rc_selector.clone()
            },
            f.http.clone().unwrap_or_else(|| "-".into()),
            f.session.clone(),
        ]);
    }
    t.print();
    let rule = ov.assignment_rule;
    if rule == Rule::HoldersFirst.number() {
        let holding: Vec<&str> = ov
            .farms
            .iter()
            .filter(|f| Rule::from_published(f.assignment_rule) == Rule::HoldersFirst)
            .map(|f| f.farm_id.as_str())
            .collect();
        println!(
            "assignment rule: 1 (holders first; offered by {}: every farm computes rule 2, by score alone, once all are started with --assignment-rule 2)",
            holding.join(", ")
        );
    } else {
        println!("assignment rule: {rule} (by score alone, whoever holds what)");
    }
    // The cluster's removal window: one for every farm (farms of releases before it keep
    // their own and do not charge it).
    if let Ok((Some(kv), _)) = ctx
        .consul
        .kv_get(crate::budget::BUDGET_KEY, &Default::default())
        .await
    {
        match crate::budget::Window::parse(kv.value_bytes()) {
            Ok(w) => println!(
                "cluster removal window: {}",
                w.describe(chrono::Utc::now().timestamp())
            ),
            Err(e) => println!(
                "cluster removal window: unreadable ({e}); removals wait: run `rcctl farm release-removals`"
            ),
        }
    }
    if let Some(note) = super::audit::shipping_note(ctx).await {
        println!("{note}");
    }
    Ok(())
}
