//! The server configuration: from the command line or a TOML file.
//!
//! ```toml
//! cpus = "0-1"                 # reactor CPUs (one reactor per CPU)
//! rbd_cpus = "2-3"             # librados/librbd threads (default: the CPUs reactors do not use)
//! rpc = "/run/udrive/rpc.sock" # optional JSON-RPC control socket (docs/rpc.md)
//! metrics_listen = "127.0.0.1:9100"  # optional Prometheus endpoint
//!
//! [[controller]]
//! socket = "/run/udrive/vm1.sock"
//! namespaces = ["ram:1G", "null:64G,bs=4096"]
//! serial = "vm1-disk"          # optional; default derived from the socket
//! placement = "round-robin"    # or "single"
//! io_queues = 32               # I/O queue pairs the controller offers
//! max_namespaces = 32          # highest NSID (namespaces can be added at run time)
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::nsspec::NsSpec;

mod vhost;
pub use vhost::{default_queues, disk_specs, validate, VhostBlkConfig};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_cpus")]
    pub cpus: String,
    /// CPUs for librados' and librbd's threads (`--rbd-cpus`); default: the allowed
    /// CPUs without the reactors'.
    #[serde(default)]
    pub rbd_cpus: Option<String>,
    /// JSON-RPC control socket.
    #[serde(default)]
    pub rpc: Option<PathBuf>,
    /// Address of the Prometheus HTTP endpoint.
    #[serde(default)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    #[serde(default, rename = "controller")]
    pub controllers: Vec<ControllerConfig>,
    #[serde(default)]
    pub vhost_user_blk: Vec<VhostBlkConfig>,
    /// Default mode and group of every device socket (each device may set its own).
    #[serde(default)]
    pub socket_mode: Option<String>,
    #[serde(default)]
    pub socket_group: Option<String>,
    /// Directories where devices added at run time may keep their files and
    /// sockets (Landlock; docs/security.md).
    #[serde(default)]
    pub allow_dirs: Vec<PathBuf>,
    /// The file this came from: what a reload re-reads.
    #[serde(skip)]
    pub file: Option<PathBuf>,
}

/// A configuration without devices: reactors on the default CPUs, no control socket.
impl Default for Config {
    fn default() -> Self {
        Config {
            cpus: default_cpus(),
            rbd_cpus: None,
            rpc: None,
            metrics_listen: None,
            controllers: Vec::new(),
            vhost_user_blk: Vec::new(),
            socket_mode: None,
            socket_group: None,
            allow_dirs: Vec::new(),
            file: None,
        }
    }
}

/// Who may connect to a device socket: `socket_mode` (octal, default 0600: owner
/// only) and `socket_group` (name or number), as in the TOML config, the CLI and
/// the RPC add methods.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct SocketPerms {
    #[serde(default)]
    pub socket_mode: Option<String>,
    #[serde(default)]
    pub socket_group: Option<String>,
}

impl SocketPerms {
    /// These, with what is unset taken from `defaults`.
    pub fn or(&self, defaults: &SocketPerms) -> SocketPerms {
        SocketPerms {
            socket_mode: self.socket_mode.clone().or(defaults.socket_mode.clone()),
            socket_group: self.socket_group.clone().or(defaults.socket_group.clone()),
        }
    }

