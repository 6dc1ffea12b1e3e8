//! `rcfarm check-config FILE`: checks a `--config` file of `rcfarm serve` and reports every
//! mistake at once, each with its line and key (`FILE:LINE: key `x`: problem`), exit 2 if there
//! is any. It cannot disagree with `serve`, because it asks serve's own code:
//!
//! 1. the TOML syntax (with the line of the error);
//! 2. each key against `serve`'s options ([`super::config::find_option`], as `--config` reads
//!    the file), an unknown one with the closest valid key suggested;
//! 3. each value's type, as `--config` turns it into flags ([`super::config::to_flags`]);
//! 4. each value through the clap value parser of its flag (durations, enums, numbers, ...),
//!    by parsing that flag alone with a command holding only that argument;
//! 5. the settings together, as `serve` checks them before it connects to anything
//!    ([`super::serve::prepare`]: the HTTP address, selectors, the audit database URL, limits)
//!    and builds its Consul client (the Consul address, TLS files, token file). What fails is
//!    pinned on the key its message names; that key is set aside and the rest checked again,
//!    so every such mistake is found.
//!
//! Environment variables (`RCFARM_*`, `CONSUL_*`) are ignored: the file is checked on its own.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::{Arg, Command, CommandFactory, FromArgMatches};
use toml::Spanned;

use super::CliError;
use super::config::{file_options, find_option, to_flags};

/// `rcfarm check-config FILE`.
#[derive(Debug, clap::Args)]
pub struct CheckConfigArgs {
    /// The TOML file to check, as given to `rcfarm serve --config` (/etc/rcfarm/rcfarm.toml).
    pub file: PathBuf,
}

/// One mistake in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line; `None` when it is about the file as a whole.
    pub line: Option<usize>,
    /// 1-based column (in characters).
    pub column: Option<usize>,
    /// The key, when the mistake is about one.
    pub key: Option<String>,
    pub message: String,
}

impl Problem {
    /// `FILE:LINE: key `x`: problem`.
    pub fn render(&self, file: &str) -> String {
        let at = match self.line {
            Some(line) => format!("{file}:{line}"),
            None => file.to_string(),
        };
        match &self.key {
            Some(key) => format!("{at}: key `{key}`: {}", self.message),
            None => format!("{at}: {}", self.message),
        }
    }
}

/// What a check found.
#[derive(Debug, Default)]
pub struct Report {
    /// The file's top-level keys.
    pub settings: usize,
    /// In the order of the file.
    pub problems: Vec<Problem>,
}

/// Runs the command: prints `FILE: ok (N settings)`, or each problem and a summary (exit 2).
pub fn run(args: &CheckConfigArgs) -> Result<(), CliError> {
    let name = args.file.display().to_string();
    let text = std::fs::read_to_string(&args.file)
        .map_err(|e| CliError::Usage(format!("{name}: cannot read it: {e}")))?;
    let report = check(&text);
    if report.problems.is_empty() {
        println!(
            "{name}: ok ({} setting{})",
            report.settings,
            if report.settings == 1 { "" } else { "s" }
        );
        return Ok(());
    }
    for p in &report.problems {
        eprintln!("{}", p.render(&name));
    }
    let n = report.problems.len();
    Err(CliError::Usage(format!(
        "{name}: {n} problem{}; `rcfarm serve --config {name}` would refuse this file",
        if n == 1 { "" } else { "s" }
    )))
}

/// Checks a file's text as `rcfarm serve --config` would read it.
pub fn check(text: &str) -> Report {
    // serve's checks log advice (a certificate not verified, say); a checker only reports.
    tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
        check_quietly(text)
    })
}

/// A key that passed the checks of its own, with the flags it stands for.
struct Entry {
    key: String,
    line: usize,
    column: usize,
    arg: Arg,
    flags: Vec<String>,
}

