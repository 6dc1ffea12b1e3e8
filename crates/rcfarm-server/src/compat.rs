//! Which Consul the embedded server answers as, where Consul 0.7 and 1.x differ on the wire
//! (docs/consul-backends.md lists every difference, the rcfarm code that copes with it and the
//! test that runs it under each mode).
//!
//! Also the test control that copies Consul < 0.8.5's post-election answers: a new leader that
//! still replays its log answers reads from an older state (hashicorp/consul#2644).

use std::fmt;
use std::str::FromStr;

use parking_lot::Mutex;

use super::store::{SnapshotData, Store};

/// The Consul version the server copies where versions differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compat {
    /// Consul 0.7.0, as read off the real binary.
    V0_7,
    /// Consul 1.x (the newest behaviour where 1.x releases differ, as the server did before it
    /// had modes).
    #[default]
    V1,
}

impl Compat {
    /// Whether a txn KV verb exists in this version (0.7 has no `get-or-empty` and no
    /// `check-not-exists`: they roll the transaction back as unknown verbs).
    pub fn knows_verb(self, verb: &str) -> bool {
        match self {
            Compat::V0_7 => !matches!(verb, "get-or-empty" | "check-not-exists"),
            Compat::V1 => true,
        }
    }

    pub fn is_0_7(self) -> bool {
        self == Compat::V0_7
    }
}

impl fmt::Display for Compat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compat::V0_7 => "0.7",
            Compat::V1 => "1.x",
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown Consul compatibility mode {0:?}: expected 0.7 or 1.x")]
pub struct UnknownCompat(String);

impl FromStr for Compat {
    type Err = UnknownCompat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "0.7" => Ok(Compat::V0_7),
            "1.x" => Ok(Compat::V1),
            other => Err(UnknownCompat(other.to_string())),
        }
    }
}

/// The server's state at one moment, kept to be answered from later
/// ([`super::EmbeddedServer::serve_stale`]).
pub struct StaleCheckpoint(pub(super) SnapshotData);

/// Reads answered from an older state, as a Consul 0.7 leader replaying its log answers them.
#[derive(Default)]
pub(crate) struct StaleReads {
    state: Mutex<Option<(Store, usize)>>,
}

impl StaleReads {
    pub fn start(&self, store: Store, answers: usize) {
        *self.state.lock() = (answers > 0).then_some((store, answers));
    }

    pub fn left(&self) -> usize {
        self.state.lock().as_ref().map_or(0, |(_, n)| *n)
    }

    /// Runs `eval` on the stale state if answers from it remain (counting this one).
    pub fn answer<T>(&self, eval: impl FnOnce(&Store) -> T) -> Option<T> {
        let mut st = self.state.lock();
        let (store, left) = st.as_mut()?;
        let out = eval(store);
        *left -= 1;
        if *left == 0 {
            *st = None;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_as_the_flag_spells_them() {
        assert_eq!("0.7".parse::<Compat>().unwrap(), Compat::V0_7);
        assert_eq!("1.x".parse::<Compat>().unwrap(), Compat::V1);
        assert!("1.0".parse::<Compat>().is_err());
        assert_eq!(Compat::V0_7.to_string(), "0.7");
        assert_eq!(Compat::default(), Compat::V1);
    }

    #[test]
    fn stale_reads_run_out() {
        let stale = StaleReads::default();
        assert_eq!(stale.answer(|s| s.index()), None);
        stale.start(Store::new(), 2);
        assert_eq!(stale.answer(|s| s.index()), Some(1));
        assert_eq!(stale.answer(|s| s.index()), Some(1));
        assert_eq!(stale.answer(|s| s.index()), None);
    }
}
