//! The driver's side of the fake front end's split virtqueue: descriptors, the
//! avail ring, kicks, and reading the used ring back.

use std::sync::atomic::{fence, Ordering};

use super::{FakeFrontend, AVAIL, DATA, HDR, NEXT, QSIZE, STATUS, STATUSES, T_OUT, USED, WRITE};
use crate::wait::{poll_until, T};

impl FakeFrontend {
    pub fn put(&self, at: u64, bytes: &[u8]) {
        self.mem
            .all()
            .write_from(usize::try_from(at).expect("in RAM"), bytes)
            .expect("guest write");
    }

    pub fn get(&self, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem
            .all()
            .read_into(usize::try_from(at).expect("in RAM"), &mut v)
            .expect("guest read");
        v
    }

    pub fn u16_at(&self, at: u64) -> u16 {
        let b = self.get(at, 2);
        u16::from_le_bytes([b[0], b[1]])
    }

    /// A request header of type `t` for `sector` at [`HDR`].
    pub fn header(&self, t: u32, sector: u64) {
        self.header_at(HDR, t, sector);
    }

    fn header_at(&self, at: u64, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.put(at, &h);
    }

    /// Writes request `i`'s parts into guest memory: an OUT header for sector `i * 8`,
    /// 4 KiB of byte `i + 1` and an unset status byte. Returns the header's address.
    pub fn stage_write(&self, i: u64) -> u64 {
        let hdr_at = HDR + 16 * i;
        self.header_at(hdr_at, T_OUT, i * 8);
        self.put(DATA + 4096 * i, &[i as u8 + 1; 4096]);
        self.put(STATUSES + i, &[0xff]);
        hdr_at
    }

    /// Descriptor `idx` of the table.
    pub fn desc(&self, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.put(16 * u64::from(idx), &d);
    }

    /// Links `descs` (addr, len, device-writable) into a chain, publishes it and
    /// kicks.
    pub fn push(&mut self, descs: &[(u64, u32, bool)]) {
        let head = self.link(descs);
        self.publish(head);
    }

    /// As [`push`](Self::push), kicking only if the device asked for it (as a
    /// driver does: avail_event with EVENT_IDX, else the used ring's NO_NOTIFY
    /// flag; virtio 1.2, 2.7.10). Returns whether it kicked.
    pub fn push_polite(&mut self, descs: &[(u64, u32, bool)]) -> bool {
        let head = self.link(descs);
        let old = self.avail;
        self.make_avail(head);
        let kick = self.wants_kick(old, self.avail);
        if kick {
            self.kick.write(1).expect("kick");
        }
        kick
    }

    /// Whether the device asks to be kicked for the avail index moving `old` →
    /// `new`: it passed avail_event with EVENT_IDX, else NO_NOTIFY is clear.
    pub fn wants_kick(&self, old: u16, new: u16) -> bool {
        if self.event_idx {
            let event = self.avail_event();
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            self.used_flags() & 1 == 0
        }
    }

    /// The used ring's flags (bit 0: VRING_USED_F_NO_NOTIFY).
    pub fn used_flags(&self) -> u16 {
        self.u16_at(USED)
    }

    /// The used ring's avail_event (EVENT_IDX): the driver kicks when its avail
    /// index passes it.
    pub fn avail_event(&self) -> u16 {
        self.u16_at(USED + 4 + 8 * u64::from(QSIZE))
    }

    fn link(&mut self, descs: &[(u64, u32, bool)]) -> u16 {
        if usize::from(self.next_desc) + descs.len() > usize::from(QSIZE) {
            self.next_desc = 0;
        }
        let head = self.next_desc;
        for (i, (addr, len, w)) in descs.iter().enumerate() {
            let idx = head + i as u16;
            let last = i + 1 == descs.len();
            let flags = if *w { WRITE } else { 0 } | if last { 0 } else { NEXT };
            self.desc(idx, *addr, *len, flags, if last { 0 } else { idx + 1 });
        }
        self.next_desc += descs.len() as u16;
        head
    }

    /// Makes the chain at `head` available and kicks.
    pub fn publish(&mut self, head: u16) {
        self.make_avail(head);
        self.kick.write(1).expect("kick");
    }

    fn make_avail(&mut self, head: u16) {
        let slot = AVAIL + 4 + 2 * u64::from(self.avail % QSIZE);
        self.put(slot, &head.to_le_bytes());
        self.avail = self.avail.wrapping_add(1);
        fence(Ordering::SeqCst);
        self.put(AVAIL + 2, &self.avail.to_le_bytes());
        fence(Ordering::SeqCst);
    }

    pub fn used_idx(&self) -> u16 {
        self.u16_at(USED + 2)
    }

    /// Waits (bounded) until the used index reaches `n` (or passes it); whether it
    /// did.
    pub fn wait_used(&self, n: u16) -> bool {
        poll_until(T, || (self.used_idx().wrapping_sub(n) as i16) >= 0)
    }

    /// One request whose status byte is at [`STATUS`]; that status.
    pub fn request(&mut self, descs: &[(u64, u32, bool)]) -> u8 {
        self.put(STATUS, &[0xff]);
        let n = self.used_idx().wrapping_add(1);
        self.push(descs);
        assert!(self.wait_used(n), "request not completed");
        self.get(STATUS, 1)[0]
    }
}
