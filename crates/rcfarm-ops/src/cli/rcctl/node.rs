//! `rcctl node …`.

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
            if ctx.json {
                let v: Vec<_> = nodes
                    .iter()
                    .map(|(n, l)| json!({"node": n, "labels": l}))
                    .collect();
                return json(&v);
            }
            let mut t = Table::new(&["NODE", "LABELS"]);
            for (n, l) in &nodes {
                t.row(vec![
                    n.clone(),
                    l.iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(","),
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
            Ok(())
        }
    }
}
