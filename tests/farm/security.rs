//! Security to Consul: ACL tokens and TLS.
//!
//! - A farm whose token Consul refuses (unknown, or none under `acl_default_policy = deny`) stops
//!   at start, exit 1, with a message naming the token, having created no session and written
//!   nothing; with the right token it serves.
//! - `--consul https://…` with `--consul-ca-file`: a farm (and rcctl) talk to real Consul's HTTPS
//!   listener with a CA and certificate made here; without the CA the farm stops with a
//!   certificate error; a CA file that cannot be read is a usage error naming it.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use rcfarm::consul::{ConsulConfig, ConsulError, QueryOptions};
use rcfarm::rc::RcId;
use rcfarm::server::ServerConfig;
use rcfarm_testkit::chaos::agent::{AgentConfig, AgentTls};

use crate::harness::{Backend, Cluster, Server, nodes, rcs};
use crate::on_every_backend;

const MASTER_TOKEN: &str = "3f0c6b6e-rcfarm-test-master";

/// A cluster whose Consul has ACLs on, default policy deny, and [`MASTER_TOKEN`]; the test's own
/// client uses that token.
async fn acl_cluster(backend: &Backend) -> Cluster {
    match backend {
        Backend::Embedded(compat) => {
            Cluster::start_with(ServerConfig {
                acl_token: Some(MASTER_TOKEN.into()),
                compat: *compat,
                ..Cluster::server_config()
            })
            .await
        }
        Backend::Real(bin) => {
            let mut config = AgentConfig::dev(bin, "rcfarm-acl");
            config.acl_master_token = Some(MASTER_TOKEN.into());
            Cluster::start_real(config).await
        }
    }
}

/// Waits for farm `i` to exit (it must within 15 s) and returns how, with its log.
async fn exit_of(c: &mut Cluster, i: usize) -> (ExitStatus, String) {
    let status = tokio::time::timeout(Duration::from_secs(15), c.farms[i].child.wait())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "farm {} still runs after 15 s:\n{}",
                c.farms[i].id,
                c.farm_log(i)
            )
        })
        .unwrap();
    // The log reader may be a line behind the exit.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = c.farm_log(i);
    assert!(!log.contains("panicked"), "{log}");
    (status, log)
}

/// Waits until every RC of `ids` has `replicas` pods, with farm `farm` still running.
async fn serves(c: &mut Cluster, farm: usize, ids: &[RcId], replicas: usize, what: &str) {
    let cr = &*c;
    cr.wait_for(Duration::from_secs(30), what, || placed(cr, ids, replicas))
        .await;
    assert!(
        c.farms[farm].child.try_wait().unwrap().is_none(),
        "{}",
        c.farm_log(farm)
    );
    c.check_invariants(|_| false);
}

/// Waits for farm `i` to exit with `code`, saying each of `needles`; prints its last line.
async fn stops_with(c: &mut Cluster, i: usize, code: i32, needles: &[&str]) -> String {
    let (status, log) = exit_of(c, i).await;
    assert_eq!(status.code(), Some(code), "{log}");
    for n in needles {
        assert!(log.contains(n), "{n:?} not said:\n{log}");
    }
    println!(
        "{}: {}",
        c.farms[i].id,
        log.lines().last().unwrap_or_default()
    );
    log
}

/// Every RC of `ids` placed on `replicas` nodes.
async fn placed(c: &Cluster, ids: &[RcId], replicas: usize) -> bool {
    let p = c.placements().await;
    ids.iter()
        .all(|id| p.get(id).is_some_and(|n| n.len() == replicas))
}

