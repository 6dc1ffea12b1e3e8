//! Blocking queries as a watch: a background task keeps the latest result of one query in a
//! `tokio::sync::watch` channel, following Consul's rules for indexes.
//!
//! The rules (Consul's "blocking queries" page): block on the last index seen; treat an index
//! ≤ 0 as 1; if the index goes backwards (a restored or restarted server), start again from 0;
//! an early return does not promise a change, so a result equal to the last one is not
//! published; rate-limit the loop so a misbehaving server cannot make it spin.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::client::Consul;
use super::error::Result;
use super::kvlist::KvList;
use super::types::{KvPair, QueryMeta, QueryOptions, SessionEntry};
use crate::util::Backoff;

/// One query of a watch, boxed so that a function can name the type of its fetch.
type BoxFuture<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

/// How a watch queries.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// The `wait` of each blocking query.
    pub wait: Duration,
    /// At least this long between two queries (a floor against spinning; 0 disables it).
    pub min_interval: Duration,
    /// And at least this long per MiB of the last answer: a blocking query on a prefix returns
    /// the whole tree, so re-reading a big tree after every single change would spend the
    /// farm's (and Consul's) time re-sending it; pausing in proportion batches changes.
    pub pace_per_mib: Duration,
    /// The pause never exceeds this.
    pub max_pace: Duration,
    /// How long an answer older than one already seen (a lower index) is held back, re-asking,
    /// before it is believed. Consul before 0.8.5 serves reads from a new leader still replaying
    /// its log (hashicorp/consul#2644): for a moment the store looks as it was seconds or
    /// minutes ago, and acting on that would redo work already done (a pod scheduled twice).
    /// A store that really went back (restored, or restarted empty) is believed after this.
    pub regression_grace: Duration,
    pub error_backoff_base: Duration,
    pub error_backoff_cap: Duration,
    /// Reads on demand instead of after every change (see [`Demand`]); `None`: a plain watch.
    pub demand: Option<Arc<Demand>>,
    /// Shared by the watches of one process: see [`Regressions`].
    pub regressions: Option<Arc<Regressions>>,
    /// How many processes (farms) watch the same trees, if known. The pacing above was
    /// measured with [`REFERENCE_READERS`] farms; with `r` of them each paces `r / 3` times
    /// as long, so that all of them together re-read a changing tree at the same rate whatever
    /// their number: Consul's cost of the farms' reads does not grow with the farms.
    pub readers: Option<Arc<std::sync::atomic::AtomicUsize>>,
}

/// Counts the times any watch sharing it was answered with an older state than it had seen
/// (at the first such answer, whether or not the store really went back, and whether the answer
/// is believed after the grace or overtaken by newer ones): what a process holds from before
/// may no longer be in the store. Each such answer also makes every other watch sharing it ask
/// again at once, without blocking: a store restored or emptied has not reached the index
/// their blocking queries wait on, and Consul would hold them until `wait` runs out.
#[derive(Debug)]
pub struct Regressions {
    count: watch::Sender<u64>,
}

impl Default for Regressions {
    fn default() -> Self {
        Regressions {
            count: watch::Sender::new(0),
        }
    }
}

impl Regressions {
    pub fn count(&self) -> u64 {
        *self.count.borrow()
    }

    fn seen(&self) {
        self.count.send_modify(|c| *c += 1);
    }
}

/// The number of farms [`WatchConfig`]'s pacing was measured with.
pub const REFERENCE_READERS: usize = 3;

/// How much longer than measured with [`REFERENCE_READERS`] farms each of `readers` paces
/// (1 when their number is unknown).
pub fn readers_scale(readers: Option<&std::sync::atomic::AtomicUsize>) -> f64 {
    readers.map_or(1.0, |r| {
        r.load(Ordering::Relaxed).max(1) as f64 / REFERENCE_READERS as f64
    })
}

impl WatchConfig {
    /// This config, read on demand.
    pub fn on_demand(mut self, demand: Arc<Demand>) -> Self {
        self.demand = Some(demand);
        self
    }
}