    pub fn access(&self) -> Result<sockfile::SocketAccess> {
        sockfile::SocketAccess::parse(self.socket_mode.as_deref(), self.socket_group.as_deref())
            .map_err(anyhow::Error::msg)
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerConfig {
    pub socket: PathBuf,
    pub namespaces: Vec<NsSpec>,
    /// The NSID of each namespace (default 1, 2, …): a running controller's
    /// namespaces after some were removed, as a handover passes them on. Given
    /// (even empty), the controller may start without namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsids: Option<Vec<u32>>,
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(default, with = "crate::serde_str")]
    pub placement: engine::Placement,
    #[serde(default = "default_io_queues")]
    pub io_queues: u16,
    #[serde(default = "default_max_namespaces")]
    pub max_namespaces: u32,
    /// How its queues wait for work: busy, adaptive or event.
    #[serde(default, with = "crate::serde_str")]
    pub poll: engine::PollMode,
    /// Idle time in µs before an `adaptive` queue group sleeps.
    #[serde(default = "default_poll_idle_us")]
    pub poll_idle_us: u64,
    #[serde(default)]
    pub socket_mode: Option<String>,
    #[serde(default)]
    pub socket_group: Option<String>,
}

/// The first CPU this process may run on (CPU 0 unless an affinity mask says otherwise).
pub fn default_cpus() -> String {
    engine::allowed_cpus()
        .first()
        .map_or_else(|| "0".into(), ToString::to_string)
}
pub fn default_io_queues() -> u16 {
    32
}
pub fn default_max_namespaces() -> u32 {
    32
}
pub fn default_poll_idle_us() -> u64 {
    nvme::DEFAULT_ADAPTIVE_IDLE.as_micros() as u64
}

/// A serial number of at most 20 printable ASCII characters: the one given, or
/// derived from the socket's file name (NVMe SN and virtio-blk GET_ID both hold 20).
pub fn serial_for(given: Option<&str>, socket: &std::path::Path) -> String {
    let s = given.map(str::to_string).unwrap_or_else(|| {
        let stem = socket
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

impl ControllerConfig {
    /// The NSID of the `i`-th namespace.
    pub fn nsid(&self, i: usize) -> u32 {
        self.nsids
            .as_ref()
            .and_then(|n| n.get(i).copied())
            .unwrap_or(i as u32 + 1)
    }

    pub fn new(socket: PathBuf, namespaces: Vec<NsSpec>) -> Self {
        ControllerConfig {
            socket,
            namespaces,
            nsids: None,
            serial: None,
            placement: engine::Placement::RoundRobin,
            io_queues: default_io_queues(),
            max_namespaces: default_max_namespaces(),
            poll: engine::PollMode::default(),
            poll_idle_us: default_poll_idle_us(),
            socket_mode: None,
            socket_group: None,
        }
    }

    /// Who may connect to its socket.
    pub fn socket_perms(&self) -> SocketPerms {
        SocketPerms {
            socket_mode: self.socket_mode.clone(),
            socket_group: self.socket_group.clone(),
        }
    }

    pub fn set_socket_perms(&mut self, p: SocketPerms) {
        self.socket_mode = p.socket_mode;
        self.socket_group = p.socket_group;
    }

    /// Serial number: given, or derived from the socket's file name.
    pub fn serial(&self) -> String {
        crate::config::serial_for(self.serial.as_deref(), &self.socket)
    }
}

impl Config {
    /// The socket mode and group of devices that do not set their own.
    pub fn socket_defaults(&self) -> SocketPerms {
        SocketPerms {
            socket_mode: self.socket_mode.clone(),
            socket_group: self.socket_group.clone(),
        }
    }

    /// `rbd_cpus` as a list, checked against the CPUs this process may use.
    pub fn rbd_cpu_list(&self) -> Result<Option<Vec<usize>>> {
        let Some(list) = &self.rbd_cpus else {
            return Ok(None);
        };
        let cpus = engine::parse_cpu_list(list)
            .and_then(|c| engine::check_allowed(&c).map(|()| c))
            .map_err(|e| anyhow::anyhow!("--rbd-cpus {list}: {e}"))?;
        Ok(Some(cpus))
    }

    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        let mut cfg: Config = toml::from_str(&text)
            .with_context(|| format!("config file {} is not valid", path.display()))?;
        cfg.file = Some(std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()));
        Ok(cfg)
    }

    /// Checks what can be checked before anything is created: every problem, not
    /// only the first.
    pub fn validate(&self) -> Result<()> {
        Problems::result(self.problems())
    }

    /// What [`Config::validate`] finds wrong, each naming the device or setting.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Err(e) = engine::parse_cpu_list(&self.cpus) {
            p.push(format!("cpus {}: {e}", self.cpus));
        }
        if let Err(e) = self.rbd_cpu_list() {
            p.push(format!("{e:#}"));
        }
        // With a control socket, devices can come later (nvme_add_controller).
        if self.controllers.is_empty() && self.vhost_user_blk.is_empty() && self.rpc.is_none() {
            p.push("no device configured: add a [[controller]] or [[vhost_user_blk]] section, or use --vfio-user/--ns or --vhost-user-blk/--disk".into());
        }
        if let Err(e) = self.socket_defaults().access() {
            p.push(format!("socket_mode/socket_group: {e:#}"));
        }
        let mut sockets = HashSet::new();
        for c in &self.controllers {
            p.extend(c.problems());
            if !sockets.insert(c.socket.clone()) {
                p.push(format!(
                    "socket {} is used by two controllers",
                    c.socket.display()
                ));
            }
        }
        p.extend(vhost::problems(&self.vhost_user_blk, &mut sockets));
        if let Some(rpc) = &self.rpc {
            if sockets.contains(rpc) {
                p.push(format!(
                    "rpc socket {} is also a device socket",
                    rpc.display()
                ));
            }
            p.extend(socket_dir_problem("rpc socket", rpc));
        }
        p
    }
}

