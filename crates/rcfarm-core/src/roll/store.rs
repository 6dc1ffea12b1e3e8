//! The roll store over `rolls/<new-rc-id>`: list, watch, create (as P2's rollstore does,
//! under the RCs' `update_creation` locks, refusing RCs already in a roll), start (a new RC
//! from an old one and a roll, in one transaction), and abort.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::control::{RollControl, control_key};
use super::history::{History, history_key};
use super::record::{InvalidRoll, ROLL_PREFIX, Roll, RollId, Update, roll_id_from_key, roll_key};
use crate::audit::{AuditRecord, events};
use crate::consul::{
    Consul, ConsulError, DerivedWatch, KvEntry, QueryOptions, SessionBehavior, SessionRequest,
    TxnFailure, TxnOp, WatchConfig,
};
use crate::labels::{LabelSet, LabelStore, LabelType};
use crate::rc::{AllocationStrategy, NewRc, POD_ID_LABEL, Rc, RcId, RcStore, RcStoreError};

/// P2's pod-cluster labels, put on the roll (P2's RU completion record reads them back).
const AVAILABILITY_ZONE: &str = "availability_zone";
const CLUSTER_NAME: &str = "cluster_name";

#[derive(Debug, thiserror::Error)]
pub enum RollStoreError {
    #[error(transparent)]
    Consul(#[from] ConsulError),
    #[error(transparent)]
    Rc(#[from] RcStoreError),
    #[error("replication controller {0} does not exist")]
    RcNotFound(RcId),
    #[error("rolling update {0} does not exist")]
    NotFound(RollId),
    #[error("refusing the rolling update: {0}")]
    Refused(String),
    #[error(
        "RC {rc} is already in rolling update {roll} ({old} → {new}); wait for it to finish or abort it (rcctl roll abort {roll})"
    )]
    Conflict {
        rc: RcId,
        roll: RollId,
        old: RcId,
        new: RcId,
    },
    #[error(
        "RC {rc} is being put into another rolling update right now (its update_creation lock is held by session {session} \"{name}\"); try again in a moment. A creator that died frees it when its session expires"
    )]
    CreationLocked {
        rc: RcId,
        session: String,
        name: String,
    },
    #[error(
        "the rolling update kept changing while this was written; look at it again (rcctl roll show {0})"
    )]
    Changed(RollId),
}

/// Valid rolls and the invalid records beside them.
#[derive(Debug, Clone, Default)]
pub struct RollListing {
    pub index: u64,
    pub rolls: BTreeMap<RollId, Arc<Roll>>,
    pub invalid: BTreeMap<String, InvalidRoll>,
}

impl RollListing {
    /// The roll an RC takes part in, if any (as old or new RC).
    pub fn roll_of(&self, rc: RcId) -> Option<&Arc<Roll>> {
        self.rolls
            .values()
            .find(|r| r.update.old_rc == rc || r.update.new_rc == rc)
    }

    /// Why a roll must wait for another that shares one of its RCs, if it must: of rolls
    /// sharing an RC (only possible when written by hand), the one created first goes first.
    pub fn conflict(&self, roll: &Roll) -> Option<String> {
        let mine = [roll.update.old_rc, roll.update.new_rc];
        self.rolls
            .values()
            .filter(|o| o.id() != roll.id())
            .filter(|o| (o.create_index, o.id()) < (roll.create_index, roll.id()))
            .find_map(|o| {
                let shared = [o.update.old_rc, o.update.new_rc]
                    .into_iter()
                    .find(|rc| mine.contains(rc))?;
                Some(format!(
                    "shares RC {shared} with rolling update {} ({}), which goes first",
                    o.id(),
                    o
                ))
            })
    }
}

