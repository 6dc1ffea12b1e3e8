//! The model's world: a simulated KV with sessions and locks, the node agents, and two farms
//! whose RC tasks, roll task and ownership decide with rcfarm's own decision cores. Every
//! write a farm plans is kept pending, guarded by what it was planned against, and committed
//! (or refused) by a later event, so the schedules interleave plans, commits and faults.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::budget::{Settings, Window};
use tokio::time::Instant;

use crate::failsafe::MaxRemovals;
use crate::farm::claims::{FarmView, Rule, assign_held};
use crate::farm::decide::{self, HeldIndex, Rules, Situation, Stop};
use crate::health::HealthStatus;
use crate::rc::{Rc, RcId};
use crate::rctask::plan::{
    self as rcplan, Action, Observed, Transfer, needs_mutation_lock, neighbours, removals,
    within_grant,
};
use crate::roll::{
    DeadlineClock, LockState, RcCounts, RollAction, RollObserved, Update, deadline_clock,
};
use crate::scheduler::{NodeName, NodeSet};

/// Nodes in the world of the random schedules (the exhaustive exploration's is smaller:
/// [`World::with_nodes`]).
pub const NODES: usize = 4;
/// Farms in the world.
pub const FARMS: usize = 2;
/// A node transfer rolls back after this many ticks without its new pod up.
pub const TRANSFER_TIMEOUT: u64 = 4;
/// The cluster's removal budget: all farms together, this many counted removals per window
/// of this many ticks (one tick a second: the window's buckets are a second long, exact).
pub const BUDGET_LIMIT: u64 = 2;
pub const BUDGET_WINDOW: u64 = 8;
/// A roll fails when its new pods are not up for this long.
pub const ROLL_DEADLINE: u64 = 5;
/// The claim grace of the farms (ticks).
pub const CLAIM_GRACE: u64 = 1;

/// The removal window's settings, as every farm has them.
pub fn budget() -> Settings {
    Settings {
        max_removals: MaxRemovals::Pods(BUDGET_LIMIT),
        window: Duration::from_secs(BUDGET_WINDOW),
    }
}

/// The RCs: a rolling update's old and new RC, and an unrelated RC with the same pod id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Which {
    O,
    N,
    X,
}

impl Which {
    pub const ALL: [Which; 3] = [Which::O, Which::N, Which::X];

    pub fn id(self) -> RcId {
        let n = match self {
            Which::O => 1,
            Which::N => 2,
            Which::X => 3,
        };
        // A fixed, valid id per RC.
        RcId::parse(&format!("00000000-0000-4000-8000-0000000000{n:02}"))
            .unwrap_or_else(|_| unreachable!("a canonical UUID parses"))
    }

    fn of(id: RcId) -> Option<Which> {
        Which::ALL.into_iter().find(|w| w.id() == id)
    }

    fn manifest(self) -> &'static str {
        match self {
            Which::O => "id: web\nversion: old\n",
            Which::N => "id: web\nversion: new\n",
            Which::X => "id: web\nversion: other\n",
        }
    }
}

/// A Consul session: which farm (or an outside tool, `u8::MAX`) and its generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Session(pub u8, pub u32);

impl Session {
    pub const OUTSIDE: Session = Session(u8::MAX, 0);

    pub fn name(self) -> String {
        format!("s{}.{}", self.0, self.1)
    }
}

/// Who holds a mutation lock, as its value says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holder {
    /// A node transfer of the RC.
    Transfer,
    /// A rolling update (its id).
    Roll(Which),
    /// P2's `p2-rctl rolling-update`, holding both RCs' locks with one session.
    P2Roller,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RcRec {
    pub desired: u64,
    pub disabled: bool,
    pub version: u64,
    /// A roll's retirement mark: (roll, replicas).
    pub retire: Option<(Which, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pod {
    /// The RC its label names.
    pub owner: Which,
    /// The manifest its intent asks for.
    pub intent: Which,
    /// The label's version (ModifyIndex).
    pub version: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeState {
    pub eligible: bool,
    pub pod: Option<Pod>,
    /// What the node agent runs, and the reality key's version.
    pub reality: Option<(Which, u64)>,
    /// Health passing or not, and the key's version.
    pub health: Option<(bool, u64)>,
    /// A node made sick by a fault never passes until it heals.
    pub sick: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRec {
    pub old: usize,
    pub new: usize,
    pub started: u64,
    pub id: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollRec {
    pub old: Which,
    pub new: Which,
    pub target: u64,
    pub minimum: u64,
    pub version: u64,
    pub started: bool,
    pub paused: bool,
    pub canary: Option<u64>,
    pub failed: bool,
    pub auto_revert: bool,
    pub revert_of: bool,
    pub control_version: u64,
}

impl RollRec {
    /// The roll's id (its new RC).
    pub fn id(&self) -> Which {
        self.new
    }
}

/// The simulated KV.
#[derive(Debug, Clone, Default)]
pub struct Kv {
    pub index: u64,
    pub rcs: BTreeMap<Which, RcRec>,
    pub own_lock: BTreeMap<Which, Session>,
    pub mut_lock: BTreeMap<Which, (Session, Holder)>,
    /// P2's node-transfer lock (a freeze).
    pub nt_lock: BTreeMap<Which, Session>,
    pub transfer: BTreeMap<Which, TransferRec>,
    pub nodes: Vec<NodeState>,
    pub roll: Option<RollRec>,
    pub roll_lock: Option<Session>,
    /// The cluster's removal window (`rcfarm/removals/window`): every commit that removes
    /// capacity charges it in the same transaction.
    pub window: Window,
    /// The window key's version (0: never written).
    pub window_version: u64,
}

impl Kv {
    fn next(&mut self) -> u64 {
        self.index += 1;
        self.index
    }

    /// The room the cluster's window has at tick `now`.
    pub fn room(&self, now: u64) -> u64 {
        self.window.room(budget(), now as i64)
    }

    pub fn pods_of(&self, w: Which) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|n| self.nodes[*n].pod.is_some_and(|p| p.owner == w))
            .collect()
    }

    /// Whether the pod on `n` is up: its node runs what its intent asks and passes, with a
    /// health result newer than that reality.
    pub fn up(&self, n: usize) -> bool {
        let node = &self.nodes[n];
        match (node.pod, node.reality, node.health) {
            (Some(p), Some((runs, rv)), Some((passing, hv))) => {
                runs == p.intent && passing && hv > rv
            }
            _ => false,
        }
    }

    /// `giver`'s replicas move onto `taker`: a roll record, or both mutation locks held by
    /// one session with one value.
    pub fn rolled_onto(&self, giver: Which, taker: Which) -> bool {
        self.roll
            .as_ref()
            .is_some_and(|r| r.old == giver && r.new == taker)
            || match (self.mut_lock.get(&giver), self.mut_lock.get(&taker)) {
                (Some(g), Some(t)) => g == t,
                _ => false,
            }
    }
}

/// What a pending write checks when it commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Guard {
    RcVersion(Which, u64),
    /// The label of a node's pod as seen at plan time (`None`: none).
    Label(usize, Option<u64>),
    MutLockHeld(Which, Session),
    StatusAbsent(Which),
    RollVersion(u64),
    ControlVersion(u64),
}

/// One write of a pending transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    SetPod { node: usize, owner: Which },
    DeletePod { node: usize },
    SetTransfer(Which, TransferRec),
    DeleteTransfer(Which),
    SetRc(Which, RcRec),
    DeleteRc(Which),
    SetRoll(Option<RollRec>),
    DeleteMutLock(Which),
    DeleteRollLock,
}

/// A transaction planned and not yet committed.
#[derive(Debug, Clone)]
pub struct Pending {
    pub farm: usize,
    /// The farm's process when it planned this.
    pub incarnation: u32,
    pub session: Session,
    /// Fenced by this RC's ownership lock, or by the roll's lock (`None`).
    pub fence: Option<Which>,
    pub guards: Vec<Guard>,
    pub writes: Vec<Write>,
    /// Counted removals it charges to the cluster's window as it commits (capped to the room
    /// the farm saw when it planned): it commits if and only if the window has room for them
    /// then. Nothing is granted ahead, nothing is given back.
    pub charge: u64,
    /// The writer RC (an RC task's) for the invariants.
    pub writer: Option<Which>,
    /// Release the writer's mutation lock (as a transfer's) once committed.
    pub release_transfer_lock: bool,
    /// What it does, for traces.
    pub what: String,
    /// The nodes whose pods were up when it was planned: a write is judged against the world
    /// it was planned from (a pod failing meanwhile is the node's doing, not the farm's).
    pub up_at_plan: BTreeSet<usize>,
}

#[derive(Debug, Clone, Default)]
pub struct RcTask {
    pub transfer_loaded: bool,
    pub transfer_started: Option<u64>,
}

#[derive(Debug, Clone, Default)]
pub struct RollTask {
    pub ready_since: Option<u64>,
    pub deadline_spent: u64,
    pub counting_since: Option<u64>,
    pub best_new_up: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct Farm {
    pub session: Session,
    pub incarnation: u32,
    pub tasks: BTreeMap<Which, RcTask>,
    pub roll_task: Option<RollTask>,
    pub unheld_since: HashMap<RcId, Instant>,
    pub roll_unheld_since: HashMap<RcId, Instant>,
}

/// Rules the model may be told to break, to show the checker finds what they cause: the code
/// before the fixes of issue 36, and a removal charged to the cluster's window without its
/// `cas`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutant {
    /// A node transfer's end takes the RC's mutation lock as its start does, and a roll takes
    /// the mutation locks whatever transfer is in flight (the roll/transfer deadlock).
    FinishNeedsLock,
    /// Pod labels guarded by their version when the write commits, not when it was planned
    /// (the fencing violation of chaos seed 5550123).
    LabelsGuardedAtCommit,
    /// Any RC takes a disabled RC's surplus pods over, not only its roll's new RC.
    AnyTakeover,
    /// A removal's charge written blindly as it commits (no `cas` on the window, no room
    /// checked then): removals are capped only by the room the farm saw when it planned, so
    /// farms planning from the same room spend it more than once.
    BlindCharge,
    /// A node transfer's end leaves the RC's mutation lock held (a lock leak: neither the
    /// finishing commit nor a later pass releases it).
    KeepsTransferLock,
    /// A scale-down's removals counted as free (`rctask::plan::removals` calling an
    /// `Unschedule` uncounted): never capped by the room, never charged.
    UnchargedScaleDown,
    /// The roll planner shown a minimum of 0 whatever the roll's record says.
    IgnoresMinimum,
    /// An RC task's writes not guarded by the RC record's version they were planned from.
    UnguardedRcWrites,
    /// The roll's progress deadline counts whenever the roll waits (paused, or waiting for
    /// room), not only while new pods are not up.
    DeadlineAlwaysCounts,
    /// A revert that fails is reverted in turn (its record keeps `auto_revert`, and a failure
    /// reverts whatever rolls back).
    RevertsARevert,
}

/// How a world starts.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub canary: Option<u64>,
    pub auto_revert: bool,
    pub x_replicas: u64,
    /// The roll's new manifest never passes its health check (a bad deploy).
    pub bad_deploy: bool,
    /// The roll is created by an operator during the schedule ([`World::start_roll`]), not
    /// there from the start: the old RC may be moving a pod when it comes.
    pub roll_later: bool,
    /// The farms' assignment rule (every farm of one release, so all agree on it).
    pub rule: Rule,
}

