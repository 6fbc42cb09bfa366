//! [`SliceDisk`]: a namespace carved out of a shared backend. This is the isolation
//! boundary between VMs sharing one backend, so every request is range-checked
//! against the slice (with checked arithmetic) *before* its offset is translated.

use std::io;
use std::sync::Arc;

use crate::{in_range, BlockDevice, BlockInfo, IoChannel, IoOp, IoRequest, IoStatus, Prefetch};

/// Whether the byte ranges `(offset, len)` `a` and `b` share at least one byte.
/// Empty ranges overlap nothing; ranges reaching past `u64::MAX` are clamped
/// (config validation should reject them separately).
pub fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    if a.1 == 0 || b.1 == 0 {
        return false;
    }
    let a_end = a.0.saturating_add(a.1);
    let b_end = b.0.saturating_add(b.1);
    a.0 < b_end && b.0 < a_end
}

/// `[offset, offset+size)` of `inner`, seen as a device of `size` bytes.
pub struct SliceDisk {
    inner: Arc<dyn BlockDevice>,
    offset: u64,
    info: BlockInfo,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl SliceDisk {
    pub fn new(inner: Arc<dyn BlockDevice>, offset: u64, size: u64) -> io::Result<SliceDisk> {
        let inner_info = inner.info().clone();
        let bs = u64::from(inner_info.block_size);
        let inner_size = inner_info.size_bytes();
        if bs == 0 {
            return Err(invalid(format!("{}: block size is 0", inner.describe())));
        }
        if size == 0 {
            return Err(invalid("slice size must not be 0".into()));
        }
        if !offset.is_multiple_of(bs) {
            return Err(invalid(format!(
                "slice offset {offset} is not a multiple of the block size {bs}"
            )));
        }
        if !size.is_multiple_of(bs) {
            return Err(invalid(format!(
                "slice size {size} is not a multiple of the block size {bs}"
            )));
        }
        let Some(end) = offset.checked_add(size) else {
            return Err(invalid(format!(
                "slice offset {offset} + size {size} overflows"
            )));
        };
        if end > inner_size {
            return Err(invalid(format!(
                "slice [{offset}, {end}) ends past the end of {} ({inner_size} bytes)",
                inner.describe()
            )));
        }
        let info = BlockInfo {
            num_blocks: size / bs,
            ..inner_info
        };
        Ok(SliceDisk {
            inner,
            offset,
            info,
        })
    }

    /// Byte offset of the slice in the inner device.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl BlockDevice for SliceDisk {
    fn describe(&self) -> String {
        format!(
            "slice:{}@{}+{}",
            self.inner.describe(),
            self.offset,
            self.info.size_bytes()
        )
    }
    /// A slice's extent is part of the configuration that keeps tenants apart
    /// (checked for overlaps when it was opened): it does not change at run time.
    fn resize(&self, _bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "a slice keeps the offset= and size= it was opened with; change them in the configuration",
        ))
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(SliceChannel {
            inner: self.inner.channel()?,
            offset: self.offset,
            size: self.info.size_bytes(),
        }))
    }
    fn format_support(&self) -> crate::FormatSupport {
        crate::FormatSupport::Shared
    }
    fn let_go(&self) -> io::Result<()> {
        self.inner.let_go()
    }
    fn take_back(&self, dead_owners: &[String]) -> io::Result<()> {
        self.inner.take_back(dead_owners)
    }
}

struct SliceChannel {
    inner: Box<dyn IoChannel>,
    offset: u64,
    size: u64,
}

impl SliceChannel {
    /// A prefetch hint in the backing device's offsets; `None` outside the slice.
    fn translated<'r>(&self, req: &IoRequest<'r>) -> Option<IoRequest<'r>> {
        let offset = self
            .offset
            .checked_add(req.offset)
            .filter(|_| in_range(req.offset, req.len, self.size))?;
        Some(IoRequest { offset, ..*req })
    }
}

/// Sum of the buffer lengths, `None` on overflow.
fn iov_total(req: &IoRequest<'_>) -> Option<u64> {
    req.iov
        .iter()
        .try_fold(0u64, |acc, b| acc.checked_add(b.len() as u64))
}

impl IoChannel for SliceChannel {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        if req.op == IoOp::Flush {
            return self.inner.submit(tag, req);
        }
        if !in_range(req.offset, req.len, self.size) {
            return Some(IoStatus::OutOfRange);
        }
        // The backend may move data buffer by buffer before it compares the total
        // with `len`; buffers longer than `len` would then reach past the slice.
        if matches!(req.op, IoOp::Read | IoOp::Write) && iov_total(req) != Some(req.len) {
            return Some(IoStatus::Invalid);
        }
        // Cannot overflow: offset + size <= inner size (checked in `new`).
        let translated = IoRequest {
            op: req.op,
            offset: self.offset + req.offset,
            len: req.len,
            iov: req.iov,
            fua: req.fua,
        };
        self.inner.submit(tag, &translated)
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        self.inner.poll(done)
    }

    fn flush(&mut self) {
        self.inner.flush()
    }

    fn room(&self) -> usize {
        self.inner.room()
    }

    fn arm_notifier(&mut self) -> crate::Armed {
        self.inner.arm_notifier()
    }

    fn notifier(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner.notifier()
    }

    fn wake_by(&self) -> Option<std::time::Instant> {
        self.inner.wake_by()
    }

    fn slow_completions(&self) -> bool {
        self.inner.slow_completions()
    }

    fn prefetch(&mut self, req: &IoRequest<'_>, when: Prefetch) {
        if let Some(r) = self.translated(req) {
            self.inner.prefetch(&r, when)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_helper() {
        assert!(overlaps((0, 10), (5, 10)));
        assert!(overlaps((5, 10), (0, 10)));
        assert!(!overlaps((0, 10), (10, 10)));
        assert!(!overlaps((10, 10), (0, 10)));
        assert!(!overlaps((0, 0), (0, 10)));
        assert!(overlaps((0, 100), (10, 1)));
        assert!(overlaps((u64::MAX - 1, 10), (u64::MAX - 5, 5)));
    }
}