fn check_quietly(text: &str) -> Report {
    let table: BTreeMap<Spanned<String>, Spanned<toml::Value>> = match toml::from_str(text) {
        Ok(t) => t,
        Err(e) => {
            return Report {
                settings: 0,
                problems: tidy(syntax_problems(text, &e)),
            };
        }
    };
    let root = super::RcfarmCli::command();
    let Some(serve) = root.find_subcommand("serve") else {
        return Report {
            settings: table.len(),
            problems: vec![Problem {
                line: None,
                column: None,
                key: None,
                message: "internal error: rcfarm has no serve command".into(),
            }],
        };
    };
    let known = file_options(&root, serve);
    let mut problems = Vec::new();
    let mut entries: Vec<Entry> = Vec::new();
    // Each option's first key, to catch one option set twice (`session-ttl`, `session_ttl`).
    let mut seen: Vec<(&Arg, String, usize)> = Vec::new();
    // In the order of the file, so a repeated option points back at its first key.
    let mut in_order: Vec<_> = table.iter().collect();
    in_order.sort_by_key(|(k, _)| k.span().start);
    for (key, value) in in_order {
        let (line, column) = position(text, key.span().start);
        let problem = |message: String| Problem {
            line: Some(line),
            column: Some(column),
            key: Some(key.get_ref().clone()),
            message,
        };
        let Some(arg) = find_option(&known, key.get_ref()) else {
            problems.push(problem(unknown_key(key.get_ref(), &known)));
            continue;
        };
        if let Some((_, first, first_line)) = seen.iter().find(|(a, ..)| a.get_id() == arg.get_id())
        {
            problems.push(problem(format!(
                "the same option as `{first}` on line {first_line}; keep one"
            )));
            continue;
        }
        seen.push((arg, key.get_ref().clone(), line));
        let flags = match to_flags(arg, value.get_ref()) {
            Ok(f) => f,
            Err(e) => {
                problems.push(problem(e));
                continue;
            }
        };
        if let Err(e) = parse_alone(arg, &flags) {
            problems.push(problem(e));
            continue;
        }
        entries.push(Entry {
            key: key.get_ref().clone(),
            line,
            column,
            arg: arg.clone(),
            flags,
        });
    }
    problems.extend(as_serve_would(&root, entries));
    Report {
        settings: table.len(),
        problems: tidy(problems),
    }
}

/// Problems in the order of the file, one line each (a selector's error draws a caret under
/// the value on further lines: the first says where).
fn tidy(mut problems: Vec<Problem>) -> Vec<Problem> {
    for p in &mut problems {
        if let Some(first) = p.message.lines().next() {
            p.message = first.trim_end().to_string();
        }
    }
    problems.sort_by_key(|p| (p.line.unwrap_or(usize::MAX), p.column));
    problems
}

/// Every syntax error of the text (the parser recovers and goes on), each with its line.
fn syntax_problems(text: &str, first: &toml::de::Error) -> Vec<Problem> {
    let (_, errors) = toml::de::DeTable::parse_recoverable(text);
    let errors: Vec<&toml::de::Error> = if errors.is_empty() {
        vec![first]
    } else {
        errors.iter().collect()
    };
    errors
        .into_iter()
        .map(|e| {
            let (line, column) = match e.span() {
                Some(span) => {
                    let (l, c) = position(text, span.start);
                    (Some(l), Some(c))
                }
                None => (None, None),
            };
            let message = e.message().trim_end();
            Problem {
                line,
                column,
                key: None,
                message: match column {
                    Some(c) => format!("TOML syntax error (column {c}): {message}"),
                    None => format!("TOML syntax error: {message}"),
                },
            }
        })
        .collect()
}

/// The 1-based line and column (in characters) of a byte offset.
fn position(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before.get(line_start..).map_or(0, |s| s.chars().count()) + 1;
    (line, column)
}

/// Why a key is unknown, with the closest valid key when one is close.
fn unknown_key(key: &str, known: &[&Arg]) -> String {
    let long = key.replace('_', "-");
    if ["config", "help", "version"].contains(&long.as_str()) {
        return format!(
            "not a setting: `--{long}` cannot be given in the file (`rcfarm serve --help` lists the settings)"
        );
    }
    let wanted = long.to_lowercase();
    let best = known
        .iter()
        .flat_map(|a| {
            a.get_long()
                .into_iter()
                .chain(a.get_all_aliases().unwrap_or_default())
        })
        .map(|name| (edit_distance(&wanted, name), name))
        .min();
    match best {
        Some((d, name)) if d <= (wanted.chars().count() / 3).max(2) => {
            format!("unknown key; did you mean `{name}`?")
        }
        _ => {
            "unknown key: not an option of `rcfarm serve` (`rcfarm serve --help` lists them)".into()
        }
    }
}

