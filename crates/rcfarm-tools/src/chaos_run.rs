//! `rcfarm-tools chaos`: three farms crashed, stalled and restarted while RCs and node labels change,
//! with every committed write checked. Exits 1 when a promise was broken.

use std::path::PathBuf;
use std::time::Duration;

use crate::chaos::{ChaosConfig, ChaosConsul, proxy::ProxyFaults};
use crate::{CliError, parse_duration_flag};

#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// How long to inject faults and mutations; convergence is checked afterwards.
    #[arg(long, default_value = "60s", value_parser = parse_duration_flag)]
    pub duration: Duration,
    #[arg(long, default_value_t = 3)]
    pub farms: usize,
    #[arg(long, default_value_t = 12)]
    pub nodes: usize,
    #[arg(long, default_value_t = 15)]
    pub rcs: usize,
    /// Session TTL of the farms; SIGSTOP lasts 2.5×TTL.
    #[arg(long, default_value = "2s", value_parser = parse_duration_flag)]
    pub session_ttl: Duration,
    /// Seed of the fault and mutation choices (the same seed picks the same sequence).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Put the first farm behind a proxy that delays requests by up to 200 ms and cuts 1% of
    /// connections mid-request.
    #[arg(long)]
    pub proxy: bool,
    /// Farm logs and the audit database go here (default: a new temporary directory, kept).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// The `rcfarm` to run farms with (default: the one beside `rcfarm-tools`).
    #[arg(long)]
    pub farm_binary: Option<PathBuf>,
    /// Run against real Consul started from this binary (e.g. ../shared/consul/consul)
    /// instead of the embedded server.
    #[arg(long, value_name = "PATH")]
    pub consul_bin: Option<PathBuf>,
    /// With --consul-bin: 1 runs a dev agent; 3 or more run a cluster of that many servers and
    /// a client agent per farm, and the chaos faults the servers too (the leader included).
    #[arg(long, default_value_t = 1, requires = "consul_bin")]
    pub consul_servers: usize,
    /// Leave the farms alone (fault only Consul servers).
    #[arg(long, conflicts_with = "faults")]
    pub no_farm_faults: bool,
    /// Leave the Consul servers alone.
    #[arg(long, conflicts_with = "faults")]
    pub no_consul_faults: bool,
    /// With --consul-servers 3 or more: also cut the network between Consul agents (each on
    /// an address of its own in 127.0.0.0/8, partitioned by nftables rules; needs root and
    /// `nft`): the leader cut off, one server, a farm's agent, one-way links, bridges, flapping.
    #[arg(long, conflicts_with = "faults")]
    pub partitions: bool,
    /// Which faults to inject, instead of the default mix: a comma-separated list of
    /// `farms` (kill, stop, terminate, restart), `servers` (Consul servers killed, stopped,
    /// restarted), `partitions` (see --partitions), `clock` (a farm's wall clock stepped an
    /// hour forward or back, or run 10 % fast, with libfaketime; its monotonic clock untouched)
    /// `audit-db` (the farms ship to a PostgreSQL of the run's own, stopped for 5–20 s or
    /// slowed now and then; needs PostgreSQL's server tools) and `restore` (with
    /// --consul-servers 3 or more: every server stopped and its data copied, and later every
    /// server put back to that copy, once per 4 minutes of run: the store goes back in time).
    #[arg(long, value_name = "KINDS", value_delimiter = ',')]
    pub faults: Option<Vec<String>>,
    /// Run the farms on their default failsafe (20 % of what each serves, at least 5, per 5
    /// minutes; the tripwire on), as a new user runs them, instead of the run's quick one (8
    /// removals per 10 s, tripwire off): the observer checks the default blast radius, and
    /// after the faults the run releases held removals as an operator would.
    #[arg(long)]
    pub default_failsafe: bool,
    /// Change nothing (no RC, node or roll changes): faults only, to count handovers.
    #[arg(long)]
    pub no_mutations: bool,
}

