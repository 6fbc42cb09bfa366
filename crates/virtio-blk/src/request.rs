//! Descriptor chain -> request. The guest is untrusted: every length, direction and
//! address is checked, and anything odd becomes a status byte, never a panic.
//!
//! The spec does not fix how a request is framed over descriptors, so the chain is
//! read as two byte streams: device-readable (16-byte header, then OUT data or a
//! DISCARD/WRITE_ZEROES segment) and device-writable (IN data or GET_ID, then the
//! status byte last).

use std::sync::Arc;

use bdev::{BlockInfo, IoOp, IoRequest, IoStatus};
use frontend_core::{Disk, Protocol, Refusal};
use guest_mem::DmaSlice;
use trace::{OpClass, Stamps};
use virtio_bindings::virtio_blk as vb;
use virtio_queue::desc::split::Descriptor;

use crate::config::{features, BlkConfig, MAX_DISCARD_SECTORS};
use crate::guest::{window, Mem};
use crate::SECTOR;

pub(crate) const S_OK: u8 = vb::VIRTIO_BLK_S_OK as u8;
pub(crate) const S_IOERR: u8 = vb::VIRTIO_BLK_S_IOERR as u8;
pub(crate) const S_UNSUPP: u8 = vb::VIRTIO_BLK_S_UNSUPP as u8;

/// virtio-blk as a front-end protocol: its status table (a status byte).
pub struct VirtioBlk;

impl Protocol for VirtioBlk {
    type Status = u8;
    const OK: u8 = S_OK;

    fn from_io(st: IoStatus, _op: IoOp) -> u8 {
        match st {
            IoStatus::Ok => S_OK,
            IoStatus::Unsupported => S_UNSUPP,
            _ => S_IOERR,
        }
    }

    /// virtio-blk has one error status for every refusal.
    fn refused(_: Refusal) -> u8 {
        S_IOERR
    }

    fn code(s: u8) -> u16 {
        u16::from(s)
    }
}

const HEADER: usize = 16;
const ID_BYTES: usize = vb::VIRTIO_BLK_ID_BYTES as usize;

#[derive(Clone, Copy)]
pub(crate) struct Seg {
    s: DmaSlice<'static>,
    writable: bool,
}

/// What to do with a parsed chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Send to the backend.
    Submit,
    /// Already decided: write this status.
    Finish(u8),
}

/// One preallocated request slot.
pub(crate) struct Slot {
    pub head: u16,
    /// Keeps the guest mapping that `data` and `status` point into alive.
    pub mem: Option<Arc<Mem>>,
    pub status: Option<DmaSlice<'static>>,
    pub data: Vec<DmaSlice<'static>>,
    pub op: IoOp,
    pub offset: u64,
    pub len: u64,
    pub fua: bool,
    pub used_len: u32,
    pub outcome: Outcome,
    /// `data` is what the device writes into guest memory (IN, GET_ID), which a
    /// dirty-page log must hear of (`dirty.rs`).
    pub into_guest: bool,
    /// Why the request gets VIRTIO_BLK_S_IOERR (for the log), when parsing decided it.
    pub cause: &'static str,
    /// What the request is for the counters (set from the header's type, also for
    /// requests rejected before the backend).
    pub class: OpClass,
    /// Trace stamps; `kick == 0` when this request is not traced.
    pub stamps: Stamps,
}

impl Slot {
    pub fn new(max_segs: usize) -> Self {
        Slot {
            head: 0,
            mem: None,
            status: None,
            data: Vec::with_capacity(max_segs),
            op: IoOp::Read,
            offset: 0,
            len: 0,
            fua: false,
            used_len: 0,
            outcome: Outcome::Finish(S_IOERR),
            into_guest: false,
            cause: "",
            class: OpClass::Other,
            stamps: Stamps::default(),
        }
    }

    pub fn release(&mut self) {
        self.mem = None;
        self.status = None;
        self.data.clear();
    }

    /// The backend request of a parsed chain (`Outcome::Submit`).
    pub fn request(&self) -> IoRequest<'_> {
        IoRequest {
            op: self.op,
            offset: self.offset,
            len: self.len,
            iov: &self.data,
            fua: self.fua,
        }
    }

    fn finish(&mut self, status: u8) {
        self.outcome = Outcome::Finish(status);
    }

    /// Refused while parsing: VIRTIO_BLK_S_IOERR, for `cause`.
    fn fail(&mut self, cause: &'static str) {
        self.cause = cause;
        self.finish(S_IOERR);
    }

    /// Taken for the chain `head`: what a previous request left is cleared.
    fn start(&mut self, head: u16, mem: &Arc<Mem>) {
        self.head = head;
        self.mem = Some(mem.clone());
        self.status = None;
        self.data.clear();
        self.used_len = 0;
        self.len = 0;
        self.fua = false;
        self.outcome = Outcome::Finish(S_IOERR);
        self.into_guest = false;
        self.cause = "";
        self.class = OpClass::Other;
        self.stamps = Stamps::default();
    }
}

