//! A supervised task per claimed object (an RC, a rolling update): the farm hands it new
//! versions of its object, wakes it when something it depends on changes, and stops it. The
//! task side reads the same channels through its [`Inbox`], and runs its passes through
//! [`drive`], the one loop both the RC task and the roll task use.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::rc::RcId;

/// How long a task counts as on its first pass at most, whatever the pass does: a pass that
/// hangs (Consul unreachable within its timeouts) must not keep a farm over its share.
pub const FIRST_PASS_GRACE: Duration = Duration::from_secs(5);

/// The farm's handle on a task; `S` is the object's state as the farm last saw it.
pub struct TaskHandle<S> {
    pub id: RcId,
    state: watch::Sender<S>,
    wake: Arc<Notify>,
    cancel: CancellationToken,
    join: JoinHandle<()>,
    passed: Arc<AtomicBool>,
    spawned: Instant,
}

/// The task's side: the latest state, wake-ups, and its stop signal.
pub struct Inbox<S> {
    pub state: watch::Receiver<S>,
    pub wake: Arc<Notify>,
    pub cancel: CancellationToken,
    /// Set once the task's first pass is done ([`drive`] sets it).
    pub passed: Arc<AtomicBool>,
}

/// Starts a task for `id` with `initial` state; it stops when `parent` is cancelled (the
/// session was lost) or when its handle stops it.
pub fn spawn<S, F, Fut>(id: RcId, initial: S, parent: &CancellationToken, run: F) -> TaskHandle<S>
where
    S: Send + Sync + 'static,
    F: FnOnce(Inbox<S>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (state_tx, state_rx) = watch::channel(initial);
    let wake = Arc::new(Notify::new());
    let cancel = parent.child_token();
    let passed = Arc::new(AtomicBool::new(false));
    let join = tokio::spawn(run(Inbox {
        state: state_rx,
        wake: wake.clone(),
        cancel: cancel.clone(),
        passed: passed.clone(),
    }));
    TaskHandle {
        id,
        state: state_tx,
        wake,
        cancel,
        join,
        passed,
        spawned: Instant::now(),
    }
}

impl<S> TaskHandle<S> {
    /// Hands the task a new version of its object.
    pub fn update(&self, state: S) {
        let _ = self.state.send(state);
    }

    /// Asks for a new pass (something it depends on changed).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }

    /// Whether the task has yet to finish its first pass, within [`FIRST_PASS_GRACE`] of its
    /// start.
    pub fn on_first_pass(&self) -> bool {
        !self.passed.load(Ordering::Acquire)
            && !self.join.is_finished()
            && self.spawned.elapsed() < FIRST_PASS_GRACE
    }

    /// Stops the task and waits until it can no longer write.
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.join.await;
    }

    /// Signals the task to stop without waiting.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

/// What a pass asks of the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Look again after this long at the latest; at once when the object changes or the task
    /// is woken.
    Requeue(Duration),
    /// Look again after `after` at the latest, but not before `at`, however woken (an error's
    /// backoff, pacing). A change of the object itself lifts the hold when `change_lifts` (an
    /// operator's fix is acted on at once).
    Hold {
        after: Duration,
        at: Instant,
        change_lifts: bool,
    },
    /// The task is done: its object is gone or no longer this farm's.
    Stop,
}

/// A pass's future, boxed: its state machine is kilobytes, and a task spends nearly all its
/// life waiting between passes, so the waiting task must not carry it inline (a farm holds
/// thousands of tasks).
pub type PassFuture<'a, O> = Pin<Box<dyn Future<Output = O> + Send + 'a>>;

/// A task's reconciler: one pass over its object's state, and what the pass's outcome means.
pub trait Reconciler: Send {
    type State: Clone + Send + Sync;
    type Outcome: Send;

    /// One pass over `state`. Abandoned at once if the task is stopped: whatever write it
    /// has in flight is fenced.
    fn reconcile(&mut self, state: Self::State) -> PassFuture<'_, Self::Outcome>;

    /// What the outcome means for the loop; also where its effects go (events, status,
    /// metrics, reports).
    fn next(&mut self, outcome: Self::Outcome) -> impl Future<Output = Next> + Send;

    /// The object's state as the farm last saw it, wake-ups, and the stop signal.
    fn inbox(&mut self) -> &mut Inbox<Self::State>;
}

