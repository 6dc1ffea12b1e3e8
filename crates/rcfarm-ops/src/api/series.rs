//! Per-RC and per-roll series, rendered at scrape time from what this farm's tasks report.
//!
//! The `metrics` registry keeps a labelled series for ever once set; an RC that leaves (deleted,
//! handed over) would keep paging from its old farm. These are written fresh on each scrape from
//! the farm's status instead, so a series lives exactly while the farm owns the object in that
//! state. Labels follow P2's pages: the RC id (P2's PagerDuty incident key), its pod id and
//! node selector, so Alertmanager groups and dedups per RC.

use std::fmt::Write;

use chrono::{DateTime, Utc};

use crate::rctask::RcStatus;
use crate::roll::RollStatus;

/// The exposition text of the per-RC and per-roll series.
pub fn render(rcs: &[RcStatus], rolls: &[RollStatus], now: DateTime<Utc>) -> String {
    let mut out = String::new();
    header(
        &mut out,
        "rcfarm_rc_condition",
        "1 for each condition (Unmet, RemovalsHeld, Transferring, TransferFrozen, Invalid, Disabled, Waiting) an RC this farm owns is in",
    );
    for rc in rcs {
        for c in &rc.conditions {
            series(
                &mut out,
                "rcfarm_rc_condition",
                &rc_labels(rc, &[("condition", &c.kind)]),
                1.0,
            );
        }
    }
    header(
        &mut out,
        "rcfarm_rc_condition_seconds",
        "how long an RC this farm owns has been in each of its conditions",
    );
    for rc in rcs {
        for c in &rc.conditions {
            series(
                &mut out,
                "rcfarm_rc_condition_seconds",
                &rc_labels(rc, &[("condition", &c.kind)]),
                seconds_since(c.since, now),
            );
        }
    }
    header(
        &mut out,
        "rcfarm_rc_transfer_age_seconds",
        "age of the node transfer in flight of an RC this farm owns",
    );
    for rc in rcs {
        if let Some(t) = &rc.transfer {
            series(
                &mut out,
                "rcfarm_rc_transfer_age_seconds",
                &rc_labels(
                    rc,
                    &[("old_node", &*t.old_node), ("new_node", &*t.new_node)],
                ),
                seconds_since(t.started_at.unwrap_or(now), now),
            );
        }
    }
    header(
        &mut out,
        "rcfarm_roll_condition",
        "1 for each condition (Stalled, Failed, Paused, RemovalsHeld, Invalid, Blocked) a rolling update this farm carries out is in",
    );
    for r in rolls {
        for c in &r.conditions {
            let old = r.old_rc.map(|id| id.to_string()).unwrap_or_default();
            let new = r.new_rc.map(|id| id.to_string()).unwrap_or_default();
            let id = r.id.to_string();
            series(
                &mut out,
                "rcfarm_roll_condition",
                &[
                    ("roll_id", id.as_str()),
                    ("old_rc", old.as_str()),
                    ("new_rc", new.as_str()),
                    ("condition", c.kind.as_str()),
                ],
                1.0,
            );
        }
    }
    out
}

/// Seconds since each running watch's last answer from Consul.
pub fn render_watch_ages(ages: &[(String, f64)]) -> String {
    let mut out = String::new();
    header(
        &mut out,
        "rcfarm_consul_watch_answer_age_seconds",
        "seconds since each running watch last had an answer from Consul (at least one per wait: 5 min)",
    );
    for (name, age) in ages {
        series(
            &mut out,
            "rcfarm_consul_watch_answer_age_seconds",
            &[("watch", name.as_str())],
            *age,
        );
    }
    out
}

