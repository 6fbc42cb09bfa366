//! [`CryptDisk`]: a LUKS volume's payload, encrypted with AES-XTS-plain64 on the
//! way to the backend and decrypted on the way back
//! (docs/decisions/0037-luks-encryption.md). The header (`luks`) is read and
//! written through libcryptsetup; the data path is here, on the channel's own
//! thread.
//!
//! Writes are encrypted into bounce buffers the channel owns (never in the
//! client's memory, which the client may read or change while we work); reads
//! land in the client's buffers and are decrypted there once the backend
//! completed them, a sector group at a time through a private scratch block.
//! Slots and their buffers are made once and reused: a request allocates
//! nothing once the channel has seen its deepest queue and longest write.

mod header;
mod kdf;
mod keyslots;
mod luks;
mod xts;

pub use header::{Key, LuksError};
pub use keyslots::{change_key, luks_status, KeyChange, LuksStatus};
pub use luks::{format_luks, open_luks, open_or_format_luks};
pub use xts::{SectorCipher, SectorCrypter, SECTOR};

use std::fmt;
use std::io;
use std::sync::Arc;

use guest_mem::{DmaSlice, HeldIov, MappedRegion};

use crate::{
    in_range, BlockDevice, BlockInfo, ChannelWrapper, DeviceWrapper, FormatSupport, IoChannel,
    IoOp, IoRequest, IoStatus,
};

/// The longest write a channel encrypts (its bounce buffers grow to it).
pub const MAX_CRYPT_IO: usize = 4 << 20;
/// How much a read decrypts at a time (the scratch block, in L1).
const CHUNK: usize = 4096;

/// The payload of a LUKS volume on `inner`: data from `data_offset` on,
/// encrypted with `cipher`.
pub struct CryptDisk {
    inner: Arc<dyn BlockDevice>,
    cipher: Arc<SectorCipher>,
    data_offset: u64,
    info: BlockInfo,
}

/// Never prints key material.
impl fmt::Debug for CryptDisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CryptDisk")
            .field("inner", &self.inner.describe())
            .field("data_offset", &self.data_offset)
            .finish_non_exhaustive()
    }
}

impl CryptDisk {
    /// The payload of `inner` from `data_offset` (a multiple of the block size) to
    /// its end, in blocks of at least the cipher's sector.
    pub fn new(
        inner: Arc<dyn BlockDevice>,
        cipher: Arc<SectorCipher>,
        data_offset: u64,
    ) -> Result<CryptDisk, LuksError> {
        let ii = inner.info().clone();
        let total = ii.size_bytes();
        let block_size = ii.block_size.max(cipher.unit() as u32);
        let bs = u64::from(block_size);
        if bs == 0 || !data_offset.is_multiple_of(bs) || data_offset >= total {
            return Err(LuksError::Layout {
                data_offset,
                device_size: total,
                block_size: bs,
            });
        }
        let info = BlockInfo {
            block_size,
            num_blocks: (total - data_offset) / bs,
            // Zeroes or a trim would reach the disk in the clear: both refused.
            discard: false,
            write_zeroes: false,
            discard_zeroes: false,
            ..ii
        };
        Ok(CryptDisk {
            inner,
            cipher,
            data_offset,
            info,
        })
    }

    /// The payload of `inner` from `data_offset` on, encrypted with the volume
    /// key `key` (32 or 64 bytes) in sectors of `unit` bytes (512 or 4096). The
    /// key is not kept: its cipher is (OpenSSL's key schedules).
    pub fn with_key(
        inner: Arc<dyn BlockDevice>,
        key: &[u8],
        unit: usize,
        data_offset: u64,
    ) -> Result<CryptDisk, LuksError> {
        if key.len() != 32 && key.len() != 64 {
            return Err(LuksError::KeySize { bytes: key.len() });
        }
        let cipher = SectorCipher::new(key, unit).ok_or(LuksError::KeyRefused)?;
        let cipher = Arc::new(cipher);
        CryptDisk::new(inner, cipher, data_offset)
    }

    /// Where the payload starts on the backend, in bytes.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
}

