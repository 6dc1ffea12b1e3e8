//! `rcctl farm …`: what operators say to farms.

use chrono::Utc;
use clap::Subcommand;
use serde_json::json;

use super::output::{json, print_txn};
use super::{Ctx, DryRun, consul_failed, rc_actor};
use crate::audit::{AuditRecord, events};
use crate::cli::CliError;
use crate::consul::TxnOp;
use crate::failsafe::{Release, release_key};

#[derive(Debug, Subcommand)]
pub(crate) enum FarmCommand {
    /// Let a farm whose removals are held (RemovalsHeld: its --max-removals per window is
    /// spent, or FailsafeTripped: the RC tree went empty or all to 0 replicas) remove again at
    /// once: its removal window starts empty and a pending confirmation ends. Once per call;
    /// audited (REMOVALS_RELEASED, with who).
    ReleaseRemovals {
        /// The farm (its --farm-id); every live farm when absent.
        farm: Option<String>,
        #[command(flatten)]
        dry: DryRun,
    },
}

pub(crate) async fn run(ctx: &Ctx, c: FarmCommand) -> Result<(), CliError> {
    match c {
        FarmCommand::ReleaseRemovals { farm, dry } => release(ctx, farm, dry).await,
    }
}

async fn release(ctx: &Ctx, farm: Option<String>, dry: DryRun) -> Result<(), CliError> {
    if let Some(f) = &farm
        && (f.is_empty() || f.contains(['/', ' ']))
    {
        return Err(CliError::Usage(format!(
            "{f:?} is not a farm id (farm ids have no '/' or spaces); `rcctl farms` lists the live ones"
        )));
    }
    let live: Vec<String> = ctx
        .overview_farms()
        .await?
        .into_iter()
        .map(|f| f.farm_id)
        .collect();
    let farms = match farm {
        Some(f) if live.contains(&f) => vec![f],
        Some(f) => {
            return Err(CliError::Usage(format!(
                "no live farm {f:?} (live: {}); nothing written",
                if live.is_empty() {
                    "none".to_string()
                } else {
                    live.join(", ")
                }
            )));
        }
        None if live.is_empty() => {
            return Err(CliError::Failed(
                "no farm is live: there is nothing to release".into(),
            ));
        }
        None => {
            let mut l = live;
            l.sort();
            l.dedup();
            l
        }
    };
    let actor = rc_actor();
    let at = Utc::now();
    let mut ops = Vec::new();
    for f in &farms {
        let rel = Release {
            by: actor.clone(),
            at,
        };
        ops.push(TxnOp::set(release_key(f), rel.to_bytes()));
        ops.push(
            AuditRecord::new(
                events::REMOVALS_RELEASED,
                json!({"farm_id": f, "actor": actor}),
            )
            .txn_op(),
        );
    }
    if dry.dry_run {
        return print_txn(&ops);
    }
    ctx.consul.txn(&ops).await.map_err(consul_failed)?;
    if ctx.json {
        return json(&json!({"released": farms, "actor": actor}));
    }
    for f in &farms {
        println!(
            "farm {f}: removals released (its removal window starts empty; a pending failsafe confirmation ends)"
        );
    }
    Ok(())
}
