//! From a fetched command to backend requests: data pointers resolved into iovecs,
//! what `decode` asks for submitted to the namespace's channel. Reads and writes are
//! prepared here and submitted in batches by the poll (`poll.rs`); every other
//! command is executed at once.

use std::sync::atomic::Ordering;

use bdev::{BlockInfo, IoChannel, IoOp, IoRequest};
use guest_mem::{Access, MemoryMap};
use trace::{QueueRecorder, Stamps};

use super::ns_table::NsChan;
use super::sq::Slot;
use crate::decode::{decode, Facts, IoCmd};
use crate::decode::{OP_DSM, OP_FLUSH, OP_WRITE, OP_WRITE_ZEROES};
use crate::iov::Iov;
use crate::queue::Sqe;
use crate::shared::Shared;
use crate::status::{Nvme, Status};
use frontend_core::{Disk, Protocol};

const MAX_DSM_RANGES: usize = 256;

/// What executing a command gave: its status, or the number of backend requests it
/// now waits for.
pub(super) enum Exec {
    Done(Status),
    Pending(u16),
}

/// Resolves a command's data pointer (PRP or SGL per PSDT) into `iov`.
pub(crate) fn data_ptr<'a>(
    map: &'a MemoryMap,
    sqe: &Sqe,
    len: u64,
    access: Access,
    iov: &mut Iov<'a>,
) -> Result<(), Status> {
    match sqe.psdt() {
        0 => crate::prp::walk(map, sqe.prp1(), sqe.prp2(), len, access, iov),
        1 | 2 => crate::sgl::walk(map, sqe.sgl1(), len, access, iov),
        _ => Err(Status::INVALID_FIELD),
    }
}

/// The backend operation of an I/O opcode, for its status (anything else counts as
/// a read: it moves no data to the disk).
pub(super) fn io_op(op: u8) -> IoOp {
    match op {
        OP_WRITE => IoOp::Write,
        OP_WRITE_ZEROES => IoOp::WriteZeroes,
        OP_DSM => IoOp::Discard,
        OP_FLUSH => IoOp::Flush,
        _ => IoOp::Read,
    }
}

/// What decoding needs to know about namespace `c`.
pub(super) fn facts<'a>(shared: &Shared, c: &'a NsChan) -> Facts<'a> {
    facts_of(shared, &c.info, c.formatting)
}

fn facts_of<'a>(shared: &Shared, info: &'a BlockInfo, formatting: bool) -> Facts<'a> {
    Facts {
        info,
        wce: shared.wce.load(Ordering::Relaxed),
        mdts_bytes: shared.mdts_bytes,
        formatting,
    }
}

/// A fresh slot for `sqe`, keeping the trace stamps the fetch already set.
fn reset_slot(slot: &mut Slot, sqe: &Sqe) {
    *slot = Slot {
        cid: sqe.cid(),
        opcode: sqe.opcode(),
        nsid: sqe.nsid(),
        stamps: slot.stamps,
        ..Slot::default()
    };
}

/// Checks a Read or Write and resolves its data pointer into `iov` (as the iovec's
/// current command), leaving what the submit needs in `slot`.
pub(super) fn prepare_rw<'a>(
    map: &'a MemoryMap,
    facts: Option<Facts<'_>>,
    sqe: &Sqe,
    slot: &mut Slot,
    iov: &mut Iov<'a>,
) -> Result<(), Status> {
    let access = decode_rw(facts, sqe, slot)?;
    map_rw(map, sqe, slot, access, iov)
}

/// The first half of [`prepare_rw`]: checks a Read or Write and leaves its range in
/// `slot`; returns how its data pointer is accessed.
pub(super) fn decode_rw(
    facts: Option<Facts<'_>>,
    sqe: &Sqe,
    slot: &mut Slot,
) -> Result<Access, Status> {
    reset_slot(slot, sqe);
    let IoCmd::Rw {
        write,
        slba,
        offset,
        bytes,
        fua,
    } = decode(sqe, facts)?
    else {
        return Err(Status::INVALID_OPCODE);
    };
    slot.slba = slba;
    slot.bytes = bytes;
    slot.offset = offset;
    slot.fua = fua;
    Ok(if write { Access::Read } else { Access::Write })
}

/// The second half of [`prepare_rw`]: resolves the data pointer of a command
/// [`decode_rw`] accepted into `iov`.
pub(super) fn map_rw<'a>(
    map: &'a MemoryMap,
    sqe: &Sqe,
    slot: &mut Slot,
    access: Access,
    iov: &mut Iov<'a>,
) -> Result<(), Status> {
    data_ptr(map, sqe, slot.bytes, access, iov)?;
    slot.segs = iov.range();
    slot.runs = iov.run_range();
    Ok(())
}

/// Executes any command but a batched Read or Write on namespace `nc` (None: no
/// such namespace), counting what it leaves in flight on the namespace's channel.
pub(super) fn exec(
    map: &MemoryMap,
    shared: &Shared,
    nc: Option<&mut NsChan>,
    sqe: &Sqe,
    tag: u64,
    slot: &mut Slot,
) -> Exec {
    reset_slot(slot, sqe);
    let cmd = decode(sqe, nc.as_deref().map(|c| facts(shared, c)));
    let cmd = match cmd {
        Ok(c) => c,
        Err(s) => return Exec::Done(s),
    };
    let Some(nc) = nc else {
        return Exec::Done(Status::INVALID_NAMESPACE);
    };
    let r = exec_on(map, shared, nc, cmd, sqe, tag, slot);
    if let Exec::Pending(n) = r {
        nc.inflight += u32::from(n);
    }
    r
}

