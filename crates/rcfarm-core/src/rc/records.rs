//! The RC tree as a farm reads it: every key from one keys-only watch (`?keys`), and the
//! records of only the RCs it has a use for, read in batched read-only transactions.
//!
//! Claims need every RC's id and nothing else of it (the assignment is computed from ids,
//! RC labels, farms and locks), and the emptied-tree tripwire needs only how many keys there
//! are. A farm reads and parses the records of the RCs it owns, is about to claim, or sees in a
//! rolling update or under a held mutation lock: its bytes and memory follow what it owns,
//! plus ~40 bytes of key per RC in the cluster (issue 38).
//!
//! Why batched reads, not a watch of the owned set: Consul has no query over a set of keys,
//! and a blocking query per owned RC is an HTTP connection per RC (6,667 per farm at 20,000
//! RCs and three farms). A keys-only answer carries one index for the whole tree and none per
//! key, so it cannot say which records changed: when its index moves, every record of
//! interest is read again (64 per transaction, a few in flight) and only those whose
//! `ModifyIndex` moved are parsed again. When only the interest grew (a claim), only the new
//! records are read.

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::sync::watch;

use super::model::{RC_PREFIX, RcId};
use super::store::{RcListing, RcStoreError, parse_listing};
use crate::consul::{Consul, SinkWatch, WatchConfig};

/// Transactions of record reads in flight at once.
const READ_CONCURRENCY: usize = 4;

/// The watch label the record reads' bytes are counted under (beside the watches' own).
const READS_LABEL: &str = "records:replication_controllers/";

/// Every key of the RC tree at one index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RcKeys {
    pub index: u64,
    /// Keys that name an RC (valid record or not), by id.
    pub ids: BTreeSet<RcId>,
    /// Keys under the prefix that name no RC: read with every sync, reported as unclaimable.
    pub other: Vec<String>,
}

impl RcKeys {
    pub fn parse(index: u64, keys: Vec<String>) -> RcKeys {
        let mut out = RcKeys {
            index,
            ..Default::default()
        };
        let mut ids = Vec::with_capacity(keys.len());
        for key in keys {
            match RcId::from_key(&key) {
                Some(Ok(id)) => ids.push(id),
                _ => out.other.push(key),
            }
        }
        // Built in one go (see `parse_locks`): every farm keeps this set for the whole cluster.
        out.ids = ids.into_iter().collect();
        out
    }

