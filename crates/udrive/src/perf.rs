//! `udrive perf`: drive a device with udrive's own initiator and report IOPS and
//! latency, as text or JSON. `--vfio-user SOCKET` drives an NVMe controller;
//! `--file PATH` drives a file or block device directly through io_uring (the
//! bare-metal baseline, see `bdev_target`); `--rbd POOL/IMAGE` drives a Ceph RBD
//! image directly through librbd.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bdev::BlockDevice;
use initiator::workload::{self, NvmeTarget, Report, Rw, WorkloadConfig};
use initiator::{DataMode, DriverOpts, NvmeDriver};

use crate::bdev_target::BdevTarget;

#[derive(clap::Args, Debug)]
pub struct PerfArgs {
    /// vfio-user socket of an NVMe controller
    #[arg(
        long,
        value_name = "SOCKET",
        required_unless_present_any = ["vhost_user", "file", "rbd"],
        conflicts_with_all = ["vhost_user", "file", "rbd"]
    )]
    pub vfio_user: Option<PathBuf>,
    /// vhost-user-blk socket, driven through libblkio (jobs = virtqueues)
    #[arg(long, value_name = "SOCKET", conflicts_with_all = ["file", "rbd"])]
    pub vhost_user: Option<PathBuf>,
    /// Drive this file or block device directly through io_uring (bare-metal baseline)
    #[arg(long, value_name = "PATH", conflicts_with = "rbd")]
    pub file: Option<PathBuf>,
    /// Drive this Ceph RBD image directly through librbd (the baseline of `rbd:`
    /// namespaces): POOL/IMAGE with an `rbd:` spec's options, e.g.
    /// `rbd/vm1,conf=/etc/ceph/ceph.conf,id=admin`
    #[cfg(feature = "rbd")]
    #[arg(long, value_name = "POOL/IMAGE[,OPTS]")]
    pub rbd: Option<String>,
    /// With --file: O_DIRECT (on) or the page cache (off)
    #[arg(long, default_value = "on", value_parser = ["on", "off"], requires = "file")]
    pub direct: String,
    /// With --file: I/O engine, as a file namespace's `engine=` (auto, uring, inline)
    #[arg(long, default_value = "auto", requires = "file")]
    pub engine: bdev::FileEngine,
    /// Namespace to drive
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// randread | randwrite | read | write | randrw
    #[arg(long, default_value = "randread")]
    pub rw: String,
    /// Percentage of reads for randrw
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub rwmixread: u8,
    /// Bytes per I/O
    #[arg(long, default_value_t = 4096)]
    pub bs: u32,
    /// I/Os in flight per job
    #[arg(long, default_value_t = 1)]
    pub qd: u32,
    /// Jobs (threads), each with its own queue pair
    #[arg(long, default_value_t = 1)]
    pub jobs: u32,
    /// Measured seconds
    #[arg(long, default_value_t = 10.0)]
    pub time: f64,
    /// Seconds to run before measuring
    #[arg(long, default_value_t = 0.0)]
    pub ramp: f64,
    /// Write patterns and check every read against them
    #[arg(long)]
    pub verify: bool,
    /// Think time in µs: each job sleeps this long after a completion before it
    /// issues the next I/O (at --qd 1: the first-I/O-after-idle latency); cut
    /// short at the end of the run, so one as long as the run is an idle client
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub think_us: u64,
    /// Describe data with SGLs instead of PRPs
    #[arg(long)]
    pub sgl: bool,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
    /// NVMe doorbells: auto (into the mapped page when the controller offers it,
    /// else by message) or messages (always REGION_WRITE)
    #[arg(long, default_value = "auto", value_parser = ["auto", "messages"])]
    pub doorbells: String,
    /// NVMe: create completion queues with interrupts (an eventfd each, as a VM's
    /// driver does), so the controller signals them; the jobs still poll
    #[arg(long)]
    pub irq: bool,
    /// Sleep on the target's completion notification when nothing has completed
    /// (NVMe: the CQ interrupt, needs --irq; vhost: libblkio's completion fd;
    /// --file/--rbd: the channel's notifier) instead of spinning: leaves the CPUs to
    /// the server and backend (measure Ceph RBD this way on a small machine)
    #[arg(long)]
    pub wait: bool,
    /// Report the N longest pauses between consecutive completions (what a
    /// client sees of a handover: run `udrive upgrade` meanwhile)
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=1000))]
    pub gaps: u16,
    /// NVMe Interrupt Coalescing to set first (Feature 08h): THRESHOLD:TIME, i.e.
    /// completions per interrupt and the longest delay in 100 µs units (e.g. 7:1)
    #[arg(long, value_name = "THR:TIME", requires = "irq", value_parser = parse_coalescing)]
    pub coalescing: Option<(u8, u8)>,
    /// NVMe shadow doorbells (Doorbell Buffer Config): auto (when doorbells go by
    /// message), on or off
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub shadow_doorbells: String,
    /// NVMe: entries per I/O queue (default: qd + 1, the smallest). Linux's driver
    /// creates 1024-entry queues whatever the depth; --queue-entries 1024 drives
    /// the controller as a Linux guest does
    #[arg(long, value_name = "N", conflicts_with_all = ["vhost_user", "file", "rbd"],
          value_parser = clap::value_parser!(u16).range(2..))]
    pub queue_entries: Option<u16>,
    /// NVMe: map the initiator's DMA memory without its file descriptor, as QEMU
    /// maps guest RAM that is not fd-backed, so that the controller reaches it only
    /// through DMA_READ/DMA_WRITE messages (the slow path; docs/decisions/0020)
    #[arg(long, conflicts_with_all = ["vhost_user", "file"])]
    pub dma_messages: bool,
    /// CPUs the jobs may run on (e.g. 1); default: any
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<String>,
    /// Time every I/O's layers on the initiator side (and on the server's, when it is
    /// reachable) and print the breakdown
    #[arg(long)]
    pub trace: bool,
    /// With --trace: also write a stacked-bar chart of mean time per layer
    #[arg(long, value_name = "PNG", requires = "trace")]
    pub plot: Option<PathBuf>,
    /// Trace every I/O on the server's side only (through --rpc), not the
    /// initiator's: the server's layers, and what tracing costs the server alone
    #[arg(long, requires = "rpc", conflicts_with = "trace")]
    pub trace_server: bool,
    /// With --trace or --trace-server: the server's control socket (`udrive serve
    /// --rpc`), to add the server's layers to the breakdown
    #[arg(long, value_name = "PATH")]
    pub rpc: Option<PathBuf>,
}

