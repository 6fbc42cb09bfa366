//! The running server: engine, devices and opened backends in one object that the
//! control socket, the metrics endpoint and signal handling share.
//!
//! Control operations take `Server::state` (a plain mutex): it serializes device and
//! namespace changes. It is never taken on the I/O path — reactors own their queues
//! and see changes only as messages (see docs/decisions/0008-control-plane.md).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{anyhow, bail, Context, Result};

use crate::backends::{BackendSet, Backends};
use crate::config::VhostBlkConfig;
use crate::config::{Config, ControllerConfig};
use crate::device::NvmeDevice;
use crate::nsspec::NsSpec;
use crate::process::Process;
use crate::vhost_device::VhostBlkDevice;

pub use crate::frontend::Device;

pub struct State {
    pub devices: Vec<Device>,
    pub backends: BackendSet,
    /// Block jobs on qcow2 disks, running and recently finished.
    pub jobs: crate::jobs::Jobs,
    next_cntlid: u16,
}

/// Whether two names denote the same socket (`vm.sock` and `./vm.sock`, or an
/// absolute path).
pub fn same_socket(a: &Path, b: &Path) -> bool {
    if a == b {
        return true;
    }
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

impl State {
    pub fn find(&self, socket: &Path) -> Option<&Device> {
        self.devices
            .iter()
            .find(|d| same_socket(d.socket(), socket))
    }

    fn position(&self, socket: &Path) -> Option<usize> {
        self.devices
            .iter()
            .position(|d| same_socket(d.socket(), socket))
    }

    /// "No such device", naming the known ones.
    pub fn not_found(&self, socket: &Path) -> anyhow::Error {
        let known: Vec<String> = self
            .devices
            .iter()
            .map(|d| d.socket().display().to_string())
            .collect();
        anyhow!(
            "no device on socket {} (devices: {})",
            socket.display(),
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        )
    }

    /// The NVMe controller on `socket`.
    pub fn nvme_mut(&mut self, socket: &Path) -> Result<&mut NvmeDevice> {
        let Some(i) = self.position(socket) else {
            return Err(self.not_found(socket));
        };
        let what = self.devices[i].what();
        self.devices[i]
            .as_nvme_mut()
            .ok_or_else(|| anyhow!("{} is {what}, not an NVMe controller", socket.display()))
    }
}

/// `d` as the NVMe controller on `socket`.
fn nvme_of<'a>(d: &'a Device, socket: &Path) -> Result<&'a NvmeDevice> {
    d.as_nvme().ok_or_else(|| {
        anyhow!(
            "{} is {}, not an NVMe controller",
            socket.display(),
            d.what()
        )
    })
}

pub struct Server {
    pub engine: Arc<engine::Engine>,
    /// The process the server runs in: devices get their part of it when built.
    process: Arc<Process>,
    pub cpus: String,
    /// `--rbd-cpus` as given (a handover passes it on).
    pub rbd_cpus: Option<String>,
    /// The control socket and metrics endpoint it was configured with (a handover
    /// passes them on).
    pub rpc: Option<PathBuf>,
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// The configuration file reloads re-read.
    pub config_file: Option<PathBuf>,
    /// Reactors from `--cpus` (shared by devices); `dedicated` placement adds more.
    base_reactors: usize,
    /// Socket mode and group of devices added later that do not name their own.
    socket_defaults: crate::config::SocketPerms,
    state: Mutex<State>,
    /// The NBD server `nbd_server_start` started, if any.
    nbd: Mutex<Option<crate::nbd_export::NbdServer>>,
}

/// Most reactors `vhost_user_blk_add` may bring the engine to with `dedicated`
/// placement (reactor threads live until shutdown, so repeated adds must not grow
/// them without bound).
pub const MAX_REACTORS: usize = 256;

