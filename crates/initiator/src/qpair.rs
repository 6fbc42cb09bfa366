//! One submission/completion queue pair, owned by one thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use crate::cmd::{opc, Completion, CqRing, Sqe, PSDT_SGL};
use crate::doorbell::Doorbells;
use crate::dptr::{self, BuildError, ListArea, PAGE};
use crate::error::{Error, Result};
use crate::nvme::Shared;
use crate::pool::{Chunk, DmaBuf, Pool};
use crate::regs::Cap;

/// Skipped doorbells a queue pair counts before adding them to the shared count.
const SKIPS_PER_ADD: u64 = 1024;

/// What queue pairs share with the driver (and nothing that could form a cycle).
#[derive(Debug)]
pub(crate) struct QpCtx {
    pub pool: Arc<Pool>,
    pub db: Doorbells,
    /// Bumped by every controller reset; queue pairs of older generations are stale.
    pub gen: AtomicU64,
    pub cap: Cap,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpairOpts {
    /// Queue entries (the pair keeps at most `depth - 1` commands in flight).
    pub depth: u16,
    /// Enable the CQ interrupt and bind an eventfd to MSI-X vector `qid`.
    pub interrupts: bool,
    /// Bytes of data buffers `alloc_buf` can hand out.
    pub data_bytes: u64,
    /// Largest transfer `submit_io` builds lists for (sizes the per-command list memory).
    pub max_xfer: u32,
    /// PRP entries per list page (2..=512); below 512 forces list chaining.
    pub prp_list_entries: u32,
    /// SGL mode: data blocks per transfer.
    pub sgl_split: u32,
    /// SGL mode: descriptors per segment (>= 2); small values force Segment chains.
    pub sgl_segment_descs: u32,
}

impl Default for QpairOpts {
    fn default() -> Self {
        QpairOpts {
            depth: 128,
            interrupts: false,
            data_bytes: 1 << 20,
            max_xfer: 128 << 10,
            prp_list_entries: dptr::MAX_PRP_PER_PAGE,
            sgl_split: 1,
            sgl_segment_descs: (PAGE / 16) as u32,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataMode {
    Prp,
    Sgl,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    Read,
    Write,
    Flush,
    WriteZeroes,
}

pub struct QueuePair {
    qid: u16,
    depth: u16,
    ctx: Arc<QpCtx>,
    /// Set for I/O queues so dropping one deletes it on the controller.
    owner: Option<Arc<Shared>>,
    gen: u64,
    sq: Chunk,
    cq_mem: Chunk,
    lists: Chunk,
    list_stride: u64,
    data: Arc<Chunk>,
    data_used: u64,
    sq_tail: u16,
    sq_head: u16,
    rung_tail: u16,
    cq: CqRing,
    free_cids: Vec<u16>,
    busy: Vec<bool>,
    stash: Vec<Completion>,
    irq: Option<EventFd>,
    opts: QpairOpts,
    db_sq: u64,
    db_cq: u64,
    /// Doorbell writes skipped and not yet added to the controller's count.
    skipped: u64,
    pub(crate) deleted: bool,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qid", &self.qid)
            .field("depth", &self.depth)
            .field("sq_tail", &self.sq_tail)
            .field("sq_head", &self.sq_head)
            .field("cq", &self.cq)
            .finish()
    }
}

/// Bytes of list memory one command needs for the given options.
fn list_bytes(o: &QpairOpts) -> u64 {
    // The worst case buffer starts just before a page boundary.
    let prp = dptr::prp_list_pages(PAGE - 4, o.max_xfer as u64, o.prp_list_entries) * PAGE;
    let sgl = dptr::sgl_area_bytes(o.max_xfer as u64, o.sgl_split, o.sgl_segment_descs);
    prp.max(sgl).max(1).div_ceil(PAGE) * PAGE
}

impl QueuePair {
    pub(crate) fn new(
        ctx: Arc<QpCtx>,
        qid: u16,
        opts: QpairOpts,
        owner: Option<Arc<Shared>>,
    ) -> Result<QueuePair> {
        let depth = opts.depth;
        if depth < 2 || depth as u32 > ctx.cap.max_queue_entries {
            return Err(Error::Invalid(format!(
                "queue depth {depth} outside 2..={}",
                ctx.cap.max_queue_entries
            )));
        }
        if !(2..=dptr::MAX_PRP_PER_PAGE).contains(&opts.prp_list_entries)
            || opts.sgl_segment_descs < 2
        {
            return Err(Error::Invalid("bad PRP/SGL layout knobs".into()));
        }
        let sq = ctx.pool.alloc(depth as u64 * 64)?;
        let cq_mem = ctx.pool.alloc(depth as u64 * 16)?;
        let list_stride = list_bytes(&opts);
        let lists = ctx.pool.alloc(list_stride * depth as u64)?;
        let data = Arc::new(ctx.pool.alloc(opts.data_bytes)?);
        let gen = ctx.gen.load(Ordering::Acquire);
        Ok(QueuePair {
            qid,
            depth,
            gen,
            sq,
            cq_mem,
            lists,
            list_stride,
            data,
            data_used: 0,
            sq_tail: 0,
            sq_head: 0,
            rung_tail: 0,
            cq: CqRing::new(depth),
            free_cids: (0..depth - 1).rev().collect(),
            busy: vec![false; depth as usize],
            stash: Vec::with_capacity(depth as usize),
            irq: None,
            opts,
            db_sq: ctx.cap.doorbell(qid, false),
            db_cq: ctx.cap.doorbell(qid, true),
            ctx,
            owner,
            skipped: 0,
            deleted: false,
        })
    }

    pub fn qid(&self) -> u16 {
        self.qid
    }
    pub fn depth(&self) -> u16 {
        self.depth
    }
    pub fn opts(&self) -> &QpairOpts {
        &self.opts
    }
    pub(crate) fn sq_iova(&self) -> u64 {
        self.sq.iova()
    }
    pub(crate) fn cq_iova(&self) -> u64 {
        self.cq_mem.iova()
    }
    pub(crate) fn set_irq(&mut self, fd: EventFd) {
        self.irq = Some(fd);
    }
    pub(crate) fn set_owner(&mut self, owner: Arc<Shared>) {
        self.owner = Some(owner);
    }
    pub(crate) fn owner(&self) -> Option<&Arc<Shared>> {
        self.owner.as_ref()
    }

    /// Commands submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        (self.depth as usize - 1) - self.free_cids.len()
    }

    /// Changes PRP/SGL layout knobs for later commands; they must fit the list memory
    /// reserved at creation.
    pub fn set_layout(
        &mut self,
        prp_list_entries: u32,
        sgl_split: u32,
        sgl_segment_descs: u32,
    ) -> Result<()> {
        let o = QpairOpts {
            prp_list_entries,
            sgl_split,
            sgl_segment_descs,
            ..self.opts
        };
        if !(2..=dptr::MAX_PRP_PER_PAGE).contains(&prp_list_entries)
            || sgl_segment_descs < 2
            || list_bytes(&o) > self.list_stride
        {
            return Err(Error::Invalid(
                "layout does not fit this queue's list memory".into(),
            ));
        }
        self.opts = o;
        Ok(())
    }

    /// Carves a page-aligned buffer out of this pair's data memory. Meant for setup:
    /// buffers are not returned until the pair is dropped.
    pub fn alloc_buf(&mut self, len: usize) -> Result<DmaBuf> {
        let need = (len.max(1) as u64).div_ceil(PAGE) * PAGE;
        if self.data_used + need > self.data.len {
            return Err(Error::NoResources("queue pair data memory exhausted"));
        }
        let off = self.data.off + self.data_used;
        let iova = self.data.iova() + self.data_used;
        self.data_used += need;
        Ok(DmaBuf::new(
            self.data.mem().clone(),
            off,
            iova,
            len,
            Some(self.data.clone()),
        ))
    }

    fn check_gen(&self) -> Result<()> {
        if self.deleted || self.ctx.gen.load(Ordering::Acquire) != self.gen {
            return Err(Error::Stale);
        }
        Ok(())
    }

    fn take_cid(&mut self) -> Result<u16> {
        self.check_gen()?;
        if (self.sq_tail + 1) % self.depth == self.sq_head {
            return Err(Error::NoResources("submission queue full"));
        }
        let cid = self
            .free_cids
            .pop()
            .ok_or(Error::NoResources("no free command id"))?;
        self.busy[cid as usize] = true;
        Ok(cid)
    }

    fn put_cid(&mut self, cid: u16) {
        if let Some(b) = self.busy.get_mut(cid as usize) {
            if *b {
                *b = false;
                self.free_cids.push(cid);
            }
        }
    }

    fn push(&mut self, sqe: &Sqe) {
        let off = self.sq_tail as usize * 64;
        // In bounds by construction: the SQ chunk holds `depth` entries.
        let _ = self.sq.slice().write_obj(off, sqe);
        self.sq_tail = (self.sq_tail + 1) % self.depth;
    }

    /// Queues a raw SQE (its CID is replaced); the doorbell is rung by `ring`.
    pub fn submit(&mut self, mut sqe: Sqe) -> Result<u16> {
        let cid = self.take_cid()?;
        sqe.cid = cid;
        self.push(&sqe);
        Ok(cid)
    }

    /// Queues a Read/Write/Flush/Write Zeroes. `nlb` is the block count; the transfer
    /// length is `buf.len()`.
    pub fn submit_io(
        &mut self,
        op: IoOp,
        nsid: u32,
        slba: u64,
        nlb: u32,
        buf: Option<&DmaBuf>,
        mode: DataMode,
    ) -> Result<u16> {
        let code = match op {
            IoOp::Read => opc::READ,
            IoOp::Write => opc::WRITE,
            IoOp::Flush => opc::FLUSH,
            IoOp::WriteZeroes => opc::WRITE_ZEROES,
        };
        let mut sqe = if op == IoOp::Flush {
            Sqe {
                nsid,
                ..Sqe::new(code)
            }
        } else {
            if !(1..=65536).contains(&nlb) {
                return Err(Error::Invalid(format!("nlb {nlb} outside 1..=65536")));
            }
            Sqe::rw(code, nsid, slba, nlb)
        };
        let cid = self.take_cid()?;
        if matches!(op, IoOp::Read | IoOp::Write) {
            let Some(buf) = buf else {
                self.put_cid(cid);
                return Err(Error::Invalid("read/write needs a buffer".into()));
            };
            if let Err(e) = self.fill_dptr(&mut sqe, cid, buf, mode) {
                self.put_cid(cid);
                return Err(Error::Invalid(format!("cannot describe buffer: {e:?}")));
            }
        }
        sqe.cid = cid;
        self.push(&sqe);
        Ok(cid)
    }

    fn fill_dptr(
        &self,
        sqe: &mut Sqe,
        cid: u16,
        buf: &DmaBuf,
        mode: DataMode,
    ) -> std::result::Result<(), BuildError> {
        let off = cid as u64 * self.list_stride;
        let area = ListArea {
            slice: self
                .lists
                .slice()
                .sub(off as usize, self.list_stride as usize)
                .ok_or(BuildError::ListTooSmall)?,
            iova: self.lists.iova() + off,
        };
        let len = buf.len() as u64;
        match mode {
            DataMode::Prp => {
                sqe.dptr = dptr::build_prp(buf.iova(), len, self.opts.prp_list_entries, &area)?;
            }
            DataMode::Sgl => {
                let d = dptr::build_sgl(
                    buf.iova(),
                    len,
                    self.opts.sgl_split,
                    self.opts.sgl_segment_descs,
                    &area,
                )?;
                sqe.dptr = [
                    u64::from_le_bytes(d[..8].try_into().unwrap_or_default()),
                    u64::from_le_bytes(d[8..].try_into().unwrap_or_default()),
                ];
                sqe.flags |= PSDT_SGL;
            }
        }
        Ok(())
    }

    fn doorbell(&mut self, bar_off: u64, v: u16) -> Result<()> {
        if self.ctx.db.write(bar_off, u32::from(v))? {
            self.skipped += 1;
            if self.skipped == SKIPS_PER_ADD {
                self.add_skipped();
            }
        }
        Ok(())
    }

    fn add_skipped(&mut self) {
        self.ctx
            .db
            .skipped
            .fetch_add(self.skipped, Ordering::Relaxed);
        self.skipped = 0;
    }

    /// Tells the controller about everything queued since the last ring.
    pub fn ring(&mut self) -> Result<()> {
        self.check_gen()?;
        if self.sq_tail != self.rung_tail {
            self.doorbell(self.db_sq, self.sq_tail)?;
            self.rung_tail = self.sq_tail;
        }
        Ok(())
    }

    fn reap(&mut self, c: Completion) {
        // A hostile or buggy controller may report any head or CID; only trust sane ones.
        if c.sq_head < self.depth {
            self.sq_head = c.sq_head;
        }
        self.put_cid(c.cid);
    }

    /// Appends up to `max` completions to `out` (no allocation if `out` has room).
    pub fn poll_into(&mut self, max: usize, out: &mut Vec<Completion>) -> Result<usize> {
        self.check_gen()?;
        let mut n = 0;
        while n < max {
            let Some(c) = self.stash.pop() else { break };
            out.push(c);
            n += 1;
        }
        let mut popped = false;
        while n < max {
            let ring = self.cq_mem.slice();
            let Some(cqe) = self.cq.pop(&ring) else { break };
            let c = Completion::from(cqe);
            self.reap(c);
            out.push(c);
            popped = true;
            n += 1;
        }
        if popped {
            self.doorbell(self.db_cq, self.cq.head)?;
        }
        Ok(n)
    }

    /// Convenience wrapper of `poll_into` that allocates.
    pub fn poll(&mut self, max: usize) -> Result<Vec<Completion>> {
        let mut v = Vec::new();
        self.poll_into(max, &mut v)?;
        Ok(v)
    }

    /// Waits for the completion of `cid`; completions of other commands seen meanwhile
    /// are kept for the next `poll`.
    pub fn wait(&mut self, cid: u16, timeout: Duration) -> Result<Completion> {
        if let Some(i) = self.stash.iter().position(|c| c.cid == cid) {
            return Ok(self.stash.swap_remove(i));
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            self.check_gen()?;
            let ring = self.cq_mem.slice();
            if let Some(cqe) = self.cq.pop(&ring) {
                let c = Completion::from(cqe);
                self.reap(c);
                self.doorbell(self.db_cq, self.cq.head)?;
                if c.cid == cid {
                    return Ok(c);
                }
                self.stash.push(c);
                continue;
            }
            spins += 1;
            if spins.is_multiple_of(1024) {
                if start.elapsed() > timeout {
                    return Err(Error::Timeout("waiting for a completion"));
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// The completion of `cid` if it has arrived (without waiting); completions of
    /// other commands seen meanwhile are kept for the next `poll`.
    pub fn try_take(&mut self, cid: u16) -> Result<Option<Completion>> {
        if let Some(i) = self.stash.iter().position(|c| c.cid == cid) {
            return Ok(Some(self.stash.swap_remove(i)));
        }
        self.check_gen()?;
        loop {
            let ring = self.cq_mem.slice();
            let Some(cqe) = self.cq.pop(&ring) else {
                return Ok(None);
            };
            let c = Completion::from(cqe);
            self.reap(c);
            self.doorbell(self.db_cq, self.cq.head)?;
            if c.cid == cid {
                return Ok(Some(c));
            }
            self.stash.push(c);
        }
    }

    /// Submit, ring and wait in one go; a non-success status becomes `Error::Nvme`.
    pub fn execute(&mut self, sqe: Sqe, timeout: Duration) -> Result<Completion> {
        let cid = self.submit(sqe)?;
        self.ring()?;
        let c = self.wait(cid, timeout)?;
        if !c.status.is_ok() {
            return Err(Error::Nvme(c.status));
        }
        Ok(c)
    }

    pub fn irq_fd(&self) -> Option<&EventFd> {
        self.irq.as_ref()
    }

    /// Sleeps until this pair's interrupt fires or `timeout` passes, consuming the
    /// interrupt (`Ok(false)` on timeout). Unlike [`QueuePair::wait_irq`] it blocks
    /// in the kernel (no polling interval).
    pub fn block_on_irq(&self, timeout: Duration) -> Result<bool> {
        let Some(fd) = &self.irq else {
            return Err(Error::Invalid("queue pair has no interrupt".into()));
        };
        if !crate::scm::wait_readable(crate::scm::borrow_eventfd(fd), timeout)? {
            return Ok(false);
        }
        match fd.read() {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits for this pair's interrupt eventfd to fire (`Ok(false)` on timeout).
    pub fn wait_irq(&self, timeout: Duration) -> Result<bool> {
        let Some(fd) = &self.irq else {
            return Err(Error::Invalid("queue pair has no interrupt".into()));
        };
        let start = Instant::now();
        loop {
            match fd.read() {
                Ok(_) => return Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
            if start.elapsed() > timeout {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Forgets all queue state, as after a controller reset (admin queue reuse).
    pub(crate) fn reset_state(&mut self) {
        self.sq_tail = 0;
        self.sq_head = 0;
        self.rung_tail = 0;
        self.cq = CqRing::new(self.depth);
        self.cq_mem.slice().fill(0);
        self.free_cids = (0..self.depth - 1).rev().collect();
        self.busy.iter_mut().for_each(|b| *b = false);
        self.stash.clear();
        self.gen = self.ctx.gen.load(Ordering::Acquire);
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.add_skipped();
        if self.deleted || self.ctx.gen.load(Ordering::Acquire) != self.gen {
            return;
        }
        if let Some(owner) = self.owner.take() {
            if let Err(e) = owner.delete_queues(self.qid) {
                tracing::warn!(qid = self.qid, "deleting queue pair on drop failed: {e}");
            }
        }
    }
}
