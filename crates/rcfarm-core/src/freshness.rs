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
    /// The lock tree (`lock/`): which session holds each RC, roll and mutation.
    LockTree,
    /// The tree of RCs (or of rolls) as one listing: which objects exist, and their records.
    Objects,
    /// The cluster's removal window (`rcfarm/removals/window`).
    RemovalWindow,
}

impl View {
    pub fn name(self) -> &'static str {
        match self {
            View::NodeLabels => "node labels",
            View::PodLabels => "pod labels",
            View::RcRecord => "RC record",
            View::LockTree => "lock tree",
            View::Objects => "objects",
            View::RemovalWindow => "removal window",
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
    /// The farm loop's ownership decisions: what to claim, which tasks to start or stop, what
    /// to hand over (`farm::decide`).
    Own,
    /// A roll worker's step: lock, grow the new RC, retire the old one, complete or revert.
    RollStep,
    /// The failsafe's tripwire looks at the RC tree (a bulk edit holds every removal).
    Trip,
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
    /// As read, with what this farm's own writes taught it laid over it ([`Learnt`]), each
    /// until the view is current to that write. What other sessions wrote since is not
    /// needed: the write the decision makes is refused if it conflicts (a lock acquire fails
    /// on a held lock, and the refusal is learnt in turn).
    OwnWrites,
    /// As read: the decision's write carries the index it read (a `cas`, a `check-index`), so
    /// a view behind makes the write fail and the decision is made again from a fresh read.
    Guarded,
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
    Rule {
        decision: Decision::Own,
        needs: &[
            (View::LockTree, Need::OwnWrites),
            (View::Objects, Need::OwnWrites),
        ],
        why: "a claim is an acquire, refused if another session holds the lock; what the view \
              lacks of this farm's own claims, refusals, releases and finished objects would \
              stop its own tasks, claim again what was refused, restart what it gave back or \
              finished: each is laid over the view until a read after it (`farm::ownership`). \
              Objects waiting between farms are settled by reads of their own (`decide::claims`)",
    },
    Rule {
        decision: Decision::RollStep,
        needs: &[
            (View::Objects, Need::ToChange),
            (View::RcRecord, Need::Guarded),
            (View::RemovalWindow, Need::Guarded),
        ],
        why: "a roll is written with its new RC in one transaction: an RC listing older than the \
              roll is behind, not proof that an RC is gone (the missing RC is read from Consul). \
              Each step's write is guarded by both RCs' indexes, and a retirement's charge by \
              the window's",
    },
    Rule {
        decision: Decision::Trip,
        needs: &[
            (View::Objects, Need::ToChange),
            (View::PodLabels, Need::SinceTakeover),
        ],
        why: "the tripwire's first look at a share trips on RCs at 0 only if their pods run: \
              the pods of RCs just taken from another farm are read first, every removal \
              held meanwhile (`Failsafe::await_first_look`)",
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

/// What one of this farm's own writes taught it about a view that the view may not show yet
/// (an object claimed, a claim refused, a lock given back, an object finished). A decision
/// reads the view with it laid over (`Need::OwnWrites`) until the view is known current to
/// the write: the view's index reached the write's, or a read sent after the write was
/// answered. Not "any answer since": a read answered after the write may have been sent
/// before it, and an answer equal to the last leaves a watch's view as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learnt {
    /// The view shows the write from this index on.
    index: u64,
    /// With an on-demand view: the ticket of a read asked for after the write.
    ticket: Option<u64>,
}

impl Learnt {
    /// A write committed at `index`.
    pub fn written_at(index: u64) -> Learnt {
        Learnt {
            index,
            ticket: None,
        }
    }

    /// A write whose index the farm does not know (a refusal, a release), learnt while the
    /// view stood at `view_index`: shown by the view's next change, or, for an on-demand view,
    /// by the answer to `ticket` (a read asked for now).
    pub fn after(view_index: u64, ticket: Option<u64>) -> Learnt {
        Learnt {
            index: view_index.saturating_add(1),
            ticket,
        }
    }

    /// Whether a view at `view_index`, whose reads with a ticket are `answered`, shows it.
    pub fn shown(&self, view_index: u64, answered: impl Fn(u64) -> bool) -> bool {
        match self.ticket {
            Some(t) => answered(t),
            None => view_index >= self.index,
        }
    }
}

/// The views to read before `decision` acts on the change at index `acts_on`, in the order of
/// [`View`]. A view the decision needs current and `seen` does not mention is not known: it is
/// read. A view needed with its own writes laid over, or guarded at the write, never is.
pub fn stale_views(decision: Decision, acts_on: u64, seen: &[Seen]) -> Vec<View> {
    let mut stale: Vec<View> = needs(decision)
        .iter()
        .filter(|(view, need)| {
            let known = || seen.iter().find(|s| s.view == *view);
            match need {
                Need::ToChange => known().is_none_or(|s| !s.current_to(acts_on)),
                Need::SinceTakeover => known().is_none_or(|s| s.owed),
                // Never read first: see their docs.
                Need::OwnWrites | Need::Guarded => false,
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
            ("ownership reads nothing first: own writes are laid over, others' refuse the acquire",
             Decision::Own, &[seen(View::LockTree, 1), seen(View::Objects, 1)], &[]),
            ("a roll step from an RC listing older than the roll reads it first",
             Decision::RollStep, &[seen(View::Objects, M - 1), rc], &[View::Objects]),
            ("a roll step's RC records and window are guarded by their indexes",
             Decision::RollStep, &[seen(View::Objects, M), seen(View::RcRecord, 1),
                                   seen(View::RemovalWindow, 1)], &[]),
            ("the tripwire's first look at RCs just taken waits for their pods",
             Decision::Trip, &[seen(View::Objects, M), pods_owed], &[View::PodLabels]),
            ("a look at a share whose pods are read decides at once",
             Decision::Trip, &[seen(View::Objects, M), pods], &[]),
        ];
        for (why, decision, views, want) in rows {
            assert_eq!(&stale_views(*decision, M, views), want, "{why}");
        }
    }

    #[test]
    fn every_decision_has_one_row_and_an_rc_task_reads_its_rc_at_the_change() {
        let rc_task = [
            Decision::Place,
            Decision::TakeOver,
            Decision::Remove,
            Decision::Transfer,
            Decision::EndTransfer,
            Decision::Idle,
        ];
        for d in rc_task {
            assert!(
                needs(d).contains(&(View::RcRecord, Need::ToChange)),
                "{d:?}"
            );
        }
        for d in rc_task
            .into_iter()
            .chain([Decision::Own, Decision::RollStep, Decision::Trip])
        {
            assert_eq!(RULES.iter().filter(|r| r.decision == d).count(), 1, "{d:?}");
        }
    }

    /// What the farm's own writes taught it stands until the view is current to them.
    #[test]
    fn learnt() {
        let none = |_: u64| false;
        let answered_7 = |t: u64| t <= 7;
        #[rustfmt::skip]
        let rows: &[(&str, Learnt, u64, bool, bool)] = &[
            // (why, learnt, view index, ticket 7 answered?, shown)
            ("a claim committed at 50: a view at 49 lacks it",
             Learnt::written_at(50), 49, false, false),
            ("a view at the claim's index shows it",
             Learnt::written_at(50), 50, false, true),
            ("a refusal learnt with the view at 40: an answer at 40 again says nothing",
             Learnt::after(40, None), 40, false, false),
            ("the watch's next change shows it",
             Learnt::after(40, None), 41, false, true),
            ("an on-demand view: its index says nothing, however new",
             Learnt::after(40, Some(8)), 1000, true, false),
            ("the read asked for after the refusal answered",
             Learnt::after(40, Some(7)), 40, true, true),
        ];
        for (why, l, index, answered, shown) in rows {
            let got = if *answered {
                l.shown(*index, answered_7)
            } else {
                l.shown(*index, none)
            };
            assert_eq!(got, *shown, "{why}");
        }
    }
}