/// The server side of `perf --trace`: starts a trace before the workload and reads
/// the server's layer table after it (the control socket for a remote server, the
/// controller itself in-process).
pub trait ServerTrace {
    fn start(&self) -> Result<()>;
    fn stop_and_read(&self) -> Result<trace::Breakdown>;
}

fn seconds(what: &str, s: f64) -> Result<Duration> {
    if !s.is_finite() || !(0.0..=86_400.0).contains(&s) {
        bail!("--{what} must be between 0 and 86400 seconds");
    }
    Ok(Duration::from_secs_f64(s))
}

pub fn run(a: PerfArgs) -> Result<()> {
    run_with(a, None)
}

/// `run`, with the server's layers merged into the trace table when `server` is given.
pub fn run_with(a: PerfArgs, server: Option<&dyn ServerTrace>) -> Result<()> {
    let rw = match a.rw.as_str() {
        "randrw" => Rw::RandRw {
            read_pct: a.rwmixread,
        },
        other => other.parse::<Rw>().map_err(|_| {
            anyhow::anyhow!("--rw {other}: expected randread, randwrite, read, write or randrw")
        })?,
    };
    let cfg = WorkloadConfig {
        rw,
        bs: a.bs,
        qd: a.qd,
        jobs: a.jobs,
        time: seconds("time", a.time)?,
        ramp: seconds("ramp", a.ramp)?,
        verify: a.verify,
        think: Duration::from_micros(a.think_us),
        wait: a.wait,
        gaps: usize::from(a.gaps),
        nsid: a.nsid,
        trace: a.trace,
        ..Default::default()
    };
    if cfg.qd == 0 || cfg.qd > 4096 || cfg.jobs == 0 || cfg.jobs > 256 {
        bail!("--qd must be 1..=4096 and --jobs 1..=256");
    }
    if a.wait && a.vfio_user.is_some() && !a.irq {
        bail!("--wait on an NVMe controller sleeps on CQ interrupts: add --irq");
    }
    if a.rpc.is_some() && !a.trace && !a.trace_server {
        bail!("--rpc reads the server's trace: add --trace or --trace-server");
    }
    if let Some(list) = &a.cpus {
        pin_process(list)?;
    }
    let server = server.filter(|_| a.trace || a.trace_server);
    if let Some(srv) = server {
        srv.start().context("cannot start the server's trace")?;
    }
    #[cfg(feature = "rbd")]
    let rbd = a.rbd.as_deref();
    #[cfg(not(feature = "rbd"))]
    let rbd: Option<&str> = None;
    let mut report = match (&a.vfio_user, &a.vhost_user, &a.file, rbd) {
        (Some(sock), ..) => run_nvme(&a, sock, &cfg)?,
        (None, Some(sock), ..) => run_vhost(&a, sock, &cfg)?,
        (None, None, Some(path), _) => run_file(&a, path, &cfg)?,
        (None, None, None, Some(spec)) => run_rbd(&a, spec, &cfg)?,
        (None, None, None, None) => {
            bail!("give --vfio-user SOCKET, --vhost-user SOCKET, --file PATH or --rbd POOL/IMAGE")
        }
    };
    if let Some(srv) = server {
        let srv = srv
            .stop_and_read()
            .context("cannot read the server's trace")?;
        report.trace = Some(match &report.trace {
            Some(init) => trace::Breakdown::full_path(init, &srv),
            None => srv,
        });
    }
    if a.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
    } else {
        crate::outln!("{report}")?;
        if let Some(t) = &report.trace {
            crate::outln!("\nlayers (µs):\n{}", crate::trace_view::table(t))?;
        }
    }
    if let (Some(t), Some(p)) = (&report.trace, &a.plot) {
        let title = format!("udrive perf {} bs={} qd={}", rw.name(), cfg.bs, cfg.qd);
        crate::trace_view::plot(t, &title, p)?;
    }
    if report.errors > 0 || report.verify_errors > 0 {
        bail!(
            "{} I/O errors, {} verify mismatches",
            report.errors,
            report.verify_errors
        );
    }
    Ok(())
}

