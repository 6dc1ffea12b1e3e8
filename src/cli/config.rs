//! `--config FILE`: a TOML file whose keys are the long option names of `rcfarm serve` / `dev`
//! (`session-ttl = "15s"`, `audit-db = "postgres://…"`). Precedence: command-line flags, then
//! environment variables, then the file, then defaults.
//!
//! The file is turned into flags placed before the user's own (which override them, the
//! subcommands allowing a flag to repeat), skipping options whose environment variable is set.

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
    let known: Vec<&clap::Arg> = sub
        .get_arguments()
        .chain(root.get_arguments())
        .filter(|a| a.get_long().is_some())
        .collect();
    let mut injected: Vec<OsString> = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let arg = known
            .iter()
            .find(|a| {
                a.get_long() == Some(long.as_str())
                    || a.get_all_aliases()
                        .is_some_and(|al| al.contains(&long.as_str()))
            })
            .ok_or_else(|| {
                let mut names: Vec<&str> = known
                    .iter()
                    .filter_map(|a| a.get_long())
                    .filter(|n| *n != "help" && *n != "version" && *n != "config")
                    .collect();
                names.sort();
                CliError::Usage(format!(
                    "--config {path}: unknown option `{key}`; valid keys: {}",
                    names.join(", ")
                ))
            })?;
        if arg
            .get_env()
            .is_some_and(|env| std::env::var_os(env).is_some())
        {
            continue;
        }
        let flag = format!("--{}", arg.get_long().unwrap_or(&long));
        // A switch (`--transfer-static`) takes no value: `true` sets it, `false` leaves it.
        let takes_value =
            arg.get_action().takes_values() && arg.get_num_args().is_none_or(|n| n.takes_values());
        match value {
            toml::Value::Boolean(b) if !takes_value => {
                if *b {
                    injected.push(flag.into());
                }
            }
            toml::Value::Array(items) => {
                for item in items {
                    injected.push(flag.clone().into());
                    injected.push(scalar(&path, key, item)?.into());
                }
            }
            other => {
                injected.push(flag.into());
                injected.push(scalar(&path, key, other)?.into());
            }
        }
    }
    let mut out: Vec<OsString> = args[..=sub_pos].to_vec();
    out.extend(injected);
    out.extend(rest);
    Ok(out)
}

fn scalar(path: &str, key: &str, v: &toml::Value) -> Result<String, CliError> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        _ => Err(CliError::Usage(format!(
            "--config {path}: `{key}` must be a string, number or boolean"
        ))),
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
    fn without_a_config_nothing_changes() {
        let a = os(&["rcfarm", "consul-dev", "--listen", "127.0.0.1:0"]);
        assert_eq!(expand(a.clone()).unwrap(), a);
    }
}
