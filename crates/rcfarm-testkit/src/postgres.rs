//! A PostgreSQL server of a test's own, to stop and start while farms ship to it (the machine's
//! shared PostgreSQL must keep serving every other test). Made with the machine's `initdb` and
//! `pg_ctl` in a temporary directory, on a free loopback port, with trust auth; as root it runs
//! as the `postgres` user (PostgreSQL refuses to run as root).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    as_user: Option<&'static str>,
}

/// The directory of `initdb` and `pg_ctl`: `pg_config --bindir`, else the newest of Debian's
/// `/usr/lib/postgresql/<version>/bin`.
pub fn bin_dir() -> Option<PathBuf> {
    let has_tools = |d: &Path| d.join("initdb").is_file() && d.join("pg_ctl").is_file();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let d = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has_tools(&d) {
            return Some(d);
        }
    }
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, d)| has_tools(d))
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, d)| d)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl PrivatePostgres {
    /// A new, running server; `Err` says why not (no PostgreSQL tools, say), for a loud skip.
    pub fn start() -> Result<PrivatePostgres, String> {
        let bin = bin_dir().ok_or(
            "no PostgreSQL server tools (initdb, pg_ctl): install Debian's postgresql package",
        )?;
        let as_user = is_root().then_some("postgres");
        let dir = tempfile::Builder::new()
            .prefix("rcfarm-pg-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let pg = PrivatePostgres {
            dir,
            bin,
            port,
            as_user,
        };
        if let Some(user) = as_user {
            // The data directory must be the server user's, and the way to it open to it.
            run(Command::new("chmod").arg("755").arg(pg.dir.path()))?;
            std::fs::create_dir(pg.data()).map_err(|e| e.to_string())?;
            run(Command::new("chown")
                .arg("-R")
                .arg(format!("{user}:"))
                .arg(pg.dir.path()))?;
        }
        run(&mut pg.tool(
            "initdb",
            &[
                "-D",
                &pg.data().display().to_string(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        ))?;
        pg.resume()?;
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn tool(&self, name: &str, args: &[&str]) -> Command {
        let path = self.bin.join(name);
        match self.as_user {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(path).args(args);
                c
            }
            None => {
                let mut c = Command::new(path);
                c.args(args);
                c
            }
        }
    }

    /// Where farms connect (the `postgres` database).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Stops the server (fast shutdown: open connections are cut).
    pub fn stop(&self) -> Result<(), String> {
        let data = self.data().display().to_string();
        run(&mut self.tool("pg_ctl", &["-D", &data, "-m", "fast", "-w", "stop"]))
    }

    /// Starts it (again), waiting until it accepts connections.
    pub fn resume(&self) -> Result<(), String> {
        let data = self.data().display().to_string();
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("log").display().to_string();
        run(&mut self.tool(
            "pg_ctl",
            &["-D", &data, "-o", &opts, "-l", &log, "-w", "start"],
        ))
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let data = self.data().display().to_string();
        let _ = self
            .tool("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
            .output();
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
