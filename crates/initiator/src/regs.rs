//! NVMe BAR0 register offsets and fields.

pub const CAP: u64 = 0x00;
pub const VS: u64 = 0x08;
pub const CC: u64 = 0x14;
pub const CSTS: u64 = 0x1c;
pub const AQA: u64 = 0x24;
pub const ASQ: u64 = 0x28;
pub const ACQ: u64 = 0x30;
pub const DOORBELL_BASE: u64 = 0x1000;

pub const CC_EN: u32 = 1;
pub const CC_IOSQES: u32 = 6 << 16;
pub const CC_IOCQES: u32 = 4 << 20;
pub const CSTS_RDY: u32 = 1;
pub const CSTS_CFS: u32 = 2;

/// Decoded controller capabilities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cap {
    pub raw: u64,
    /// Largest queue size the controller supports (entries, not 0-based).
    pub max_queue_entries: u32,
    /// Worst-case time for CSTS.RDY to change, in milliseconds.
    pub timeout_ms: u64,
    pub dstrd: u32,
    pub css_nvm: bool,
    pub mpsmin_bytes: u64,
}

impl Cap {
    pub fn parse(raw: u64) -> Cap {
        Cap {
            raw,
            max_queue_entries: (raw & 0xffff) as u32 + 1,
            timeout_ms: ((raw >> 24) & 0xff) * 500,
            dstrd: ((raw >> 32) & 0xf) as u32,
            css_nvm: (raw >> 37) & 1 != 0,
            mpsmin_bytes: 1 << (12 + ((raw >> 48) & 0xf)),
        }
    }

    /// BAR0 offset of the doorbell of queue `qid` (`cq` selects the completion side).
    pub fn doorbell(&self, qid: u16, cq: bool) -> u64 {
        DOORBELL_BASE + (2 * qid as u64 + cq as u64) * (4u64 << self.dstrd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_fields_and_doorbells() {
        let c = Cap::parse(0x0020_0020_1e01_003f | 1 << 37);
        assert_eq!(c.max_queue_entries, 64);
        assert_eq!(c.timeout_ms, 0x1e * 500);
        assert!(c.css_nvm);
        assert_eq!(c.doorbell(0, false), 0x1000);
        assert_eq!(c.doorbell(1, true), 0x100c);
        let c2 = Cap { dstrd: 1, ..c };
        assert_eq!(c2.doorbell(1, true), 0x1000 + 3 * 8);
    }
}