fn run_nvme(a: &PerfArgs, sock: &std::path::Path, cfg: &WorkloadConfig) -> Result<Report> {
    let opts = DriverOpts {
        pool_bytes: workload::pool_bytes_for(cfg),
        io_queues: u16::try_from(cfg.jobs).unwrap_or(u16::MAX),
        doorbells_via_messages: a.doorbells == "messages",
        shadow_doorbells: match a.shadow_doorbells.as_str() {
            "on" => Some(true),
            "off" => Some(false),
            _ => None,
        },
        dma_messages: a.dma_messages,
        ..Default::default()
    };
    let driver = NvmeDriver::connect(sock, opts)
        .with_context(|| format!("cannot bring up the NVMe controller at {}", sock.display()))?;
    let mode = if a.sgl { DataMode::Sgl } else { DataMode::Prp };
    if let Some((thr, time)) = a.coalescing {
        let c = driver
            .admin(initiator::Sqe::set_features(
                0x08,
                u32::from(thr) | (u32::from(time) << 8),
            ))
            .context("Set Features (Interrupt Coalescing)")?;
        anyhow::ensure!(
            c.status.is_ok(),
            "Set Features (Interrupt Coalescing): {}",
            c.status
        );
    }
    let target = NvmeTarget::new(&driver, a.nsid, mode)
        .with_context(|| format!("namespace {} of {}", a.nsid, sock.display()))?
        .with_interrupts(a.irq)
        .with_queue_entries(a.queue_entries);
    if !a.json {
        let on = format!(
            "nsid {} ({}; doorbells {}{}{})",
            a.nsid,
            driver.controller().model.trim(),
            if driver.doorbells_mapped() {
                "mapped"
            } else {
                "by message"
            },
            if driver.shadow_doorbells() {
                ", shadow"
            } else {
                ""
            },
            if a.dma_messages {
                "; memory not shared: DMA by messages"
            } else {
                ""
            }
        );
        announce(&sock.display().to_string(), cfg, &on);
    }
    let (messages, skipped) = (driver.doorbell_messages(), driver.doorbells_skipped());
    let served = |d: &NvmeDriver| {
        d.dma_service().map_or((0, 0), |s| {
            let st = &s.stats;
            let l = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            (l(&st.reads), l(&st.writes))
        })
    };
    let dma = served(&driver);
    let report = workload::run(&target, cfg).context("workload failed")?;
    if !a.json {
        crate::outln!(
            "doorbells: {} by message, {} skipped (shadow doorbells, controller polling)",
            driver.doorbell_messages() - messages,
            driver.doorbells_skipped() - skipped
        )?;
        if a.dma_messages {
            let now = served(&driver);
            crate::outln!(
                "DMA messages answered: {} DMA_READ, {} DMA_WRITE",
                now.0 - dma.0,
                now.1 - dma.1
            )?;
        }
    }
    Ok(report)
}

