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

mod config;
mod gaps;
mod job;
mod nvme_target;
pub mod pattern;
mod report;

pub use config::{pool_bytes_for, IoDone, IoTarget, JobQueue, Op, Rw, WorkloadConfig};
pub use gaps::Gap;
pub use nvme_target::{NvmeJob, NvmeTarget};
pub use report::{JobReport, LatStats, Report};

use crate::error::{Error, Result};

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