/// Every problem a configuration check found.
#[derive(Debug, thiserror::Error)]
#[error("{}", list(.0))]
pub struct Problems(pub Vec<String>);

fn list(problems: &[String]) -> String {
    match problems {
        [one] => one.clone(),
        all => format!("{} problems:\n  {}", all.len(), all.join("\n  ")),
    }
}

impl Problems {
    /// `Ok` when `problems` is empty.
    pub fn result(problems: Vec<String>) -> Result<()> {
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Problems(problems).into())
        }
    }
}

/// Why a socket cannot be created at `path`: its directory is missing, or this
/// process may not create files in it.
pub fn socket_dir_problem(what: &str, path: &Path) -> Option<String> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Some(format!(
            "{what}: directory {} does not exist",
            dir.display()
        ));
    }
    let access = nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK;
    nix::unistd::access(dir, access)
        .err()
        .map(|e| format!("{what}: cannot create a socket in {}: {e}", dir.display()))
}

impl ControllerConfig {
    /// Checks one controller on its own (also used for `nvme_add_controller`).
    pub fn validate(&self) -> Result<()> {
        Problems::result(self.problems())
    }

    /// What [`ControllerConfig::validate`] finds wrong.
    pub fn problems(&self) -> Vec<String> {
        let what = format!("controller {}", self.socket.display());
        let mut p = Vec::new();
        if let Err(e) = self.socket_perms().access() {
            p.push(format!("{what}: {e:#}"));
        }
        if self.namespaces.is_empty() && self.nsids.is_none() {
            p.push(format!("{what} has no namespace: add one, e.g. ram:1G"));
        }
        if let Some(ids) = &self.nsids {
            let mut seen = std::collections::BTreeSet::new();
            if ids.len() != self.namespaces.len()
                || ids
                    .iter()
                    .any(|n| *n == 0 || *n > self.max_namespaces || !seen.insert(*n))
            {
                p.push(format!(
                    "{what}: nsids must give each namespace a distinct NSID in 1..={}",
                    self.max_namespaces
                ));
            }
        }
        if self.placement == engine::Placement::Dedicated {
            p.push(format!("{what}: placement `dedicated` is available for vhost_user_blk devices only; use round-robin or single"));
        }
        if self.io_queues == 0 || self.io_queues > 511 {
            p.push(format!(
                "{what}: io_queues must be 1..=511, not {}",
                self.io_queues
            ));
        }
        if self.max_namespaces == 0 || self.max_namespaces > 1024 {
            p.push(format!(
                "{what}: max_namespaces must be 1..=1024, not {}",
                self.max_namespaces
            ));
        } else if self.namespaces.len() > self.max_namespaces as usize {
            p.push(format!(
                "{what}: {} namespaces but max_namespaces is {}",
                self.namespaces.len(),
                self.max_namespaces
            ));
        }
        p.extend(socket_dir_problem(&what, &self.socket));
        p
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
    fn control_socket_allows_no_controllers() {
        let cfg: Config =
            toml::from_str("rpc = \"r.sock\"\nmetrics_listen = \"127.0.0.1:9100\"").unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.metrics_listen.unwrap().port(), 9100);
        let bad: Config = toml::from_str("rpc = \"/nonexistent-dir/r.sock\"").unwrap();
        assert!(bad.validate().is_err());
    }

    /// `serve` reports every problem of the values, not only the first.
    #[test]
    fn validate_lists_every_problem() {
        let cfg: Config = toml::from_str(
            "cpus = \"x\"\n[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1G\"]\nio_queues = 0\n\
             [[vhost_user_blk]]\nsocket = \"a\"\ndisk = \"null:1G\"\nqueue_size = 3",
        )
        .unwrap();
        let e = cfg.validate().unwrap_err();
        let Some(Problems(p)) = e.downcast_ref::<Problems>() else {
            panic!("{e:#}")
        };
        assert_eq!(p.len(), 4, "{p:#?}");
        assert!(e.to_string().starts_with("4 problems:"), "{e}");
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
            "[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1G\"]\nmax_namespaces = 0",
            "metrics_listen = \"nowhere\"\n[[controller]]\nsocket = \"a\"\nnamespaces = [\"ram:1G\"]",
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
