//! A supervised task per claimed object (an RC, a rolling update): the farm hands it new
//! versions of its object, wakes it when something it depends on changes, and stops it. The
//! task side reads the same channels through its [`Inbox`].

use std::sync::Arc;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::rc::RcId;

/// The farm's handle on a task; `S` is the object's state as the farm last saw it.
pub struct TaskHandle<S> {
    pub id: RcId,
    state: watch::Sender<S>,
    wake: Arc<Notify>,
    cancel: CancellationToken,
    join: JoinHandle<()>,
}

/// The task's side: the latest state, wake-ups, and its stop signal.
pub struct Inbox<S> {
    pub state: watch::Receiver<S>,
    pub wake: Arc<Notify>,
    pub cancel: CancellationToken,
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
    let join = tokio::spawn(run(Inbox {
        state: state_rx,
        wake: wake.clone(),
        cancel: cancel.clone(),
    }));
    TaskHandle {
        id,
        state: state_tx,
        wake,
        cancel,
        join,
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
