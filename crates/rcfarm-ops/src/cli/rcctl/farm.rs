//! `rcctl farm …`: what operators say to farms.

use chrono::Utc;
use clap::Subcommand;
use serde_json::json;

use super::output::{json, print_txn};
use super::{Ctx, DryRun, consul_failed, rc_actor};
use crate::audit::{AuditRecord, events};
use crate::budget::BUDGET_KEY;
use crate::cli::CliError;
use crate::consul::TxnOp;
use crate::failsafe::{Release, release_key, release_window_op};

#[derive(Debug, Subcommand)]
pub(crate) enum FarmCommand {
    /// Let farms whose removals are held remove again at once: the cluster's removal window
    /// (RemovalsHeld: --max-removals per window is spent, by all farms together) starts
    /// empty, and a pending tripwire confirmation (FailsafeTripped: the RC tree went empty or
    /// all to 0 replicas) ends on the farm named, or on every live farm. Once per call;
    /// audited (REMOVALS_RELEASED, with who and what the window held).
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
    // The cluster's window is written with a `cas`: a farm charging it meanwhile makes the
    // release read it again (its charge is released too).
    for _ in 0..5 {
        let at = Utc::now();
        let (release, spent) = release_window_op(&ctx.consul, &actor)
            .await
            .map_err(consul_failed)?;
        let mut ops = vec![release];
        for f in &farms {
            let rel = Release {
                by: actor.clone(),
                at,
            };
            ops.push(TxnOp::set(release_key(f), rel.to_bytes()));
            ops.push(
                AuditRecord::new(
                    events::REMOVALS_RELEASED,
                    json!({"farm_id": f, "actor": actor, "cluster_removals_released": spent}),
                )
                .txn_op(),
            );
        }
        if dry.dry_run {
            return print_txn(&ops);
        }
        match ctx.consul.txn(&ops).await {
            Err(crate::consul::ConsulError::Conflict(errs))
                if errs.iter().all(|e| e.op_index == 0) =>
            {
                continue;
            }
            r => {
                r.map_err(consul_failed)?;
            }
        }
        if ctx.json {
            return json(
                &json!({"released": farms, "actor": actor, "cluster_removals_released": spent}),
            );
        }
        println!(
            "the cluster's removal window starts empty ({spent} removals in it were released)"
        );
        for f in &farms {
            println!("farm {f}: removals released (a pending failsafe confirmation ends)");
        }
        return Ok(());
    }
    Err(CliError::Failed(format!(
        "{BUDGET_KEY} kept changing under 5 releases in a row (farms are removing pods); nothing written, run it again"
    )))
}
