//! The server configuration: from the command line or a TOML file.
//!
//! ```toml
//! cpus = "0-1"                 # reactor CPUs (one reactor per CPU)
//!
//! [[controller]]
//! socket = "/run/udrive/vm1.sock"
//! namespaces = ["ram:1G", "null:64G,bs=4096"]
//! serial = "vm1-disk"          # optional; default derived from the socket
//! placement = "round-robin"    # or "single"
//! io_queues = 32               # I/O queue pairs the controller offers
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::nsspec::NsSpec;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_cpus")]
    pub cpus: String,
    #[serde(default, rename = "controller")]
    pub controllers: Vec<ControllerConfig>,
    #[serde(default)]
    pub vhost_user_blk: Vec<crate::vhost_device::VhostBlkConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerConfig {
    pub socket: PathBuf,
    pub namespaces: Vec<NsSpec>,
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(default = "default_placement")]
    pub placement: String,
    #[serde(default = "default_io_queues")]
    pub io_queues: u16,
}

pub fn default_cpus() -> String {
    "0".into()
}
fn default_placement() -> String {
    "round-robin".into()
}
pub fn default_io_queues() -> u16 {
    32
}

impl ControllerConfig {
    pub fn new(socket: PathBuf, namespaces: Vec<NsSpec>) -> Self {
        ControllerConfig {
            socket,
            namespaces,
            serial: None,
            placement: default_placement(),
            io_queues: default_io_queues(),
        }
    }

    /// Serial number: given, or derived from the socket's file name.
    pub fn serial(&self) -> String {
        let s = self.serial.clone().unwrap_or_else(|| {
            let stem = self
                .socket
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            format!("UD-{stem}")
        });
        s.chars()
            .filter(|c| c.is_ascii_graphic())
            .take(20)
            .collect()
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        let cfg: Config = toml::from_str(&text)
            .with_context(|| format!("config file {} is not valid", path.display()))?;
        Ok(cfg)
    }

    /// Checks what can be checked before anything is created.
    pub fn validate(&self) -> Result<()> {
        engine::parse_cpu_list(&self.cpus).map_err(anyhow::Error::msg)?;
        if self.controllers.is_empty() && self.vhost_user_blk.is_empty() {
            bail!("no device configured: add a [[controller]] or [[vhost_user_blk]] section, or use --vfio-user/--ns or --vhost-user-blk/--disk");
        }
        let mut sockets = HashSet::new();
        for c in &self.controllers {
            let what = format!("controller {}", c.socket.display());
            if c.namespaces.is_empty() {
                bail!("{what} has no namespace: add one, e.g. ram:1G");
            }
            if !sockets.insert(c.socket.clone()) {
                bail!("socket {} is used by two controllers", c.socket.display());
            }
            if let engine::Placement::Dedicated = c
                .placement
                .parse::<engine::Placement>()
                .map_err(|e| anyhow::anyhow!("{what}: {e}"))?
            {
                bail!("{what}: placement `dedicated` is available for vhost_user_blk devices only; use round-robin or single");
            }
            if c.io_queues == 0 || c.io_queues > 511 {
                bail!("{what}: io_queues must be 1..=511, not {}", c.io_queues);
            }
            if let Some(dir) = c.socket.parent().filter(|d| !d.as_os_str().is_empty()) {
                if !dir.is_dir() {
                    bail!("{what}: directory {} does not exist", dir.display());
                }
            }
        }
        crate::vhost_device::validate(&self.vhost_user_blk, &mut sockets)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_several_controllers() {
        let cfg: Config = toml::from_str(
            r#"
            cpus = "0-1"
            [[controller]]
            socket = "a.sock"
            namespaces = ["ram:1G"]
            [[controller]]
            socket = "b.sock"
            namespaces = ["null:1G", "ram:64M,bs=4096"]
            placement = "single"
            io_queues = 4
            "#,
        )
        .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.controllers.len(), 2);
        assert_eq!(cfg.controllers[1].namespaces.len(), 2);
        assert_eq!(cfg.controllers[0].serial(), "UD-a");
    }

    #[test]
    fn rejects_bad_configs() {
        let bad = [
            "[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1X\"]",
            "[[controller]]\nsocket = \"a\"\nnamespaces = []",
            "[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1G\"]\n[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1G\"]",
            "cpus = \"x\"\n[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1G\"]",
            "[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1G\"]\nplacement = \"fast\"",
            "[[controller]]\nsocket = \"/nonexistent-dir/a\"\nnamespaces = [\"ram:1G\"]",
            "[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1G\"]\nbogus = 1",
            "",
        ];
        for b in bad {
            let r = toml::from_str::<Config>(b)
                .map_err(anyhow::Error::from)
                .and_then(|c| c.validate());
            assert!(r.is_err(), "accepted: {b}");
        }
    }
}
