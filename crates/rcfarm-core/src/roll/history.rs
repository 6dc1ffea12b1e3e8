//! Revision history: every RC a roll replaces leaves a revision (its manifest, selector, pod
//! labels, replica count, when, who, by which roll, and the roll's pace), so that an operator
//! can list what a lineage ran (`rcctl rc history`) and roll back to it (`rcctl roll undo`).
//!
//! A lineage is the chain of RCs that completed rolls connected. Its history lives in Consul
//! at `rcfarm/history/<current-rc-id>` (P2's tools never read `rcfarm/`, and rcctl needs no
//! audit database to read it): one JSON document, the last N revisions oldest first. The
//! transaction that completes a roll moves the document to the new RC's key with the old RC
//! as its newest revision, guarded by the versions it read, so two writers cannot lose one.
//! Rolls completed by P2's own `p2-rctl-server` leave no revision.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::control::RollControl;
use super::record::{RollId, Update};
use crate::consul::TxnOp;
use crate::labels::LabelSet;
use crate::rc::{Rc, RcId};

/// Where the histories of lineages live.
pub const HISTORY_PREFIX: &str = "rcfarm/history/";

/// The farm's default of `--revision-history`.
pub const DEFAULT_REVISIONS: usize = 10;

/// The most bytes a history document may take: it joins the completion's transaction, whose
/// values Consul 0.7 caps at 512 KiB altogether (and Consul 1.x its body, base64 included).
/// Past it, the oldest revisions are dropped (the newest is always kept).
pub const MAX_HISTORY_BYTES: usize = 256 * 1024;

/// `rcfarm/history/<rc-id>`.
pub fn history_key(rc: RcId) -> String {
    format!("{HISTORY_PREFIX}{rc}")
}

/// One RC a roll replaced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revision {
    /// Numbered per lineage, from 1, never reused (trimming drops the oldest numbers).
    pub revision: u64,
    /// The replaced RC (deleted by the roll unless it was kept).
    pub rc_id: RcId,
    /// The manifest as stored (YAML or JSON, as written).
    pub manifest: String,
    pub node_selector: String,
    #[serde(default)]
    pub pod_labels: LabelSet,
    /// The replicas the lineage ran when it was replaced (the roll's desired count).
    pub replicas: u64,
    pub replaced_at: DateTime<Utc>,
    /// Who started the roll (`rcctl:<user>@<host>`, `rcfarm auto-revert …`); unknown for rolls
    /// written without rcfarm's control record (P2's `p2-rctl schedule-update`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// The roll that replaced it (its id is the successor RC's).
    pub roll: RollId,
    /// The roll's pace, for an undo under the same minimum and pace.
    pub desired_replicas: u64,
    pub minimum_replicas: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallel: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_deadline: Option<String>,
    /// Replaced by a revert (`--auto-revert`): the manifest of a deploy that failed, which a
    /// plain `rcctl roll undo` passes over. (Farms before this field drop it when they move a
    /// history: such a revision reads as an ordinary one.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reverted: bool,
}

impl Revision {
    /// The revision `old` leaves when roll `u` (with its control) replaces it.
    pub fn of(old: &Rc, u: &Update, control: Option<&RollControl>, at: DateTime<Utc>) -> Self {
        Revision {
            revision: 0,
            rc_id: old.id,
            manifest: old.manifest.raw().to_string(),
            node_selector: old.node_selector.to_string(),
            pod_labels: old.pod_labels.clone(),
            replicas: u.desired_replicas,
            replaced_at: at,
            by: control.and_then(|c| c.created_by.clone()),
            roll: u.id(),
            desired_replicas: u.desired_replicas,
            minimum_replicas: u.minimum_replicas,
            max_parallel: control.and_then(|c| c.max_parallel),
            progress_deadline: control.and_then(|c| c.progress_deadline.clone()),
            reverted: control.is_some_and(|c| c.revert_of.is_some()),
        }
    }
}

/// A lineage's revisions, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    pub revisions: Vec<Revision>,
}