/// Reads the chain with head `head` (its descriptors in `chain`) into `slot`,
/// checking it against the disk `info` the queue serves. `segs` is scratch space
/// whose capacity bounds the number of descriptors accepted.
///
/// Parsing (the chain's framing, then the header) is apart from preparing (each
/// type's checks against the device's features and the disk, and the slot filled
/// for the backend), as rust-vmm's `Request::parse` is apart from its executor.
/// GET_ID is answered here: it needs no backend.
pub(crate) fn parse(
    head: u16,
    chain: impl Iterator<Item = Descriptor>,
    mem: &Arc<Mem>,
    (cfg, info): (&BlkConfig, &BlockInfo),
    segs: &mut Vec<Seg>,
    slot: &mut Slot,
) {
    slot.start(head, mem);
    segs.clear();
    let framing = frame(chain, mem, segs);
    // Without a writable last byte there is nowhere to put a status: the chain is
    // returned with nothing written.
    let Some(last) = framing.last.filter(|l| l.writable) else {
        slot.fail("no writable status byte (or it is outside guest memory)");
        return;
    };
    slot.status = last.s.sub(last.s.len() - 1, 1);
    slot.used_len = 1;
    if let Some(cause) = framing.fault {
        slot.fail(cause);
        return;
    }
    let Some(hdr) = Header::read(segs) else {
        slot.fail("short request header");
        return;
    };
    slot.class = hdr.class();
    let status = prepare(&hdr, (cfg, info), segs, slot);
    if status != S_OK || slot.outcome != Outcome::Submit {
        if status == S_IOERR {
            slot.cause = "bad request (range, alignment, read-only or segment)";
        }
        slot.finish(status);
    }
}

/// A chain read as byte streams.
struct Framing {
    /// The last descriptor with bytes, if it lies in guest memory: its last byte
    /// takes the status.
    last: Option<Seg>,
    /// Why the chain is refused, if it is (the status byte still says so).
    fault: Option<&'static str>,
}

/// Reads the descriptors into `segs` (as many as its capacity takes), noting what
/// makes the chain unusable: a descriptor outside guest memory, more of them than
/// `seg_max`, a readable one after a writable one.
fn frame(chain: impl Iterator<Item = Descriptor>, mem: &Arc<Mem>, segs: &mut Vec<Seg>) -> Framing {
    let (mut overflow, mut bad_addr, mut bad_order, mut seen_w) = (false, false, false, false);
    let mut last: Option<Seg> = None;
    for d in chain {
        let writable = d.is_write_only();
        if !writable && seen_w {
            bad_order = true;
        }
        seen_w |= writable;
        if d.len() == 0 {
            continue;
        }
        match window(mem, d.addr().0, d.len()) {
            Some(s) => {
                let seg = Seg { s, writable };
                last = Some(seg);
                if segs.len() < segs.capacity() {
                    segs.push(seg);
                } else {
                    overflow = true;
                }
            }
            None => {
                bad_addr = true;
                last = None;
            }
        }
    }
    let fault = if bad_addr {
        Some("a descriptor is outside the guest memory table")
    } else if overflow {
        Some("more descriptors than seg_max allows")
    } else if bad_order {
        Some("a readable descriptor follows a writable one")
    } else {
        None
    };
    Framing { last, fault }
}

/// The request header: type and first sector (the reserved field is ignored).
struct Header {
    req_type: u32,
    sector: u64,
}

impl Header {
    /// The header at the start of the readable stream; `None` if it is shorter.
    fn read(segs: &[Seg]) -> Option<Header> {
        let mut hdr = [0u8; HEADER];
        if !gather(segs, false, 0, &mut hdr) {
            return None;
        }
        Some(Header {
            req_type: u32::from_le_bytes(hdr[0..4].try_into().unwrap_or_default()),
            sector: u64::from_le_bytes(hdr[8..16].try_into().unwrap_or_default()),
        })
    }

