//! The `[[vhost_user_blk]]` table: one vhost-user-blk device each.

use std::collections::HashSet;
use std::path::PathBuf;

use anyhow::Result;
use engine::{Placement, PollMode};
use serde::{Deserialize, Serialize};

use crate::nsspec::NsSpec;

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VhostBlkConfig {
    pub socket: PathBuf,
    pub disk: NsSpec,
    #[serde(default = "default_queues")]
    pub queues: u16,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    #[serde(default, with = "crate::serde_str")]
    pub placement: Placement,
    #[serde(default, with = "crate::serde_str")]
    pub poll: PollMode,
    /// CPUs for `dedicated` reactors; queue i gets the i-th (cycled). Default: the
    /// CPUs of the shared reactors (`cpus` at the top level).
    #[serde(default)]
    pub cpus: Option<String>,
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(default)]
    pub socket_mode: Option<String>,
    #[serde(default)]
    pub socket_group: Option<String>,
}

pub fn default_queues() -> u16 {
    1
}
fn default_queue_size() -> u16 {
    256
}

impl VhostBlkConfig {
    pub fn new(socket: PathBuf, disk: NsSpec) -> Self {
        VhostBlkConfig {
            socket,
            disk,
            queues: default_queues(),
            queue_size: default_queue_size(),
            placement: Placement::RoundRobin,
            poll: PollMode::default(),
            cpus: None,
            serial: None,
            socket_mode: None,
            socket_group: None,
        }
    }

    /// Who may connect to its socket.
    pub fn socket_perms(&self) -> super::SocketPerms {
        super::SocketPerms {
            socket_mode: self.socket_mode.clone(),
            socket_group: self.socket_group.clone(),
        }
    }

    pub fn set_socket_perms(&mut self, p: super::SocketPerms) {
        self.socket_mode = p.socket_mode;
        self.socket_group = p.socket_group;
    }

    pub fn what(&self) -> String {
        format!("vhost-user-blk device {}", self.socket.display())
    }

    /// GET_ID answer: given, or derived from the socket's file name.
    pub fn serial(&self) -> String {
        super::serial_for(self.serial.as_deref(), &self.socket)
    }
}

/// Checks the `[[vhost_user_blk]]` entries; `sockets` holds the sockets already used.
pub fn validate(devs: &[VhostBlkConfig], sockets: &mut HashSet<PathBuf>) -> Result<()> {
    super::Problems::result(problems(devs, sockets))
}

/// What [`validate`] finds wrong, every problem of every device.
pub fn problems(devs: &[VhostBlkConfig], sockets: &mut HashSet<PathBuf>) -> Vec<String> {
    let mut p = Vec::new();
    for d in devs {
        let what = d.what();
        if !sockets.insert(d.socket.clone()) {
            p.push(format!(
                "socket {} is used by two devices",
                d.socket.display()
            ));
        }
        if d.queues == 0 || d.queues > 64 {
            p.push(format!("{what}: queues must be 1..=64, not {}", d.queues));
        }
        if !d.queue_size.is_power_of_two() || !(16..=1024).contains(&d.queue_size) {
            p.push(format!(
                "{what}: queue_size must be a power of two in 16..=1024, not {}",
                d.queue_size
            ));
        }
        if let Some(Err(e)) = d.cpus.as_deref().map(engine::parse_cpu_list) {
            p.push(format!("{what}: cpus: {e}"));
        }
        if let Err(e) = d.socket_perms().access() {
            p.push(format!("{what}: {e:#}"));
        }
        p.extend(super::socket_dir_problem(&what, &d.socket));
    }
    p
}

/// The vhost-user-blk disks of `cfg` as `(socket, spec)`, for opening with the
/// NVMe namespaces (shared files, overlap checks across both kinds).
pub fn disk_specs(cfg: &super::Config) -> Vec<(PathBuf, &NsSpec)> {
    cfg.vhost_user_blk
        .iter()
        .map(|d| (d.socket.clone(), &d.disk))
        .collect()
}
