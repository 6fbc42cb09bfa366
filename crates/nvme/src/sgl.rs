//! SGL (Scatter Gather List) walking: Data Block, Segment and Last Segment
//! descriptors. Bit Bucket and keyed/transport descriptors are not supported.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use guest_mem::{Access, MemoryMap};

use crate::iov::Iov;
use crate::status::Status;

/// Hard cap on descriptors per command, segments included: stops loops and
/// pathological chains.
pub(crate) const MAX_DESCRIPTORS: u32 = 256;

const DATA_BLOCK: u8 = 0x0;
const SEGMENT: u8 = 0x2;
const LAST_SEGMENT: u8 = 0x3;

#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    kind: u8,
    subtype: u8,
}

fn parse(b: [u8; 16]) -> Desc {
    let addr = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    Desc {
        addr,
        len,
        kind: b[15] >> 4,
        subtype: b[15] & 0xf,
    }
}

fn data<'a>(
    map: &'a MemoryMap,
    d: Desc,
    rem: &mut u64,
    access: Access,
    iov: &mut Iov<'a>,
) -> Result<(), Status> {
    let len = u64::from(d.len);
    if len > *rem {
        return Err(Status::DATA_SGL_LENGTH_INVALID);
    }
    iov.add(map, d.addr, len, access)?;
    *rem -= len;
    Ok(())
}

/// A segment to read: address and number of descriptors.
fn segment(d: Desc) -> Result<(u64, u32, bool), Status> {
    if d.subtype != 0 {
        return Err(Status::SGL_TYPE_INVALID);
    }
    if d.len == 0 || !d.len.is_multiple_of(16) {
        return Err(Status::INVALID_SGL_SEGMENT);
    }
    Ok((d.addr, d.len / 16, d.kind == LAST_SEGMENT))
}

/// Resolves a `len`-byte transfer described by SGL1 into `iov`; the descriptors must
/// describe exactly `len` bytes.
pub(crate) fn walk<'a>(
    map: &'a MemoryMap,
    sgl1: [u8; 16],
    len: u64,
    access: Access,
    iov: &mut Iov<'a>,
) -> Result<(), Status> {
    let mut rem = len;
    let first = parse(sgl1);
    let mut seg = match first.kind {
        DATA_BLOCK if first.subtype == 0 => {
            data(map, first, &mut rem, access, iov)?;
            None
        }
        SEGMENT | LAST_SEGMENT => Some(segment(first)?),
        _ => return Err(Status::SGL_TYPE_INVALID),
    };
    let mut seen = 1u32;
    while let Some((addr, count, last)) = seg.take() {
        // A segment in unshared client memory comes over whole (one message).
        // (Only what the descriptor cap lets us read: a longer one fails there.)
        let usable = count.min((MAX_DESCRIPTORS + 1).saturating_sub(seen));
        map.fetch(&[(addr, u64::from(usable) * 16)])
            .map_err(|_| Status::DATA_TRANSFER_ERROR)?;
        for i in 0..count {
            seen += 1;
            if seen > MAX_DESCRIPTORS {
                return Err(Status::INVALID_SGL_COUNT);
            }
            let at = addr
                .checked_add(u64::from(i) * 16)
                .ok_or(Status::DATA_TRANSFER_ERROR)?;
            let raw: [u8; 16] = map
                .translate(at, 16, Access::Read)
                .and_then(|s| {
                    s.read_obj(0)
                        .map_err(|_| guest_mem::MemError::Unmapped { addr: at, len: 16 })
                })
                .map_err(|_| Status::DATA_TRANSFER_ERROR)?;
            let d = parse(raw);
            match d.kind {
                DATA_BLOCK if d.subtype == 0 => data(map, d, &mut rem, access, iov)?,
                // Only the last descriptor of a non-last segment may point onwards.
                SEGMENT | LAST_SEGMENT if !last && i + 1 == count => seg = Some(segment(d)?),
                SEGMENT | LAST_SEGMENT => return Err(Status::INVALID_SGL_SEGMENT),
                _ => return Err(Status::SGL_TYPE_INVALID),
            }
        }
        if !last && seg.is_none() {
            // A Segment must end with a pointer to the next one.
            return Err(Status::INVALID_SGL_SEGMENT);
        }
    }
    if rem != 0 {
        return Err(Status::DATA_SGL_LENGTH_INVALID);
    }
    iov.finish(map, access)
}
