//! `udrive upgrade`: starts a new server process that takes over from the running
//! one (`serve --takeover`) and waits until the control socket is answered by it.

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

fn server_pid(rpc: &std::path::Path) -> Result<u64> {
    let v = crate::rpc_client::call(rpc, "get_version", json!({}), Duration::from_secs(10))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    v.get("pid")
        .and_then(|p| p.as_u64())
        .context("the running server does not report its pid (too old for `udrive upgrade`)")
}

pub fn run(a: UpgradeArgs) -> Result<()> {
    let old = server_pid(&a.rpc)?;
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
