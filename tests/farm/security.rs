//! Security to Consul: ACL tokens and TLS.
//!
//! - A farm whose token Consul refuses (unknown, or none under `acl_default_policy = deny`) stops
//!   at start, exit 1, with a message naming the token, having created no session and written
//!   nothing; with the right token it serves.
//! - `--consul https://…` with `--consul-ca-file`: a farm (and rcctl) talk to real Consul's HTTPS
//!   listener with a CA and certificate made here; without the CA the farm stops with a
//!   certificate error; a CA file that cannot be read is a usage error naming it.

use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

use rcfarm::chaos::agent::{AgentConfig, AgentTls};
use rcfarm::consul::{ConsulConfig, ConsulError, QueryOptions};
use rcfarm::rc::RcId;
use rcfarm::server::ServerConfig;

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
        log.contains("The farm needs read on the KV prefixes"),
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
    assert!(log.contains("--consul-token or CONSUL_HTTP_TOKEN"), "{log}");
    assert!(log.contains("Permission denied"), "{log}");
    println!("no token: {}", log.lines().last().unwrap_or_default());

    // A token that may read everything and write only some of what the farm writes (real
    // Consul: the embedded server knows one token, all or nothing).
    if c.is_real() {
        let rules = r#"key "" { policy = "read" }
key "rcfarm/" { policy = "write" }
key "lock/" { policy = "write" }"#;
        let resp = crate::common::http()
            .put(format!("{}/v1/acl/create", c.server.url()))
            .header("X-Consul-Token", MASTER_TOKEN)
            .json(&serde_json::json!({"Name": "partial", "Type": "client", "Rules": rules}))
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{resp:?}");
        let token = resp.json::<serde_json::Value>().await.unwrap()["ID"]
            .as_str()
            .unwrap()
            .to_string();
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

/// A CA, and a certificate it signs for 127.0.0.1 and localhost, in `dir`.
fn make_certs(dir: &Path) -> AgentTls {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name
        .push(DnType::CommonName, "rcfarm test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate().unwrap();
    let mut server = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    server
        .distinguished_name
        .push(DnType::CommonName, "server.dc1.consul");
    server.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    server.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = server.signed_by(&key, &issuer).unwrap();

    let tls = AgentTls {
        ca_file: dir.join("ca.pem"),
        cert_file: dir.join("server.pem"),
        key_file: dir.join("server-key.pem"),
    };
    std::fs::write(&tls.ca_file, ca_cert.pem()).unwrap();
    std::fs::write(&tls.cert_file, cert.pem()).unwrap();
    std::fs::write(&tls.key_file, key.serialize_pem()).unwrap();
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
    c.wait_for(
        Duration::from_secs(30),
        "both RCs placed over HTTPS",
        || placed(&c, &ids, 2),
    )
    .await;
    assert!(
        c.farms[good].child.try_wait().unwrap().is_none(),
        "{}",
        c.farm_log(good)
    );
    c.check_invariants(|_| false);

    // rcctl too: the flag, and CONSUL_CACERT as Consul's CLI reads it.
    let rcctl = |args: &[&str], env: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rcctl"));
        cmd.args(["--consul", &https]).args(args);
        cmd.env_remove("CONSUL_CACERT");
        if let Some(ca) = env {
            cmd.env("CONSUL_CACERT", ca);
        }
        cmd.output().unwrap()
    };
    for out in [
        rcctl(&["--consul-ca-file", ca, "ping"], None),
        rcctl(&["ping"], Some(ca)),
    ] {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("is up; leader"), "{stdout}");
    }
    let out = rcctl(&["ping"], None);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid peer certificate"), "{stderr}");
    assert!(
        stderr.contains("--consul-ca-file or CONSUL_CACERT"),
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