impl DeviceWrapper for CryptDisk {
    fn inner(&self) -> &dyn BlockDevice {
        &*self.inner
    }
    fn kind(&self) -> &'static str {
        "luks"
    }
    fn encrypted_volume(&self) -> Option<&dyn BlockDevice> {
        Some(&*self.inner)
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(CryptChannel {
            inner: self.inner.channel()?,
            state: CryptState {
                crypter: self.cipher.crypter().map_err(io::Error::other)?,
                data_offset: self.data_offset,
                size: self.info.size_bytes(),
                slots: Vec::new(),
                free: Vec::new(),
                scratch: Box::new([0; CHUNK]),
            },
        }))
    }
    /// `bytes` of payload: the backend grows by the same amount.
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        let total = bytes
            .checked_add(self.data_offset)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        self.rewrap(self.inner.resize(total)?)
    }
    fn rewrap(&self, inner: Arc<dyn BlockDevice>) -> io::Result<Arc<dyn BlockDevice>> {
        let d = CryptDisk::new(inner, self.cipher.clone(), self.data_offset)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(Arc::new(d))
    }
    /// Reformatting erases with Write Zeroes, which this device refuses.
    fn format_support(&self) -> FormatSupport {
        FormatSupport::Unsupported
    }
}

/// One request passed on to the backend.
#[derive(Default)]
struct Slot {
    tag: u64,
    op: Option<IoOp>,
    first_sector: u64,
    /// A read's client buffers, decrypted when it completes.
    held: HeldIov,
    /// A write's ciphertext (page aligned, for `O_DIRECT` backends).
    bounce: Option<MappedRegion>,
}

struct CryptChannel {
    /// First, so that it is dropped (and waits for what it has in flight)
    /// before the buffers it may still touch.
    inner: Box<dyn IoChannel>,
    state: CryptState,
}

/// Everything of a channel but its inner channel, so that completions the inner
/// channel hands out can be finished while it is borrowed.
struct CryptState {
    crypter: SectorCrypter,
    data_offset: u64,
    size: u64,
    slots: Vec<Slot>,
    free: Vec<usize>,
    scratch: Box<[u8; CHUNK]>,
}

impl CryptState {
    /// A free slot's index (a new slot only past the deepest queue seen).
    fn take_slot(&mut self) -> usize {
        self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot::default());
            self.slots.len() - 1
        })
    }

    /// Slot `i`'s request ended with `st` at the backend: decrypts a read and
    /// frees the slot; the tag and status to report.
    fn finish(&mut self, i: usize, st: IoStatus) -> Option<(u64, IoStatus)> {
        let slot = self.slots.get_mut(i).filter(|s| s.op.is_some())?;
        let mut st = st;
        if slot.op == Some(IoOp::Read) && st == IoStatus::Ok {
            let iov = slot.held.slices();
            let total: usize = iov.iter().map(DmaSlice::len).sum();
            let mut pos = 0;
            while pos < total {
                let n = CHUNK.min(total - pos);
                let buf = &mut self.scratch[..n];
                let sector = slot.first_sector + (pos / SECTOR) as u64;
                let ok = copy_out(iov, pos, buf).is_some()
                    && self.crypter.decrypt(buf, sector).is_ok()
                    && copy_in(iov, pos, buf).is_some();
                if !ok {
                    st = IoStatus::IoError;
                    break;
                }
                pos += n;
            }
        }
        slot.held.clear();
        slot.op = None;
        self.free.push(i);
        Some((slot.tag, st))
    }

    /// Encrypts `req`'s data into slot `i`'s bounce buffer; `None` if the
    /// buffer cannot be had.
    fn encrypt_into(&mut self, i: usize, req: &IoRequest<'_>, sector: u64) -> Option<()> {
        let len = req.len as usize;
        let slot = &mut self.slots[i];
        if slot
            .bounce
            .as_ref()
            .is_none_or(|b| (b.len() as usize) < len)
        {
            let cap = len.next_power_of_two().max(128 << 10) as u64;
            slot.bounce = Some(MappedRegion::anonymous(0, cap).ok()?);
        }
        let bounce = slot.bounce.as_ref()?.slice(0, len)?;
        let mut pos = 0;
        while pos < len {
            let n = CHUNK.min(len - pos);
            let buf = &mut self.scratch[..n];
            copy_out(req.iov, pos, buf)?;
            self.crypter
                .encrypt(buf, sector + (pos / SECTOR) as u64)
                .ok()?;
            bounce.write_from(pos, buf).ok()?;
            pos += n;
        }
        Some(())
    }

    /// What is wrong with a read or write, before any work.
    fn check(&self, req: &IoRequest<'_>) -> Option<IoStatus> {
        let sector = self.crypter.unit() as u64;
        if !in_range(req.offset, req.len, self.size) {
            return Some(IoStatus::OutOfRange);
        }
        let total: u64 = req.iov.iter().map(|s| s.len() as u64).sum();
        let misaligned = !req.offset.is_multiple_of(sector) || !req.len.is_multiple_of(sector);
        if misaligned || total != req.len || req.len > MAX_CRYPT_IO as u64 {
            return Some(IoStatus::Invalid);
        }
        None
    }
}

