//! The running server's configuration as a handover passes it on: what it was
//! started with plus every change made over the control socket since (devices and
//! namespaces added or removed, QoS, placement, poll modes).

use std::path::PathBuf;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::config::{Config, ControllerConfig, VhostBlkConfig};
use crate::jobs::handover::{ActiveImage, JobRecord};
use crate::server::{Server, State};

/// Bumped when a field changes meaning; a process refuses a version it does not know.
/// 2: running jobs and the images disks serve instead of their spec's (a process
/// that knows only 1 would drop them). A snapshot without either says 1, so
/// that such a process can still take it over.
pub const VERSION: u32 = 2;

#[derive(Debug, Serialize, Deserialize)]
pub struct ServerSnapshot {
    pub version: u32,
    pub cpus: String,
    /// Absent in a snapshot from a udrive before `--rbd-cpus`: the default.
    #[serde(default)]
    pub rbd_cpus: Option<String>,
    pub rpc: Option<PathBuf>,
    pub metrics_listen: Option<std::net::SocketAddr>,
    pub socket_mode: Option<String>,
    pub socket_group: Option<String>,
    pub controllers: Vec<ControllerConfig>,
    pub vhost_user_blk: Vec<VhostBlkConfig>,
    /// Limits set at run time, per device socket and namespace (vhost: nsid 1).
    pub qos: Vec<QosEntry>,
    /// The configuration file reloads re-read (absent: none, or an older udrive).
    #[serde(default)]
    pub config_file: Option<PathBuf>,
    /// `--allow-dir` (absent: none, or an older udrive).
    #[serde(default)]
    pub allow_dirs: Vec<PathBuf>,
    /// Disks whose chain changed: the image each serves (version 2).
    #[serde(default)]
    pub active_images: Vec<ActiveImage>,
    /// Block jobs, running, paused and finished (version 2 when any runs).
    #[serde(default)]
    pub jobs: Vec<JobRecord>,
    /// The id the last job got (later jobs count on from it).
    #[serde(default)]
    pub last_job_id: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct QosEntry {
    pub socket: PathBuf,
    pub nsid: u32,
    pub iops: Option<u64>,
    pub read_iops: Option<u64>,
    pub write_iops: Option<u64>,
    pub bw_bytes: Option<u64>,
    pub read_bw: Option<u64>,
    pub write_bw: Option<u64>,
}

impl QosEntry {
    fn new(socket: PathBuf, nsid: u32, l: bdev::QosLimits) -> QosEntry {
        QosEntry {
            socket,
            nsid,
            iops: l.iops,
            read_iops: l.read_iops,
            write_iops: l.write_iops,
            bw_bytes: l.bw_bytes,
            read_bw: l.read_bw,
            write_bw: l.write_bw,
        }
    }

    pub fn limits(&self) -> bdev::QosLimits {
        bdev::QosLimits {
            iops: self.iops,
            read_iops: self.read_iops,
            write_iops: self.write_iops,
            bw_bytes: self.bw_bytes,
            read_bw: self.read_bw,
            write_bw: self.write_bw,
        }
    }
}

impl ServerSnapshot {
    /// The server as it runs now (`st`: its locked state).
    pub fn of(server: &Server, st: &State) -> Self {
        let defaults = server.socket_defaults();
        let mut snap = ServerSnapshot {
            version: VERSION,
            cpus: server.cpus.clone(),
            rbd_cpus: server.rbd_cpus.clone(),
            rpc: server.rpc.clone(),
            metrics_listen: server.metrics_listen,
            socket_mode: defaults.socket_mode.clone(),
            socket_group: defaults.socket_group.clone(),
            controllers: Vec::new(),
            vhost_user_blk: Vec::new(),
            qos: Vec::new(),
            config_file: server.config_file.clone(),
            allow_dirs: crate::fs_access::allowed_dirs(),
            active_images: crate::jobs::handover::active_images(st),
            jobs: st.jobs.records(),
            last_job_id: st.jobs.last_id(),
        };
        let running = |j: &JobRecord| j.state == "running" || j.state == "paused";
        if snap.active_images.is_empty() && !snap.jobs.iter().any(running) {
            snap.version = 1;
        }
        for d in &st.devices {
            if let Some(n) = d.as_nvme() {
                let mut cfg = n.cfg.clone();
                let namespaces = n.namespaces();
                cfg.namespaces = namespaces.iter().map(|(_, ns)| ns.spec.clone()).collect();
                cfg.nsids = Some(namespaces.iter().map(|(id, _)| *id).collect());
                for (id, ns) in &namespaces {
                    let l = ns.qos.limits();
                    if l != bdev::QosLimits::default() {
                        snap.qos.push(QosEntry::new(n.socket.clone(), *id, l));
                    }
                }
                snap.controllers.push(cfg);
            } else if let Some(v) = d.as_vhost() {
                let l = v.disk.limits();
                if l != bdev::QosLimits::default() {
                    snap.qos.push(QosEntry::new(v.cfg.socket.clone(), 1, l));
                }
                snap.vhost_user_blk.push(v.cfg.clone());
            }
        }
        snap
    }

    /// The configuration to start from (validated like any).
    pub fn config(&self) -> Result<Config> {
        if !(1..=VERSION).contains(&self.version) {
            bail!(
                "the running udrive speaks handover version {}, this one {VERSION}",
                self.version
            );
        }
        let cfg = Config {
            cpus: self.cpus.clone(),
            rbd_cpus: self.rbd_cpus.clone(),
            rpc: self.rpc.clone(),
            metrics_listen: self.metrics_listen,
            controllers: self.controllers.clone(),
            vhost_user_blk: self.vhost_user_blk.clone(),
            socket_mode: self.socket_mode.clone(),
            socket_group: self.socket_group.clone(),
            allow_dirs: self.allow_dirs.clone(),
            file: self.config_file.clone(),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
