//! Applying a changed configuration file to a running server: the `reload_config`
//! method, SIGHUP and `systemctl reload udrive` all come here.
//!
//! The file is the wanted state; the server's devices as they run now
//! ([`ServerSnapshot::of`], the same view a live handover sends) are the current
//! one. Every difference goes through the code the RPC methods use: devices are
//! added and removed, namespaces added and removed, QoS, poll mode and placement
//! set while queues run. A device whose fixed settings changed (queue counts,
//! serial, a namespace's backend) is re-created when no client is connected and
//! left as it is, with the reason, when one is: a reload never stops a device a
//! VM is attached to (namespaces come and go as the namespace methods do). Settings of the whole process (CPUs, sockets of the control
//! plane) need a restart.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use crate::config::{Config, ControllerConfig, SocketPerms, VhostBlkConfig};
use crate::handover::snapshot::ServerSnapshot;
use crate::nsspec::NsSpec;
use crate::server::{same_socket, Server};

/// What a reload did, one line per change.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct ReloadReport {
    /// Changes made.
    pub applied: Vec<String>,
    /// Changes wanted but not made, each with its reason.
    pub failed: Vec<String>,
    /// Changes that need the process restarted.
    pub needs_restart: Vec<String>,
}

impl ReloadReport {
    fn run(&mut self, what: String, r: Result<()>) {
        match r {
            Ok(()) => self.applied.push(what),
            Err(e) => self.failed.push(format!("{what}: {e:#}")),
        }
    }
}

/// Reads `path` and applies it to `server`. An unreadable or invalid file changes
/// nothing.
pub fn reload(server: &Server, path: &Path) -> Result<ReloadReport> {
    crate::systemd::reloading();
    let r = read_and_apply(server, path);
    crate::systemd::ready(server.lock().devices.len());
    r
}

fn read_and_apply(server: &Server, path: &Path) -> Result<ReloadReport> {
    let new = Config::load(path)?;
    new.validate()?;
    let report = apply(server, &new);
    tracing::info!(
        config = %path.display(),
        applied = report.applied.len(),
        failed = report.failed.len(),
        needs_restart = report.needs_restart.len(),
        "configuration reloaded"
    );
    for line in &report.applied {
        tracing::info!("reload: {line}");
    }
    for line in report.failed.iter().chain(&report.needs_restart) {
        tracing::warn!("reload: not applied: {line}");
    }
    Ok(report)
}

/// Makes the server's devices what `new` describes, as far as it can without
/// disturbing a connected client.
pub fn apply(server: &Server, new: &Config) -> ReloadReport {
    let now = ServerSnapshot::of(server, &server.lock());
    let mut r = ReloadReport::default();
    process_settings(&now, new, &mut r);
    // A spec that still names the image a disk served before a live snapshot,
    // commit or mirror is the same spec: the disk goes on as it is.
    for a in &now.active_images {
        tracing::warn!(
            spec = %a.spec.display(),
            serves = %a.active.display(),
            "reload: a disk serves another image than its spec names (its chain changed \
             while it ran); a spec naming {} keeps it serving {}",
            a.spec.display(),
            a.active.display()
        );
    }
    for c in &now.controllers {
        if !new
            .controllers
            .iter()
            .any(|n| same_socket(&n.socket, &c.socket))
        {
            remove(server, &c.socket, "controller", &mut r);
        }
    }
    for d in &now.vhost_user_blk {
        if !new
            .vhost_user_blk
            .iter()
            .any(|n| same_socket(&n.socket, &d.socket))
        {
            remove(server, &d.socket, "vhost-user-blk device", &mut r);
        }
    }
    for c in &new.controllers {
        match now
            .controllers
            .iter()
            .find(|o| same_socket(&o.socket, &c.socket))
        {
            Some(old) => controller(server, old, c, &mut r),
            None => r.run(
                format!("added controller {}", c.socket.display()),
                server.add_controller(c.clone()),
            ),
        }
    }
    for d in &new.vhost_user_blk {
        match now
            .vhost_user_blk
            .iter()
            .find(|o| same_socket(&o.socket, &d.socket))
        {
            Some(old) => vhost(server, old, d, &mut r),
            None => r.run(
                format!("added vhost-user-blk device {}", d.socket.display()),
                server.add_vhost_blk(d.clone()),
            ),
        }
    }
    r
}

fn process_settings(now: &ServerSnapshot, new: &Config, r: &mut ReloadReport) {
    let mut differs = |name: &str, same: bool| {
        if !same {
            r.needs_restart.push(format!("{name} changed"));
        }
    };
    differs("cpus", now.cpus == new.cpus);
    differs("rbd_cpus", now.rbd_cpus == new.rbd_cpus);
    differs("rpc", now.rpc == new.rpc);
    differs("metrics_listen", now.metrics_listen == new.metrics_listen);
    differs("socket_mode", now.socket_mode == new.socket_mode);
    differs("socket_group", now.socket_group == new.socket_group);
}

fn remove(server: &Server, socket: &Path, what: &str, r: &mut ReloadReport) {
    r.run(
        format!("removed {what} {}", socket.display()),
        server.remove_device(socket, false),
    );
}

/// Re-creates the device on `socket` with `add` when no client is connected.
fn recreate(
    server: &Server,
    socket: &Path,
    why: &str,
    add: impl FnOnce() -> Result<()>,
    r: &mut ReloadReport,
) {
    let connected = server.lock().find(socket).is_some_and(|d| d.connected());
    let what = format!("re-created {} ({why})", socket.display());
    if connected {
        r.failed.push(format!(
            "{what}: a client is connected; disconnect it and reload again"
        ));
        return;
    }
    r.run(
        what,
        server.remove_device(socket, false).and_then(|()| add()),
    );
}