impl Setup {
    /// A setup without a canary, under the default assignment rule.
    pub fn plain(x_replicas: u64, bad_deploy: bool, auto_revert: bool, roll_later: bool) -> Setup {
        Setup {
            canary: None,
            auto_revert,
            x_replicas,
            bad_deploy,
            roll_later,
            rule: Rule::DEFAULT,
        }
    }
}

/// A broken promise, with where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken(pub String);

impl fmt::Display for Broken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The whole model.
#[derive(Debug, Clone)]
pub struct World {
    pub setup: Setup,
    pub kv: Kv,
    pub farms: Vec<Farm>,
    pub pending: Vec<Pending>,
    pub now: u64,
    pub mutant: Option<Mutant>,
    /// Pods taken away, by every farm, as the checker sees them leave the KV at each commit
    /// (not from the window or the charges): (commit tick, farm, its process, how many).
    pub removed: Vec<(u64, usize, u32, u64)>,
    pub broken: Vec<Broken>,
    /// Whether the roll was ever started.
    pub rolled: bool,
    /// RCs an operator enabled or disabled by hand (`rcctl rc enable|disable`): the flag as it
    /// was before, and as the operator left it. Once the faults stop the operator undoes it
    /// (`calm`), unless a write since made the flag what it is.
    pub flipped: BTreeMap<Which, (bool, bool)>,
    next_transfer: u64,
    rc_cache: HashMap<RcShape, Arc<Rc>>,
}

/// What an RC record says, as far as the planners read it: which, desired, disabled, retired.
type RcShape = (Which, u64, bool, Option<(Which, u64)>);

fn base() -> std::time::Instant {
    static BASE: OnceLock<std::time::Instant> = OnceLock::new();
    *BASE.get_or_init(std::time::Instant::now)
}

/// The instant of model tick `t` (one tick a second).
pub fn at(t: u64) -> Instant {
    Instant::from_std(base() + Duration::from_secs(t))
}

fn node_name(n: usize) -> NodeName {
    NodeName::from(format!("n{n}"))
}

fn node_index(name: &str) -> usize {
    name.trim_start_matches('n').parse().unwrap_or(usize::MAX)
}

impl World {
    pub fn new(setup: Setup, mutant: Option<Mutant>) -> World {
        World::with_nodes(setup, mutant, NODES)
    }

    /// A world of `nodes` nodes (at least 3: O runs on the first two, X on the next ones).
    pub fn with_nodes(setup: Setup, mutant: Option<Mutant>, nodes: usize) -> World {
        let mut kv = Kv {
            nodes: (0..nodes)
                .map(|_| NodeState {
                    eligible: true,
                    ..NodeState::default()
                })
                .collect(),
            ..Kv::default()
        };
        let v = kv.next();
        kv.rcs.insert(
            Which::O,
            RcRec {
                desired: 2,
                disabled: false,
                version: v,
                retire: None,
            },
        );
        kv.rcs.insert(
            Which::N,
            RcRec {
                desired: 0,
                disabled: true,
                version: v,
                retire: None,
            },
        );
        kv.rcs.insert(
            Which::X,
            RcRec {
                desired: setup.x_replicas,
                disabled: false,
                version: v,
                retire: None,
            },
        );
        // The old RC runs on n0 and n1, up; X on n2 if it wants a pod.
        let place = |kv: &mut Kv, n: usize, w: Which| {
            let v = kv.next();
            kv.nodes[n].pod = Some(Pod {
                owner: w,
                intent: w,
                version: v,
            });
            let rv = kv.next();
            kv.nodes[n].reality = Some((w, rv));
            let hv = kv.next();
            kv.nodes[n].health = Some((true, hv));
        };
        place(&mut kv, 0, Which::O);
        place(&mut kv, 1, Which::O);
        for n in 0..(setup.x_replicas as usize).min(nodes.saturating_sub(2)) {
            place(&mut kv, 2 + n, Which::X);
        }
        let mut world = World {
            setup,
            kv,
            farms: (0..FARMS)
                .map(|f| Farm {
                    session: Session(f as u8, 0),
                    incarnation: 0,
                    tasks: BTreeMap::new(),
                    roll_task: None,
                    unheld_since: HashMap::new(),
                    roll_unheld_since: HashMap::new(),
                })
                .collect(),
            pending: Vec::new(),
            now: 0,
            mutant,
            removed: Vec::new(),
            broken: Vec::new(),
            rolled: false,
            flipped: BTreeMap::new(),
            next_transfer: 0,
            rc_cache: HashMap::new(),
        };
        if !setup.roll_later {
            world.start_roll();
        }
        world
    }

