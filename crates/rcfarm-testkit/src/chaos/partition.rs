//! Network partitions on one machine, with `nftables` (issue 37): every Consul agent of a
//! partitionable cluster binds an address of its own in 127.0.0.0/8 and runs under a user id
//! of its own, and a partition is a set of rules in a table of this run's that drop what one
//! agent sends another.
//!
//! Addresses alone cannot say who sent a packet: Consul dials its peers (Raft, RPC) without
//! binding the source, so those connections leave from 127.0.0.1 whatever the agent binds.
//! What the kernel does know in the output hook is the sending socket's owner (`meta skuid`),
//! and, through conntrack, the connection a reply belongs to. So each agent's new connections
//! are marked with its own id (`ct mark`), and "what `a` sends `b` is dropped" is two rules:
//! packets from `a`'s user to `b`'s address (`a`'s own connections, and its UDP gossip, which
//! does leave from the bound address), and packets from `a`'s user on connections `b` opened
//! (`a`'s answers to `b`). Both ways blocked is a symmetric partition; one way is Jepsen's
//! one-way link, under which TCP fails both ways but gossip's UDP still flows the other way.
//!
//! Needs root (to run agents under other user ids and to load rules) and the `nft` tool; the
//! ids and addresses are unique per process and per call, so tests may run side by side. The
//! table is deleted when the [`Partitions`] is dropped.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// One agent, as the rules see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub name: String,
    /// The address it binds.
    pub ip: Ipv4Addr,
    /// The user id it runs under (also the mark of the connections it opens).
    pub uid: u32,
}

static NEXT: AtomicU32 = AtomicU32::new(1);
static TABLES: AtomicU32 = AtomicU32::new(1);

/// A fresh (address, user id) pair, unique among the processes of this machine that use this
/// module at once (by process id) and among the calls of this one (by a counter).
pub fn identity() -> (Ipv4Addr, u32) {
    let n = NEXT.fetch_add(1, Ordering::Relaxed) % 254 + 1;
    let id = (std::process::id() % 4096) * 256 + n;
    let ip = Ipv4Addr::new(127, 10 + (id >> 16) as u8, (id >> 8) as u8, id as u8);
    (ip, 1_000_000 + id)
}

/// Whether partitions can be made here: `Err` says why not (for a test's loud skip).
pub fn available() -> Result<(), String> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| format!("cannot run `id -u`: {e}"))?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Err("partitions need root (agents run under their own user ids, and nftables rules are loaded)".into());
    }
    let probe = format!("rcfarm_probe_{}", std::process::id());
    nft(&format!(
        "add table inet {probe}\ndelete table inet {probe}\n"
    ))
    .map_err(|e| format!("nftables is not usable here (install Debian's `nftables`): {e}"))
}

/// Runs an `nft -f -` script: applied as one transaction, all or nothing.
fn nft(script: &str) -> Result<(), String> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run nft: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| format!("cannot write to nft: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("nft did not finish: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nft refused the rules: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The partitions between a set of endpoints: which of them does not hear which.
#[derive(Debug)]
pub struct Partitions {
    table: String,
    endpoints: Vec<Endpoint>,
    /// (from, to): what `from` sends `to` is dropped.
    blocked: BTreeSet<(usize, usize)>,
}

impl Partitions {
    /// A table of this run's for `endpoints`, marking the connections each opens; nothing
    /// blocked yet.
    pub fn new(endpoints: Vec<Endpoint>) -> Result<Partitions, String> {
        let table = format!(
            "rcfarm_partitions_{}_{}",
            std::process::id(),
            TABLES.fetch_add(1, Ordering::Relaxed)
        );
        let mut script = format!(
            "add table inet {table}\n\
             add chain inet {table} marking {{ type filter hook output priority -10; policy accept; }}\n\
             add chain inet {table} blocks {{ type filter hook output priority 0; policy accept; }}\n"
        );
        for e in &endpoints {
            script.push_str(&format!(
                "add rule inet {table} marking meta skuid {} ct state new ct mark set {}\n",
                e.uid, e.uid
            ));
        }
        nft(&script)?;
        Ok(Partitions {
            table,
            endpoints,
            blocked: BTreeSet::new(),
        })
    }

    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// What is blocked now, as (from, to) names.
    pub fn blocked(&self) -> Vec<(String, String)> {
        self.blocked
            .iter()
            .map(|(a, b)| {
                (
                    self.endpoints[*a].name.clone(),
                    self.endpoints[*b].name.clone(),
                )
            })
            .collect()
    }

    /// What `from` sends `to` is dropped from now on (one way).
    pub fn block(&mut self, from: usize, to: usize) -> Result<(), String> {
        self.set(|b| {
            b.insert((from, to));
        })
    }

    /// Nothing passes between the two sides, either way.
    pub fn split(&mut self, side_a: &[usize], side_b: &[usize]) -> Result<(), String> {
        self.set(|b| {
            for a in side_a {
                for x in side_b {
                    if a != x {
                        b.insert((*a, *x));
                        b.insert((*x, *a));
                    }
                }
            }
        })
    }

    /// `one` hears no one and no one hears it, among `others`.
    pub fn isolate(&mut self, one: usize, others: &[usize]) -> Result<(), String> {
        self.split(&[one], others)
    }

    /// Everything passes again.
    pub fn heal(&mut self) -> Result<(), String> {
        self.set(BTreeSet::clear)
    }

    /// Changes the blocked set and loads it, the whole drop chain at once.
    fn set(&mut self, change: impl FnOnce(&mut BTreeSet<(usize, usize)>)) -> Result<(), String> {
        let mut next = self.blocked.clone();
        change(&mut next);
        let n = self.endpoints.len();
        if let Some((a, b)) = next.iter().find(|(a, b)| *a >= n || *b >= n) {
            return Err(format!("no endpoint {a} or {b}: there are {n}"));
        }
        let t = &self.table;
        let mut script = format!("flush chain inet {t} blocks\n");
        for (a, b) in &next {
            let (from, to) = (&self.endpoints[*a], &self.endpoints[*b]);
            script.push_str(&format!(
                "add rule inet {t} blocks meta skuid {} ip daddr {} drop\n\
                 add rule inet {t} blocks meta skuid {} ct mark {} drop\n",
                from.uid, to.ip, from.uid, to.uid
            ));
        }
        nft(&script)?;
        self.blocked = next;
        Ok(())
    }
}

impl Drop for Partitions {
    fn drop(&mut self) {
        let _ = nft(&format!("delete table inet {}\n", self.table));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_distinct_loopback_addresses_and_users() {
        let ids: Vec<(Ipv4Addr, u32)> = (0..300).map(|_| identity()).collect();
        for (ip, uid) in &ids {
            assert!(ip.is_loopback(), "{ip}");
            assert!(*uid >= 1_000_000);
        }
        // Within one wrap of the counter (254 calls), every one differs.
        let first: BTreeSet<_> = ids[..254].iter().collect();
        assert_eq!(first.len(), 254);
    }
}
