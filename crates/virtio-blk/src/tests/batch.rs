//! A poll's chains reach the backend as one batch (docs/decisions/
//! 0033-backend-batches.md): chains that fail to parse finish on their own, and
//! the RAM disk's copies, each loading the next request's data while it runs,
//! move every request's own bytes.

use super::*;

/// Chain `i`'s header, data and status addresses.
fn at(i: u64) -> (u64, u64, u64) {
    (HDR + 32 * i, DATA + 0x2000 * i, STATUS + i)
}

impl Guest {
    /// Publishes a request of type `t` at `sector` with `len` bytes of data as
    /// chain `i` (without running the queue).
    fn stage(&mut self, i: u64, t: u32, sector: u64, len: u32) -> u16 {
        let (hdr, data, status) = at(i);
        self.header(hdr, t, sector);
        self.mem.write_obj(0xffu8, GuestAddress(status)).unwrap();
        let dir = if t == vb::VIRTIO_BLK_T_IN { W } else { R };
        self.push(&[desc(hdr, 16, R), desc(data, len, dir), desc(status, 1, W)])
    }

    fn status_of(&self, i: u64) -> u8 {
        self.mem.read_obj::<u8>(GuestAddress(at(i).2)).unwrap()
    }
}

/// Writes, then reads back, several 4 KiB blocks in one poll each, with a chain
/// whose data lies outside guest memory and a read past the disk's end among
/// them: every good request moves its own bytes, each bad one fails alone.
#[test]
fn a_polls_chains_go_to_the_backend_together_and_move_their_own_bytes() {
    let mut g = guest();
    let sectors = [0u64, 8, 2040, 64];
    for (i, &s) in sectors.iter().enumerate() {
        let block: Vec<u8> = (0..4096u32).map(|b| (b as u64 * 3 + s) as u8).collect();
        g.mem
            .write_slice(&block, GuestAddress(at(i as u64).1))
            .unwrap();
        g.stage(i as u64, vb::VIRTIO_BLK_T_OUT, s, 4096);
    }
    // Data outside guest memory: refused while parsing, in the middle of the poll.
    g.header(at(4).0, vb::VIRTIO_BLK_T_OUT, 16);
    g.push(&[
        desc(at(4).0, 16, R),
        desc(0xffff_0000, 4096, R),
        desc(at(4).2, 1, W),
    ]);
    let p = g.run();
    assert_eq!(p.used, 5);
    let want_w = [OK, OK, OK, OK, IOERR];
    assert_eq!((0..5).map(|i| g.status_of(i)).collect::<Vec<_>>(), want_w);

    // Read them back in reverse order into zeroed buffers, with a read past the end.
    for i in 0..5 {
        g.mem
            .write_slice(&[0u8; 4096], GuestAddress(at(i).1))
            .unwrap();
    }
    for (i, &s) in sectors.iter().rev().enumerate() {
        g.stage(i as u64, vb::VIRTIO_BLK_T_IN, s, 4096);
    }
    g.stage(4, vb::VIRTIO_BLK_T_IN, DISK / 512 - 4, 4096);
    let p = g.run();
    assert_eq!(p.used, 5);
    assert_eq!(g.worker.in_flight(), 0);
    for (i, &s) in sectors.iter().rev().enumerate() {
        assert_eq!(g.status_of(i as u64), OK, "read {i}");
        let mut got = vec![0u8; 4096];
        g.mem
            .read_slice(&mut got, GuestAddress(at(i as u64).1))
            .unwrap();
        let want: Vec<u8> = (0..4096u32).map(|b| (b as u64 * 3 + s) as u8).collect();
        assert_eq!(got, want, "read {i} of sector {s}");
    }
    assert_eq!(g.status_of(4), IOERR, "past the end");
}
