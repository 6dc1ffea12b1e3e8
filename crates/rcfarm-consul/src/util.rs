//! Small helpers shared by every layer: Go-style durations (Consul speaks them on the wire) and
//! capped, jittered backoff.

use std::time::Duration;

use rand::Rng;

/// Parses a Go `time.ParseDuration` string (`"300ms"`, `"1.5h"`, `"2h45m"`, `"0"`).
///
/// Consul's `wait`, `TTL` and `LockDelay` use this syntax; accepting exactly what Go accepts keeps
/// the embedded server's 400s identical to Consul's. Negative durations parse to `None` in the
/// second slot of the tuple: callers decide what a negative value means (Consul treats a
/// negative `wait` as "use the default").
pub fn parse_go_duration(s: &str) -> Result<GoDuration, String> {
    let orig = s;
    let err = || format!("time: invalid duration {orig:?}");
    let mut rest = s;
    let mut negative = false;
    if let Some(r) = rest.strip_prefix('-') {
        negative = true;
        rest = r;
    } else if let Some(r) = rest.strip_prefix('+') {
        rest = r;
    }
    if rest == "0" {
        return Ok(GoDuration {
            nanos: 0,
            negative: false,
        });
    }
    if rest.is_empty() {
        return Err(err());
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        // Integer part.
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let int_part = &rest[..int_len];
        rest = &rest[int_len..];
        let mut frac_part = "";
        if let Some(r) = rest.strip_prefix('.') {
            let frac_len = r.bytes().take_while(u8::is_ascii_digit).count();
            frac_part = &r[..frac_len];
            rest = &r[frac_len..];
            if int_part.is_empty() && frac_part.is_empty() {
                return Err(err());
            }
        } else if int_part.is_empty() {
            return Err(err());
        }
        let unit_len = rest
            .char_indices()
            .find(|(_, c)| c.is_ascii_digit() || *c == '.')
            .map(|(i, _)| i)
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let scale: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err(format!("time: missing unit in duration {orig:?}")),
            other => return Err(format!("time: unknown unit {other:?} in duration {orig:?}")),
        };
        let int: u128 = if int_part.is_empty() {
            0
        } else {
            int_part.parse().map_err(|_| err())?
        };
        let mut value = int.checked_mul(scale).ok_or_else(err)?;
        if !frac_part.is_empty() {
            // Keep at most 18 fractional digits: more cannot change a nanosecond count even in
            // hours (3.6e12 ns), and 1e18 × 3.6e12 stays far inside u128 (found by fuzzing).
            let digits = &frac_part[..frac_part.len().min(18)];
            let frac: u128 = digits.parse().map_err(|_| err())?;
            let denom = 10u128.pow(digits.len() as u32);
            let part = frac.checked_mul(scale).ok_or_else(err)? / denom;
            value = value.checked_add(part).ok_or_else(err)?;
        }
        total = total.checked_add(value).ok_or_else(err)?;
        // Go's Duration is an int64 of nanoseconds.
        if total > i64::MAX as u128 {
            return Err(err());
        }
    }
    Ok(GoDuration {
        nanos: total as u64,
        negative: negative && total > 0,
    })
}

/// A parsed Go duration: magnitude plus sign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GoDuration {
    pub nanos: u64,
    pub negative: bool,
}

impl GoDuration {
    /// The duration if it is positive, `None` for zero or negative values.
    pub fn positive(self) -> Option<Duration> {
        (!self.negative && self.nanos > 0).then(|| Duration::from_nanos(self.nanos))
    }
}