/// Levenshtein distance, in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = Vec::with_capacity(b.len() + 1);
        cur.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let substitute = prev[j] + usize::from(ca != *cb);
            cur.push(substitute.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Parses one option's flags with the option's own clap definition (and so its value parser),
/// alone: its mistakes are its own.
fn parse_alone(arg: &Arg, flags: &[String]) -> Result<(), String> {
    let option = arg.clone().env(None).global(false).required(false);
    Command::new("rcfarm-serve")
        .no_binary_name(true)
        .arg(option)
        .try_get_matches_from(flags)
        .map(|_| ())
        .map_err(|e| clap_problem(&e))
}

/// A clap error as the rest of a problem line (after the key).
fn clap_problem(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => Some(v.clone()),
        _ => None,
    };
    match (e.kind(), value) {
        (ErrorKind::ValueValidation, Some(v)) => match std::error::Error::source(e) {
            // Parsers that name the value themselves (`"0": a farm allowed no removal …`).
            Some(why) if why.to_string().starts_with(&format!("{v:?}")) => {
                format!("invalid value {why}")
            }
            Some(why) => format!("invalid value {v:?}: {why}"),
            None => format!("invalid value {v:?}"),
        },
        (ErrorKind::InvalidValue, Some(v)) => {
            let valid = match e.get(ContextKind::ValidValue) {
                Some(ContextValue::Strings(vs)) => vs.join(", "),
                _ => String::new(),
            };
            let mut m = format!("invalid value {v:?}");
            if !valid.is_empty() {
                m.push_str(&format!("; possible values: {valid}"));
            }
            let suggested = match e.get(ContextKind::SuggestedValue) {
                Some(ContextValue::String(s)) => Some(s),
                Some(ContextValue::Strings(ss)) => ss.first(),
                _ => None,
            };
            if let Some(s) = suggested {
                m.push_str(&format!(" (did you mean {s:?}?)"));
            }
            m
        }
        _ => {
            let rendered = e.to_string();
            let first = rendered.lines().next().unwrap_or_default();
            first.strip_prefix("error: ").unwrap_or(first).to_string()
        }
    }
}

fn without_env(a: Arg) -> Arg {
    a.env(None)
}

/// Runs serve's own checks on the settings together; a failure is pinned on the key its
/// message names, which is set aside before the rest are checked again.
fn as_serve_would(root: &Command, mut entries: Vec<Entry>) -> Vec<Problem> {
    let cmd = root
        .clone()
        .mut_args(without_env)
        .mut_subcommand("serve", |s| s.mut_args(without_env));
    let mut problems = Vec::new();
    loop {
        let mut argv = vec!["rcfarm".to_string(), "serve".to_string()];
        for e in &entries {
            argv.extend(e.flags.iter().cloned());
        }
        let Err(message) = serve_accepts(cmd.clone(), &argv) else {
            break;
        };
        match blame(&message, &entries) {
            Some(i) => {
                let e = entries.remove(i);
                problems.push(Problem {
                    line: Some(e.line),
                    column: Some(e.column),
                    key: Some(e.key),
                    message,
                });
            }
            None => {
                problems.push(Problem {
                    line: None,
                    column: None,
                    key: None,
                    message,
                });
                break;
            }
        }
    }
    problems
}

/// What `rcfarm serve` with these arguments checks before it connects to anything.
fn serve_accepts(cmd: Command, argv: &[String]) -> Result<(), String> {
    let matches = cmd
        .try_get_matches_from(argv)
        .map_err(|e| clap_problem(&e))?;
    let cli = super::RcfarmCli::from_arg_matches(&matches).map_err(|e| clap_problem(&e))?;
    let super::RcfarmCommand::Serve(args) = cli.command else {
        return Err("internal error: not the serve command".into());
    };
    let (config, _http) = super::serve::prepare(&args).map_err(|e| e.to_string())?;
    match crate::consul::Consul::new(config.consul) {
        Ok(_) => Ok(()),
        Err(crate::consul::ConsulError::Config(why)) => Err(why),
        Err(e) => Err(e.to_string()),
    }
}

/// The entry a message of serve's is about: the one whose flag, alias or environment variable
/// it names first (`--consul-client-cert / CONSUL_CLIENT_CERT`), or the Consul address.
fn blame(message: &str, entries: &[Entry]) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None;
    for (i, e) in entries.iter().enumerate() {
        let mut needles: Vec<String> = e
            .arg
            .get_long()
            .into_iter()
            .chain(e.arg.get_all_aliases().unwrap_or_default())
            .map(|n| format!("--{n}"))
            .collect();
        needles.extend(e.arg.get_env().map(|v| v.to_string_lossy().into_owned()));
        if e.arg.get_long() == Some("consul") {
            needles.push("Consul address".into());
        }
        for needle in &needles {
            if let Some(at) = find_word(message, needle)
                && best.is_none_or(|(b, _)| at < b)
            {
                best = Some((at, i));
            }
        }
    }
    best.map(|(_, i)| i)
}

