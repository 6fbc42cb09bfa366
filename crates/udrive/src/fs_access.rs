//! Landlock for the server (sandbox::restrict_files): the paths a
//! configuration names, the operator's `--allow-dir` directories, and the
//! check that gives a device added later over RPC a clear error when its file
//! lies outside them.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::Result;

use crate::config::Config;
use crate::kinds::dir_of;
use crate::nsspec::NsSpec;

pub use crate::fs_allowed::check_paths;

/// `--allow-dir` as given: what a handover passes on.
static ALLOWED_DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();

/// The operator's `--allow-dir` directories of this server.
pub fn allowed_dirs() -> Vec<PathBuf> {
    ALLOWED_DIRS.get().cloned().unwrap_or_default()
}

/// For a device socket created while the server runs: its directory must be
/// one the server may write to.
pub fn check_socket(socket: &Path) -> Result<()> {
    check_paths(vec![(dir_of(socket), true)])
        .map_err(|e| anyhow::anyhow!("socket {}: {e}", socket.display()))
}

/// Where a namespace's backend reads and writes, with its key file.
fn ns_paths(ns: &NsSpec) -> Vec<(PathBuf, bool)> {
    let mut v = ns.kind.0.fs_paths();
    if let Some(path) = ns.encrypt.as_ref().and_then(|e| e.key.file()) {
        v.push((path.to_path_buf(), false));
    }
    v
}

/// What `cfg` and `allow_dirs` let the server open after start-up.
pub fn rules(cfg: &Config, allow_dirs: &[PathBuf]) -> sandbox::FsRules {
    let mut rules = sandbox::FsRules::default();
    let sockets = cfg.controllers.iter().map(|c| &c.socket);
    let sockets = sockets.chain(cfg.vhost_user_blk.iter().map(|d| &d.socket));
    rules
        .read_write
        .extend(sockets.chain(cfg.rpc.iter()).map(|s| dir_of(s)));
    let namespaces = cfg.controllers.iter().flat_map(|c| c.namespaces.iter());
    for ns in namespaces.chain(cfg.vhost_user_blk.iter().map(|d| &d.disk)) {
        for (path, write) in ns_paths(ns) {
            match write {
                true => rules.read_write.push(path),
                false => rules.read_only.push(path),
            }
        }
    }
    rules.read_only.extend(cfg.file.iter().cloned());
    rules.read_write.extend(allow_dirs.iter().cloned());
    rules
}

/// Restricts the calling thread and every thread it starts to `rules` (Landlock,
/// best effort), and logs how much the kernel enforces.
pub fn restrict(rules: sandbox::FsRules, allow_dirs: Vec<PathBuf>) -> Result<()> {
    let enforced = sandbox::restrict_files(&rules).map_err(|e| {
        anyhow::anyhow!("cannot set up Landlock ({e}); --landlock off runs without")
    })?;
    match enforced {
        sandbox::Enforced::Fully => tracing::info!(
            dirs = rules.read_write.len(),
            "Landlock: files only beneath the configured paths and --allow-dir"
        ),
        sandbox::Enforced::Partially => tracing::warn!(
            "Landlock: this kernel's Landlock is older than udrive's; some kinds of file access stay unrestricted"
        ),
        sandbox::Enforced::Not => {
            tracing::warn!("Landlock: not available in this kernel; file access is not restricted");
            return Ok(());
        }
    }
    let system = sandbox::SYSTEM_READ_ONLY.iter().map(PathBuf::from);
    crate::fs_allowed::set(
        rules.read_only.into_iter().chain(system).collect(),
        rules.read_write,
    );
    let _ = ALLOWED_DIRS.set(allow_dirs);
    Ok(())
}

/// For a device added while the server runs: every path its backend writes
/// must lie beneath what the server may write, else a clear error (the kernel
/// would refuse with a bare "permission denied").
pub fn check_ns(ns: &NsSpec) -> Result<()> {
    check_paths(ns_paths(ns))
}