    /// An operator starts the roll O → N (`rcctl roll start`). `false`: it exists already.
    pub fn start_roll(&mut self) -> bool {
        if self.rolled || self.kv.roll.is_some() || !self.kv.rcs.contains_key(&Which::O) {
            return false;
        }
        self.rolled = true;
        let rv = self.kv.next();
        self.kv.roll = Some(RollRec {
            old: Which::O,
            new: Which::N,
            target: 2,
            minimum: 1,
            version: rv,
            started: false,
            paused: false,
            canary: self.setup.canary,
            failed: false,
            auto_revert: self.setup.auto_revert,
            revert_of: false,
            control_version: rv,
        });
        true
    }

    /// How many nodes the world has.
    pub fn nodes(&self) -> usize {
        self.kv.nodes.len()
    }

    fn break_(&mut self, what: String) {
        self.broken.push(Broken(what));
    }

    /// The RC record as rcfarm parses it.
    fn rc(&mut self, w: Which) -> Option<Arc<Rc>> {
        let r = self.kv.rcs.get(&w)?.clone();
        let key = (w, r.desired, r.disabled, r.retire);
        if let Some(rc) = self.rc_cache.get(&key) {
            // The version is what guards use; the parsed record's index only names it.
            return Some(rc.clone());
        }
        let mut json = serde_json::json!({
            "id": w.id().to_string(),
            "manifest": w.manifest(),
            "node_selector": "",
            "pod_labels": {},
            "replicas_desired": r.desired,
            "disabled": r.disabled,
            "allocation_strategy": "dynamic_strategy",
        });
        if let Some((roll, replicas)) = r.retire {
            json[crate::rc::RETIRE_MARKER] =
                serde_json::json!({"roll": roll.id().to_string(), "replicas": replicas});
        }
        let rc = Arc::new(
            Rc::from_kv(&w.id().key(), json.to_string().as_bytes(), 1)
                .unwrap_or_else(|e| unreachable!("the model's RCs are valid: {e:?}")),
        );
        self.rc_cache.insert(key, rc.clone());
        Some(rc)
    }

    fn health_of(&self, n: usize) -> Option<HealthStatus> {
        self.kv.nodes[n].health.map(|(passing, _)| {
            if passing {
                HealthStatus::Passing
            } else {
                HealthStatus::Critical
            }
        })
    }

    fn fresh_health(&self, n: usize) -> Option<HealthStatus> {
        let node = &self.kv.nodes[n];
        match (node.health, node.reality) {
            (Some((_, hv)), Some((_, rv))) if hv > rv => self.health_of(n),
            _ => None,
        }
    }

    // ---- the RC task ----------------------------------------------------------------------

    /// One pass of farm `f`'s task of `w`, up to the first write it plans (kept pending) or
    /// until it has nothing to do. `None`: nothing happened.
    pub fn rc_pass(&mut self, f: usize, w: Which) -> Option<String> {
        if !self.farms[f].tasks.contains_key(&w)
            || self
                .pending
                .iter()
                .any(|p| p.farm == f && p.writer == Some(w))
        {
            return None;
        }
        let Some(rc) = self.rc(w) else {
            // Its key is gone: the task stops (the farm gives the lock back).
            self.farms[f].tasks.remove(&w);
            return Some(format!("f{f} {w:?}: RC gone, task stops"));
        };
        let session = self.farms[f].session;
        // The transfer in flight, learnt once; its start carried over from the record.
        let task = self.farms[f].tasks.get_mut(&w)?;
        if !task.transfer_loaded {
            task.transfer_loaded = true;
            task.transfer_started = self.kv.transfer.get(&w).map(|t| t.started);
        }
        let transfer = self.kv.transfer.get(&w).copied();
        if transfer.is_none()
            && self.mutant != Some(Mutant::KeepsTransferLock)
            && self.kv.mut_lock.get(&w) == Some(&(session, Holder::Transfer))
        {
            // Left over from a transfer that ended: released (a write of its own).
            self.kv.mut_lock.remove(&w);
            self.kv.next();
            return Some(format!("f{f} {w:?}: released its transfer's mutation lock"));
        }
        let mut allocation_exhausted = false;
        let mut mutation_locked = false;
        for _ in 0..16 {
            let o = self.observe(f, w, &rc, allocation_exhausted, mutation_locked);
            let p = rcplan::plan(&o);
            let action = p.actions.first().cloned()?;
            // The cluster's removal window: the action is capped to the room the farm reads in
            // it now; the commit charges what its writes remove, and is refused if another
            // farm spent that room meanwhile.
            let mut cost = removals(&action, &o);
            if self.mutant == Some(Mutant::UnchargedScaleDown)
                && matches!(action, Action::Unschedule(_))
            {
                cost.counted.clear();
            }
            let granted = (cost.counted.len() as u64).min(self.kv.room(self.now));
            let action = within_grant(action, &cost, granted as usize)?;
            let counted: BTreeSet<NodeName> = cost
                .counted
                .iter()
                .take(granted as usize)
                .cloned()
                .collect();
            // The mutation lock: only what starts waits for it (unless told otherwise).
            let needs_lock = needs_mutation_lock(&action)
                || (self.mutant == Some(Mutant::FinishNeedsLock)
                    && matches!(
                        action,
                        Action::CompleteTransfer | Action::RollbackTransfer(_)
                    ));
            if needs_lock {
                let frozen = self.kv.nt_lock.contains_key(&w);
                let ours = self.kv.mut_lock.get(&w) == Some(&(session, Holder::Transfer));
                let free = !self.kv.mut_lock.contains_key(&w);
                if frozen || !(ours || free) {
                    if frozen {
                        return None;
                    }
                    mutation_locked = true;
                    continue;
                }
                if free {
                    self.kv.mut_lock.insert(w, (session, Holder::Transfer));
                    self.kv.next();
                }
            }
            let labels = |world: &World, n: usize| {
                if world.mutant == Some(Mutant::LabelsGuardedAtCommit) {
                    None
                } else {
                    Some(Guard::Label(n, world.kv.nodes[n].pod.map(|p| p.version)))
                }
            };
            let mut pend = Pending {
                farm: f,
                incarnation: self.farms[f].incarnation,
                session,
                fence: Some(w),
                guards: if self.mutant == Some(Mutant::UnguardedRcWrites) {
                    Vec::new()
                } else {
                    vec![Guard::RcVersion(w, self.kv.rcs[&w].version)]
                },
                writes: Vec::new(),
                charge: 0,
                writer: Some(w),
                release_transfer_lock: false,
                what: format!("f{f} {w:?}: {action:?}"),
                up_at_plan: (0..self.nodes()).filter(|n| self.kv.up(*n)).collect(),
            };
            let mut removed = 0;
            match &action {
                Action::Schedule(t) | Action::Replace(t) | Action::Repair(t) => {
                    for n in t {
                        let i = node_index(n);
                        pend.guards.extend(labels(self, i));
                        pend.writes.push(Write::SetPod { node: i, owner: w });
                        removed += u64::from(counted.contains(n));
                    }
                }
                Action::Unschedule(t) => {
                    for n in t {
                        let i = node_index(n);
                        pend.guards.extend(labels(self, i));
                        pend.writes.push(Write::DeletePod { node: i });
                        removed += u64::from(counted.contains(n));
                    }
                }
                Action::Allocate(_) => {
                    // The label scheduler allocates nothing.
                    allocation_exhausted = true;
                    continue;
                }
                Action::StartTransfer { old, new } => {
                    let Some(new) = new else {
                        // Nothing to allocate: the lock goes back.
                        if self.kv.mut_lock.get(&w) == Some(&(session, Holder::Transfer)) {
                            self.kv.mut_lock.remove(&w);
                            self.kv.next();
                        }
                        allocation_exhausted = true;
                        continue;
                    };
                    let i = node_index(new);
                    self.next_transfer += 1;
                    pend.guards.push(Guard::MutLockHeld(w, session));
                    pend.guards.push(Guard::StatusAbsent(w));
                    pend.guards.extend(labels(self, i));
                    pend.writes.push(Write::SetTransfer(
                        w,
                        TransferRec {
                            old: node_index(old),
                            new: i,
                            started: self.now,
                            id: self.next_transfer,
                        },
                    ));
                    pend.writes.push(Write::SetPod { node: i, owner: w });
                }
                Action::CompleteTransfer | Action::RollbackTransfer(_) => {
                    let t = transfer?;
                    let drop = if matches!(action, Action::CompleteTransfer) {
                        t.old
                    } else {
                        t.new
                    };
                    pend.writes.push(Write::DeleteTransfer(w));
                    if self.kv.nodes[drop].pod.is_some_and(|p| p.owner == w) {
                        pend.guards.extend(labels(self, drop));
                        pend.writes.push(Write::DeletePod { node: drop });
                    }
                    pend.release_transfer_lock = true;
                }
            }
            // Charged only what the writes remove.
            pend.charge = removed;
            self.pending.push(pend);
            return Some(format!("f{f} {w:?}: planned {action:?}"));
        }
        None
    }