/// Parses a snapshot of the roll tree, reusing the previous listing's parse of unchanged keys.
pub fn parse_roll_listing<E: KvEntry>(
    index: u64,
    entries: impl IntoIterator<Item = E>,
    prev: Option<&RollListing>,
) -> RollListing {
    let mut listing = RollListing {
        index,
        ..Default::default()
    };
    for e in entries {
        let (key, modify_index) = (e.key(), e.modify_index());
        if let Some(prev) = prev {
            if let Some(Ok(id)) = roll_id_from_key(key)
                && let Some(r) = prev.rolls.get(&id)
                && r.modify_index == modify_index
            {
                listing.rolls.insert(id, r.clone());
                continue;
            }
            if let Some(inv) = prev.invalid.get(key)
                && inv.modify_index == modify_index
            {
                listing.invalid.insert(key.to_string(), inv.clone());
                continue;
            }
        }
        match Roll::from_kv(key, &e.value(), modify_index, e.create_index()) {
            Ok(r) => {
                listing.rolls.insert(r.id(), Arc::new(r));
            }
            Err(inv) => {
                listing.invalid.insert(key.to_string(), inv);
            }
        }
    }
    listing
}

/// The roll tree, watched with one blocking query.
pub type RollWatch = DerivedWatch<RollListing>;

/// A rolling update to create between two existing RCs (`p2-rctl schedule-update`).
#[derive(Debug, Clone)]
pub struct NewRoll {
    pub update: Update,
    /// Labels of the roll itself (P2 puts the pod cluster's there); the new RC's pod id and
    /// pod-cluster labels are added.
    pub labels: LabelSet,
}

/// A rolling update that replaces an RC's manifest: a new RC like the old one (its selector,
/// pod labels, strategy and own labels) with the new manifest and no replicas, and the roll.
#[derive(Debug, Clone)]
pub struct StartRoll {
    pub old_rc: RcId,
    pub manifest: String,
    /// Replicas the new RC ends with; the old RC's count when `None`.
    pub desired: Option<u64>,
    /// Healthy replicas to keep; one below the desired count when `None`.
    pub minimum: Option<u64>,
    pub leave_old: bool,
    pub roll_delay: Duration,
}

/// What a creation wrote (or, for a dry run, would write).
#[derive(Debug, Clone)]
pub struct WrittenRoll {
    pub update: Update,
    pub ops: Vec<TxnOp>,
    pub committed: bool,
}

/// What an operator changes about a roll (`rcctl roll pause|resume|promote`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlChange {
    Pause,
    /// Ends a pause and a failure.
    Resume,
    /// Lets a canary roll go on to the end.
    Promote,
}

/// What `RollStore::change_control` found or did.
#[derive(Debug, Clone)]
pub enum PauseOutcome {
    /// Written (or, on a dry run, the transaction that would be).
    Written(WrittenRoll),
    /// Already as asked; nothing written. The control, for the message.
    Unchanged(RollControl),
}

/// Reads and writes rolls.
#[derive(Debug, Clone)]
pub struct RollStore {
    consul: Consul,
    /// What a roll created by this store starts with at `rcfarm/rolls/<id>` (its pace).
    control: RollControl,
}

/// The creation session's id in a dry run's printed transaction.
const DRY_RUN_SESSION: &str = "<creation-session>";

impl RollStore {
    pub fn new(consul: Consul) -> Self {
        Self {
            consul,
            control: RollControl::default(),
        }
    }

    /// Rolls this store creates start with `control` (e.g. `--max-parallel`). Every creation
    /// writes a control record, clearing one a roll of the same id left behind (P2's tools
    /// delete rolls without it).
    pub fn with_control(mut self, control: RollControl) -> Self {
        self.control = control;
        self
    }

    /// The new roll's control: its pace, and who created it (the `by` of the revision the
    /// replaced RC leaves).
    fn control_op(&self, u: &Update, actor: &str) -> TxnOp {
        let control = RollControl {
            created_by: Some(actor.to_string()),
            ..self.control.clone()
        };
        TxnOp::set(control_key(u.id()), control.to_bytes())
    }

