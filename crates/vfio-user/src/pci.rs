//! PCI configuration space of the emulated device: a type-0 header, one 64-bit memory
//! BAR, and Power Management, MSI-X and PCI Express capabilities. Every byte has a
//! write mask, so read-only fields ignore writes whatever the access width.

use crate::MsixSpec;

/// 4 KiB (PCIe extended space): QEMU drops the Express capability of a device whose
/// config region is only 256 bytes. The extended list is empty (header at 0x100 is 0).
pub const CONFIG_SIZE: usize = 4096;

pub const PM_CAP: usize = 0x40;
pub const MSIX_CAP: usize = 0x50;
pub const PCIE_CAP: usize = 0x60;

/// Bits of the MSI-X Message Control word.
pub const MSIX_CTRL_ENABLE: u16 = 1 << 15;
pub const MSIX_CTRL_FUNC_MASK: u16 = 1 << 14;

/// Identity of the device as the guest sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciIds {
    pub vendor: u16,
    pub device: u16,
    pub subsystem_vendor: u16,
    pub subsystem: u16,
    /// class << 16 | subclass << 8 | prog-if; 0x010802 for NVMe.
    pub class_code: u32,
    pub revision: u8,
}

#[derive(Clone)]
pub struct ConfigSpace {
    bytes: Box<[u8; CONFIG_SIZE]>,
    wmask: Box<[u8; CONFIG_SIZE]>,
    reset_image: Box<[u8; CONFIG_SIZE]>,
}

impl ConfigSpace {
    /// `bar0_size` must be a power of two (checked by the server).
    pub fn new(ids: &PciIds, bar0_size: u64, msix: &MsixSpec) -> ConfigSpace {
        let mut c = ConfigSpace {
            bytes: Box::new([0; CONFIG_SIZE]),
            wmask: Box::new([0; CONFIG_SIZE]),
            reset_image: Box::new([0; CONFIG_SIZE]),
        };
        c.init(ids, bar0_size, msix);
        c.reset_image = c.bytes.clone();
        c
    }

    fn put16(&mut self, off: usize, v: u16, wmask: u16) {
        self.bytes[off..off + 2].copy_from_slice(&v.to_le_bytes());
        self.wmask[off..off + 2].copy_from_slice(&wmask.to_le_bytes());
    }
    fn put32(&mut self, off: usize, v: u32, wmask: u32) {
        self.bytes[off..off + 4].copy_from_slice(&v.to_le_bytes());
        self.wmask[off..off + 4].copy_from_slice(&wmask.to_le_bytes());
    }

    fn init(&mut self, ids: &PciIds, bar0_size: u64, msix: &MsixSpec) {
        self.put16(0x00, ids.vendor, 0);
        self.put16(0x02, ids.device, 0);
        // Command: I/O, memory, bus master, parity, SERR#, INTx disable.
        self.put16(0x04, 0, 0x0547);
        // Status: capabilities list. Its error bits are RW1C; we never set them, so
        // treating the register as read-only is indistinguishable.
        self.put16(0x06, 0x0010, 0);
        let class = ids.class_code & 0x00ff_ffff;
        self.put32(0x08, (class << 8) | u32::from(ids.revision), 0);
        self.bytes[0x0c] = 0; // cache line size: writable scratch
        self.wmask[0x0c] = 0xff;
        // BAR0/1: 64-bit non-prefetchable memory. The mask makes size probing work:
        // writing all-ones reads back the size mask.
        let size_mask = !(bar0_size.max(16) - 1) & !0xf;
        self.put32(0x10, 0x4, size_mask as u32);
        self.put32(0x14, 0, (size_mask >> 32) as u32);
        self.put16(0x2c, ids.subsystem_vendor, 0);
        self.put16(0x2e, ids.subsystem, 0);
        self.bytes[0x34] = PM_CAP as u8;
        self.bytes[0x3c] = 0xff; // interrupt line: unassigned, writable by firmware
        self.wmask[0x3c] = 0xff;
        self.bytes[0x3d] = 1; // INTA#

        // Power Management v3, D0 only; PMCSR power state writable, No_Soft_Reset set.
        self.put16(PM_CAP, (MSIX_CAP as u16) << 8 | 0x01, 0);
        self.put16(PM_CAP + 2, 0x0003, 0);
        self.put16(PM_CAP + 4, 0x0008, 0x0003);

        // MSI-X: table size N-1 read-only; enable and function mask writable.
        let n = msix.vectors.clamp(1, 2048) - 1;
        self.put16(MSIX_CAP, (PCIE_CAP as u16) << 8 | 0x11, 0);
        self.put16(MSIX_CAP + 2, n, MSIX_CTRL_ENABLE | MSIX_CTRL_FUNC_MASK);
        self.put32(
            MSIX_CAP + 4,
            msix.table_offset | u32::from(msix.table_bar & 7),
            0,
        );
        self.put32(
            MSIX_CAP + 8,
            msix.pba_offset | u32::from(msix.pba_bar & 7),
            0,
        );

        // PCI Express v2 endpoint, last in the list.
        self.put16(PCIE_CAP, 0x10, 0);
        self.put16(PCIE_CAP + 0x02, 0x0002, 0); // version 2, type 0 = endpoint
        self.put32(PCIE_CAP + 0x04, 1 << 15, 0); // DevCap: RBER, 128 B payload, no FLR
        self.put16(PCIE_CAP + 0x08, 0x2810, 0x7eff); // DevCtl: RO on, 512 B MRRS
        self.put32(PCIE_CAP + 0x0c, 0x0000_0011, 0); // LinkCap: 2.5 GT/s x1, port 0
        self.put16(PCIE_CAP + 0x10, 0, 0x01c3); // LinkCtl: ASPM/RCB/CCC/ext sync
        self.put16(PCIE_CAP + 0x12, 0x0011, 0); // LinkSta: 2.5 GT/s x1
        self.put32(PCIE_CAP + 0x24, 0, 0); // DevCap2
        self.put16(PCIE_CAP + 0x28, 0, 0x0400); // DevCtl2: LTR enable only
        self.put32(PCIE_CAP + 0x2c, 0x0000_0002, 0); // LinkCap2: 2.5 GT/s supported
        self.put16(PCIE_CAP + 0x30, 0x0001, 0); // LinkCtl2: target 2.5 GT/s
    }

