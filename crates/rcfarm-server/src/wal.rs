//! Durability for `--data-dir`: an append-only log of committed records, fsynced in groups, plus
//! a snapshot that bounds the log.
//!
//! A write is acknowledged only after the log holding it is fsynced; reads wait for the index
//! they observed to be durable too, so nobody ever sees a write that a crash could take back.
//! One writer thread drains every record queued while the previous fsync ran and syncs them
//! together (group commit), so throughput grows with concurrency instead of being one fsync per
//! write.
//!
//! Files: `wal.log` and `snapshot.bin`, each a header then frames of
//! `[len: u32 LE][crc32: u32 LE][postcard payload]`. Recovery loads the snapshot, replays log
//! records newer than it, drops a torn tail, then writes a fresh snapshot and empties the log.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;

use tokio::sync::watch;
use tokio::time::Instant;

use super::store::{Record, SnapshotData, Store};

const LOG_MAGIC: &[u8; 8] = b"RCFWAL01";
const SNAP_MAGIC: &[u8; 8] = b"RCFSNP01";
/// Compact once the log holds this much since the last snapshot.
const SNAPSHOT_AFTER_BYTES: u64 = 64 << 20;
/// A single frame larger than this is corruption, not data (values are capped far below).
const MAX_FRAME: u32 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("data directory {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("data directory {0} is in use by another server (its LOCK file is held)")]
    Locked(PathBuf),
    #[error("{path} is corrupt: {reason}; move it aside to start empty")]
    Corrupt { path: PathBuf, reason: String },
    #[error("the write-ahead log failed earlier; the server no longer accepts writes")]
    Failed,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WalError + '_ {
    move |source| WalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

enum Msg {
    Record(Vec<u8>, u64),
    Snapshot(Vec<u8>, u64),
    Shutdown(std::sync::mpsc::Sender<()>),
}

/// The durable log of one data directory.
pub struct Wal {
    tx: mpsc::Sender<Msg>,
    durable: watch::Receiver<u64>,
    snapshot_due: Arc<AtomicBool>,
    failed: Arc<AtomicBool>,
    bytes_logged: Arc<AtomicU64>,
    _lock: File,
}

/// What recovery found.
#[derive(Debug, Default, Clone, Copy)]
pub struct Recovery {
    pub snapshot_index: u64,
    pub replayed: usize,
    pub torn_bytes: u64,
    pub index: u64,
}

impl Wal {
    /// Opens (or creates) a data directory and recovers the store it holds.
    pub fn open(dir: &Path) -> Result<(Wal, Store, Recovery), WalError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let lock_path = dir.join("LOCK");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(WalError::Locked(dir.to_path_buf()));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io_err(&lock_path)(e)),
        }

        let now = Instant::now();
        let snap_path = dir.join("snapshot.bin");
        let log_path = dir.join("wal.log");
        let mut recovery = Recovery::default();
        let mut store = match read_snapshot(&snap_path)? {
            Some(data) => {
                recovery.snapshot_index = data.index;
                Store::restore(data, now)
            }
            None => Store::new(),
        };
        let (records, torn) = read_log(&log_path)?;
        recovery.torn_bytes = torn;
        for rec in &records {
            if rec.index > store.index() {
                store.replay(rec, now);
                recovery.replayed += 1;
            }
        }
        store.reset_session_timers(now);
        recovery.index = store.index();

        // Start from a clean slate: the recovered state as a snapshot, an empty log.
        write_snapshot(dir, &snap_path, &store.snapshot())?;
        let mut log = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        log.write_all(LOG_MAGIC).map_err(io_err(&log_path))?;
        log.sync_all().map_err(io_err(&log_path))?;
        sync_dir(dir)?;

        let (tx, rx) = mpsc::channel();
        let (durable_tx, durable_rx) = watch::channel(store.index());
        let snapshot_due = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(AtomicBool::new(false));
        let bytes_logged = Arc::new(AtomicU64::new(0));
        let writer = Writer {
            dir: dir.to_path_buf(),
            log,
            log_path,
            snap_path,
            durable: durable_tx,
            snapshot_due: snapshot_due.clone(),
            failed: failed.clone(),
            bytes_logged: bytes_logged.clone(),
            since_snapshot: 0,
        };
        std::thread::Builder::new()
            .name("consul-dev-wal".into())
            .spawn(move || writer.run(rx))
            .map_err(io_err(dir))?;
        Ok((
            Wal {
                tx,
                durable: durable_rx,
                snapshot_due,
                failed,
                bytes_logged,
                _lock: lock,
            },
            store,
            recovery,
        ))
    }

    /// Queues a committed record. Call it under the store's lock so records stay in index order.
    pub fn append(&self, rec: &Record) {
        match postcard::to_stdvec(rec) {
            Ok(payload) => {
                let _ = self.tx.send(Msg::Record(frame(&payload), rec.index));
            }
            Err(e) => {
                // Every field of a record is plain data, so this cannot happen; refuse further
                // writes rather than acknowledge one we could not log.
                tracing::error!(error = %e, "cannot encode a log record");
                self.failed.store(true, Ordering::SeqCst);
            }
        }
    }

    /// True once, when the log has grown enough to be compacted into a snapshot.
    pub fn take_snapshot_due(&self) -> bool {
        self.snapshot_due.swap(false, Ordering::AcqRel)
    }

    /// Queues a snapshot of the store at `data.index`. Call it under the store's lock.
    pub fn snapshot(&self, data: &SnapshotData) {
        match postcard::to_stdvec(data) {
            Ok(payload) => {
                let _ = self.tx.send(Msg::Snapshot(payload, data.index));
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a snapshot; the log keeps growing")
            }
        }
    }

    /// Waits until every record up to `index` is on disk.
    pub async fn wait_durable(&self, index: u64) -> Result<(), WalError> {
        let mut rx = self.durable.clone();
        loop {
            if self.failed.load(Ordering::SeqCst) {
                return Err(WalError::Failed);
            }
            if *rx.borrow_and_update() >= index {
                return Ok(());
            }
            if rx.changed().await.is_err() {
                return Err(WalError::Failed);
            }
        }
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    pub fn bytes_logged(&self) -> u64 {
        self.bytes_logged.load(Ordering::Relaxed)
    }

    /// Flushes and stops the writer thread.
    pub fn close(&self) {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        if self.tx.send(Msg::Shutdown(done_tx)).is_ok() {
            let _ = done_rx.recv_timeout(std::time::Duration::from_secs(10));
        }
    }
}

