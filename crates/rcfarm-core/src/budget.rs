//! The cluster's removal budget: one Consul key, `rcfarm/removals/window`, that every removal
//! charges **in its own transaction** (a `cas` on the key's `ModifyIndex`, beside the writes
//! that remove pods). A removal commits if and only if it is charged: nothing is granted ahead
//! and nothing is given back, so a cancelled task, a handover, a crash, a lost answer, a paced
//! write or a restart can neither leak removals nor spend them twice. A farm whose `cas` loses
//! reads the key again and plans again.
//!
//! The key's value stays small whatever the limit: removals are counted per time bucket (a
//! thirtieth of the window), not per pod, plus one entry per farm for the base of a percentage.
//!
//! **The limit.** `--max-removals` is the whole cluster's limit per `--max-removals-window`,
//! whatever the number of farms. A percentage (the default, `20%`) is of the pods the farms
//! serve: each farm writes its own count into the key (`farms`), so every farm computes the
//! same limit from the same version of the key without reading every RC, and the key keeps the
//! largest sum seen within the window (`peak`), so a cluster scaling down does not see its
//! limit shrink with each pod it removes. The limit a charge was made under is written with it
//! (`limit`): an outside check reads the same number the farm acted on.
//!
//! Pure: wall time (unix seconds) is an argument; the farm's side is [`crate::failsafe`], which
//! uses this module (never the other way round).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A percentage limit never goes below this many removals per window (a small farm must still
/// be able to scale down).
pub const MIN_REMOVALS: u64 = 5;

/// `--max-removals`: a count, a percentage of the pods the farms serve, or `off`: the whole
/// cluster's limit per window ([`crate::budget`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxRemovals {
    Off,
    Pods(u64),
    /// Percent of the pods the farms serve, at least [`MIN_REMOVALS`].
    Percent(u64),
}

impl Default for MaxRemovals {
    fn default() -> Self {
        MaxRemovals::Percent(20)
    }
}

impl MaxRemovals {
    /// The most removals per window for farms serving `served` pods (`None`: no limit).
    pub fn limit(self, served: u64) -> Option<u64> {
        match self {
            MaxRemovals::Off => None,
            MaxRemovals::Pods(n) => Some(n),
            MaxRemovals::Percent(p) => Some((served.saturating_mul(p) / 100).max(MIN_REMOVALS)),
        }
    }
}

impl FromStr for MaxRemovals {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let bad = || {
            format!(
                "{s:?}: give a number of pods (20), a percentage of the pods the farms serve (20%), or off"
            )
        };
        if s.eq_ignore_ascii_case("off") {
            return Ok(MaxRemovals::Off);
        }
        let zero = || {
            format!(
                "{s:?}: a farm allowed no removal could never scale down or roll; give at least 1 (or 1%), or off"
            )
        };
        if let Some(p) = s.strip_suffix('%') {
            let p: u64 = p.trim().parse().map_err(|_| bad())?;
            if p == 0 {
                return Err(zero());
            }
            if p > 100 {
                return Err(format!("{s:?}: a percentage is at most 100%"));
            }
            return Ok(MaxRemovals::Percent(p));
        }
        match s.parse::<u64>().map_err(|_| bad())? {
            0 => Err(zero()),
            n => Ok(MaxRemovals::Pods(n)),
        }
    }
}

impl fmt::Display for MaxRemovals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaxRemovals::Off => write!(f, "off"),
            MaxRemovals::Pods(n) => write!(f, "{n}"),
            MaxRemovals::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// The one key every farm charges.
pub const BUDGET_KEY: &str = "rcfarm/removals/window";

/// The prefix of [`BUDGET_KEY`] (a farm's ACL token needs write on it).
pub const BUDGET_PREFIX: &str = "rcfarm/removals/";

/// Buckets per window: a removal counts for at most a thirtieth of the window longer than the
/// window itself (the bucket it fell in is counted whole), never shorter.
const BUCKETS: u64 = 30;

/// An operator's release, as the key records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    pub by: String,
    /// Unix seconds.
    pub at: i64,
}

