//! The fenced transaction: every write a farm makes under a lock it holds.
//!
//! A transaction is laid out in one fixed order, so no caller can put its fence anywhere but
//! first and no reordering can silently turn a fence into a plain op:
//!
//! | part | ops | fails the commit as |
//! |---|---|---|
//! | the fence | `check-session` on the lock held (op 0), if any | [`FenceError::Fenced`] |
//! | the guards | what the write was planned against (`check-index`, `check-session` on other locks) | [`FenceError::Stale`] |
//! | the charge | a `cas` on a shared counter the write spends from (the cluster's removal window) | [`FenceError::Uncharged`] |
//! | the ops | the writes | [`FenceError::Conflict`] |
//! | the records | create-only audit records (`cas` at index 0) | [`FenceError::AlreadyRecorded`] |
//!
//! When several parts fail at once, the earliest part in that table names the failure: a farm
//! that lost its lock must stop, whatever else moved. [`FencedBatch`] lays several such units
//! out in one all-or-nothing transaction (claims, releases) and says which unit failed how.

use super::client::Consul;
use super::error::ConsulError;
use super::txn::{KvVerb, TxnFailure, TxnOp};
use super::types::SessionId;

/// The lock a write is fenced by: it commits only while `session` holds `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub key: String,
    pub session: SessionId,
}

impl Fence {
    pub fn new(key: impl Into<String>, session: &SessionId) -> Fence {
        Fence {
            key: key.into(),
            session: session.clone(),
        }
    }

    fn op(&self) -> TxnOp {
        TxnOp::check_session(self.key.clone(), &self.session)
    }
}

/// A transaction in four parts (see the module doc). Build it, then [`FencedTxn::commit`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FencedTxn {
    fence: Option<Fence>,
    guards: Vec<TxnOp>,
    charge: Option<TxnOp>,
    ops: Vec<TxnOp>,
    records: Vec<TxnOp>,
}

/// Why a [`FencedTxn`] did not commit.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// The fence's lock is not held by the session any more (or is gone): the writer must
    /// stop; another may own what it wrote for.
    #[error("fenced: this session no longer holds {key}")]
    Fenced { key: String },
    /// A guard failed: something the write was planned against changed. Look again and plan
    /// anew. `guards` are the failed guards' positions among the guards.
    #[error("stale: {what}")]
    Stale {
        guards: Vec<(usize, TxnFailure)>,
        what: String,
    },
    /// The charge's `cas` failed: someone else wrote the counter since it was read. Read it
    /// again and charge anew (nothing of the transaction was applied).
    #[error("uncharged: {what}")]
    Uncharged { what: String },
    /// An op failed (a `cas` on a key someone else wrote, a lock held elsewhere). `ops` are the
    /// failed ops' positions among the ops.
    #[error("conflict: {source}")]
    Conflict {
        ops: Vec<(usize, TxnFailure)>,
        source: ConsulError,
    },
    /// Only create-only records failed, because they exist: a deterministic report another
    /// farm (or an earlier owner) made already.
    #[error("already recorded")]
    AlreadyRecorded,
    /// Not a refusal of the transaction: Consul could not be asked, or refused the request.
    #[error(transparent)]
    Consul(ConsulError),
}

impl FenceError {
    /// Whether the commit may have been applied with its answer lost (a retry is safe: every
    /// part is a check or is idempotent under its guards).
    pub fn is_retryable(&self) -> bool {
        match self {
            FenceError::Consul(e) => e.is_retryable(),
            _ => false,
        }
    }
}

/// How a [`FencedTxn`] was laid out, kept to name a failure after its ops were sent.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    fence: Option<String>,
    guards: usize,
    charge: bool,
    ops: usize,
    records: usize,
}

/// Which part of a [`FencedTxn`] an op index of its laid-out transaction falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Fence,
    Guard(usize),
    Charge,
    Op(usize),
    Record(usize),
}

impl FencedTxn {
    /// A transaction fenced by `fence`.
    pub fn fenced(fence: Fence) -> FencedTxn {
        FencedTxn {
            fence: Some(fence),
            ..FencedTxn::default()
        }
    }

