//! Submission/completion ring bookkeeping shared by the admin and I/O paths.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use guest_mem::DmaSlice;

use crate::status::Status;

pub(crate) const SQE_SIZE: usize = 64;
pub(crate) const CQE_SIZE: usize = 16;

/// Byte offset of a doorbell inside the doorbell page (DSTRD = 0).
pub(crate) fn db_index(qid: u16, cq: bool) -> usize {
    (usize::from(qid) * 2 + usize::from(cq)) * 4
}

/// A submission queue entry, decoded into dwords.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Sqe {
    pub dw: [u32; 16],
}

impl Sqe {
    pub fn opcode(&self) -> u8 {
        crate::bits::lo8(self.dw[0])
    }
    pub fn fuse(&self) -> u32 {
        (self.dw[0] >> 8) & 3
    }
    pub fn psdt(&self) -> u32 {
        (self.dw[0] >> 14) & 3
    }
    pub fn cid(&self) -> u16 {
        (self.dw[0] >> 16) as u16
    }
    pub fn nsid(&self) -> u32 {
        self.dw[1]
    }
    pub fn prp1(&self) -> u64 {
        u64::from(self.dw[6]) | (u64::from(self.dw[7]) << 32)
    }
    pub fn prp2(&self) -> u64 {
        u64::from(self.dw[8]) | (u64::from(self.dw[9]) << 32)
    }
    /// The 16-byte SGL1 descriptor (same bytes as PRP1/PRP2).
    pub fn sgl1(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        for (i, d) in self.dw[6..10].iter().enumerate() {
            b[i * 4..i * 4 + 4].copy_from_slice(&d.to_le_bytes());
        }
        b
    }
    pub fn cdw(&self, n: usize) -> u32 {
        self.dw.get(n).copied().unwrap_or(0)
    }

    /// Reads entry `idx` of a ring mapped at `ring`.
    pub fn fetch(ring: &DmaSlice<'_>, idx: u16) -> Option<Sqe> {
        let raw: [u32; 16] = ring.read_obj(usize::from(idx) * SQE_SIZE).ok()?;
        Some(Sqe {
            dw: raw.map(u32::from_le),
        })
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SqRing {
    pub qid: u16,
    pub base: u64,
    pub size: u16,
    pub head: u16,
}

impl SqRing {
    pub fn advance(&mut self) {
        self.head = wrap_inc(self.head, self.size);
    }
    pub fn ring_bytes(&self) -> usize {
        usize::from(self.size) * SQE_SIZE
    }
    /// How many entries index `i` lies past the head (entries the host added, when
    /// `i` is its tail).
    pub fn ahead(&self, i: u16) -> u32 {
        let size = u32::from(self.size).max(1);
        (u32::from(i) + size - u32::from(self.head)) % size
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CqRing {
    pub qid: u16,
    pub base: u64,
    pub size: u16,
    pub head: u16,
    pub tail: u16,
    pub phase: bool,
    pub ien: bool,
    pub vector: u16,
}

impl CqRing {
    pub fn new(qid: u16, base: u64, size: u16, ien: bool, vector: u16) -> CqRing {
        CqRing {
            qid,
            base,
            size,
            head: 0,
            tail: 0,
            phase: true,
            ien,
            vector,
        }
    }

    pub fn ring_bytes(&self) -> usize {
        usize::from(self.size) * CQE_SIZE
    }

    /// Entries we may still post without overwriting ones the host has not consumed.
    pub fn free(&self) -> u32 {
        let size = u32::from(self.size);
        let used = (u32::from(self.tail) + size - u32::from(self.head) % size.max(1)) % size.max(1);
        size.saturating_sub(1).saturating_sub(used)
    }

    /// Writes one CQE; the dword holding the phase tag is stored last (release) so the
    /// host never sees a new phase with stale contents. False if the ring is unusable.
    pub fn post(
        &mut self,
        ring: &DmaSlice<'_>,
        dw0: u32,
        sq_head: u16,
        sqid: u16,
        cid: u16,
        status: Status,
    ) -> bool {
        let off = usize::from(self.tail) * CQE_SIZE;
        let mut first = [0u8; 12];
        first[0..4].copy_from_slice(&dw0.to_le_bytes());
        first[8..12].copy_from_slice(&(u32::from(sq_head) | (u32::from(sqid) << 16)).to_le_bytes());
        let dw3 =
            u32::from(cid) | (u32::from(self.phase) << 16) | (u32::from(status.0 & 0x7fff) << 17);
        if ring.write_from(off, &first).is_err() || ring.store_u32(off + 12, dw3.to_le()).is_none()
        {
            return false;
        }
        self.tail = wrap_inc(self.tail, self.size);
        if self.tail == 0 {
            self.phase = !self.phase;
        }
        true
    }
}

/// The guest ranges (IOVA, length) of entries `from..to` of a ring of `size`
/// entries of `entry` bytes at `base`: one range, or two when it wraps.
pub(crate) fn ring_ranges(
    base: u64,
    from: u16,
    to: u16,
    size: u16,
    entry: usize,
) -> [(u64, u64); 2] {
    let e = entry as u64;
    let at = |i: u16| base.wrapping_add(u64::from(i) * e);
    if from <= to {
        [(at(from), u64::from(to - from) * e), (base, 0)]
    } else {
        [
            (at(from), u64::from(size.saturating_sub(from)) * e),
            (base, u64::from(to) * e),
        ]
    }
}

pub(crate) fn wrap_inc(v: u16, size: u16) -> u16 {
    let n = u32::from(v) + 1;
    if n >= u32::from(size) {
        0
    } else {
        crate::bits::lo16(n)
    }
}
