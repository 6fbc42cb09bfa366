//! `udrive serve`: start reactors and devices, print how to attach, run until a signal.

use std::path::PathBuf;

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::config::{Config, ControllerConfig};
use crate::device::{qemu_command, NvmeDevice};
use crate::nsspec::NsSpec;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// vfio-user socket of the NVMe controller [default: ./udrive-nvme.sock]
    #[arg(long, value_name = "SOCKET", conflicts_with = "config")]
    pub vfio_user: Option<PathBuf>,
    /// Namespace, repeatable: null:SIZE or ram:SIZE, optional ,bs=512|4096 [default: ram:1G]
    #[arg(long = "ns", value_name = "SPEC", conflicts_with = "config")]
    pub ns: Vec<NsSpec>,
    /// CPUs for reactor threads, one reactor per CPU (e.g. 0 or 0-1 or 0,2)
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<String>,
    /// Queue placement over reactors: round-robin or single (vhost-user-blk also: dedicated)
    #[arg(long, default_value = "round-robin", conflicts_with = "config")]
    pub placement: String,
    #[command(flatten)]
    pub vhost: crate::vhost_device::VhostArgs,
    /// I/O queue pairs the controller offers
    #[arg(long, default_value_t = crate::config::default_io_queues(), conflicts_with = "config")]
    pub io_queues: u16,
    /// TOML configuration with several controllers (see docs/config.md)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

impl ServeArgs {
    fn into_config(self) -> Result<Config> {
        let mut cfg = match &self.config {
            Some(path) => Config::load(path)?,
            None if self.vhost.vhost_user_blk.is_some()
                && self.vfio_user.is_none()
                && self.ns.is_empty() =>
            {
                Config {
                    cpus: crate::config::default_cpus(),
                    controllers: Vec::new(),
                    vhost_user_blk: Vec::new(),
                }
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
                c.placement = self.placement.clone();
                c.io_queues = self.io_queues;
                Config {
                    cpus: crate::config::default_cpus(),
                    controllers: vec![c],
                    vhost_user_blk: Vec::new(),
                }
            }
        };
        if let Some(d) = self.vhost.to_config(&self.placement)? {
            cfg.vhost_user_blk.push(d);
        }
        if let Some(cpus) = self.cpus {
            cfg.cpus = cpus;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    let cfg = args.into_config()?;
    let cpus = engine::parse_cpu_list(&cfg.cpus).map_err(anyhow::Error::msg)?;
    let online = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(bad) = cpus.iter().find(|c| **c >= online) {
        anyhow::bail!(
            "--cpus names CPU {bad}, but this machine has CPUs 0-{}",
            online - 1
        );
    }
    let (backends, disks) = crate::vhost_device::open_backends(&cfg)?;
    // Signals are routed into the iterator before any thread starts.
    let mut signals = Signals::new([SIGINT, SIGTERM]).context("cannot install signal handlers")?;
    let engine = engine::Engine::start(&cpus.iter().map(|c| Some(*c)).collect::<Vec<_>>())
        .context("cannot start reactors")?;
    tracing::info!(reactors = engine.num_reactors(), cpus = %cfg.cpus, "reactors started");

    let mut devices = Vec::new();
    for (i, (c, devs)) in cfg.controllers.iter().zip(backends).enumerate() {
        match NvmeDevice::start(c, devs, (i + 1) as u16, &engine) {
            Ok(d) => devices.push(d),
            Err(e) => {
                devices.into_iter().for_each(NvmeDevice::stop);
                engine.shutdown();
                return Err(e);
            }
        }
    }
    let blk = match crate::vhost_device::start_all(&cfg, disks, &engine, cpus.len()) {
        Ok(b) => b,
        Err(e) => {
            devices.into_iter().for_each(NvmeDevice::stop);
            engine.shutdown();
            return Err(e);
        }
    };
    for d in &devices {
        println!(
            "udrive: NVMe controller on {} with namespaces {}",
            d.socket.display(),
            d.namespaces.join(", ")
        );
    }
    if !devices.is_empty() {
        println!("\nAttach a VM (QEMU 10.1+; guest RAM must be a shared memfd):\n");
        for d in &devices {
            println!("{}\n", qemu_command(&d.socket));
        }
        println!(
            "Or measure it: udrive perf --vfio-user {} --rw randread --bs 4096 --qd 32 --time 10",
            devices[0].socket.display()
        );
    }
    crate::vhost_device::print_attach(&cfg);
    println!("Stop with Ctrl-C.");

    let sig = signals.forever().next();
    tracing::info!(signal = ?sig, "shutting down");
    for d in devices {
        d.stop();
    }
    blk.into_iter().for_each(vhost_user_blk::VhostUserBlk::stop);
    engine.shutdown();
    Ok(())
}