/// Runs `r`'s passes until it stops or is stopped: a pass, then a wait for the object to
/// change, a wake-up, or the requeue time, within the hold the last pass asked for.
pub async fn drive<R: Reconciler>(r: &mut R) {
    let mut hold: Option<(Instant, bool)> = None;
    loop {
        let cancel = r.inbox().cancel.clone();
        if cancel.is_cancelled() {
            break;
        }
        if let Some((at, _)) = hold {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep_until(at) => {}
            }
        }
        hold = None;
        let state = r.inbox().state.borrow_and_update().clone();
        let outcome = tokio::select! {
            _ = cancel.cancelled() => break,
            o = r.reconcile(state) => o,
        };
        r.inbox().passed.store(true, Ordering::Release);
        let after = match r.next(outcome).await {
            Next::Stop => break,
            Next::Requeue(after) => after,
            Next::Hold {
                after,
                at,
                change_lifts,
            } => {
                hold = Some((at, change_lifts));
                after
            }
        };
        let wake = r.inbox().wake.clone();
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = r.inbox().state.changed() => {
                if hold.is_some_and(|(_, lifts)| lifts) {
                    hold = None;
                }
            }
            _ = wake.notified() => {}
            _ = tokio::time::sleep(after) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A reconciler that records when it passed and returns the scripted next steps.
    struct Script {
        inbox: Inbox<u32>,
        script: Vec<Next>,
        passes: Arc<AtomicUsize>,
        seen: Vec<(u32, Instant)>,
    }

    impl Reconciler for Script {
        type State = u32;
        type Outcome = ();
        fn reconcile(&mut self, state: u32) -> PassFuture<'_, ()> {
            self.seen.push((state, Instant::now()));
            self.passes.fetch_add(1, Ordering::SeqCst);
            Box::pin(async {})
        }
        async fn next(&mut self, _: ()) -> Next {
            if self.script.is_empty() {
                Next::Stop
            } else {
                self.script.remove(0)
            }
        }
        fn inbox(&mut self) -> &mut Inbox<u32> {
            &mut self.inbox
        }
    }

    fn script(next: Vec<Next>) -> (Script, watch::Sender<u32>, Arc<AtomicUsize>) {
        let (tx, rx) = watch::channel(0);
        let passes = Arc::new(AtomicUsize::new(0));
        (
            Script {
                inbox: Inbox {
                    state: rx,
                    wake: Arc::new(Notify::new()),
                    cancel: CancellationToken::new(),
                    passed: Arc::new(AtomicBool::new(false)),
                },
                script: next,
                passes: passes.clone(),
                seen: vec![],
            },
            tx,
            passes,
        )
    }

    const MIN: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn requeues_after_the_time_asked_and_stops_when_told() {
        let (mut s, _tx, _) = script(vec![Next::Requeue(MIN), Next::Requeue(MIN)]);
        let t0 = Instant::now();
        drive(&mut s).await;
        let at: Vec<Duration> = s.seen.iter().map(|(_, t)| *t - t0).collect();
        assert_eq!(at, [Duration::ZERO, MIN, 2 * MIN]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_passes_at_once_unless_held() {
        let t0 = Instant::now();
        // Requeued for a minute: a change 5 s in passes at once, with the new state.
        let (mut s, tx, passes) = script(vec![Next::Requeue(MIN)]);
        let run = tokio::spawn(async move {
            drive(&mut s).await;
            s.seen
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(passes.load(Ordering::SeqCst), 1);
        tx.send(7).unwrap();
        let seen = run.await.unwrap();
        assert_eq!(seen[1], (7, t0 + Duration::from_secs(5)));

        // Requeued for a minute (an RC whose removals are held): a wake 5 s in (room came
        // back, an operator released them) passes at once.
        let t0 = Instant::now();
        let (mut s, _tx, _) = script(vec![Next::Requeue(MIN)]);
        let wake = s.inbox.wake.clone();
        let run = tokio::spawn(async move {
            drive(&mut s).await;
            s.seen
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        wake.notify_one();
        let seen = run.await.unwrap();
        assert_eq!(seen[1], (0, t0 + Duration::from_secs(5)));

        // Held for 30 s (an error's backoff): a change or a wake waits for the hold.
        let hold = |change_lifts| Next::Hold {
            after: MIN,
            at: Instant::now() + Duration::from_secs(30),
            change_lifts,
        };
        let t0 = Instant::now();
        let (mut s, tx, _) = script(vec![hold(false)]);
        let wake = s.inbox.wake.clone();
        let run = tokio::spawn(async move {
            drive(&mut s).await;
            s.seen
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        tx.send(8).unwrap();
        wake.notify_one();
        let seen = run.await.unwrap();
        assert_eq!(seen[1], (8, t0 + Duration::from_secs(30)));

        // Held with `change_lifts` (pacing while desires are unmet): a change lifts it.
        let t0 = Instant::now();
        let (mut s, tx, _) = script(vec![hold(true)]);
        let run = tokio::spawn(async move {
            drive(&mut s).await;
            s.seen
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        tx.send(9).unwrap();
        let seen = run.await.unwrap();
        assert_eq!(seen[1], (9, t0 + Duration::from_secs(5)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopped_task_passes_no_more() {
        let (mut s, _tx, passes) = script(vec![Next::Requeue(MIN); 10]);
        let cancel = s.inbox.cancel.clone();
        let run = tokio::spawn(async move { drive(&mut s).await });
        tokio::time::sleep(Duration::from_secs(90)).await;
        cancel.cancel();
        run.await.unwrap();
        assert_eq!(passes.load(Ordering::SeqCst), 2);
    }
}
