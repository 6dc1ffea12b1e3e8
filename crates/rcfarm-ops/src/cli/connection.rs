//! How `rcfarm serve`, `rcctl` and `rcfarm-tools simulate-nodes` reach Consul: Consul's own CLI
//! variables with their meaning, P2's flag spellings as aliases, and for `rcfarm serve` the same
//! keys in its TOML file. Precedence: a flag, then the environment, then the file.

use std::path::PathBuf;

use super::CliError;
use crate::consul::{ConsulConfig, TlsConfig, parse_go_bool, with_https};

/// Consul connection options shared by every command that talks to Consul. Its `Debug`
/// never shows the token or a header's value.
#[derive(Clone, clap::Args)]
pub struct ConsulArgs {
    /// Consul's HTTP API: `http://host:port`, or `https://host:port` for TLS (a bare
    /// `host:port` is http, or https with CONSUL_HTTP_SSL=true).
    #[arg(
        long,
        global = true,
        env = "CONSUL_HTTP_ADDR",
        default_value = "http://127.0.0.1:8500"
    )]
    pub consul: String,
    /// ACL token. Prefer --consul-token-file: a token on the command line is visible to every
    /// user of the machine (`ps`).
    #[arg(long, global = true, env = "CONSUL_HTTP_TOKEN", hide_env_values = true)]
    pub consul_token: Option<String>,
    /// A file holding the ACL token (re-read when it changes, so a token can be rotated
    /// without a restart). Wins over a token given at the same level, as in Consul's CLI.
    #[arg(
        long,
        global = true,
        visible_alias = "token-file",
        env = "CONSUL_HTTP_TOKEN_FILE",
        value_name = "PATH"
    )]
    pub consul_token_file: Option<PathBuf>,
    /// PEM file of the CA(s) that sign Consul's HTTPS certificate; only these are then trusted.
    /// Default: the system's roots.
    #[arg(
        long,
        global = true,
        visible_alias = "tls-ca-file",
        env = "CONSUL_CACERT",
        value_name = "PATH"
    )]
    pub consul_ca_file: Option<PathBuf>,
    /// A directory of PEM files of trusted CAs (used when no CA file is given).
    #[arg(long, global = true, env = "CONSUL_CAPATH", value_name = "DIR")]
    pub consul_ca_path: Option<PathBuf>,
    /// PEM client certificate, for a Consul run with `verify_incoming`.
    #[arg(
        long,
        global = true,
        visible_alias = "tls-cert-file",
        env = "CONSUL_CLIENT_CERT",
        value_name = "PATH"
    )]
    pub consul_client_cert: Option<PathBuf>,
    /// PEM private key of the client certificate.
    #[arg(
        long,
        global = true,
        visible_alias = "tls-key-file",
        env = "CONSUL_CLIENT_KEY",
        value_name = "PATH"
    )]
    pub consul_client_key: Option<PathBuf>,
    /// Check Consul's certificate against this name rather than the address's host (e.g.
    /// server.dc1.consul when the address is an IP).
    #[arg(
        long,
        global = true,
        env = "CONSUL_TLS_SERVER_NAME",
        value_name = "NAME"
    )]
    pub consul_tls_server_name: Option<String>,
    /// `false` accepts any certificate from Consul (never in production: anyone on the path
    /// can read the token and forge answers).
    #[arg(
        long,
        global = true,
        env = "CONSUL_HTTP_SSL_VERIFY",
        value_name = "BOOL",
        default_value = "true"
    )]
    pub consul_ssl_verify: String,
    /// A header sent on every request to Consul (repeat for several), as P2's tools' --header.
    #[arg(long = "header", global = true, value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
}