impl CryptChannel {
    /// Sends `req` (checked; a write's ciphertext is in slot `i`) to the backend
    /// as slot `i`'s.
    fn pass_on(&mut self, i: usize, req: &IoRequest<'_>) -> Option<IoStatus> {
        let s = &mut self.state;
        // Reads and writes are range-checked; a flush's offset means nothing.
        let offset = req.offset.saturating_add(s.data_offset);
        let st = if req.op == IoOp::Write {
            let b = s.slots[i]
                .bounce
                .as_ref()
                .and_then(|b| b.slice(0, req.len as usize));
            match b {
                Some(b) => {
                    let iov = [b];
                    let r = IoRequest {
                        offset,
                        iov: &iov,
                        ..*req
                    };
                    self.inner.submit(i as u64, &r)
                }
                None => Some(IoStatus::IoError),
            }
        } else {
            self.inner.submit(i as u64, &IoRequest { offset, ..*req })
        };
        st.map(|st| s.finish(i, st).map_or(IoStatus::IoError, |(_, st)| st))
    }
}

impl ChannelWrapper for CryptChannel {
    fn inner(&self) -> &dyn IoChannel {
        &*self.inner
    }
    fn inner_mut(&mut self) -> &mut dyn IoChannel {
        &mut *self.inner
    }

    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        match req.op {
            IoOp::Read | IoOp::Write => {
                if let Some(st) = self.state.check(req) {
                    return Some(st);
                }
            }
            IoOp::Flush => {}
            IoOp::WriteZeroes | IoOp::Discard => return Some(IoStatus::Unsupported),
        }
        let s = &mut self.state;
        let i = s.take_slot();
        let sector = req.offset / SECTOR as u64;
        match req.op {
            IoOp::Write if s.encrypt_into(i, req, sector).is_none() => {
                s.free.push(i);
                return Some(IoStatus::IoError);
            }
            // SAFETY: the backend contract: the client keeps a request's buffers
            // valid until its completion is reported, and `finish` clears the
            // hold when it is.
            IoOp::Read => unsafe { s.slots[i].held.hold(req.iov) },
            _ => {}
        }
        let slot = &mut s.slots[i];
        slot.tag = tag;
        slot.op = Some(req.op);
        slot.first_sector = sector;
        self.pass_on(i, req)
    }

    /// In the backend's offsets.
    fn announce(&mut self, op: IoOp, offset: u64, len: u64) {
        if let Some(o) = offset.checked_add(self.state.data_offset) {
            self.inner.announce(op, o, len)
        }
    }

    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        let state = &mut self.state;
        let mut n = 0;
        self.inner.poll(&mut |i, st| {
            if let Some((tag, st)) = usize::try_from(i).ok().and_then(|i| state.finish(i, st)) {
                done(tag, st);
                n += 1;
            }
        });
        n
    }
}

/// Copies `buf.len()` bytes from byte `pos` of the buffer list `iov`.
pub(crate) fn copy_out(iov: &[DmaSlice<'_>], pos: usize, buf: &mut [u8]) -> Option<()> {
    walk(iov, pos, buf.len(), |s, off, at, n| {
        s.read_into(off, &mut buf[at..at + n]).ok()
    })
}

/// Copies `buf` to byte `pos` of the buffer list `iov`.
pub(crate) fn copy_in(iov: &[DmaSlice<'_>], pos: usize, buf: &[u8]) -> Option<()> {
    walk(iov, pos, buf.len(), |s, off, at, n| {
        s.write_from(off, &buf[at..at + n]).ok()
    })
}

/// Calls `f(segment, offset in it, offset in the range, length)` for each piece
/// of bytes `pos..pos+len` of the buffer list `iov`; `None` if it is shorter.
fn walk(
    iov: &[DmaSlice<'_>],
    pos: usize,
    len: usize,
    mut f: impl FnMut(&DmaSlice<'_>, usize, usize, usize) -> Option<()>,
) -> Option<()> {
    let mut skip = pos;
    let mut at = 0;
    for s in iov {
        if at == len {
            break;
        }
        if skip >= s.len() {
            skip -= s.len();
            continue;
        }
        let n = (s.len() - skip).min(len - at);
        f(s, skip, at, n)?;
        at += n;
        skip = 0;
    }
    (at == len).then_some(())
}
