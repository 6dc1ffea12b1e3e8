//! `rcctl roll …`: rolling updates.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Subcommand;

use super::output::{Table, json, print_txn};
use super::{Ctx, DryRun, consul_failed, rc_actor};
use super::{parse_id, read_manifest};
use crate::cli::{CliError, parse_duration_flag};
use crate::labels::LabelSet;
use crate::overview::{CANARY_CONDITION, RollOverview};
use crate::rc::RcId;
use crate::roll::{
    ControlChange, NewRoll, PauseOutcome, RollControl, RollStore, RollStoreError, StartRoll,
    Update, WrittenRoll,
};

#[derive(Debug, Subcommand)]
pub(crate) enum RollCommand {
    /// Roll an RC onto a new manifest: a new RC like it (its selector, pod labels, strategy
    /// and RC labels) with the manifest and no replicas, and the roll to it, in one
    /// transaction. Prints the roll's id (the new RC's).
    Start {
        /// The RC to roll from.
        rc: String,
        /// The new pod manifest (YAML or JSON; `-` reads standard input).
        #[arg(short = 'f', long = "manifest")]
        manifest: PathBuf,
        #[command(flatten)]
        opts: RollOpts,
        #[command(flatten)]
        wait: WaitOpts,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Roll from one existing RC to another (as `p2-rctl schedule-update`). Prints the roll's
    /// id (the new RC's).
    Create {
        /// The RC giving its replicas up (deleted at the end unless --leave-old).
        #[arg(long)]
        old: String,
        /// The RC taking them.
        #[arg(long)]
        new: String,
        #[command(flatten)]
        opts: RollOpts,
        #[command(flatten)]
        wait: WaitOpts,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Roll an RC back to a revision of its lineage (`rcctl rc history RC`; by default the
    /// latest that was not a failed deploy an auto-revert replaced): an ordinary roll to a new RC with that revision's manifest, node selector and
    /// pod labels, the RC's current replica count, and the minimum and pace of the roll that
    /// replaced the revision (the flags below override them). Prints the roll's id.
    Undo {
        /// The RC to roll back (the head of its lineage).
        rc: String,
        /// The revision to go back to (default: the latest, passing over failed deploys that
        /// were reverted).
        #[arg(long, value_name = "R")]
        to_revision: Option<u64>,
        #[command(flatten)]
        opts: RollOpts,
        #[command(flatten)]
        wait: WaitOpts,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Rolling updates: old → new, their pods, progress, owner farm.
    List,
    /// One rolling update: both RCs' desired, current and healthy pods, and what it waits for.
    Show { id: String },
    /// Delete a rolling update and leave both RCs as they are (the old RC stays disabled if
    /// the roll started: `rcctl rc enable` it to let it act again).
    Abort {
        id: String,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Pause a rolling update: it takes no further step (not even one already planned) and
    /// keeps its RCs and lock as they are, until `rcctl roll resume`.
    Pause {
        id: String,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Resume a paused rolling update, from where its RCs' counts are.
    Resume {
        id: String,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Promote a canary rolling update (`--canary K`): it goes on to the end, with the pace it
    /// was given.
    Promote {
        id: String,
        #[command(flatten)]
        wait: WaitOpts,
        #[command(flatten)]
        dry: DryRun,
    },
}

/// The roll's numbers.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RollOpts {
    /// Replicas the new RC ends with (`roll start`: the old RC's count by default).
    #[arg(long)]
    desired: Option<u64>,
    /// Healthy replicas (old and new together) never to go below; must be below --desired
    /// (`roll start`: one below it by default, so pods are replaced one at a time).
    #[arg(long, conflicts_with = "max_unavailable")]
    minimum: Option<u64>,
    /// The minimum said the other way: at most N pods, or P% of --desired (rounded down),
    /// unavailable at once. Stored as P2's minimum (desired less that).
    #[arg(long, value_name = "N|P%")]
    max_unavailable: Option<String>,
    /// At most N pods replaced per step, even where the minimum would allow more (a minimum
    /// of 0 otherwise replaces every pod at once).
    #[arg(long, value_name = "N")]
    max_parallel: Option<u64>,
    /// Replace K pods first (under the minimum and pace), wait until they run the new
    /// manifest and pass their health checks, then pause until `rcctl roll promote`. With
    /// --wait, rcctl returns once the canary is up.
    #[arg(long, value_name = "K")]
    canary: Option<u64>,
    /// Fail the roll when no new pod becomes up for this long (a terminal state: the farm
    /// takes no further step until `rcctl roll resume` or `abort`). Default: the farm's
    /// --roll-progress-deadline (10m).
    #[arg(long, value_name = "D", value_parser = parse_duration_flag)]
    progress_deadline: Option<Duration>,
    /// Pause before each step once it is safe, so new pods prove themselves.
    #[arg(long, default_value = "0s", value_parser = parse_duration_flag)]
    roll_delay: Duration,
    /// Keep the old RC at the end (it stays disabled, with what replicas it has left).
    #[arg(long)]
    leave_old: bool,
    /// When the roll Fails, the farm rolls back to the old RC itself, under this roll's
    /// minimum and pace (a revert that fails stays Failed). Default: the farm's
    /// --roll-auto-revert; `--auto-revert=false` opts out.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    auto_revert: Option<bool>,
}

/// `--wait`.
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct WaitOpts {
    /// Follow the roll until it completes, showing its progress.
    #[arg(long)]
    wait: bool,
    /// Give up waiting after this long (exit 1; the roll goes on).
    #[arg(long, default_value = "30m", value_parser = parse_duration_flag)]
    timeout: Duration,
}

impl RollOpts {
    /// The roll's minimum from --minimum, or from --max-unavailable of `desired`.
    fn minimum(&self, desired: u64) -> Result<Option<u64>, CliError> {
        let Some(raw) = &self.max_unavailable else {
            return Ok(self.minimum);
        };
        let bad = |why: String| CliError::Usage(format!("--max-unavailable {raw:?}: {why}"));
        let unavailable = match raw.trim().strip_suffix('%') {
            Some(p) => {
                let p: u64 = p
                    .trim()
                    .parse()
                    .map_err(|_| bad("give a number of pods (2) or a percentage (25%)".into()))?;
                if p > 100 {
                    return Err(bad("a percentage of at most 100%".into()));
                }
                desired * p / 100
            }
            None => raw
                .trim()
                .parse()
                .map_err(|_| bad("give a number of pods (2) or a percentage (25%)".into()))?,
        };
        if unavailable == 0 {
            return Err(bad(format!(
                "that is 0 of {desired} pods: the roll could never take a pod down; give at least 1 pod or a larger percentage"
            )));
        }
        Ok(Some(desired.saturating_sub(unavailable)))
    }

    /// The roll's control record: its pace and canary, for a roll to `desired` replicas.
    fn control(&self, desired: u64) -> Result<RollControl, CliError> {
        match self.canary {
            Some(k) if k >= desired => {
                return Err(CliError::Usage(format!(
                    "--canary {k}: a canary must be smaller than the roll's {desired} replicas (it is the part tried first); give 1..{}",
                    desired.saturating_sub(1)
                )));
            }
            _ => {}
        }
        if self.max_parallel == Some(0) {
            return Err(CliError::Usage(
                "--max-parallel 0: the roll could never replace a pod; give at least 1".into(),
            ));
        }
        if self.progress_deadline == Some(Duration::ZERO) {
            return Err(CliError::Usage(
                "--progress-deadline 0s: every roll would fail at once; give a duration like 10m"
                    .into(),
            ));
        }
        Ok(RollControl {
            max_parallel: self.max_parallel,
            progress_deadline: self.progress_deadline.map(crate::util::format_go_duration),
            // `--canary 0` is no canary, as when absent.
            canary: self.canary.filter(|k| *k > 0),
            auto_revert: self.auto_revert,
            ..Default::default()
        })
    }
}

fn roll_failed(e: RollStoreError) -> CliError {
    match e {
        RollStoreError::Consul(c) => consul_failed(c),
        RollStoreError::Refused(why) => {
            CliError::Usage(format!("refusing the rolling update: {why}"))
        }
        RollStoreError::Rc(e) => CliError::Failed(e.to_string()),
        other => CliError::Failed(other.to_string()),
    }
}

pub(crate) async fn run(ctx: &Ctx, cmd: RollCommand) -> Result<(), CliError> {
    let store = RollStore::new(ctx.consul.clone());
    match cmd {
        RollCommand::Start {
            rc,
            manifest,
            opts,
            wait,
            dry,
        } => {
            let old = parse_id(&rc)?;
            let manifest = read_manifest(&manifest)?;
            start(ctx, store, old, manifest, opts, wait, dry).await
        }
        RollCommand::Create {
            old,
            new,
            opts,
            wait,
            dry,
        } => {
            let Some(desired) = opts.desired else {
                return Err(CliError::Usage(
                    "roll create needs --desired N and --minimum M (or --max-unavailable N|P%)"
                        .into(),
                ));
            };
            let Some(minimum) = opts.minimum(desired)? else {
                return Err(CliError::Usage(
                    "roll create needs --minimum M (the minimum below the desired count) or --max-unavailable N|P%".into(),
                ));
            };
            let update = Update {
                old_rc: parse_id(&old)?,
                new_rc: parse_id(&new)?,
                desired_replicas: desired,
                minimum_replicas: minimum,
                leave_old: opts.leave_old,
                roll_delay: opts.roll_delay,
            };
            let w = store
                .with_control(opts.control(desired)?)
                .create(
                    NewRoll {
                        update,
                        labels: LabelSet::new(),
                    },
                    &rc_actor(),
                    dry.dry_run,
                )
                .await
                .map_err(roll_failed)?;
            created(ctx, w, wait).await
        }
        RollCommand::Undo {
            rc,
            to_revision,
            opts,
            wait,
            dry,
        } => undo(ctx, store, &rc, to_revision, opts, wait, dry).await,
        RollCommand::Pause { id, dry } => set_paused(ctx, &store, &id, true, dry).await,
        RollCommand::Resume { id, dry } => set_paused(ctx, &store, &id, false, dry).await,
        RollCommand::Promote { id, wait, dry } => promote(ctx, &store, &id, wait, dry).await,
        RollCommand::List => list(ctx).await,
        RollCommand::Show { id } => show(ctx, &id).await,
        RollCommand::Abort { id, dry } => {
            let id = parse_id(&id)?;
            let w = store
                .abort(id, &rc_actor(), dry.dry_run)
                .await
                .map_err(roll_failed)?;
            if !w.committed {
                return print_txn(&w.ops);
            }
            if ctx.json {
                return json(&serde_json::json!({"aborted": id.to_string()}));
            }
            println!(
                "rolling update {id} aborted; both RCs are left as they are (the old RC {} stays disabled if the roll had started: `rcctl rc enable {}` to let it act again)",
                w.update.old_rc, w.update.old_rc
            );
            Ok(())
        }
    }
}

/// `roll start`, and `rc restart` (the same manifest with a restart key): an ordinary roll of
/// `old` onto `manifest`.
pub(crate) async fn start(
    ctx: &Ctx,
    store: RollStore,
    old: RcId,
    manifest: String,
    opts: RollOpts,
    wait: WaitOpts,
    dry: DryRun,
) -> Result<(), CliError> {
    // The old RC's count, where the roll's options are relative to it.
    let desired = match opts.desired {
        Some(d) => Some(d),
        None if opts.max_unavailable.is_some() || opts.canary.is_some() => Some(
            crate::rc::RcStore::new(ctx.consul.clone())
                .get(old)
                .await
                .map_err(|e| CliError::Failed(e.to_string()))?
                .ok_or_else(|| {
                    CliError::Failed(format!("replication controller {old} does not exist"))
                })?
                .replicas_desired,
        ),
        None => None,
    };
    let minimum = match desired {
        Some(d) => opts.minimum(d)?,
        None => opts.minimum,
    };
    // Without a count here there is no canary (it would have fetched one) to compare with it.
    let control = opts.control(desired.unwrap_or(u64::MAX))?;
    let w = store
        .with_control(control)
        .start(
            StartRoll {
                old_rc: old,
                manifest,
                desired: opts.desired,
                minimum,
                leave_old: opts.leave_old,
                roll_delay: opts.roll_delay,
            },
            &rc_actor(),
            dry.dry_run,
        )
        .await
        .map_err(roll_failed)?;
    created(ctx, w, wait).await
}

/// `roll pause` / `roll resume`.
async fn set_paused(
    ctx: &Ctx,
    store: &RollStore,
    id: &str,
    paused: bool,
    dry: DryRun,
) -> Result<(), CliError> {
    let id = parse_id(id)?;
    let outcome = match store.set_paused(id, paused, &rc_actor(), dry.dry_run).await {
        Err(RollStoreError::NotFound(_)) => {
            return Err(CliError::Usage(format!(
                "no rolling update {id}: it finished, was aborted or never existed (rcctl roll list; rcctl audit --type ROLLING_UPDATE_COMPLETION)"
            )));
        }
        other => other.map_err(roll_failed)?,
    };
    match outcome {
        PauseOutcome::Written(w) if !w.committed => print_txn(&w.ops),
        PauseOutcome::Written(_) if ctx.json => {
            json(&serde_json::json!({"id": id.to_string(), "paused": paused, "changed": true}))
        }
        PauseOutcome::Written(_) => {
            if paused {
                println!(
                    "rolling update {id} paused: it takes no further step until `rcctl roll resume {id}`"
                );
            } else {
                println!(
                    "rolling update {id} resumed (a failure, if it had failed, is cleared: its deadline starts again)"
                );
            }
            Ok(())
        }
        PauseOutcome::Unchanged(c) if ctx.json => json(&serde_json::json!({
            "id": id.to_string(), "paused": paused, "changed": false,
            "paused_by": c.paused_by,
        })),
        PauseOutcome::Unchanged(c) => {
            if paused {
                println!(
                    "rolling update {id} is already {}; nothing written",
                    c.describe()
                );
            } else {
                println!("rolling update {id} is neither paused nor failed; nothing written");
            }
            Ok(())
        }
    }
}

/// `roll promote`.
async fn promote(
    ctx: &Ctx,
    store: &RollStore,
    id: &str,
    wait: WaitOpts,
    dry: DryRun,
) -> Result<(), CliError> {
    let id = parse_id(id)?;
    let outcome = match store
        .change_control(id, ControlChange::Promote, &rc_actor(), dry.dry_run)
        .await
    {
        Err(RollStoreError::NotFound(_)) => {
            return Err(CliError::Usage(format!(
                "no rolling update {id}: it finished, was aborted or never existed (rcctl roll list)"
            )));
        }
        Err(RollStoreError::Refused(why)) => return Err(CliError::Usage(why)),
        other => other.map_err(roll_failed)?,
    };
    let update = match outcome {
        PauseOutcome::Written(w) if !w.committed => return print_txn(&w.ops),
        PauseOutcome::Written(w) => {
            if ctx.json && !wait.wait {
                return json(
                    &serde_json::json!({"id": id.to_string(), "promoted": true, "changed": true}),
                );
            }
            println!("rolling update {id} promoted: it goes on to the end");
            w.update
        }
        PauseOutcome::Unchanged(c) => {
            if ctx.json && !wait.wait {
                return json(
                    &serde_json::json!({"id": id.to_string(), "promoted": true, "changed": false, "promoted_by": c.promoted_by}),
                );
            }
            println!(
                "rolling update {id} was already promoted by {}; nothing written",
                c.promoted_by.as_deref().unwrap_or("?")
            );
            if !wait.wait {
                return Ok(());
            }
            let roll = store
                .list()
                .await
                .map_err(roll_failed)?
                .rolls
                .get(&id)
                .cloned()
                .ok_or_else(|| CliError::Failed(format!("rolling update {id} is gone")))?;
            roll.update.clone()
        }
    };
    if wait.wait {
        follow(ctx, id, &update, wait.timeout).await?;
    }
    Ok(())
}

async fn created(ctx: &Ctx, w: WrittenRoll, wait: WaitOpts) -> Result<(), CliError> {
    if !w.committed {
        return print_txn(&w.ops);
    }
    let id = w.update.id();
    if ctx.json && !wait.wait {
        return json(&serde_json::json!({
            "id": id.to_string(),
            "old_rc": w.update.old_rc.to_string(),
            "new_rc": w.update.new_rc.to_string(),
            "desired_replicas": w.update.desired_replicas,
            "minimum_replicas": w.update.minimum_replicas,
        }));
    }
    println!("{id}");
    if wait.wait {
        follow(ctx, id, &w.update, wait.timeout).await?;
    }
    Ok(())
}

/// The rolls, with what each owning farm says about the ones it carries out.
async fn load(ctx: &Ctx) -> Result<Vec<RollOverview>, CliError> {
    let mut rolls = crate::overview::load_rolls(&ctx.consul)
        .await
        .map_err(consul_failed)?;
    let farms = ctx.overview_farms().await?;
    for f in farms {
        let Some(base) = f.http.as_deref() else {
            continue;
        };
        if !rolls
            .iter()
            .any(|r| r.owner_session.as_deref() == Some(f.session.as_str()))
        {
            continue;
        }
        let Some(body) = ctx.farm_get(&format!("{base}/v1/rolls")).await else {
            continue;
        };
        for remote in body["rolls"].as_array().into_iter().flatten() {
            let Ok(theirs) = serde_json::from_value::<RemoteRoll>(remote.clone()) else {
                continue;
            };
            if let Some(r) = rolls.iter_mut().find(|r| {
                r.id == theirs.id && r.owner_session.as_deref() == Some(f.session.as_str())
            }) {
                r.waiting = theirs.waiting;
                r.steps = theirs.steps;
                for c in theirs.conditions {
                    if !r.conditions.contains(&c) {
                        r.conditions.push(c);
                    }
                }
            }
        }
    }
    Ok(rolls)
}

/// The parts of a farm's `/v1/rolls` entry that only the owner knows.
#[derive(serde::Deserialize)]
struct RemoteRoll {
    id: String,
    waiting: Option<String>,
    steps: Option<u64>,
    #[serde(default)]
    conditions: Vec<String>,
}

/// `[#####-----] 50%`.
pub(crate) fn bar(progress: f64) -> String {
    let filled = (progress.clamp(0.0, 1.0) * 20.0).round() as usize;
    format!(
        "[{}{}] {:>3.0}%",
        "#".repeat(filled),
        "-".repeat(20 - filled),
        progress * 100.0
    )
}

fn counts(c: &Option<crate::roll::RcCounts>) -> String {
    match c {
        Some(c) => format!("{}/{}/{}", c.desired, c.current, c.healthy),
        None => "-".into(),
    }
}

async fn list(ctx: &Ctx) -> Result<(), CliError> {
    let rolls = load(ctx).await?;
    if ctx.json {
        return json(&serde_json::json!({"rolls": rolls}));
    }
    if rolls.is_empty() {
        println!("no rolling updates (start one: rcctl roll start RC -f new-manifest.yaml)");
        return Ok(());
    }
    let mut t = Table::new(&[
        "ID",
        "POD",
        "OLD D/C/H",
        "NEW D/C/H",
        "TARGET/MIN",
        "PROGRESS",
        "OWNER",
        "STATE",
    ]);
    for r in &rolls {
        t.row(vec![
            r.id.clone(),
            r.pod_id.clone().unwrap_or_else(|| "-".into()),
            counts(&r.old),
            counts(&r.new),
            format!("{}/{}", r.desired_replicas, r.minimum_replicas),
            bar(r.progress),
            r.owner_farm.clone().unwrap_or_else(|| "-".into()),
            state(r),
        ]);
    }
    t.print();
    println!("(D/C/H: desired, current, healthy pods)");
    Ok(())
}

fn state(r: &RollOverview) -> String {
    let mut parts = r.conditions.clone();
    if let Some(w) = &r.waiting {
        parts.push(format!("waiting: {w}"));
    }
    if parts.is_empty() {
        "rolling".into()
    } else {
        parts.join("; ")
    }
}

async fn show(ctx: &Ctx, id: &str) -> Result<(), CliError> {
    let id = parse_id(id)?;
    let rolls = load(ctx).await?;
    let Some(r) = rolls.iter().find(|r| r.id == id.to_string()) else {
        return Err(CliError::Failed(format!(
            "rolling update {id} does not exist (see `rcctl roll list`; a completed roll is gone, its record is in `rcctl audit --type ROLLING_UPDATE_COMPLETION`)"
        )));
    };
    if ctx.json {
        return json(r);
    }
    let rc = |x: &Option<String>| x.clone().unwrap_or_else(|| "-".into());
    println!("Rolling update  {}", r.id);
    println!("Pod             {}", rc(&r.pod_id));
    println!("Old RC          {}", rc(&r.old_rc));
    println!("New RC          {}", rc(&r.new_rc));
    println!(
        "Target          {} replicas, at least {} healthy throughout{}{}",
        r.desired_replicas,
        r.minimum_replicas,
        if r.roll_delay != "0s" {
            format!(", {} between steps", r.roll_delay)
        } else {
            String::new()
        },
        if r.leave_old {
            ", old RC kept at the end"
        } else {
            ", old RC deleted at the end"
        }
    );
    let mut t = Table::new(&["RC", "DESIRED", "CURRENT", "REAL", "HEALTHY"]);
    for (name, c) in [("old", &r.old), ("new", &r.new)] {
        match c {
            Some(c) => t.row(vec![
                format!("{name}{}", if c.disabled { " (disabled)" } else { "" }),
                c.desired.to_string(),
                c.current.to_string(),
                c.real.to_string(),
                c.healthy.to_string(),
            ]),
            None => t.row(vec![
                name.into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]),
        }
    }
    t.print();
    println!("(real: pods whose node runs the RC's manifest, per reality/)");
    println!("Progress        {}", bar(r.progress));
    if let Some(s) = r.steps {
        println!("Steps           {s} (by the farm carrying it out)");
    }
    println!(
        "Owner           {}",
        r.owner_farm
            .clone()
            .unwrap_or_else(|| "none (no farm has claimed it yet)".into())
    );
    if let Some(w) = &r.waiting {
        println!("Waiting for     {w}");
    }
    for c in &r.conditions {
        println!("Condition       {c}");
    }
    Ok(())
}

/// Shows the roll's progress until its record is gone, then how it ended.
async fn follow(ctx: &Ctx, id: RcId, u: &Update, timeout: Duration) -> Result<(), CliError> {
    let started = Instant::now();
    let mut last = String::new();
    loop {
        let rolls = load(ctx).await?;
        let Some(r) = rolls.iter().find(|r| r.id == id.to_string()) else {
            return finished(ctx, id, u, started).await;
        };
        let line = format!(
            "{} old {} new {}{}",
            bar(r.progress),
            counts(&r.old),
            counts(&r.new),
            match state(r).as_str() {
                "rolling" => String::new(),
                s => format!("  {s}"),
            }
        );
        if line != last {
            eprintln!("  {line}");
            last = line;
        }
        // A canary that is up waits for a person: following it further would only time out.
        if r.conditions.iter().any(|c| c.starts_with(CANARY_CONDITION)) {
            if ctx.json {
                return json(
                    &serde_json::json!({"id": id.to_string(), "complete": false, "canary_up": true, "seconds": started.elapsed().as_secs_f64()}),
                );
            }
            eprintln!(
                "canary up after {:.1}s: rolling update {id} is paused until `rcctl roll promote {id}` (or `rcctl roll abort {id}`)",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        if let Some(f) = r.conditions.iter().find(|c| c.starts_with("Failed")) {
            return Err(CliError::RollFailed(format!(
                "rolling update {id} {}; it takes no further step: `rcctl roll resume {id}` gives it another deadline, `rcctl roll abort {id}` ends it",
                f.replacen("Failed: ", "failed: ", 1)
            )));
        }
        if started.elapsed() >= timeout {
            return Err(CliError::Failed(format!(
                "the rolling update is not done after {}s (it goes on): see `rcctl roll show {id}`",
                timeout.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// How a followed roll ended: complete (the new RC has its replicas; the old RC is gone
/// unless kept), or aborted.
async fn finished(ctx: &Ctx, id: RcId, u: &Update, started: Instant) -> Result<(), CliError> {
    let store = crate::rc::RcStore::new(ctx.consul.clone());
    let new = store.get(u.new_rc).await.ok().flatten();
    let old = store.get(u.old_rc).await.ok().flatten();
    let complete = new
        .as_ref()
        .is_some_and(|n| n.replicas_desired >= u.desired_replicas)
        && (u.leave_old || old.is_none());
    let reverted = !complete && reverted(ctx, id, u).await;
    if ctx.json {
        return json(
            &serde_json::json!({"id": id.to_string(), "complete": complete, "reverted": reverted, "seconds": started.elapsed().as_secs_f64()}),
        );
    }
    if reverted {
        return Err(CliError::RollFailed(format!(
            "rolling update {id} failed and its farm reverted it: rolling update {old} rolls back to the old RC {old} under the same minimum and pace (rcctl roll show {old}; rcctl audit --type ROLLING_UPDATE_REVERTED)",
            old = u.old_rc
        )));
    }
    if complete {
        eprintln!(
            "rolling update complete in {:.1}s{}",
            started.elapsed().as_secs_f64(),
            if u.leave_old {
                ""
            } else {
                "; the old RC is deleted"
            }
        );
        Ok(())
    } else {
        Err(CliError::Failed(format!(
            "rolling update {id} ended without completing (aborted?): see `rcctl audit --type ROLLING_UPDATE_COMPLETION`"
        )))
    }
}

/// Whether a roll that ended without completing was reverted by its farm: its revert (the
/// roll named by the old RC) is under way, or has completed (the failed RC is then a revision
/// of the old RC's lineage).
async fn reverted(ctx: &Ctx, id: RcId, u: &Update) -> bool {
    let Ok(found) = ctx
        .consul
        .read_keys(&[
            crate::roll::control_key(u.old_rc),
            crate::roll::history_key(u.old_rc),
        ])
        .await
    else {
        return false;
    };
    let revert_under_way = found
        .get(&crate::roll::control_key(u.old_rc))
        .and_then(|kv| RollControl::parse(kv.value_bytes()).ok())
        .is_some_and(|c| c.revert_of == Some(id));
    let revert_done = found
        .get(&crate::roll::history_key(u.old_rc))
        .and_then(|kv| crate::roll::History::parse(kv.value_bytes()).ok())
        .is_some_and(|h| h.revisions.iter().any(|r| r.rc_id == u.new_rc));
    revert_under_way || revert_done
}

/// `rcctl roll undo`: checks everything before writing anything (no history, no such
/// revision, an RC already in a roll are usage mistakes).
async fn undo(
    ctx: &Ctx,
    store: RollStore,
    rc: &str,
    to_revision: Option<u64>,
    opts: RollOpts,
    wait: WaitOpts,
    dry: DryRun,
) -> Result<(), CliError> {
    let id = parse_id(rc)?;
    let current = crate::rc::RcStore::new(ctx.consul.clone())
        .get(id)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?
        .ok_or_else(|| {
            CliError::Usage(format!(
                "replication controller {id} does not exist (see `rcctl rc list`): nothing to undo"
            ))
        })?;
    let history = store.history(id).await.map_err(roll_failed)?;
    let Some(history) = history.filter(|h| !h.revisions.is_empty()) else {
        return Err(CliError::Usage(format!(
            "RC {id} has no revision history, nothing to undo: no roll onto it has completed under rcfarm (rolls completed by P2's own farm leave none); roll it explicitly with `rcctl roll start {id} -f MANIFEST`"
        )));
    };
    let rev = match to_revision {
        None => {
            let Some(rev) = history.undo_target() else {
                return Err(CliError::Usage(format!(
                    "RC {id}'s only revisions are deploys that failed and were reverted ({}): nothing to go back to by default; pick one with --to-revision R (rcctl rc history {id})",
                    history.numbers()
                )));
            };
            Some(rev)
        }
        Some(r) => history.get(r),
    };
    let Some(rev) = rev.cloned() else {
        return Err(CliError::Usage(format!(
            "RC {id} has no revision {}; its revisions are {} (rcctl rc history {id})",
            to_revision.unwrap_or_default(),
            history.numbers()
        )));
    };
    let desired = opts.desired.unwrap_or(current.replicas_desired);
    if desired == 0 {
        return Err(CliError::Usage(format!(
            "RC {id} wants 0 replicas: a roll moves replicas; give --desired N (or scale it first)"
        )));
    }
    let minimum = if opts.minimum.is_some() || opts.max_unavailable.is_some() {
        opts.minimum(desired)?
    } else {
        // As many pods unavailable at once as under the roll that replaced the revision.
        let unavailable = rev
            .desired_replicas
            .saturating_sub(rev.minimum_replicas)
            .max(1);
        Some(desired.saturating_sub(unavailable))
    };
    let mut control = opts.control(desired)?;
    control.max_parallel = control.max_parallel.or(rev.max_parallel);
    control.progress_deadline = control
        .progress_deadline
        .or_else(|| rev.progress_deadline.clone());
    let req = StartRoll {
        old_rc: id,
        manifest: rev.manifest.clone(),
        desired: Some(desired),
        minimum,
        leave_old: opts.leave_old,
        roll_delay: opts.roll_delay,
    };
    let w = store
        .with_control(control)
        .start_shaped(
            req,
            Some((rev.node_selector.clone(), rev.pod_labels.clone())),
            &rc_actor(),
            dry.dry_run,
        )
        .await
        .map_err(|e| match e {
            e @ RollStoreError::Conflict { .. } => CliError::Usage(e.to_string()),
            e => roll_failed(e),
        })?;
    if w.committed && !ctx.json {
        eprintln!(
            "rolling RC {id} back to revision {} (the manifest of RC {}, replaced {} by rolling update {}), {} replicas, at least {} healthy throughout",
            rev.revision,
            rev.rc_id,
            rev.replaced_at.format("%Y-%m-%dT%H:%M:%SZ"),
            rev.roll,
            w.update.desired_replicas,
            w.update.minimum_replicas
        );
    }
    created(ctx, w, wait).await
}

/// `rcctl rc history RC`.
pub(crate) async fn history(ctx: &Ctx, rc: &str) -> Result<(), CliError> {
    let id = parse_id(rc)?;
    let store = RollStore::new(ctx.consul.clone());
    let history = store
        .history(id)
        .await
        .map_err(roll_failed)?
        .unwrap_or_default();
    if history.revisions.is_empty() {
        let exists = crate::rc::RcStore::new(ctx.consul.clone())
            .get(id)
            .await
            .map_err(|e| CliError::Failed(e.to_string()))?
            .is_some();
        if !exists {
            return Err(CliError::Failed(format!(
                "replication controller {id} does not exist and has no revision history (see `rcctl rc list`)"
            )));
        }
    }
    if ctx.json {
        return json(&serde_json::json!({"rc": id.to_string(), "revisions": history.revisions}));
    }
    if history.revisions.is_empty() {
        println!(
            "RC {id} has no revisions: no roll onto it has completed under rcfarm (rolls completed by P2's own farm leave none)"
        );
        return Ok(());
    }
    let mut t = Table::new(&[
        "REVISION",
        "REPLACED AT",
        "RC",
        "BY",
        "ROLL",
        "REPLICAS/MIN",
        "MANIFEST",
    ]);
    for r in &history.revisions {
        t.row(vec![
            r.revision.to_string(),
            r.replaced_at.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
            r.rc_id.to_string(),
            match (&r.by, r.reverted) {
                (by, true) => format!("{} (failed, reverted)", by.as_deref().unwrap_or("-")),
                (Some(by), false) => by.clone(),
                (None, false) => "-".into(),
            },
            r.roll.to_string(),
            format!("{}/{}", r.replicas, r.minimum_replicas),
            manifest_summary(&r.manifest),
        ]);
    }
    t.print();
    println!("(roll back: rcctl roll undo {id} [--to-revision R])");
    Ok(())
}

/// A manifest in a few characters: its digest's start and its first launchable's artifact.
fn manifest_summary(raw: &str) -> String {
    let Ok(m) = crate::rc::Manifest::parse(raw) else {
        return "(unreadable manifest)".into();
    };
    let digest = &m.digest()[..12.min(m.digest().len())];
    let first = serde_yaml_ng::from_str::<serde_json::Value>(raw)
        .ok()
        .and_then(|v| {
            let (name, l) = v.get("launchables")?.as_object()?.iter().next()?;
            let what = l
                .get("location")
                .and_then(|x| x.as_str())
                .map(|loc| loc.rsplit('/').next().unwrap_or(loc).to_string())
                .or_else(|| l.get("version").map(|v| v.to_string()))
                .unwrap_or_default();
            Some(format!("{name}: {what}"))
        });
    match first {
        Some(f) => format!("{digest} {f}"),
        None => digest.to_string(),
    }
}
