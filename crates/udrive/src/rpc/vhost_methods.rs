//! vhost-user-blk methods (docs/rpc.md): `vhost_user_blk_add`, `vhost_user_blk_remove`,
//! `set_poll_mode`.
//! A device added here goes through the same construction as one from the command
//! line or the TOML config (`Server::add_vhost_blk` -> `vhost_device::start`).

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;

use super::api::{parse_params, Registry, RpcError};
use crate::config::VhostBlkConfig;
use crate::nsspec::NsSpec;

pub fn register(r: &mut Registry) {
    r.register(
        "vhost_user_blk_add",
        "start a virtio-blk device on a new vhost-user socket",
        |rpc, p| {
            let cfg = parse_params::<AddVhostBlk>(p)?.into_config()?;
            let socket = cfg.socket.clone();
            rpc.server.add_vhost_blk(cfg)?;
            super::params::device_json_by_socket(&rpc.server, &socket)
        },
    );
    r.register(
        "vhost_user_blk_remove",
        "stop a vhost-user-blk device (error if a front end is connected, unless force)",
        |rpc, p| {
            let a: RemoveVhostBlk = parse_params(p)?;
            rpc.server
                .remove_device_of(&a.socket, Some("vhost-user-blk"), a.force)?;
            Ok(Value::Bool(true))
        },
    );
    r.register(
        "set_poll_mode",
        "how a vhost-user-blk device's queues wait for work (busy, adaptive or event), applied at once",
        |rpc, p| {
            let a: SetPollMode = parse_params(p)?;
            rpc.server.set_poll_mode(&a.socket, a.mode)?;
            Ok(Value::Bool(true))
        },
    );
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetPollMode {
    socket: PathBuf,
    #[serde(with = "crate::serde_str")]
    mode: engine::PollMode,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddVhostBlk {
    socket: PathBuf,
    /// As `--disk`: `ram:1G`, `file:/img,offset=1G,size=8G`, ...
    disk: String,
    queues: Option<u16>,
    queue_size: Option<u16>,
    #[serde(default, with = "crate::serde_str::opt")]
    placement: Option<engine::Placement>,
    #[serde(default, alias = "poll", with = "crate::serde_str::opt")]
    poll_mode: Option<engine::PollMode>,
    cpus: Option<String>,
    serial: Option<String>,
    socket_mode: Option<String>,
    socket_group: Option<String>,
    /// Same as `,ro` in `disk`.
    #[serde(default)]
    read_only: bool,
}

impl AddVhostBlk {
    /// The device's configuration, checked as the TOML config is (-32602 if not).
    fn into_config(self) -> Result<VhostBlkConfig, RpcError> {
        let mut spec = self.disk;
        if self.read_only {
            spec.push_str(",ro");
        }
        let disk: NsSpec = spec
            .parse()
            .map_err(|e| RpcError::params(format!("disk: {e}")))?;
        let mut c = VhostBlkConfig::new(self.socket, disk);
        if let Some(q) = self.queues {
            c.queues = q;
        }
        if let Some(q) = self.queue_size {
            c.queue_size = q;
        }
        if let Some(p) = self.placement {
            c.placement = p;
        }
        if let Some(p) = self.poll_mode {
            c.poll = p;
        }
        c.cpus = self.cpus;
        c.serial = self.serial;
        c.socket_mode = self.socket_mode;
        c.socket_group = self.socket_group;
        crate::config::validate(std::slice::from_ref(&c), &mut Default::default())
            .map_err(|e| RpcError::params(format!("{e:#}")))?;
        Ok(c)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveVhostBlk {
    socket: PathBuf,
    #[serde(default)]
    force: bool,
}
