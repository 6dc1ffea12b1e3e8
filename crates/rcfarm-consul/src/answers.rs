//! When each running watch last had an answer from Consul, for the watch-lag alert.
//!
//! A blocking query answers at least once per wait (5 min by default) even when nothing
//! changes, so a watch whose last answer is much older is failing or stuck, and whatever acts on
//! its view acts on an old one. Kept here rather than as a `metrics` gauge because a gauge
//! outlives its watch: a watch that ended (its session gone, its roll done) would look stuck
//! for ever. An entry lives while a watch of its name runs.

use std::collections::HashMap;
use std::sync::LazyLock;

use parking_lot::Mutex;
use tokio::time::Instant;

struct Entry {
    running: usize,
    last_answer: Instant,
}

static ANSWERS: LazyLock<Mutex<HashMap<String, Entry>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Registers a running watch; its age counts from now until its first answer.
pub(super) struct Running(String);

impl Running {
    pub(super) fn new(name: &str) -> Running {
        let mut m = ANSWERS.lock();
        let e = m.entry(name.to_string()).or_insert(Entry {
            running: 0,
            last_answer: Instant::now(),
        });
        e.running += 1;
        Running(name.to_string())
    }

    pub(super) fn answered(&self) {
        if let Some(e) = ANSWERS.lock().get_mut(&self.0) {
            e.last_answer = Instant::now();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut m = ANSWERS.lock();
        if let Some(e) = m.get_mut(&self.0) {
            e.running -= 1;
            if e.running == 0 {
                m.remove(&self.0);
            }
        }
    }
}

/// Seconds since each running watch's last answer, by watch name.
pub fn watch_answer_ages() -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = ANSWERS
        .lock()
        .iter()
        .map(|(k, e)| (k.clone(), e.last_answer.elapsed().as_secs_f64()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_lives_while_a_watch_of_its_name_runs() {
        let name = "test:answers-entry";
        let a = Running::new(name);
        let b = Running::new(name);
        a.answered();
        assert!(watch_answer_ages().iter().any(|(n, _)| n == name));
        drop(a);
        assert!(watch_answer_ages().iter().any(|(n, _)| n == name));
        drop(b);
        assert!(!watch_answer_ages().iter().any(|(n, _)| n == name));
    }
}