fn run_vhost(a: &PerfArgs, sock: &std::path::Path, cfg: &WorkloadConfig) -> Result<Report> {
    let target = crate::blkio_target::BlkioTarget::connect(sock, cfg.jobs, cfg.qd, cfg.bs)
        .with_context(|| {
            format!(
                "cannot bring up the vhost-user-blk device at {}",
                sock.display()
            )
        })?;
    if !a.json {
        let on = format!("libblkio {}", crate::blkio_target::DRIVER);
        announce(&sock.display().to_string(), cfg, &on);
    }
    workload::run(&target, cfg).context("workload failed")
}

fn run_file(a: &PerfArgs, path: &std::path::Path, cfg: &WorkloadConfig) -> Result<Report> {
    let opts = bdev::FileOptions {
        direct: a.direct == "on",
        // Verify writes its pattern first, even for read workloads.
        read_only: !cfg.verify && matches!(cfg.rw, Rw::RandRead | Rw::Read),
        block_size: None,
        engine: a.engine,
    };
    let disk = bdev::FileDisk::open(path, opts.clone())
        .with_context(|| format!("cannot open {} for I/O", path.display()))?;
    if opts.direct && !disk.direct() {
        eprintln!(
            "udrive perf: {}: O_DIRECT is not supported here; measuring buffered I/O",
            path.display()
        );
    }
    if !a.json {
        announce(&path.display().to_string(), cfg, &disk.describe());
    }
    let target = BdevTarget::new(std::sync::Arc::new(disk));
    workload::run(&target, cfg).context("workload failed")
}

fn run_rbd(a: &PerfArgs, spec: &str, cfg: &WorkloadConfig) -> Result<Report> {
    let ns: crate::nsspec::NsSpec = format!("rbd:{spec}")
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--rbd {spec}: {e}"))?;
    let read_only = !cfg.verify && matches!(cfg.rw, Rw::RandRead | Rw::Read);
    let disk = ns
        .kind
        .0
        .open(
            &crate::kinds::NoEnv,
            ns.block_size,
            read_only || ns.read_only,
        )
        .with_context(|| format!("cannot open rbd:{spec}"))?;
    if !a.json {
        announce(&format!("rbd:{spec}"), cfg, &disk.describe());
    }
    let target = BdevTarget::new(disk);
    workload::run(&target, cfg).context("workload failed")
}

/// The one line `perf` prints before it starts (unless --json).
fn announce(target: &str, cfg: &WorkloadConfig, on: &str) {
    eprintln!(
        "udrive perf: {target} {} bs={} qd={} jobs={} for {:.1}s on {on} ...",
        cfg.rw.name(),
        cfg.bs,
        cfg.qd,
        cfg.jobs,
        cfg.time.as_secs_f64(),
    );
}

/// Restricts this process (and the job threads it starts later) to `list`.
fn pin_process(list: &str) -> Result<()> {
    let cpus = engine::parse_cpu_list(list).map_err(anyhow::Error::msg)?;
    let mut set = nix::sched::CpuSet::new();
    for c in cpus {
        set.set(c)
            .with_context(|| format!("CPU {c} out of range"))?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .with_context(|| format!("cannot run on CPUs {list}"))?;
    Ok(())
}

/// `THR:TIME` of `--coalescing`.
fn parse_coalescing(s: &str) -> Result<(u8, u8), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: expected THRESHOLD:TIME, e.g. 7:1"))?;
    let n = |x: &str| {
        x.trim()
            .parse::<u8>()
            .map_err(|_| format!("`{x}` is not 0..=255"))
    };
    Ok((n(a)?, n(b)?))
}
