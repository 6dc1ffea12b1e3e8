//! An observer of every committed write (the embedded server's commit log) that checks the
//! farms' promises, for tests and the chaos run:
//!
//! - **fencing**: every write to a pod's intent or labels carries a `check-session` on the lock
//!   of the RC the pod belongs to, by the session holding that lock at that moment (a pod that
//!   a disabled RC gave up, running more than it wants, is fenced by the lock of the RC that
//!   takes it over);
//! - **never too many pods**: no write raises an RC's pod count above its desired count (+1
//!   while its node-transfer status key exists);
//! - **rolling updates**: every roll step is fenced by the roll's lock, held by the writer; a
//!   step never raises old + new desired replicas above the roll's bound (its target, or what
//!   they were); and no farm write takes a started roll's pods that are up (their node runs
//!   what the intent asks and passes its health check) below the roll's minimum;
//! - **brakes**: no step of a roll whose control (`rcfarm/rolls/<id>`) says paused or failed,
//!   and no revert of a revert (a revert that fails stays failed);
//! - **blast radius** (when given the farms' `--max-removals` per window W): all the farms
//!   together commit no more removals within any W (less a slack for clocks) than the limit the
//!   cluster's removal window key (`rcfarm/removals/window`) says its charges were made under
//!   (a count is checked as given); every commit that removes pods charges the key in the same
//!   commit by exactly what it removes; an operator's release (the key's `released` changing)
//!   empties the window. A removal is an intent deleted or rewritten onto another manifest by
//!   the RC owning the pod (not a takeover by another RC), a roll retirement's
//!   `lost_capacity`, a node transfer's start.
//!
//! It also counts scheduling transactions and audit records, to check that every committed
//! change reached the audit log.

pub mod external;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

use crate::audit::{AUDIT_PREFIX, AuditRecord, events};
use crate::health::{HEALTH_PREFIX, parse_health};
use crate::labels::parse_labels;
use crate::rc::{RC_ID_LABEL, RC_LOCK_PREFIX, RC_PREFIX};
use crate::roll::{ROLL_LOCK_PREFIX, ROLL_PREFIX, RollControl};

/// `rcfarm/rolls/<id>`, for an id as the audit record spells it.
fn control_key_of(id: &str) -> String {
    format!("{}{id}", crate::roll::CONTROL_PREFIX)
}
use crate::server::{Change, LoggedCommit};

/// A broken promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub index: u64,
    pub what: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "at index {}: {}", self.index, self.what)
    }
}

/// Replays commits in order.
#[derive(Debug, Default)]
pub struct Observer {
    kv: HashMap<String, Vec<u8>>,
    sessions: HashMap<String, String>,
    /// RC id → pod label keys carrying it.
    pods: HashMap<String, BTreeSet<String>>,
    pub violations: Vec<Violation>,
    /// Writes to an RC's pods checked for fencing: one per RC a fenced commit touched (a farm
    /// sends several RCs' writes in one transaction when they queue for a connection).
    pub fenced_writes: u64,
    /// Commits that carried a `REPLICATION_CONTROLLER_RETARGET` record.
    pub retarget_commits: u64,
    /// The ids of every audit record ever written.
    pub audit_ids: BTreeSet<String>,
    pub commits: u64,
    /// Commits that carried a roll's step, start or completion record.
    pub roll_steps: u64,
    /// Per roll: the fewest pods up seen after a farm's write while the roll ran.
    pub roll_lowest_up: BTreeMap<String, usize>,
    /// Per roll: the smallest (pods up − minimum) right after a farm's write that took pods
    /// down (a takeover, the old RC's leftovers removed): never negative, or it is a violation.
    pub roll_margin: BTreeMap<String, i64>,
    /// Roll steps checked against their roll's control (not paused, not failed).
    pub roll_control_checked: u64,
    /// `ROLLING_UPDATE_REVERTED` records seen.
    pub reverts: u64,
    /// The farms' blast-radius limit to check (`--max-removals N` per `--max-removals-window`),
    /// if any: see [`Observer::with_removal_limit`].
    removal_limit: Option<(RemovalLimit, std::time::Duration)>,
    /// When each removal was committed, by any farm, within the last window.
    removals: std::collections::VecDeque<std::time::Instant>,
    /// The limits the window key's charges were made under, with when, within the window.
    limits: std::collections::VecDeque<(std::time::Instant, u64)>,
    /// The last operator's release the window key showed.
    released: Option<crate::budget::Released>,
    /// The most removals all farms committed within any window (less the slack).
    pub removals_max_per_window: u64,
    /// Removals counted (scale-downs, replacements, roll steps' removals, transfer starts).
    pub removals_seen: u64,
    /// Rolls started as reverts and not finished: one of them reverted is a revert loop.
    reverting: BTreeSet<String>,
}