impl Server {
    /// Starts the configured controllers on a running engine. On error everything
    /// started so far is stopped again.
    pub fn start(
        cfg: &Config,
        backends: BackendSet,
        devs: Backends,
        disks: Vec<Arc<bdev::QosDisk>>,
        engine: Arc<engine::Engine>,
        process: Arc<Process>,
    ) -> Result<Arc<Server>> {
        let base_reactors = engine.num_reactors();
        let server = Arc::new(Server {
            engine,
            process,
            cpus: cfg.cpus.clone(),
            rbd_cpus: cfg.rbd_cpus.clone(),
            rpc: cfg.rpc.clone(),
            metrics_listen: cfg.metrics_listen,
            config_file: cfg.file.clone(),
            base_reactors,
            socket_defaults: cfg.socket_defaults(),
            state: Mutex::new(State {
                devices: Vec::new(),
                backends,
                jobs: Default::default(),
                next_cntlid: 1,
            }),
            nbd: Mutex::new(None),
        });
        for (c, devs) in cfg.controllers.iter().zip(devs) {
            let mut st = server.lock();
            let cntlid = st.next_cntlid;
            let life = server
                .process
                .device_life(&NvmeDevice::keep_prefix(&c.socket));
            match NvmeDevice::start(c, devs, cntlid, &server.engine, server.base_reactors, life) {
                Ok(d) => {
                    st.next_cntlid = st.next_cntlid.wrapping_add(1).max(1);
                    st.devices.push(Box::new(d));
                }
                Err(e) => {
                    drop(st);
                    server.stop_devices();
                    return Err(e);
                }
            }
        }
        for (c, disk) in cfg.vhost_user_blk.iter().zip(disks) {
            let mut st = server.lock();
            let restore = server
                .process
                .device_life(&crate::vhost_device::keep_prefix(&c.socket))
                .restore;
            if let Err(e) = server.start_vhost_blk(&mut st, c, disk, restore) {
                drop(st);
                server.stop_devices();
                return Err(e);
            }
        }
        Ok(server)
    }

    /// Starts a vhost-user-blk device on its opened disk (the one path for
    /// configured devices and `vhost_user_blk_add`).
    fn start_vhost_blk(
        &self,
        st: &mut State,
        cfg: &VhostBlkConfig,
        disk: Arc<bdev::QosDisk>,
        restore: lifecycle::KeptRecords,
    ) -> Result<()> {
        // Devices so far: round-robin starts each device's queues on a further reactor.
        let index = st.devices.iter().filter(|d| d.as_vhost().is_some()).count();
        let dev = crate::vhost_device::start(
            cfg,
            disk.clone(),
            index,
            &self.engine,
            self.base_reactors,
            restore,
        )?;
        st.devices.push(Box::new(VhostBlkDevice {
            cfg: cfg.clone(),
            dev,
            disk,
        }));
        Ok(())
    }

    /// Opens the disk and starts a vhost-user-blk device; the socket must be new.
    pub fn add_vhost_blk(&self, mut cfg: VhostBlkConfig) -> Result<()> {
        let perms = cfg.socket_perms().or(&self.socket_defaults);
        cfg.set_socket_perms(perms);
        crate::config::validate(std::slice::from_ref(&cfg), &mut Default::default())?;
        crate::fs_access::check_socket(&cfg.socket)?;
        crate::fs_access::check_ns(&cfg.disk)?;
        let mut st = self.lock();
        if st.find(&cfg.socket).is_some() {
            bail!("socket {} already has a device", cfg.socket.display());
        }
        self.check_reactor_budget(&cfg)?;
        let disk = st.backends.open_disk(&cfg.disk, &cfg.socket)?;
        if let Err(e) = self.start_vhost_blk(&mut st, &cfg, disk, Default::default()) {
            st.backends.release_all(&cfg.socket);
            return Err(e);
        }
        Ok(())
    }

    /// Socket mode and group of devices that do not name their own.
    pub fn socket_defaults(&self) -> &crate::config::SocketPerms {
        &self.socket_defaults
    }

    /// The process the server runs in.
    pub fn process(&self) -> &Arc<Process> {
        &self.process
    }

    /// CPUs for the threads of backend libraries (librbd), as backends get them.
    pub fn library_cpus(&self) -> Vec<usize> {
        crate::kinds::OpenEnv::library_cpus(&*self.process)
    }