    /// What the request is for the counters, also when it is refused.
    fn class(&self) -> OpClass {
        match self.req_type {
            vb::VIRTIO_BLK_T_IN => OpClass::Read,
            vb::VIRTIO_BLK_T_OUT => OpClass::Write,
            vb::VIRTIO_BLK_T_FLUSH => OpClass::Flush,
            _ => OpClass::Other,
        }
    }
}

/// Checks a parsed request of each type and fills the slot: marked for the
/// backend (`Outcome::Submit`, status `S_OK`), or the status to write now.
fn prepare(hdr: &Header, f: Facts<'_>, segs: &[Seg], slot: &mut Slot) -> u8 {
    let cfg = f.0;
    match hdr.req_type {
        vb::VIRTIO_BLK_T_IN => {
            let len = collect(segs, true, 0, writable_data(segs), &mut slot.data);
            slot.into_guest = true;
            slot.used_len = u32::try_from(len + 1).unwrap_or(u32::MAX);
            rw(f, slot, IoOp::Read, hdr.sector, len)
        }
        vb::VIRTIO_BLK_T_OUT => {
            let len = collect(
                segs,
                false,
                HEADER as u64,
                readable_data(segs),
                &mut slot.data,
            );
            rw(f, slot, IoOp::Write, hdr.sector, len)
        }
        vb::VIRTIO_BLK_T_FLUSH => {
            if cfg.features & features::FLUSH == 0 {
                return S_UNSUPP;
            }
            slot.op = IoOp::Flush;
            slot.offset = 0;
            submit(slot);
            S_OK
        }
        vb::VIRTIO_BLK_T_GET_ID => get_id(cfg, segs, slot),
        vb::VIRTIO_BLK_T_DISCARD => range_op(f, segs, slot, readable_data(segs), IoOp::Discard),
        vb::VIRTIO_BLK_T_WRITE_ZEROES => {
            range_op(f, segs, slot, readable_data(segs), IoOp::WriteZeroes)
        }
        _ => S_UNSUPP,
    }
}

/// Writes the device's serial (up to 20 bytes, as much as the buffer takes).
fn get_id(cfg: &BlkConfig, segs: &[Seg], slot: &mut Slot) -> u8 {
    let mut id = [0u8; ID_BYTES];
    let n = cfg.opts.serial.len().min(ID_BYTES);
    id[..n].copy_from_slice(&cfg.opts.serial.as_bytes()[..n]);
    let want = (writable_data(segs) as usize).min(ID_BYTES);
    if scatter(segs, &id[..want]) {
        collect(segs, true, 0, want as u64, &mut slot.data);
        slot.into_guest = true;
        slot.used_len = want as u32 + 1;
        S_OK
    } else {
        S_IOERR
    }
}

/// Bytes of the writable stream before the status byte.
fn writable_data(segs: &[Seg]) -> u64 {
    total(segs, true).saturating_sub(1)
}

/// Bytes of the readable stream after the header.
fn readable_data(segs: &[Seg]) -> u64 {
    total(segs, false).saturating_sub(HEADER as u64)
}

fn submit(slot: &mut Slot) {
    slot.outcome = Outcome::Submit;
}

/// The device's config and the disk its queue serves now.
type Facts<'a> = (&'a BlkConfig, &'a BlockInfo);

/// The disk under the front-end core's policy (range, read-only, FUA).
fn disk<'a>((cfg, info): Facts<'a>) -> Disk<'a> {
    Disk {
        info,
        cache_on: cfg.writeback(),
    }
}

/// Checks an IN/OUT request; on success marks the slot for submission.
fn rw(f: Facts<'_>, slot: &mut Slot, op: IoOp, sector: u64, len: u64) -> u8 {
    slot.outcome = Outcome::Finish(S_IOERR);
    // With the guest's write cache off, every write must be durable on completion.
    let fua = disk(f).fua(op, false);
    queue_range(f, slot, op, sector, len, fua)
}

/// Checks the operation against a read-only disk and the sector range (whole blocks
/// inside the disk), and marks the slot for submission; an empty range completes
/// at once.
fn queue_range(f: Facts<'_>, slot: &mut Slot, op: IoOp, sector: u64, len: u64, fua: bool) -> u8 {
    let d = disk(f);
    let range = match d.allows(op).and_then(|()| d.units(sector, SECTOR, len)) {
        Ok(r) => r,
        Err(e) => return VirtioBlk::refused(e),
    };
    if len == 0 {
        return S_OK;
    }
    slot.op = op;
    slot.offset = range.offset;
    slot.len = range.len;
    slot.fua = fua;
    submit(slot);
    S_OK
}