    /// A transaction under no lock: a claim (its `lock` ops are the fence being taken) or a
    /// report any farm may make (a deterministic record alone).
    pub fn unfenced() -> FencedTxn {
        FencedTxn::default()
    }

    pub fn guard(mut self, op: TxnOp) -> Self {
        self.guards.push(op);
        self
    }

    pub fn guards(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.guards.extend(ops);
        self
    }

    pub fn op(mut self, op: TxnOp) -> Self {
        self.ops.push(op);
        self
    }

    /// Sets the charge: a `cas` on a shared counter, checked after the guards (replacing any
    /// charge set before: a transaction spends from one counter once).
    pub fn charge(mut self, op: TxnOp) -> Self {
        self.charge = Some(op);
        self
    }

    pub fn ops(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.ops.extend(ops);
        self
    }

    /// Adds create-only records. A record that is not a create-only `cas` is a caller's bug: it
    /// could overwrite history, so it is refused at commit ([`FenceError::Consul`]).
    pub fn records(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.records.extend(ops);
        self
    }

    pub fn push_op(&mut self, op: TxnOp) {
        self.ops.push(op);
    }

    pub fn extend_ops(&mut self, ops: impl IntoIterator<Item = TxnOp>) {
        self.ops.extend(ops);
    }

    /// The writes, in order.
    pub fn write_ops(&self) -> &[TxnOp] {
        &self.ops
    }

    /// Ops in the laid-out transaction.
    pub fn len(&self) -> usize {
        usize::from(self.fence.is_some())
            + self.guards.len()
            + usize::from(self.charge.is_some())
            + self.ops.len()
            + self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the writes sit in the laid-out transaction.
    #[cfg(test)]
    fn ops_range(&self) -> std::ops::Range<usize> {
        let start = usize::from(self.fence.is_some())
            + self.guards.len()
            + usize::from(self.charge.is_some());
        start..start + self.ops.len()
    }

    fn layout(&self) -> Layout {
        Layout {
            fence: self.fence.as_ref().map(|f| f.key.clone()),
            guards: self.guards.len(),
            charge: self.charge.is_some(),
            ops: self.ops.len(),
            records: self.records.len(),
        }
    }

    /// The transaction as sent, moved out (a write's values are not copied).
    fn into_ops(self) -> (Vec<TxnOp>, Layout) {
        let layout = self.layout();
        let mut all = Vec::with_capacity(self.len());
        all.extend(self.fence.as_ref().map(Fence::op));
        all.extend(self.guards);
        all.extend(self.charge);
        all.extend(self.ops);
        all.extend(self.records);
        (all, layout)
    }

    /// Refuses a record that is not a create-only `cas` (it could overwrite history).
    fn check_records(&self) -> Result<(), ConsulError> {
        match self
            .records
            .iter()
            .find(|r| r.verb != KvVerb::Cas || r.index != 0)
        {
            Some(r) => Err(ConsulError::Config(format!(
                "a record must be a create-only cas; {} on {} is not",
                r.verb.as_str(),
                r.key
            ))),
            None => Ok(()),
        }
    }

    /// Commits all or nothing; the commit index, or why not.
    pub async fn commit(self, consul: &Consul) -> Result<u64, FenceError> {
        self.check_records().map_err(FenceError::Consul)?;
        let (ops, layout) = self.into_ops();
        match consul.txn(&ops).await {
            Ok(resp) => Ok(resp.commit_index()),
            Err(e) => Err(layout.classify(e)),
        }
    }

    /// [`FencedTxn::commit`] through the client's coalescing queue, which joins concurrent
    /// small transactions into one request (each still all or nothing).
    pub async fn commit_coalesced(self, consul: &Consul) -> Result<crate::Committed, FenceError> {
        self.check_records().map_err(FenceError::Consul)?;
        let (ops, layout) = self.into_ops();
        match consul.txn_coalesced(ops).await {
            Ok(committed) => Ok(committed),
            Err(e) => Err(layout.classify(e)),
        }
    }
}

impl Layout {
    fn len(&self) -> usize {
        usize::from(self.fence.is_some())
            + self.guards
            + usize::from(self.charge)
            + self.ops
            + self.records
    }

