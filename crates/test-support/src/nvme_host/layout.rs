//! Where the fake host keeps things: its guest memory, the doorbells in BAR0, and
//! each queue pair's rings. Plain values, so the host and its queue operations
//! both build on them.

use initiator::cmd::CqRing;

/// Guest address of the fake host's memory.
pub const BASE: u64 = 0x10_0000;
pub const MEM_SIZE: u64 = 32 << 20;
pub const PAGE: u64 = 4096;

/// BAR0 offset of the doorbells (stride 4: CAP.DSTRD 0).
pub const DOORBELLS: u64 = 0x1000;

/// One queue pair as the host sees it: where its rings are, its SQ tail and the CQ
/// head and phase it expects.
#[derive(Clone, Copy)]
pub struct Q {
    pub sq: u64,
    pub cq: u64,
    pub size: u16,
    /// CQ this SQ posts to.
    pub cqid: u16,
    pub tail: u16,
    pub ring: CqRing,
}

impl Default for Q {
    fn default() -> Q {
        Q::new(0, 0, 0, 0, 0)
    }
}

impl Q {
    pub fn new(sq: u64, cq: u64, size: u16, cq_size: u16, cqid: u16) -> Q {
        Q {
            sq,
            cq,
            size,
            cqid,
            tail: 0,
            ring: CqRing::new(cq_size),
        }
    }
}
