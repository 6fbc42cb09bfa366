//! The fake controller's I/O commands: PRP and SGL walking over the client's
//! mapped memory, and the RAM namespace.

use super::ctrl::{Ctrl, LBA, NS_BLOCKS, PAGE};

impl Ctrl {
    fn prp_segments(&self, prp1: u64, prp2: u64, len: u64) -> Option<Vec<(u64, u64)>> {
        let first = len.min(PAGE - prp1 % PAGE);
        let mut v = vec![(prp1, first)];
        let mut rem = len - first;
        if rem == 0 {
            return Some(v);
        }
        if rem <= PAGE {
            v.push((prp2, rem));
            return Some(v);
        }
        let mut list = prp2;
        let mut hops = 0;
        'outer: while rem > 0 {
            hops += 1;
            if hops > 1000 || !list.is_multiple_of(8) {
                return None;
            }
            let n = (PAGE - list % PAGE) / 8;
            let s = self.guest(list, (n * 8) as usize)?;
            for i in 0..n {
                let e: u64 = s.read_obj((i * 8) as usize).ok()?;
                if i == n - 1 && rem > PAGE {
                    list = e;
                    continue 'outer;
                }
                if !e.is_multiple_of(PAGE) {
                    return None;
                }
                let l = rem.min(PAGE);
                v.push((e, l));
                rem -= l;
                if rem == 0 {
                    break 'outer;
                }
            }
        }
        Some(v)
    }

    fn sgl_segments(&self, d: [u8; 16], len: u64) -> Option<Vec<(u64, u64)>> {
        let addr = u64::from_le_bytes(d[..8].try_into().unwrap());
        let dlen = u32::from_le_bytes(d[8..12].try_into().unwrap()) as u64;
        let mut v = Vec::new();
        match d[15] >> 4 {
            0 => v.push((addr, dlen)),
            2 | 3 => {
                let (mut seg, mut slen, mut last) = (addr, dlen, d[15] >> 4 == 3);
                for _ in 0..1000 {
                    if slen == 0 || slen % 16 != 0 {
                        return None;
                    }
                    let s = self.guest(seg, slen as usize)?;
                    let n = slen / 16;
                    let mut next = None;
                    for i in 0..n {
                        let mut x = [0u8; 16];
                        s.read_into((i * 16) as usize, &mut x).ok()?;
                        let a = u64::from_le_bytes(x[..8].try_into().unwrap());
                        let l = u32::from_le_bytes(x[8..12].try_into().unwrap()) as u64;
                        match x[15] >> 4 {
                            0 => v.push((a, l)),
                            t @ (2 | 3) if i == n - 1 && !last => next = Some((a, l, t == 3)),
                            _ => return None,
                        }
                    }
                    match next {
                        Some((a, l, t)) => (seg, slen, last) = (a, l, t),
                        None => break,
                    }
                }
            }
            _ => return None,
        }
        (v.iter().map(|x| x.1).sum::<u64>() >= len).then_some(v)
    }

    pub(super) fn io(&mut self, e: &[u8; 64]) -> (u16, u32) {
        let nsid = Self::dw(e, 1);
        let slba = Self::q(e, 40);
        let nlb = (Self::dw(e, 12) & 0xffff) as u64 + 1;
        let dptr = [Self::q(e, 24), Self::q(e, 32)];
        self.io_log.push((e[0], e[1], dptr));
        if nsid != 1 {
            return (0x0b, 0);
        }
        match e[0] {
            0x00 => return (0, 0),
            0x01 | 0x02 | 0x08 => {}
            _ => return (0x01, 0),
        }
        if slba + nlb > NS_BLOCKS {
            return (0x80, 0);
        }
        let (off, len) = ((slba * LBA) as usize, nlb * LBA);
        if e[0] == 0x08 {
            self.disk[off..off + len as usize].fill(0);
            return (0, 0);
        }
        let segs = if e[1] >> 6 == 1 {
            let mut d = [0u8; 16];
            d.copy_from_slice(&e[24..40]);
            self.sgl_segments(d, len)
        } else {
            self.prp_segments(dptr[0], dptr[1], len)
        };
        let Some(segs) = segs else { return (0x13, 0) };
        let mut pos = off;
        let end = off + len as usize;
        let mut disk = std::mem::take(&mut self.disk);
        let mut st = 0;
        for (a, l) in segs {
            let l = (l as usize).min(end - pos);
            if l == 0 {
                break;
            }
            let Some(s) = self.guest(a, l) else {
                st = 0x13;
                break;
            };
            if e[0] == 0x01 {
                let _ = s.read_into(0, &mut disk[pos..pos + l]);
            } else {
                let _ = s.write_from(0, &disk[pos..pos + l]);
            }
            pos += l;
        }
        self.disk = disk;
        (st, 0)
    }
}
