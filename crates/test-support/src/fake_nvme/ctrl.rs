//! The fake NVMe controller behind the fake server: registers, queues, admin
//! commands; I/O commands are in `dptr`.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use guest_mem::{DmaSlice, MappedRegion, SharedMem};

pub const NS_BLOCKS: u64 = 2048;
pub const LBA: u64 = 512;
pub(super) const PAGE: u64 = 4096;

#[derive(Clone, Copy, Default)]
struct Sq {
    iova: u64,
    depth: u16,
    head: u16,
    cqid: u16,
    live: bool,
}

#[derive(Clone, Copy, Default)]
struct Cq {
    iova: u64,
    depth: u16,
    tail: u16,
    phase: bool,
    ien: bool,
    vector: u16,
    live: bool,
}

pub struct Ctrl {
    bar: Arc<SharedMem>,
    pub mem: Vec<MappedRegion>,
    regs: [u8; 0x40],
    sqs: Vec<Sq>,
    cqs: Vec<Cq>,
    irqs: Vec<Option<File>>,
    pub disk: Vec<u8>,
    pub(super) sgl: bool,
    /// Every I/O command seen: (opcode, flags byte, dptr).
    pub io_log: Vec<(u8, u8, [u64; 2])>,
    pub irq_count: u64,
}

impl Ctrl {
    pub fn new(bar: Arc<SharedMem>, sgl: bool) -> Ctrl {
        let mut c = Ctrl {
            bar,
            mem: Vec::new(),
            regs: [0; 0x40],
            sqs: vec![Sq::default(); 16],
            cqs: vec![Cq::default(); 16],
            irqs: (0..64).map(|_| None).collect(),
            disk: vec![0; (NS_BLOCKS * LBA) as usize],
            sgl,
            io_log: Vec::new(),
            irq_count: 0,
        };
        // MQES 255, CQR, TO 1 (500 ms), DSTRD 0, CSS NVM.
        let cap: u64 = 255 | 1 << 16 | 1 << 24 | 1 << 37;
        c.regs[0..8].copy_from_slice(&cap.to_le_bytes());
        c.regs[8..12].copy_from_slice(&0x0001_0400u32.to_le_bytes());
        c
    }

    fn reg32(&self, off: usize) -> u32 {
        u32::from_le_bytes(self.regs[off..off + 4].try_into().unwrap())
    }
    fn reg64(&self, off: usize) -> u64 {
        u64::from_le_bytes(self.regs[off..off + 8].try_into().unwrap())
    }

    pub fn set_irq(&mut self, v: usize, fd: OwnedFd) {
        if let Some(s) = self.irqs.get_mut(v) {
            *s = Some(File::from(fd));
        }
    }

    pub fn reset(&mut self) {
        self.regs[0x14..0x20].fill(0);
        self.sqs.iter_mut().for_each(|q| *q = Sq::default());
        self.cqs.iter_mut().for_each(|q| *q = Cq::default());
    }

    pub fn read(&mut self, off: u64, out: &mut [u8]) {
        let off = off as usize;
        if off + out.len() <= self.regs.len() {
            out.copy_from_slice(&self.regs[off..off + out.len()]);
        } else if let Some(s) = self.bar.slice(off as u64, out.len()) {
            let _ = s.read_into(0, out);
        }
    }

    pub fn write(&mut self, off: u64, data: &[u8]) {
        let o = off as usize;
        if o >= 0x1000 {
            if let Some(s) = self.bar.slice(off, data.len()) {
                let _ = s.write_from(0, data);
            }
            self.process();
            return;
        }
        if o + data.len() > self.regs.len() || o < 0x14 {
            return;
        }
        self.regs[o..o + data.len()].copy_from_slice(data);
        if o == 0x14 {
            let cc = self.reg32(0x14);
            let mut csts = self.reg32(0x1c);
            if cc & 1 != 0 && csts & 1 == 0 {
                let aqa = self.reg32(0x24);
                self.sqs[0] = Sq {
                    iova: self.reg64(0x28),
                    depth: (aqa & 0xfff) as u16 + 1,
                    live: true,
                    ..Default::default()
                };
                self.cqs[0] = Cq {
                    iova: self.reg64(0x30),
                    depth: ((aqa >> 16) & 0xfff) as u16 + 1,
                    phase: true,
                    live: true,
                    ..Default::default()
                };
                self.bar.slice(0x1000, 0x1000).unwrap().fill(0);
                csts |= 1;
            } else if cc & 1 == 0 {
                self.sqs.iter_mut().for_each(|q| q.live = false);
                self.cqs.iter_mut().for_each(|q| q.live = false);
                self.bar.slice(0x1000, 0x1000).unwrap().fill(0);
                csts &= !1;
            }
            self.regs[0x1c..0x20].copy_from_slice(&csts.to_le_bytes());
        }
    }

