//! What benchmarks and tests read about running processes from outside: their TCP connections to a port
//! (from `/proc`), their CPU time, and their Prometheus counters.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// TCP states as `/proc/net/tcp` writes them.
const ESTABLISHED: &str = "01";
const TIME_WAIT: &str = "06";

/// One `/proc/net/tcp{,6}` row: state, remote port, socket inode.
struct TcpRow {
    state: String,
    remote_port: u16,
    inode: u64,
}

fn tcp_rows(pid: u32) -> Vec<TcpRow> {
    let mut rows = Vec::new();
    for file in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(rem), Some(st), Some(inode)) = (f.get(2), f.get(3), f.get(9)) else {
                continue;
            };
            let Some(port) = rem
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
            else {
                continue;
            };
            rows.push(TcpRow {
                state: st.to_string(),
                remote_port: port,
                inode: inode.parse().unwrap_or(0),
            });
        }
    }
    rows
}

fn socket_inodes(pid: u32) -> BTreeSet<u64> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return BTreeSet::new();
    };
    dir.filter_map(|e| {
        let link = std::fs::read_link(e.ok()?.path()).ok()?;
        let s = link.to_str()?;
        s.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
    })
    .collect()
}

/// Established TCP connections process `pid` holds to `port`.
pub fn connections_to(pid: u32, port: u16) -> usize {
    connections_of(&[pid], port)[0]
}

/// Established TCP connections each of `pids` holds to `port`, from one read of the TCP table:
/// the processes share the network namespace, and the table lists every socket on the machine
/// (a read of it per process, many times a second, took a tenth of a 2-core machine's CPU in a
/// benchmark of 400,000 pods).
pub fn connections_of(pids: &[u32], port: u16) -> Vec<usize> {
    let Some(&first) = pids.first() else {
        return Vec::new();
    };
    let established: Vec<u64> = tcp_rows(first)
        .into_iter()
        .filter(|r| r.state == ESTABLISHED && r.remote_port == port)
        .map(|r| r.inode)
        .collect();
    pids.iter()
        .map(|&pid| {
            let mine = socket_inodes(pid);
            established.iter().filter(|i| mine.contains(i)).count()
        })
        .collect()
}

/// Sockets to `port` in TIME-WAIT on the machine (they belong to no process any more).
pub fn time_wait_to(port: u16) -> usize {
    tcp_rows(std::process::id())
        .iter()
        .filter(|r| r.state == TIME_WAIT && r.remote_port == port)
        .count()
}

/// User + system CPU time the process used so far.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name (which may contain spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // Linux reports CPU time in USER_HZ, 100 on every architecture rcfarm runs on.
    Some(Duration::from_millis(ticks * 10))
}

/// Sums of the Prometheus counters named `metric` at `url`, by the value of `label` ("" when the
/// series has none).
pub async fn scrape_counter(
    http: &reqwest::Client,
    url: &str,
    metric: &str,
    label: &str,
) -> Option<BTreeMap<String, f64>> {
    let text = http.get(url).send().await.ok()?.text().await.ok()?;
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric) else {
            continue;
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => {
                let (l, v) = r.split_once('}')?;
                (l, v)
            }
            None if rest.starts_with(' ') => ("", rest),
            None => continue,
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let key = labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == label)
            .map(|(_, v)| v.trim_matches('"').to_string())
            .unwrap_or_default();
        *out.entry(key).or_insert(0.0) += v;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn counts_this_process_connections() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let a = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let b = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let _accepted = (
            listener.accept().await.unwrap(),
            listener.accept().await.unwrap(),
        );
        assert_eq!(connections_to(std::process::id(), port), 2);
        drop((a, b));
        assert!(cpu_time(std::process::id()).is_some());
    }
}