/// When a watch of a big tree reads it again: not after every change, which with several
/// farms writing means continuously (each farm re-reading the whole tree for every farm's
/// writes), but when someone asks ([`Demand::urge`]), while someone needs every change
/// ([`Demand::fast`]), and otherwise at least every `idle`.
///
/// An urge is answered by a query sent after it that does not block: a waiter learns the
/// tree as it is now, even when nothing in it changed since the last answer.
#[derive(Debug)]
pub struct Demand {
    idle: Duration,
    /// If set, `idle` is for [`REFERENCE_READERS`] readers and scales with their number (see
    /// [`WatchConfig::readers`]).
    readers: Option<Arc<std::sync::atomic::AtomicUsize>>,
    fast: std::sync::atomic::AtomicUsize,
    urge: tokio::sync::Notify,
    /// Queries started, and the sequence number of the last one answered and published.
    started: AtomicU64,
    answered: watch::Sender<u64>,
    /// When the last answer was published: what the watch shows is known current up to then
    /// (a derived view does not change for an answer equal to the last).
    answered_at: parking_lot::Mutex<Option<Instant>>,
}

/// While held, the watch reads after every change (see [`Demand::fast`]).
#[derive(Debug)]
pub struct FastGuard(Arc<Demand>);

impl Drop for FastGuard {
    fn drop(&mut self) {
        self.0.fast.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Demand {
    pub fn new(idle: Duration) -> Arc<Demand> {
        Self::shared(idle, None)
    }

    /// Like [`Demand::new`], the idle wait scaling with `readers` as a watch's pace does.
    pub fn shared(
        idle: Duration,
        readers: Option<Arc<std::sync::atomic::AtomicUsize>>,
    ) -> Arc<Demand> {
        Arc::new(Demand {
            idle,
            readers,
            fast: Default::default(),
            urge: tokio::sync::Notify::new(),
            started: AtomicU64::new(0),
            answered: watch::channel(0).0,
            answered_at: parking_lot::Mutex::new(None),
        })
    }

    /// Asks for a fresh read. Returns a ticket that [`Demand::fresh`] waits on.
    pub fn urge(&self) -> u64 {
        let ticket = self.next_ticket();
        self.urge.notify_one();
        ticket
    }

    /// A ticket for the next query sent, without asking for one: whoever takes it must
    /// [`Demand::urge`] before waiting on it, unless a read is due anyway.
    pub fn next_ticket(&self) -> u64 {
        self.started.load(Ordering::SeqCst) + 1
    }

    /// Whether an answer to a query sent after the urge that gave `ticket` was applied.
    pub fn is_fresh(&self, ticket: u64) -> bool {
        *self.answered.borrow() >= ticket
    }

    /// Waits until an answer to a query sent after the urge that gave `ticket` was applied.
    pub async fn fresh(&self, ticket: u64) {
        let mut rx = self.answered.subscribe();
        let _ = rx.wait_for(|a| *a >= ticket).await;
    }

    /// Reads after every change for as long as the guard is held.
    pub fn fast(self: &Arc<Self>) -> FastGuard {
        if self.fast.fetch_add(1, Ordering::SeqCst) == 0 {
            self.urge.notify_one();
        }
        FastGuard(self.clone())
    }

    pub fn is_fast(&self) -> bool {
        self.fast.load(Ordering::SeqCst) > 0
    }

    /// Before a query: waits until one is wanted. `true`: it was asked for (the query must
    /// not block).
    async fn gate(&self) -> bool {
        if self.is_fast() {
            return false;
        }
        let scale = readers_scale(self.readers.as_deref()).max(1.0);
        tokio::select! {
            _ = self.urge.notified() => !self.is_fast(),
            _ = tokio::time::sleep(self.idle.mul_f64(scale)) => false,
        }
    }

    fn start(&self) -> u64 {
        self.started.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// When the last answer was applied (`None`: none yet).
    pub fn answered_at(&self) -> Option<Instant> {
        *self.answered_at.lock()
    }

    fn answered(&self, seq: u64) {
        *self.answered_at.lock() = Some(Instant::now());
        self.answered.send_if_modified(|a| {
            let newer = seq > *a;
            if newer {
                *a = seq;
            }
            newer
        });
    }
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self {
            wait: Duration::from_secs(300),
            min_interval: Duration::from_millis(5),
            // Consul 0.7 answered the farms' queries on the lock tree (1.4 MiB at 20,000 RCs)
            // and the RC listing (3 MiB) several times a second while they converged, mostly
            // with nothing new: at 100 ms per MiB the farms read 1.65 GB from Consul in 28 s,
            // at 400 ms 1.13 GB in 25 s.
            pace_per_mib: Duration::from_millis(400),
            // A 100,000-pod label tree is ~25 MiB of JSON per answer: re-read every 200 ms by
            // each farm, it cost more CPU (theirs and Consul's) than the work it reported. A
            // 5-s cap did no better than 1 s (20,000 RCs: 11.0 s against 10.7-11.0 s).
            max_pace: Duration::from_secs(1),
            regression_grace: Duration::from_secs(5),
            error_backoff_base: Duration::from_millis(100),
            error_backoff_cap: Duration::from_secs(5),
            demand: None,
            regressions: None,
            readers: None,
        }
    }
}

/// One result of a watched query.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot<T> {
    pub index: u64,
    pub value: T,
}

/// The receiving side: `None` until the first answer arrives.
pub type SnapshotRx<T> = watch::Receiver<Option<Arc<Snapshot<T>>>>;

/// Counters of one watch.
#[derive(Debug, Default)]
pub struct WatchStats {
    pub queries: AtomicU64,
    pub errors: AtomicU64,
    pub resets: AtomicU64,
    pub published: AtomicU64,
    /// Answers held back for being older than one already seen.
    pub regressions_held: AtomicU64,
}

/// A running watch. Dropping it stops the background task.
pub struct Watch<T> {
    rx: SnapshotRx<T>,
    stats: Arc<WatchStats>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl<T> Watch<T> {
    pub fn subscribe(&self) -> SnapshotRx<T> {
        self.rx.clone()
    }

    pub fn stats(&self) -> &Arc<WatchStats> {
        &self.stats
    }

    /// The latest snapshot, if any arrived yet.
    pub fn latest(&self) -> Option<Arc<Snapshot<T>>> {
        self.rx.borrow().clone()
    }

    /// Stops the watch and waits for its task to end.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl<T> Drop for Watch<T> {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Where a watch's answers go.
trait Publish<T>: Send + 'static {
    /// Takes one answer (at `index`, which only grows between resets).
    fn publish(&mut self, index: u64, value: T, stats: &WatchStats);
    /// Resolves once nobody wants answers any more.
    fn closed(&self) -> impl Future<Output = ()> + Send;
}

/// Into a channel that keeps the latest answer, unless it equals the one there.
struct ToChannel<T>(watch::Sender<Option<Arc<Snapshot<T>>>>);

impl<T: PartialEq + Send + Sync + 'static> Publish<T> for ToChannel<T> {
    fn publish(&mut self, index: u64, value: T, stats: &WatchStats) {
        let changed = match &*self.0.borrow() {
            Some(prev) => prev.value != value,
            None => true,
        };
        if changed {
            stats.published.fetch_add(1, Ordering::Relaxed);
            let _ = self.0.send(Some(Arc::new(Snapshot { index, value })));
        }
    }