    /// The control-plane lock. Never held by reactors.
    /// Counters and histograms of every device and reactor (`get_stats`, metrics).
    pub fn stats(&self) -> trace::StatsSnapshot {
        let st = self.lock();
        let devs: Vec<&dyn crate::frontend::FrontEnd> =
            st.devices.iter().map(|d| d.as_ref()).collect();
        crate::stats::get_stats(&devs, &self.engine)
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops every device (removing its socket).
    pub fn stop_devices(&self) {
        let devices = std::mem::take(&mut self.lock().devices);
        for d in devices {
            d.stop();
        }
    }

    /// Opens the namespaces and starts a controller; the socket must be new.
    pub fn add_controller(&self, mut cfg: ControllerConfig) -> Result<()> {
        let perms = cfg.socket_perms().or(&self.socket_defaults);
        cfg.set_socket_perms(perms);
        cfg.validate()?;
        crate::fs_access::check_socket(&cfg.socket)?;
        cfg.namespaces
            .iter()
            .try_for_each(crate::fs_access::check_ns)?;
        let mut st = self.lock();
        if st.find(&cfg.socket).is_some() {
            bail!("socket {} already has a device", cfg.socket.display());
        }
        let mut devs = Vec::new();
        for (i, ns) in cfg.namespaces.iter().enumerate() {
            match st.backends.open(ns, &cfg.socket, cfg.nsid(i)) {
                Ok(d) => devs.push(d),
                Err(e) => {
                    st.backends.release_all(&cfg.socket);
                    return Err(e);
                }
            }
        }
        let cntlid = st.next_cntlid;
        let life = self
            .process
            .new_device_life(&NvmeDevice::keep_prefix(&cfg.socket));
        match NvmeDevice::start(&cfg, devs, cntlid, &self.engine, self.base_reactors, life) {
            Ok(d) => {
                st.next_cntlid = st.next_cntlid.wrapping_add(1).max(1);
                st.devices.push(Box::new(d));
                Ok(())
            }
            Err(e) => {
                st.backends.release_all(&cfg.socket);
                Err(e)
            }
        }
    }

    /// Stops the device on `socket`. A connected client makes this an error unless
    /// `force` (the client then loses the device as if unplugged).
    pub fn remove_device(&self, socket: &Path, force: bool) -> Result<()> {
        self.remove_device_of(socket, None, force)
    }

    /// [`Self::remove_device`] that refuses devices of another kind than `kind`
    /// (`Device::kind`), naming the method that removes them.
    pub fn remove_device_of(&self, socket: &Path, kind: Option<&str>, force: bool) -> Result<()> {
        let mut st = self.lock();
        let Some(at) = st.position(socket) else {
            return Err(st.not_found(socket));
        };
        if let Some(k) = kind.filter(|k| *k != st.devices[at].kind()) {
            let (is, method) = (st.devices[at].what(), st.devices[at].remove_method());
            bail!(
                "{} is {is}, not a {k} device; remove it with {method}",
                socket.display()
            );
        }
        if st.devices[at].connected() && !force {
            bail!(
                "device {} has a connected client; disconnect it first or pass \"force\": true",
                socket.display()
            );
        }
        let d = st.devices.remove(at);
        st.backends.release_all(d.socket());
        drop(st);
        if let Some(n) = self.nbd_server().as_ref() {
            n.forget_device(&|s| same_socket(s, d.socket()));
        }
        d.stop();
        Ok(())
    }

    /// Adds namespace `nsid` (default: the lowest free one) to the controller on
    /// `socket`; returns the NSID.
    pub fn add_namespace(&self, socket: &Path, spec: NsSpec, nsid: Option<u32>) -> Result<u32> {
        crate::fs_access::check_ns(&spec)?;
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(at) = st.position(socket) else {
            return Err(st.not_found(socket));
        };
        let (devices, backends) = (&st.devices, &mut st.backends);
        let dev = nvme_of(&devices[at], socket)?;
        let mut opened = None;
        let r = dev.add_namespace(nsid, spec.clone(), |nsid| {
            opened = Some(nsid);
            backends.open(&spec, &dev.socket, nsid)
        });
        if let (Err(_), Some(n)) = (&r, opened) {
            backends.release(&dev.socket, n);
        }
        r
    }

    /// Removes namespace `nsid`: commands in flight finish, new ones fail with
    /// Invalid Namespace, and the host is notified.
    pub fn remove_namespace(&self, socket: &Path, nsid: u32) -> Result<()> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let dev = st.nvme_mut(socket)?;
        dev.remove_namespace(nsid)?;
        let sock = dev.socket.clone();
        st.backends.release(&sock, nsid);
        Ok(())
    }

    /// Runs `f` on the QoS wrapper of a disk: NVMe namespace `nsid` of the
    /// controller on `socket`, or the disk of the vhost-user-blk device on `socket`
    /// (which has one: `nsid` absent or 1).
    pub fn with_qos<R>(
        &self,
        socket: &Path,
        nsid: Option<u32>,
        f: impl FnOnce(&bdev::QosDisk) -> Result<R>,
    ) -> Result<R> {
        let st = self.lock();
        let d = st.find(socket).ok_or_else(|| st.not_found(socket))?;
        f(&*d.qos(nsid)?)
    }

