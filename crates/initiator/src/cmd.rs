//! NVMe submission/completion entries and command constructors.

use std::fmt;

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

pub mod opc {
    pub const DELETE_IO_SQ: u8 = 0x00;
    pub const CREATE_IO_SQ: u8 = 0x01;
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const DELETE_IO_CQ: u8 = 0x04;
    pub const CREATE_IO_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
    pub const ASYNC_EVENT: u8 = 0x0c;
    pub const KEEP_ALIVE: u8 = 0x18;
    pub const DOORBELL_BUFFER_CONFIG: u8 = 0x7c;
    pub const FORMAT_NVM: u8 = 0x80;

    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DSM: u8 = 0x09;
}

pub const FEAT_NUM_QUEUES: u32 = 0x07;
pub const FEAT_ASYNC_EVENT_CONFIG: u32 = 0x0b;
/// Log page: Changed Namespace List.
pub const LOG_CHANGED_NS: u8 = 0x04;
/// CDW0 bits 15:14 = 01: data pointer is an SGL.
pub const PSDT_SGL: u8 = 0x40;

/// A 64-byte submission queue entry.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
#[repr(C)]
pub struct Sqe {
    pub opcode: u8,
    /// Fused (bits 1:0) and PSDT (bits 7:6).
    pub flags: u8,
    pub cid: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub mptr: u64,
    pub dptr: [u64; 2],
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

impl Sqe {
    pub fn new(opcode: u8) -> Sqe {
        Sqe {
            opcode,
            ..Default::default()
        }
    }
    pub fn identify(cns: u8, nsid: u32) -> Sqe {
        Sqe {
            nsid,
            cdw10: cns as u32,
            ..Sqe::new(opc::IDENTIFY)
        }
    }
    /// Doorbell Buffer Config: shadow doorbells at `db`, EventIdx at `ei` (one
    /// page each).
    pub fn doorbell_buffer_config(db: u64, ei: u64) -> Sqe {
        Sqe {
            dptr: [db, ei],
            ..Sqe::new(opc::DOORBELL_BUFFER_CONFIG)
        }
    }
    pub fn set_features(fid: u32, cdw11: u32) -> Sqe {
        Sqe {
            cdw10: fid,
            cdw11,
            ..Sqe::new(opc::SET_FEATURES)
        }
    }
    pub fn get_log_page(lid: u8, nsid: u32, dwords: u32) -> Sqe {
        let numd = dwords.saturating_sub(1);
        Sqe {
            nsid,
            cdw10: lid as u32 | (numd & 0xffff) << 16,
            cdw11: numd >> 16,
            ..Sqe::new(opc::GET_LOG_PAGE)
        }
    }
    pub fn create_io_cq(qid: u16, depth: u16, iova: u64, vector: u16, ien: bool) -> Sqe {
        let mut s = Sqe::new(opc::CREATE_IO_CQ);
        s.dptr[0] = iova;
        s.cdw10 = (depth as u32 - 1) << 16 | qid as u32;
        s.cdw11 = (vector as u32) << 16 | (ien as u32) << 1 | 1;
        s
    }
    pub fn create_io_sq(qid: u16, depth: u16, iova: u64, cqid: u16) -> Sqe {
        let mut s = Sqe::new(opc::CREATE_IO_SQ);
        s.dptr[0] = iova;
        s.cdw10 = (depth as u32 - 1) << 16 | qid as u32;
        s.cdw11 = (cqid as u32) << 16 | 1;
        s
    }
    pub fn delete_io_sq(qid: u16) -> Sqe {
        Sqe {
            cdw10: qid as u32,
            ..Sqe::new(opc::DELETE_IO_SQ)
        }
    }
    pub fn delete_io_cq(qid: u16) -> Sqe {
        Sqe {
            cdw10: qid as u32,
            ..Sqe::new(opc::DELETE_IO_CQ)
        }
    }
    /// Read/Write/Write Zeroes header (`nlb` is the block count, 1..=65536).
    pub fn rw(opcode: u8, nsid: u32, slba: u64, nlb: u32) -> Sqe {
        Sqe {
            nsid,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: nlb.saturating_sub(1) & 0xffff,
            ..Sqe::new(opcode)
        }
    }
}

/// A 16-byte completion queue entry.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
#[repr(C)]
pub struct Cqe {
    pub dw0: u32,
    pub dw1: u32,
    pub sq_head: u16,
    pub sq_id: u16,
    pub cid: u16,
    /// Phase (bit 0) and status.
    pub status: u16,
}

/// Decoded status field of a completion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    pub crd: u8,
    pub more: bool,
    pub dnr: bool,
}

