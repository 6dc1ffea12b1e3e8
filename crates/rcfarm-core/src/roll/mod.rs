//! Rolling updates: P2's roll farm (`pkg/roll`), the other half of `p2-rctl-server`. A roll
//! moves replicas from an old RC to a new one (a new manifest, usually) in steps that never
//! take healthy pods below a minimum, then deletes the old RC.
//!
//! - [`record`]: P2's `Update` record at `rolls/<new-rc-id>`, byte for byte.
//! - [`store`]: list, watch, create (P2's `update_creation` protocol), start, abort.
//! - [`plan`]: the pure planner (P2's algorithm) from observed counts to the next action.
//! - [`worker`]: the task that carries a claimed roll out (its writes, fenced transactions,
//!   in `apply`).
//! - [`status`]: what a farm reports about the rolls it carries out.
//! - [`history`]: the revisions replaced RCs leave (`rcfarm/history/<rc-id>`), for undo.

mod apply;
pub mod control;
pub mod history;
pub mod plan;
pub mod record;
pub mod status;
pub mod store;
pub mod worker;

pub use control::{
    CANARY_PAUSER, CONTROL_PREFIX, ControlSeen, RollControl, RollFailure, control_key,
};
pub use history::{DEFAULT_REVISIONS, HISTORY_PREFIX, History, HistorySeen, Revision, history_key};
pub use plan::{
    DeadlineClock, LockState, RcCounts, RollAction, RollObserved, RollPlan, WaitKind,
    deadline_clock, plan, roll_algorithm,
};
pub use record::{
    InvalidRoll, ROLL_LOCK_PREFIX, ROLL_PREFIX, Roll, RollId, RollProblem, Update, roll_key,
    roll_lock_key,
};
pub use status::{RollStatus, RollStatusRegistry};
pub use store::{
    ControlChange, NewRoll, PauseOutcome, RollListing, RollStore, RollStoreError, RollWatch,
    StartRoll, WrittenRoll, update_creation_key,
};
pub use worker::{
    ROLL_HOLDER_PREFIX, RollConfig, RollContext, RollEvent, RollHandle, RollState, STARTED_LABEL,
    reality_key, roll_holder, runs, spawn,
};
