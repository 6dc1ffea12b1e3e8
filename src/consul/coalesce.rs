//! Many callers' transactions sent as one.
//!
//! A farm converging thousands of RCs has thousands of small transactions waiting for one of
//! its few connections. Consul spends most of a small transaction's cost on the request
//! itself (HTTP, the agent's RPC to the leader, one raft entry, waking every blocking query on
//! the prefixes it touches), so whoever gets a connection takes every transaction queued
//! behind it that fits in one (64 ops, a bounded body) and sends them together. Nothing waits
//! to be batched: a caller that finds a free connection sends at once, alone if nobody queues.
//!
//! Each caller keeps its own all-or-nothing semantics: a rolled-back batch applied nothing, so
//! the callers whose ops failed are told so (with op indexes of their own) and the others are
//! sent again without them.

use std::collections::VecDeque;
use std::ops::Range;

use tokio::sync::oneshot;

use super::client::{Consul, Permit};
use super::error::{ConsulError, Result};
use super::txn::{MAX_TXN_OPS, TxnOp};

/// A batch stops growing past this many (estimated) body bytes: Consul refuses a body over
/// ~512 KiB, and one caller's big write should not make others' fail.
const MAX_BATCH_BYTES: usize = 128 * 1024;

/// Transactions waiting for a connection.
#[derive(Default)]
pub(crate) struct TxnQueue {
    waiting: parking_lot::Mutex<VecDeque<Pending>>,
}

struct Pending {
    ops: Vec<TxnOp>,
    bytes: usize,
    done: oneshot::Sender<Result<u64>>,
}

/// Roughly what `ops` add to a body: keys, base64 values and the JSON around them.
fn body_bytes(ops: &[TxnOp]) -> usize {
    ops.iter()
        .map(|op| 96 + op.key.len() + op.value.as_ref().map_or(0, |v| v.len() * 4 / 3))
        .sum()
}

impl Consul {
    /// Commits `ops` all or nothing, as [`Consul::txn`] does, possibly in one transaction with
    /// other callers' ops (see the module's comment). Returns the index it committed at (0 if
    /// nothing in it yields a result, as for `txn`).
    ///
    /// A caller dropped before its ops were sent never sends them; once sent, they may apply
    /// whatever becomes of the caller, like any request in flight.
    pub async fn txn_coalesced(&self, ops: Vec<TxnOp>) -> Result<u64> {
        super::txn::check_op_count(ops.len())?;
        let (done, mut answer) = oneshot::channel();
        let bytes = body_bytes(&ops);
        self.inner
            .txn_queue
            .waiting
            .lock()
            .push_back(Pending { ops, bytes, done });
        let lost = || {
            Err(ConsulError::Unavailable {
                addr: self.address().to_string(),
                reason: "the transaction's batch was abandoned (the client is shutting down)"
                    .into(),
            })
        };
        loop {
            let permit = tokio::select! {
                biased;
                r = &mut answer => return r.unwrap_or_else(|_| lost()),
                p = self.permit() => p?,
            };
            let batch = self.take_batch();
            if batch.is_empty() {
                // Ours is in a batch another caller is sending.
                drop(permit);
                return answer.await.unwrap_or_else(|_| lost());
            }
            // Sent from a task of its own: the batch carries other callers' writes, which must
            // not be abandoned because this caller is (an RC task stopped mid-write).
            let consul = self.clone();
            tokio::spawn(async move { consul.send_batch(batch, permit).await });
        }
    }

    /// Takes the oldest waiting transactions that fit in one, skipping those whose callers are
    /// gone.
    fn take_batch(&self) -> Vec<Pending> {
        let mut waiting = self.inner.txn_queue.waiting.lock();
        let (mut ops, mut bytes) = (0, 0);
        let mut batch = Vec::new();
        while let Some(p) = waiting.front() {
            if p.done.is_closed() {
                waiting.pop_front();
                continue;
            }
            let fits = ops + p.ops.len() <= MAX_TXN_OPS && bytes + p.bytes <= MAX_BATCH_BYTES;
            if !batch.is_empty() && !fits {
                break;
            }
            ops += p.ops.len();
            bytes += p.bytes;
            batch.extend(waiting.pop_front());
        }
        batch
    }

    async fn send_batch(&self, mut batch: Vec<Pending>, permit: Permit) {
        let mut permit = Some(permit);
        metrics::histogram!("rcfarm_consul_txn_batch_size").record(batch.len() as f64);
        while !batch.is_empty() {
            let mut ops = Vec::with_capacity(batch.iter().map(|p| p.ops.len()).sum());
            let mut ranges: Vec<Range<usize>> = Vec::with_capacity(batch.len());
            for p in &mut batch {
                let start = ops.len();
                ops.append(&mut p.ops);
                ranges.push(start..ops.len());
            }
            let held = match permit.take() {
                Some(p) => p,
                None => match self.permit().await {
                    Ok(p) => p,
                    Err(e) => return fail_all(batch, &e),
                },
            };
            let result = self.txn_held(&ops, Some(held)).await;
            // Give every caller its ops back, for a resend.
            for (p, r) in batch.iter_mut().zip(&ranges).rev() {
                p.ops = ops.drain(r.clone()).collect();
            }
            match result {
                Ok(resp) => {
                    let index = resp.commit_index();
                    for p in batch {
                        // What `txn` would have answered this caller alone: callers wait for
                        // their caches to reach a write's index, and a tree that only lost
                        // keys (deletes yield no result) may not show that index until it
                        // next changes.
                        let own = if p.ops.iter().any(|op| op.verb.yields_result()) {
                            index
                        } else {
                            0
                        };
                        let _ = p.done.send(Ok(own));
                    }
                    return;
                }
                Err(ConsulError::Conflict(errors)) => {
                    // Nothing was applied. The callers whose ops failed get their failures; the
                    // others go again without them.
                    let mut kept = Vec::with_capacity(batch.len());
                    let mut failed_any = false;
                    for (p, r) in batch.into_iter().zip(&ranges) {
                        let own: Vec<_> = errors
                            .iter()
                            .filter(|e| r.contains(&e.op_index))
                            .map(|e| super::TxnOpError {
                                op_index: e.op_index - r.start,
                                what: e.what.clone(),
                            })
                            .collect();
                        if own.is_empty() {
                            kept.push(p);
                        } else {
                            failed_any = true;
                            let _ = p.done.send(Err(ConsulError::Conflict(own)));
                        }
                    }
                    if !failed_any {
                        // Failures naming no op of ours: nothing to take out, so no resend
                        // could fare better.
                        return fail_all(kept, &ConsulError::Conflict(errors));
                    }
                    batch = kept;
                }
                Err(e @ (ConsulError::Rejected { .. } | ConsulError::TooManyOps { .. }))
                    if batch.len() > 1 =>
                {
                    // Refused as a whole (too big, or malformed): whose ops it was shows only
                    // when each goes alone.
                    tracing::debug!(error = %e, callers = batch.len(), "batched transaction refused; sending its parts alone");
                    for p in batch {
                        let r = self.txn(&p.ops).await.map(|resp| resp.commit_index());
                        let _ = p.done.send(r);
                    }
                    return;
                }
                Err(e) => return fail_all(batch, &e),
            }
        }
    }
}

fn fail_all(batch: Vec<Pending>, e: &ConsulError) {
    for p in batch {
        let _ = p.done.send(Err(e.clone()));
    }
}
