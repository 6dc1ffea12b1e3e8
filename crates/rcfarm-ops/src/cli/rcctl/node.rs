//! `rcctl node …`.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;

use super::output::{Table, json, print_txn};
use super::{Ctx, NodeCommand, consul_failed};
use crate::audit::{AuditRecord, events};
use crate::cli::CliError;
use crate::consul::TxnFailure;
use crate::labels::{LabelSet, LabelStore, LabelType, Selector};

/// Splits `k=v` (set) and `k-` (remove) arguments.
fn parse_changes(changes: &[String]) -> Result<(LabelSet, Vec<String>), CliError> {
    let mut set = LabelSet::new();
    let mut remove = Vec::new();
    for c in changes {
        if let Some(k) = c.strip_suffix('-').filter(|k| !k.contains('=')) {
            remove.push(k.to_string());
        } else {
            set.extend(super::output::parse_pairs(
                std::slice::from_ref(c),
                "label",
            )?);
        }
    }
    Ok((set, remove))
}

pub async fn run(ctx: &Ctx, cmd: NodeCommand) -> Result<(), CliError> {
    match cmd {
        NodeCommand::Label { node, changes, dry } => {
            if node.is_empty() || node.contains('/') {
                return Err(CliError::Usage(format!(
                    "node name {node:?}: use a name without '/'"
                )));
            }
            let (set, remove) = parse_changes(&changes)?;
            let store = LabelStore::new(ctx.consul.clone());
            for _ in 0..5 {
                let (current, index) = store
                    .get(LabelType::Node, &node)
                    .await
                    .map_err(|e| CliError::Failed(e.to_string()))?;
                let audit = AuditRecord::new(
                    events::NODE_LABELS_CHANGED,
                    json!({"node": node, "set": set, "removed": remove, "actor": super::rc_actor()}),
                );
                let ops = vec![
                    LabelStore::apply_op(LabelType::Node, &node, &current, index, &set, &remove),
                    audit.txn_op(),
                ];
                if dry.dry_run {
                    return print_txn(&ops);
                }
                match ctx.consul.txn(&ops).await {
                    Ok(_) => {
                        let mut now = current.clone();
                        for k in &remove {
                            now.remove(k);
                        }
                        now.extend(set.clone());
                        if ctx.json {
                            return json(&json!({"node": node, "labels": now}));
                        }
                        println!(
                            "{node} labelled: {}",
                            if now.is_empty() {
                                "(no labels)".to_string()
                            } else {
                                now.iter()
                                    .map(|(k, v)| format!("{k}={v}"))
                                    .collect::<Vec<_>>()
                                    .join(",")
                            }
                        );
                        return Ok(());
                    }
                    Err(e) if e.failed_at(0, TxnFailure::IndexStale) => continue,
                    Err(e) => return Err(consul_failed(e)),
                }
            }
            Err(CliError::Failed(format!(
                "the labels of {node} kept changing; try again"
            )))
        }
        NodeCommand::List { selector } => {
            let sel =
                Selector::parse(&selector).map_err(|e| CliError::Usage(format!("-l: {e}")))?;
            let nodes = crate::overview::nodes(&ctx.consul, &sel)
                .await
                .map_err(consul_failed)?;
            let ov = crate::overview::Overview::load(&ctx.consul)
                .await
                .map_err(consul_failed)?;
            // node → (pod id, RC id, whether the RC is gone).
            let mut pods: BTreeMap<String, Vec<(String, String, bool)>> = BTreeMap::new();
            for r in &ov.rcs {
                for n in &r.nodes {
                    pods.entry(n.clone()).or_default().push((
                        r.pod_id.clone().unwrap_or_else(|| "?".into()),
                        r.id.clone(),
                        false,
                    ));
                }
            }
            for o in &ov.orphans {
                pods.entry(o.node.clone()).or_default().push((
                    o.pod_id.clone(),
                    o.rc_id.clone(),
                    true,
                ));
            }
            let mut rows: Vec<(String, LabelSet)> = nodes;
            if selector.is_empty() {
                // A node whose labels are gone still runs what it runs.
                let labelled: BTreeSet<String> = rows.iter().map(|(n, _)| n.clone()).collect();
                rows.extend(
                    pods.keys()
                        .filter(|n| !labelled.contains(*n))
                        .map(|n| (n.clone(), LabelSet::new()))
                        .collect::<Vec<_>>(),
                );
                rows.sort_by(|a, b| a.0.cmp(&b.0));
            }
            let pods_on = |n: &str| pods.get(n).cloned().unwrap_or_default();
            if ctx.json {
                let v: Vec<_> = rows
                    .iter()
                    .map(|(n, l)| {
                        let p: Vec<_> = pods_on(n)
                            .into_iter()
                            .map(|(pod, rc, orphaned)| {
                                json!({"pod_id": pod, "rc_id": rc, "orphaned": orphaned})
                            })
                            .collect();
                        json!({"node": n, "labels": l, "pods": p})
                    })
                    .collect();
                return json(&v);
            }
            let mut t = Table::new(&["NODE", "LABELS", "PODS"]);
            for (n, l) in &rows {
                t.row(vec![
                    n.clone(),
                    l.iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(","),
                    pods_on(n)
                        .into_iter()
                        .map(|(pod, rc, orphaned)| {
                            if orphaned {
                                format!("{pod} ORPHANED (its RC {rc} is gone)")
                            } else {
                                format!("{pod} ({})", &rc[..rc.len().min(8)])
                            }
                        })
                        .collect::<Vec<_>>()
                        .join(", "),
                ]);
            }
            if t.is_empty() {
                println!(
                    "no nodes{} (label one with `rcctl node label NODE key=value`)",
                    if selector.is_empty() {
                        String::new()
                    } else {
                        format!(" match {selector:?}")
                    }
                );
            } else {
                t.print();
            }
            if !ov.orphans.is_empty() {
                println!(
                    "{} pod{} ORPHANED: {} RC is gone (deleted with --force, by P2's CLI or a KV write), and nothing removes {}",
                    ov.orphans.len(),
                    if ov.orphans.len() == 1 { "" } else { "s" },
                    if ov.orphans.len() == 1 {
                        "its"
                    } else {
                        "their"
                    },
                    if ov.orphans.len() == 1 { "it" } else { "them" },
                );
            }
            Ok(())
        }
    }
}
