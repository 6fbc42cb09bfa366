//! `udrive serve`: start reactors and devices, print how to attach, run until a signal.

use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::config::{Config, ControllerConfig};
use crate::handover::snapshot::ServerSnapshot;
use crate::handover::take::Takeover;
use crate::metrics::MetricsServer;
use crate::nsspec::NsSpec;
use crate::process::{Process, METRICS_LISTENER_KEY, RPC_LISTENER_KEY};
use crate::rpc::{Rpc, RpcServer};
use crate::sandboxing::Sandboxing;
use crate::server::Server;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// vfio-user socket of the NVMe controller [default: ./udrive-nvme.sock]
    #[arg(long, value_name = "SOCKET", conflicts_with = "config")]
    pub vfio_user: Option<PathBuf>,
    /// Namespace, repeatable: null:SIZE, ram:SIZE, file:PATH, qcow2:PATH or rbd:POOL/IMAGE, with options (docs/config.md) [default: ram:1G]
    #[arg(long = "ns", value_name = "SPEC", conflicts_with = "config")]
    pub ns: Vec<NsSpec>,
    /// CPUs for reactor threads, one reactor per CPU (e.g. 0 or 0-1 or 0,2)
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<String>,
    /// CPUs for librados'/librbd's threads (RBD backends) [default: the CPUs the
    /// reactors do not use]; may include reactor CPUs when their queues sleep
    /// (adaptive, event), never useful with busy polling
    #[arg(long, value_name = "LIST")]
    pub rbd_cpus: Option<String>,
    /// Queue placement over reactors: round-robin or single (vhost-user-blk also: dedicated)
    #[arg(long, default_value = "round-robin", conflicts_with = "config")]
    pub placement: engine::Placement,
    /// How queues wait for work: busy (spin), adaptive (spin, sleep when idle) or event (sleep whenever idle)
    #[arg(long, default_value = "adaptive", conflicts_with = "config")]
    pub poll: engine::PollMode,
    /// Idle time in µs after which an adaptive NVMe queue group sleeps
    #[arg(long, value_name = "US", default_value_t = crate::config::default_poll_idle_us(), conflicts_with = "config")]
    pub poll_idle_us: u64,
    #[command(flatten)]
    pub vhost: crate::vhost_device::VhostArgs,
    /// I/O queue pairs the controller offers
    #[arg(long, default_value_t = crate::config::default_io_queues(), conflicts_with = "config")]
    pub io_queues: u16,
    /// TOML configuration with several controllers (see docs/config.md)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// JSON-RPC control socket (docs/rpc.md); `udrive rpc` talks to it
    #[arg(long, value_name = "SOCKET")]
    pub rpc: Option<PathBuf>,
    /// File mode of the control socket, octal
    #[arg(long, value_name = "MODE", default_value = "0600", value_parser = sockfile::parse_mode)]
    pub rpc_mode: u32,
    /// File mode of the device sockets (vfio-user, vhost-user), octal; a VMM running
    /// as another user needs e.g. 0660 with --socket-group [default: 0600]
    #[arg(long, value_name = "MODE", value_parser = check_mode)]
    pub socket_mode: Option<String>,
    /// Group of the device sockets, by name or number
    #[arg(long, value_name = "GROUP", value_parser = check_group)]
    pub socket_group: Option<String>,
    /// Serve Prometheus metrics over HTTP at ADDR:PORT (GET /metrics)
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Run the server under a small supervisor that keeps NVMe clients connected
    /// and restarts the server if it dies (docs/decisions/0021-supervise.md)
    #[arg(long)]
    pub supervise: bool,
    /// Set by the supervisor on its child: stdin is the supervisor's channel
    #[arg(long, hide = true, conflicts_with = "supervise")]
    pub supervised: bool,
    /// Take every device over from the udrive serving this control socket, with
    /// its current configuration, while its clients stay connected (see `udrive
    /// upgrade`; docs/decisions/0022-live-handover.md)
    #[arg(long, value_name = "RPC_SOCKET", conflicts_with_all = ["config", "vfio_user", "ns", "supervise", "supervised", "rpc"])]
    pub takeover: Option<PathBuf>,
    /// What a thread's system call outside its role's list does (docs/security.md):
    /// `on` stops the server with a line naming the role and the call, `log` lets
    /// it through for the kernel's log, `off` installs no filters [default: on, or
    /// $UDRIVE_SECCOMP]
    #[arg(long, value_name = "on|log|off")]
    pub seccomp: Option<sandbox::Mode>,
    /// Whether Landlock limits the files the server opens after start-up to the
    /// paths the configuration names and --allow-dir (docs/security.md) [default:
    /// on, or $UDRIVE_LANDLOCK]
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    pub landlock: Option<String>,
    /// A directory where devices added at run time (RPC, reload) may keep their
    /// files and sockets, repeatable (allow_dirs in the TOML file)
    #[arg(long = "allow-dir", value_name = "DIR")]
    pub allow_dirs: Vec<PathBuf>,
    /// Run as this user (with its groups) from start-up on: sockets, disks and
    /// the control socket must be reachable to it; no capability is kept
    #[arg(long, value_name = "NAME")]
    pub user: Option<String>,
    /// With --user: this group instead of the user's own
    #[arg(long, value_name = "NAME", requires = "user")]
    pub group: Option<String>,
}

