//! A vhost-user-blk device driven through libblkio (the `blkio` crate's
//! `virtio-blk-vhost-user` driver), as a target for udrive's workload generator.
//! libblkio is an independent client, so `udrive perf --vhost-user` measures udrive
//! and other vhost-user-blk servers (qemu-storage-daemon) the same way.

use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::Mutex;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use guest_mem::DmaSlice;
use initiator::workload::{IoDone, IoTarget, JobQueue, Op};
use initiator::Error;

pub const DRIVER: &str = "virtio-blk-vhost-user";

pub struct BlkioTarget {
    blkio: Mutex<Blkio>,
    queues: Mutex<Vec<Option<Blkioq>>>,
    region: MemoryRegion,
    /// Bytes of `region` each job may use.
    per_job: usize,
    block_size: u32,
    capacity: u64,
}

fn err(what: &str, e: blkio::Error) -> Error {
    Error::Invalid(format!("libblkio: {what}: {}", e.message()))
}

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to.max(1)) * to.max(1)
}

impl BlkioTarget {
    /// Connects to `socket` with `jobs` queues and buffers for `qd` I/Os of `bs`
    /// bytes per job.
    pub fn connect(socket: &Path, jobs: u32, qd: u32, bs: u32) -> Result<BlkioTarget, Error> {
        let mut b = Blkio::new(DRIVER).map_err(|e| err("driver", e))?;
        let path = socket
            .to_str()
            .ok_or_else(|| Error::Invalid("socket path is not UTF-8".into()))?;
        b.set_str("path", path).map_err(|e| err("path", e))?;
        b.connect()
            .map_err(|e| err(&format!("cannot connect to {}", socket.display()), e))?;
        let max_queues = b.get_i32("max-queues").map_err(|e| err("max-queues", e))?;
        if jobs as i64 > max_queues as i64 {
            return Err(Error::Invalid(format!(
                "--jobs {jobs} needs {jobs} queues but the device offers {max_queues}"
            )));
        }
        b.set_i32("num-queues", jobs as i32)
            .map_err(|e| err("num-queues", e))?;
        let capacity = b.get_u64("capacity").map_err(|e| err("capacity", e))?;
        let block_size = b
            .get_i32("request-alignment")
            .map_err(|e| err("request-alignment", e))?
            .max(512) as u32;
        let align = b
            .get_u64("mem-region-alignment")
            .map_err(|e| err("mem-region-alignment", e))? as usize;
        let page = guest_mem::page_size();
        let per_job = round_up(qd as usize * round_up(bs as usize, page), align.max(page));
        let started = b.start().map_err(|e| err("start", e))?;
        let region = b
            .alloc_mem_region(per_job * jobs as usize)
            .map_err(|e| err("alloc_mem_region", e))?;
        b.map_mem_region(&region)
            .map_err(|e| err("map_mem_region", e))?;
        Ok(BlkioTarget {
            blkio: Mutex::new(b),
            queues: Mutex::new(started.queues.into_iter().map(Some).collect()),
            region,
            per_job,
            block_size,
            capacity,
        })
    }

    /// The buffer memory of job `job`.
    fn job_mem(&self, job: u32) -> Option<DmaSlice<'_>> {
        // SAFETY: libblkio mapped `region` (read/write, shared) and keeps it until
        // `self.blkio` is dropped, which outlives the returned borrow of `self`; the
        // job windows are disjoint and inside the region (checked by the caller).
        let all = unsafe { DmaSlice::from_raw_parts(self.region.addr as *mut u8, self.region.len) };
        all.sub(job as usize * self.per_job, self.per_job)
    }
}