    pub fn guest(&self, iova: u64, len: usize) -> Option<DmaSlice<'_>> {
        let r = self
            .mem
            .iter()
            .find(|r| iova >= r.iova() && iova - r.iova() < r.len())?;
        r.slice(iova - r.iova(), len)
    }

    /// Runs every command between each SQ's head and its doorbell.
    pub fn process(&mut self) {
        if self.reg32(0x1c) & 1 == 0 {
            return;
        }
        for qid in 0..self.sqs.len() {
            loop {
                let sq = self.sqs[qid];
                if !sq.live {
                    break;
                }
                let tail = self.bar.all().load_u32(0x1000 + qid * 8).unwrap() as u16;
                if tail >= sq.depth || sq.head == tail {
                    break;
                }
                let mut e = [0u8; 64];
                let ok = self
                    .guest(sq.iova + sq.head as u64 * 64, 64)
                    .map(|s| s.read_into(0, &mut e).is_ok())
                    .unwrap_or(false);
                self.sqs[qid].head = (sq.head + 1) % sq.depth;
                if !ok {
                    break;
                }
                let (status, dw0) = if qid == 0 {
                    self.admin(&e)
                } else {
                    self.io(&e)
                };
                let cid = u16::from_le_bytes([e[2], e[3]]);
                self.post(sq.cqid as usize, qid as u16, cid, status, dw0);
            }
        }
    }

    fn post(&mut self, cqid: usize, sqid: u16, cid: u16, status: u16, dw0: u32) {
        let head = self.sqs[sqid as usize].head;
        let Some(cq) = self.cqs.get(cqid).copied().filter(|c| c.live) else {
            return;
        };
        let mut c = [0u8; 16];
        c[0..4].copy_from_slice(&dw0.to_le_bytes());
        c[8..10].copy_from_slice(&head.to_le_bytes());
        c[10..12].copy_from_slice(&sqid.to_le_bytes());
        c[12..14].copy_from_slice(&cid.to_le_bytes());
        c[14..16].copy_from_slice(&((status << 1) | cq.phase as u16).to_le_bytes());
        if let Some(s) = self.guest(cq.iova + cq.tail as u64 * 16, 16) {
            let _ = s.write_from(0, &c[..12]);
            let w = u32::from_le_bytes(c[12..16].try_into().unwrap());
            s.store_u32(12, w);
        }
        let q = &mut self.cqs[cqid];
        q.tail += 1;
        if q.tail == q.depth {
            q.tail = 0;
            q.phase = !q.phase;
        }
        if cq.ien {
            if let Some(Some(f)) = self.irqs.get_mut(cq.vector as usize) {
                let _ = f.write_all(&1u64.to_le_bytes());
                self.irq_count += 1;
            }
        }
    }

    pub(super) fn dw(e: &[u8; 64], i: usize) -> u32 {
        u32::from_le_bytes(e[i * 4..i * 4 + 4].try_into().unwrap())
    }
    pub(super) fn q(e: &[u8; 64], i: usize) -> u64 {
        u64::from_le_bytes(e[i..i + 8].try_into().unwrap())
    }

    fn write_page(&self, prp1: u64, page: &[u8; 4096]) -> u16 {
        match self.guest(prp1, 4096) {
            Some(s) => {
                let _ = s.write_from(0, page);
                0
            }
            None => 0x02 | 0x2 << 8,
        }
    }

    fn admin(&mut self, e: &[u8; 64]) -> (u16, u32) {
        let (cdw10, cdw11) = (Self::dw(e, 10), Self::dw(e, 11));
        let nsid = Self::dw(e, 1);
        match e[0] {
            0x06 => {
                let mut p = [0u8; 4096];
                match cdw10 & 0xff {
                    1 => {
                        p[4..12].copy_from_slice(b"FAKE0001");
                        p[24..32].copy_from_slice(b"fakenvme");
                        p[64..67].copy_from_slice(b"1.0");
                        p[77] = 5;
                        p[512] = 0x66;
                        p[513] = 0x44;
                        p[516..520].copy_from_slice(&1u32.to_le_bytes());
                        p[525] = 1;
                        if self.sgl {
                            p[536] = 1;
                        }
                    }
                    0 if nsid == 1 => {
                        p[0..8].copy_from_slice(&NS_BLOCKS.to_le_bytes());
                        p[8..16].copy_from_slice(&NS_BLOCKS.to_le_bytes());
                        p[128 + 2] = 9;
                    }
                    0 => return (0x0b, 0),
                    2 => p[0..4].copy_from_slice(&1u32.to_le_bytes()),
                    _ => return (0x02, 0),
                }
                (self.write_page(Self::q(e, 24), &p), 0)
            }
            0x09 if cdw10 & 0xff == 7 => (0, 7 << 16 | 7),
            0x05 => {
                let qid = (cdw10 & 0xffff) as usize;
                if qid == 0 || qid >= self.cqs.len() || self.cqs[qid].live {
                    return (0x101, 0);
                }
                self.cqs[qid] = Cq {
                    iova: Self::q(e, 24),
                    depth: (cdw10 >> 16) as u16 + 1,
                    phase: true,
                    ien: cdw11 & 2 != 0,
                    vector: (cdw11 >> 16) as u16,
                    live: true,
                    tail: 0,
                };
                (0, 0)
            }
            0x01 => {
                let qid = (cdw10 & 0xffff) as usize;
                let cqid = (cdw11 >> 16) as usize;
                if qid == 0 || qid >= self.sqs.len() || self.sqs[qid].live {
                    return (0x101, 0);
                }
                if !self.cqs.get(cqid).is_some_and(|c| c.live) {
                    return (0x100, 0);
                }
                self.sqs[qid] = Sq {
                    iova: Self::q(e, 24),
                    depth: (cdw10 >> 16) as u16 + 1,
                    cqid: cqid as u16,
                    head: 0,
                    live: true,
                };
                (0, 0)
            }
            0x00 | 0x04 => {
                let qid = (cdw10 & 0xffff) as usize;
                if qid == 0 || qid >= self.sqs.len() {
                    return (0x101, 0);
                }
                if e[0] == 0 {
                    self.sqs[qid].live = false;
                    self.bar.all().store_u32(0x1000 + qid * 8, 0);
                } else {
                    self.cqs[qid].live = false;
                    self.bar.all().store_u32(0x1000 + qid * 8 + 4, 0);
                }
                (0, 0)
            }
            _ => (0x01, 0),
        }
    }
}