/// The farms' `--max-removals`, as the observer checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemovalLimit {
    Pods(u64),
    /// Percent of the pods the farms serve, at least `min` (the default: 20 %, 5), as the
    /// window key's charges record it.
    Percent {
        percent: u64,
        min: u64,
    },
}

/// A roll as the observer reads it from the replayed KV.
struct RollView {
    old: String,
    new: String,
    target: i64,
    minimum: usize,
}

fn pod_key(k: &str) -> Option<(&str, &str)> {
    let rest = k
        .strip_prefix("intent/")
        .or_else(|| k.strip_prefix("labels/pod/"))?;
    rest.split_once('/')
}

impl Observer {
    fn rc_of_pod(&self, node: &str, pod: &str) -> Option<String> {
        let l = self.kv.get(&format!("labels/pod/{node}/{pod}"))?;
        parse_labels(l).ok()?.get(RC_ID_LABEL).cloned()
    }

    fn desired(&self, rc: &str) -> i64 {
        self.kv
            .get(&format!("{RC_PREFIX}{rc}"))
            .and_then(|v| serde_json::from_slice::<Value>(v).ok())
            .and_then(|v| v["replicas_desired"].as_i64())
            .unwrap_or(0)
    }

    fn count(&self, rc: &str) -> usize {
        self.pods.get(rc).map_or(0, BTreeSet::len)
    }

    fn rc_field(&self, rc: &str, field: &str) -> Option<Value> {
        self.kv
            .get(&format!("{RC_PREFIX}{rc}"))
            .and_then(|v| serde_json::from_slice::<Value>(v).ok())
            .map(|v| v[field].clone())
    }

    /// Whether the pod of intent key `k` belongs to an RC its rolling update retired (the
    /// record as the roll left it, the roll still there): the roll charged what goes.
    fn deleting_rc_retiring(&self, k: &str) -> bool {
        let Some((node, pod)) = k.strip_prefix("intent/").and_then(|r| r.split_once('/')) else {
            return false;
        };
        let Some(rc) = self.rc_of_pod(node, pod) else {
            return false;
        };
        let Some(m) = self.rc_field(&rc, crate::rc::RETIRE_MARKER) else {
            return false;
        };
        let roll = m["roll"].as_str().unwrap_or_default();
        m["replicas"].as_i64() == Some(self.desired(&rc))
            && self.rc_field(&rc, "disabled") != Some(Value::Bool(true))
            && self.roll_old_rc(roll).as_deref() == Some(rc.as_str())
    }

    /// The old RC of roll `id` (its record at `rolls/<id>`), if the roll exists.
    fn roll_old_rc(&self, id: &str) -> Option<String> {
        let v = self.kv.get(&format!("{ROLL_PREFIX}{id}"))?;
        crate::roll::record::decode(v)
            .ok()
            .map(|u| u.old_rc.to_string())
    }