fn exec_on(
    map: &MemoryMap,
    shared: &Shared,
    nc: &mut NsChan,
    cmd: IoCmd,
    sqe: &Sqe,
    tag: u64,
    slot: &mut Slot,
) -> Exec {
    let NsChan {
        info,
        formatting,
        chan,
        ..
    } = nc;
    let info: &BlockInfo = info;
    let chan: &mut dyn IoChannel = chan.as_mut();
    let req = match cmd {
        IoCmd::Flush => IoRequest::without_data(IoOp::Flush, 0, 0, false),
        IoCmd::Rw { write, .. } => {
            let mut iov = Iov::new();
            let f = facts_of(shared, info, *formatting);
            if let Err(s) = prepare_rw(map, Some(f), sqe, slot, &mut iov) {
                return Exec::Done(s);
            }
            // Reads and writes are batched by the poll, which also moves their
            // data for unshared client memory; this path has nowhere to keep a
            // read's ranges until it completes, so it serves shared memory only.
            if map.any_remote(iov.runs()) {
                return Exec::Done(Status::DATA_TRANSFER_ERROR);
            }
            let req = IoRequest {
                op: if write { IoOp::Write } else { IoOp::Read },
                offset: slot.offset,
                len: slot.bytes,
                iov: iov.slices(),
                fua: slot.fua,
            };
            return submit(chan, tag, &req, &mut slot.stamps);
        }
        IoCmd::WriteZeroes {
            slba,
            offset,
            len,
            fua,
        } => {
            slot.slba = slba;
            IoRequest::without_data(IoOp::WriteZeroes, offset, len, fua)
        }
        IoCmd::Dsm { ranges, deallocate } => {
            let disk = facts_of(shared, info, *formatting).disk();
            return dsm(map, disk, chan, sqe, (ranges, deallocate), tag, slot);
        }
    };
    submit(chan, tag, &req, &mut slot.stamps)
}

fn submit(chan: &mut dyn IoChannel, tag: u64, req: &IoRequest<'_>, stamps: &mut Stamps) -> Exec {
    stamps.submitted = QueueRecorder::stamp(stamps.kick);
    match chan.submit(tag, req) {
        Some(st) => {
            stamps.completed = QueueRecorder::stamp(stamps.kick);
            Exec::Done(Nvme::from_io(st, req.op))
        }
        None => Exec::Pending(1),
    }
}

/// Dataset Management: the range list is read into private memory, checked whole,
/// then each deallocated range becomes a discard.
fn dsm(
    map: &MemoryMap,
    disk: Disk<'_>,
    chan: &mut dyn IoChannel,
    sqe: &Sqe,
    (nr, deallocate): (usize, bool),
    tag: u64,
    slot: &mut Slot,
) -> Exec {
    let mut buf = [0u8; MAX_DSM_RANGES * 16];
    let Some(ranges) = buf.get_mut(..nr * 16) else {
        return Exec::Done(Status::INVALID_FIELD);
    };
    let mut iov = Iov::new();
    if let Err(s) = data_ptr(map, sqe, (nr * 16) as u64, Access::Read, &mut iov) {
        return Exec::Done(s);
    }
    if map.fetch(iov.runs()).is_err() {
        return Exec::Done(Status::DATA_TRANSFER_ERROR);
    }
    iov.copy_in(ranges);
    let parse = |r: &[u8]| {
        let mut len = [0u8; 4];
        let mut lba = [0u8; 8];
        len.copy_from_slice(r.get(4..8).unwrap_or(&[0; 4]));
        lba.copy_from_slice(r.get(8..16).unwrap_or(&[0; 8]));
        (u64::from_le_bytes(lba), u64::from(u32::from_le_bytes(len)))
    };
    for r in ranges.chunks_exact(16) {
        let (slba, nlb) = parse(r);
        if let Err(e) = disk.blocks(slba, nlb) {
            slot.slba = slba;
            return Exec::Done(Nvme::refused(e));
        }
    }
    // Deallocation is advisory: without backend support it is a successful no-op.
    if !deallocate || !disk.info.discard {
        return Exec::Done(Status::SUCCESS);
    }
    let mut pending = 0u16;
    let mut status = Status::SUCCESS;
    for r in ranges.chunks_exact(16) {
        let (slba, nlb) = parse(r);
        let Ok(range) = disk.blocks(slba, nlb) else {
            continue;
        };
        if range.len == 0 {
            continue;
        }
        // Only a range that changes data is refused on a read-only namespace.
        // (The first such range: nothing was submitted yet.)
        if let Err(e) = disk.allows(IoOp::Discard) {
            return Exec::Done(Nvme::refused(e));
        }
        let req = IoRequest::without_data(IoOp::Discard, range.offset, range.len, false);
        match chan.submit(tag, &req) {
            Some(st) if status.is_ok() => status = Nvme::from_io(st, IoOp::Discard),
            Some(_) => {}
            None => pending += 1,
        }
    }
    if pending > 0 {
        slot.status = status;
        Exec::Pending(pending)
    } else {
        Exec::Done(status)
    }
}