/// Formats a duration the way Go's `time.Duration.String` does (`"15s"`, `"1m30s"`, `"100ms"`).
pub fn format_go_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_string();
    }
    if nanos < 1_000 {
        return format!("{nanos}ns");
    }
    if nanos < 1_000_000 {
        return format!("{}µs", trim_frac(nanos, 1_000));
    }
    if nanos < 1_000_000_000 {
        return format!("{}ms", trim_frac(nanos, 1_000_000));
    }
    let secs_total = nanos / 1_000_000_000;
    let sub = nanos % 1_000_000_000;
    let h = secs_total / 3600;
    let m = (secs_total % 3600) / 60;
    let s = secs_total % 60;
    let secs = trim_frac(s * 1_000_000_000 + sub, 1_000_000_000);
    if h > 0 {
        format!("{h}h{m}m{secs}s")
    } else if m > 0 {
        format!("{m}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

fn trim_frac(value: u128, unit: u128) -> String {
    let int = value / unit;
    let frac = value % unit;
    if frac == 0 {
        return int.to_string();
    }
    let width = unit.ilog10() as usize;
    let mut f = format!("{frac:0width$}");
    while f.ends_with('0') {
        f.pop();
    }
    format!("{int}.{f}")
}

/// Capped exponential backoff with "equal jitter": each delay is half the exponential step plus a
/// random part of the other half, so retries from many processes spread out but never collapse
/// to zero.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap: cap.max(base),
            attempt: 0,
        }
    }

    /// The next delay; grows until the cap.
    pub fn next_delay(&mut self) -> Duration {
        let exp = self
            .base
            .checked_mul(1u32 << self.attempt.min(20))
            .unwrap_or(self.cap)
            .min(self.cap);
        self.attempt = self.attempt.saturating_add(1);
        jitter_half(exp)
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

/// Half of `d` plus a uniformly random part of the other half.
pub fn jitter_half(d: Duration) -> Duration {
    let half = d / 2;
    let extra = rand::rng().random_range(0..=half.as_nanos().min(u64::MAX as u128) as u64);
    half + Duration::from_nanos(extra)
}

/// A uniformly random duration in `[0, d]`.
pub fn jitter_up_to(d: Duration) -> Duration {
    let n = d.as_nanos().min(u64::MAX as u128) as u64;
    Duration::from_nanos(rand::rng().random_range(0..=n))
}

/// A JSON value for an error message, cut to 40 characters.
pub fn describe_json(v: &serde_json::Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// What kind of JSON value a document is, for "must be an object, found …".
pub fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Object(_) => "an object",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Null => "null",
    }
}

/// Runs `work`, when `heavy` (CPU-bound for long: decoding or encoding a listing of a million
/// keys), without holding up the other tasks of a multi-threaded runtime: `block_in_place` hands
/// this worker's queue to another thread for the while. A renewal, a timer or a small answer
/// then waits for a core, not for this work to end. Light work, or a current-thread runtime
/// (tests, tools), just runs: the hand-off costs a thread wake-up, worth it only for long work.
pub fn cpu_heavy<R>(heavy: bool, work: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if heavy && h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

/// Bodies at least this big are heavy for [`cpu_heavy`]: a few milliseconds of work and more.
pub const CPU_HEAVY_BYTES: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations() {
        let ok = |s: &str| parse_go_duration(s).unwrap();
        assert_eq!(ok("0").nanos, 0);
        assert_eq!(ok("100ms").nanos, 100_000_000);
        assert_eq!(ok("10s").nanos, 10_000_000_000);
        assert_eq!(ok("5m").nanos, 300_000_000_000);
        assert_eq!(ok("1.5s").nanos, 1_500_000_000);
        assert_eq!(ok("2h45m").nanos, (2 * 3600 + 45 * 60) * 1_000_000_000);
        assert_eq!(ok(".5s").nanos, 500_000_000);
        assert_eq!(ok("1µs").nanos, 1_000);
        assert_eq!(ok("3us").nanos, 3_000);
        assert!(ok("-1s").negative);
        assert!(ok("-1s").positive().is_none());
        // Long fractions (found by fuzzing: they overflowed).
        assert_eq!(
            ok("5555.55555555555555555555555555555510s").nanos,
            5_555_555_555_555
        );
        assert_eq!(ok("1.999999999999999999999999h").nanos, 7_199_999_999_999);
        for bad in [
            "",
            "10",
            "s",
            "1x",
            "1.s.",
            "-",
            ".s",
            "99999999999h",
            "1..5s",
        ] {
            assert!(parse_go_duration(bad).is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn formats_like_go() {
        assert_eq!(format_go_duration(Duration::from_secs(15)), "15s");
        assert_eq!(format_go_duration(Duration::from_secs(90)), "1m30s");
        assert_eq!(format_go_duration(Duration::from_secs(3600)), "1h0m0s");
        assert_eq!(format_go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_go_duration(Duration::from_millis(100)), "100ms");
        assert_eq!(format_go_duration(Duration::ZERO), "0s");
        for d in [
            1u64,
            999,
            1_000,
            123_456_789,
            15_000_000_000,
            3_723_000_000_000,
        ] {
            let d = Duration::from_nanos(d);
            assert_eq!(
                parse_go_duration(&format_go_duration(d)).unwrap().nanos as u128,
                d.as_nanos()
            );
        }
    }

    #[test]
    fn backoff_grows_to_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut last_max = Duration::ZERO;
        for _ in 0..10 {
            let d = b.next_delay();
            assert!(d <= Duration::from_secs(2));
            last_max = last_max.max(d);
        }
        assert!(
            last_max >= Duration::from_secs(1),
            "cap half is a floor once at cap"
        );
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
