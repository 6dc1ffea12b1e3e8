//! Time as an input: one clock for the RC tasks, roll workers, farm, sweep, shipper and
//! scheduler.
//!
//! Two readings, for two jobs:
//! - [`Clock::now`] is monotonic, for every timer, deadline and backoff. It is tokio's clock, so
//!   a test under `tokio::time::pause` drives it.
//! - [`Clock::wall`] is the calendar time that is shown and recorded (audit timestamps, a
//!   transfer's `started_at`, a roll's progress). A clock jump moves it and nothing else: no
//!   timer is measured with it, except where the time to measure was itself recorded by
//!   another process (a transfer started by another farm), which can only be compared in wall
//!   time.
//!
//! [`Clock::system`] reads the system's calendar; [`Clock::paused_at`] derives the calendar from
//! tokio's clock, so a paused-time test moves both together.

use chrono::{DateTime, Utc};
use tokio::time::Instant;

/// What time it is; cheap to clone and pass.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    kind: Kind,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    System,
    /// Wall time is `wall` plus what tokio's clock has advanced since `at`.
    Following {
        wall: DateTime<Utc>,
        at: Instant,
    },
}

impl Default for Clock {
    fn default() -> Self {
        Clock::system()
    }
}

impl Clock {
    /// The production clock: tokio's monotonic clock and the system's calendar.
    pub fn system() -> Clock {
        Clock { kind: Kind::System }
    }

    /// A clock whose calendar reads `wall` now and then advances exactly as tokio's clock does
    /// (for tests under `tokio::time::pause`, where `tokio::time::advance` moves both).
    pub fn paused_at(wall: DateTime<Utc>) -> Clock {
        Clock {
            kind: Kind::Following {
                wall,
                at: Instant::now(),
            },
        }
    }

    /// Monotonic time, for timers and deadlines.
    pub fn now(&self) -> Instant {
        Instant::now()
    }

    /// Calendar time, for what is shown and recorded.
    pub fn wall(&self) -> DateTime<Utc> {
        match self.kind {
            Kind::System => Utc::now(),
            Kind::Following { wall, at } => {
                let gone = Instant::now().saturating_duration_since(at);
                wall + chrono::Duration::from_std(gone).unwrap_or(chrono::Duration::MAX)
            }
        }
    }

    /// How long ago `t` was in calendar time, zero if it is in the future (a clock behind
    /// another farm's).
    pub fn wall_since(&self, t: DateTime<Utc>) -> std::time::Duration {
        (self.wall() - t).to_std().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_paused_clock_moves_wall_and_monotonic_time_together() {
        let start: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().unwrap();
        let clock = Clock::paused_at(start);
        let t0 = clock.now();
        assert_eq!(clock.wall(), start);
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(clock.now() - t0, Duration::from_secs(90));
        assert_eq!(clock.wall(), start + chrono::Duration::seconds(90));
        assert_eq!(clock.wall_since(start), Duration::from_secs(90));
        assert_eq!(
            clock.wall_since(start + chrono::Duration::hours(1)),
            Duration::ZERO
        );
    }
}
