//! `--config FILE`: a TOML file whose keys are the long option names of `rcfarm serve` / `dev`
//! (`session-ttl = "15s"`, `audit-db = "postgres://…"`). Precedence: command-line flags, then
//! environment variables, then the file, then defaults.
//!
//! The file is turned into flags placed before the user's own (which override them, the
//! subcommands allowing a flag to repeat), skipping options whose environment variable is set.
//! A switch (`transfer-static`) takes `true` or `false`, any other option a string, number or
//! boolean, and a repeatable one (`header`) an array of them too; one option given by two keys
//! (`session-ttl` and `session_ttl`, or `consul-ca-file` and its alias `tls-ca-file`) is refused.
//! `rcfarm check-config` ([`super::check_config`]) reads a file by the same rules.

use std::ffi::OsString;

use clap::CommandFactory;

use super::CliError;

/// Rewrites the process arguments with the config file's options, if one is given.
pub fn expand(args: Vec<OsString>) -> Result<Vec<OsString>, CliError> {
    let strs: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    // The subcommand: the first argument that names one.
    let Some(sub_pos) = strs.iter().position(|a| a == "serve" || a == "dev") else {
        return Ok(args);
    };
    let mut path = std::env::var("RCFARM_CONFIG")
        .ok()
        .filter(|p| !p.is_empty());
    let mut rest: Vec<OsString> = Vec::new();
    let mut i = sub_pos + 1;
    while i < args.len() {
        let a = &strs[i];
        if a == "--config" {
            path = Some(
                strs.get(i + 1)
                    .cloned()
                    .ok_or_else(|| CliError::Usage("--config needs a file path".into()))?,
            );
            i += 2;
            continue;
        }
        if let Some(p) = a.strip_prefix("--config=") {
            path = Some(p.to_string());
        } else {
            rest.push(args[i].clone());
        }
        i += 1;
    }
    let Some(path) = path else { return Ok(args) };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| CliError::Usage(format!("--config {path}: {e}")))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| CliError::Usage(format!("--config {path}: {e}")))?;

    let root = super::RcfarmCli::command();
    let sub = root
        .find_subcommand(&strs[sub_pos])
        .ok_or_else(|| CliError::Usage(format!("unknown subcommand {}", strs[sub_pos])))?;
    let known = file_options(&root, sub);
    let mut injected: Vec<OsString> = Vec::new();
    let mut seen: Vec<(&clap::Arg, &str)> = Vec::new();
    for (key, value) in &table {
        let arg = find_option(&known, key).ok_or_else(|| {
            let mut names: Vec<&str> = known.iter().filter_map(|a| a.get_long()).collect();
            names.sort();
            CliError::Usage(format!(
                "--config {path}: unknown option `{key}`; valid keys: {}",
                names.join(", ")
            ))
        })?;
        if let Some((_, other)) = seen.iter().find(|(a, _)| a.get_id() == arg.get_id()) {
            return Err(CliError::Usage(format!(
                "--config {path}: `{other}` and `{key}` are the same option; keep one"
            )));
        }
        seen.push((arg, key));
        let flags = to_flags(arg, value)
            .map_err(|e| CliError::Usage(format!("--config {path}: `{key}`: {e}")))?;
        if arg
            .get_env()
            .is_some_and(|env| std::env::var_os(env).is_some())
        {
            continue;
        }
        injected.extend(flags.into_iter().map(OsString::from));
    }
    let mut out: Vec<OsString> = args[..=sub_pos].to_vec();
    out.extend(injected);
    out.extend(rest);
    Ok(out)
}

/// Options that cannot be set from a file: they are not settings.
const NOT_SETTINGS: [&str; 3] = ["help", "version", "config"];

/// The options a file may set for subcommand `sub` of `root`: the subcommand's long options and
/// the root's global ones (`log-format`), without help, version and config.
pub(super) fn file_options<'a>(
    root: &'a clap::Command,
    sub: &'a clap::Command,
) -> Vec<&'a clap::Arg> {
    sub.get_arguments()
        .chain(root.get_arguments().filter(|a| a.is_global_set()))
        .filter(|a| a.get_long().is_some_and(|l| !NOT_SETTINGS.contains(&l)))
        .collect()
}

/// The option a file key names: its long name or an alias, `_` read as `-`.
pub(super) fn find_option<'a>(known: &[&'a clap::Arg], key: &str) -> Option<&'a clap::Arg> {
    let long = key.replace('_', "-");
    known.iter().copied().find(|a| {
        a.get_long() == Some(long.as_str())
            || a.get_all_aliases()
                .is_some_and(|al| al.contains(&long.as_str()))
    })
}

/// Whether an option takes no value (`--transfer-static`): `true` in a file sets it.
fn is_switch(arg: &clap::Arg) -> bool {
    !(arg.get_action().takes_values() && arg.get_num_args().is_none_or(|n| n.takes_values()))
}

/// Whether an option may be given several times, each adding a value (`--header`): an array
/// in a file gives it once per item.
fn is_repeatable(arg: &clap::Arg) -> bool {
    matches!(arg.get_action(), clap::ArgAction::Append)
}

