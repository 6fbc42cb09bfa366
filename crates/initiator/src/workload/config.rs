//! What a workload is: its access pattern and parameters, and the target it runs
//! on (`IoTarget`, one `JobQueue` per job).

use std::time::Duration;

use crate::error::Result;

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
    pub(super) fn random(&self) -> bool {
        !matches!(self, Rw::Read | Rw::Write)
    }
    pub(super) fn read_pct(&self) -> u8 {
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
    /// Cut short at the run's end: one as long as the run makes an idle client.
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
