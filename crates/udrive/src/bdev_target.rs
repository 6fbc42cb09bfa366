//! The bare baselines of `udrive perf --file` and `--rbd`: the workload generator
//! drives a backend through its own `bdev` channel, i.e. the very io_uring (or
//! librbd) code a `file:` (`rbd:`) namespace uses behind the NVMe controller, with
//! no vfio-user, no controller and no reactor in between. The difference between
//! the two runs is udrive's overhead.
//!
//! Each job opens its own channel (its own ring) and keeps its buffers in one
//! page-aligned anonymous mapping, so O_DIRECT never needs a bounce buffer.

use std::io;
use std::sync::Arc;

use bdev::{BlockDevice, IoChannel, IoOp, IoRequest, IoStatus};
use guest_mem::MappedRegion;
use initiator::workload::{IoDone, IoTarget, JobQueue, Op};
use initiator::{Error, Result};

pub struct BdevTarget {
    disk: Arc<dyn BlockDevice>,
}

impl BdevTarget {
    pub fn new(disk: Arc<dyn BlockDevice>) -> BdevTarget {
        BdevTarget { disk }
    }
}

fn io_err(what: &str, e: io::Error) -> Error {
    Error::Invalid(format!("{what}: {e}"))
}

impl IoTarget for BdevTarget {
    fn block_size(&self) -> u32 {
        self.disk.info().block_size
    }
    fn size_bytes(&self) -> u64 {
        self.disk.info().size_bytes()
    }
    fn open_job(&self, _job: u32, slots: u32, buf_len: u32) -> Result<Box<dyn JobQueue + '_>> {
        let stride = u64::from(buf_len).div_ceil(4096) * 4096;
        let total = stride
            .checked_mul(u64::from(slots))
            .filter(|t| *t > 0)
            .ok_or_else(|| Error::Invalid("no buffers requested".into()))?;
        let bufs = MappedRegion::anonymous(0, total).map_err(|e| io_err("buffers", e))?;
        let chan = self.disk.channel().map_err(|e| io_err("channel", e))?;
        Ok(Box::new(BdevJob {
            chan,
            bufs,
            stride,
            buf_len,
            inline: Vec::with_capacity(slots as usize),
        }))
    }
}

/// One job's ring and buffers. Field order matters: the channel (which may still
/// hold pointers into `bufs` for in-flight I/O and waits for them on drop) is
/// dropped before the buffers are unmapped.
struct BdevJob {
    chan: Box<dyn IoChannel>,
    bufs: MappedRegion,
    stride: u64,
    buf_len: u32,
    /// Requests the channel finished inside `submit` (errors such as out of range),
    /// reported on the next `poll`.
    inline: Vec<IoDone>,
}

/// A non-zero code per failure, in NVMe terms (SCT << 8 | SC) so bare and udrive
/// runs report errors alike.
fn code(st: IoStatus, write: bool) -> u16 {
    use frontend_core::Protocol;
    let op = if write { IoOp::Write } else { IoOp::Read };
    nvme::Nvme::code(nvme::Nvme::from_io(st, op))
}

impl JobQueue for BdevJob {
    fn submit(&mut self, op: Op, offset: u64, len: u32, slot: u32) -> Result<()> {
        if len > self.buf_len {
            return Err(Error::Invalid(format!(
                "I/O of {len} bytes exceeds the buffer"
            )));
        }
        let buf = self
            .bufs
            .slice(u64::from(slot) * self.stride, len as usize)
            .ok_or_else(|| Error::Invalid(format!("no buffer slot {slot}")))?;
        let write = op == Op::Write;
        let req = IoRequest {
            op: if write { IoOp::Write } else { IoOp::Read },
            offset,
            len: u64::from(len),
            iov: std::slice::from_ref(&buf),
            fua: false,
        };
        if let Some(st) = self.chan.submit(u64::from(slot), &req) {
            self.inline.push(IoDone {
                slot,
                status: code(st, write),
            });
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<()> {
        self.chan.flush();
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<IoDone>) -> Result<usize> {
        let mut n = self.inline.len();
        out.append(&mut self.inline);
        n += self.chan.poll(&mut |tag, st| {
            // Writes and reads both map to a non-zero code on failure; which one
            // does not matter to the generator.
            out.push(IoDone {
                slot: tag as u32,
                status: code(st, false),
            })
        });
        Ok(n)
    }

    /// Sleeps on the channel's completion notifier (io_uring's ring fd, librbd's
    /// eventfd) when nothing has completed.
    fn poll_wait(&mut self, out: &mut Vec<IoDone>, timeout: std::time::Duration) -> Result<usize> {
        let n = self.poll(out)?;
        if n > 0 || self.chan.arm_notifier() != bdev::Armed::Fd {
            return Ok(n);
        }
        if let Some(fd) = self.chan.notifier() {
            use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
            let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
            let _ = poll(
                &mut [PollFd::new(fd, PollFlags::POLLIN)],
                PollTimeout::from(ms),
            );
        }
        self.poll(out)
    }

    fn write_buf(&mut self, slot: u32, off: usize, data: &[u8]) -> Result<()> {
        self.buf(slot)?
            .write_from(off, data)
            .map_err(|_| Error::Invalid("write beyond the buffer".into()))
    }

    fn read_buf(&mut self, slot: u32, off: usize, out: &mut [u8]) -> Result<()> {
        self.buf(slot)?
            .read_into(off, out)
            .map_err(|_| Error::Invalid("read beyond the buffer".into()))
    }
}

impl BdevJob {
    fn buf(&self, slot: u32) -> Result<guest_mem::DmaSlice<'_>> {
        self.bufs
            .slice(u64::from(slot) * self.stride, self.buf_len as usize)
            .ok_or_else(|| Error::Invalid(format!("no buffer slot {slot}")))
    }
}
