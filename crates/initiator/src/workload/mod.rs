//! The workload generator behind `udrive perf`.
//!
//! Each job runs on its own thread with its own queue (`JobQueue`), keeps `qd` I/Os in
//! flight and records per-I/O latency into an HDR histogram; histograms are merged at
//! the end. The target is a trait so the same generator can drive an NVMe namespace
//! (`NvmeTarget`) or, later, a file through io_uring.
//!
//! Verify mode: each job owns a disjoint slice of the target, writes a pattern that
//! names (LBA, generation, job) in every sector, remembers the generation per block and
//! never has two I/Os on one block at a time. Reads of blocks with no known content
//! are counted as `unverified_reads`; for read-only workloads the job first writes its
//! whole slice once (untimed) so every read can be checked.

mod gaps;
mod job;
mod nvme_target;
pub mod pattern;
mod report;

use std::time::Duration;

pub use gaps::Gap;
pub use nvme_target::{NvmeJob, NvmeTarget};
pub use report::{JobReport, LatStats, Report};

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rw {
    RandRead,
    RandWrite,
    Read,
    Write,
    /// Random mix; `read_pct` of I/Os are reads.
    RandRw {
        read_pct: u8,
    },
}

impl Rw {
    pub fn name(&self) -> String {
        match self {
            Rw::RandRead => "randread".into(),
            Rw::RandWrite => "randwrite".into(),
            Rw::Read => "read".into(),
            Rw::Write => "write".into(),
            Rw::RandRw { read_pct } => format!("randrw{read_pct}"),
        }
    }
    fn random(&self) -> bool {
        !matches!(self, Rw::Read | Rw::Write)
    }
    fn read_pct(&self) -> u8 {
        match self {
            Rw::RandRead | Rw::Read => 100,
            Rw::RandWrite | Rw::Write => 0,
            Rw::RandRw { read_pct } => (*read_pct).min(100),
        }
    }
}

impl std::str::FromStr for Rw {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Rw, String> {
        Ok(match s {
            "randread" => Rw::RandRead,
            "randwrite" => Rw::RandWrite,
            "read" => Rw::Read,
            "write" => Rw::Write,
            "randrw" => Rw::RandRw { read_pct: 50 },
            _ => match s.strip_prefix("randrw") {
                Some(p) => Rw::RandRw {
                    read_pct: p
                        .parse()
                        .map_err(|_| format!("bad read percentage in {s}"))?,
                },
                None => return Err(format!("unknown workload {s}")),
            },
        })
    }
}

#[derive(Clone, Debug)]
pub struct WorkloadConfig {
    pub rw: Rw,
    /// Bytes per I/O; a multiple of the target's block size.
    pub bs: u32,
    pub qd: u32,
    pub jobs: u32,
    /// Measured time (after `ramp`).
    pub time: Duration,
    pub verify: bool,
    pub nsid: u32,
    /// Run this long before measuring.
    pub ramp: Duration,
    /// Record the initiator's layers per I/O (`trace::INITIATOR_LAYERS`) into
    /// `Report::trace`; costs a few clock reads per I/O.
    pub trace: bool,
    /// Seed for offsets (per job: seed + job); fixed seeds make runs repeatable.
    pub seed: u64,
    /// Pause (sleeping) after each batch of completions before the next I/Os are
    /// issued: at QD1 with a think time longer than a server's idle threshold,
    /// every I/O is the first after the server went to sleep. Not part of latency.
    pub think: Duration,
    /// Block on the target's completion notification when nothing has completed
    /// ([`JobQueue::poll_wait`]) instead of spinning: leaves the CPUs to the server
    /// and the backend, which matters when they need them (a Ceph OSD).
    pub wait: bool,
    /// Report the this many longest pauses between consecutive completions of a
    /// job (`Report::gaps`); 0: none.
    pub gaps: usize,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            rw: Rw::RandRead,
            bs: 4096,
            qd: 32,
            jobs: 1,
            time: Duration::from_secs(10),
            verify: false,
            nsid: 1,
            ramp: Duration::ZERO,
            trace: false,
            seed: 0x5eed,
            think: Duration::ZERO,
            wait: false,
            gaps: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

/// One finished I/O, identified by the buffer slot it was submitted with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoDone {
    pub slot: u32,
    /// 0 on success; NVMe (SCT << 8 | SC) or errno for other targets.
    pub status: u16,
}