impl std::fmt::Debug for ConsulArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsulArgs")
            .field("consul", &self.consul)
            .field("consul_token", &self.consul_token.as_ref().map(|_| "***"))
            .field("consul_token_file", &self.consul_token_file)
            .field("consul_ca_file", &self.consul_ca_file)
            .field("consul_ca_path", &self.consul_ca_path)
            .field("consul_client_cert", &self.consul_client_cert)
            .field("consul_client_key", &self.consul_client_key)
            .field("consul_tls_server_name", &self.consul_tls_server_name)
            .field("consul_ssl_verify", &self.consul_ssl_verify)
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|h| format!("{}=***", h.split_once('=').map_or(h.as_str(), |(k, _)| k)))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Whether the user typed `--flag` (or `--flag=…`, or an alias) on this process's command line.
fn on_command_line(names: &[&str]) -> bool {
    std::env::args_os().skip(1).any(|a| {
        let a = a.to_string_lossy();
        names.iter().any(|n| {
            a.strip_prefix("--")
                .and_then(|rest| rest.strip_prefix(n))
                .is_some_and(|tail| tail.is_empty() || tail.starts_with('='))
        })
    })
}

fn env_set(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty())
}

/// Where a setting came from, higher wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Unset,
    File,
    Env,
    Flag,
}

fn level(given: bool, flags: &[&str], env: &str) -> Level {
    if !given {
        Level::Unset
    } else if on_command_line(flags) {
        Level::Flag
    } else if env_set(env) {
        Level::Env
    } else {
        Level::File
    }
}

impl ConsulArgs {
    /// The client configuration, with every mistake that can be seen without Consul reported
    /// as a usage error naming the flag. `warn` receives advice (a token in argv).
    pub fn to_config(&self) -> Result<ConsulConfig, CliError> {
        let verify = parse_go_bool(self.consul_ssl_verify.trim()).map_err(|e| {
            CliError::Usage(format!("--consul-ssl-verify / CONSUL_HTTP_SSL_VERIFY: {e}"))
        })?;
        let mut address = self.consul.clone();
        if let Ok(ssl) = std::env::var("CONSUL_HTTP_SSL")
            && !ssl.is_empty()
            && parse_go_bool(&ssl).map_err(|e| CliError::Usage(format!("CONSUL_HTTP_SSL: {e}")))?
        {
            address = with_https(&address);
        }
        let mut headers = Vec::new();
        for h in &self.headers {
            let (name, value) = h.split_once('=').ok_or_else(|| {
                CliError::Usage(format!(
                    "--header {h:?}: expected NAME=VALUE, e.g. --header X-Request-Source=rcfarm"
                ))
            })?;
            if name.trim().is_empty() {
                return Err(CliError::Usage(format!(
                    "--header {h:?}: the header name is empty; expected NAME=VALUE"
                )));
            }
            headers.push((name.trim().to_string(), value.to_string()));
        }
        // A token and a token file at different levels: the higher level wins. At the same
        // level the file wins, as in Consul's client.
        let token_level = level(
            self.consul_token.is_some(),
            &["consul-token"],
            "CONSUL_HTTP_TOKEN",
        );
        let file_level = level(
            self.consul_token_file.is_some(),
            &["consul-token-file", "token-file"],
            "CONSUL_HTTP_TOKEN_FILE",
        );
        let (token, token_file) = if file_level >= token_level {
            (None, self.consul_token_file.clone())
        } else {
            (self.consul_token.clone(), None)
        };
        if token.is_some() && token_level == Level::Flag {
            tracing::warn!(
                "the ACL token was given with --consul-token: every user of this machine can read \
                 it in the process list; use --consul-token-file or CONSUL_HTTP_TOKEN_FILE"
            );
        }
        if !verify {
            tracing::warn!(
                "Consul's certificate is not checked (--consul-ssl-verify false / \
                 CONSUL_HTTP_SSL_VERIFY=false): anyone between here and Consul can read the token \
                 and change every answer"
            );
        }
        Ok(ConsulConfig {
            token,
            token_file,
            headers,
            tls: TlsConfig {
                ca_file: self.consul_ca_file.clone(),
                ca_path: self.consul_ca_path.clone(),
                client_cert: self.consul_client_cert.clone(),
                client_key: self.consul_client_key.clone(),
                server_name: self.consul_tls_server_name.clone(),
                skip_verify: !verify,
            },
            ..ConsulConfig::new(address)
        })
    }
}