    /// Copies config bytes at `off`; false if the range is outside config space.
    pub fn read(&self, off: u64, data: &mut [u8]) -> bool {
        match range(off, data.len()) {
            Some(r) => {
                data.copy_from_slice(&self.bytes[r]);
                true
            }
            None => false,
        }
    }

    /// Applies a write through the write masks; false if out of range.
    pub fn write(&mut self, off: u64, data: &[u8]) -> bool {
        let Some(r) = range(off, data.len()) else {
            return false;
        };
        for (i, &v) in r.zip(data) {
            let m = self.wmask[i];
            self.bytes[i] = (self.bytes[i] & !m) | (v & m);
        }
        true
    }

    /// The whole space as the client last wrote it (for a keeper).
    pub fn image(&self) -> &[u8] {
        &self.bytes[..]
    }

    /// Writes a kept [`ConfigSpace::image`] back through the write masks.
    pub fn restore(&mut self, image: &[u8]) -> bool {
        image.len() == CONFIG_SIZE && self.write(0, image)
    }

    pub fn msix_control(&self) -> u16 {
        u16::from_le_bytes([self.bytes[MSIX_CAP + 2], self.bytes[MSIX_CAP + 3]])
    }

    /// Back to power-on values (DEVICE_RESET).
    pub fn reset(&mut self) {
        self.bytes = self.reset_image.clone();
    }
}

fn range(off: u64, len: usize) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(off).ok()?;
    let end = start.checked_add(len)?;
    (end <= CONFIG_SIZE).then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ConfigSpace {
        let ids = PciIds {
            vendor: 0x1b36,
            device: 0x0010,
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
            class_code: 0x010802,
            revision: 2,
        };
        let msix = MsixSpec {
            vectors: 9,
            table_bar: 0,
            table_offset: 0x2000,
            pba_bar: 0,
            pba_offset: 0x3000,
        };
        ConfigSpace::new(&ids, 0x4000, &msix)
    }

    fn r32(c: &ConfigSpace, off: u64) -> u32 {
        let mut b = [0; 4];
        assert!(c.read(off, &mut b));
        u32::from_le_bytes(b)
    }

    #[test]
    fn ids_and_caps_chain() {
        let c = cfg();
        assert_eq!(r32(&c, 0), 0x0010_1b36);
        assert_eq!(r32(&c, 8), 0x0108_0202);
        assert_eq!(r32(&c, 0x2c), 0x1100_1af4);
        let mut ids = vec![];
        let mut p = c.bytes[0x34] as usize;
        while p != 0 {
            ids.push(c.bytes[p]);
            p = c.bytes[p + 1] as usize;
        }
        assert_eq!(ids, [0x01, 0x11, 0x10]);
        assert_eq!(c.msix_control() & 0x7ff, 8);
        assert_eq!(r32(&c, MSIX_CAP as u64 + 4), 0x2000);
    }

    #[test]
    fn bar_probe_and_readonly() {
        let mut c = cfg();
        c.write(0x10, &[0xff; 4]);
        c.write(0x14, &[0xff; 4]);
        assert_eq!(r32(&c, 0x10), 0xffff_c004);
        assert_eq!(r32(&c, 0x14), 0xffff_ffff);
        c.write(0x10, &0xfebf_0000u32.to_le_bytes());
        assert_eq!(r32(&c, 0x10), 0xfebf_0004);
        c.write(0, &[0; 4]);
        assert_eq!(r32(&c, 0), 0x0010_1b36);
        c.write(0x18, &[0xff; 4]);
        assert_eq!(r32(&c, 0x18), 0);
        c.write(0x04, &[0xff, 0xff]);
        assert_eq!(r32(&c, 4) & 0xffff, 0x0547);
        c.write(MSIX_CAP as u64 + 2, &[0xff, 0xff]);
        assert_eq!(c.msix_control(), 0xc008);
        c.reset();
        assert_eq!(c.msix_control(), 8);
        assert!(!c.read(4095, &mut [0; 2]));
        assert!(!c.write(u64::MAX, &[0]));
    }
}