/// A farm's count of the pods it serves, as the key records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Served {
    pub pods: u64,
    /// Unix seconds.
    pub at: i64,
    /// The session the farm held when it wrote the count. A farm whose session ended lost its
    /// RCs with it, and registers again under the same farm id with a new session: its count
    /// from before is then dropped by whoever writes next ([`Window::without_stale`]), not
    /// kept until the farm itself writes again. Absent in counts written by farms of releases
    /// before it (kept while their farm id is live, as those releases did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
}

/// A farm's count as it writes it: its id, its session, the pods it serves now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count<'a> {
    pub farm: &'a str,
    pub session: Option<&'a str>,
    pub pods: u64,
}

impl Count<'_> {
    fn served(self, now: i64) -> Served {
        Served {
            pods: self.pods,
            at: now,
            session: self.session.map(str::to_string),
        }
    }
}

/// The key's value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// The window's length in seconds, as the last writer had it.
    #[serde(default)]
    pub window_s: u64,
    /// One bucket's length in seconds (`window_s / 30`, at least 1).
    #[serde(default)]
    pub bucket_s: u64,
    /// (a bucket's start in unix seconds, removals charged in it), oldest first.
    #[serde(default)]
    pub buckets: Vec<(i64, u64)>,
    /// The limit the last charge was made under (`None`: no limit).
    #[serde(default)]
    pub limit: Option<u64>,
    /// `--max-removals` as the last writer had it (`20%`, `50`).
    #[serde(default)]
    pub max_removals: String,
    /// Each farm's count of the pods it serves (the base of a percentage), by farm id.
    #[serde(default)]
    pub farms: BTreeMap<String, Served>,
    /// The largest sum of `farms` within the window, and when it was seen.
    #[serde(default)]
    pub peak: u64,
    #[serde(default)]
    pub peak_at: i64,
    /// The last operator's release: buckets before it were emptied.
    #[serde(default)]
    pub released: Option<Released>,
}

/// The window's settings, as one farm has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub max_removals: MaxRemovals,
    pub window: Duration,
}

impl Settings {
    fn window_s(self) -> u64 {
        self.window.as_secs().max(1)
    }

    fn bucket_s(self) -> u64 {
        self.window_s().div_ceil(BUCKETS).max(1)
    }
}

impl Window {
    pub fn parse(bytes: &[u8]) -> Result<Window, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not a removal window record: {e}"))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        // Plain fields and string-keyed maps always serialize.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Whether the bucket starting at `start` (of `bucket_s` seconds) still counts at `now`:
    /// some second of it lies within the window before `now`.
    fn counts(start: i64, bucket_s: u64, window_s: u64, now: i64) -> bool {
        start + bucket_s as i64 > now - window_s as i64
    }

    /// Removals charged within the window before `now` (unix seconds).
    pub fn spent(&self, s: Settings, now: i64) -> u64 {
        let bucket_s = self.bucket_s.max(1);
        self.buckets
            .iter()
            .filter(|(b, _)| Self::counts(*b, bucket_s, s.window_s(), now))
            .map(|(_, n)| n)
            .sum()
    }

    /// The pods the farms serve, by their own counts that are not older than the window.
    pub fn served(&self, s: Settings, now: i64) -> u64 {
        self.farms
            .values()
            .filter(|f| now - f.at < s.window_s() as i64)
            .map(|f| f.pods)
            .sum()
    }

    /// The base of a percentage: the most pods served within the window.
    pub fn base(&self, s: Settings, now: i64) -> u64 {
        let peak = if now - self.peak_at < s.window_s() as i64 {
            self.peak
        } else {
            0
        };
        peak.max(self.served(s, now))
    }

    /// The cluster's limit now (`None`: no limit).
    pub fn limit(&self, s: Settings, now: i64) -> Option<u64> {
        s.max_removals.limit(self.base(s, now))
    }

    /// How many more removals may be charged now (`u64::MAX`: no limit).
    pub fn room(&self, s: Settings, now: i64) -> u64 {
        match self.limit(s, now) {
            None => u64::MAX,
            Some(l) => l.saturating_sub(self.spent(s, now)),
        }
    }

    /// When room comes back (unix seconds): when the oldest bucket still counted leaves the
    /// window. `None`: nothing is counted.
    pub fn room_at(&self, s: Settings, now: i64) -> Option<i64> {
        let bucket_s = self.bucket_s.max(1);
        self.buckets
            .iter()
            .find(|(b, _)| Self::counts(*b, bucket_s, s.window_s(), now))
            .map(|(b, _)| b + bucket_s as i64 + s.window_s() as i64)
    }