async fn a_refused_acl_token_stops_the_farm_at_start(backend: Backend) {
    let mut c = acl_cluster(&backend).await;
    nodes(&c, 3, 1).await;
    let ids = rcs(&c, 2, 2).await;

    // A token Consul does not know.
    let wrong = c
        .spawn_farm("wrong-token", &["--consul-token", "not-a-token"])
        .await;
    let (status, log) = exit_of(&mut c, wrong).await;
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("Consul refused the ACL token given by --consul-token / CONSUL_HTTP_TOKEN"),
        "{log}"
    );
    assert!(log.contains("ACL not found"), "{log}");
    assert!(
        log.contains("The farm needs write on the KV prefixes"),
        "{log}"
    );
    println!("wrong token: {}", log.lines().last().unwrap_or_default());

    // No token at all: the anonymous token, denied everything.
    let anonymous = c.spawn_farm("no-token", &[]).await;
    let (status, log) = exit_of(&mut c, anonymous).await;
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("Consul refused requests without an ACL token"),
        "{log}"
    );
    assert!(
        log.contains("give one with --consul-token-file / CONSUL_HTTP_TOKEN_FILE, or --consul-token / CONSUL_HTTP_TOKEN"),
        "{log}"
    );
    assert!(log.contains("Permission denied"), "{log}");
    println!("no token: {}", log.lines().last().unwrap_or_default());

    // A token that may read everything and write only some of what the farm writes (real
    // Consul: the embedded server knows one token, all or nothing).
    if c.is_real() {
        let rules = r#"key "" { policy = "read" }
key "rcfarm/" { policy = "write" }
key "lock/" { policy = "write" }"#;
        let token = legacy_token(&c.server.url(), "partial", "client", rules).await;
        let partial = c.spawn_farm("partial", &["--consul-token", &token]).await;
        let (status, log) = exit_of(&mut c, partial).await;
        assert_eq!(status.code(), Some(1), "{log}");
        assert!(
            log.contains("Consul refused the ACL token given by --consul-token"),
            "{log}"
        );
        // Exactly the writes it lacks are named.
        assert!(
            log.contains(
                "Permission denied for write on replication_controllers/, write on rolls/, \
                 write on labels/pod/, write on labels/replication_controller/, write on \
                 labels/rolls/, write on intent/, write on status/replication_controllers/, \
                 write on audit_logs/."
            ),
            "{log}"
        );
        println!("partial token: {}", log.lines().last().unwrap_or_default());
    }

    // None half-worked: no session kept, nothing registered, nothing scheduled.
    let (sessions, _) = c
        .consul
        .session_list(&QueryOptions::default())
        .await
        .unwrap();
    assert!(sessions.is_empty(), "sessions left: {sessions:?}");
    assert_eq!(c.count_prefix("rcfarm/farms/").await, 0);
    assert_eq!(c.count_prefix("intent/").await, 0);
    assert_eq!(c.count_prefix("lock/").await, 0);

    // The master token: the farm serves.
    let good = c.spawn_farm("f1", &["--consul-token", MASTER_TOKEN]).await;
    c.wait_for(Duration::from_secs(30), "both RCs placed", || {
        placed(&c, &ids, 2)
    })
    .await;
    assert!(
        c.farms[good].child.try_wait().unwrap().is_none(),
        "{}",
        c.farm_log(good)
    );
    c.check_invariants(|_| false);
}
on_every_backend!(a_refused_acl_token_stops_the_farm_at_start);