    /// Whether `taker` is the RC a rolling update moves `giver`'s replicas onto: a roll record
    /// `rolls/<taker>` naming `giver` as old, or (P2's `p2-rctl rolling-update`, which writes
    /// none) both RCs' mutation locks held by one session with one value.
    /// Who wrote a commit, for a violation's message: the locks its fence checked, by which
    /// session of which farm (from the farms' registry).
    fn writer(&self, c: &LoggedCommit) -> String {
        c.checks
            .iter()
            .map(|(k, s)| {
                let farm = self
                    .kv
                    .get(&format!("{}{s}", crate::farm::registry::FARMS_PREFIX))
                    .and_then(|v| serde_json::from_slice::<Value>(v).ok())
                    .and_then(|v| v.get("farm_id")?.as_str().map(str::to_string))
                    .unwrap_or_else(|| "?".into());
                format!("{k} checked for session {s} of farm {farm}")
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn rolled_onto(&self, giver: &str, taker: &str) -> bool {
        if self.roll_old_rc(taker).as_deref() == Some(giver) {
            return true;
        }
        let lock = |rc: &str| {
            let k = format!("{RC_LOCK_PREFIX}{rc}/update");
            Some((self.sessions.get(&k)?.clone(), self.kv.get(&k)?.clone()))
        };
        lock(giver).is_some_and(|g| lock(taker) == Some(g))
    }

    /// Rolls in the replayed KV that have started (their old RC is disabled).
    fn started_rolls(&self) -> BTreeMap<String, RollView> {
        self.kv
            .iter()
            .filter(|(k, _)| k.starts_with(ROLL_PREFIX))
            .filter_map(|(k, v)| {
                let u = crate::roll::record::decode(v).ok()?;
                let started =
                    self.rc_field(&u.old_rc.to_string(), "disabled") == Some(Value::Bool(true));
                started.then(|| {
                    (
                        k.trim_start_matches(ROLL_PREFIX).to_string(),
                        RollView {
                            old: u.old_rc.to_string(),
                            new: u.new_rc.to_string(),
                            target: u.desired_replicas as i64,
                            minimum: u.minimum_replicas as usize,
                        },
                    )
                })
            })
            .collect()
    }

    /// Pods of a roll's two RCs that are up: their node runs what the intent asks (per
    /// `reality/`) and their health check passes.
    fn up(&self, roll: &RollView) -> usize {
        let digest = |key: &str| {
            self.kv
                .get(key)
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|t| crate::rc::Manifest::parse(t).ok())
                .map(|m| m.digest().to_string())
        };
        [&roll.old, &roll.new]
            .iter()
            .filter_map(|rc| self.pods.get(*rc))
            .flatten()
            .filter(|label_key| {
                let Some((node, pod)) = pod_key(label_key) else {
                    return false;
                };
                let wanted = digest(&format!("intent/{node}/{pod}"));
                wanted.is_some()
                    && wanted == digest(&format!("reality/{node}/{pod}"))
                    && self
                        .kv
                        .get(&format!("{HEALTH_PREFIX}{pod}/{node}"))
                        .and_then(|v| parse_health(v).ok())
                        .is_some_and(|h| h.is_passing())
            })
            .count()
    }

    /// Checks a commit against the rolls it concerns: steps fenced by the roll's lock, the
    /// replica bound, and the minimum of pods up (farm writes only: `fenced`).
    fn check_rolls(
        &mut self,
        c: &LoggedCommit,
        before: &BTreeMap<String, (usize, i64)>,
        roll_records: &BTreeSet<String>,
        holders: &HashMap<String, String>,
    ) {
        for id in roll_records {
            let lock = format!("{ROLL_LOCK_PREFIX}{id}");
            let fenced = c
                .checks
                .iter()
                .any(|(k, s)| *k == lock && holders.get(&lock) == Some(s));
            if !fenced {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "a step of rolling update {id} not fenced by its lock, held by the writer"
                    ),
                });
            }
        }
        let fenced = !c.checks.is_empty();
        for (id, roll) in self.started_rolls() {
            let Some((up_before, sum_before)) = before.get(&id).copied() else {
                continue;
            };
            let sum = |rc: &str| self.desired(rc).max(0);
            let sum_after = sum(&roll.old) + sum(&roll.new);
            // The bound holds the roll's own steps (an operator may scale an RC mid-roll).
            if roll_records.contains(&id) && sum_after > sum_before && sum_after > roll.target {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "rolling update {id}: old + new desired rose to {sum_after}, above its bound max({}, {sum_before})",
                        roll.target
                    ),
                });
            }
            if !fenced {
                continue;
            }
            let up = self.up(&roll);
            let lowest = self.roll_lowest_up.entry(id.clone()).or_insert(up);
            *lowest = (*lowest).min(up);
            if up < up_before {
                // How close a farm's own write came to the minimum.
                let margin = up as i64 - roll.minimum as i64;
                let m = self.roll_margin.entry(id.clone()).or_insert(margin);
                *m = (*m).min(margin);
            }
            if up < up_before && up < roll.minimum {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "rolling update {id}: a farm's write took the pods up from {up_before} to {up}, below its minimum {}",
                        roll.minimum
                    ),
                });
            }
        }
    }

    fn set(&mut self, key: &str, value: Option<(&[u8], Option<&String>)>) {
        if key.starts_with("labels/pod/") {
            if let Some(old) = self
                .kv
                .get(key)
                .and_then(|v| parse_labels(v).ok())
                .and_then(|l| l.get(RC_ID_LABEL).cloned())
                && let Some(s) = self.pods.get_mut(&old)
            {
                s.remove(key);
            }
            if let Some(new) = value
                .and_then(|(v, _)| parse_labels(v).ok())
                .and_then(|l| l.get(RC_ID_LABEL).cloned())
            {
                self.pods.entry(new).or_default().insert(key.to_string());
            }
        }
        match value {
            Some((v, session)) => {
                self.kv.insert(key.to_string(), v.to_vec());
                match session {
                    Some(s) => self.sessions.insert(key.to_string(), s.clone()),
                    None => self.sessions.remove(key),
                };
            }
            None => {
                self.kv.remove(key);
                self.sessions.remove(key);
            }
        }
    }

    /// A paused or failed roll takes no step (its control as it was before this commit), and
    /// a revert is never reverted.
    fn check_brakes(&mut self, c: &LoggedCommit, audits: &[AuditRecord]) {
        for r in audits {
            if r.event_type == events::ROLL_REVERTED {
                self.reverts += 1;
                let failed = r.event_details["failed_rolling_update_id"].as_str();
                if let Some(f) = failed.filter(|f| self.reverting.contains(*f)) {
                    self.violations.push(Violation {
                        index: c.index,
                        what: format!(
                            "a revert loop: rolling update {f}, itself a revert, was reverted"
                        ),
                    });
                }
                if let Some(id) = r.event_details["rolling_update_id"].as_str() {
                    self.reverting.insert(id.to_string());
                }
            }
            if r.event_type == events::ROLL_COMPLETION
                && let Some(id) = r.event_details["rolling_update_id"].as_str()
            {
                self.reverting.remove(id);
            }
            let steps = [events::ROLL_STARTED, events::ROLL_STEP].contains(&r.event_type.as_str())
                || (r.event_type == events::ROLL_COMPLETION
                    && r.event_details["canceled"] != Value::Bool(true));
            let Some(id) = r.event_details["rolling_update_id"].as_str() else {
                continue;
            };
            if !steps || c.checks.is_empty() {
                continue;
            }
            let control = self
                .kv
                .get(&control_key_of(id))
                .and_then(|v| RollControl::parse(v).ok());
            if let Some(ctl) = control.filter(|ctl| ctl.paused || ctl.failed.is_some()) {
                let state = if ctl.paused { "paused" } else { "failed" };
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "a step ({}) of rolling update {id} while it was {state}",
                        r.event_type
                    ),
                });
            }
            if r.event_type == events::ROLL_STEP {
                self.roll_control_checked += 1;
            }
        }
    }

    /// Checks and applies one commit.
    pub fn observe(&mut self, c: &LoggedCommit) {
        self.commits += 1;
        // The commit's audit records, parsed once for every check that reads them.
        let audits: Vec<AuditRecord> = c
            .changes
            .iter()
            .filter_map(|ch| match ch {
                Change::Put(k, e) if k.starts_with(AUDIT_PREFIX) => {
                    AuditRecord::from_kv(k, &e.value).ok()
                }
                _ => None,
            })
            .collect();
        self.check_removals(c, &audits);
        let pod_keys: Vec<(String, String)> = c
            .changes
            .iter()
            .filter_map(|ch| match ch {
                Change::Put(k, _) | Change::Delete(k) => {
                    pod_key(k).map(|(n, p)| (n.to_string(), p.to_string()))
                }
                _ => None,
            })
            .collect();
        let mut touched: BTreeSet<String> = pod_keys
            .iter()
            .filter_map(|(n, p)| self.rc_of_pod(n, p))
            .collect();
        let before: BTreeMap<String, usize> = touched
            .iter()
            .map(|rc| (rc.clone(), self.count(rc)))
            .collect();
        // Rolls this commit steps (by its audit records), and the rolls' state before it.
        let roll_records: BTreeSet<String> = audits
            .iter()
            .filter(|r| {
                [
                    events::ROLL_STARTED,
                    events::ROLL_STEP,
                    events::ROLL_COMPLETION,
                ]
                .contains(&r.event_type.as_str())
            })
            .filter(|r| !c.checks.is_empty() || r.event_type != events::ROLL_COMPLETION)
            .filter_map(|r| {
                r.event_details["rolling_update_id"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        self.check_brakes(c, &audits);
        let concerns_rolls = c.changes.iter().any(|ch| match ch {
            Change::Put(k, _) | Change::Delete(k) => {
                k.starts_with(RC_PREFIX) || k.starts_with(ROLL_PREFIX) || pod_key(k).is_some()
            }
            _ => false,
        });
        let rolls_before: BTreeMap<String, (usize, i64)> = if concerns_rolls {
            self.started_rolls()
                .into_iter()
                .map(|(id, r)| {
                    let sum = self.desired(&r.old).max(0) + self.desired(&r.new).max(0);
                    (id, (self.up(&r), sum))
                })
                .collect()
        } else {
            BTreeMap::new()
        };
        let holders: HashMap<String, String> = if pod_keys.is_empty() && roll_records.is_empty() {
            HashMap::new()
        } else {
            self.sessions
                .iter()
                .filter(|(k, _)| k.starts_with(RC_LOCK_PREFIX) || k.starts_with(ROLL_LOCK_PREFIX))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        for ch in &c.changes {
            match ch {
                Change::Put(k, e) => {
                    if let Some(id) = k.strip_prefix(AUDIT_PREFIX) {
                        self.audit_ids.insert(id.to_string());
                    }
                    self.set(k, Some((&e.value, e.session.as_ref())));
                }
                Change::Delete(k) => self.set(k, None),
                Change::DeleteTree(p) => {
                    let keys: Vec<String> = self
                        .kv
                        .keys()
                        .filter(|k| k.starts_with(p.as_str()))
                        .cloned()
                        .collect();
                    for k in keys {
                        self.set(&k, None);
                    }
                }
                _ => {}
            }
        }
        self.retarget_commits += audits
            .iter()
            .filter(|r| r.event_type == events::RC_RETARGET)
            .count() as u64;
        if !roll_records.is_empty() {
            self.roll_steps += 1;
        }
        if concerns_rolls {
            self.check_rolls(c, &rolls_before, &roll_records, &holders);
        }
        touched.extend(pod_keys.iter().filter_map(|(n, p)| self.rc_of_pod(n, p)));
        if touched.is_empty() {
            return;
        }
        if c.checks.is_empty() {
            self.violations.push(Violation {
                index: c.index,
                what: format!("unfenced write to the pods of {touched:?}"),
            });
            return;
        }
        // An RC that is disabled and runs more pods than it wants has given them up (a rolling
        // update moved its replicas): the RC the roll moves them to, and only that one, takes
        // them over in place, fenced by its own lock (checked as that RC's write), not the
        // giver's.
        let fenced_by = |rc: &str| {
            let lock = format!("{RC_LOCK_PREFIX}{rc}");
            c.checks
                .iter()
                .any(|(k, s)| *k == lock && holders.get(&lock) == Some(s))
        };
        for rc in &touched {
            let gave_up = !fenced_by(rc)
                && self.rc_field(rc, "disabled") == Some(Value::Bool(true))
                && self.count(rc) < before.get(rc).copied().unwrap_or(0)
                && self.count(rc) as i64 >= self.desired(rc)
                && touched
                    .iter()
                    .any(|other| other != rc && fenced_by(other) && self.rolled_onto(rc, other));
            if gave_up {
                continue;
            }
            self.fenced_writes += 1;
            let lock = format!("{RC_LOCK_PREFIX}{rc}");
            let Some((_, session)) = c.checks.iter().find(|(k, _)| k == &lock) else {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "write to the pods of {rc} not fenced by its lock (the writer: {})",
                        self.writer(c)
                    ),
                });
                continue;
            };
            if holders.get(&lock) != Some(session) {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "write to {rc} by session {session}, which did not hold its lock"
                    ),
                });
            }
            let after = self.count(rc);
            let was = before.get(rc).copied().unwrap_or(0);
            let transfer = self.kv.contains_key(&format!(
                "status/replication_controllers/{rc}/replication_controller"
            ));
            let limit = self.desired(rc).max(0) as usize + usize::from(transfer);
            if after > was && after > limit {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "{rc} raised to {after} pods, desired {} (transfer in flight: {transfer})",
                        self.desired(rc)
                    ),
                });
            }
        }
    }

    /// The smallest margin above a roll's minimum (pods up − minimum) right after a farm's
    /// write that took pods down, over every roll.
    pub fn roll_min_margin(&self) -> Option<i64> {
        self.roll_margin.values().min().copied()
    }

    /// An observer that also checks the cluster's blast-radius limit: at most `limit` removals
    /// per `window` by all farms together, each charged to the window key.
    pub fn with_removal_limit(limit: u64, window: std::time::Duration) -> Observer {
        Observer::with_removal_limits(RemovalLimit::Pods(limit), window)
    }

    /// [`Observer::with_removal_limit`], the limit in pods or in percent (read from the window
    /// key's charges). An operator's release (the key's `released`) empties the window.
    pub fn with_removal_limits(limit: RemovalLimit, window: std::time::Duration) -> Observer {
        Observer {
            removal_limit: Some((limit, window)),
            ..Observer::default()
        }
    }

    /// The farms' default failsafe: 20 % of what a farm serves (at least 5) per 5 minutes.
    pub fn with_default_failsafe() -> Observer {
        let d = crate::failsafe::FailsafeConfig::default();
        let limit = match d.max_removals {
            crate::failsafe::MaxRemovals::Pods(n) => RemovalLimit::Pods(n),
            crate::failsafe::MaxRemovals::Percent(p) => RemovalLimit::Percent {
                percent: p,
                min: crate::failsafe::MIN_REMOVALS,
            },
            crate::failsafe::MaxRemovals::Off => RemovalLimit::Pods(u64::MAX),
        };
        Observer::with_removal_limits(limit, d.window)
    }

    /// Reads the window key a commit wrote: an operator's release empties the window; a
    /// charge records the limit it was made under. Returns what the commit charged (the
    /// increase of the key's buckets), if it wrote the key.
    fn observe_window_key(&mut self, c: &LoggedCommit) -> Option<u64> {
        let written = c.changes.iter().find_map(|ch| match ch {
            Change::Put(k, e) if k == crate::budget::BUDGET_KEY => Some(e.value.clone()),
            _ => None,
        })?;
        let Ok(after) = crate::budget::Window::parse(&written) else {
            self.violations.push(Violation {
                index: c.index,
                what: "the removal window key was written unreadable".into(),
            });
            return None;
        };
        if after.released != self.released {
            self.released = after.released.clone();
            self.removals.clear();
            self.limits.clear();
            return Some(0);
        }
        if let Some(l) = after.limit {
            self.limits.push_back((c.at, l));
        }
        let before = self
            .kv
            .get(crate::budget::BUDGET_KEY)
            .and_then(|v| crate::budget::Window::parse(v).ok())
            .unwrap_or_default();
        Some(after.charged_since(&before))
    }

    /// Counts the removals one commit makes (before it is applied: it compares with what the
    /// pods were) and checks the writer's window.
    fn check_removals(&mut self, c: &LoggedCommit, audits: &[AuditRecord]) {
        let Some((limit, window)) = self.removal_limit else {
            return;
        };
        let charged = self.observe_window_key(c);
        let Some((_, session)) = c.checks.first() else {
            return;
        };
        let session = session.clone();
        // A transfer's removal was charged when it started: its completion (or rollback)
        // deletes an intent it already paid for.
        let transfer_end = audits.iter().any(|r| {
            [
                events::NODE_TRANSFER_COMPLETION,
                events::NODE_TRANSFER_ROLLBACK,
            ]
            .contains(&r.event_type.as_str())
        });
        let mut n = 0u64;
        for ch in &c.changes {
            match ch {
                Change::Delete(k)
                    if k.starts_with("intent/")
                        && self.kv.contains_key(k)
                        && !transfer_end
                        && !self.deleting_rc_retiring(k) =>
                {
                    n += 1
                }
                Change::Put(k, e) if k.starts_with("intent/") => {
                    let Some(before) = self.kv.get(k) else {
                        continue;
                    };
                    let digest = |v: &[u8]| {
                        crate::rc::Manifest::parse(&String::from_utf8_lossy(v))
                            .ok()
                            .map(|m| m.digest().to_string())
                    };
                    if digest(before) == digest(&e.value) {
                        continue;
                    }
                    // A pod taken over by another RC (a roll's new RC, in place) was charged
                    // to the roll's step; only an RC rewriting its own pod counts here.
                    let Some((node, pod)) =
                        k.strip_prefix("intent/").and_then(|r| r.split_once('/'))
                    else {
                        continue;
                    };
                    let label = format!("labels/pod/{node}/{pod}");
                    let rc_of = |v: Option<&[u8]>| {
                        v.and_then(|v| parse_labels(v).ok())
                            .and_then(|l| l.get(RC_ID_LABEL).cloned())
                    };
                    let was = rc_of(self.kv.get(&label).map(Vec::as_slice));
                    let now = c
                        .changes
                        .iter()
                        .find_map(|ch| match ch {
                            Change::Put(lk, le) if *lk == label => Some(rc_of(Some(&le.value))),
                            _ => None,
                        })
                        .unwrap_or_else(|| was.clone());
                    if was.is_some() && was == now {
                        n += 1;
                    }
                }
                _ => {}
            }
        }
        // A roll's steps replace pods under its minimum and its node transfers' ends replace
        // one pod with another already up: neither counts. A roll's retirement of its old RC
        // counts the capacity that goes with it (`lost_capacity`), and the old RC's removals
        // then count nothing more (see `deleting_rc_retiring`).
        for r in audits {
            if r.event_type == events::ROLL_STEP {
                n += r.event_details["lost_capacity"].as_u64().unwrap_or(0);
            }
        }
        if n == 0 {
            return;
        }
        self.removals_seen += n;
        if charged != Some(n) {
            self.violations.push(Violation {
                index: c.index,
                what: format!(
                    "session {session} committed {n} removals and charged {} to the cluster's removal window",
                    charged.map_or("nothing".to_string(), |x| x.to_string())
                ),
            });
        }
        // Clocks: a farm stamps its charge with its own wall clock, the log with the server's.
        let slack = std::time::Duration::from_secs(2).min(window / 2);
        for _ in 0..n {
            self.removals.push_back(c.at);
        }
        let old = |t: &std::time::Instant| c.at.duration_since(*t) >= window - slack;
        while self.removals.front().is_some_and(old) {
            self.removals.pop_front();
        }
        while self.limits.front().is_some_and(|(t, _)| old(t)) {
            self.limits.pop_front();
        }
        // The limit: a count as given; a percentage as the key says the charges were made
        // under (the farms and this check read the same number), at least its floor.
        let limit = match limit {
            RemovalLimit::Pods(l) => l,
            RemovalLimit::Percent { min, .. } => self
                .limits
                .iter()
                .map(|(_, l)| *l)
                .max()
                .unwrap_or(min)
                .max(min),
        };
        let in_window = self.removals.len() as u64;
        self.removals_max_per_window = self.removals_max_per_window.max(in_window);
        if in_window > limit {
            self.violations.push(Violation {
                index: c.index,
                what: format!(
                    "the farms committed {in_window} removals within {:?}, above the cluster's limit of {limit} per {:?}",
                    window - slack,
                    window
                ),
            });
        }
    }

    /// Observes a whole log.
    pub fn replay(log: &[LoggedCommit]) -> Observer {
        let mut o = Observer::default();
        for c in log {
            o.observe(c);
        }
        o
    }

    /// Current pods per RC id (label keys carrying the RC's id).
    pub fn pods_of(&self, rc: &str) -> usize {
        self.count(rc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roll::RollFailure;
    use crate::server::Entry;

    fn put(key: &str, value: &[u8], session: Option<&str>) -> Change {
        Change::Put(
            key.to_string(),
            Entry {
                value: value.to_vec().into(),
                flags: 0,
                session: session.map(str::to_string),
                lock_index: 0,
                create_index: 1,
                modify_index: 1,
            },
        )
    }

    fn commit(index: u64, changes: Vec<Change>, checks: &[(&str, &str)]) -> LoggedCommit {
        LoggedCommit {
            index,
            changes,
            checks: checks
                .iter()
                .map(|(k, s)| (k.to_string(), s.to_string()))
                .collect(),
            at: std::time::Instant::now(),
        }
    }

    fn step(id: &str) -> Change {
        let r = AuditRecord::new(
            events::ROLL_STEP,
            serde_json::json!({"rolling_update_id": id, "replicas_added": 1}),
        );
        put(&r.key(), &serde_json::to_vec(&r).unwrap(), None)
    }

    #[test]
    fn a_step_of_a_paused_or_failed_roll_is_a_violation() {
        let id = crate::rc::RcId::new().to_string();
        let lock = format!("{ROLL_LOCK_PREFIX}{id}");
        let control = |c: &RollControl| put(&control_key_of(&id), &c.to_bytes(), None);
        let mut o = Observer::default();
        o.observe(&commit(1, vec![put(&lock, b"f1", Some("s1"))], &[]));
        // Unpaused: fine.
        o.observe(&commit(2, vec![control(&RollControl::default())], &[]));
        o.observe(&commit(3, vec![step(&id)], &[(&lock, "s1")]));
        assert!(o.violations.is_empty(), "{:?}", o.violations);
        // Paused: the next step breaks the promise; the pause's own write does not.
        let paused = RollControl {
            paused: true,
            ..Default::default()
        };
        o.observe(&commit(4, vec![control(&paused)], &[]));
        o.observe(&commit(5, vec![step(&id)], &[(&lock, "s1")]));
        assert_eq!(o.violations.len(), 1);
        assert!(o.violations[0].what.contains("while it was paused"));
        // Failed likewise.
        let failed = RollControl {
            failed: Some(RollFailure {
                reason: "deadline".into(),
                at: chrono::Utc::now(),
            }),
            ..Default::default()
        };
        o.observe(&commit(6, vec![control(&failed)], &[]));
        o.observe(&commit(7, vec![step(&id)], &[(&lock, "s1")]));
        assert_eq!(o.violations.len(), 2);
        assert!(o.violations[1].what.contains("while it was failed"));
        assert_eq!(o.roll_control_checked, 3);
    }

    /// The window key after charging `n` more under `limit` (a farm's charge).
    fn charge(
        w: &mut crate::budget::Window,
        n: u64,
        limit: crate::failsafe::MaxRemovals,
    ) -> Change {
        let st = crate::budget::Settings {
            max_removals: limit,
            window: std::time::Duration::from_secs(60),
        };
        *w = w.charge(st, 1_000, n, None).unwrap_or_else(|_| {
            // Past the limit on purpose: the record as an over-spending farm would write it.
            let mut over = w.clone();
            over.buckets[0].1 += n;
            over
        });
        put(crate::budget::BUDGET_KEY, &w.to_bytes(), None)
    }

    #[test]
    fn removals_above_the_limit_within_a_window_are_a_violation() {
        let intent = |node: &str, v: u32| {
            put(
                &format!("intent/{node}/web"),
                format!("id: web\nversion: {v}\n").as_bytes(),
                None,
            )
        };
        let del = |node: &str| Change::Delete(format!("intent/{node}/web"));
        let lock = ("lock/replication_controllers/rc-1", "s1");
        let other = ("lock/replication_controllers/rc-2", "s2");
        let two = crate::failsafe::MaxRemovals::Pods(2);
        let mut w = crate::budget::Window::default();
        let mut o = Observer::with_removal_limit(2, std::time::Duration::from_secs(60));
        // Pods placed: no removal.
        o.observe(&commit(
            1,
            vec![intent("n1", 1), intent("n2", 1), intent("n3", 1)],
            &[lock],
        ));
        assert_eq!(o.removals_seen, 0);
        // Two removed (charged), then an intent rewritten with the same manifest (no removal),
        // then a third removal by another farm's session: one too many for the cluster.
        o.observe(&commit(
            2,
            vec![del("n1"), del("n2"), charge(&mut w, 2, two)],
            &[lock],
        ));
        o.observe(&commit(3, vec![intent("n3", 1)], &[lock]));
        assert!(o.violations.is_empty(), "{:?}", o.violations);
        assert_eq!(o.removals_seen, 2);
        o.observe(&commit(
            4,
            vec![del("n3"), charge(&mut w, 1, two)],
            &[other],
        ));
        assert_eq!(o.removals_max_per_window, 3);
        assert!(
            o.violations.len() == 1 && o.violations[0].what.contains("3 removals"),
            "{:?}",
            o.violations
        );
        // A removal that does not charge the key is one too.
        o.observe(&commit(5, vec![intent("n4", 1)], &[lock]));
        o.observe(&commit(
            6,
            vec![Change::Delete("intent/n4/web".into())],
            &[lock],
        ));
        assert!(
            o.violations
                .iter()
                .any(|v| v.what.contains("charged nothing")),
            "{:?}",
            o.violations
        );
        // Without a limit nothing is checked.
        let mut free = Observer::default();
        free.observe(&commit(1, vec![intent("n1", 1)], &[lock]));
        free.observe(&commit(2, vec![del("n1")], &[lock]));
        assert_eq!(free.removals_seen, 0);
    }

    #[test]
    fn a_percent_limit_is_read_from_the_key_and_a_release_empties_the_window() {
        let intent = |i: usize| put(&format!("intent/n{i}/web"), b"id: web\n", None);
        let del = |r: std::ops::Range<usize>| -> Vec<Change> {
            r.map(|i| Change::Delete(format!("intent/n{i}/web")))
                .collect()
        };
        let lock = ("lock/replication_controllers/rc-1", "s1");
        let pct = crate::failsafe::MaxRemovals::Percent(20);
        let mut w = crate::budget::Window::default();
        let mut o = Observer::with_removal_limits(
            RemovalLimit::Percent {
                percent: 20,
                min: 5,
            },
            std::time::Duration::from_secs(60),
        );
        let placed: Vec<Change> = (0..12).map(intent).collect();
        o.observe(&commit(1, placed, &[lock]));
        // Five removals: the floor, as the key's charges say.
        let mut five = del(0..5);
        five.push(charge(&mut w, 5, pct));
        o.observe(&commit(2, five, &[lock]));
        assert!(o.violations.is_empty(), "{:?}", o.violations);
        assert_eq!(w.limit, Some(5));
        // An operator's release: the window starts empty, five more are fine.
        w = w.release("rcctl:op@host", 1_001);
        o.observe(&commit(
            3,
            vec![put(crate::budget::BUDGET_KEY, &w.to_bytes(), None)],
            &[],
        ));
        let mut five = del(5..10);
        five.push(charge(&mut w, 5, pct));
        o.observe(&commit(4, five, &[lock]));
        assert!(o.violations.is_empty(), "{:?}", o.violations);
        // The sixth is one too many.
        let mut one = del(10..11);
        one.push(charge(&mut w, 1, pct));
        o.observe(&commit(6, one, &[lock]));
        assert!(
            o.violations
                .first()
                .is_some_and(|v| v.what.contains("6 removals") && v.what.contains("limit of 5")),
            "{:?}",
            o.violations
        );
    }

    #[test]
    fn a_revert_of_a_revert_is_a_loop() {
        let reverted = |failed: &str, revert: &str| {
            let r = AuditRecord::new(
                events::ROLL_REVERTED,
                serde_json::json!({"failed_rolling_update_id": failed, "rolling_update_id": revert}),
            );
            put(&r.key(), &serde_json::to_vec(&r).unwrap(), None)
        };
        let mut o = Observer::default();
        o.observe(&commit(1, vec![reverted("b", "a")], &[("x", "s")]));
        assert!(o.violations.is_empty());
        o.observe(&commit(2, vec![reverted("a", "b")], &[("x", "s")]));
        assert_eq!(o.reverts, 2);
        assert!(
            o.violations[0].what.contains("a revert loop"),
            "{:?}",
            o.violations
        );
    }
}
