//! PRP (Physical Region Page) walking: PRP1, PRP2 and chained PRP lists.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use guest_mem::{Access, MemoryMap};

use crate::iov::{Iov, PAGE};
use crate::status::Status;

/// Resolves a `len`-byte transfer described by `prp1`/`prp2` into `iov`. The walk is
/// bounded by `len`: each list page read yields at least one data page, so a list
/// that loops back on itself just ends when the transfer is covered.
pub(crate) fn walk<'a>(
    map: &'a MemoryMap,
    prp1: u64,
    prp2: u64,
    len: u64,
    access: Access,
    iov: &mut Iov<'a>,
) -> Result<(), Status> {
    if len == 0 {
        return Ok(());
    }
    let off1 = prp1 % PAGE;
    if !off1.is_multiple_of(4) {
        return Err(Status::PRP_OFFSET_INVALID);
    }
    let first = len.min(PAGE - off1);
    iov.add(map, prp1, first, access)?;
    let mut rem = len - first;
    if rem == 0 {
        return iov.finish(map, access);
    }
    if rem <= PAGE {
        if !prp2.is_multiple_of(PAGE) {
            return Err(Status::PRP_OFFSET_INVALID);
        }
        iov.add(map, prp2, rem, access)?;
        return iov.finish(map, access);
    }
    if !prp2.is_multiple_of(8) {
        return Err(Status::PRP_OFFSET_INVALID);
    }
    let mut list = prp2;
    while rem > 0 {
        let slots = (PAGE - list % PAGE) / 8;
        let pages = rem.div_ceil(PAGE);
        // When more pages remain than this list page holds, its last entry chains on.
        let (data, chained) = if pages > slots {
            (slots - 1, true)
        } else {
            (pages, false)
        };
        let bytes = (data + u64::from(chained)) * 8;
        // A list page in unshared client memory comes over first (one message).
        map.fetch(&[(list, bytes)])
            .map_err(|_| Status::DATA_TRANSFER_ERROR)?;
        let entries = map
            .translate(
                list,
                usize::try_from(bytes).unwrap_or(usize::MAX),
                Access::Read,
            )
            .map_err(|_| Status::DATA_TRANSFER_ERROR)?;
        for i in 0..data {
            let e = u64::from_le(
                entries
                    .read_obj::<u64>(usize::try_from(i * 8).unwrap_or(usize::MAX))
                    .map_err(|_| Status::DATA_TRANSFER_ERROR)?,
            );
            if e % PAGE != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            let chunk = rem.min(PAGE);
            iov.add(map, e, chunk, access)?;
            rem -= chunk;
        }
        if chained {
            let next = u64::from_le(
                entries
                    .read_obj::<u64>(usize::try_from(data * 8).unwrap_or(usize::MAX))
                    .map_err(|_| Status::DATA_TRANSFER_ERROR)?,
            );
            if next % PAGE != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            if next == list - list % PAGE {
                // Not needed for termination, but a list naming itself is a host bug.
                return Err(Status::INVALID_FIELD);
            }
            list = next;
        }
    }
    iov.finish(map, access)
}