    /// The record with what no longer counts dropped, and the settings, the peak and the limit
    /// brought to `now` (what every write does first).
    fn refreshed(&self, s: Settings, now: i64) -> Window {
        let mut w = self.clone();
        let (window_s, bucket_s) = (s.window_s(), s.bucket_s());
        // Buckets written with another length (a farm with another window) are kept while the
        // longer of the two lengths still counts them.
        let kept = w.bucket_s.max(bucket_s);
        w.buckets
            .retain(|(b, _)| Self::counts(*b, kept, window_s, now));
        w.window_s = window_s;
        w.bucket_s = bucket_s;
        w.farms.retain(|_, f| now - f.at < window_s as i64);
        let base = w.base(s, now);
        if base > w.peak || now - w.peak_at >= window_s as i64 {
            w.peak = base;
            w.peak_at = now;
        }
        w.max_removals = s.max_removals.to_string();
        w.limit = w.limit(s, now);
        w
    }

    /// The record after charging `n` removals at `now`, or why not: the window has no room for
    /// them. `farm` reports the pods it serves with the charge.
    pub fn charge(
        &self,
        s: Settings,
        now: i64,
        n: u64,
        farm: Option<Count<'_>>,
    ) -> Result<Window, u64> {
        let mut w = self.refreshed(s, now);
        if let Some(c) = farm {
            w.farms.insert(c.farm.to_string(), c.served(now));
            w = w.refreshed(s, now);
        }
        let room = w.room(s, now);
        if n > room {
            return Err(room);
        }
        if n > 0 {
            let start = now - now.rem_euclid(w.bucket_s as i64);
            match w.buckets.iter_mut().find(|(b, _)| *b == start) {
                Some((_, c)) => *c += n,
                None => {
                    w.buckets.push((start, n));
                    w.buckets.sort_unstable();
                }
            }
        }
        Ok(w)
    }

    /// The record after a farm reports the pods it serves now.
    pub fn report(&self, s: Settings, now: i64, c: Count<'_>) -> Window {
        let mut w = self.clone();
        w.farms.insert(c.farm.to_string(), c.served(now));
        w.refreshed(s, now)
    }

    /// The record without the counts of farms that are not live (`live`: farm id → the
    /// session its registration holds), nor those written under another session than the one
    /// the farm's registration holds now: a farm whose session ended serves nothing (its locks
    /// went with the session, and the farms that take its RCs over count them), whether or
    /// not it registered again since. Counts without a session (farms of an older release)
    /// are kept while their farm is live. `me`'s own count is kept: its write replaces it.
    pub fn without_stale(&self, me: &str, live: &BTreeMap<String, String>) -> Window {
        let mut w = self.clone();
        w.farms.retain(|id, f| {
            id == me
                || live
                    .get(id)
                    .is_some_and(|s| f.session.as_ref().is_none_or(|fs| fs == s))
        });
        w
    }

    /// Whether `farm`'s count in the record is due to be written again: absent, off by more
    /// than a tenth (and by more than one pod), or older than half the window.
    pub fn report_due(&self, s: Settings, now: i64, farm: &str, pods: u64) -> bool {
        match self.farms.get(farm) {
            None => pods > 0,
            Some(f) => {
                let off = f.pods.abs_diff(pods);
                (off > 1 && off * 10 > f.pods) || now - f.at >= (s.window_s() / 2) as i64
            }
        }
    }

    /// The settings the last writer had, as the record says them (for readers that are not a
    /// farm: `rcctl farms`, the chaos observer). `None`: no farm has written it yet.
    pub fn recorded_settings(&self) -> Option<Settings> {
        Some(Settings {
            max_removals: self.max_removals.parse().ok()?,
            window: Duration::from_secs(self.window_s.max(1)),
        })
    }

    /// Removals the window holds at `now` by the settings it records (an operator's release
    /// reports it): buckets that left the window are not held, though not yet pruned.
    pub fn held(&self, now: i64) -> u64 {
        match self.recorded_settings() {
            Some(s) => self.spent(s, now),
            None => self.buckets.iter().map(|b| b.1).sum(),
        }
    }

