//! `udrive perf`: drive a device with udrive's own initiator and report IOPS and
//! latency, as text or JSON.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use initiator::workload::{self, NvmeTarget, Rw, WorkloadConfig};
use initiator::{DataMode, DriverOpts, NvmeDriver};

#[derive(clap::Args, Debug)]
pub struct PerfArgs {
    /// vfio-user socket of an NVMe controller
    #[arg(
        long,
        value_name = "SOCKET",
        required_unless_present = "vhost_user",
        conflicts_with = "vhost_user"
    )]
    pub vfio_user: Option<PathBuf>,
    /// vhost-user-blk socket, driven through libblkio (jobs = virtqueues)
    #[arg(long, value_name = "SOCKET")]
    pub vhost_user: Option<PathBuf>,
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
    /// Describe data with SGLs instead of PRPs
    #[arg(long)]
    pub sgl: bool,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
    /// CPUs the jobs may run on (e.g. 1); default: any
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<String>,
}

fn seconds(what: &str, s: f64) -> Result<Duration> {
    if !s.is_finite() || !(0.0..=86_400.0).contains(&s) {
        bail!("--{what} must be between 0 and 86400 seconds");
    }
    Ok(Duration::from_secs_f64(s))
}

pub fn run(a: PerfArgs) -> Result<()> {
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
        nsid: a.nsid,
        ..Default::default()
    };
    if cfg.qd == 0 || cfg.qd > 4096 || cfg.jobs == 0 || cfg.jobs > 256 {
        bail!("--qd must be 1..=4096 and --jobs 1..=256");
    }
    if let Some(list) = &a.cpus {
        pin_process(list)?;
    }
    if let Some(sock) = &a.vhost_user {
        let target = crate::blkio_target::BlkioTarget::connect(sock, cfg.jobs, cfg.qd, cfg.bs)
            .with_context(|| {
                format!(
                    "cannot bring up the vhost-user-blk device at {}",
                    sock.display()
                )
            })?;
        if !a.json {
            eprintln!(
                "udrive perf: {} (libblkio {}) {} bs={} qd={} jobs={} for {:.1}s ...",
                sock.display(),
                crate::blkio_target::DRIVER,
                rw.name(),
                cfg.bs,
                cfg.qd,
                cfg.jobs,
                cfg.time.as_secs_f64(),
            );
        }
        return finish(&a, workload::run(&target, &cfg).context("workload failed")?);
    }
    let Some(vfio_user) = a.vfio_user.clone() else {
        bail!("give --vfio-user SOCKET or --vhost-user SOCKET");
    };
    let opts = DriverOpts {
        pool_bytes: workload::pool_bytes_for(&cfg),
        io_queues: u16::try_from(cfg.jobs).unwrap_or(u16::MAX),
        ..Default::default()
    };
    let driver = NvmeDriver::connect(&vfio_user, opts).with_context(|| {
        format!(
            "cannot bring up the NVMe controller at {}",
            vfio_user.display()
        )
    })?;
    let mode = if a.sgl { DataMode::Sgl } else { DataMode::Prp };
    let target = NvmeTarget::new(&driver, a.nsid, mode)
        .with_context(|| format!("namespace {} of {}", a.nsid, vfio_user.display()))?;
    if !a.json {
        eprintln!(
            "udrive perf: {} {} bs={} qd={} jobs={} for {:.1}s on nsid {} ({}) ...",
            vfio_user.display(),
            rw.name(),
            cfg.bs,
            cfg.qd,
            cfg.jobs,
            cfg.time.as_secs_f64(),
            a.nsid,
            driver.controller().model.trim(),
        );
    }
    let report = workload::run(&target, &cfg).context("workload failed")?;
    finish(&a, report)
}

fn finish(a: &PerfArgs, report: workload::Report) -> Result<()> {
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{report}");
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
