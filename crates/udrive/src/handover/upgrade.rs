//! `udrive upgrade`: starts a new server process that takes over from the running
//! one (`serve --takeover`) and waits until the control socket is answered by it.
//! A server that runs under a service manager starts that process itself, so that
//! it stays in the service (crate::handover::successor).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct UpgradeArgs {
    /// Control socket of the running server
    #[arg(long, value_name = "SOCKET")]
    pub rpc: PathBuf,
    /// The udrive binary to run [default: this one]
    #[arg(long, value_name = "PATH")]
    pub binary: Option<PathBuf>,
    /// Where the new server's output goes [default: this command's]
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
}

fn version(rpc: &std::path::Path) -> Result<serde_json::Value> {
    crate::rpc_client::call(rpc, "get_version", json!({}), Duration::from_secs(10))
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// The pid in a `get_version` answer.
fn pid_of(v: &serde_json::Value) -> Result<u64> {
    v.get("pid")
        .and_then(|p| p.as_u64())
        .context("the running server does not report its pid (too old for `udrive upgrade`)")
}

fn server_pid(rpc: &std::path::Path) -> Result<u64> {
    pid_of(&version(rpc)?)
}

pub fn run(a: UpgradeArgs) -> Result<()> {
    let v = version(&a.rpc)?;
    if v["service_manager"] == true {
        return run_in_service(&a, &v);
    }
    let old = pid_of(&v)?;
    let binary = match a.binary {
        Some(b) => b,
        None => std::env::current_exe().context("cannot find udrive's own binary")?,
    };
    let mut cmd = Command::new(&binary);
    cmd.args(["serve", "--takeover"])
        .arg(&a.rpc)
        .stdin(Stdio::null());
    if let Some(log) = &a.log {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        cmd.stdout(f.try_clone()?).stderr(f);
    }
    // Its own process group: a Ctrl-C meant for this command must not stop it.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let t0 = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))?;
    eprintln!(
        "udrive upgrade: {} (pid {}) is taking over from pid {old}",
        binary.display(),
        child.id()
    );
    // The old process answers until it has handed over; then the new one does.
    let mut exited = None;
    let served = engine::wait_until(Duration::from_secs(180), Duration::from_millis(20), || {
        match child.try_wait() {
            Ok(Some(st)) => {
                exited = Some(st.to_string());
                return true;
            }
            Ok(None) => {}
            Err(e) => {
                exited = Some(e.to_string());
                return true;
            }
        }
        matches!(server_pid(&a.rpc), Ok(p) if p == u64::from(child.id()))
    });
    if let Some(st) = exited {
        bail!(
            "the new server exited ({st}) before taking over; pid {old} still serves{}",
            a.log
                .as_ref()
                .map(|l| format!(" (its output: {})", l.display()))
                .unwrap_or_default()
        );
    }
    if !served {
        bail!("no answer from the new server after 3 minutes");
    }
    crate::outln!(
        "udrive upgrade: pid {} serves {} ({:.0} ms); pid {old} exited",
        child.id(),
        a.rpc.display(),
        t0.elapsed().as_secs_f64() * 1e3
    )?;
    Ok(())
}

/// A server that runs as a service starts its successor itself, so that it stays
/// in the unit (crate::handover::successor); this command waits for it.
fn run_in_service(a: &UpgradeArgs, v: &serde_json::Value) -> Result<()> {
    if a.binary.is_some() || a.log.is_some() {
        bail!(
            "the server on {} runs under a service manager: it starts its successor from its own \
             path (install the new binary there) and logs where it logs; drop --binary and --log",
            a.rpc.display()
        );
    }
    let old = pid_of(v)?;
    let t0 = Instant::now();
    let r = crate::rpc_client::call(
        &a.rpc,
        "start_successor",
        json!({}),
        Duration::from_secs(10),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let pid = r["pid"]
        .as_u64()
        .context("start_successor did not say which process it started")?;
    eprintln!("udrive upgrade: the service's server (pid {old}) started pid {pid} to take over");
    let mut gone = false;
    let served = engine::wait_until(Duration::from_secs(180), Duration::from_millis(20), || {
        gone = !process_alive(pid);
        gone || matches!(server_pid(&a.rpc), Ok(p) if p == pid)
    });
    if gone || !served {
        bail!(
            "pid {pid} did not take over ({}); pid {old} still serves: see the service's log",
            if gone {
                "it exited"
            } else {
                "no answer after 3 minutes"
            }
        );
    }
    crate::outln!(
        "udrive upgrade: pid {pid} serves {} ({:.0} ms); pid {old} exited",
        a.rpc.display(),
        t0.elapsed().as_secs_f64() * 1e3
    )?;
    Ok(())
}

/// Whether `pid` runs (a zombie, exited but not yet reaped by its parent, does not).
fn process_alive(pid: u64) -> bool {
    i32::try_from(pid)
        .ok()
        .and_then(super::give::proc_stat)
        .is_some_and(|(state, _)| state != 'Z')
}