/// Where `needle` first occurs in `hay` as a whole word (not followed or preceded by a letter,
/// digit, `-` or `_`: `--session-ttl` is not in `--session-ttl-min`).
fn find_word(hay: &str, needle: &str) -> Option<usize> {
    let word = |c: char| c.is_alphanumeric() || c == '-' || c == '_';
    hay.match_indices(needle).map(|(i, _)| i).find(|&i| {
        let before = hay[..i].chars().next_back();
        let after = hay[i + needle.len()..].chars().next();
        !before.is_some_and(word) && !after.is_some_and(word)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEPLOYED: &str = include_str!("../../../../deploy/rcfarm.toml");

    /// (line, key, what the message must say) of each problem.
    fn found(text: &str) -> Vec<(Option<usize>, Option<String>, String)> {
        check(text)
            .problems
            .into_iter()
            .map(|p| (p.line, p.key, p.message))
            .collect()
    }

    fn assert_problems(text: &str, expected: &[(usize, &str, &str)]) {
        let got = found(text);
        assert_eq!(got.len(), expected.len(), "{got:#?}");
        for ((line, key, message), (want_line, want_key, want)) in got.iter().zip(expected) {
            assert_eq!(*line, Some(*want_line), "{got:#?}");
            assert_eq!(key.as_deref(), Some(*want_key), "{got:#?}");
            assert!(
                message.contains(want),
                "{want:?} in {message:?}; all: {got:#?}"
            );
        }
    }

    #[test]
    fn every_mistake_is_reported_with_its_line_and_key() {
        let text = r#"# a farm with many mistakes
farm-id = "farm-a"
sesion-ttl = "20s"
lock-delay = "soon"
scheduler = "magic"

http = "nowhere"
audit-db = "mysql://db/rcfarm"
pool-capacity = -1
session-ttl = "500ms"
consul-max-conns = 4
max-removals = "150%"
transfer-static = "yes"
rc-selector = "a in"
consul = "ftp://consul:8500"
header = ["X-Team"]
resync-interval = ["1s", "2s"]
watch-wait = { value = "5m" }
session_ttl = "15s"
consul-ssl-verify = "maybe"
"#;
        assert_problems(
            text,
            &[
                (3, "sesion-ttl", "unknown key; did you mean `session-ttl`?"),
                (4, "lock-delay", "invalid value \"soon\""),
                (
                    5,
                    "scheduler",
                    "invalid value \"magic\"; possible values: label, pool",
                ),
                (7, "http", "give an address like 127.0.0.1:8791, or off"),
                (8, "audit-db", "--audit-db"),
                (9, "pool-capacity", "invalid value \"-1\""),
                (10, "session-ttl", "--session-ttl must be at least 1s"),
                (11, "consul-max-conns", "a farm needs at least 16"),
                (12, "max-removals", "a percentage is at most 100%"),
                (13, "transfer-static", "a switch takes true or false"),
                (14, "rc-selector", "--rc-selector"),
                (15, "consul", "the scheme must be http or https"),
                (16, "header", "expected NAME=VALUE"),
                (
                    17,
                    "resync-interval",
                    "an array, but `resync-interval` takes one value",
                ),
                (18, "watch-wait", "a table"),
                (
                    19,
                    "session_ttl",
                    "the same option as `session-ttl` on line 10",
                ),
                (20, "consul-ssl-verify", "\"maybe\" is not a boolean"),
            ],
        );
        // And the command's lines.
        let p = &check(text).problems[0];
        assert_eq!(
            p.render("farm.toml"),
            "farm.toml:3: key `sesion-ttl`: unknown key; did you mean `session-ttl`?"
        );
    }

    #[test]
    fn a_good_file_passes() {
        let text = r#"
consul = "https://consul.internal:8501"
farm-id = "farm-a"
session-ttl = "20s"
http = "0.0.0.0:8791"
audit-db = "postgres://rcfarm@db.internal/rcfarm"
audit-shipping = false
scheduler = "pool"
pool-capacity = 3
max-removals = "off"
transfer-static = true
roll-auto-revert = false
header = ["X-Team=payments", "X-Source=rcfarm"]
consul-tls-server-name = "server.dc1.consul"
log-format = "json"
"#;
        let report = check(text);
        assert_eq!(report.problems, [], "{text}");
        assert_eq!(report.settings, 14);
    }

    #[test]
    fn a_selector_is_checked_as_the_scheduler_uses_it() {
        // serve reads --pool-selector only with --scheduler pool: so does the checker.
        assert_problems("pool-selector = \"a in\"\n", &[]);
        assert_problems(
            "scheduler = \"pool\"\npool-selector = \"a in\"\n",
            &[(2, "pool-selector", "--pool-selector")],
        );
        // One line per problem, though the selector's error draws a caret under the value.
        let report = check("scheduler = \"pool\"\npool-selector = \"a in\"\n");
        assert!(!report.problems[0].message.contains('\n'), "{report:?}");
    }

    #[test]
    fn files_are_read_as_serve_reads_them() {
        // A CA file that is not there, named by P2's alias: pinned on the key as written.
        assert_problems(
            "farm-id = \"a\"\ntls-ca-file = \"/nonexistent/ca.pem\"\n",
            &[(
                2,
                "tls-ca-file",
                "the Consul CA file /nonexistent/ca.pem (--consul-ca-file / CONSUL_CACERT): cannot read it",
            )],
        );
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "s3cr3t\n").unwrap();
        let text = format!("consul-token-file = {:?}\n", token.display().to_string());
        assert_problems(&text, &[]);
    }

    #[test]
    fn a_switch_given_a_string_is_refused() {
        for (text, want) in [
            (
                "roll-auto-revert = \"true\"\n",
                "a switch takes true or false (unquoted), not the string \"true\"",
            ),
            (
                "transfer-static = 1\n",
                "a switch takes true or false, not an integer",
            ),
        ] {
            let key = text.split(' ').next().unwrap_or_default();
            assert_problems(text, &[(1, key, want)]);
        }
        assert_problems("transfer-static = true\nroll-auto-revert = false\n", &[]);
    }

    #[test]
    fn a_syntax_error_is_reported_with_its_line() {
        let got = found("farm-id = \"a\"\n\nsession-ttl = 15s\n");
        assert!(!got.is_empty(), "{got:?}");
        assert_eq!(got[0].0, Some(3), "{got:?}");
        assert!(got[0].2.starts_with("TOML syntax error"), "{got:?}");
        let got = found("farm-id = \"a\"\nfarm-id = \"b\"\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0, Some(2), "{got:?}");
    }

    #[test]
    fn keys_that_are_no_settings_and_far_off_names_are_unknown() {
        assert_problems(
            "config = \"/etc/rcfarm/other.toml\"\nzzz = 1\n",
            &[
                (1, "config", "not a setting"),
                (2, "zzz", "not an option of `rcfarm serve`"),
            ],
        );
    }

    #[test]
    fn the_deployed_config_passes() {
        let report = check(DEPLOYED);
        assert_eq!(report.problems, [], "deploy/rcfarm.toml");
        assert!(report.settings >= 3, "{}", report.settings);
    }

    /// Every option of `rcfarm serve` is in deploy/rcfarm.toml, set or commented out
    /// (`# key = value`): a new flag without a word there fails here.
    #[test]
    fn the_deployed_config_documents_every_serve_option() {
        let root = crate::cli::RcfarmCli::command();
        let serve = root.find_subcommand("serve").expect("serve");
        let options = file_options(&root, serve);
        assert!(options.len() > 30, "{}", options.len());
        let documented: Vec<String> = DEPLOYED
            .lines()
            .filter_map(|l| {
                let l = l.trim_start();
                let l = l.strip_prefix('#').map_or(l, str::trim_start);
                let (key, _) = l.split_once('=')?;
                let key = key.trim();
                (!key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
                    .then(|| key.to_string())
            })
            .collect();
        let missing: Vec<&str> = options
            .iter()
            // Hidden options are test knobs, not settings.
            .filter(|a| !a.is_hide_set())
            .filter_map(|a| a.get_long())
            .filter(|long| !documented.iter().any(|d| d == long))
            .collect();
        assert!(
            missing.is_empty(),
            "deploy/rcfarm.toml lacks {missing:?}: add each with a comment on what it does and its default"
        );
        // And names nothing that is no option.
        let known: Vec<&str> = options.iter().filter_map(|a| a.get_long()).collect();
        let stray: Vec<&String> = documented
            .iter()
            .filter(|d| !known.contains(&d.as_str()))
            .collect();
        assert!(stray.is_empty(), "deploy/rcfarm.toml names {stray:?}");
    }

    #[test]
    fn positions_count_lines_and_characters() {
        assert_eq!(position("a\nbé = 1\n", 0), (1, 1));
        assert_eq!(position("a\nbé = 1\n", 2), (2, 1));
        assert_eq!(position("a\nbé = 1\n", 6), (2, 4));
        assert_eq!(edit_distance("sesion-ttl", "session-ttl"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(find_word("--session-ttl-min x", "--session-ttl"), None);
        assert_eq!(find_word("a --session-ttl: x", "--session-ttl"), Some(2));
    }
}
