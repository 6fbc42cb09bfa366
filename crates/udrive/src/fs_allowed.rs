//! What the server's Landlock rules let it open, once restricted, and the
//! check that says so by name: a leaf module, so that backends can explain a
//! refused path without importing the configuration
//! ([`crate::fs_access`] sets it up).

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{bail, Result};

/// The directories and files the server may write beneath, once restricted.
static WRITABLE: OnceLock<Vec<PathBuf>> = OnceLock::new();
/// Where it may read (besides beneath `WRITABLE`).
static READABLE: OnceLock<Vec<PathBuf>> = OnceLock::new();

/// Records what Landlock enforces from here (once).
pub fn set(readable: Vec<PathBuf>, writable: Vec<PathBuf>) {
    let _ = READABLE.set(readable);
    let _ = WRITABLE.set(writable);
}

/// For the paths `(path, writes)` a client names (a namespace's files, a Ceph
/// configuration, an image's backing file): each must lie beneath what the
/// server may open, else a clear error (the kernel would refuse with a bare
/// "permission denied").
pub fn check_paths(paths: Vec<(PathBuf, bool)>) -> Result<()> {
    let Some(writable) = WRITABLE.get() else {
        return Ok(());
    };
    let readable = READABLE.get().map_or(&[][..], Vec::as_slice);
    for (path, write) in paths {
        // Read-only: the files named (a key file, Ceph's configuration and
        // keyring), not the directories searched.
        if !write && !path.is_file() {
            continue;
        }
        let path = std::fs::canonicalize(&path).unwrap_or(path);
        let beneath = |dirs: &[PathBuf]| dirs.iter().any(|d| path.starts_with(d));
        if !beneath(writable) && (write || !beneath(readable)) {
            bail!(
                "{} is outside the directories this server may open (Landlock): start it \
                 with --allow-dir for that directory (allow_dirs in the TOML file)",
                path.display()
            );
        }
    }
    Ok(())
}
