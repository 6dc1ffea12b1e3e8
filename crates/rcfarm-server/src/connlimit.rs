//! Consul 1.x's `limits.http_max_conns_per_client`: a cap on concurrent TCP connections per
//! client IP on the HTTP listener.
//!
//! Consul (agent/agent.go with hashicorp/go-connlimit) counts a connection from the moment it is
//! accepted until it closes, keyed by the peer's IP (the port does not matter, loopback is not
//! exempt). A connection that would exceed the limit is answered at once, before any request is
//! read, with go-connlimit's canned 429 (written under a 10 ms deadline) and closed; it is never
//! counted. Consul 1.6.3 added the limit (default 100), 1.7.1 raised the default to 200 and
//! hashicorp/consul#8221 replaced the bare close with the 429. Consul 0.7 has no limit.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// go-connlimit's `tooManyRequestsResponse`, byte for byte.
pub(crate) const TOO_MANY_CONNS_RESPONSE: &[u8] = b"HTTP/1.1 429 Too Many Requests\r\n\
Content-Type: text/plain\r\n\
Content-Length: 81\r\n\
Connection: close\r\n\
\r\n\
Your IP is issuing too many concurrent connections, please rate limit your calls\n";

/// How long the refusal may take to write (Consul: `HTTPConnStateFuncWithDefault429Handler(10ms)`).
const REFUSAL_WRITE_DEADLINE: Duration = Duration::from_millis(10);

/// Open connections per client IP, and what was refused.
#[derive(Debug)]
pub(crate) struct ConnLimiter {
    /// 0 = no limit.
    max_per_client: usize,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    open: AtomicUsize,
    refused: AtomicU64,
}

impl ConnLimiter {
    pub fn new(max_per_client: usize) -> Arc<ConnLimiter> {
        Arc::new(ConnLimiter {
            max_per_client,
            per_ip: Mutex::default(),
            open: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// Counts a new connection from `ip`, or `None` when `ip` already holds the limit.
    fn try_acquire(self: &Arc<Self>, ip: IpAddr) -> Option<Slot> {
        // `::ffff:a.b.c.d` is a.b.c.d, as Go's `IP.String()` (connlimit's key) makes it.
        let ip = ip.to_canonical();
        let mut per_ip = self.per_ip.lock();
        let n = per_ip.entry(ip).or_insert(0);
        if self.max_per_client > 0 && *n >= self.max_per_client {
            return None;
        }
        *n += 1;
        self.open.fetch_add(1, Ordering::Relaxed);
        Some(Slot {
            limiter: self.clone(),
            ip,
        })
    }

    /// Connections open now (all clients).
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections refused with 429 since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// One counted connection; dropping it frees the slot.
#[derive(Debug)]
struct Slot {
    limiter: Arc<ConnLimiter>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut per_ip = self.limiter.per_ip.lock();
        if let Entry::Occupied(mut e) = per_ip.entry(self.ip) {
            let n = e.get_mut();
            *n = n.saturating_sub(1);
            if *n == 0 {
                e.remove();
            }
        }
        self.limiter.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The server's TCP listener with the per-client limit applied, for `axum::serve`.
pub(crate) struct LimitedListener {
    inner: TcpListener,
    limiter: Arc<ConnLimiter>,
}

impl LimitedListener {
    pub fn new(inner: TcpListener, limiter: Arc<ConnLimiter>) -> LimitedListener {
        LimitedListener { inner, limiter }
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = LimitedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (LimitedStream, SocketAddr) {
        loop {
            // Retries accept errors (and backs off on EMFILE) as axum does for a TcpListener.
            let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            match self.limiter.try_acquire(addr.ip()) {
                Some(slot) => {
                    return (
                        LimitedStream {
                            stream,
                            _slot: slot,
                        },
                        addr,
                    );
                }
                None => {
                    self.limiter.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        client = %addr,
                        limit = self.limiter.max_per_client,
                        "refused a connection with 429: too many concurrent connections from this IP"
                    );
                    // Off the accept loop (Consul writes on it, under the same deadline).
                    tokio::spawn(refuse(stream));
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// Writes the 429 (giving up after the deadline) and closes, without reading anything.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(
        REFUSAL_WRITE_DEADLINE,
        stream.write_all(TOO_MANY_CONNS_RESPONSE),
    )
    .await;
    drop(stream);
}

/// An accepted connection holding its slot until it is dropped (when hyper is done with it).
#[derive(Debug)]
pub(crate) struct LimitedStream {
    stream: TcpStream,
    _slot: Slot,
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for LimitedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_is_go_connlimits_response() {
        let msg =
            "Your IP is issuing too many concurrent connections, please rate limit your calls\n";
        let expected = format!(
            "HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{msg}",
            msg.len()
        );
        assert_eq!(TOO_MANY_CONNS_RESPONSE, expected.as_bytes());
    }

    #[test]
    fn slots_count_per_ip_and_free_on_drop() {
        let l = ConnLimiter::new(2);
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.1".parse().unwrap();
        let s1 = l.try_acquire(a).unwrap();
        let _s2 = l.try_acquire(mapped).unwrap();
        assert!(
            l.try_acquire(a).is_none(),
            "the mapped address is the same client"
        );
        let _s3 = l.try_acquire(b).unwrap();
        assert_eq!(l.open(), 3);
        drop(s1);
        assert_eq!(l.open(), 2);
        let _s4 = l.try_acquire(a).unwrap();

        let unlimited = ConnLimiter::new(0);
        let slots: Vec<_> = (0..500).map(|_| unlimited.try_acquire(a)).collect();
        assert!(slots.iter().all(Option::is_some));
        assert_eq!(unlimited.open(), 500);
        drop(slots);
        assert_eq!(unlimited.open(), 0);
        assert!(unlimited.per_ip.lock().is_empty());
    }
}