/// Something the generator can drive: an NVMe namespace, a file, a fake.
pub trait IoTarget: Sync {
    fn block_size(&self) -> u32;
    fn size_bytes(&self) -> u64;
    /// Opens job `job`'s private queue with `slots` buffers of `buf_len` bytes each.
    fn open_job(&self, job: u32, slots: u32, buf_len: u32) -> Result<Box<dyn JobQueue + '_>>;
}

/// A job's queue. Implementations must not allocate in `submit`/`commit`/`poll`.
pub trait JobQueue: Send {
    /// Queues an I/O of `len` bytes at byte `offset` using buffer `slot`.
    fn submit(&mut self, op: Op, offset: u64, len: u32, slot: u32) -> Result<()>;
    /// Makes queued I/Os visible to the device (doorbell, io_uring_enter).
    fn commit(&mut self) -> Result<()>;
    /// Appends finished I/Os to `out`.
    fn poll(&mut self, out: &mut Vec<IoDone>) -> Result<usize>;
    /// As [`JobQueue::poll`], but when nothing has completed blocks up to
    /// `timeout` on the target's completion notification ([`WorkloadConfig::wait`]).
    /// Targets without one do not block.
    fn poll_wait(&mut self, out: &mut Vec<IoDone>, timeout: Duration) -> Result<usize> {
        let _ = timeout;
        self.poll(out)
    }
    fn write_buf(&mut self, slot: u32, off: usize, data: &[u8]) -> Result<()>;
    fn read_buf(&mut self, slot: u32, off: usize, out: &mut [u8]) -> Result<()>;
}

/// DMA pool size an `NvmeDriver` needs to run `cfg` (queues, lists, buffers, slack).
pub fn pool_bytes_for(cfg: &WorkloadConfig) -> u64 {
    let per_job = (cfg.qd as u64 + 1) * (cfg.bs as u64).div_ceil(4096) * 4096
        + (cfg.qd as u64 + 1) * (64 + 16 + 4096 * 2)
        + (1 << 20);
    (per_job * cfg.jobs as u64 + (4 << 20)).max(64 << 20)
}

/// Runs the workload and merges the jobs' results.
pub fn run(target: &dyn IoTarget, cfg: &WorkloadConfig) -> Result<Report> {
    let lba = target.block_size();
    if cfg.bs == 0
        || lba == 0
        || !cfg.bs.is_multiple_of(lba)
        || !(cfg.bs as usize).is_multiple_of(pattern::SECTOR)
    {
        return Err(Error::Invalid(format!(
            "bs {} must be a multiple of the block size {lba} and of 512",
            cfg.bs
        )));
    }
    if cfg.qd == 0 || cfg.jobs == 0 {
        return Err(Error::Invalid("qd and jobs must be at least 1".into()));
    }
    let total_blocks = target.size_bytes() / cfg.bs as u64;
    if total_blocks < cfg.jobs as u64 {
        return Err(Error::Invalid(
            "target smaller than one block per job".into(),
        ));
    }
    let results: Vec<Result<job::JobResult>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cfg.jobs)
            .map(|j| {
                let region = if cfg.verify {
                    let per = total_blocks / cfg.jobs as u64;
                    (j as u64 * per, per)
                } else {
                    (0, total_blocks)
                };
                s.spawn(move || job::run_job(target, cfg, j, region))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Invalid("job thread panicked".into())))
            })
            .collect()
    });
    let mut jobs = Vec::with_capacity(results.len());
    for r in results {
        jobs.push(r?);
    }
    Ok(job::merge(cfg, jobs))
}

#[cfg(test)]
mod tests;
