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

use super::error::{ConsulError, Result};
use super::txn::{Committed, MAX_TXN_OPS, TxnOp, TxnResponse};

/// A batch stops growing past this many body bytes: Consul refuses a body over 512 KiB
/// ([`super::txn::MAX_TXN_BYTES`]), and one caller's big write should not make others' fail.
/// Only a caller whose own transaction is bigger sends a bigger body, alone.
const MAX_BATCH_BYTES: usize = 128 * 1024;

/// Transactions waiting for a connection.
#[derive(Default)]
pub(crate) struct TxnQueue {
    waiting: parking_lot::Mutex<VecDeque<Pending>>,
}

struct Pending {
    ops: Vec<TxnOp>,
    bytes: usize,
    done: oneshot::Sender<Result<Committed>>,
}

/// What the queue needs of a client: a connection, and a transaction sent on it. The client
/// implements it; this module knows nothing else of the client.
pub(crate) trait Sender: Clone + Send + Sync + 'static {
    /// A connection held (one of the client's few).
    type Permit: Send + 'static;
    fn queue(&self) -> &TxnQueue;
    /// For errors: the Consul this client talks to.
    fn address(&self) -> &str;
    fn permit(&self) -> impl Future<Output = Result<Self::Permit>> + Send;
    /// Sends `ops` as one transaction (on `held` if given); Consul's answer.
    fn send(
        &self,
        ops: &[TxnOp],
        held: Option<Self::Permit>,
    ) -> impl Future<Output = Result<TxnResponse>> + Send;
}

/// Commits `ops` all or nothing through `client`, possibly in one transaction with other
/// callers' ops (see the module's comment). Returns the index it committed at (0 if nothing in
/// it yields a result, as for a transaction sent alone) and the keys it set with theirs.
///
/// A caller dropped before its ops were sent never sends them; once sent, they may apply
/// whatever becomes of the caller, like any request in flight.
pub(crate) async fn txn<S: Sender>(client: &S, ops: Vec<TxnOp>) -> Result<Committed> {
    super::txn::check_op_count(ops.len())?;
    let (done, mut answer) = oneshot::channel();
    let bytes = super::txn::encoded_len(&ops);
    client
        .queue()
        .waiting
        .lock()
        .push_back(Pending { ops, bytes, done });
    let lost = || {
        Err(ConsulError::Unavailable {
            addr: client.address().to_string(),
            reason: "the transaction's batch was abandoned (the client is shutting down)".into(),
        })
    };
    loop {
        let permit = tokio::select! {
            biased;
            r = &mut answer => return r.unwrap_or_else(|_| lost()),
            p = client.permit() => p?,
        };
        let batch = take_fitting(&mut client.queue().waiting.lock());
        if batch.is_empty() {
            // Ours is in a batch another caller is sending.
            drop(permit);
            return answer.await.unwrap_or_else(|_| lost());
        }
        // Sent from a task of its own: the batch carries other callers' writes, which must
        // not be abandoned because this caller is (an RC task stopped mid-write).
        let client = client.clone();
        tokio::spawn(async move { send_batch(&client, batch, permit).await });
    }
}

/// Sends `batch` as one transaction; on a rollback, tells the callers whose ops failed and
/// sends the others again.
async fn send_batch<S: Sender>(client: &S, mut batch: Vec<Pending>, permit: S::Permit) {
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
            None => match client.permit().await {
                Ok(p) => p,
                Err(e) => return fail_all(batch, &e),
            },
        };
        let result = client.send(&ops, Some(held)).await;
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
                    let _ = p.done.send(Ok(Committed::of(own, &p.ops, &resp.results)));
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
                    let r = client
                        .send(&p.ops, None)
                        .await
                        .map(|resp| Committed::of(resp.commit_index(), &p.ops, &resp.results));
                    let _ = p.done.send(r);
                }
                return;
            }
            Err(e) => return fail_all(batch, &e),
        }
    }
}

/// The oldest waiting transactions that fit in one: 64 ops and [`MAX_BATCH_BYTES`] of body
/// (the first one goes whatever its size).
fn take_fitting(waiting: &mut VecDeque<Pending>) -> Vec<Pending> {
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

fn fail_all(batch: Vec<Pending>, e: &ConsulError) {
    for p in batch {
        let _ = p.done.send(Err(e.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::txn::MAX_TXN_BYTES;

    fn queue(
        txns: Vec<Vec<TxnOp>>,
    ) -> (VecDeque<Pending>, Vec<oneshot::Receiver<Result<Committed>>>) {
        let mut rxs = Vec::new();
        let waiting = txns
            .into_iter()
            .map(|ops| {
                let (done, rx) = oneshot::channel();
                rxs.push(rx);
                let bytes = super::super::txn::encoded_len(&ops);
                Pending { ops, bytes, done }
            })
            .collect();
        (waiting, rxs)
    }

    /// An RC task's write: the fencing check, intent and pod label of one node, the audit record.
    fn pod_write(i: usize, manifest: &[u8]) -> Vec<TxnOp> {
        vec![
            TxnOp::check_session(format!("lock/replication_controllers/{i}"), "session"),
            TxnOp::set(format!("intent/node-{i}/web"), manifest.to_vec()),
            TxnOp::set(
                format!("labels/pod/node-{i}/web"),
                br#"{"pod_id":"web"}"#.to_vec(),
            ),
            TxnOp::cas(format!("audit_logs/{i}"), vec![b'a'; 300], 0),
        ]
    }

    fn body_len(batch: &[Pending]) -> usize {
        let ops: Vec<&TxnOp> = batch.iter().flat_map(|p| &p.ops).collect();
        serde_json::to_vec(&ops).unwrap().len()
    }

    #[test]
    fn batches_of_200_kb_manifests_stay_under_512_kib() {
        let manifest = vec![b'm'; 200 * 1024];
        let (mut waiting, _rxs) = queue((0..20).map(|i| pod_write(i, &manifest)).collect());
        let mut batches = 0;
        while !waiting.is_empty() {
            let batch = take_fitting(&mut waiting);
            assert!(!batch.is_empty());
            assert!(body_len(&batch) <= MAX_TXN_BYTES, "{}", body_len(&batch));
            batches += 1;
        }
        // Two of them would be ~550 KiB: each goes alone.
        assert_eq!(batches, 20);
    }

    #[test]
    fn small_writes_still_go_64_ops_at_a_time() {
        let (mut waiting, _rxs) = queue((0..48).map(|i| pod_write(i, b"id: web")).collect());
        let sizes: Vec<usize> = std::iter::from_fn(|| {
            let b = take_fitting(&mut waiting);
            (!b.is_empty()).then_some(b.len())
        })
        .collect();
        assert_eq!(sizes, vec![16, 16, 16]);
    }

    #[test]
    fn a_big_write_goes_alone_and_the_queue_behind_it_is_batched() {
        let big = vec![b'm'; 400 * 1024];
        let mut txns = vec![pod_write(0, &big)];
        txns.extend((1..5).map(|i| pod_write(i, b"id: web")));
        txns.push(pod_write(5, &big));
        let (mut waiting, mut rxs) = queue(txns);
        // A caller that gave up is skipped.
        drop(rxs.remove(2));
        let first = take_fitting(&mut waiting);
        assert_eq!(first.len(), 1);
        let second = take_fitting(&mut waiting);
        assert_eq!(second.len(), 3, "the small ones, without the abandoned one");
        let third = take_fitting(&mut waiting);
        assert_eq!(third.len(), 1);
        assert!(body_len(&third) > MAX_BATCH_BYTES, "a big one still goes");
        assert!(waiting.is_empty());
    }
}