    fn part(&self, i: usize) -> Option<Part> {
        let mut at = i;
        if self.fence.is_some() {
            if at == 0 {
                return Some(Part::Fence);
            }
            at -= 1;
        }
        if at >= self.guards && self.charge {
            if at == self.guards {
                return Some(Part::Charge);
            }
            at -= 1;
        }
        for (len, part) in [
            (self.guards, Part::Guard as fn(usize) -> Part),
            (self.ops, Part::Op),
            (self.records, Part::Record),
        ] {
            if at < len {
                return Some(part(at));
            }
            at -= len;
        }
        None
    }

    fn classify(&self, e: ConsulError) -> FenceError {
        let failures: Vec<(Part, TxnFailure, String)> = match &e {
            ConsulError::Conflict(errs) => errs
                .iter()
                .filter_map(|x| Some((self.part(x.op_index)?, x.failure(), x.what.clone())))
                .collect(),
            _ => return FenceError::Consul(e),
        };
        if failures.is_empty() {
            return FenceError::Consul(e);
        }
        if failures.iter().any(|(p, f, _)| {
            *p == Part::Fence && matches!(f, TxnFailure::SessionMismatch | TxnFailure::KeyMissing)
        }) {
            return FenceError::Fenced {
                key: self.fence.clone().unwrap_or_default(),
            };
        }
        let guards: Vec<(usize, TxnFailure)> = failures
            .iter()
            .filter_map(|(p, f, _)| match p {
                Part::Guard(g) => Some((*g, *f)),
                _ => None,
            })
            .collect();
        if !guards.is_empty() {
            let what = failures
                .iter()
                .filter(|(p, _, _)| matches!(p, Part::Guard(_)))
                .map(|(_, _, w)| w.as_str())
                .collect::<Vec<_>>()
                .join("; ");
            return FenceError::Stale { guards, what };
        }
        if let Some((_, _, what)) = failures.iter().find(|(p, _, _)| *p == Part::Charge) {
            return FenceError::Uncharged { what: what.clone() };
        }
        let ops: Vec<(usize, TxnFailure)> = failures
            .iter()
            .filter_map(|(p, f, _)| match p {
                Part::Op(o) => Some((*o, *f)),
                _ => None,
            })
            .collect();
        if !ops.is_empty() {
            return FenceError::Conflict { ops, source: e };
        }
        if failures
            .iter()
            .all(|(p, f, _)| matches!(p, Part::Record(_)) && *f == TxnFailure::IndexStale)
        {
            return FenceError::AlreadyRecorded;
        }
        FenceError::Consul(e)
    }
}

/// Several [`FencedTxn`] units in one all-or-nothing transaction: a batch of claims or
/// releases, one unit per object.
#[derive(Debug, Clone, Default)]
pub struct FencedBatch {
    units: Vec<FencedTxn>,
}

/// Why a [`FencedBatch`] did not commit.
#[derive(Debug)]
pub enum BatchError {
    /// Units failed, each named with its failure (by position in the batch); the others were
    /// fine and may be sent again without them.
    Units(Vec<(usize, FenceError)>),
    /// Not a refusal of the transaction.
    Consul(ConsulError),
}

impl FencedBatch {
    pub fn new(units: Vec<FencedTxn>) -> FencedBatch {
        FencedBatch { units }
    }

