use guest_mem::DmaSlice;

/// What a request does. Offsets and lengths are in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    Read,
    Write,
    Flush,
    WriteZeroes,
    /// Deallocate/trim: the range's content becomes undefined (zeroes for our backends).
    Discard,
}

/// One block request: zero-copy buffers in client memory.
#[derive(Clone, Copy, Debug)]
pub struct IoRequest<'a> {
    pub op: IoOp,
    pub offset: u64,
    pub len: u64,
    /// Data buffers for Read/Write; their lengths add up to `len`. Empty otherwise.
    pub iov: &'a [DmaSlice<'a>],
    /// Force Unit Access: the write must be durable when it completes.
    pub fua: bool,
}

impl IoRequest<'static> {
    /// A request that moves no data: flush, write zeroes, discard.
    pub fn without_data(op: IoOp, offset: u64, len: u64, fua: bool) -> IoRequest<'static> {
        IoRequest {
            op,
            offset,
            len,
            iov: &[],
            fua,
        }
    }
}

/// How a request ended; device models map these to their protocol's statuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoStatus {
    Ok,
    /// Media or transport error on write or other op (EIO).
    IoError,
    /// Unrecovered read error.
    ReadError,
    /// The range is outside the device.
    OutOfRange,
    /// A write to a read-only device.
    ReadOnly,
    /// The backend does not implement this op.
    Unsupported,
    /// Buffers do not add up to the length, or similar caller bug.
    Invalid,
    /// No space left (thin backing file).
    NoSpace,
}

/// Static facts about a backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Logical block size in bytes (512 or 4096).
    pub block_size: u32,
    pub num_blocks: u64,
    /// Data does not survive the process (null, ram).
    pub volatile: bool,
    /// Writes may sit in a cache until Flush.
    pub write_cache: bool,
    pub read_only: bool,
    pub discard: bool,
    pub write_zeroes: bool,
    /// Discarded blocks read back as zeroes.
    pub discard_zeroes: bool,
}

impl BlockInfo {
    pub fn size_bytes(&self) -> u64 {
        self.num_blocks.saturating_mul(u64::from(self.block_size))
    }

    /// The same device with a size of `bytes`: a non-zero multiple of the block size.
    pub fn resized(&self, bytes: u64) -> Result<BlockInfo, crate::GeometryError> {
        let bs = u64::from(self.block_size);
        crate::GeometryError::check_size(bytes, bs)?;
        Ok(BlockInfo {
            num_blocks: bytes / bs,
            ..*self
        })
    }
}