    /// One line for operators: spent, limit, when room comes back.
    pub fn describe(&self, now: i64) -> String {
        let Some(st) = self.recorded_settings() else {
            return "no removal charged yet".into();
        };
        let limit = self
            .limit(st, now)
            .map_or("no limit".to_string(), |l| l.to_string());
        let base = match st.max_removals {
            MaxRemovals::Percent(_) => format!(" of {} pods", self.base(st, now)),
            _ => String::new(),
        };
        let room = match (self.room(st, now), self.room_at(st, now)) {
            (0, Some(t)) => format!("; room again in {}s", (t - now).max(1)),
            _ => String::new(),
        };
        format!(
            "{} of {limit} removals in the last {}s (--max-removals {}{base}){room}",
            self.spent(st, now),
            st.window.as_secs(),
            st.max_removals
        )
    }

    /// Removals charged since `before` (an earlier version of the record): what its buckets
    /// grew by. Buckets only grow, or leave once they no longer count.
    pub fn charged_since(&self, before: &Window) -> u64 {
        let was: BTreeMap<i64, u64> = before.buckets.iter().copied().collect();
        self.buckets
            .iter()
            .map(|(b, n)| n.saturating_sub(was.get(b).copied().unwrap_or(0)))
            .sum()
    }

    /// The record after an operator's release: every bucket emptied.
    pub fn release(&self, by: &str, now: i64) -> Window {
        let mut w = self.clone();
        w.buckets.clear();
        w.released = Some(Released {
            by: by.to_string(),
            at: now,
        });
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(farm: &str, pods: u64) -> Count<'_> {
        Count {
            farm,
            session: None,
            pods,
        }
    }

    #[test]
    fn a_count_written_under_an_ended_session_is_dropped_by_the_next_writer() {
        let st = s(MaxRemovals::Percent(20), 300);
        let at = |farm, session, pods| Count {
            farm,
            session: Some(session),
            pods,
        };
        let w = Window::default()
            .report(st, 0, at("a", "s-a1", 60))
            .report(st, 0, at("b", "s-b", 40))
            .report(st, 0, count("old", 10));
        let live: BTreeMap<String, String> = [("a", "s-a2"), ("b", "s-b"), ("old", "s-o")]
            .map(|(f, s)| (f.to_string(), s.to_string()))
            .into();
        // Farm a lost its session (and its RCs) and registered again: b drops its old count,
        // keeps its own, and keeps the count without a session while its farm is live.
        let pruned = w.without_stale("b", &live);
        assert_eq!(pruned.farms.keys().collect::<Vec<_>>(), ["b", "old"]);
        // Farm a's new count, written under its new session, is kept by the others.
        let w = pruned.report(st, 1, at("a", "s-a2", 5));
        assert_eq!(w.without_stale("b", &live).served(st, 1), 55);
        // A farm no longer live is dropped whatever its session; the writer's own never is.
        let gone = BTreeMap::from([("b".to_string(), "s-b".to_string())]);
        assert_eq!(
            w.without_stale("a", &gone).farms.keys().collect::<Vec<_>>(),
            ["a", "b"]
        );
        // The session field round-trips, and a record without it (an older release's) reads.
        assert_eq!(Window::parse(&w.to_bytes()).unwrap(), w);
        let old = br#"{"farms":{"x":{"pods":3,"at":7}}}"#;
        assert_eq!(Window::parse(old).unwrap().farms["x"].session, None);
    }

    fn s(m: MaxRemovals, secs: u64) -> Settings {
        Settings {
            max_removals: m,
            window: Duration::from_secs(secs),
        }
    }

    #[test]
    fn a_count_limits_the_cluster_within_the_window_and_room_comes_back_after_it() {
        let st = s(MaxRemovals::Pods(5), 300);
        let t0 = 1_000_000;
        let w = Window::default().charge(st, t0, 3, None).unwrap();
        let w = w.charge(st, t0 + 15, 2, None).unwrap();
        assert_eq!(w.spent(st, t0 + 20), 5);
        assert_eq!(w.charge(st, t0 + 20, 1, None), Err(0));
        // Buckets of 10 s: the first removal counts until its bucket's end leaves the window.
        let back = w.room_at(st, t0 + 20).unwrap();
        assert!(back > t0 + 300 && back <= t0 + 310, "{back}");
        assert_eq!(w.room(st, back - 1), 0);
        assert_eq!(w.room(st, back), 3);
        assert!(w.charge(st, back, 3, None).is_ok());
    }