    pub fn len(&self) -> usize {
        self.units.iter().map(FencedTxn::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// Commits every unit or none; the commit index, or which units failed how.
    pub async fn commit(self, consul: &Consul) -> Result<u64, BatchError> {
        for unit in &self.units {
            unit.check_records().map_err(BatchError::Consul)?;
        }
        let mut ops = Vec::with_capacity(self.len());
        let mut layouts = Vec::with_capacity(self.units.len());
        for unit in self.units {
            let (unit_ops, layout) = unit.into_ops();
            ops.extend(unit_ops);
            layouts.push(layout);
        }
        match consul.txn(&ops).await {
            Ok(resp) => Ok(resp.commit_index()),
            Err(e) => Err(classify_units(&layouts, e)),
        }
    }
}

/// Names each failed unit's failure (units laid out one after another, as `layouts` say) from
/// the batch's failure.
fn classify_units(layouts: &[Layout], e: ConsulError) -> BatchError {
    let ConsulError::Conflict(errs) = &e else {
        return BatchError::Consul(e);
    };
    let mut out = Vec::new();
    let mut start = 0;
    for (u, unit) in layouts.iter().enumerate() {
        let end = start + unit.len();
        let mine: Vec<_> = errs
            .iter()
            .filter(|x| (start..end).contains(&x.op_index))
            .map(|x| super::txn::TxnOpError {
                op_index: x.op_index - start,
                what: x.what.clone(),
            })
            .collect();
        if !mine.is_empty() {
            out.push((u, unit.classify(ConsulError::Conflict(mine))));
        }
        start = end;
    }
    if out.is_empty() {
        return BatchError::Consul(e);
    }
    BatchError::Units(out)
}

#[cfg(test)]
mod tests {
    use super::super::txn::TxnOpError;
    use super::*;

    impl FencedTxn {
        fn to_ops(&self) -> Vec<TxnOp> {
            self.clone().into_ops().0
        }

        fn classify(&self, e: ConsulError) -> FenceError {
            self.layout().classify(e)
        }
    }

    fn session() -> SessionId {
        SessionId::from("s-1")
    }

    fn txn() -> FencedTxn {
        FencedTxn::fenced(Fence::new("lock/a", &session()))
            .guard(TxnOp::check_index("rc/a", 7))
            .guard(TxnOp::check_session("lock/b", &session()))
            .op(TxnOp::set("intent/n/p", b"x".to_vec()))
            .op(TxnOp::cas("labels/pod/n/p", b"{}".to_vec(), 3))
            .records([TxnOp::cas("audit_logs/1", b"{}".to_vec(), 0)])
    }

    fn failed(at: &[(usize, &str)]) -> ConsulError {
        ConsulError::Conflict(
            at.iter()
                .map(|(i, what)| TxnOpError {
                    op_index: *i,
                    what: what.to_string(),
                })
                .collect(),
        )
    }

    const STALE: &str = "failed to set key \"k\", index is stale";
    const MISMATCH: &str = "failed session check for key \"k\", current session \"x\" != \"s-1\"";

    #[test]
    fn lays_out_fence_guards_ops_records_in_that_order() {
        let t = txn();
        let verbs: Vec<KvVerb> = t.to_ops().iter().map(|o| o.verb).collect();
        assert_eq!(
            verbs,
            [
                KvVerb::CheckSession,
                KvVerb::CheckIndex,
                KvVerb::CheckSession,
                KvVerb::Set,
                KvVerb::Cas,
                KvVerb::Cas
            ]
        );
        assert_eq!(t.to_ops()[0].key, "lock/a");
        assert_eq!(t.ops_range(), 3..5);
        assert_eq!(t.len(), 6);
    }

    /// A case, the ops that failed in it (index, Consul's words), and what the commit says.
    type Row = (&'static str, Vec<(usize, &'static str)>, &'static str);

    /// One row per case: which ops failed → what the commit says.
    #[test]
    fn the_earliest_failed_part_names_the_failure() {
        let cases: &[Row] = &[
            ("fence alone", vec![(0, MISMATCH)], "fenced"),
            (
                "fence and a guard: the lock lost wins",
                vec![(0, MISMATCH), (1, STALE)],
                "fenced",
            ),
            ("a guard", vec![(1, STALE)], "stale [(0, IndexStale)]"),
            (
                "the second guard",
                vec![(2, MISMATCH)],
                "stale [(1, SessionMismatch)]",
            ),
            (
                "a guard and an op: planned against the past",
                vec![(1, STALE), (4, STALE)],
                "stale [(0, IndexStale)]",
            ),
            ("an op", vec![(4, STALE)], "conflict [(1, IndexStale)]"),
            (
                "an op and the record",
                vec![(4, STALE), (5, STALE)],
                "conflict [(1, IndexStale)]",
            ),
            ("the record alone", vec![(5, STALE)], "recorded"),
            ("past the end", vec![(9, STALE)], "consul"),
        ];
        for (case, at, want) in cases {
            let got = match txn().classify(failed(at)) {
                FenceError::Fenced { key } => {
                    assert_eq!(key, "lock/a");
                    "fenced".to_string()
                }
                FenceError::Stale { guards, .. } => format!("stale {guards:?}"),
                FenceError::Uncharged { .. } => "uncharged".to_string(),
                FenceError::Conflict { ops, .. } => format!("conflict {ops:?}"),
                FenceError::AlreadyRecorded => "recorded".to_string(),
                FenceError::Consul(_) => "consul".to_string(),
            };
            assert_eq!(&got, want, "{case}");
        }
    }

    /// The charge sits between the guards and the ops: a guard failing names the failure
    /// before it (the plan is stale anyway), it before any op.
    #[test]
    fn a_charge_fails_after_the_guards_and_before_the_ops() {
        let t = || {
            FencedTxn::fenced(Fence::new("lock/a", &session()))
                .guard(TxnOp::check_index("rc/a", 1))
                .charge(TxnOp::cas("rcfarm/removals/window", b"{}".to_vec(), 7))
                .op(TxnOp::set("intent/n/a", b"x".to_vec()))
        };
        assert_eq!(t().len(), 4);
        assert_eq!(t().ops_range(), 3..4);
        assert!(matches!(
            t().classify(failed(&[(2, STALE)])),
            FenceError::Uncharged { .. }
        ));
        assert!(matches!(
            t().classify(failed(&[(1, STALE), (2, STALE)])),
            FenceError::Stale { .. }
        ));
        assert!(matches!(
            t().classify(failed(&[(3, STALE)])),
            FenceError::Conflict { ref ops, .. } if ops == &[(0, TxnFailure::IndexStale)]
        ));
        // The charge is laid out after the guards, whatever the order it was set in.
        let (ops, _) = t().into_ops();
        assert_eq!(ops[2].key, "rcfarm/removals/window");
    }

    #[test]
    fn without_a_fence_op_zero_is_the_first_guard() {
        let t = FencedTxn::unfenced()
            .guard(TxnOp::check_index("rc/a", 1))
            .op(TxnOp::lock("lock/a", b"f".to_vec(), &session()));
        assert!(matches!(
            t.classify(failed(&[(0, STALE)])),
            FenceError::Stale { .. }
        ));
        let record_only =
            FencedTxn::unfenced().records([TxnOp::cas("audit_logs/2", b"{}".to_vec(), 0)]);
        assert!(matches!(
            record_only.classify(failed(&[(0, STALE)])),
            FenceError::AlreadyRecorded
        ));
    }

    #[test]
    fn a_record_that_could_overwrite_is_refused() {
        let t = FencedTxn::unfenced().records([TxnOp::set("audit_logs/3", b"{}".to_vec())]);
        assert!(matches!(t.check_records(), Err(ConsulError::Config(_))));
    }

    #[test]
    fn a_batch_names_each_failed_unit_with_indexes_of_its_own() {
        let unit = |k: &str| {
            FencedTxn::fenced(Fence::new(format!("lock/{k}"), &session()))
                .op(TxnOp::delete(format!("lock/{k}")))
                .records([TxnOp::cas(format!("audit_logs/{k}"), b"{}".to_vec(), 0)])
        };
        let batch = FencedBatch::new(vec![unit("a"), unit("b"), unit("c")]);
        assert_eq!(batch.len(), 9);
        let layouts: Vec<Layout> = batch.units.iter().map(FencedTxn::layout).collect();
        let BatchError::Units(units) =
            classify_units(&layouts, failed(&[(3, MISMATCH), (8, STALE)]))
        else {
            panic!("a refusal names units")
        };
        assert_eq!(units.len(), 2);
        assert_eq!(units[0].0, 1);
        assert!(matches!(&units[0].1, FenceError::Fenced { key } if key == "lock/b"));
        assert_eq!(units[1].0, 2);
        assert!(matches!(units[1].1, FenceError::AlreadyRecorded));
    }
}