/// The process's own figures under the names Prometheus client libraries use
/// (`process_resident_memory_bytes`, `process_cpu_seconds_total`, …), read from procfs; nothing
/// on systems without it.
pub fn render_process() -> String {
    let mut out = String::new();
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    // The first number after `key` in /proc/self/status (memory in KiB).
    let field_of_status = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
    };
    for (key, name, help) in [
        (
            "VmRSS:",
            "process_resident_memory_bytes",
            "resident memory size in bytes",
        ),
        (
            "VmSize:",
            "process_virtual_memory_bytes",
            "virtual memory size in bytes",
        ),
    ] {
        if let Some(kib) = field_of_status(key) {
            header(&mut out, name, help);
            let _ = writeln!(out, "{name} {}", kib * 1024.0);
        }
    }
    // utime and stime are fields 14 and 15, counted after the command name, which is in
    // parentheses and may hold spaces; /proc reports them in USER_HZ, 100 on Linux.
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    if let (Some(u), Some(s)) = (field(14), field(15)) {
        header_of(
            &mut out,
            "process_cpu_seconds_total",
            "counter",
            "user and system CPU time spent in seconds",
        );
        let _ = writeln!(out, "process_cpu_seconds_total {}", (u + s) / 100.0);
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        header(&mut out, "process_open_fds", "open file descriptors");
        let _ = writeln!(out, "process_open_fds {}", fds.count());
    }
    if let Some(threads) = field_of_status("Threads:") {
        header(&mut out, "process_threads", "OS threads");
        let _ = writeln!(out, "process_threads {threads}");
    }
    out
}

fn rc_labels<'a>(rc: &'a RcStatus, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, String)> {
    let mut l = vec![
        ("rc_id", rc.id.to_string()),
        ("pod_id", rc.pod_id.clone().unwrap_or_default()),
        ("selector", rc.selector.clone().unwrap_or_default()),
    ];
    l.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    l
}

fn seconds_since(t: DateTime<Utc>, now: DateTime<Utc>) -> f64 {
    ((now - t).num_milliseconds().max(0) as f64) / 1000.0
}

fn header(out: &mut String, name: &str, help: &str) {
    header_of(out, name, "gauge", help);
}

fn header_of(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn series<K: AsRef<str>, V: AsRef<str>>(out: &mut String, name: &str, labels: &[(K, V)], v: f64) {
    out.push_str(name);
    out.push('{');
    for (i, (k, val)) in labels.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(k.as_ref());
        out.push_str("=\"");
        escape(out, val.as_ref());
        out.push('"');
    }
    let _ = writeln!(out, "}} {v}");
}

/// The text format's label value escapes: backslash, double quote and newline.
fn escape(out: &mut String, v: &str) {
    for ch in v.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rc::RcId;

    #[test]
    fn conditions_become_one_series_each_with_escaped_labels() {
        let id = RcId::new();
        let mut rc = RcStatus::new(id, "farm-a");
        rc.pod_id = Some("web".into());
        rc.selector = Some("role in (a,\"b\")".into());
        rc.set_condition("Unmet", Some("no node".into()));
        let text = render(&[rc], &[], Utc::now());
        let line = text
            .lines()
            .find(|l| l.starts_with("rcfarm_rc_condition{"))
            .unwrap();
        assert_eq!(
            line,
            format!(
                "rcfarm_rc_condition{{rc_id=\"{id}\",pod_id=\"web\",selector=\"role in (a,\\\"b\\\")\",condition=\"Unmet\"}} 1"
            )
        );
        assert!(!text.contains("rcfarm_roll_condition{"), "{text}");
    }

    #[test]
    fn process_figures_come_from_procfs() {
        if !std::path::Path::new("/proc/self/status").exists() {
            return;
        }
        let text = render_process();
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.parse::<f64>().ok())
        };
        assert!(
            value("process_resident_memory_bytes").is_some_and(|v| v > 1e6),
            "{text}"
        );
        assert!(
            value("process_cpu_seconds_total").is_some_and(|v| v >= 0.0),
            "{text}"
        );
        assert!(
            value("process_open_fds").is_some_and(|v| v >= 3.0),
            "{text}"
        );
    }

    #[test]
    fn an_rc_without_conditions_has_no_series() {
        let rc = RcStatus::new(RcId::new(), "farm-a");
        let text = render(&[rc], &[], Utc::now());
        assert!(text.lines().all(|l| l.starts_with('#')), "{text}");
    }
}
