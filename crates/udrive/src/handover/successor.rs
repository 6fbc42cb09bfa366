//! A successor started by the running server itself (`start_successor`), for a
//! server that runs as a systemd service: a process the server forks stays in the
//! service's cgroup with its user, sandbox and `NOTIFY_SOCKET`, so the service
//! manager sees one service before and after the handover. The successor names
//! itself the main process before it confirms (crate::systemd::main_pid), so the
//! old process's exit ends nothing.
//!
//! The binary is the server's own path: what a package upgrade replaced. A client
//! cannot name another one; it is the server's user already, but an exec of its
//! choice would still be one thing more it could do.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

/// The path this process was started from, also after a package upgrade replaced
/// the file (the kernel then names it "PATH (deleted)").
pub fn own_binary() -> Result<PathBuf> {
    let exe = std::fs::read_link("/proc/self/exe").context("cannot read /proc/self/exe")?;
    let text = exe.to_string_lossy();
    Ok(match text.strip_suffix(" (deleted)") {
        Some(p) => PathBuf::from(p),
        None => exe,
    })
}

/// Whether a service manager started this process (`Type=notify` units).
pub fn under_service_manager() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// Starts `serve --takeover RPC` from the server's own binary; returns its pid.
/// Its output goes where the server's goes (the journal under systemd).
pub fn start(rpc: &Path) -> Result<u32> {
    let binary = own_binary()?;
    let mut cmd = Command::new(&binary);
    cmd.args(["serve", "--takeover"])
        .arg(rpc)
        .stdin(Stdio::null());
    // Its own process group: a signal meant for this process group must not reach it.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))?;
    let pid = child.id();
    tracing::info!(pid, binary = %binary.display(), "started a successor to take over");
    // Reaped here if it fails; on success this process exits first and the
    // successor carries on as the service's main process.
    sandbox::spawn(
        sandbox::Role::Control,
        "successor-wait".into(),
        move || match child.wait() {
            Ok(st) => tracing::warn!(pid, "the successor exited ({st}) before taking over"),
            Err(e) => tracing::warn!(pid, "cannot wait for the successor: {e}"),
        },
    )
    .context("cannot start the thread that waits for the successor")?;
    Ok(pid)
}