fn controller(
    server: &Server,
    old: &ControllerConfig,
    new: &ControllerConfig,
    r: &mut ReloadReport,
) {
    let mut fixed = vec![
        ("serial", old.serial == new.serial),
        ("io_queues", old.io_queues == new.io_queues),
        ("max_namespaces", old.max_namespaces == new.max_namespaces),
        ("poll_idle_us", old.poll_idle_us == new.poll_idle_us),
    ];
    fixed.extend(same_perms(&old.socket_perms(), &new.socket_perms()));
    let running = Running {
        socket: &new.socket,
        fixed,
        placement: (old.placement, new.placement),
        poll: (old.poll, new.poll),
    };
    let cfg = new.clone();
    if running.apply(server, || server.add_controller(cfg), r) {
        namespaces(server, old, new, r);
    }
}

/// Socket mode and group: a file that leaves them out keeps what the device has
/// (the server's defaults filled them in).
fn same_perms(old: &SocketPerms, new: &SocketPerms) -> [(&'static str, bool); 2] {
    [
        (
            "socket_mode",
            new.socket_mode.is_none() || old.socket_mode == new.socket_mode,
        ),
        (
            "socket_group",
            new.socket_group.is_none() || old.socket_group == new.socket_group,
        ),
    ]
}

/// What devices of both kinds have: settings fixed when the device is made, and
/// placement and poll mode, set while its queues run.
struct Running<'a> {
    socket: &'a Path,
    /// Each fixed setting, and whether the file keeps it.
    fixed: Vec<(&'static str, bool)>,
    placement: (engine::Placement, engine::Placement),
    poll: (engine::PollMode, engine::PollMode),
}

impl Running<'_> {
    /// Re-creates the device with `add` if a fixed setting changed (false: the
    /// device was re-created or left alone), else sets placement and poll mode.
    fn apply(
        self,
        server: &Server,
        add: impl FnOnce() -> Result<()>,
        r: &mut ReloadReport,
    ) -> bool {
        let s = self.socket;
        if let Some((name, _)) = self.fixed.iter().find(|(_, same)| !same) {
            recreate(server, s, &format!("{name} changed"), add, r);
            return false;
        }
        let (was, now) = self.placement;
        if was != now {
            r.run(
                format!("{}: placement {now}", s.display()),
                server.set_placement(s, now),
            );
        }
        let (was, now) = self.poll;
        if was != now {
            r.run(
                format!("{}: poll mode {now}", s.display()),
                server.set_poll_mode(s, now),
            );
        }
        true
    }
}

fn by_nsid(c: &ControllerConfig) -> BTreeMap<u32, &NsSpec> {
    c.namespaces
        .iter()
        .enumerate()
        .map(|(i, ns)| (c.nsid(i), ns))
        .collect()
}

fn namespaces(
    server: &Server,
    old: &ControllerConfig,
    new: &ControllerConfig,
    r: &mut ReloadReport,
) {
    let s = &new.socket;
    let (was, want) = (by_nsid(old), by_nsid(new));
    for (&nsid, &ns) in &was {
        match want.get(&nsid) {
            None => r.run(
                format!("{}: removed namespace {nsid}", s.display()),
                server.remove_namespace(s, nsid),
            ),
            Some(&w) if !ns.same_backend(w) => r.run(
                format!("{}: namespace {nsid} is now {w}", s.display()),
                server
                    .remove_namespace(s, nsid)
                    .and_then(|()| server.add_namespace(s, w.clone(), Some(nsid)).map(drop)),
            ),
            Some(&w) => qos(server, s, nsid, w, r),
        }
    }
    for (&nsid, &ns) in &want {
        if !was.contains_key(&nsid) {
            r.run(
                format!("{}: added namespace {nsid} ({ns})", s.display()),
                server.add_namespace(s, ns.clone(), Some(nsid)).map(drop),
            );
        }
    }
}

/// Sets the QoS limits the file gives a disk when they differ from those in force
/// (which `set_qos` may have changed since it started).
fn qos(server: &Server, socket: &Path, nsid: u32, want: &NsSpec, r: &mut ReloadReport) {
    let limits = want.qos;
    let changed = server.with_qos(socket, Some(nsid), |d| Ok(d.limits() != limits));
    match changed {
        Ok(false) => {}
        Ok(true) => r.run(
            format!("{}: QoS of disk {nsid} set to the file's", socket.display()),
            server.with_qos(socket, Some(nsid), |d| Ok(d.set_limits(limits)?)),
        ),
        Err(e) => r
            .failed
            .push(format!("{}: QoS of disk {nsid}: {e:#}", socket.display())),
    }
}

fn vhost(server: &Server, old: &VhostBlkConfig, new: &VhostBlkConfig, r: &mut ReloadReport) {
    let mut fixed = vec![
        ("disk", old.disk.same_backend(&new.disk)),
        ("queues", old.queues == new.queues),
        ("queue_size", old.queue_size == new.queue_size),
        ("cpus", old.cpus == new.cpus),
        ("serial", old.serial == new.serial),
    ];
    fixed.extend(same_perms(&old.socket_perms(), &new.socket_perms()));
    let running = Running {
        socket: &new.socket,
        fixed,
        placement: (old.placement, new.placement),
        poll: (old.poll, new.poll),
    };
    let cfg = new.clone();
    if running.apply(server, || server.add_vhost_blk(cfg), r) {
        qos(server, &new.socket, 1, &new.disk, r);
    }
}