    /// A release reports what the window held when it was released, not charges that had
    /// left it (the key keeps them until the next charge prunes them).
    #[test]
    fn a_release_reports_only_what_the_window_still_held() {
        let st = s(MaxRemovals::Pods(5), 300);
        let t0 = 1_000_000;
        let w = Window::default().charge(st, t0, 3, None).unwrap();
        let w = w.charge(st, t0 + 200, 1, None).unwrap();
        assert_eq!(w.held(t0 + 250), 4);
        assert_eq!(w.buckets.iter().map(|b| b.1).sum::<u64>(), 4);
        assert_eq!(w.held(t0 + 400), 1, "the first charge left the window");
        assert_eq!(w.release("rcctl:op@host", t0 + 400).held(t0 + 400), 0);
    }

    #[test]
    fn a_charge_larger_than_the_room_is_refused_whole_and_says_the_room() {
        let st = s(MaxRemovals::Pods(5), 300);
        let w = Window::default().charge(st, 100, 4, None).unwrap();
        assert_eq!(w.charge(st, 101, 2, None), Err(1));
        assert_eq!(w.charge(st, 101, 1, None).unwrap().spent(st, 101), 5);
    }

    #[test]
    fn a_percentage_is_of_the_pods_every_farm_reported_and_does_not_shrink_within_the_window() {
        let st = s(MaxRemovals::Percent(20), 300);
        let t = 5_000;
        let w = Window::default()
            .report(st, t, count("a", 60))
            .report(st, t, count("b", 40));
        assert_eq!(w.limit(st, t), Some(20));
        // Farm a scales down: the base stays the peak within the window.
        let w = w.report(st, t + 10, count("a", 10));
        assert_eq!(w.limit(st, t + 10), Some(20));
        // A window later, the base is what the farms serve now.
        let w = w
            .report(st, t + 400, count("a", 10))
            .report(st, t + 400, count("b", 40));
        assert_eq!(w.limit(st, t + 400), Some(10));
        // Never under the floor.
        let w = w
            .report(st, t + 800, count("a", 1))
            .report(st, t + 800, count("b", 1));
        assert_eq!(w.limit(st, t + 800), Some(MIN_REMOVALS));
        // A farm gone for a window no longer counts.
        let w = Window::default().report(st, t, count("gone", 1000));
        assert_eq!(w.served(st, t + 300), 0);
    }

    #[test]
    fn a_release_empties_the_window_and_the_record_stays_small() {
        let st = s(MaxRemovals::Pods(1_000_000), 300);
        let mut w = Window::default();
        for i in 0..10_000 {
            w = w
                .charge(st, 1_000 + i / 10, 7, Some(count("farm-a", 500_000)))
                .unwrap();
        }
        // One bucket per 10 s at most, whatever was removed.
        assert!(w.buckets.len() <= 31, "{}", w.buckets.len());
        assert!(w.to_bytes().len() < 2048, "{}", w.to_bytes().len());
        let r = w.release("rcctl:op@host", 2_000);
        assert_eq!(r.spent(st, 2_000), 0);
        assert_eq!(r.released.as_ref().unwrap().by, "rcctl:op@host");
        assert_eq!(Window::parse(&r.to_bytes()).unwrap(), r);
    }

    #[test]
    fn off_charges_nothing_against_a_limit() {
        let st = s(MaxRemovals::Off, 300);
        assert_eq!(Window::default().room(st, 0), u64::MAX);
        assert!(Window::default().charge(st, 0, 1_000_000, None).is_ok());
    }

    #[test]
    fn a_report_is_due_when_absent_off_by_a_tenth_or_old() {
        let st = s(MaxRemovals::Percent(20), 300);
        let w = Window::default().report(st, 0, count("a", 100));
        assert!(!w.report_due(st, 10, "a", 105));
        assert!(w.report_due(st, 10, "a", 111));
        assert!(w.report_due(st, 150, "a", 100));
        assert!(w.report_due(st, 10, "b", 3));
        assert!(!w.report_due(st, 10, "b", 0));
    }
}