    /// The revision history of the lineage `rc` heads (`None`: it has none).
    pub async fn history(&self, rc: RcId) -> Result<Option<History>, RollStoreError> {
        let (entry, _) = self
            .consul
            .kv_get(&history_key(rc), &QueryOptions::default())
            .await?;
        entry
            .map(|e| {
                History::parse(e.value_bytes())
                    .map_err(|why| RollStoreError::Refused(format!("{}: {why}", history_key(rc))))
            })
            .transpose()
    }

    pub fn consul(&self) -> &Consul {
        &self.consul
    }

    /// Every roll; invalid records are listed apart, never failing the list.
    pub async fn list(&self) -> Result<RollListing, RollStoreError> {
        let (entries, meta) = self
            .consul
            .kv_list(ROLL_PREFIX, &QueryOptions::default())
            .await?;
        Ok(parse_roll_listing(meta.index, &entries, None))
    }

    /// Watches the roll tree.
    pub fn watch(&self, config: WatchConfig) -> RollWatch {
        RollWatch::spawn(&self.consul, ROLL_PREFIX, config, |index, entries, prev| {
            parse_roll_listing(index, entries.iter(), prev)
        })
    }

    /// Creates a roll between two existing RCs, as `p2-rctl schedule-update` does: under both
    /// RCs' `update_creation` locks, refusing RCs that are already in a roll, with the record,
    /// its labels and a `ROLLING_UPDATE_CREATION` audit record in one transaction.
    pub async fn create(
        &self,
        new: NewRoll,
        actor: &str,
        dry_run: bool,
    ) -> Result<WrittenRoll, RollStoreError> {
        let u = new.update;
        u.check_new().map_err(RollStoreError::Refused)?;
        let rcs = RcStore::new(self.consul.clone());
        let old_rc = self.existing(&rcs, u.old_rc).await?;
        let new_rc = self.existing(&rcs, u.new_rc).await?;
        self.creation(
            &[u.old_rc, u.new_rc],
            dry_run,
            |_session, rolls: &RollListing| {
                check_conflicts(rolls, &[u.old_rc, u.new_rc])?;
                let mut ops = Vec::new();
                for rc in [&old_rc, &new_rc] {
                    ops.push(TxnOp::check_index(rc.id.key(), rc.modify_index));
                }
                ops.extend(creation_ops(&u, &new_rc, &new.labels, actor));
                ops.push(self.control_op(&u, actor));
                Ok((u.clone(), ops))
            },
        )
        .await
    }

    /// Starts a roll of `old_rc` onto a new manifest: creates the new RC (the old one's
    /// selector, pod labels, strategy and RC labels; no replicas) and the roll in one
    /// transaction, under the old RC's `update_creation` lock.
    pub async fn start(
        &self,
        req: StartRoll,
        actor: &str,
        dry_run: bool,
    ) -> Result<WrittenRoll, RollStoreError> {
        self.start_shaped(req, None, actor, dry_run).await
    }

    /// [`RollStore::start`] whose new RC takes `shape`'s node selector and pod labels instead
    /// of the old RC's (an undo: those of the revision rolled back to).
    pub async fn start_shaped(
        &self,
        req: StartRoll,
        shape: Option<(String, LabelSet)>,
        actor: &str,
        dry_run: bool,
    ) -> Result<WrittenRoll, RollStoreError> {
        let rcs = RcStore::new(self.consul.clone());
        let old = self.existing(&rcs, req.old_rc).await?;
        let (mut rc_labels, _) = LabelStore::new(self.consul.clone())
            .get(LabelType::ReplicationController, &old.id.to_string())
            .await
            .map_err(RcStoreError::from)?;
        rc_labels.remove(POD_ID_LABEL);
        let created = rcs
            .create(
                NewRc {
                    manifest: req.manifest.clone(),
                    node_selector: shape
                        .as_ref()
                        .map_or_else(|| old.node_selector.to_string(), |s| s.0.clone()),
                    pod_labels: shape.map_or_else(|| old.pod_labels.clone(), |s| s.1),
                    replicas_desired: 0,
                    strategy: old.strategy,
                    rc_labels,
                    disabled: false,
                },
                actor,
                // Only the ops: they join the roll's transaction.
                true,
            )
            .await?;
        let new_rc = created
            .rc
            .ok_or_else(|| RollStoreError::Refused("the new RC could not be built".into()))?;
        let desired = req.desired.unwrap_or(old.replicas_desired);
        let u = Update {
            old_rc: old.id,
            new_rc: new_rc.id,
            desired_replicas: desired,
            minimum_replicas: req.minimum.unwrap_or(desired.saturating_sub(1)),
            leave_old: req.leave_old,
            roll_delay: req.roll_delay,
        };
        u.check_new().map_err(RollStoreError::Refused)?;
        if old.strategy == AllocationStrategy::Dynamic {
            tracing::debug!("the new RC keeps the old one's dynamic strategy");
        }
        self.creation(&[old.id], dry_run, |_session, rolls: &RollListing| {
            check_conflicts(rolls, &[old.id])?;
            let mut ops = vec![TxnOp::check_index(old.id.key(), old.modify_index)];
            ops.extend(created.ops.iter().cloned());
            ops.extend(creation_ops(&u, &new_rc, &LabelSet::new(), actor));
            ops.push(self.control_op(&u, actor));
            Ok((u.clone(), ops))
        })
        .await
    }