pub async fn run(args: ChaosArgs) -> Result<(), CliError> {
    if args.farms < 2 {
        return Err(CliError::Usage(
            "--farms must be at least 2: the chaos needs a farm to take over from another".into(),
        ));
    }
    if args.nodes == 0 || args.rcs == 0 {
        return Err(CliError::Usage(
            "--nodes and --rcs must be at least 1".into(),
        ));
    }
    if args.session_ttl < Duration::from_secs(1) {
        return Err(CliError::Usage(
            "--session-ttl must be at least 1s (Consul's minimum is 10s; the embedded server allows 1s for tests)".into(),
        ));
    }
    if args.consul_servers == 2 || args.consul_servers == 0 {
        return Err(CliError::Usage(format!(
            "--consul-servers {}: use 1 (a dev agent) or 3 or more (a cluster that keeps a quorum while one server is faulted)",
            args.consul_servers
        )));
    }
    let kinds = FaultKinds::from_args(&args)?;
    if kinds.restore && (args.consul_bin.is_none() || args.consul_servers < 3) {
        return Err(CliError::Usage(
            "restore puts every server of a real Consul cluster back to a backup of its data: add --consul-bin PATH --consul-servers 3".into(),
        ));
    }
    if kinds.partitions && (args.consul_bin.is_none() || args.consul_servers < 3) {
        return Err(CliError::Usage(
            "partitions cut the network between the agents of a real Consul cluster: add --consul-bin PATH --consul-servers 3".into(),
        ));
    }
    if kinds.partitions
        && let Err(why) = crate::chaos::partition::available()
    {
        return Err(CliError::Usage(format!(
            "partitions are not possible here: {why}"
        )));
    }
    if !kinds.farms
        && !kinds.partitions
        && !kinds.restore
        && (!kinds.servers || args.consul_servers < 3)
    {
        return Err(CliError::Usage(
            "nothing to fault: without farm faults, run a cluster (--consul-bin PATH --consul-servers 3) and fault its servers or its network (--faults servers,partitions)".into(),
        ));
    }
    let consul = match &args.consul_bin {
        None => ChaosConsul::Embedded,
        Some(bin) => {
            if !bin.is_file() {
                return Err(CliError::Usage(format!(
                    "--consul-bin {}: no such file (point it at a Consul binary, e.g. ../shared/consul/consul)",
                    bin.display()
                )));
            }
            let bin = bin
                .canonicalize()
                .map_err(|e| CliError::Failed(format!("{}: {e}", bin.display())))?;
            if args.consul_servers == 1 {
                ChaosConsul::Agent(bin)
            } else {
                ChaosConsul::Cluster {
                    bin,
                    servers: args.consul_servers,
                    partitions: kinds.partitions,
                }
            }
        }
    };
    let farm_binary = match args.farm_binary {
        Some(p) => p,
        None => crate::rcfarm_beside(" or pass --farm-binary PATH")?,
    };
    let log_dir = match args.log_dir {
        Some(d) => {
            std::fs::create_dir_all(&d)
                .map_err(|e| CliError::Failed(format!("{}: {e}", d.display())))?;
            d.canonicalize()
                .map_err(|e| CliError::Failed(format!("{}: {e}", d.display())))?
        }
        None => tempfile::Builder::new()
            .prefix("rcfarm-chaos-")
            .tempdir()
            .map_err(|e| CliError::Failed(e.to_string()))?
            .keep(),
    };
    let seed = args.seed.unwrap_or_else(rand::random);
    let proxy = args.proxy.then_some(ProxyFaults {
        max_delay: Duration::from_millis(200),
        drop_per_mille: 10,
    });
    println!(
        "chaos: {} farms, {} nodes, {} RCs, TTL {:?}, seed {seed}, for {:?} on {}{}; logs in {}",
        args.farms,
        args.nodes,
        args.rcs,
        args.session_ttl,
        args.duration,
        match &consul {
            ChaosConsul::Embedded => "the embedded server".to_string(),
            ChaosConsul::Agent(b) => format!("a real Consul agent ({})", b.display()),
            ChaosConsul::Cluster {
                servers,
                partitions,
                ..
            } => format!(
                "a real Consul cluster of {servers} servers{}",
                if *partitions {
                    ", partitioned now and then"
                } else {
                    ""
                }
            ),
        },
        if proxy.is_some() {
            ", farm 0 behind a faulty proxy"
        } else {
            ""
        },
        log_dir.display()
    );
    let report = crate::chaos::run(ChaosConfig {
        farm_binary,
        duration: args.duration,
        farms: args.farms,
        nodes: args.nodes,
        rcs: args.rcs,
        session_ttl: args.session_ttl,
        seed,
        // On the default failsafe, removals wait for the run's releases (every 5 s) when a
        // farm has more to remove than its budget allows.
        settle_margin: Duration::from_secs(if args.default_failsafe { 30 } else { 10 }),
        proxy,
        log_dir,
        consul,
        farm_faults: kinds.farms,
        consul_faults: kinds.servers,
        partition_faults: kinds.partitions,
        clock_faults: kinds.clock,
        audit_db_faults: kinds.audit_db,
        restore_faults: kinds.restore,
        default_failsafe: args.default_failsafe,
        mutations: !args.no_mutations,
    })
    .await
    .map_err(CliError::Failed)?;
    print!("{}", report.summary());
    if report.ok() {
        println!("result: OK");
        Ok(())
    } else {
        Err(CliError::Failed("result: FAILED (see above)".into()))
    }
}

/// Which faults a run injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FaultKinds {
    farms: bool,
    servers: bool,
    partitions: bool,
    clock: bool,
    audit_db: bool,
    restore: bool,
}

impl FaultKinds {
    fn from_args(args: &ChaosArgs) -> Result<FaultKinds, CliError> {
        let Some(list) = &args.faults else {
            return Ok(FaultKinds {
                farms: !args.no_farm_faults,
                servers: !args.no_consul_faults,
                partitions: args.partitions,
                clock: false,
                audit_db: false,
                restore: false,
            });
        };
        let mut k = FaultKinds {
            farms: false,
            servers: false,
            partitions: false,
            clock: false,
            audit_db: false,
            restore: false,
        };
        for kind in list.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
            match kind {
                "farms" => k.farms = true,
                "servers" => k.servers = true,
                "partitions" => k.partitions = true,
                "clock" => k.clock = true,
                "audit-db" => k.audit_db = true,
                "restore" => k.restore = true,
                other => {
                    return Err(CliError::Usage(format!(
                        "--faults {other}: no such fault kind; use a comma-separated list of farms, servers, partitions, clock, audit-db, restore (e.g. --faults partitions,clock)"
                    )));
                }
            }
        }
        if !(k.farms || k.servers || k.partitions || k.clock || k.audit_db || k.restore) {
            return Err(CliError::Usage(
                "--faults needs at least one kind: farms, servers, partitions, clock, audit-db, restore"
                    .into(),
            ));
        }
        Ok(k)
    }
}
