use std::io;

use crate::{
    in_range, BlockDevice, BlockInfo, GeometryError, IoChannel, IoOp, IoRequest, IoStatus,
};

/// Completes every request at once without touching data: measures the software
/// path. Reads leave the buffers as they were. Volatile by definition.
pub struct NullDisk {
    info: BlockInfo,
}

impl NullDisk {
    pub fn new(size: u64, block_size: u32) -> Result<Self, GeometryError> {
        let info = crate::ram::sized_info(size, block_size)?;
        Ok(NullDisk { info })
    }
}

impl BlockDevice for NullDisk {
    fn describe(&self) -> String {
        format!("null:{}", self.info.size_bytes())
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(NullChannel {
            size: self.info.size_bytes(),
        }))
    }
    fn resize(&self, bytes: u64) -> io::Result<std::sync::Arc<dyn BlockDevice>> {
        Ok(std::sync::Arc::new(NullDisk {
            info: self.info.resized(bytes)?,
        }))
    }
    fn format_support(&self) -> crate::FormatSupport {
        crate::FormatSupport::Exclusive {
            min_block_size: 512,
        }
    }
}

struct NullChannel {
    size: u64,
}

impl IoChannel for NullChannel {
    fn submit(&mut self, _tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        if req.op != IoOp::Flush && !in_range(req.offset, req.len, self.size) {
            return Some(IoStatus::OutOfRange);
        }
        Some(IoStatus::Ok)
    }
}