/// A token file is read at start (never logged), re-read when it is rotated, and preferred to a
/// token on the command line, which only draws a warning.
async fn a_token_file_is_used_and_reread_when_rotated(backend: Backend) {
    let mut c = acl_cluster(&backend).await;
    nodes(&c, 3, 1).await;
    let ids = rcs(&c, 1, 2).await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");

    // On real Consul, a token of its own that the test can revoke; the embedded server knows
    // only its master token.
    let server_url = c.server.url();
    let first = if c.is_real() {
        legacy_token(&server_url, "first", "management", "").await
    } else {
        MASTER_TOKEN.to_string()
    };
    std::fs::write(&token_file, format!("{first}\n")).unwrap();
    let path = token_file.to_str().unwrap().to_string();
    // A token on the command line too: the file wins (same level: as in Consul's client).
    let farm = c
        .spawn_farm(
            "f1",
            &[
                "--consul-token-file",
                &path,
                "--consul-token",
                "not-a-token",
            ],
        )
        .await;
    c.wait_for(Duration::from_secs(30), "the RC placed", || {
        placed(&c, &ids, 2)
    })
    .await;
    let log = c.farm_log(farm);
    assert!(!log.contains(&first), "the token is never logged:\n{log}");
    assert!(
        !log.contains("every user of this machine can read it"),
        "{log}"
    );

    if c.is_real() {
        // Rotation: the new token is written beside the file and renamed over it, then the old
        // one is revoked. The farm goes on serving with the new one, without a restart.
        let second = legacy_token(&server_url, "second", "management", "").await;
        let tmp = dir.path().join("token.new");
        std::fs::write(&tmp, format!("{second}\n")).unwrap();
        std::fs::rename(&tmp, &token_file).unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let resp = crate::common::http()
            .put(format!("{}/v1/acl/destroy/{first}", c.server.url()))
            .header("X-Consul-Token", MASTER_TOKEN)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{resp:?}");
        let more = [RcId::new()];
        c.put_rc(more[0], "after-rotation", "env=prod", 2, "static_strategy")
            .await;
        c.wait_for(
            Duration::from_secs(30),
            "an RC created after the rotation placed",
            || placed(&c, &more, 2),
        )
        .await;
        let log = c.farm_log(farm);
        assert!(
            log.contains("ACL token file changed: using the new token"),
            "{log}"
        );
        assert!(!log.contains(&second), "the token is never logged:\n{log}");
    }
    assert!(
        c.farms[farm].child.try_wait().unwrap().is_none(),
        "{}",
        c.farm_log(farm)
    );

    // A token only on the command line works, with a warning that `ps` shows it.
    crate::harness::signal(c.farms[farm].pid, "TERM");
    let _ = tokio::time::timeout(Duration::from_secs(15), c.farms[farm].child.wait()).await;
    let argv = c.spawn_farm("f2", &["--consul-token", MASTER_TOKEN]).await;
    let more = [RcId::new()];
    c.put_rc(more[0], "argv-token", "env=prod", 1, "static_strategy")
        .await;
    c.wait_for(Duration::from_secs(30), "an RC placed by f2", || {
        placed(&c, &more, 1)
    })
    .await;
    let log = c.farm_log(argv);
    assert!(
        log.contains(
            "the ACL token was given with --consul-token: every user of this machine can read it"
        ),
        "{log}"
    );
    c.check_invariants(|_| false);
}
on_every_backend!(a_token_file_is_used_and_reread_when_rotated);

/// A certificate authority made by a test.
struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.distinguished_name.push(DnType::CommonName, name);
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = ca.self_signed(&key).unwrap();
        TestCa {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(ca, key),
        }
    }

    /// A certificate for 127.0.0.1 and localhost, good for server and client authentication
    /// (as Consul's own agent certificates are), valid until `not_after`; its PEM and key PEM.
    fn leaf(&self, name: &str, not_after: Option<(i32, u8, u8)>) -> (String, String) {
        self.leaf_for(name, &["127.0.0.1", "localhost"], not_after)
    }

    /// Like [`TestCa::leaf`], for the names `sans`.
    fn leaf_for(
        &self,
        name: &str,
        sans: &[&str],
        not_after: Option<(i32, u8, u8)>,
    ) -> (String, String) {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose};
        let key = KeyPair::generate().unwrap();
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(sans).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        if let Some((y, m, d)) = not_after {
            p.not_before = rcgen::date_time_ymd(y - 1, m, d);
            p.not_after = rcgen::date_time_ymd(y, m, d);
        }
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Writes a leaf's certificate and key as `<stem>.pem` and `<stem>-key.pem` in `dir`.
    fn write_leaf(
        &self,
        dir: &Path,
        stem: &str,
        not_after: Option<(i32, u8, u8)>,
    ) -> (PathBuf, PathBuf) {
        let (cert, key) = self.leaf(stem, not_after);
        let (c, k) = (
            dir.join(format!("{stem}.pem")),
            dir.join(format!("{stem}-key.pem")),
        );
        std::fs::write(&c, cert).unwrap();
        std::fs::write(&k, key).unwrap();
        (c, k)
    }
}

