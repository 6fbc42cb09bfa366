//! [`SliceDisk`]: a namespace carved out of a shared backend. This is the isolation
//! boundary between VMs sharing one backend, so every request is range-checked
//! against the slice (with checked arithmetic) *before* its offset is translated.

use std::io;
use std::sync::Arc;

use crate::{
    in_range, submit_each, Batch, BlockDevice, BlockInfo, ChannelWrapper, DeviceWrapper,
    FormatSupport, IoChannel, IoOp, IoRequest, IoStatus,
};

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

/// Why a slice cannot be cut, or changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    #[error("{device}: block size is 0")]
    NoBlockSize { device: String },
    #[error("slice size must not be 0")]
    Empty,
    #[error("slice offset {offset} is not a multiple of the block size {block_size}")]
    UnalignedOffset { offset: u64, block_size: u64 },
    #[error("slice size {size} is not a multiple of the block size {block_size}")]
    UnalignedSize { size: u64, block_size: u64 },
    #[error("slice offset {offset} + size {size} overflows")]
    Overflow { offset: u64, size: u64 },
    #[error("slice [{offset}, {end}) ends past the end of {device} ({device_size} bytes)")]
    PastEnd {
        offset: u64,
        end: u64,
        device: String,
        device_size: u64,
    },
    /// A slice's extent is part of the configuration that keeps tenants apart.
    #[error(
        "a slice keeps the offset= and size= it was opened with; change them in the configuration"
    )]
    FixedExtent,
}

impl From<SliceError> for io::Error {
    fn from(e: SliceError) -> io::Error {
        let kind = match e {
            SliceError::FixedExtent => io::ErrorKind::Unsupported,
            _ => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

/// `[offset, offset+size)` of `inner`, seen as a device of `size` bytes.
pub struct SliceDisk {
    inner: Arc<dyn BlockDevice>,
    offset: u64,
    info: BlockInfo,
}

impl SliceDisk {
    pub fn new(
        inner: Arc<dyn BlockDevice>,
        offset: u64,
        size: u64,
    ) -> Result<SliceDisk, SliceError> {
        let inner_info = inner.info().clone();
        let block_size = u64::from(inner_info.block_size);
        let device_size = inner_info.size_bytes();
        if block_size == 0 {
            return Err(SliceError::NoBlockSize {
                device: inner.describe(),
            });
        }
        if size == 0 {
            return Err(SliceError::Empty);
        }
        if !offset.is_multiple_of(block_size) {
            return Err(SliceError::UnalignedOffset { offset, block_size });
        }
        if !size.is_multiple_of(block_size) {
            return Err(SliceError::UnalignedSize { size, block_size });
        }
        let Some(end) = offset.checked_add(size) else {
            return Err(SliceError::Overflow { offset, size });
        };
        if end > device_size {
            return Err(SliceError::PastEnd {
                offset,
                end,
                device: inner.describe(),
                device_size,
            });
        }
        let info = BlockInfo {
            num_blocks: size / block_size,
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

impl DeviceWrapper for SliceDisk {
    fn inner(&self) -> &dyn BlockDevice {
        &*self.inner
    }
    fn kind(&self) -> &'static str {
        "slice"
    }
    fn describe(&self) -> String {
        format!(
            "slice:{}@{}+{}",
            self.inner.describe(),
            self.offset,
            self.info.size_bytes()
        )
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
    /// A slice's extent is part of the configuration that keeps tenants apart
    /// (checked for overlaps when it was opened): it does not change at run time.
    fn resize(&self, _bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        Err(SliceError::FixedExtent.into())
    }
    fn rewrap(&self, _inner: Arc<dyn BlockDevice>) -> io::Result<Arc<dyn BlockDevice>> {
        Err(SliceError::FixedExtent.into())
    }
    /// Not the whole backend: control operations of its kind (an RBD image's
    /// snapshots) would reach other tenants' data.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
    fn format_support(&self) -> FormatSupport {
        FormatSupport::Shared
    }
}

struct SliceChannel {
    inner: Box<dyn IoChannel>,
    offset: u64,
    size: u64,
}

impl SliceChannel {
    /// `req` in the backing device's offsets, or how it ends here: outside the
    /// slice, or with buffers that do not add up to its length (the backend may
    /// move data buffer by buffer before it compares the total with `len`;
    /// buffers longer than `len` would then reach past the slice). A flush has no
    /// range and passes as it is.
    fn translate<'r>(&self, req: &IoRequest<'r>) -> Result<IoRequest<'r>, IoStatus> {
        if req.op == IoOp::Flush {
            return Ok(*req);
        }
        if !in_range(req.offset, req.len, self.size) {
            return Err(IoStatus::OutOfRange);
        }
        if matches!(req.op, IoOp::Read | IoOp::Write) && iov_total(req) != Some(req.len) {
            return Err(IoStatus::Invalid);
        }
        // Cannot overflow: offset + size <= inner size (checked in `new`).
        Ok(IoRequest {
            offset: self.offset + req.offset,
            ..*req
        })
    }
}

/// Sum of the buffer lengths, `None` on overflow.
fn iov_total(req: &IoRequest<'_>) -> Option<u64> {
    req.iov
        .iter()
        .try_fold(0u64, |acc, b| acc.checked_add(b.len() as u64))
}

/// A batch whose every request a slice has checked, seen in the backing
/// device's offsets. The batch's requests do not change while it is submitted
/// ([`Batch`]), so the check holds for every read of them.
struct Shifted<'b> {
    batch: &'b mut dyn Batch,
    offset: u64,
}

impl Batch for Shifted<'_> {
    fn request(&self, i: usize) -> Option<(u64, IoRequest<'_>)> {
        let (tag, req) = self.batch.request(i)?;
        if req.op == IoOp::Flush {
            return Some((tag, req));
        }
        let offset = self.offset + req.offset;
        Some((tag, IoRequest { offset, ..req }))
    }

    fn started(&mut self, i: usize, inline: Option<IoStatus>) {
        self.batch.started(i, inline)
    }
}

impl ChannelWrapper for SliceChannel {
    fn inner(&self) -> &dyn IoChannel {
        &*self.inner
    }
    fn inner_mut(&mut self) -> &mut dyn IoChannel {
        &mut *self.inner
    }

    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        match self.translate(req) {
            Ok(r) => self.inner.submit(tag, &r),
            Err(st) => Some(st),
        }
    }

    /// Whole to the backend when every request lies inside the slice (the usual
    /// case), else one by one (each refused request ends here).
    fn submit_batch(&mut self, batch: &mut dyn Batch) -> usize {
        let mut i = 0;
        while let Some((_, req)) = batch.request(i) {
            if self.translate(&req).is_err() {
                return submit_each(batch, |tag, req| ChannelWrapper::submit(self, tag, req));
            }
            i += 1;
        }
        let offset = self.offset;
        self.inner.submit_batch(&mut Shifted { batch, offset })
    }

    /// Passed on in the backing device's offsets; dropped outside the slice.
    fn announce(&mut self, op: IoOp, offset: u64, len: u64) {
        if in_range(offset, len, self.size) {
            self.inner.announce(op, self.offset + offset, len)
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