struct Writer {
    dir: PathBuf,
    log: File,
    log_path: PathBuf,
    snap_path: PathBuf,
    durable: watch::Sender<u64>,
    snapshot_due: Arc<AtomicBool>,
    failed: Arc<AtomicBool>,
    bytes_logged: Arc<AtomicU64>,
    since_snapshot: u64,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 20);
        while let Ok(first) = rx.recv() {
            let mut msgs = vec![first];
            // Group commit: take everything that queued up while the last fsync ran.
            while msgs.len() < 65_536 {
                match rx.try_recv() {
                    Ok(m) => msgs.push(m),
                    Err(_) => break,
                }
            }
            let mut durable_to = None;
            let mut shutdown = None;
            for msg in msgs {
                match msg {
                    Msg::Record(frame, index) => {
                        buf.extend_from_slice(&frame);
                        durable_to = Some(index);
                    }
                    Msg::Snapshot(payload, index) => {
                        if let Err(e) = self.flush(&mut buf).and_then(|_| self.compact(&payload)) {
                            return self.fail(e);
                        }
                        durable_to = Some(index);
                    }
                    Msg::Shutdown(done) => shutdown = Some(done),
                }
            }
            if let Err(e) = self.flush(&mut buf) {
                return self.fail(e);
            }
            if let Some(i) = durable_to {
                self.durable.send_modify(|d| *d = (*d).max(i));
            }
            if self.since_snapshot > SNAPSHOT_AFTER_BYTES {
                self.snapshot_due.store(true, Ordering::Release);
            }
            if let Some(done) = shutdown {
                let _ = done.send(());
                return;
            }
        }
    }

    fn flush(&mut self, buf: &mut Vec<u8>) -> Result<(), WalError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.log.write_all(buf).map_err(io_err(&self.log_path))?;
        self.log.sync_data().map_err(io_err(&self.log_path))?;
        self.since_snapshot += buf.len() as u64;
        self.bytes_logged
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        buf.clear();
        Ok(())
    }

    fn compact(&mut self, snapshot_payload: &[u8]) -> Result<(), WalError> {
        write_snapshot_bytes(&self.dir, &self.snap_path, snapshot_payload)?;
        // Records at or below the snapshot's index are skipped on replay, so a crash at any
        // point of this truncation is safe.
        self.log.set_len(0).map_err(io_err(&self.log_path))?;
        self.log
            .seek(SeekFrom::Start(0))
            .map_err(io_err(&self.log_path))?;
        self.log
            .write_all(LOG_MAGIC)
            .map_err(io_err(&self.log_path))?;
        self.log.sync_all().map_err(io_err(&self.log_path))?;
        self.since_snapshot = 0;
        tracing::debug!(
            bytes = snapshot_payload.len(),
            "compacted the log into a snapshot"
        );
        Ok(())
    }

    fn fail(self, e: WalError) {
        tracing::error!(error = %e, "write-ahead log failed; refusing further writes");
        self.failed.store(true, Ordering::SeqCst);
        // Wake every waiter so it sees the failure instead of hanging.
        self.durable.send_modify(|_| {});
    }
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Reads frames until the end or the first incomplete or corrupt one; returns the payloads and
/// the length of the valid prefix.
fn read_frames(data: &[u8]) -> (Vec<&[u8]>, usize) {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 8 <= data.len() {
        let len = u32::from_le_bytes([data[pos], data[pos + 1], data[pos + 2], data[pos + 3]]);
        let crc = u32::from_le_bytes([data[pos + 4], data[pos + 5], data[pos + 6], data[pos + 7]]);
        if len > MAX_FRAME || pos + 8 + len as usize > data.len() {
            break;
        }
        let payload = &data[pos + 8..pos + 8 + len as usize];
        if crc32fast::hash(payload) != crc {
            break;
        }
        out.push(payload);
        pos += 8 + len as usize;
    }
    (out, pos)
}