/// A CA, and a certificate it signs for 127.0.0.1 and localhost, in `dir`.
fn make_certs(dir: &Path) -> AgentTls {
    let ca = TestCa::new("rcfarm test CA");
    let (cert_file, key_file) = ca.write_leaf(dir, "server", None);
    let tls = AgentTls {
        ca_file: dir.join("ca.pem"),
        cert_file,
        key_file,
        verify_incoming: false,
        https_only: false,
    };
    std::fs::write(&tls.ca_file, &ca.pem).unwrap();
    tls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_farm_talks_tls_to_consul_with_the_ca_file_and_refuses_an_unknown_certificate() {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let tls = make_certs(dir.path());
    let mut config = AgentConfig::dev(&bin, "rcfarm-tls");
    config.tls = Some(tls.clone());
    let mut c = Cluster::start_real(config).await;
    let https = match &c.server {
        Server::Real(agent) => agent.https_url().unwrap(),
        Server::Embedded(_) => unreachable!("a real agent"),
    };
    nodes(&c, 3, 1).await;
    let ids = rcs(&c, 2, 2).await;
    let ca = tls.ca_file.to_str().unwrap();

    // Without the CA, Consul's certificate is not trusted: the farm says so and stops.
    let no_ca = c.spawn_farm_via("no-ca", &https, &[]).await;
    let (status, log) = exit_of(&mut c, no_ca).await;
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("cannot talk TLS to Consul at"), "{log}");
    assert!(log.contains("invalid peer certificate"), "{log}");
    assert!(log.contains("--consul-ca-file / CONSUL_CACERT"), "{log}");
    println!("no CA file: {}", log.lines().last().unwrap_or_default());

    // A CA file that is not there: a usage mistake, naming the file.
    let missing = c
        .spawn_farm_via(
            "missing-ca",
            &https,
            &["--consul-ca-file", "/nonexistent/rcfarm-ca.pem"],
        )
        .await;
    let (status, log) = exit_of(&mut c, missing).await;
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(
        log.contains("the Consul CA file /nonexistent/rcfarm-ca.pem (--consul-ca-file / CONSUL_CACERT): cannot read it"),
        "{log}"
    );

    // HTTPS on a port that speaks plain HTTP: said to be a TLS problem, not retried forever.
    let plain = c.server.url().replace("http://", "https://");
    let wrong_port = c
        .spawn_farm_via("plain-port", &plain, &["--consul-ca-file", ca])
        .await;
    let (status, log) = exit_of(&mut c, wrong_port).await;
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("cannot talk TLS to Consul at"), "{log}");
    println!(
        "HTTPS to the HTTP port: {}",
        log.lines().last().unwrap_or_default()
    );

    // With the CA file: the farm serves over HTTPS.
    let good = c
        .spawn_farm_via("f1", &https, &["--consul-ca-file", ca])
        .await;
    serves(&mut c, good, &ids, 2, "both RCs placed over HTTPS").await;

    // rcctl too: the flag, and CONSUL_CACERT as Consul's CLI reads it.
    let ca_path = Path::new(ca);
    for out in [
        rcctl_with(&https, &["--consul-ca-file", ca, "ping"], &[]),
        rcctl_with(&https, &["ping"], &[("CONSUL_CACERT", ca_path)]),
    ] {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("is up; leader"), "{stdout}");
    }
    let out = rcctl_with(&https, &["ping"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid peer certificate"), "{stderr}");
    assert!(
        stderr.contains("--consul-ca-file / CONSUL_CACERT"),
        "{stderr}"
    );
    println!("rcctl without the CA: {stderr}");
}

/// What the client says about a CA file it cannot use, before any request.
#[test]
fn a_ca_file_that_cannot_be_used_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").unwrap();
    let ca = make_certs(dir.path()).ca_file;
    let build = |p: &Path| {
        rcfarm::consul::Consul::new(
            ConsulConfig::new("https://127.0.0.1:8501").with_ca_file(Some(p.to_path_buf())),
        )
    };
    let Err(ConsulError::Config(msg)) = build(&missing) else {
        panic!("a missing CA file is refused");
    };
    assert!(
        msg.contains(&format!(
            "{} (--consul-ca-file / CONSUL_CACERT): cannot read it",
            missing.display()
        )),
        "{msg}"
    );
    let Err(ConsulError::Config(msg)) = build(&empty) else {
        panic!("a CA file without a certificate is refused");
    };
    assert!(msg.contains("no PEM certificate"), "{msg}");
    assert!(build(&ca).is_ok());
}