/// The command-line arguments a file's value for `arg` stands for, or why it cannot be one.
/// A switch takes `true` (set) or `false` (left unset); an option a string, number or boolean,
/// or for a repeatable option an array of them.
pub(super) fn to_flags(arg: &clap::Arg, value: &toml::Value) -> Result<Vec<String>, String> {
    let long = arg.get_long().unwrap_or_default();
    let flag = format!("--{long}");
    if is_switch(arg) {
        return match value {
            toml::Value::Boolean(true) => Ok(vec![flag]),
            toml::Value::Boolean(false) => Ok(Vec::new()),
            toml::Value::String(s) => Err(format!(
                "a switch takes true or false (unquoted), not the string {s:?}"
            )),
            other => Err(format!(
                "a switch takes true or false, not {} {}",
                article(other.type_str()),
                other.type_str()
            )),
        };
    }
    let with = |v: String| {
        // A value that starts with `-` is glued to its flag, or it would read as another flag.
        if v.starts_with('-') {
            vec![format!("{flag}={v}")]
        } else {
            vec![flag.clone(), v]
        }
    };
    match value {
        toml::Value::Array(items) if is_repeatable(arg) => {
            let mut out = Vec::new();
            for item in items {
                out.extend(with(scalar(item).map_err(|t| {
                    format!(
                        "an array item is {} {t}; give strings, numbers or booleans",
                        article(t)
                    )
                })?));
            }
            Ok(out)
        }
        toml::Value::Array(_) => Err(format!(
            "an array, but `{long}` takes one value; give a string, number or boolean"
        )),
        other => Ok(with(scalar(other).map_err(|t| {
            let what = if is_repeatable(arg) {
                "a string, number or boolean, or an array of them"
            } else {
                "a string, number or boolean"
            };
            format!("{} {t}, but `{long}` takes {what}", article(t))
        })?)),
    }
}

fn article(type_name: &str) -> &'static str {
    if type_name.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

/// A scalar as its command-line text, or the TOML type it is instead.
fn scalar(v: &toml::Value) -> Result<String, &'static str> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(other.type_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn file_options_come_before_the_users_own() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("farm.toml");
        std::fs::write(
            &f,
            "farm-id = \"from-file\"\nsession_ttl = \"20s\"\npool-capacity = 3\n",
        )
        .unwrap();
        let out = expand(os(&[
            "rcfarm",
            "serve",
            "--config",
            f.to_str().unwrap(),
            "--farm-id",
            "cli",
        ]))
        .unwrap();
        let s: Vec<String> = out
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(&s[..2], ["rcfarm", "serve"]);
        assert!(s.windows(2).any(|w| w == ["--session-ttl", "20s"]), "{s:?}");
        assert!(s.windows(2).any(|w| w == ["--pool-capacity", "3"]), "{s:?}");
        assert_eq!(
            s.iter().rposition(|a| a == "--farm-id").map(|i| &s[i + 1]),
            Some(&"cli".to_string()),
            "the flag wins: {s:?}"
        );
        assert!(!s.iter().any(|a| a.contains("config")), "{s:?}");
    }

    #[test]
    fn switches_are_set_by_true_and_left_by_false() {
        let dir = tempfile::tempdir().unwrap();
        for (text, set) in [
            ("transfer-static = true\naudit-shipping = \"off\"\n", true),
            ("transfer-static = false\n", false),
        ] {
            let f = dir.path().join("farm.toml");
            std::fs::write(&f, text).unwrap();
            let out = expand(os(&["rcfarm", "serve", "--config", f.to_str().unwrap()])).unwrap();
            let s: Vec<String> = out
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            assert_eq!(s.contains(&"--transfer-static".to_string()), set, "{s:?}");
            assert!(!s.iter().any(|a| a == "true" || a == "false"), "{s:?}");
            // And clap takes what the file gave.
            let cli = <crate::cli::RcfarmCli as clap::Parser>::try_parse_from(&out);
            assert!(cli.is_ok(), "{s:?}: {:?}", cli.err());
        }
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("farm.toml");
        std::fs::write(&f, "sesion-ttl = \"20s\"\n").unwrap();
        let err = expand(os(&["rcfarm", "serve", "--config", f.to_str().unwrap()]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown option `sesion-ttl`") && err.contains("session-ttl"),
            "{err}"
        );
    }

    #[test]
    fn arrays_only_for_repeatable_options_and_one_key_per_option() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("farm.toml");
        let run = |text: &str| {
            std::fs::write(&f, text).unwrap();
            expand(os(&["rcfarm", "serve", "--config", f.to_str().unwrap()]))
                .map(|out| {
                    out.iter()
                        .map(|a| a.to_string_lossy().into_owned())
                        .collect::<Vec<_>>()
                })
                .map_err(|e| e.to_string())
        };
        let s = run("header = [\"A=1\", \"B=2\"]\nrc-selector = \"-x\"\n").unwrap();
        assert!(s.windows(2).any(|w| w == ["--header", "A=1"]), "{s:?}");
        assert!(s.windows(2).any(|w| w == ["--header", "B=2"]), "{s:?}");
        assert!(s.contains(&"--rc-selector=-x".to_string()), "{s:?}");
        let err = run("session-ttl = [\"1s\", \"2s\"]\n").unwrap_err();
        assert!(err.contains("takes one value"), "{err}");
        let err = run("session-ttl = \"1s\"\nsession_ttl = \"2s\"\n").unwrap_err();
        assert!(err.contains("the same option"), "{err}");
        let err = run("transfer-static = \"yes\"\n").unwrap_err();
        assert!(err.contains("a switch takes true or false"), "{err}");
    }

    #[test]
    fn without_a_config_nothing_changes() {
        let a = os(&["rcfarm", "consul-dev", "--listen", "127.0.0.1:0"]);
        assert_eq!(expand(a.clone()).unwrap(), a);
    }
}