fn read_log(path: &Path) -> Result<(Vec<Record>, u64), WalError> {
    let mut data = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut data).map_err(io_err(path))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(io_err(path)(e)),
    }
    if data.is_empty() {
        return Ok((Vec::new(), 0));
    }
    if data.len() < LOG_MAGIC.len() || &data[..LOG_MAGIC.len()] != LOG_MAGIC {
        return Err(WalError::Corrupt {
            path: path.to_path_buf(),
            reason: "not an rcfarm log".into(),
        });
    }
    let body = &data[LOG_MAGIC.len()..];
    let (frames, valid) = read_frames(body);
    let mut records = Vec::with_capacity(frames.len());
    for payload in frames {
        match postcard::from_bytes::<Record>(payload) {
            Ok(r) => records.push(r),
            // A frame with a good checksum that does not decode was written by another version.
            Err(e) => {
                return Err(WalError::Corrupt {
                    path: path.to_path_buf(),
                    reason: format!("undecodable record: {e}"),
                });
            }
        }
    }
    let torn = (body.len() - valid) as u64;
    if torn > 0 {
        tracing::warn!(path = %path.display(), torn_bytes = torn, "dropping a torn tail of the log (a write that was never acknowledged)");
    }
    Ok((records, torn))
}

fn read_snapshot(path: &Path) -> Result<Option<SnapshotData>, WalError> {
    let mut data = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut data).map_err(io_err(path))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path)(e)),
    }
    let corrupt = |reason: &str| WalError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    if data.len() < SNAP_MAGIC.len() || &data[..SNAP_MAGIC.len()] != SNAP_MAGIC {
        return Err(corrupt("not an rcfarm snapshot"));
    }
    let (frames, _) = read_frames(&data[SNAP_MAGIC.len()..]);
    let payload = frames.first().ok_or_else(|| corrupt("checksum mismatch"))?;
    postcard::from_bytes(payload)
        .map(Some)
        .map_err(|e| corrupt(&format!("undecodable snapshot: {e}")))
}

fn write_snapshot(dir: &Path, path: &Path, data: &SnapshotData) -> Result<(), WalError> {
    let payload = postcard::to_stdvec(data).map_err(|e| WalError::Corrupt {
        path: path.to_path_buf(),
        reason: format!("cannot encode: {e}"),
    })?;
    write_snapshot_bytes(dir, path, &payload)
}

/// Writes a snapshot atomically: a temporary file, fsynced, renamed over the old one.
fn write_snapshot_bytes(dir: &Path, path: &Path, payload: &[u8]) -> Result<(), WalError> {
    let tmp = path.with_extension("tmp");
    {
        let f = File::create(&tmp).map_err(io_err(&tmp))?;
        let mut w = BufWriter::new(f);
        w.write_all(SNAP_MAGIC).map_err(io_err(&tmp))?;
        w.write_all(&frame(payload)).map_err(io_err(&tmp))?;
        let f = w.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), WalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_stop_at_a_torn_or_corrupt_tail() {
        let mut data = frame(b"one");
        data.extend(frame(b"two"));
        let full = data.len();
        data.extend(&frame(b"three")[..5]);
        let (frames, valid) = read_frames(&data);
        assert_eq!(frames, vec![b"one".as_slice(), b"two".as_slice()]);
        assert_eq!(valid, full);

        let mut bad = frame(b"one");
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        assert!(read_frames(&bad).0.is_empty());
    }
}