    /// What farm `f`'s task of `w` sees (the real planner's input).
    fn observe<'a>(
        &self,
        f: usize,
        w: Which,
        rc: &'a Rc,
        allocation_exhausted: bool,
        mutation_locked: bool,
    ) -> Observed<'a> {
        let session = self.farms[f].session;
        let current: BTreeMap<NodeName, String> = self
            .kv
            .pods_of(w)
            .into_iter()
            .map(|n| (node_name(n), "web".to_string()))
            .collect();
        let eligible: NodeSet = (0..self.nodes())
            .filter(|n| self.kv.nodes[*n].eligible)
            .map(node_name)
            .collect();
        let transfer = self.kv.transfer.get(&w).copied();
        let mut health: BTreeMap<NodeName, HealthStatus> = (0..self.nodes())
            .filter_map(|n| self.health_of(n).map(|h| (node_name(n), h)))
            .collect();
        let health_in_use = !health.is_empty();
        if let Some(t) = transfer
            && self.fresh_health(t.new).is_none()
        {
            health.remove(&node_name(t.new));
        }
        let bad_intents: BTreeSet<NodeName> = self
            .kv
            .pods_of(w)
            .into_iter()
            .filter(|n| self.kv.nodes[*n].pod.is_some_and(|p| p.intent != w))
            .map(node_name)
            .collect();
        let mut others: BTreeMap<String, Vec<(bool, NodeName)>> = BTreeMap::new();
        for n in 0..self.nodes() {
            if let Some(p) = self.kv.nodes[n].pod
                && p.owner != w
            {
                others.entry(p.owner.id().to_string()).or_default().push((
                    self.health_of(n) == Some(HealthStatus::Passing),
                    node_name(n),
                ));
            }
        }
        let any_takeover = self.mutant == Some(Mutant::AnyTakeover);
        let nb = neighbours(
            others,
            |owner| {
                let g = Which::of(RcId::parse(owner).ok()?)?;
                let r = self.kv.rcs.get(&g)?;
                Some((g.id(), r.disabled, r.desired))
            },
            |g| any_takeover || Which::of(g).is_some_and(|g| self.kv.rolled_onto(g, w)),
        );
        let retiring = self.kv.rcs[&w].retire.is_some_and(|(roll, replicas)| {
            replicas == self.kv.rcs[&w].desired
                && !self.kv.rcs[&w].disabled
                && self
                    .kv
                    .roll
                    .as_ref()
                    .is_some_and(|r| r.id() == roll && r.old == w)
        });
        let started = self.farms[f]
            .tasks
            .get(&w)
            .and_then(|t| t.transfer_started)
            .unwrap_or(self.now);
        Observed {
            rc,
            current,
            eligible,
            health,
            health_in_use,
            runs_other: bad_intents.clone(),
            bad_intents,
            transfer: transfer.map(|t| Transfer {
                old_node: node_name(t.old),
                new_node: node_name(t.new),
                id: t.id.to_string(),
                started_at: None,
            }),
            takeover: nb.takeover,
            occupied: nb.occupied,
            labels_seen: BTreeMap::new(),
            allocation_exhausted,
            mutation_locked_elsewhere: mutation_locked
                || self
                    .kv
                    .mut_lock
                    .get(&w)
                    .is_some_and(|h| *h != (session, Holder::Transfer)),
            transfer_static: false,
            transfer_frozen: self.kv.nt_lock.get(&w).map(|s| s.name()),
            transfer_age: Duration::from_secs(self.now.saturating_sub(started)),
            transfer_timeout: Duration::from_secs(TRANSFER_TIMEOUT),
            retiring,
            // Before issue 36 a roll's RCs started transfers like any other.
            in_roll: self
                .kv
                .roll
                .as_ref()
                .filter(|r| r.old == w || r.new == w)
                .filter(|_| self.mutant != Some(Mutant::FinishNeedsLock))
                .map(|r| format!("rolling update {:?}", r.id())),
        }
    }

    // ---- the roll task ------------------------------------------------------------------------

    fn counts(&mut self, w: Which) -> Option<RcCounts> {
        let rc = self.rc(w)?;
        let pods: Vec<(Option<String>, Option<HealthStatus>)> = self
            .kv
            .pods_of(w)
            .into_iter()
            .map(|n| {
                let runs = self.kv.nodes[n].reality.map(|(m, _)| {
                    // What the node runs, as a digest the RC can compare with its own.
                    self.rc_digest(m)
                });
                (runs, self.fresh_health(n))
            })
            .collect();
        Some(RcCounts::count(
            rc.replicas_desired,
            rc.disabled,
            rc.manifest.digest(),
            pods,
        ))
    }

    fn rc_digest(&self, m: Which) -> String {
        crate::rc::Manifest::parse(m.manifest())
            .map(|x| x.digest().to_string())
            .unwrap_or_default()
    }

    /// One pass of farm `f`'s roll task, up to the first write it plans. `None`: nothing.
    pub fn roll_pass(&mut self, f: usize) -> Option<String> {
        self.farms[f].roll_task.as_ref()?;
        if self
            .pending
            .iter()
            .any(|p| p.farm == f && p.fence.is_none())
        {
            return None;
        }
        let Some(roll) = self.kv.roll.clone() else {
            self.farms[f].roll_task = None;
            return Some(format!("f{f}: roll gone, task stops"));
        };
        let session = self.farms[f].session;
        let old = self.counts(roll.old);
        let new = self.counts(roll.new);
        let lock = |w: Which| match self.kv.mut_lock.get(&w) {
            None => LockState::Free,
            Some((s, Holder::Roll(r))) if *s == session && *r == roll.id() => LockState::Ours,
            Some((s, h)) => LockState::Elsewhere(format!("{} {h:?}", s.name())),
        };
        // Before issue 36 a roll took the mutation locks whatever transfer was in flight.
        let transfer = [roll.old, roll.new]
            .into_iter()
            .find(|w| self.kv.transfer.contains_key(w))
            .filter(|_| self.mutant != Some(Mutant::FinishNeedsLock))
            .map(|w| format!("a node transfer is in flight on {w:?}"));
        let update = Update {
            old_rc: roll.old.id(),
            new_rc: roll.new.id(),
            desired_replicas: roll.target,
            minimum_replicas: if self.mutant == Some(Mutant::IgnoresMinimum) {
                0
            } else {
                roll.minimum
            },
            leave_old: false,
            roll_delay: Duration::ZERO,
        };
        // The room the cluster's window has, as the farm reads it now.
        let room = self.kv.room(self.now);
        let task = self.farms[f].roll_task.clone().unwrap_or_default();
        let o = RollObserved {
            update: &update,
            old: old.ok_or_else(|| "does not exist".to_string()),
            new: new.ok_or_else(|| "does not exist".to_string()),
            old_lock: lock(roll.old),
            new_lock: lock(roll.new),
            conflict: None,
            transfer,
            ready_for: Duration::from_secs(
                task.ready_since.map_or(0, |t| self.now.saturating_sub(t)),
            ),
            started: roll.started,
            old_missing: !self.kv.rcs.contains_key(&roll.old),
            paused: roll.paused.then(|| "paused".to_string()),
            max_parallel: None,
            failed: roll.failed.then(|| "failed".to_string()),
            canary: roll.canary,
            removal_room: Some((room, "removals held".to_string())),
            tripped: None,
            old_served_by: None,
        };
        let planned = crate::roll::plan(&o);
        let mut task = task;
        if planned.step_ready {
            task.ready_since.get_or_insert(self.now);
        } else {
            task.ready_since = None;
        }
        // The progress deadline, as the worker keeps it.
        let up = new.map_or(0, |c| c.healthy);
        match task.best_new_up {
            None => task.best_new_up = Some(up),
            Some(b) if up > b => {
                task.best_new_up = Some(up);
                task.deadline_spent = 0;
                task.counting_since = None;
            }
            _ => {}
        }
        let mut fail = false;
        if planned.action.is_none() {
            let clock = if self.mutant == Some(Mutant::DeadlineAlwaysCounts) {
                DeadlineClock::Count
            } else {
                deadline_clock(planned.waiting.as_ref().map(|w| w.0), new)
            };
            match clock {
                DeadlineClock::Restart => {
                    task.deadline_spent = 0;
                    task.counting_since = None;
                }
                DeadlineClock::Pause => {
                    if let Some(s) = task.counting_since.take() {
                        task.deadline_spent += self.now - s;
                    }
                }
                DeadlineClock::Count => {
                    let s = *task.counting_since.get_or_insert(self.now);
                    fail = task.deadline_spent + (self.now - s) >= ROLL_DEADLINE;
                }
            }
        }
        self.farms[f].roll_task = Some(task);
        let mut pend = Pending {
            farm: f,
            incarnation: self.farms[f].incarnation,
            session,
            fence: None,
            guards: vec![
                Guard::RollVersion(roll.version),
                Guard::ControlVersion(roll.control_version),
            ],
            writes: Vec::new(),
            charge: 0,
            writer: None,
            release_transfer_lock: false,
            what: String::new(),
            up_at_plan: (0..self.nodes()).filter(|n| self.kv.up(*n)).collect(),
        };
        if fail {
            if new.is_some_and(|c| c.healthy >= c.desired) {
                self.break_(format!(
                    "roll {:?} failed with all {} of its scheduled new pods up",
                    roll.id(),
                    new.map_or(0, |c| c.desired)
                ));
            }
            let mut r = roll.clone();
            let reverts = self.mutant == Some(Mutant::RevertsARevert) || !r.revert_of;
            if r.auto_revert && reverts {
                // Replaced by its revert: the roll back to the old RC, under the same minimum.
                let v = self.kv.index + 1;
                r = RollRec {
                    old: roll.new,
                    new: roll.old,
                    target: roll.target,
                    minimum: roll.minimum,
                    version: v,
                    started: false,
                    paused: false,
                    canary: None,
                    failed: false,
                    auto_revert: self.mutant == Some(Mutant::RevertsARevert),
                    revert_of: true,
                    control_version: v,
                };
                for w in [roll.old, roll.new] {
                    if self.kv.mut_lock.get(&w) == Some(&(session, Holder::Roll(roll.id()))) {
                        pend.guards.push(Guard::MutLockHeld(w, session));
                        pend.writes.push(Write::DeleteMutLock(w));
                    }
                }
                pend.writes.push(Write::DeleteRollLock);
                pend.what = format!("f{f}: roll {:?} failed, reverted", roll.id());
            } else {
                r.failed = true;
                pend.what = format!("f{f}: roll {:?} failed", roll.id());
            }
            pend.writes.push(Write::SetRoll(Some(r)));
            self.pending.push(pend);
            return Some(format!("f{f}: roll fails"));
        }
        let action = planned.action?;
        pend.what = format!("f{f}: roll {:?} {action:?}", roll.id());
        let held = |w: Which| Guard::MutLockHeld(w, session);
        let rec = |world: &World, w: Which| world.kv.rcs.get(&w).cloned();
        match action {
            RollAction::Lock => {
                // Both locks, with a CAS on what was seen: atomic.
                for w in [roll.old, roll.new] {
                    match self.kv.mut_lock.get(&w) {
                        None => {
                            self.kv
                                .mut_lock
                                .insert(w, (session, Holder::Roll(roll.id())));
                        }
                        Some((s, Holder::Roll(r))) if *s == session && *r == roll.id() => {}
                        Some(_) => return None,
                    }
                }
                self.kv.next();
                return Some(format!("f{f}: roll took the mutation locks"));
            }
            RollAction::Start {
                disable_old,
                enable_new,
                adopt,
            } => {
                pend.guards.extend([held(roll.old), held(roll.new)]);
                for (w, flip, to, delta) in [
                    (roll.old, disable_old, true, -(adopt as i64)),
                    (roll.new, enable_new, false, adopt as i64),
                ] {
                    if (flip || delta != 0)
                        && let Some(mut r) = rec(self, w)
                    {
                        pend.guards.push(Guard::RcVersion(w, r.version));
                        if flip {
                            r.disabled = to;
                        }
                        r.desired = (r.desired as i64 + delta).max(0) as u64;
                        r.retire = None;
                        pend.writes.push(Write::SetRc(w, r));
                    }
                }
                let mut r = roll.clone();
                r.started = true;
                pend.writes.push(Write::SetRoll(Some(r)));
            }
            RollAction::Step { add, old_to, .. } => {
                pend.guards.extend([held(roll.old), held(roll.new)]);
                if let (Some(mut o), Some(mut n)) = (rec(self, roll.old), rec(self, roll.new)) {
                    pend.guards.push(Guard::RcVersion(roll.old, o.version));
                    pend.guards.push(Guard::RcVersion(roll.new, n.version));
                    o.desired = old_to;
                    o.retire = None;
                    n.desired += add;
                    n.retire = None;
                    pend.writes.push(Write::SetRc(roll.old, o));
                    pend.writes.push(Write::SetRc(roll.new, n));
                }
            }
            RollAction::RetireOld { old_to, charge } => {
                // The old RC's lost capacity (the planner capped it to the room it was shown),
                // charged in the retirement's own transaction.
                pend.charge = charge;
                pend.guards.extend([held(roll.old), held(roll.new)]);
                if let Some(mut o) = rec(self, roll.old) {
                    pend.guards.push(Guard::RcVersion(roll.old, o.version));
                    o.desired = old_to;
                    o.disabled = false;
                    o.retire = Some((roll.id(), old_to));
                    pend.writes.push(Write::SetRc(roll.old, o));
                }
            }
            RollAction::Complete => {
                pend.guards.extend([held(roll.old), held(roll.new)]);
                if let Some(o) = rec(self, roll.old) {
                    pend.guards.push(Guard::RcVersion(roll.old, o.version));
                }
                pend.writes.extend([
                    Write::SetRoll(None),
                    Write::DeleteMutLock(roll.old),
                    Write::DeleteMutLock(roll.new),
                    Write::DeleteRc(roll.old),
                    Write::DeleteTransfer(roll.old),
                    Write::DeleteRollLock,
                ]);
            }
            RollAction::DeleteOrphan => {
                pend.writes
                    .extend([Write::SetRoll(None), Write::DeleteRollLock]);
            }
            RollAction::CanaryPause { .. } => {
                let mut r = roll.clone();
                r.paused = true;
                pend.writes.push(Write::SetRoll(Some(r)));
            }
        }
        self.pending.push(pend);
        Some(format!("f{f}: roll planned"))
    }

    // ---- commits ------------------------------------------------------------------------------

    /// Commits pending write `i` if its fence and guards hold; refuses it otherwise. Checks the
    /// promises on what it changed.
    pub fn commit(&mut self, i: usize) -> String {
        let p = self.pending.remove(i);
        let fenced = match p.fence {
            Some(w) => self.kv.own_lock.get(&w) == Some(&p.session),
            None => self.kv.roll_lock == Some(p.session),
        };
        let guards_hold = p.guards.iter().all(|g| match g {
            Guard::RcVersion(w, v) => self.kv.rcs.get(w).is_some_and(|r| r.version == *v),
            Guard::Label(n, v) => self.kv.nodes[*n].pod.map(|p| p.version) == *v,
            Guard::MutLockHeld(w, s) => self.kv.mut_lock.get(w).is_some_and(|h| h.0 == *s),
            Guard::StatusAbsent(w) => !self.kv.transfer.contains_key(w),
            Guard::RollVersion(v) => self.kv.roll.as_ref().is_some_and(|r| r.version == *v),
            Guard::ControlVersion(v) => self
                .kv
                .roll
                .as_ref()
                .is_some_and(|r| r.control_version == *v),
        });
        if !fenced || !guards_hold {
            // Refused: nothing applied, nothing charged.
            return format!(
                "refused ({}): {}",
                if fenced { "stale" } else { "fenced" },
                p.what
            );
        }
        // The charge, in the same transaction: a `cas` on the window key with the charged
        // value (a farm whose `cas` loses reads the key again and charges the newer version
        // while there is room). No room: the whole transaction is refused, as a failed guard
        // refuses it.
        let charged = if p.charge == 0 {
            None
        } else if self.mutant == Some(Mutant::BlindCharge) {
            let blind = Settings {
                max_removals: MaxRemovals::Off,
                ..budget()
            };
            self.kv
                .window
                .charge(blind, self.now as i64, p.charge, None)
                .ok()
        } else {
            match self
                .kv
                .window
                .charge(budget(), self.now as i64, p.charge, None)
            {
                Ok(w) => Some(w),
                Err(room) => {
                    return format!(
                        "refused (uncharged: {} removals, room {room}): {}",
                        p.charge, p.what
                    );
                }
            }
        };
        let f = p.farm;
        let before = self.kv.clone();
        let index = self.kv.next();
        if let Some(w) = charged {
            self.kv.window = w;
            self.kv.window_version = index;
        }
        for wr in &p.writes {
            match wr {
                Write::SetPod { node, owner } => {
                    self.kv.nodes[*node].pod = Some(Pod {
                        owner: *owner,
                        intent: *owner,
                        version: index,
                    })
                }
                Write::DeletePod { node } => self.kv.nodes[*node].pod = None,
                Write::SetTransfer(w, t) => {
                    self.kv.transfer.insert(*w, *t);
                }
                Write::DeleteTransfer(w) => {
                    self.kv.transfer.remove(w);
                }
                Write::SetRc(w, r) => {
                    let mut r = r.clone();
                    r.version = index;
                    self.kv.rcs.insert(*w, r);
                }
                Write::DeleteRc(w) => {
                    self.kv.rcs.remove(w);
                }
                Write::SetRoll(r) => {
                    self.kv.roll = r.clone().map(|mut r| {
                        r.version = index;
                        r.control_version = index;
                        r
                    });
                }
                Write::DeleteMutLock(w) => {
                    self.kv.mut_lock.remove(w);
                }
                Write::DeleteRollLock => self.kv.roll_lock = None,
            }
        }
        if p.release_transfer_lock
            && self.mutant != Some(Mutant::KeepsTransferLock)
            && let Some(w) = p.writer
            && self.kv.mut_lock.get(&w) == Some(&(p.session, Holder::Transfer))
        {
            self.kv.mut_lock.remove(&w);
        }
        let left = self.pods_that_left(&before, &p);
        if left > 0 {
            self.removed.push((self.now, f, p.incarnation, left));
        }
        self.check_commit(&before, &p, left);
        format!("committed: {}", p.what)
    }

    /// The pods a commit took away, from what the KV held before and holds now, not from
    /// what the farm charged: a pod whose intent went or now asks for another manifest (what
    /// ran there is stopped), but for a node transfer's end (the RC keeps its count: the
    /// transfer's other pod stays), a roll's old RC giving up pods the roll retired (its
    /// retirement paid for the capacity it loses), and a roll's new RC taking its old RC's
    /// pod over (a roll's steps are never held by the window).
    fn pods_that_left(&self, before: &Kv, p: &Pending) -> u64 {
        let mut left = 0;
        for n in 0..self.nodes() {
            let Some(b) = before.nodes[n].pod else {
                continue;
            };
            let after = self.kv.nodes[n].pod;
            if after.is_some_and(|a| a.intent == b.intent) {
                continue;
            }
            let transfer_end = before.transfer.contains_key(&b.owner)
                && p.writes.contains(&Write::DeleteTransfer(b.owner));
            let retired = before.rcs.get(&b.owner).is_some_and(|r| {
                r.retire.is_some_and(|(roll, _)| {
                    before
                        .roll
                        .as_ref()
                        .is_some_and(|x| x.id() == roll && x.old == b.owner)
                })
            });
            let taken_over = after.is_some_and(|a| before.rolled_onto(b.owner, a.owner));
            if !(transfer_end || retired || taken_over) {
                left += 1;
            }
        }
        left
    }

    /// The promises a commit keeps: only an RC's own task writes its pods (but for the roll's
    /// takeover of given-up pods), no RC raised above its count, no roll's pods up taken below
    /// its minimum, no more counted removals by all farms together within a window than the
    /// cluster's limit.
    fn check_commit(&mut self, before: &Kv, p: &Pending, left: u64) {
        if let Some(w) = p.writer {
            for wr in &p.writes {
                let n = match wr {
                    Write::SetPod { node, .. } | Write::DeletePod { node } => *node,
                    _ => continue,
                };
                let Some(b) = before.nodes[n].pod.map(|p| p.owner) else {
                    continue;
                };
                if b == w {
                    continue;
                }
                let surplus = before
                    .rcs
                    .get(&b)
                    .is_some_and(|r| r.disabled && before.pods_of(b).len() as u64 > r.desired);
                if !(surplus && before.rolled_onto(b, w)) {
                    self.break_(format!(
                        "{w:?}'s task wrote the pod of {b:?} on n{n}: a write to {b:?}'s pods not fenced by {b:?}'s lock ({})",
                        p.what
                    ));
                }
            }
            let count = self.kv.pods_of(w).len() as u64;
            let limit = self.kv.rcs.get(&w).map_or(0, |r| r.desired)
                + u64::from(self.kv.transfer.contains_key(&w));
            if count > before.pods_of(w).len() as u64 && count > limit {
                self.break_(format!("{w:?} raised to {count} pods, above {limit}"));
            }
        }
        if let Some(roll) = &before.roll
            && roll.started
        {
            // Pods up as the write was planned, and which of those it leaves up.
            let written: BTreeSet<usize> = p
                .writes
                .iter()
                .filter_map(|wr| match wr {
                    Write::SetPod { node, .. } | Write::DeletePod { node } => Some(*node),
                    _ => None,
                })
                .collect();
            let up = |kv: &Kv, keep: &dyn Fn(usize) -> bool| {
                [roll.old, roll.new]
                    .iter()
                    .flat_map(|w| kv.pods_of(*w))
                    .filter(|n| p.up_at_plan.contains(n) && keep(*n))
                    .count() as u64
            };
            let (was, is) = (
                up(before, &|_| true),
                up(&self.kv, &|n| !written.contains(&n)),
            );
            if is < was && is < roll.minimum {
                self.break_(format!(
                    "roll {:?}: a farm's write took its pods up from {was} to {is}, below its minimum {} ({})",
                    roll.id(),
                    roll.minimum,
                    p.what
                ));
            }
        }
        // The cluster's limit, from the log of commits (not from the window): every farm and
        // every process of it together, within the window of BUDGET_WINDOW ticks ending now
        // (time only goes forward, so checking the window ending at each commit checks every
        // window).
        if left > 0 {
            let recent: Vec<&(u64, usize, u32, u64)> = self
                .removed
                .iter()
                .filter(|(t, ..)| self.now - *t < BUDGET_WINDOW)
                .collect();
            let in_window: u64 = recent.iter().map(|(.., n)| n).sum();
            if in_window > BUDGET_LIMIT {
                let by: Vec<String> = recent
                    .iter()
                    .map(|(t, f, i, n)| format!("f{f} (process {i}) {n} at tick {t}"))
                    .collect();
                self.break_(format!(
                    "the farms removed {in_window} pods within {BUDGET_WINDOW} ticks ({}), above the cluster's limit of {BUDGET_LIMIT}",
                    by.join(", ")
                ));
            }
        }
        if let (Some(b), Some(a)) = (&before.roll, &self.kv.roll)
            && b.revert_of
            && a.revert_of
            && a.old == b.new
            && a.new == b.old
            && a.version != b.version
        {
            self.break_("a revert was reverted".into());
        }
    }

    // ---- ownership ----------------------------------------------------------------------------

    /// Farm `f`'s ownership reconcile, with rcfarm's decisions (`farm::decide`): stops, claims,
    /// starts and handovers of RCs and of the roll. Returns what it did, if anything.
    pub fn farm_pass(&mut self, f: usize) -> Option<String> {
        let mut did = Vec::new();
        let session = self.farms[f].session;
        let now = at(self.now);
        let rules = Rules {
            grace: Duration::from_secs(CLAIM_GRACE),
            slack: 1,
        };
        let no = |_: &RcId| false;
        // RCs.
        {
            let locks: BTreeMap<RcId, Session> =
                self.kv.own_lock.iter().map(|(w, s)| (w.id(), *s)).collect();
            let all: BTreeSet<RcId> = self.kv.rcs.keys().map(|w| w.id()).collect();
            let view = DecideView::new(self, f, all, &locks);
            let s = view.situation(now, &no);
            let tasks: BTreeMap<RcId, ()> =
                self.farms[f].tasks.keys().map(|w| (w.id(), ())).collect();
            for (id, why) in decide::stops(&s, &tasks, |_| false) {
                let Some(w) = Which::of(id) else { continue };
                self.farms[f].tasks.remove(&w);
                if matches!(why, Stop::Deleted { release: true })
                    && self.kv.own_lock.get(&w) == Some(&session)
                {
                    self.kv.own_lock.remove(&w);
                }
                did.push(format!("stopped {w:?} ({why:?})"));
            }
            let tasks: BTreeMap<RcId, ()> =
                self.farms[f].tasks.keys().map(|w| (w.id(), ())).collect();
            let mut unheld = std::mem::take(&mut self.farms[f].unheld_since);
            let claims = decide::claims(&s, &tasks, &mut unheld, now, rules);
            self.farms[f].unheld_since = unheld;
            for id in claims.claim {
                let Some(w) = Which::of(id) else { continue };
                if self.kv.own_lock.contains_key(&w) {
                    continue;
                }
                self.kv.own_lock.insert(w, session);
                self.kv.next();
                self.farms[f].tasks.insert(w, RcTask::default());
                did.push(format!("claimed {w:?}"));
            }
            for id in decide::starts(&s, &tasks, std::iter::empty()) {
                let Some(w) = Which::of(id) else { continue };
                self.farms[f].tasks.entry(w).or_default();
            }
            for id in decide::handovers(&s, &tasks, |_| false).now {
                let Some(w) = Which::of(id) else { continue };
                did.push(self.hand_over_rc(f, w));
            }
        }
        // The roll.
        if let Some(roll) = self.kv.roll.clone() {
            let rid = roll.id().id();
            let locks: BTreeMap<RcId, Session> =
                self.kv.roll_lock.iter().map(|s| (rid, *s)).collect();
            let view = DecideView::new(self, f, [rid].into(), &locks);
            let s = view.situation(now, &no);
            let tasks: BTreeMap<RcId, ()> =
                self.farms[f].roll_task.iter().map(|_| (rid, ())).collect();
            if !decide::stops(&s, &tasks, |_| false).is_empty() {
                self.stop_roll_task(f);
                did.push("stopped the roll task".into());
            }
            let tasks: BTreeMap<RcId, ()> =
                self.farms[f].roll_task.iter().map(|_| (rid, ())).collect();
            let mut unheld = std::mem::take(&mut self.farms[f].roll_unheld_since);
            let claims = decide::claims(&s, &tasks, &mut unheld, now, rules);
            self.farms[f].roll_unheld_since = unheld;
            if !claims.claim.is_empty() && self.kv.roll_lock.is_none() {
                self.kv.roll_lock = Some(session);
                self.kv.next();
                self.farms[f].roll_task = Some(RollTask::default());
                did.push("claimed the roll".into());
            }
            if self.kv.roll_lock == Some(session) && self.farms[f].roll_task.is_none() {
                self.farms[f].roll_task = Some(RollTask::default());
            }
            if !decide::handovers(&s, &tasks, |_| false).now.is_empty() {
                did.push(self.hand_over_roll(f));
            }
        } else if self.farms[f].roll_task.is_some() {
            self.stop_roll_task(f);
        }
        // Mutation locks this farm's session holds for what it no longer does.
        let stray: Vec<Which> = self
            .kv
            .mut_lock
            .iter()
            .filter(|(w, (s, h))| {
                *s == session
                    && match h {
                        Holder::Transfer => !self.farms[f].tasks.contains_key(w),
                        Holder::Roll(_) => self.farms[f].roll_task.is_none(),
                        Holder::P2Roller => false,
                    }
            })
            .map(|(w, _)| *w)
            .collect();
        for w in stray {
            self.kv.mut_lock.remove(&w);
            self.kv.next();
            did.push(format!("released a stray mutation lock of {w:?}"));
        }
        (!did.is_empty()).then(|| format!("f{f}: {}", did.join(", ")))
    }

    fn stop_roll_task(&mut self, f: usize) {
        self.farms[f].roll_task = None;
    }

    /// Farm `f` hands RC `w` over: its task stops, its lock is given back.
    pub fn hand_over_rc(&mut self, f: usize, w: Which) -> String {
        let session = self.farms[f].session;
        self.farms[f].tasks.remove(&w);
        if self.kv.own_lock.get(&w) == Some(&session) {
            self.kv.own_lock.remove(&w);
            self.kv.next();
        }
        format!("handed {w:?} over")
    }

    /// Farm `f` hands the roll over, giving back the mutation locks it took for it.
    pub fn hand_over_roll(&mut self, f: usize) -> String {
        let session = self.farms[f].session;
        self.stop_roll_task(f);
        if self.kv.roll_lock == Some(session) {
            self.kv.roll_lock = None;
        }
        self.kv
            .mut_lock
            .retain(|_, (s, h)| !(*s == session && matches!(h, Holder::Roll(_))));
        self.kv.next();
        "handed the roll over".into()
    }

    /// Farm `f` loses its session (`crash`: its process too): every key the session holds goes
    /// (Behavior=delete), its tasks stop; writes it sent may still arrive, and are fenced. The
    /// removal window is the cluster's, in the KV: a restart resets nothing of it.
    pub fn lose_session(&mut self, f: usize, crash: bool) {
        let old = self.farms[f].session;
        self.kv.own_lock.retain(|_, s| *s != old);
        self.kv.mut_lock.retain(|_, (s, _)| *s != old);
        if self.kv.roll_lock == Some(old) {
            self.kv.roll_lock = None;
        }
        self.kv.next();
        let farm = &mut self.farms[f];
        farm.session = Session(old.0, old.1 + 1);
        farm.tasks.clear();
        farm.roll_task = None;
        farm.unheld_since.clear();
        farm.roll_unheld_since.clear();
        if crash {
            farm.incarnation += 1;
        }
    }

    // ---- nodes --------------------------------------------------------------------------------

    /// Node `n`'s agent runs what its intent asks (or stops what has none): reality written,
    /// health critical until it passes.
    pub fn node_acts(&mut self, n: usize) -> Option<String> {
        let node = &self.kv.nodes[n];
        match (node.pod, node.reality) {
            (Some(p), r) if r.map(|(m, _)| m) != Some(p.intent) => {
                let rv = self.kv.next();
                self.kv.nodes[n].reality = Some((p.intent, rv));
                let hv = self.kv.next();
                self.kv.nodes[n].health = Some((false, hv));
                Some(format!("n{n} runs {:?}", p.intent))
            }
            (None, Some(_)) => {
                self.kv.nodes[n].reality = None;
                self.kv.nodes[n].health = None;
                self.kv.next();
                Some(format!("n{n} stopped its pod"))
            }
            _ => None,
        }
    }

    /// Node `n`'s pod passes its health check.
    pub fn node_passes(&mut self, n: usize) -> Option<String> {
        let node = &self.kv.nodes[n];
        let bad = self.setup.bad_deploy && node.reality.is_some_and(|(m, _)| m == Which::N);
        if bad || node.sick || node.health.is_none_or(|(p, _)| p) || node.reality.is_none() {
            return None;
        }
        let hv = self.kv.next();
        self.kv.nodes[n].health = Some((true, hv));
        Some(format!("n{n} passes"))
    }

    /// The RCs' states, for traces.
    pub fn describe(&self) -> String {
        let mut out = Vec::new();
        for (w, r) in &self.kv.rcs {
            out.push(format!(
                "{w:?}: desired {}{}{} pods {:?}{}{}{}",
                r.desired,
                if r.disabled { " disabled" } else { "" },
                r.retire.map_or(String::new(), |(roll, n)| format!(
                    " retired by {roll:?} at {n}"
                )),
                self.kv.pods_of(*w),
                self.kv.transfer.get(w).map_or(String::new(), |t| format!(
                    " transfer n{}→n{}",
                    t.old, t.new
                )),
                self.kv
                    .own_lock
                    .get(w)
                    .map_or(" unowned".into(), |s| format!(" owned by {}", s.name())),
                self.kv
                    .mut_lock
                    .get(w)
                    .map_or(String::new(), |(s, h)| format!(
                        " mutation lock {} {h:?}",
                        s.name()
                    )),
            ));
        }
        if let Some(r) = &self.kv.roll {
            out.push(format!(
                "roll {:?}→{:?} target {} min {}{}{}{}{} lock {}",
                r.old,
                r.new,
                r.target,
                r.minimum,
                if r.started { " started" } else { "" },
                if r.paused { " paused" } else { "" },
                if r.failed { " failed" } else { "" },
                if r.revert_of { " (a revert)" } else { "" },
                r.roll_lock_name(&self.kv),
            ));
        }
        let nodes: Vec<String> = (0..self.nodes())
            .map(|n| {
                let node = &self.kv.nodes[n];
                format!(
                    "n{n}{}: {} runs {} {}",
                    if node.eligible { "" } else { " (ineligible)" },
                    node.pod
                        .map_or("-".into(), |p| format!("{:?}/{:?}", p.owner, p.intent)),
                    node.reality.map_or("-".into(), |(m, _)| format!("{m:?}")),
                    match (node.health, self.kv.up(n)) {
                        (_, true) => "up",
                        (Some((true, _)), false) => "passing (stale)",
                        (Some((false, _)), _) => "critical",
                        (None, _) => "no health",
                    }
                )
            })
            .collect();
        out.push(nodes.join("; "));
        out.push(format!(
            "removal window: {} of {BUDGET_LIMIT} spent at tick {} (version {})",
            self.kv.window.spent(budget(), self.now as i64),
            self.now,
            self.kv.window_version
        ));
        out.join("\n  ")
    }
}