impl Status {
    /// From the CQE's upper 16 bits (phase bit included and ignored).
    pub fn from_raw(raw: u16) -> Status {
        Status {
            sc: (raw >> 1) as u8,
            sct: ((raw >> 9) & 7) as u8,
            crd: ((raw >> 12) & 3) as u8,
            more: raw & (1 << 14) != 0,
            dnr: raw & (1 << 15) != 0,
        }
    }
    pub fn is_ok(&self) -> bool {
        self.sct == 0 && self.sc == 0
    }
    /// (SCT << 8 | SC), handy for compact counters and comparisons.
    pub fn code(&self) -> u16 {
        (self.sct as u16) << 8 | self.sc as u16
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sct={:#x} sc={:#04x}", self.sct, self.sc)?;
        if self.dnr {
            write!(f, " dnr")?;
        }
        if self.more {
            write!(f, " more")?;
        }
        Ok(())
    }
}

/// What a completion says, decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    pub cid: u16,
    pub status: Status,
    pub sq_head: u16,
    pub sq_id: u16,
    pub dw0: u32,
    pub dw1: u32,
}

impl From<Cqe> for Completion {
    fn from(c: Cqe) -> Self {
        Completion {
            cid: c.cid,
            status: Status::from_raw(c.status),
            sq_head: c.sq_head,
            sq_id: c.sq_id,
            dw0: c.dw0,
            dw1: c.dw1,
        }
    }
}

/// Consumer side of a completion ring: head index and expected phase.
#[derive(Clone, Copy, Debug)]
pub struct CqRing {
    pub head: u16,
    pub phase: bool,
    pub depth: u16,
}

impl CqRing {
    pub fn new(depth: u16) -> CqRing {
        CqRing {
            head: 0,
            phase: true,
            depth,
        }
    }

    /// Takes the entry at head if its phase says the controller posted it.
    pub fn pop(&mut self, ring: &guest_mem::DmaSlice<'_>) -> Option<Cqe> {
        let off = self.head as usize * 16;
        // The status word is the last one the controller writes; acquire it first so the
        // rest of the entry is read after it.
        let w = ring.load_u32(off + 12)?;
        if ((w >> 16) & 1 != 0) != self.phase {
            return None;
        }
        let cqe: Cqe = ring.read_obj(off).ok()?;
        self.head += 1;
        if self.head >= self.depth {
            self.head = 0;
            self.phase = !self.phase;
        }
        Some(cqe)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_mem::SharedMem;

    fn post(mem: &guest_mem::DmaSlice<'_>, idx: usize, cid: u16, phase: bool, sc: u8) {
        let c = Cqe {
            cid,
            sq_head: idx as u16,
            status: (sc as u16) << 1 | phase as u16,
            ..Default::default()
        };
        mem.write_obj(idx * 16, &c).unwrap();
    }

    #[test]
    fn phase_flips_on_wrap() {
        let m = SharedMem::new("cq", 4096).unwrap();
        let s = m.slice(0, 4 * 16).unwrap();
        let mut cq = CqRing::new(4);
        assert!(cq.pop(&s).is_none(), "zeroed ring has phase 0: empty");
        for i in 0..4 {
            post(&s, i, i as u16, true, 0);
        }
        for i in 0..4 {
            assert_eq!(cq.pop(&s).unwrap().cid, i);
        }
        assert!(!cq.phase);
        assert!(cq.pop(&s).is_none(), "old entries have the old phase");
        post(&s, 0, 7, false, 0x02);
        let c = Completion::from(cq.pop(&s).unwrap());
        assert_eq!(c.cid, 7);
        assert_eq!(c.status.sc, 2);
        assert!(!c.status.is_ok());
        assert!(cq.pop(&s).is_none());
    }

    #[test]
    fn status_decode() {
        let s = Status::from_raw(0x8000 | 1 << 9 | 0x0b << 1 | 1);
        assert_eq!((s.sct, s.sc, s.dnr), (1, 0x0b, true));
        assert_eq!(s.code(), 0x10b);
    }

    #[test]
    fn sqe_layout() {
        assert_eq!(std::mem::size_of::<Sqe>(), 64);
        assert_eq!(std::mem::size_of::<Cqe>(), 16);
        let s = Sqe::rw(opc::WRITE, 1, 0x1_0000_0002, 8);
        assert_eq!((s.cdw10, s.cdw11, s.cdw12), (2, 1, 7));
        let c = Sqe::create_io_cq(3, 64, 0x1000, 3, true);
        assert_eq!(c.cdw10, 63 << 16 | 3);
        assert_eq!(c.cdw11, 3 << 16 | 3);
    }
}
