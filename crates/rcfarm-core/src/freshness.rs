//! Views and freshness: which of the farm's views a decision must have read again before it is
//! made, so that every decision comes from one consistent cut of Consul.
//!
//! Consul's index is one Raft index for the whole store, and every change a decision acts on
//! has one (an RC's `ModifyIndex`, a claim's write). A decision may act on a change only from
//! views that are each current to at least that index. A view is known current to index `m`
//! when its last answer's index is `m` or more (an answer is the store as of at least its own
//! index), or when a read the farm sent after it learned of the change was answered since:
//! Consul's index of a prefix is the newest change *under that prefix*, so a view whose tree
//! did not change can show an index far below `m` and still be current, and only a read sent
//! afterwards can tell.
//!
//! [`stale_views`] is the pure rule: given a decision, the index it acts on and what the farm
//! knows of each view, it names the views to read first. [`RULES`] is its table, one row per
//! decision, with the reason; `docs/architecture.md` ("Views and freshness") is the page a
//! newcomer reads. The farm's side (asking a watch for a read sent now, and waiting for its
//! answer) is [`crate::consul::Demand`].

/// A view of Consul a decision reads, as the farm holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum View {
    /// Node labels (`labels/node/`): which nodes an RC's selector makes eligible.
    NodeLabels,
    /// Pod labels (`labels/pod/`): which pods each RC has, and whose a pod is.
    PodLabels,
    /// The RC's own record (`replication_controllers/<id>`), read when its keys' index moves.
    RcRecord,
}

impl View {
    pub fn name(self) -> &'static str {
        match self {
            View::NodeLabels => "node labels",
            View::PodLabels => "pod labels",
            View::RcRecord => "RC record",
        }
    }
}

/// A decision a farm makes, by what it changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// An RC task places pods on free nodes (schedule, allocate, repair in place).
    Place,
    /// An RC task takes pods over in place from the RC a rolling update moves replicas from.
    TakeOver,
    /// An RC task removes pods it chose (scale down, replace, unschedule an ineligible node).
    Remove,
    /// An RC task starts moving a pod off a node it found ineligible.
    Transfer,
    /// An RC task ends a transfer (completes or rolls it back).
    EndTransfer,
    /// An RC task finds nothing to do, and reports the RC settled or its desires unmet.
    Idle,
}

/// How current a decision needs a view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Current to the index the decision acts on.
    ToChange,
    /// Holding every write another session made since this farm took the RC: the RC's own
    /// pods are written only under its lock, by this farm (applied to the view as it commits)
    /// or by the session that held it before (owed a read when the farm took the RC over).
    SinceTakeover,
}

/// One row of the table: a decision, the views it reads, how current each must be, and why.
pub struct Rule {
    pub decision: Decision,
    pub needs: &'static [(View, Need)],
    pub why: &'static str,
}

/// The rules, one row per decision. A view a decision reads and the table does not name is
/// read as the farm holds it: the rows say why that is enough.
pub const RULES: &[Rule] = &[
    Rule {
        decision: Decision::Place,
        needs: &[
            (View::RcRecord, Need::ToChange),
            (View::PodLabels, Need::SinceTakeover),
        ],
        why: "a pod placed from a node view that lacks a relabel is moved by a transfer once the \
              view has it; a read of the node tree before every placement would cost a whole \
              tree per pace on a converging farm. Pods another session wrote must be known, or \
              the RC gets more pods than it wants",
    },
    Rule {
        decision: Decision::TakeOver,
        needs: &[
            (View::RcRecord, Need::ToChange),
            (View::NodeLabels, Need::ToChange),
            (View::PodLabels, Need::SinceTakeover),
        ],
        why: "a roll's new RC chooses which of the old RC's pods to keep: one taken over on a \
              node relabelled just before the roll started is moved by a transfer, onto the \
              node of an eligible pod the old RC then removed",
    },
    Rule {
        decision: Decision::Remove,
        needs: &[
            (View::RcRecord, Need::ToChange),
            (View::NodeLabels, Need::ToChange),
            (View::PodLabels, Need::SinceTakeover),
        ],
        why: "a removal chooses ineligible nodes first: a node view without a relabel committed \
              before the RC write would remove an eligible pod and keep the ineligible one",
    },
    Rule {
        decision: Decision::Transfer,
        needs: &[
            (View::RcRecord, Need::ToChange),
            (View::NodeLabels, Need::ToChange),
            (View::PodLabels, Need::SinceTakeover),
        ],
        why: "a transfer moves a pod off a node found ineligible and onto one found eligible: \
              both from the node labels as of the RC's selector",
    },
    Rule {
        decision: Decision::EndTransfer,
        needs: &[
            (View::RcRecord, Need::ToChange),
            (View::PodLabels, Need::SinceTakeover),
        ],
        why: "a transfer ends on its new pod's health and the RC's version, both read with \
              the transfer record; it is guarded by the RC's index at commit",
    },
    Rule {
        decision: Decision::Idle,
        needs: &[
            (View::RcRecord, Need::ToChange),
            (View::PodLabels, Need::SinceTakeover),
        ],
        why: "nothing to do is a decision too: pods another session wrote and the view lacks \
              would be left until the next resync (an RC at 0 keeping its previous farm's pods)",
    },
];