    /// How many keys the tree holds (the emptied-tree tripwire's count).
    pub fn len(&self) -> usize {
        self.ids.len() + self.other.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The key an RC's record is stored under (an id parses from its canonical form only).
    pub fn key_of(&self, id: &RcId) -> String {
        id.key()
    }
}

/// The RC tree's keys, watched: a new value whenever the tree changed (a record written,
/// created or deleted moves the index even when the keys stay the same).
pub struct RcKeysWatch {
    rx: watch::Receiver<Option<Arc<RcKeys>>>,
    _watch: SinkWatch,
}

impl RcKeysWatch {
    pub fn spawn(consul: &Consul, config: WatchConfig) -> RcKeysWatch {
        let (tx, rx) = watch::channel(None::<Arc<RcKeys>>);
        let watch = consul.sink_keys(RC_PREFIX, config, move |index, keys| {
            let parsed = RcKeys::parse(index, keys);
            tx.send_if_modified(|cur| {
                // A blocking query's timeout answers again with nothing new.
                if cur.as_deref() == Some(&parsed) {
                    return false;
                }
                *cur = Some(Arc::new(parsed));
                true
            });
        });
        RcKeysWatch { rx, _watch: watch }
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<RcKeys>>> {
        self.rx.clone()
    }

    pub fn latest(&self) -> Option<Arc<RcKeys>> {
        self.rx.borrow().clone()
    }
}

/// The records of the RCs a farm has a use for, published as an [`RcListing`] that holds only
/// them (and the keys that name no RC). Synced by its one user, the farm's loop, in turn.
pub struct RcRecords {
    consul: Consul,
    tx: watch::Sender<Option<Arc<RcListing>>>,
    synced: tokio::sync::Mutex<Synced>,
}

/// What the listing was last brought to.
#[derive(Default)]
struct Synced {
    /// The keys index every record of the listing was last read at or after.
    read_at: u64,
    /// The interest of the last sync ([`RcId::digest`]), while the listing holds exactly it:
    /// the farm's loop asks for a sync on every pass, and with neither the keys nor the
    /// interest moved there is nothing to read or drop.
    interest: Option<(u64, u128)>,
}

impl RcRecords {
    pub fn new(consul: Consul) -> RcRecords {
        RcRecords {
            consul,
            tx: watch::channel(None).0,
            synced: tokio::sync::Mutex::new(Synced::default()),
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<RcListing>>> {
        self.tx.subscribe()
    }

    pub fn latest(&self) -> Option<Arc<RcListing>> {
        self.tx.borrow().clone()
    }

    /// Brings the listing to `keys` for the RCs of `interest`: every one read again if the tree
    /// changed since the last sync, else only those not held yet; records no longer of
    /// interest are dropped. The listing's index is the keys' (its records are that new or
    /// newer). Returns whether the listing changed.
    pub async fn sync(
        &self,
        keys: &RcKeys,
        interest: &BTreeSet<RcId>,
    ) -> Result<bool, RcStoreError> {
        let mut synced = self.synced.lock().await;
        let prev = self.latest();
        // The last listing, if the tree has not changed since it was read: kept, and only what
        // it lacks read.
        let unchanged = prev.as_deref().filter(|_| synced.read_at == keys.index);
        let digest = RcId::digest(interest);
        if unchanged.is_some() && synced.interest == Some(digest) {
            return Ok(false);
        }
        let wanted: BTreeSet<RcId> = interest
            .iter()
            .filter(|id| keys.ids.contains(*id))
            .copied()
            .collect();
        let listing = match unchanged {
            None => {
                let to_read: Vec<String> = wanted
                    .iter()
                    .map(|id| keys.key_of(id))
                    .chain(keys.other.iter().cloned())
                    .collect();
                self.read(keys.index, &to_read, prev.as_deref()).await?
            }
            Some(p) => {
                let to_read: Vec<String> = wanted
                    .iter()
                    .filter(|id| p.record(id).is_none())
                    .map(|id| keys.key_of(id))
                    .collect();
                let mut l = kept(p, keys, &wanted);
                if to_read.is_empty()
                    && p.rcs.len() + p.invalid.len() == l.rcs.len() + l.invalid.len()
                {
                    synced.interest = Some(digest);
                    return Ok(false);
                }
                let fresh = self.read(keys.index, &to_read, Some(p)).await?;
                l.rcs.extend(fresh.rcs);
                l.invalid.extend(fresh.invalid);
                l
            }
        };
        synced.read_at = keys.index;
        synced.interest = Some(digest);
        Ok(self.publish(prev.as_deref(), listing))
    }

    /// Reads the records of `ids` not held yet into the listing, keeping every other record and
    /// the listing's index (what a claim needs before its task starts, without a re-read of
    /// everything the farm serves). Returns whether the listing changed.
    pub async fn add(&self, keys: &RcKeys, ids: &BTreeSet<RcId>) -> Result<bool, RcStoreError> {
        let mut synced = self.synced.lock().await;
        let prev = self.latest();
        let to_read: Vec<String> = ids
            .iter()
            .filter(|id| {
                keys.ids.contains(*id) && prev.as_ref().is_none_or(|p| p.record(id).is_none())
            })
            .map(|id| keys.key_of(id))
            .collect();
        if to_read.is_empty() {
            return Ok(false);
        }
        let index = prev.as_ref().map_or(keys.index, |p| p.index);
        let fresh = self.read(index, &to_read, prev.as_deref()).await?;
        let mut l = prev.as_deref().cloned().unwrap_or_default();
        l.index = index;
        l.rcs.extend(fresh.rcs);
        l.invalid.extend(fresh.invalid);
        // The listing may now hold more than the last sync's interest: the next sync looks.
        synced.interest = None;
        Ok(self.publish(prev.as_deref(), l))
    }

    /// Reads `keys` and parses them, reusing `prev`'s parse of records unchanged since.
    async fn read(
        &self,
        index: u64,
        keys: &[String],
        prev: Option<&RcListing>,
    ) -> Result<RcListing, RcStoreError> {
        if keys.is_empty() {
            return Ok(RcListing {
                index,
                ..Default::default()
            });
        }
        let found = self
            .consul
            .read_keys_concurrently(keys, READ_CONCURRENCY, READS_LABEL)
            .await?;
        let mut entries: Vec<crate::consul::KvPair> = found.into_values().collect();
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(parse_listing(index, &entries, prev))
    }

    /// Publishes `listing` if it differs from `prev`; returns whether it did.
    fn publish(&self, prev: Option<&RcListing>, listing: RcListing) -> bool {
        let changed = prev.is_none_or(|p| {
            p.index != listing.index
                || p.rcs.len() != listing.rcs.len()
                || p.invalid.len() != listing.invalid.len()
                || p.rcs
                    .iter()
                    .zip(&listing.rcs)
                    .any(|((a, x), (b, y))| a != b || x.modify_index != y.modify_index)
                || p.invalid
                    .iter()
                    .zip(&listing.invalid)
                    .any(|((a, x), (b, y))| a != b || x.modify_index != y.modify_index)
        });
        if changed {
            self.tx.send_replace(Some(Arc::new(listing)));
        }
        changed
    }
}

/// Of `listing`, the records of `wanted` and the keys that name no RC still in `keys`, at the
/// keys' index.
fn kept(listing: &RcListing, keys: &RcKeys, wanted: &BTreeSet<RcId>) -> RcListing {
    RcListing {
        index: keys.index,
        rcs: listing
            .rcs
            .iter()
            .filter(|(id, _)| wanted.contains(*id))
            .map(|(id, rc)| (*id, rc.clone()))
            .collect(),
        invalid: listing
            .invalid
            .iter()
            .filter(|(k, _)| match RcId::from_key(k) {
                Some(Ok(id)) => wanted.contains(&id),
                _ => keys.other.contains(*k),
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_split_into_rc_ids_and_others() {
        let (a, b) = (RcId::new(), RcId::new());
        // Not canonical: no RC's key (reported as unclaimable, as a record that names none).
        let upper = format!("{RC_PREFIX}{}", b.to_string().to_uppercase());
        let keys = RcKeys::parse(
            7,
            vec![
                a.key(),
                b.key(),
                upper.clone(),
                format!("{RC_PREFIX}not-an-id"),
            ],
        );
        assert_eq!(keys.index, 7);
        assert_eq!(keys.ids, [a, b].into_iter().collect());
        assert_eq!(keys.key_of(&a), a.key());
        assert_eq!(keys.other, vec![upper, format!("{RC_PREFIX}not-an-id")]);
        assert_eq!(keys.len(), 4);
    }
}
