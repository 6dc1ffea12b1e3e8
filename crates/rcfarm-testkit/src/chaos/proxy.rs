//! A TCP proxy that delays and drops traffic, to put between a farm and Consul: requests arrive
//! late, and some connections die mid-request (the client cannot tell whether a write was
//! applied). Loopback only.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// What the proxy does to traffic.
#[derive(Debug, Clone, Copy)]
pub struct ProxyFaults {
    /// Each chunk towards the server waits up to this long.
    pub max_delay: Duration,
    /// Chance, per thousand chunks, that the connection is cut instead.
    pub drop_per_mille: u32,
}

/// Counters of what the proxy did.
#[derive(Debug, Default)]
pub struct ProxyStats {
    pub connections: AtomicU64,
    pub dropped: AtomicU64,
    pub delayed: AtomicU64,
}

pub struct FaultyProxy {
    addr: SocketAddr,
    stop: CancellationToken,
    stats: Arc<ProxyStats>,
    faults: Arc<Mutex<ProxyFaults>>,
    lose_answer: Arc<Mutex<Option<LoseAnswer>>>,
}

/// A targeted fault on the next `times` requests whose bytes contain `pattern`: either they
/// reach the server and their answers are thrown away (`forward`), or they never reach it; then
/// the connection is cut.
#[derive(Debug, Clone)]
struct LoseAnswer {
    pattern: Vec<u8>,
    times: u32,
    forward: bool,
}

/// Shared by a connection's two directions.
#[derive(Clone)]
struct Shared {
    faults: Arc<Mutex<ProxyFaults>>,
    lose_answer: Arc<Mutex<Option<LoseAnswer>>>,
    stats: Arc<ProxyStats>,
    stop: CancellationToken,
}

impl Drop for FaultyProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl FaultyProxy {
    /// Listens on an ephemeral loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr, faults: ProxyFaults) -> std::io::Result<FaultyProxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let stats = Arc::new(ProxyStats::default());
        let faults = Arc::new(Mutex::new(faults));
        let lose_answer = Arc::new(Mutex::new(None));
        let shared = Shared {
            faults: faults.clone(),
            lose_answer: lose_answer.clone(),
            stats: stats.clone(),
            stop: stop.clone(),
        };
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = shared.stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else { continue };
                shared.stats.connections.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(relay(client, target, shared.clone()));
            }
        });
        Ok(FaultyProxy {
            addr,
            stop,
            stats,
            faults,
            lose_answer,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn stats(&self) -> &Arc<ProxyStats> {
        &self.stats
    }

    /// Changes what the proxy does from the next chunk on, on every connection.
    pub fn set_faults(&self, faults: ProxyFaults) {
        *self.faults.lock() = faults;
    }

    /// Lets the next `times` requests containing `pattern` (in one chunk) reach the server and
    /// be applied, but drops their answers and cuts their connections: the client sees a
    /// write of unknown fate, deterministically. Counted in `dropped`.
    pub fn lose_answers_to(&self, pattern: &[u8], times: u32) {
        *self.lose_answer.lock() = Some(LoseAnswer {
            pattern: pattern.to_vec(),
            times,
            forward: true,
        });
    }

    /// Cuts the connection of the next `times` requests containing `pattern` (in one chunk)
    /// before they reach the server: a write that certainly failed. Counted in `dropped`.
    pub fn refuse_requests_with(&self, pattern: &[u8], times: u32) {
        *self.lose_answer.lock() = Some(LoseAnswer {
            pattern: pattern.to_vec(),
            times,
            forward: false,
        });
    }
}

/// If this chunk is one the targeted fault applies to: whether to forward it (and counts it).
fn take_lose_answer(rule: &Mutex<Option<LoseAnswer>>, chunk: &[u8]) -> Option<bool> {
    let mut rule = rule.lock();
    let r = rule.as_mut()?;
    if r.times == 0
        || r.pattern.is_empty()
        || !chunk.windows(r.pattern.len()).any(|w| w == r.pattern)
    {
        return None;
    }
    r.times -= 1;
    Some(r.forward)
}

async fn relay(client: TcpStream, target: SocketAddr, shared: Shared) {
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let stats = &shared.stats;
    // Set once a request's answer is to be lost: from then on nothing goes back to the client.
    let mute = std::sync::atomic::AtomicBool::new(false);
    let upstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Some(forward) = take_lose_answer(&shared.lose_answer, &buf[..n]) {
                mute.store(true, Ordering::SeqCst);
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                if forward {
                    let _ = sw.write_all(&buf[..n]).await;
                    // Long enough for the server to apply it and answer into the void.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                return;
            }
            let (delay, drop) = {
                let faults = *shared.faults.lock();
                let mut rng = rand::rng();
                let delay = if faults.max_delay.is_zero() {
                    Duration::ZERO
                } else {
                    faults.max_delay.mul_f64(rng.random::<f64>())
                };
                (delay, rng.random_range(0..1000) < faults.drop_per_mille)
            };
            if !delay.is_zero() {
                stats.delayed.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(delay).await;
            }
            if drop {
                // Forward the chunk, then cut: the request may be applied, the answer is lost.
                let _ = sw.write_all(&buf[..n]).await;
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            if sw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if mute.load(Ordering::SeqCst) {
                continue;
            }
            if cw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = shared.stop.cancelled() => {}
        _ = upstream => {}
        _ = downstream => {}
    }
}
