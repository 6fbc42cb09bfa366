//! BAR0 controller registers (NVMe 1.4 §3.1). State lives behind the controller's
//! mutex: only the control path touches it.

pub(crate) const CAP: u64 = 0x00;
pub(crate) const VS: u64 = 0x08;
pub(crate) const INTMS: u64 = 0x0c;
pub(crate) const INTMC: u64 = 0x10;
pub(crate) const CC: u64 = 0x14;
pub(crate) const CSTS: u64 = 0x1c;
pub(crate) const AQA: u64 = 0x24;
pub(crate) const ASQ: u64 = 0x28;
pub(crate) const ACQ: u64 = 0x30;

pub(crate) const VERSION: u32 = 0x0001_0400;

pub(crate) const CC_EN: u32 = 1;
pub(crate) const CSTS_RDY: u32 = 1;
pub(crate) const CSTS_CFS: u32 = 1 << 1;
pub(crate) const SHST_COMPLETE: u32 = 2;

pub(crate) fn cc_css(cc: u32) -> u32 {
    (cc >> 4) & 7
}
pub(crate) fn cc_mps(cc: u32) -> u32 {
    (cc >> 7) & 0xf
}
pub(crate) fn cc_ams(cc: u32) -> u32 {
    (cc >> 11) & 7
}
pub(crate) fn cc_shn(cc: u32) -> u32 {
    (cc >> 14) & 3
}
pub(crate) fn cc_iosqes(cc: u32) -> u32 {
    (cc >> 16) & 0xf
}
pub(crate) fn cc_iocqes(cc: u32) -> u32 {
    (cc >> 20) & 0xf
}

/// CAP for a controller with `mqes` (0-based) entries per queue: contiguous queues
/// required, doorbell stride 4, NVM command set, 4 KiB pages only.
pub(crate) fn capabilities(mqes: u16) -> u64 {
    let to: u64 = 20; // 10 s in 500 ms units: generous for a software controller.
    u64::from(mqes) | (1 << 16) | (to << 24) | (1 << 37)
}

#[derive(Debug, Default, Clone)]
pub(crate) struct Regs {
    pub cap: u64,
    pub cc: u32,
    pub rdy: bool,
    /// Fatal status from the control path (bad enable); the I/O path has its own flag.
    pub cfs: bool,
    pub shst: u32,
    pub intms: u32,
    pub aqa: u32,
    pub asq: u64,
    pub acq: u64,
}

impl Regs {
    pub fn new(cap: u64) -> Regs {
        Regs {
            cap,
            ..Regs::default()
        }
    }

    /// Everything but CAP back to its reset value.
    pub fn reset(&mut self) {
        *self = Regs::new(self.cap);
    }

    pub fn csts(&self, fatal: bool) -> u32 {
        let mut v = self.shst << 2;
        if self.rdy {
            v |= CSTS_RDY;
        }
        if self.cfs || fatal {
            v |= CSTS_CFS;
        }
        v
    }

    /// The dword at `off` (4-aligned).
    pub fn read32(&self, off: u64, fatal: bool) -> u32 {
        match off {
            CAP => self.cap as u32,
            0x04 => (self.cap >> 32) as u32,
            VS => VERSION,
            INTMS | INTMC => self.intms,
            CC => self.cc,
            CSTS => self.csts(fatal),
            AQA => self.aqa,
            ASQ => self.asq as u32,
            0x2c => (self.asq >> 32) as u32,
            ACQ => self.acq as u32,
            0x34 => (self.acq >> 32) as u32,
            _ => 0,
        }
    }

    /// Stores a dword to a register that has no side effects (CC is handled by the
    /// controller). Returns false if `off` is not such a register.
    pub fn write_plain(&mut self, off: u64, v: u32) -> bool {
        let lo = |r: u64| (r & !0xffff_ffff) | u64::from(v);
        let hi = |r: u64| (r & 0xffff_ffff) | (u64::from(v) << 32);
        match off {
            INTMS => self.intms |= v,
            INTMC => self.intms &= !v,
            AQA => self.aqa = v & 0x0fff_0fff,
            ASQ => self.asq = lo(self.asq),
            0x2c => self.asq = hi(self.asq),
            ACQ => self.acq = lo(self.acq),
            0x34 => self.acq = hi(self.acq),
            _ => return false,
        }
        true
    }
}