    /// The NBD server, if `nbd_server_start` started one.
    pub fn nbd_server(&self) -> std::sync::MutexGuard<'_, Option<crate::nbd_export::NbdServer>> {
        self.nbd.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Disk `nsid` of the device on `socket` (vhost-user-blk: its disk), held
    /// past the control lock: for control operations that take long (a LUKS
    /// keyslot's key derivation) and must not stall other requests.
    pub fn disk(&self, socket: &Path, nsid: Option<u32>) -> Result<Arc<bdev::QosDisk>> {
        let st = self.lock();
        let d = st.find(socket).ok_or_else(|| st.not_found(socket))?;
        d.qos(nsid)
    }

    /// Gives disk `nsid` of the device on `socket` (NVMe: a namespace;
    /// vhost-user-blk: its disk, `nsid` absent or 1) a new size while the guest
    /// uses it (decision 0018).
    pub fn resize(
        &self,
        socket: &Path,
        nsid: Option<u32>,
        req: crate::resize::ResizeRequest,
    ) -> Result<crate::resize::Resized, crate::resize::ResizeError> {
        let mut st = self.lock();
        let Some(at) = st.position(socket) else {
            return Err(st.not_found(socket).into());
        };
        let r = st.devices[at].resize(nsid, &req)?;
        let sock = st.devices[at].socket().to_path_buf();
        st.backends.resized(&sock, nsid.unwrap_or(1), r.new_bytes);
        tracing::info!(
            socket = %sock.display(),
            nsid = nsid.unwrap_or(1),
            old_bytes = r.old_bytes,
            new_bytes = r.new_bytes,
            notified = r.notified,
            "disk resized: {}",
            r.notice
        );
        Ok(r)
    }

    /// How the queues of the vhost-user-blk device on `socket` wait for work
    /// (`busy`, `adaptive`, `event`), applied while they run.
    pub fn set_poll_mode(&self, socket: &Path, mode: engine::PollMode) -> Result<()> {
        let mut st = self.lock();
        let Some(at) = st.position(socket) else {
            return Err(st.not_found(socket));
        };
        st.devices[at].set_poll_mode(mode)
    }

    pub fn set_placement(&self, socket: &Path, placement: engine::Placement) -> Result<()> {
        let mut st = self.lock();
        let Some(at) = st.position(socket) else {
            return Err(st.not_found(socket));
        };
        let index = st.devices[..at]
            .iter()
            .filter(|d| d.as_vhost().is_some())
            .count();
        let d = &mut st.devices[at];
        if let Some(dev) = d.as_nvme_mut() {
            if placement == engine::Placement::Dedicated {
                bail!(
                    "placement `dedicated` is available for vhost-user-blk devices only; \
                     use round-robin or single for NVMe controller {}",
                    socket.display()
                );
            }
            dev.set_placement(placement, self.base_reactors);
            return Ok(());
        }
        let Some(v) = d.as_vhost_mut() else {
            bail!(
                "{} is {}: it has no queue placement",
                socket.display(),
                d.what()
            );
        };
        let mut cfg = v.cfg.clone();
        cfg.placement = placement;
        self.check_reactor_budget(&cfg)?;
        let reactors =
            crate::vhost_device::reactors_for(&cfg, index, &self.engine, self.base_reactors)?;
        v.dev
            .move_queues(&reactors)
            .with_context(|| format!("cannot move the queues of {}", socket.display()))?;
        v.cfg = cfg;
        Ok(())
    }

    /// Refuses `dedicated` placement that would grow the engine past [`MAX_REACTORS`].
    fn check_reactor_budget(&self, cfg: &VhostBlkConfig) -> Result<()> {
        if cfg.placement == engine::Placement::Dedicated
            && self.engine.num_reactors() + usize::from(cfg.queues) > MAX_REACTORS
        {
            bail!(
                "dedicated placement would need {} more reactors and the server has {} of at most {MAX_REACTORS} \
                 (reactor threads stay until shutdown); use round-robin or single",
                cfg.queues,
                self.engine.num_reactors()
            );
        }
        Ok(())
    }
}