/// What farm `f` sees of one kind of claimed object (RCs, or the roll), as `farm::decide`
/// takes it: every farm serves everything, under the setup's assignment rule.
struct DecideView {
    farm_id: String,
    session: String,
    all: BTreeSet<RcId>,
    holders: BTreeMap<RcId, std::sync::Arc<str>>,
    assignment: crate::farm::claims::Assignment,
    held: HeldIndex,
}

impl DecideView {
    fn new(w: &World, f: usize, all: BTreeSet<RcId>, locks: &BTreeMap<RcId, Session>) -> Self {
        let farm_id = |i: usize| format!("f{i}");
        let views: Vec<FarmView> = (0..FARMS)
            .map(|i| FarmView {
                farm_id: farm_id(i),
                rc_selector: crate::labels::Selector::everything(),
            })
            .collect();
        let farm_of = |s: &Session| (0..FARMS).find(|i| w.farms[*i].session == *s).map(farm_id);
        let holders = locks.iter().map(|(id, s)| (*id, s.name().into())).collect();
        let held_by: BTreeMap<RcId, String> = locks
            .iter()
            .filter_map(|(id, s)| Some((*id, farm_of(s)?)))
            .collect();
        let labels: BTreeMap<RcId, crate::labels::LabelSet> =
            all.iter().map(|id| (*id, Default::default())).collect();
        let session = w.farms[f].session.name();
        let held = HeldIndex::new(&all, &holders, &session);
        DecideView {
            farm_id: farm_id(f),
            assignment: assign_held(&labels, &views, &held_by, w.setup.rule),
            session,
            all,
            holders,
            held,
        }
    }

    fn situation<'a>(&'a self, now: Instant, no: &'a dyn Fn(&RcId) -> bool) -> Situation<'a> {
        Situation {
            farm_id: &self.farm_id,
            session: &self.session,
            all: &self.all,
            matching: &self.all,
            assignment: &self.assignment,
            holders: &self.holders,
            held: &self.held,
            locks_read_at: now,
            claimed: no,
            released: no,
            refused: no,
            finished: no,
        }
    }
}

impl RollRec {
    fn roll_lock_name(&self, kv: &Kv) -> String {
        kv.roll_lock.map_or("none".into(), |s| s.name())
    }
}
