//! Drives an NVMe namespace of an `NvmeDriver`: one queue pair per job.

use super::config::{IoDone, IoTarget, JobQueue, Op};
use crate::cmd::Completion;
use crate::error::{Error, Result};
use crate::nvme::NvmeDriver;
use crate::pool::DmaBuf;
use crate::qpair::{DataMode, IoOp, QpairOpts, QueuePair};

pub struct NvmeTarget<'a> {
    driver: &'a NvmeDriver,
    nsid: u32,
    lba_size: u32,
    size: u64,
    mode: DataMode,
    interrupts: bool,
    /// Entries per queue; `None`: one more than the job's depth (the smallest).
    entries: Option<u16>,
}

impl<'a> NvmeTarget<'a> {
    pub fn new(driver: &'a NvmeDriver, nsid: u32, mode: DataMode) -> Result<NvmeTarget<'a>> {
        let ns = driver
            .namespace(nsid)
            .ok_or_else(|| Error::Invalid(format!("namespace {nsid} not found")))?;
        Ok(NvmeTarget {
            driver,
            nsid,
            lba_size: ns.lba_size,
            size: ns.size_bytes(),
            mode,
            interrupts: false,
            entries: None,
        })
    }

    /// Creates the jobs' completion queues with interrupts enabled (an eventfd per
    /// queue, as a VM's driver has), so the controller signals; jobs still poll.
    pub fn with_interrupts(mut self, on: bool) -> Self {
        self.interrupts = on;
        self
    }

    /// Queues of `entries` entries (at most the controller's CAP.MQES + 1) instead of
    /// one more than the depth: Linux's driver creates 1024-entry queues whatever the
    /// depth, so a doorbell's EventIdx may lag far behind it.
    pub fn with_queue_entries(mut self, entries: Option<u16>) -> Self {
        self.entries = entries;
        self
    }
}

impl IoTarget for NvmeTarget<'_> {
    fn block_size(&self) -> u32 {
        self.lba_size
    }
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn open_job(&self, _job: u32, slots: u32, buf_len: u32) -> Result<Box<dyn JobQueue + '_>> {
        if let Some(m) = self.driver.max_xfer() {
            if buf_len as u64 > m {
                return Err(Error::Invalid(format!(
                    "bs {buf_len} exceeds the controller's MDTS ({m} bytes)"
                )));
            }
        }
        let max = self.driver.cap().max_queue_entries;
        let depth = u16::try_from(slots + 1)
            .ok()
            .filter(|d| *d as u32 <= max)
            .ok_or_else(|| {
                Error::Invalid(format!("qd {slots} exceeds the controller's queue size"))
            })?;
        let depth = match self.entries {
            Some(e) if u32::from(e) > max || e < depth => {
                return Err(Error::Invalid(format!(
                "{e} queue entries: the controller takes {max} at most, qd {slots} needs {depth}"
            )))
            }
            Some(e) => e,
            None => depth,
        };
        let per_buf = (buf_len as u64).div_ceil(4096) * 4096;
        let mut qp = self.driver.create_qpair_with(QpairOpts {
            depth,
            interrupts: self.interrupts,
            data_bytes: per_buf * slots as u64,
            max_xfer: buf_len,
            ..Default::default()
        })?;
        let bufs = (0..slots)
            .map(|_| qp.alloc_buf(buf_len as usize))
            .collect::<Result<Vec<_>>>()?;
        Ok(Box::new(NvmeJob {
            cid_slot: vec![u32::MAX; depth as usize],
            comps: Vec::with_capacity(depth as usize),
            qp,
            bufs,
            nsid: self.nsid,
            lba_size: self.lba_size,
            mode: self.mode,
        }))
    }
}

pub struct NvmeJob {
    qp: QueuePair,
    bufs: Vec<DmaBuf>,
    cid_slot: Vec<u32>,
    comps: Vec<Completion>,
    nsid: u32,
    lba_size: u32,
    mode: DataMode,
}

impl NvmeJob {
    fn buf(&self, slot: u32) -> Result<&DmaBuf> {
        self.bufs
            .get(slot as usize)
            .ok_or_else(|| Error::Invalid(format!("no buffer slot {slot}")))
    }
}

impl JobQueue for NvmeJob {
    fn submit(&mut self, op: Op, offset: u64, len: u32, slot: u32) -> Result<()> {
        let buf = self.buf(slot)?;
        if len as usize != buf.len()
            || !offset.is_multiple_of(self.lba_size as u64)
            || !len.is_multiple_of(self.lba_size)
        {
            return Err(Error::Invalid(
                "I/O not aligned to the buffer and LBA size".into(),
            ));
        }
        let op = match op {
            Op::Read => IoOp::Read,
            Op::Write => IoOp::Write,
        };
        let slba = offset / self.lba_size as u64;
        let nlb = len / self.lba_size;
        // Split borrow: the buffer lives in `bufs`, the queue in `qp`.
        let cid = self.qp.submit_io(
            op,
            self.nsid,
            slba,
            nlb,
            Some(&self.bufs[slot as usize]),
            self.mode,
        )?;
        if let Some(s) = self.cid_slot.get_mut(cid as usize) {
            *s = slot;
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<()> {
        self.qp.ring()
    }

    fn poll(&mut self, out: &mut Vec<IoDone>) -> Result<usize> {
        self.comps.clear();
        let cap = self.comps.capacity();
        self.qp.poll_into(cap, &mut self.comps)?;
        let mut n = 0;
        for c in &self.comps {
            match self.cid_slot.get_mut(c.cid as usize) {
                Some(s) if *s != u32::MAX => {
                    out.push(IoDone {
                        slot: *s,
                        status: c.status.code(),
                    });
                    *s = u32::MAX;
                    n += 1;
                }
                // A completion for nothing we submitted: the controller is confused.
                _ => tracing::warn!(cid = c.cid, "completion for an unknown command id"),
            }
        }
        Ok(n)
    }

    /// Sleeps on the completion queue's interrupt (queues created with
    /// interrupts, `--irq`); without one it polls like `poll`.
    fn poll_wait(&mut self, out: &mut Vec<IoDone>, timeout: std::time::Duration) -> Result<usize> {
        let n = self.poll(out)?;
        if n > 0 || self.qp.irq_fd().is_none() {
            return Ok(n);
        }
        // The controller posts the entry before it signals: one more poll after
        // the interrupt finds it.
        self.qp.block_on_irq(timeout)?;
        self.poll(out)
    }

    fn write_buf(&mut self, slot: u32, off: usize, data: &[u8]) -> Result<()> {
        self.buf(slot)?.write(off, data)
    }

    fn read_buf(&mut self, slot: u32, off: usize, out: &mut [u8]) -> Result<()> {
        self.buf(slot)?.read(off, out)
    }
}