    /// Pauses (`paused`) or resumes a roll; see [`RollStore::change_control`].
    pub async fn set_paused(
        &self,
        id: RollId,
        paused: bool,
        actor: &str,
        dry_run: bool,
    ) -> Result<PauseOutcome, RollStoreError> {
        let change = if paused {
            ControlChange::Pause
        } else {
            ControlChange::Resume
        };
        self.change_control(id, change, actor, dry_run).await
    }

    /// Pauses, resumes or promotes a roll: its control record at `rcfarm/rolls/<id>` and an
    /// audit record with `actor`, in one transaction guarded by both keys' versions (retried a
    /// few times if the roll's farm writes meanwhile). A roll that does not exist (finished, or
    /// never started) is [`RollStoreError::NotFound`]; one already as asked is left alone; a
    /// change that makes no sense for the roll (promoting one without a canary, resuming one
    /// that waits for its promotion) is refused.
    pub async fn change_control(
        &self,
        id: RollId,
        change: ControlChange,
        actor: &str,
        dry_run: bool,
    ) -> Result<PauseOutcome, RollStoreError> {
        for _ in 0..5 {
            let keys = [roll_key(id), control_key(id)];
            let found = self.consul.read_keys(&keys).await?;
            let entry = found.get(&keys[0]).ok_or(RollStoreError::NotFound(id))?;
            let update = Roll::from_kv(
                &entry.key,
                entry.value_bytes(),
                entry.modify_index,
                entry.create_index,
            )
            .map(|r| r.update)
            .map_err(|inv| {
                RollStoreError::Refused(format!("its record is invalid: {}", inv.problem))
            })?;
            let (current, index) = match found.get(&keys[1]) {
                // A control that cannot be read counts as paused (the farm treats it so).
                Some(kv) => (
                    RollControl::parse(kv.value_bytes()).unwrap_or(RollControl {
                        paused: true,
                        ..Default::default()
                    }),
                    kv.modify_index,
                ),
                None => (RollControl::default(), 0),
            };
            let now = chrono::Utc::now();
            let (control, event, extra) = match change {
                ControlChange::Pause => {
                    if current.paused {
                        return Ok(PauseOutcome::Unchanged(current));
                    }
                    // The roll's pace stays as it was.
                    let c = RollControl {
                        paused: true,
                        paused_by: Some(actor.to_string()),
                        paused_at: Some(now),
                        ..current.clone()
                    };
                    (c, events::ROLL_PAUSED, json!({}))
                }
                ControlChange::Resume => {
                    if current.canary_paused() {
                        return Err(RollStoreError::Refused(format!(
                            "rolling update {id} waits for its canary to be promoted, not resumed: `rcctl roll promote {id}` goes on to the end, `rcctl roll abort {id}` stops it"
                        )));
                    }
                    // A resume also ends a failure: the operator gives the roll another deadline.
                    if !current.paused && current.failed.is_none() {
                        return Ok(PauseOutcome::Unchanged(current));
                    }
                    let was_failed = current.failed.as_ref().map(|f| f.reason.clone());
                    let c = RollControl {
                        paused: false,
                        paused_by: None,
                        paused_at: None,
                        failed: None,
                        progress: None,
                        ..current.clone()
                    };
                    (c, events::ROLL_RESUMED, json!({"was_failed": was_failed}))
                }
                ControlChange::Promote => {
                    let Some(canary) = current.canary else {
                        return Err(RollStoreError::Refused(format!(
                            "rolling update {id} has no canary (it was not started with --canary K): there is nothing to promote; `rcctl roll resume {id}` resumes a paused roll"
                        )));
                    };
                    if current.promoted_by.is_some() {
                        return Ok(PauseOutcome::Unchanged(current));
                    }
                    let was_up = current.canary_paused();
                    // An operator's own pause stays: a promotion answers only the canary's.
                    let c = if was_up {
                        RollControl {
                            paused: false,
                            paused_by: None,
                            paused_at: None,
                            ..current.clone()
                        }
                    } else {
                        current.clone()
                    };
                    let c = RollControl {
                        promoted_by: Some(actor.to_string()),
                        promoted_at: Some(now),
                        progress: None,
                        ..c
                    };
                    (
                        c,
                        events::ROLL_PROMOTED,
                        json!({"canary": canary, "canary_was_up": was_up}),
                    )
                }
            };
            let mut details = json!({
                "rolling_update_id": id,
                "old_rc": update.old_rc,
                "new_rc": update.new_rc,
                "actor": actor,
            });
            if let (Some(d), serde_json::Value::Object(e)) = (details.as_object_mut(), extra) {
                d.extend(e);
            }
            let audit = AuditRecord::new(event, details);
            let ops = vec![
                TxnOp::check_index(roll_key(id), entry.modify_index),
                TxnOp::cas(control_key(id), control.to_bytes(), index),
                audit.txn_op(),
            ];
            if dry_run {
                return Ok(PauseOutcome::Written(WrittenRoll {
                    update,
                    ops,
                    committed: false,
                }));
            }
            match self.consul.txn(&ops).await {
                Ok(_) => {
                    return Ok(PauseOutcome::Written(WrittenRoll {
                        update,
                        ops,
                        committed: true,
                    }));
                }
                // The roll's farm wrote a step (or created the control) meanwhile: read again.
                Err(ConsulError::Conflict(_)) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(RollStoreError::Changed(id))
    }

    /// Deletes a roll and leaves both RCs as they are (the old one stays disabled if the roll
    /// started), with P2's `ROLLING_UPDATE_COMPLETION` record (`canceled`). The farm carrying
    /// it out stops and gives its locks back.
    pub async fn abort(
        &self,
        id: RollId,
        actor: &str,
        dry_run: bool,
    ) -> Result<WrittenRoll, RollStoreError> {
        let (entry, _) = self
            .consul
            .kv_get(&roll_key(id), &QueryOptions::default())
            .await?;
        let entry = entry.ok_or(RollStoreError::NotFound(id))?;
        let roll = Roll::from_kv(
            &entry.key,
            entry.value_bytes(),
            entry.modify_index,
            entry.create_index,
        );
        let (labels, _) = LabelStore::new(self.consul.clone())
            .get(LabelType::Rolls, &id.to_string())
            .await
            .map_err(RcStoreError::from)?;
        let mut details = completion_details(id, &labels, None, false, true);
        details.insert("actor".into(), json!(actor));
        if let Err(inv) = &roll {
            details.insert("problem".into(), json!(inv.problem.to_string()));
        }
        let ops = vec![
            TxnOp::delete_cas(roll_key(id), entry.modify_index),
            LabelStore::delete_op(LabelType::Rolls, &id.to_string()),
            TxnOp::delete(super::control::control_key(id)),
            AuditRecord::new(events::ROLL_COMPLETION, Value::Object(details)).txn_op(),
        ];
        let update = match roll {
            Ok(r) => r.update,
            // An invalid record is aborted all the same; what it said cannot be shown.
            Err(_) => Update {
                old_rc: id,
                new_rc: id,
                desired_replicas: 0,
                minimum_replicas: 0,
                leave_old: false,
                roll_delay: Duration::ZERO,
            },
        };
        if dry_run {
            return Ok(WrittenRoll {
                update,
                ops,
                committed: false,
            });
        }
        match self.consul.txn(&ops).await {
            Ok(_) => Ok(WrittenRoll {
                update,
                ops,
                committed: true,
            }),
            Err(e) if e.failed_at(0, TxnFailure::IndexStale) => Err(RollStoreError::Changed(id)),
            Err(e) => Err(e.into()),
        }
    }

    async fn existing(&self, rcs: &RcStore, id: RcId) -> Result<Rc, RollStoreError> {
        rcs.get(id).await?.ok_or(RollStoreError::RcNotFound(id))
    }

    /// Runs a creation under the `update_creation` locks of `locked` (P2's protocol): a
    /// short-lived session takes them in id order, `build` checks the rolls (read after the
    /// locks are held) and returns the transaction, which carries a `check-session` on every
    /// lock; the locks are released and the session destroyed whatever happens.
    async fn creation(
        &self,
        locked: &[RcId],
        dry_run: bool,
        build: impl FnOnce(&str, &RollListing) -> Result<(Update, Vec<TxnOp>), RollStoreError>,
    ) -> Result<WrittenRoll, RollStoreError> {
        let mut locked: Vec<RcId> = locked.to_vec();
        locked.sort();
        locked.dedup();
        if dry_run {
            let rolls = self.list().await?;
            let (update, body) = build(DRY_RUN_SESSION, &rolls)?;
            let mut ops: Vec<TxnOp> = locked
                .iter()
                .map(|rc| TxnOp::check_session(update_creation_key(*rc), DRY_RUN_SESSION))
                .collect();
            ops.extend(body);
            return Ok(WrittenRoll {
                update,
                ops,
                committed: false,
            });
        }
        let session = self
            .consul
            .session_create(&SessionRequest {
                name: Some(format!("rcctl: rolling update creation on {}", hostname())),
                ttl: Some(Duration::from_secs(15)),
                behavior: Some(SessionBehavior::Delete),
                lock_delay: Some(Duration::ZERO),
                ..Default::default()
            })
            .await?;
        let result = self.locked_creation(&session, &locked, build).await;
        for rc in &locked {
            let _ = self
                .consul
                .release_lock(&update_creation_key(*rc), &session)
                .await;
        }
        let _ = self.consul.session_destroy(&session).await;
        result
    }

    async fn locked_creation(
        &self,
        session: &str,
        locked: &[RcId],
        build: impl FnOnce(&str, &RollListing) -> Result<(Update, Vec<TxnOp>), RollStoreError>,
    ) -> Result<WrittenRoll, RollStoreError> {
        for rc in locked {
            let key = update_creation_key(*rc);
            let name = format!("rcctl: rolling update creation on {}", hostname());
            if !self
                .consul
                .kv_acquire(&key, name.as_bytes(), session, None)
                .await?
            {
                let (entry, _) = self.consul.kv_get(&key, &QueryOptions::default()).await?;
                let entry = entry.unwrap_or_default();
                return Err(RollStoreError::CreationLocked {
                    rc: *rc,
                    name: String::from_utf8_lossy(entry.value_bytes()).into_owned(),
                    session: entry.session.unwrap_or_else(|| "(in lock-delay)".into()),
                });
            }
        }
        let rolls = self.list().await?;
        let (update, body) = build(session, &rolls)?;
        let mut ops: Vec<TxnOp> = locked
            .iter()
            .map(|rc| TxnOp::check_session(update_creation_key(*rc), session))
            .collect();
        ops.extend(body);
        match self.consul.txn(&ops).await {
            Ok(_) => Ok(WrittenRoll {
                update,
                ops,
                committed: true,
            }),
            Err(e) if e.txn_failures().any(|(i, f)| i >= locked.len() && matches!(f, TxnFailure::IndexStale | TxnFailure::KeyMissing)) => {
                Err(RollStoreError::Refused(
                    "an RC of the roll changed, or a roll with this id appeared, while it was being created; try again"
                        .into(),
                ))
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// `lock/replication_controllers/<id>/update_creation`: held while a roll using the RC is
/// being created (P2's guard against two rolls on one RC).
pub fn update_creation_key(rc: RcId) -> String {
    format!("{}/update_creation", rc.ownership_lock_key())
}

fn check_conflicts(rolls: &RollListing, rcs: &[RcId]) -> Result<(), RollStoreError> {
    for rc in rcs {
        if let Some(r) = rolls.roll_of(*rc) {
            return Err(RollStoreError::Conflict {
                rc: *rc,
                roll: r.id(),
                old: r.update.old_rc,
                new: r.update.new_rc,
            });
        }
    }
    Ok(())
}

/// The roll's labels: the caller's, plus the new RC's pod id and pod-cluster labels.
pub fn roll_labels(new_rc: &Rc, extra: &LabelSet) -> LabelSet {
    let mut labels = extra.clone();
    labels.insert(POD_ID_LABEL.into(), new_rc.pod_id().to_string());
    for k in [AVAILABILITY_ZONE, CLUSTER_NAME] {
        if let Some(v) = new_rc.pod_labels.get(k) {
            labels.insert(k.into(), v.clone());
        }
    }
    labels
}

/// The record (create-only), its labels and P2's `ROLLING_UPDATE_CREATION` record.
pub(super) fn creation_ops(u: &Update, new_rc: &Rc, extra: &LabelSet, actor: &str) -> Vec<TxnOp> {
    let labels = roll_labels(new_rc, extra);
    let audit = AuditRecord::new(
        events::ROLL_CREATION,
        json!({
            // P2's RUCreationDetails.
            "pod_id": new_rc.pod_id(),
            "availability_zone": labels.get(AVAILABILITY_ZONE).cloned().unwrap_or_default(),
            "cluster_name": labels.get(CLUSTER_NAME).cloned().unwrap_or_default(),
            "deployer": actor,
            "manifest": new_rc.manifest.raw(),
            "rolling_update_id": u.id(),
            // rcfarm's additions.
            "old_rc": u.old_rc,
            "new_rc": u.new_rc,
            "desired_replicas": u.desired_replicas,
            "minimum_replicas": u.minimum_replicas,
            "leave_old": u.leave_old,
            "roll_delay": crate::util::format_go_duration(u.roll_delay),
        }),
    );
    vec![
        TxnOp::cas(roll_key(u.id()), u.to_json(), 0),
        LabelStore::set_op(LabelType::Rolls, &u.id().to_string(), &labels),
        audit.txn_op(),
    ]
}

/// P2's `RUCompletionDetails` (pod id and pod cluster from the roll's labels), with the
/// reason as rcfarm's addition.
pub fn completion_details(
    id: RollId,
    labels: &LabelSet,
    fallback_pod_id: Option<&str>,
    succeeded: bool,
    canceled: bool,
) -> serde_json::Map<String, Value> {
    let label = |k: &str| labels.get(k).cloned().unwrap_or_default();
    let pod_id = labels
        .get(POD_ID_LABEL)
        .cloned()
        .or_else(|| fallback_pod_id.map(str::to_string))
        .unwrap_or_default();
    let v = json!({
        "pod_id": pod_id,
        "availability_zone": label(AVAILABILITY_ZONE),
        "cluster_name": label(CLUSTER_NAME),
        "rolling_update_id": id,
        "succeeded": succeeded,
        "canceled": canceled,
    });
    match v {
        Value::Object(m) => m,
        _ => serde_json::Map::new(),
    }
}

fn hostname() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown-host".into())
}