impl IoTarget for BlkioTarget {
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn size_bytes(&self) -> u64 {
        self.capacity
    }
    fn open_job(
        &self,
        job: u32,
        slots: u32,
        buf_len: u32,
    ) -> Result<Box<dyn JobQueue + '_>, Error> {
        let stride = round_up(buf_len as usize, guest_mem::page_size());
        if slots as usize * stride > self.per_job {
            return Err(Error::Invalid(format!(
                "{slots} buffers of {buf_len} bytes do not fit the memory set up for this run"
            )));
        }
        let mem = self
            .job_mem(job)
            .ok_or_else(|| Error::Invalid(format!("no buffer memory for job {job}")))?;
        let q = self
            .queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(job as usize)
            .and_then(Option::take)
            .ok_or_else(|| Error::Invalid(format!("no libblkio queue for job {job}")))?;
        Ok(Box::new(BlkioJob {
            q,
            mem,
            stride,
            buf_len: buf_len as usize,
            comps: (0..slots.max(1)).map(|_| MaybeUninit::uninit()).collect(),
        }))
    }
}

impl Drop for BlkioTarget {
    fn drop(&mut self) {
        let mut b = self.blkio.lock().unwrap_or_else(|e| e.into_inner());
        b.unmap_mem_region(&self.region);
        b.free_mem_region(&self.region);
    }
}

struct BlkioJob<'a> {
    q: Blkioq,
    mem: DmaSlice<'a>,
    stride: usize,
    buf_len: usize,
    comps: Vec<MaybeUninit<Completion>>,
}

impl BlkioJob<'_> {
    fn buf(&self, slot: u32) -> Result<DmaSlice<'_>, Error> {
        self.mem
            .sub(slot as usize * self.stride, self.buf_len)
            .ok_or_else(|| Error::Invalid(format!("no buffer slot {slot}")))
    }
}

impl JobQueue for BlkioJob<'_> {
    fn submit(&mut self, op: Op, offset: u64, len: u32, slot: u32) -> Result<(), Error> {
        let buf = self.buf(slot)?;
        if len as usize != buf.len() {
            return Err(Error::Invalid("I/O length differs from its buffer".into()));
        }
        let ptr = buf.as_ptr();
        match op {
            Op::Read => self
                .q
                .read(offset, ptr, len as usize, slot as usize, ReqFlags::empty()),
            Op::Write => self
                .q
                .write(offset, ptr, len as usize, slot as usize, ReqFlags::empty()),
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<(), Error> {
        // libblkio submits in do_io; poll() calls it.
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<IoDone>) -> Result<usize, Error> {
        self.reap(out, 0, None)
    }

    /// libblkio sleeps on the queue's completion fd until one request completes.
    fn poll_wait(
        &mut self,
        out: &mut Vec<IoDone>,
        timeout: std::time::Duration,
    ) -> Result<usize, Error> {
        let mut t = timeout;
        self.reap(out, 1, Some(&mut t))
    }

    fn write_buf(&mut self, slot: u32, off: usize, data: &[u8]) -> Result<(), Error> {
        self.buf(slot)?
            .write_from(off, data)
            .map_err(|_| Error::Invalid("write beyond buffer".into()))
    }

    fn read_buf(&mut self, slot: u32, off: usize, out: &mut [u8]) -> Result<(), Error> {
        self.buf(slot)?
            .read_into(off, out)
            .map_err(|_| Error::Invalid("read beyond buffer".into()))
    }
}

impl BlkioJob<'_> {
    /// Submits what is queued and collects completions: at least `min` of them,
    /// waiting up to `timeout` (libblkio's `do_io`).
    fn reap(
        &mut self,
        out: &mut Vec<IoDone>,
        min: usize,
        timeout: Option<&mut std::time::Duration>,
    ) -> Result<usize, Error> {
        let n = match self.q.do_io(&mut self.comps, min, timeout, None) {
            Ok(n) => n,
            // The timeout passed with nothing completed.
            Err(e) if min > 0 && e.errno() == blkio::Errno::TIME => 0,
            Err(e) => return Err(err("do_io", e)),
        };
        for c in &self.comps[..n.min(self.comps.len())] {
            // SAFETY: do_io initialised the first `n` completions.
            let c = unsafe { c.assume_init_ref() };
            out.push(IoDone {
                slot: c.user_data as u32,
                status: if c.ret == 0 {
                    0
                } else {
                    c.ret.unsigned_abs().min(u16::MAX as u32) as u16
                },
            });
        }
        Ok(n)
    }
}