fn check_mode(s: &str) -> Result<String, String> {
    sockfile::parse_mode(s).map(|_| s.to_string())
}

fn check_group(s: &str) -> Result<String, String> {
    sockfile::parse_group(s).map(|_| s.to_string())
}

impl ServeArgs {
    fn into_config(self) -> Result<Config> {
        let cfg = self.into_unchecked_config()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration these arguments describe (the file, with the command
    /// line's additions), parsed but not validated: `udrive check` validates it
    /// further than `serve` can before starting.
    pub fn into_unchecked_config(self) -> Result<Config> {
        let mut cfg = match &self.config {
            Some(path) => Config::load(path)?,
            None if self.vhost.vhost_user_blk.is_some()
                && self.vfio_user.is_none()
                && self.ns.is_empty() =>
            {
                Config::default()
            }
            None => {
                let socket = self
                    .vfio_user
                    .clone()
                    .unwrap_or_else(|| PathBuf::from("./udrive-nvme.sock"));
                let ns = if self.ns.is_empty() {
                    vec!["ram:1G".parse().map_err(anyhow::Error::msg)?]
                } else {
                    self.ns.clone()
                };
                let mut c = ControllerConfig::new(socket, ns);
                c.placement = self.placement;
                c.io_queues = self.io_queues;
                c.poll = self.poll;
                c.poll_idle_us = self.poll_idle_us;
                Config {
                    controllers: vec![c],
                    ..Config::default()
                }
            }
        };
        if let Some(d) = self.vhost.to_config(self.placement, self.poll)? {
            cfg.vhost_user_blk.push(d);
        }
        if let Some(cpus) = self.cpus {
            cfg.cpus = cpus;
        }
        if self.rbd_cpus.is_some() {
            cfg.rbd_cpus = self.rbd_cpus;
        }
        if self.rpc.is_some() {
            cfg.rpc = self.rpc;
        }
        if self.metrics_listen.is_some() {
            cfg.metrics_listen = self.metrics_listen;
        }
        if self.socket_mode.is_some() {
            cfg.socket_mode = self.socket_mode;
        }
        if self.socket_group.is_some() {
            cfg.socket_group = self.socket_group;
        }
        cfg.allow_dirs.extend(self.allow_dirs);
        // Devices without their own socket mode/group get the defaults.
        let defaults = cfg.socket_defaults();
        for c in &mut cfg.controllers {
            let p = c.socket_perms().or(&defaults);
            c.set_socket_perms(p);
        }
        for d in &mut cfg.vhost_user_blk {
            let p = d.socket_perms().or(&defaults);
            d.set_socket_perms(p);
        }
        Ok(cfg)
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    let rpc_mode = args.rpc_mode;
    let supervised = args.supervised;
    let sandbox = Sandboxing::from_args(&args)?;
    if let Some(from) = &args.takeover {
        return run_takeover(from, &sandbox);
    }
    if args.supervise {
        // Checked here, where errors reach the user, before the child starts.
        args.into_config()?;
        let args = std::env::args_os()
            .skip(1)
            .filter(|a| a != "--supervise")
            .collect();
        return crate::supervise::run(args);
    }
    let cfg = args.into_config()?;
    sandbox.enter(&cfg)?;
    let process = if supervised {
        Process::supervised()?
    } else {
        Process::standalone()
    };
    // Signals are routed into the iterator before any thread starts.
    let signals =
        Signals::new([SIGINT, SIGTERM, SIGHUP]).context("cannot install signal handlers")?;
    let running = start(&cfg, rpc_mode, process.clone())?;
    running.print_banner();
    process.ready();
    crate::systemd::ready(running.server.lock().devices.len());
    running.run_until_signal(signals)
}

/// `serve --takeover`: takes every device over from the process serving the
/// control socket `from` (crate::handover) and serves them.
fn run_takeover(from: &Path, sandbox: &Sandboxing) -> Result<()> {
    let got = Takeover::receive(from)?;
    if let Err(e) = got.snapshot.config().and_then(|cfg| sandbox.enter(&cfg)) {
        got.takeover.abort(&e);
        return Err(e.context("takeover failed; the running udrive resumed its devices"));
    }
    crate::handover::take::fail_point("start");
    let process = Process::taking_over(got.records, got.takeover.channel()?);
    // The running process holds QEMU's locks on the images until it exits; the
    // same locks taken here are not checked against its (bdev::image_lock).
    bdev::image_lock::set_taking_over(true);
    let (running, jobs) = match start_taken_over(&got.snapshot, &process) {
        Ok(r) => r,
        Err(e) => {
            bdev::image_lock::set_taking_over(false);
            got.takeover.abort(&e);
            return Err(e.context("takeover failed; the running udrive resumed its devices"));
        }
    };
    let signals =
        Signals::new([SIGINT, SIGTERM, SIGHUP]).context("cannot install signal handlers")?;
    crate::systemd::main_pid();
    got.takeover.confirm()?;
    process.commit();
    // The jobs' threads start once the old process let go (it held its own
    // between two steps until then), before the guest's first request.
    crate::jobs::handover::launch(&running.server, jobs);
    for d in running.server.lock().devices.iter_mut() {
        d.resume();
    }
    got.takeover.finish();
    bdev::image_lock::set_taking_over(false);
    running.print_banner();
    crate::systemd::ready(running.server.lock().devices.len());
    running.run_until_signal(signals)
}

/// Starts what a handover sent: configuration, listeners, devices (paused) on
/// the images their disks served, with the QoS limits set at run time, and the
/// block jobs set up again (their threads not started); checks every device's
/// restored state.
fn start_taken_over(
    snap: &ServerSnapshot,
    process: &Arc<Process>,
) -> Result<(Running, crate::jobs::handover::Pending)> {
    let cfg = snap.config()?;
    crate::jobs::handover::log_served(&snap.active_images);
    let served = snap.active_images.iter();
    process.set_served(served.map(|a| (a.spec.clone(), a.active.clone())).collect());
    let running = start(&cfg, 0o600, process.clone());
    process.set_served(Vec::new());
    let running = running?;
    for q in &snap.qos {
        running
            .server
            .with_qos(&q.socket, Some(q.nsid), |d| Ok(d.set_limits(q.limits())?))
            .with_context(|| format!("cannot restore QoS of {}", q.socket.display()))?;
    }
    for d in &running.server.lock().devices {
        d.check_restored()?;
    }
    let jobs = crate::jobs::handover::restore(&running.server, &snap.jobs, snap.last_job_id)?;
    process.ready();
    Ok((running, jobs))
}

/// A started server: engine, devices, control socket and metrics endpoint.
pub struct Running {
    engine: Arc<engine::Engine>,
    pub server: Arc<Server>,
    rpc: Option<RpcServer>,
    metrics: Option<MetricsServer>,
}

/// Starts reactors, devices (restoring what `process` inherited for them), the
/// control socket and metrics (on the listeners `process` inherited, if any); on
/// error everything started is stopped.
pub fn start(cfg: &Config, rpc_mode: u32, process: Arc<Process>) -> Result<Running> {
    let cpus = engine::parse_cpu_list(&cfg.cpus).map_err(anyhow::Error::msg)?;
    engine::check_allowed(&cpus).map_err(|e| anyhow::anyhow!("--cpus {}: {e}", cfg.cpus))?;
    let rbd_cpus = cfg.rbd_cpu_list()?;
    if let Some(shared) = rbd_cpus
        .as_ref()
        .filter(|r| r.iter().any(|c| cpus.contains(c)))
    {
        tracing::info!(
            rbd_cpus = ?shared,
            reactors = ?cpus,
            "librbd's threads may run on reactor CPUs: fine while those queues sleep (adaptive, event), costly beside busy polling"
        );
    }
    #[cfg(feature = "rbd")]
    process.set_library_cpus(crate::kinds::rbd::thread_cpus(&cpus, rbd_cpus.as_deref()));
    let disks = crate::config::disk_specs(cfg);
    let (backend_set, backends, disk_devs) =
        crate::backends::open_all_set(process.clone(), &cfg.controllers, &disks)?;
    let engine = engine::Engine::start(&cpus.iter().map(|c| Some(*c)).collect::<Vec<_>>())
        .context("cannot start reactors")?;
    tracing::info!(reactors = engine.num_reactors(), cpus = %cfg.cpus, "reactors started");
    let server = match Server::start(
        cfg,
        backend_set,
        backends,
        disk_devs,
        engine.clone(),
        process.clone(),
    ) {
        Ok(s) => s,
        Err(e) => {
            engine.shutdown();
            return Err(e);
        }
    };
    let control = start_control(cfg, rpc_mode, &server, &process);
    match control {
        Ok((rpc, metrics)) => Ok(Running {
            engine,
            server,
            rpc,
            metrics,
        }),
        Err(e) => {
            server.stop_devices();
            engine.shutdown();
            Err(e)
        }
    }
}

/// The control socket and the metrics endpoint, on inherited listeners if a
/// predecessor passed them on.
fn start_control(
    cfg: &Config,
    rpc_mode: u32,
    server: &Arc<Server>,
    process: &Process,
) -> Result<(Option<RpcServer>, Option<MetricsServer>)> {
    let rpc = match &cfg.rpc {
        Some(path) => {
            let rpc = Arc::new(Rpc::new(server.clone()));
            let r = match process.take_listener(RPC_LISTENER_KEY) {
                Some(l) => RpcServer::start_on(path, UnixListener::from(l), rpc),
                None => RpcServer::start(path, rpc_mode, rpc),
            };
            Some(r.with_context(|| format!("cannot listen on control socket {}", path.display()))?)
        }
        None => None,
    };
    let metrics = match cfg.metrics_listen {
        Some(addr) => {
            let m = match process.take_listener(METRICS_LISTENER_KEY) {
                Some(l) => MetricsServer::start_on(TcpListener::from(l), server.clone()),
                None => MetricsServer::start(addr, server.clone()),
            };
            Some(m.with_context(|| format!("cannot serve metrics on {addr}"))?)
        }
        None => None,
    };
    Ok((rpc, metrics))
}

impl Running {
    fn reload(&self) {
        let Some(path) = self.server.config_file.clone() else {
            tracing::warn!("SIGHUP: this server was not started with --config; nothing to re-read");
            return;
        };
        if let Err(e) = crate::reload::reload(&self.server, &path) {
            tracing::error!("SIGHUP: configuration not reloaded: {e:#}");
        }
    }

    pub fn print_banner(&self) {
        print_banner(&self.server, self.rpc.as_ref(), self.metrics.as_ref());
    }

    /// Serves until SIGINT or SIGTERM, then stops everything; SIGHUP re-reads the
    /// configuration file.
    pub fn run_until_signal(self, mut signals: Signals) -> Result<()> {
        let sig = signals.forever().find(|&s| {
            if s == SIGHUP {
                self.reload();
            }
            s != SIGHUP
        });
        tracing::info!(signal = ?sig, "shutting down");
        crate::systemd::stopping();
        // Control plane first, so no request races the teardown.
        drop(self.metrics);
        drop(self.rpc);
        self.server.stop_devices();
        self.engine.shutdown();
        Ok(())
    }
}

/// What to attach and how. A closed stdout does not stop the server: its devices
/// matter more than its banner.
fn print_banner(server: &Server, rpc: Option<&RpcServer>, metrics: Option<&MetricsServer>) {
    let st = server.lock();
    let mut text = String::new();
    for d in &st.devices {
        text.push_str(&format!("{}\n", d.banner()));
    }
    if let Some(r) = rpc {
        text.push_str(&format!(
            "udrive: control socket {} ({} rpc --rpc {} rpc_get_methods)\n",
            r.path().display(),
            crate::stdout::self_command(),
            r.path().display()
        ));
    }
    if let Some(m) = metrics {
        text.push_str(&format!("udrive: metrics on http://{}/metrics\n", m.addr()));
    }
    for d in &st.devices {
        text.push_str(&format!("{}\n", d.attach_hint()));
    }
    text.push_str("Stop with Ctrl-C.");
    if let Err(e) = crate::outln!("{text}") {
        tracing::warn!("cannot print how to attach: {e}");
    }
}
