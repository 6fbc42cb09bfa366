//! The `rbd` backend's Ceph cluster: the one `--rbd-conf` (or `[rbd] conf`) names,
//! or, with `[rbd] throwaway = true`, one the harness starts for the matrix and
//! purges after it (scripts/ceph-cluster: one mon and one OSD on memstore, on
//! 127.0.0.1, cephx on). Either way the cluster's daemons on this host are the
//! `cluster` role of the CPU accounting.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::matrix::{Backend, Matrix};
use super::process::which;

/// The cluster script: `UDRIVE_CEPH_CLUSTER`, else this source tree's.
fn script() -> PathBuf {
    std::env::var_os("UDRIVE_CEPH_CLUSTER").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster"),
        PathBuf::from,
    )
}

/// Why no throwaway cluster can start here.
pub fn probe() -> Result<(), String> {
    for tool in ["ceph-mon", "ceph-osd", "ceph-authtool", "monmaptool", "rbd"] {
        if which(tool).is_none() {
            return Err(format!(
                "no throwaway Ceph cluster: {tool} is not in PATH (scripts/ensure-ceph.sh \
                 installs Debian's Ceph), or give --rbd-conf PATH"
            ));
        }
    }
    let s = script();
    if !s.is_file() {
        return Err(format!(
            "no throwaway Ceph cluster: no {} (set UDRIVE_CEPH_CLUSTER to scripts/ceph-cluster \
             of a udrive tree), or give --rbd-conf PATH",
            s.display()
        ));
    }
    Ok(())
}

/// A cluster started for one matrix; stopped and deleted when dropped.
pub struct Throwaway {
    dir: PathBuf,
}

impl Throwaway {
    /// Starts one in `dir` (made; it must not hold another cluster) if the matrix
    /// runs the `rbd` backend, asks for one and names no other: the matrix then
    /// names its conf. None if it need not or cannot start (the backend is then
    /// skipped with [`probe`]'s reason).
    pub fn start_for(m: &mut Matrix, dir: &Path) -> Result<Option<Throwaway>> {
        if !m.backends.contains(&Backend::Rbd)
            || m.rbd.conf.is_some()
            || !m.rbd.throwaway
            || probe().is_err()
        {
            return Ok(None);
        }
        eprintln!(
            "udrive bench: starting a throwaway Ceph cluster in {} ...",
            dir.display()
        );
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        let _ = std::fs::remove_dir_all(dir);
        let out = Command::new(script())
            .arg("start")
            .arg(dir)
            .stdin(std::process::Stdio::null())
            .output()
            .context("running scripts/ceph-cluster")?;
        // From here on a failure still stops what the script started.
        let c = Throwaway {
            dir: dir.to_path_buf(),
        };
        if !out.status.success() {
            let log = String::from_utf8_lossy(&out.stderr);
            bail!(
                "the throwaway Ceph cluster did not start ({}): {}",
                out.status,
                super::process::tail(&log)
            );
        }
        m.rbd.conf = Some(c.conf().display().to_string());
        Ok(Some(c))
    }

    pub fn conf(&self) -> PathBuf {
        self.dir.join("ceph.conf")
    }

    /// Its mon's and OSD's pids.
    pub fn daemons(&self) -> Vec<u32> {
        ["mon.a", "osd.0"]
            .iter()
            .filter_map(|d| {
                let p = self.dir.join("run").join(format!("{d}.pid"));
                std::fs::read_to_string(p).ok()?.trim().parse().ok()
            })
            .collect()
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .arg("stop")
            .arg(&self.dir)
            .arg("--purge")
            .stdin(std::process::Stdio::null())
            .output();
    }
}

/// The Ceph daemons running on this host (`ceph-osd`, `ceph-mon`, `ceph-mgr`, ...):
/// the cluster a `--rbd-conf` names, where it runs here.
pub fn host_daemons() -> Vec<u32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            comm.starts_with("ceph-").then_some(pid)
        })
        .collect()
}