    fn closed(&self) -> impl Future<Output = ()> + Send {
        self.0.closed()
    }
}

/// Into a function that consumes each answer (a cache folding it into its own form).
struct ToSink<S>(S);

impl<T, S> Publish<T> for ToSink<S>
where
    S: FnMut(u64, T) + Send + 'static,
{
    fn publish(&mut self, index: u64, value: T, stats: &WatchStats) {
        stats.published.fetch_add(1, Ordering::Relaxed);
        (self.0)(index, value);
    }

    fn closed(&self) -> impl Future<Output = ()> + Send {
        // The owner stops a sink's watch through its cancellation token.
        std::future::pending()
    }
}

/// Starts a watch over any blocking query. `fetch` is called with the options of each query.
pub fn spawn_watch<T, F, Fut>(name: impl Into<String>, config: WatchConfig, fetch: F) -> Watch<T>
where
    T: PartialEq + Send + Sync + 'static,
    F: Fn(QueryOptions) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(T, QueryMeta)>> + Send + 'static,
{
    let (tx, rx) = watch::channel(None);
    let stats = Arc::new(WatchStats::default());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run_watch(
        name.into(),
        config,
        fetch,
        ToChannel(tx),
        stats.clone(),
        cancel.clone(),
    ));
    Watch {
        rx,
        stats,
        cancel,
        task: Some(task),
    }
}