impl History {
    pub fn parse(bytes: &[u8]) -> Result<History, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not a revision history: {e}"))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        // Plain fields and string-keyed maps always serialize.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn latest(&self) -> Option<&Revision> {
        self.revisions.last()
    }

    /// What a plain undo goes back to: the newest revision that a revert did not replace (a
    /// failed deploy's manifest is no place to go back to), else none.
    pub fn undo_target(&self) -> Option<&Revision> {
        self.revisions.iter().rev().find(|r| !r.reverted)
    }

    pub fn get(&self, revision: u64) -> Option<&Revision> {
        self.revisions.iter().find(|r| r.revision == revision)
    }

    /// "1, 2, 3", for messages.
    pub fn numbers(&self) -> String {
        self.revisions
            .iter()
            .map(|r| r.revision.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The successor RC's history when a roll completes: the old RC's history (`old`), the
    /// successor's own if it had one (`new`: a revert onto an RC that already had a lineage,
    /// or `roll create` between two deployed RCs), then `rev` as the newest; at most `keep`
    /// revisions and [`MAX_HISTORY_BYTES`], oldest dropped first. When both lineages have
    /// revisions they are merged in time order and numbered again from 1 (the only case where
    /// numbers change).
    pub fn succeed(
        old: Option<History>,
        new: Option<History>,
        rev: Revision,
        keep: usize,
    ) -> History {
        let old = old.unwrap_or_default().revisions;
        let new = new.unwrap_or_default().revisions;
        let merged = !old.is_empty() && !new.is_empty();
        let mut revisions: Vec<Revision> = old;
        for r in new {
            if !revisions
                .iter()
                .any(|o| o.rc_id == r.rc_id && o.roll == r.roll)
            {
                revisions.push(r);
            }
        }
        if merged {
            revisions.sort_by_key(|r| (r.replaced_at, r.revision));
            for (i, r) in revisions.iter_mut().enumerate() {
                r.revision = i as u64 + 1;
            }
        }
        let next = revisions.iter().map(|r| r.revision).max().unwrap_or(0) + 1;
        revisions.push(Revision {
            revision: next,
            ..rev
        });
        let mut h = History { revisions };
        h.trim(keep);
        h
    }

    /// Keeps the newest `keep` revisions, fewer if the document would pass
    /// [`MAX_HISTORY_BYTES`] (never fewer than one).
    fn trim(&mut self, keep: usize) {
        let drop = self.revisions.len().saturating_sub(keep.max(1));
        self.revisions.drain(..drop);
        while self.revisions.len() > 1 && self.to_bytes().len() > MAX_HISTORY_BYTES {
            self.revisions.remove(0);
        }
    }
}

/// A history as read: the document (an unreadable one is `Err`) and its key's version.
#[derive(Debug, Clone)]
pub struct HistorySeen {
    pub history: Result<History, String>,
    pub index: u64,
}

/// The writes that move a lineage's history from the old RC to the new one as a roll
/// completes, guarded by the versions read (`None`: the key was absent). `keep` 0 keeps no
/// history at all (the old RC's key is still removed).
pub fn completion_ops(
    old_rc: RcId,
    new_rc: RcId,
    old_seen: Option<&HistorySeen>,
    new_seen: Option<&HistorySeen>,
    rev: Revision,
    keep: usize,
) -> Vec<TxnOp> {
    let mut ops = Vec::new();
    // An unreadable document is replaced rather than blocking the roll forever: the farm
    // cannot fix it, and a completion must not wait on history.
    let usable = |s: Option<&HistorySeen>| s.and_then(|s| s.history.clone().ok());
    if keep > 0 {
        let h = History::succeed(usable(old_seen), usable(new_seen), rev, keep);
        ops.push(TxnOp::cas(
            history_key(new_rc),
            h.to_bytes(),
            new_seen.map_or(0, |s| s.index),
        ));
    } else if let Some(s) = new_seen {
        ops.push(TxnOp::delete_cas(history_key(new_rc), s.index));
    }
    if let Some(s) = old_seen {
        ops.push(TxnOp::delete_cas(history_key(old_rc), s.index));
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rev(rc: RcId, at: i64) -> Revision {
        Revision {
            revision: 0,
            rc_id: rc,
            manifest: format!("id: web\nv: {at}\n"),
            node_selector: "env=prod".into(),
            pod_labels: LabelSet::new(),
            replicas: 3,
            replaced_at: DateTime::from_timestamp(at, 0).unwrap(),
            by: Some("rcctl:ops@host".into()),
            roll: RcId::new(),
            desired_replicas: 3,
            minimum_replicas: 2,
            max_parallel: None,
            progress_deadline: None,
            reverted: false,
        }
    }

    #[test]
    fn a_lineage_numbers_revisions_and_keeps_the_last_n() {
        let mut h: Option<History> = None;
        for i in 0..5 {
            h = Some(History::succeed(h, None, rev(RcId::new(), i), 3));
        }
        let h = h.unwrap();
        assert_eq!(h.numbers(), "3, 4, 5");
        assert_eq!(h.latest().unwrap().revision, 5);
        assert!(h.get(2).is_none());
        assert_eq!(History::parse(&h.to_bytes()).unwrap(), h);
        assert!(History::parse(b"nope").is_err());
    }

    #[test]
    fn a_plain_undo_passes_over_what_a_revert_replaced() {
        let mut h = None;
        for i in 0..3 {
            let mut r = rev(RcId::new(), i);
            // The third deploy failed and was reverted: its RC is the revert's revision.
            r.reverted = i == 2;
            h = Some(History::succeed(h, None, r, 10));
        }
        let h = h.unwrap();
        assert_eq!(h.latest().unwrap().revision, 3);
        assert_eq!(h.undo_target().unwrap().revision, 2);
        // The mark survives the round trip, and a record without it reads as not reverted.
        let back = History::parse(&h.to_bytes()).unwrap();
        assert!(back.revisions[2].reverted && !back.revisions[1].reverted);
        assert!(
            !String::from_utf8(h.to_bytes())
                .unwrap()
                .contains("\"reverted\":false")
        );
        let only = History::succeed(
            None,
            None,
            Revision {
                reverted: true,
                ..rev(RcId::new(), 1)
            },
            10,
        );
        assert!(only.undo_target().is_none());
    }

    #[test]
    fn two_lineages_merge_in_time_order() {
        let a = History::succeed(None, None, rev(RcId::new(), 10), 10);
        let b = History::succeed(None, None, rev(RcId::new(), 5), 10);
        let m = History::succeed(Some(a.clone()), Some(b.clone()), rev(RcId::new(), 20), 10);
        assert_eq!(m.numbers(), "1, 2, 3");
        assert_eq!(m.revisions[0].rc_id, b.revisions[0].rc_id);
        assert_eq!(m.revisions[1].rc_id, a.revisions[0].rc_id);
        // The same revision in both (a revert onto an RC of the lineage) is kept once.
        let again = History::succeed(Some(a.clone()), Some(a), rev(RcId::new(), 30), 10);
        assert_eq!(again.revisions.len(), 2);
    }

    #[test]
    fn a_history_too_big_drops_its_oldest_revisions() {
        let mut h = None;
        for i in 0..6 {
            let mut r = rev(RcId::new(), i);
            r.manifest = "x".repeat(MAX_HISTORY_BYTES / 4);
            h = Some(History::succeed(h, None, r, 10));
        }
        let h = h.unwrap();
        assert!(h.to_bytes().len() <= MAX_HISTORY_BYTES);
        assert_eq!(h.latest().unwrap().revision, 6);
        assert!(h.revisions.len() < 6);
    }

    #[test]
    fn completion_moves_the_history_under_the_versions_read() {
        let (old, new) = (RcId::new(), RcId::new());
        let seen = HistorySeen {
            history: Ok(History::succeed(None, None, rev(RcId::new(), 1), 10)),
            index: 7,
        };
        let ops = completion_ops(old, new, Some(&seen), None, rev(old, 2), 10);
        assert_eq!(ops.len(), 2);
        assert_eq!(ops[1], TxnOp::delete_cas(history_key(old), 7));
        let none = completion_ops(old, new, None, None, rev(old, 2), 0);
        assert!(none.is_empty());
    }
}