/// Runs rcctl against `url` with `args` and `env` (Consul's variables cleared first).
fn rcctl_with(url: &str, args: &[&str], env: &[(&str, &Path)]) -> std::process::Output {
    // A Path for every value: certificates are files; the rest pass as OsStr all the same.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rcctl"));
    cmd.args(["--consul", url]).args(args);
    for v in [
        "CONSUL_CACERT",
        "CONSUL_CAPATH",
        "CONSUL_CLIENT_CERT",
        "CONSUL_CLIENT_KEY",
        "CONSUL_HTTP_TOKEN",
        "CONSUL_HTTP_TOKEN_FILE",
        "CONSUL_TLS_SERVER_NAME",
        "CONSUL_HTTP_SSL_VERIFY",
    ] {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// Consul run as production clusters often are: `verify_incoming` on an HTTPS-only API. A farm
/// and rcctl with a certificate from Consul's CA work (with rcfarm's flags, P2's spellings and
/// Consul's variables); without one, with one from another CA, with an expired one, or with a
/// key that is not the certificate's, the farm stops at start saying which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_farm_and_rcctl_reach_a_consul_that_demands_client_certificates() {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = TestCa::new("rcfarm test CA");
    let (server_cert, server_key) = ca.write_leaf(d, "server", None);
    let ca_file = d.join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let tls = AgentTls {
        ca_file: ca_file.clone(),
        cert_file: server_cert,
        key_file: server_key,
        verify_incoming: true,
        https_only: true,
    };
    let (farm_cert, farm_key) = ca.write_leaf(d, "farm", None);
    let (expired_cert, expired_key) = ca.write_leaf(d, "expired", Some((2020, 1, 1)));
    let other = TestCa::new("some other CA");
    let (foreign_cert, foreign_key) = other.write_leaf(d, "foreign", None);

    let mut config = AgentConfig::dev(&bin, "rcfarm-mtls");
    config.tls = Some(tls);
    let mut c = Cluster::start_real(config).await;
    let https = c.server.url();
    assert!(https.starts_with("https://"), "{https}");
    nodes(&c, 3, 1).await;
    let ids = rcs(&c, 2, 2).await;
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let ca_arg = s(&ca_file);

    // No client certificate: Consul ends the handshake; the farm says it wants one.
    let none = c
        .spawn_farm_via("no-cert", &https, &["--consul-ca-file", &ca_arg])
        .await;
    stops_with(
        &mut c,
        none,
        1,
        &[
            "Consul requires a client certificate (verify_incoming) and none was given",
            "--consul-client-cert / CONSUL_CLIENT_CERT",
            "\"CN=rcfarm test CA\"",
        ],
    )
    .await;

    // A certificate from a CA Consul does not trust.
    let foreign = c
        .spawn_farm_via(
            "foreign-cert",
            &https,
            &[
                "--consul-ca-file",
                &ca_arg,
                "--consul-client-cert",
                &s(&foreign_cert),
                "--consul-client-key",
                &s(&foreign_key),
            ],
        )
        .await;
    let refused = format!(
        "Consul refused the client certificate {} (issued by \"CN=some other CA\"): it is not issued by a CA Consul trusts",
        foreign_cert.display()
    );
    stops_with(&mut c, foreign, 1, &[&refused]).await;

    // An expired certificate, and a key that is not the certificate's: refused before any
    // request, as usage mistakes naming the file.
    for (id, cert, key, words) in [
        (
            "expired-cert",
            &expired_cert,
            &expired_key,
            "expired on 2020-01-01",
        ),
        (
            "wrong-key",
            &farm_cert,
            &foreign_key,
            "it is not the key of that certificate",
        ),
    ] {
        let i = c
            .spawn_farm_via(
                id,
                &https,
                &[
                    "--consul-ca-file",
                    &ca_arg,
                    "--consul-client-cert",
                    &s(cert),
                    "--consul-client-key",
                    &s(key),
                ],
            )
            .await;
        stops_with(&mut c, i, 2, &[words]).await;
    }
    assert_eq!(c.count_prefix("rcfarm/farms/").await, 0);
    assert_eq!(c.count_prefix("intent/").await, 0);

    // The right certificate, with P2's flag spellings: the farm serves.
    let good = c
        .spawn_farm_via(
            "f1",
            &https,
            &[
                "--tls-ca-file",
                &ca_arg,
                "--tls-cert-file",
                &s(&farm_cert),
                "--tls-key-file",
                &s(&farm_key),
            ],
        )
        .await;
    serves(&mut c, good, &ids, 2, "both RCs placed over mutual TLS").await;

    // rcctl with Consul's variables, and with the flags.
    let out = rcctl_with(
        &https,
        &["rc", "list"],
        &[
            ("CONSUL_CACERT", &ca_file),
            ("CONSUL_CLIENT_CERT", &farm_cert),
            ("CONSUL_CLIENT_KEY", &farm_key),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for id in &ids {
        assert!(stdout.contains(&id.to_string()), "{stdout}");
    }
    let out = rcctl_with(
        &https,
        &[
            "--consul-ca-file",
            &ca_arg,
            "--consul-client-cert",
            &s(&farm_cert),
            "--consul-client-key",
            &s(&farm_key),
            "ping",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = rcctl_with(&https, &["ping"], &[("CONSUL_CACERT", &ca_file)]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Consul requires a client certificate (verify_incoming)"),
        "{stderr}"
    );
    println!("rcctl without a certificate: {stderr}");
}

/// Creates a legacy-system token (Consul < 1.4) with `rules` ("client"; or "management", all
/// rights); its secret.
async fn legacy_token(url: &str, name: &str, kind: &str, rules: &str) -> String {
    let resp = crate::common::http()
        .put(format!("{url}/v1/acl/create"))
        .header("X-Consul-Token", MASTER_TOKEN)
        .json(&serde_json::json!({"Name": name, "Type": kind, "Rules": rules}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{resp:?}");
    resp.json::<serde_json::Value>().await.unwrap()["ID"]
        .as_str()
        .unwrap()
        .to_string()
}

fn policy_file(name: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/deploy/consul/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

/// The least-privilege policy of deploy/consul/, on real Consul's legacy ACL system: a farm with
/// exactly those rights converges RCs and carries out a roll; without any one of them it refuses
/// to start naming that right; rcctl's read-only rules read everything and write nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_farm_with_exactly_the_documented_rights_works_and_names_any_right_taken_away() {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return;
    };
    let mut config = AgentConfig::dev(&bin, "rcfarm-least-privilege");
    config.acl_master_token = Some(MASTER_TOKEN.into());
    let mut c = Cluster::start_real(config).await;
    let url = c.server.url();
    let policy = policy_file("rcfarm-farm.legacy.hcl");
    let rule_lines: Vec<&str> = policy.lines().filter(|l| l.starts_with("key \"")).collect();
    assert!(rule_lines.len() >= 15, "{policy}");

    // Each right taken away in turn: the farm stops at start, naming exactly that right.
    let dir = tempfile::tempdir().unwrap();
    for (i, line) in rule_lines.iter().enumerate() {
        let rules: String = policy
            .lines()
            .filter(|l| l != line)
            .collect::<Vec<_>>()
            .join("\n");
        let token = legacy_token(&url, &format!("without-{i}"), "client", &rules).await;
        let file = dir.path().join(format!("token-{i}"));
        std::fs::write(&file, &token).unwrap();
        let farm = c
            .spawn_farm(
                &format!("without-{i}"),
                &["--consul-token-file", file.to_str().unwrap()],
            )
            .await;
        let (status, log) = exit_of(&mut c, farm).await;
        let prefix = line.split('"').nth(1).unwrap();
        let access = if line.contains("\"write\"") {
            "write"
        } else {
            "read"
        };
        assert_eq!(status.code(), Some(1), "without {line}: {log}");
        assert!(
            log.contains(&format!(
                "Permission denied for {access} on {prefix}. The farm needs"
            )),
            "without {line}: {log}"
        );
        assert!(log.contains("deploy/consul/rcfarm-farm"), "{log}");
    }
    println!(
        "each of {} rights taken away is named at start",
        rule_lines.len()
    );
    assert_eq!(c.count_prefix("rcfarm/farms/").await, 0);

    // Exactly the documented rights: RCs converge, a roll completes.
    nodes(&c, 4, 1).await;
    let _sim = c.simulate(4, 0.0);
    let token = legacy_token(&url, "rcfarm-farm", "client", &policy).await;
    let file = dir.path().join("token");
    std::fs::write(&file, &token).unwrap();
    let farm = c
        .spawn_farm(
            "least",
            &[
                "--consul-token-file",
                file.to_str().unwrap(),
                "--roll-resync",
                "300ms",
            ],
        )
        .await;
    let old = rcs(&c, 1, 3).await[0];
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "the RC up", move || async move {
        cr.all_up(old, 3).await
    })
    .await;
    let new_rc = c.start_roll(old, 2, Duration::ZERO).await;
    c.wait_for(
        Duration::from_secs(60),
        "the roll completes",
        move || async move {
            cr.consul
                .kv_get(&rcfarm::roll::roll_key(new_rc), &QueryOptions::default())
                .await
                .unwrap()
                .0
                .is_none()
                && cr.all_up(new_rc, 3).await
        },
    )
    .await;
    let log = c.farm_log(farm);
    assert!(!log.contains("Permission denied"), "{log}");
    c.check_invariants(|_| false);

    // rcctl with the read-only rules: reads work, writes are refused by Consul.
    let ro = legacy_token(
        &url,
        "rcctl-readonly",
        "client",
        &policy_file("rcctl-readonly.legacy.hcl"),
    )
    .await;
    let ro_file = dir.path().join("ro-token");
    std::fs::write(&ro_file, &ro).unwrap();
    for args in [
        vec!["rc", "list"],
        vec!["rc", "show", &new_rc.to_string()],
        vec!["roll", "list"],
        vec!["node", "list"],
        vec!["farms"],
        vec!["ping"],
    ] {
        let out = rcctl_with(&url, &args, &[("CONSUL_HTTP_TOKEN_FILE", &ro_file)]);
        assert!(
            out.status.success(),
            "{args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = rcctl_with(
        &url,
        &["rc", "scale", &new_rc.to_string(), "1"],
        &[("CONSUL_HTTP_TOKEN_FILE", &ro_file)],
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Consul denied the change: Permission denied (the ACL token may not write"),
        "{stderr}"
    );
    println!("read-only rcctl scaling: {stderr}");
}

/// Consul's other TLS variables, with rcctl against real Consul's HTTPS listener whose
/// certificate names only `server.dc1.consul` (as Consul's own agent certificates do):
/// `CONSUL_TLS_SERVER_NAME` makes it check out, `CONSUL_CAPATH` trusts a directory of CAs,
/// `CONSUL_HTTP_SSL_VERIFY=false` skips the check, and without them the name is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consuls_tls_variables_server_name_ca_path_and_no_verify() {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = TestCa::new("rcfarm test CA");
    let (cert, key) = ca.leaf_for("server", &["server.dc1.consul"], None);
    let cas = d.join("cas");
    std::fs::create_dir(&cas).unwrap();
    std::fs::write(cas.join("ca.pem"), &ca.pem).unwrap();
    std::fs::write(d.join("server.pem"), cert).unwrap();
    std::fs::write(d.join("server-key.pem"), key).unwrap();
    let mut config = AgentConfig::dev(&bin, "rcfarm-tls-name");
    config.tls = Some(AgentTls {
        ca_file: cas.join("ca.pem"),
        cert_file: d.join("server.pem"),
        key_file: d.join("server-key.pem"),
        verify_incoming: false,
        https_only: false,
    });
    let c = Cluster::start_real(config).await;
    let https = match &c.server {
        Server::Real(agent) => agent.https_url().unwrap(),
        Server::Embedded(_) => unreachable!("a real agent"),
    };
    let name = Path::new("server.dc1.consul");
    let no = Path::new("false");
    for (what, args, env, ok) in [
        (
            "the address's own name",
            vec!["ping"],
            vec![("CONSUL_CAPATH", cas.as_path())],
            false,
        ),
        (
            "CONSUL_TLS_SERVER_NAME",
            vec!["ping"],
            vec![
                ("CONSUL_CAPATH", cas.as_path()),
                ("CONSUL_TLS_SERVER_NAME", name),
            ],
            true,
        ),
        (
            "--consul-tls-server-name",
            vec!["--consul-tls-server-name", "server.dc1.consul", "ping"],
            vec![("CONSUL_CAPATH", cas.as_path())],
            true,
        ),
        (
            "CONSUL_HTTP_SSL_VERIFY=false",
            vec!["ping"],
            vec![("CONSUL_HTTP_SSL_VERIFY", no)],
            true,
        ),
    ] {
        let out = rcctl_with(&https, &args, &env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), ok, "{what}: {stderr}");
        if !ok {
            assert!(
                stderr.contains("certificate is only valid for DnsName(\"server.dc1.consul\")"),
                "{stderr}"
            );
            assert!(
                stderr.contains("--consul-tls-server-name / CONSUL_TLS_SERVER_NAME"),
                "{stderr}"
            );
        }
        if what.contains("VERIFY") {
            assert!(
                stderr.contains("Consul's certificate is not checked"),
                "{stderr}"
            );
        }
        println!("{what}: {}", if ok { "up" } else { stderr.trim() });
    }
}