fn range_op(f: Facts<'_>, segs: &[Seg], slot: &mut Slot, readable: u64, op: IoOp) -> u8 {
    let cfg = f.0;
    slot.outcome = Outcome::Finish(S_IOERR);
    let (feature, allowed_flags) = match op {
        IoOp::Discard => (features::DISCARD, 0),
        _ => (
            features::WRITE_ZEROES,
            vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
        ),
    };
    if cfg.features & feature == 0 {
        return S_UNSUPP;
    }
    // We offer max_discard_seg = max_write_zeroes_seg = 1.
    let mut seg = [0u8; 16];
    if readable != 16 || !gather(segs, false, HEADER as u64, &mut seg) {
        return S_IOERR;
    }
    let sector = u64::from_le_bytes(seg[0..8].try_into().unwrap_or_default());
    let num = u32::from_le_bytes(seg[8..12].try_into().unwrap_or_default());
    let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap_or_default());
    if flags & !allowed_flags != 0 {
        return S_UNSUPP;
    }
    if num > MAX_DISCARD_SECTORS {
        return S_IOERR;
    }
    queue_range(f, slot, op, sector, u64::from(num) * SECTOR, false)
}

fn total(segs: &[Seg], writable: bool) -> u64 {
    segs.iter()
        .filter(|s| s.writable == writable)
        .map(|s| s.s.len() as u64)
        .sum()
}

/// Sub-slices covering `len` bytes of one direction's stream from `skip`.
fn collect(
    segs: &[Seg],
    writable: bool,
    mut skip: u64,
    len: u64,
    out: &mut Vec<DmaSlice<'static>>,
) -> u64 {
    let mut left = len;
    for seg in segs.iter().filter(|s| s.writable == writable) {
        if left == 0 {
            break;
        }
        let l = seg.s.len() as u64;
        if skip >= l {
            skip -= l;
            continue;
        }
        let take = (l - skip).min(left);
        if let Some(part) = seg.s.sub(skip as usize, take as usize) {
            if out.len() < out.capacity() {
                out.push(part);
            }
        }
        left -= take;
        skip = 0;
    }
    len - left
}

/// Copies `dst.len()` bytes of one direction's stream from `skip`; false if short.
fn gather(segs: &[Seg], writable: bool, mut skip: u64, dst: &mut [u8]) -> bool {
    let mut at = 0;
    for seg in segs.iter().filter(|s| s.writable == writable) {
        if at == dst.len() {
            break;
        }
        let l = seg.s.len() as u64;
        if skip >= l {
            skip -= l;
            continue;
        }
        let take = ((l - skip) as usize).min(dst.len() - at);
        if seg
            .s
            .read_into(skip as usize, &mut dst[at..at + take])
            .is_err()
        {
            return false;
        }
        at += take;
        skip = 0;
    }
    at == dst.len()
}

/// Copies `src` to the start of the writable stream.
fn scatter(segs: &[Seg], src: &[u8]) -> bool {
    let mut at = 0;
    for seg in segs.iter().filter(|s| s.writable) {
        if at == src.len() {
            break;
        }
        let take = seg.s.len().min(src.len() - at);
        if seg.s.write_from(0, &src[at..at + take]).is_err() {
            return false;
        }
        at += take;
    }
    at == src.len()
}

#[cfg(test)]
mod status_tests {
    use super::*;

    #[test]
    fn status_table() {
        use IoStatus as I;
        let all = [
            I::Ok,
            I::IoError,
            I::ReadError,
            I::OutOfRange,
            I::ReadOnly,
            I::Unsupported,
            I::Invalid,
            I::NoSpace,
        ];
        for op in [
            IoOp::Read,
            IoOp::Write,
            IoOp::Flush,
            IoOp::WriteZeroes,
            IoOp::Discard,
        ] {
            for st in all {
                let want = match st {
                    I::Ok => S_OK,
                    I::Unsupported => S_UNSUPP,
                    _ => S_IOERR,
                };
                assert_eq!(VirtioBlk::from_io(st, op), want, "{st:?} on {op:?}");
            }
        }
        for r in [Refusal::OutOfRange, Refusal::Misaligned, Refusal::ReadOnly] {
            assert_eq!(VirtioBlk::refused(r), S_IOERR);
        }
        assert_eq!(VirtioBlk::code(VirtioBlk::OK), 0);
        assert_eq!(VirtioBlk::code(S_UNSUPP), 2);
    }
}