/// The views a decision reads and how current each must be.
pub fn needs(decision: Decision) -> &'static [(View, Need)] {
    RULES
        .iter()
        .find(|r| r.decision == decision)
        .map_or(&[], |r| r.needs)
}

/// What the farm knows of one view when a decision is about to be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub view: View,
    /// The index of the view's last answer (0: none yet).
    pub index: u64,
    /// The newest index the view is known current to because a read sent after the farm
    /// learned of it was answered (0: none).
    pub read_for: u64,
    /// Another session may have written in it since the farm last read it for this RC.
    pub owed: bool,
}

impl Seen {
    pub fn new(view: View, index: u64) -> Seen {
        Seen {
            view,
            index,
            read_for: 0,
            owed: false,
        }
    }

    /// Whether the view is known current to index `m`.
    pub fn current_to(&self, m: u64) -> bool {
        self.index >= m || self.read_for >= m
    }
}

/// The views to read before `decision` acts on the change at index `acts_on`, in the order of
/// [`View`]. A view the decision needs and `seen` does not mention is not known: it is read.
pub fn stale_views(decision: Decision, acts_on: u64, seen: &[Seen]) -> Vec<View> {
    let mut stale: Vec<View> = needs(decision)
        .iter()
        .filter(|(view, need)| {
            let Some(s) = seen.iter().find(|s| s.view == *view) else {
                return true;
            };
            match need {
                Need::ToChange => !s.current_to(acts_on),
                Need::SinceTakeover => s.owed,
            }
        })
        .map(|(view, _)| *view)
        .collect();
    stale.sort();
    stale
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 100;

    fn seen(view: View, index: u64) -> Seen {
        Seen::new(view, index)
    }

    /// The table: situation → views to read first, with the reason.
    #[test]
    fn rules() {
        let nodes_behind = seen(View::NodeLabels, M - 1);
        let nodes_current = seen(View::NodeLabels, M);
        let nodes_read_since = Seen {
            read_for: M,
            ..seen(View::NodeLabels, 7)
        };
        let rc = seen(View::RcRecord, M);
        let pods = seen(View::PodLabels, 3);
        let pods_owed = Seen { owed: true, ..pods };
        #[rustfmt::skip]
        let rows: &[(&str, Decision, &[Seen], &[View])] = &[
            ("a removal from a node view behind the RC write reads the nodes first",
             Decision::Remove, &[rc, nodes_behind, pods], &[View::NodeLabels]),
            ("a node view whose index is the RC write's or later is current",
             Decision::Remove, &[rc, nodes_current, pods], &[]),
            ("a node tree unchanged for long is current once read after the RC write was learnt",
             Decision::Remove, &[rc, nodes_read_since, pods], &[]),
            ("a transfer chooses by eligibility as a removal does",
             Decision::Transfer, &[rc, nodes_behind, pods], &[View::NodeLabels]),
            ("a placement does not wait for the node tree: a transfer corrects it",
             Decision::Place, &[rc, nodes_behind, pods], &[]),
            ("a roll's takeover chooses by eligibility: the nodes are read first",
             Decision::TakeOver, &[rc, nodes_behind, pods], &[View::NodeLabels]),
            ("pods another session may have written are read before any decision",
             Decision::Place, &[rc, nodes_current, pods_owed], &[View::PodLabels]),
            ("pods owed and nodes behind: a removal reads both",
             Decision::Remove, &[rc, nodes_behind, pods_owed], &[View::NodeLabels, View::PodLabels]),
            ("the pod view's own index says nothing of the RC's pods: only what is owed counts",
             Decision::Remove, &[rc, nodes_current, seen(View::PodLabels, 1)], &[]),
            ("a transfer's end reads no node labels",
             Decision::EndTransfer, &[rc, nodes_behind, pods], &[]),
            ("nothing to do is decided from every pod another session wrote",
             Decision::Idle, &[rc, nodes_behind, pods_owed], &[View::PodLabels]),
            ("nothing to do needs no node read",
             Decision::Idle, &[rc, nodes_behind, pods], &[]),
            ("a view the farm has no word of is read",
             Decision::Remove, &[rc, pods], &[View::NodeLabels]),
        ];
        for (why, decision, views, want) in rows {
            assert_eq!(&stale_views(*decision, M, views), want, "{why}");
        }
    }

    #[test]
    fn every_decision_has_one_row_and_reads_its_rc_at_the_change() {
        for d in [
            Decision::Place,
            Decision::TakeOver,
            Decision::Remove,
            Decision::Transfer,
            Decision::EndTransfer,
            Decision::Idle,
        ] {
            assert_eq!(RULES.iter().filter(|r| r.decision == d).count(), 1, "{d:?}");
            assert!(
                needs(d).contains(&(View::RcRecord, Need::ToChange)),
                "{d:?}"
            );
        }
    }
}