/// A watch whose answers are handed to a function instead of kept: a cache that folds each
/// answer into its own form then holds no second, raw copy of the tree (at 100,000 pods the
/// raw label tree alone is tens of MiB per farm). Dropping it stops the query.
pub struct SinkWatch {
    stats: Arc<WatchStats>,
    cancel: CancellationToken,
}

impl SinkWatch {
    pub fn stats(&self) -> &Arc<WatchStats> {
        &self.stats
    }
}

impl Drop for SinkWatch {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Starts a watch that calls `sink(index, answer)` with each answer, in the watch's own task.
/// Unlike [`spawn_watch`] an answer equal to the last one is passed on too (with its newer
/// index): sinks compare entries by `ModifyIndex` for less than a whole-answer comparison
/// costs, and a newer index still tells waiters the view is current.
pub fn spawn_sink_watch<T, F, Fut, S>(
    name: impl Into<String>,
    config: WatchConfig,
    fetch: F,
    sink: S,
) -> SinkWatch
where
    T: Send + 'static,
    F: Fn(QueryOptions) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(T, QueryMeta)>> + Send + 'static,
    S: FnMut(u64, T) + Send + 'static,
{
    let stats = Arc::new(WatchStats::default());
    let cancel = CancellationToken::new();
    tokio::spawn(run_watch(
        name.into(),
        config,
        fetch,
        ToSink(sink),
        stats.clone(),
        cancel.clone(),
    ));
    SinkWatch { stats, cancel }
}

async fn run_watch<T, F, Fut, P>(
    name: String,
    config: WatchConfig,
    fetch: F,
    mut out: P,
    stats: Arc<WatchStats>,
    cancel: CancellationToken,
) where
    T: Send + 'static,
    F: Fn(QueryOptions) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(T, QueryMeta)>> + Send + 'static,
    P: Publish<T>,
{
    let mut backoff = Backoff::new(config.error_backoff_base, config.error_backoff_cap);
    // The index to block on in the next query; 0 asks for the current state at once.
    let mut block_on = 0u64;
    // The index of the last answer, to notice an index going backwards.
    let mut last_seen = 0u64;
    let mut consecutive_errors = 0u32;
    let running = super::answers::Running::new(&name);
    // Registered at zero (never reset: a watch of this name may have run before), so a rate
    // over reconnects is 0 rather than no data.
    metrics::counter!("rcfarm_consul_watch_reconnects_total", "watch" => name.clone()).increment(0);
    // Since when answers have been older than `last_seen`, while they are held back.
    let mut regressed_since: Option<Instant> = None;
    // Whether the next query was asked for (it must answer at once) rather than a wait for
    // the next change.
    let mut urged = false;
    // The last answer's size: the next is read into one buffer of about that size.
    let mut last_len = 0usize;
    let mut regressions = config.regressions.as_ref().map(|r| r.count.subscribe());
    loop {
        let mut seq = 0;
        if let Some(d) = &config.demand {
            if block_on > 0 && !urged {
                urged = tokio::select! {
                    _ = cancel.cancelled() => return,
                    u = d.gate() => u,
                };
            }
            seq = d.start();
        }
        let started = Instant::now();
        let mut opts = QueryOptions::blocking(if urged { 0 } else { block_on }, config.wait);
        // An eighth more for a tree that grew since.
        opts.size_hint = last_len + last_len / 8;
        stats.queries.fetch_add(1, Ordering::Relaxed);
        let result = tokio::select! {
            _ = cancel.cancelled() => return,
            _ = out.closed() => return,
            r = fetch(opts) => r,
            // Asked for a read while waiting for a change: ask again, without blocking.
            _ = async {
                match &config.demand {
                    Some(d) if !urged => d.urge.notified().await,
                    _ => std::future::pending().await,
                }
            } => {
                urged = true;
                continue;
            }
            // Another watch saw the store go back: our index may be one it has not reached.
            _ = async {
                match regressions.as_mut() {
                    Some(rx) if block_on > 0 && !urged => {
                        if rx.changed().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    }
                    _ => std::future::pending().await,
                }
            } => {
                if let Some(rx) = regressions.as_mut() {
                    rx.borrow_and_update();
                }
                urged = true;
                continue;
            }
        };
        urged = false;
        match result {
            Ok((value, meta)) => {
                if consecutive_errors > 0 {
                    tracing::info!(watch = %name, after_errors = consecutive_errors, "blocking query recovered");
                }
                consecutive_errors = 0;
                backoff.reset();
                let index = meta.index.max(1);
                if index < last_seen {
                    let first = regressed_since.is_none();
                    let since = *regressed_since.get_or_insert_with(Instant::now);
                    if first && let Some(r) = &config.regressions {
                        r.seen();
                        // Not news to this watch, which takes in this answer or asks again.
                        if let Some(rx) = regressions.as_mut() {
                            rx.borrow_and_update();
                        }
                    }
                    if since.elapsed() < config.regression_grace {
                        if first {
                            tracing::warn!(watch = %name, seen = last_seen, answered = index, "Consul answered with an older state than already seen (a new leader replaying its log?); holding the last view and asking again");
                        }
                        stats.regressions_held.fetch_add(1, Ordering::Relaxed);
                        block_on = 0;
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                        }
                        continue;
                    }
                }
                regressed_since = None;
                if index < last_seen {
                    // A restarted or restored server: our index means nothing there. Take this
                    // answer as the truth and block on the new index from now on.
                    stats.resets.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(watch = %name, from = last_seen, to = index, "Consul index went backwards; resetting");
                }
                last_seen = index;
                block_on = index;
                last_len = meta.body_len;
                // Which trees cost what: each answer to a prefix is the whole tree again.
                metrics::counter!("rcfarm_consul_watch_answers_total", "watch" => name.clone())
                    .increment(1);
                running.answered();
                metrics::counter!("rcfarm_consul_watch_answer_bytes_total", "watch" => name.clone())
                    .increment(meta.body_len as u64);
                out.publish(index, value, &stats);
                if let Some(d) = &config.demand {
                    d.answered(seq);
                }
                let elapsed = started.elapsed();
                let scale = readers_scale(config.readers.as_deref());
                let pace = config
                    .min_interval
                    .max(
                        config
                            .pace_per_mib
                            .mul_f64(scale * meta.body_len as f64 / (1 << 20) as f64),
                    )
                    .min(config.max_pace.mul_f64(scale).max(config.min_interval));
                tracing::trace!(watch = %name, index, bytes = meta.body_len, ?elapsed, ?pace, "answer");
                if elapsed < pace {
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(pace - elapsed) => {}
                    }
                }
            }
            Err(e) => {
                consecutive_errors += 1;
                stats.errors.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("rcfarm_consul_watch_reconnects_total", "watch" => name.clone())
                    .increment(1);
                // Log the first failure and then every tenth, not every retry.
                if consecutive_errors == 1 || consecutive_errors.is_multiple_of(10) {
                    tracing::warn!(watch = %name, error = %e, attempts = consecutive_errors, "blocking query failed; retrying");
                }
                // After an error, ask for the current state without blocking: if the server
                // restarted with a lower index, blocking on our old one would stall a whole wait.
                block_on = 0;
                let delay = backoff.next_delay();
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

impl Consul {
    /// Watches every entry under `prefix` with one blocking query.
    pub fn watch_prefix(
        &self,
        prefix: impl Into<String>,
        config: WatchConfig,
    ) -> Watch<Vec<KvPair>> {
        let prefix = prefix.into();
        let name = format!("kv:{prefix}");
        spawn_watch(name, config, self.list_fetch(prefix))
    }

    /// The query of a prefix watch: the whole tree under `prefix`.
    fn list_fetch(
        &self,
        prefix: String,
    ) -> impl Fn(QueryOptions) -> BoxFuture<Result<(Vec<KvPair>, QueryMeta)>> + Send + 'static {
        let consul = self.clone();
        move |opts| {
            let consul = consul.clone();
            let prefix = prefix.clone();
            Box::pin(async move { consul.kv_list(&prefix, &opts).await })
        }
    }

    /// Watches every entry under `prefix`, handing each answer to `sink` as Consul sent it
    /// (see [`spawn_sink_watch`] and [`KvList`]).
    pub fn sink_prefix(
        &self,
        prefix: impl Into<String>,
        config: WatchConfig,
        sink: impl FnMut(u64, KvList) + Send + 'static,
    ) -> SinkWatch {
        let prefix = prefix.into();
        let name = format!("kv:{prefix}");
        let consul = self.clone();
        let fetch = move |opts: QueryOptions| -> BoxFuture<Result<(KvList, QueryMeta)>> {
            let consul = consul.clone();
            let prefix = prefix.clone();
            Box::pin(async move { consul.kv_listing(&prefix, &opts).await })
        };
        spawn_sink_watch(name, config, fetch, sink)
    }

    /// Watches one key (`None` while it does not exist).
    pub fn watch_key(&self, key: impl Into<String>, config: WatchConfig) -> Watch<Option<KvPair>> {
        let key = key.into();
        let consul = self.clone();
        let name = format!("key:{key}");
        spawn_watch(name, config, move |opts| {
            let consul = consul.clone();
            let key = key.clone();
            async move { consul.kv_get(&key, &opts).await }
        })
    }

    /// Watches the key names under `prefix`, cut after `separator` if given.
    pub fn watch_keys(
        &self,
        prefix: impl Into<String>,
        separator: Option<String>,
        config: WatchConfig,
    ) -> Watch<Vec<String>> {
        let prefix = prefix.into();
        let consul = self.clone();
        let name = format!("keys:{prefix}");
        spawn_watch(name, config, move |opts| {
            let consul = consul.clone();
            let prefix = prefix.clone();
            let separator = separator.clone();
            async move { consul.kv_keys(&prefix, separator.as_deref(), &opts).await }
        })
    }

    /// Watches the key names under `prefix` (no values: `?keys`), handing each answer to
    /// `sink` (see [`spawn_sink_watch`]): a farm keeps only what it parses them into.
    pub fn sink_keys(
        &self,
        prefix: impl Into<String>,
        config: WatchConfig,
        sink: impl FnMut(u64, Vec<String>) + Send + 'static,
    ) -> SinkWatch {
        let prefix = prefix.into();
        let name = format!("keys:{prefix}");
        let consul = self.clone();
        let fetch = move |opts: QueryOptions| -> BoxFuture<Result<(Vec<String>, QueryMeta)>> {
            let consul = consul.clone();
            let prefix = prefix.clone();
            Box::pin(async move { consul.kv_keys(&prefix, None, &opts).await })
        };
        spawn_sink_watch(name, config, fetch, sink)
    }

    /// Watches the list of sessions.
    pub fn watch_sessions(&self, config: WatchConfig) -> Watch<Vec<SessionEntry>> {
        let consul = self.clone();
        spawn_watch("sessions", config, move |opts| {
            let consul = consul.clone();
            async move { consul.session_list(&opts).await }
        })
    }
}
