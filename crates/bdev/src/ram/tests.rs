use super::*;
use crate::{IoOp, IoRequest, IoStatus, RequestList};
use guest_mem::SharedMem;

#[test]
fn write_read_discard() {
    let d = RamDisk::new(1 << 20, 512).unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("b", 8192).unwrap();
    let s = buf.all();
    s.write_from(0, &[7u8; 8192]).unwrap();
    let iov = [s.sub(0, 4096).unwrap(), s.sub(4096, 4096).unwrap()];
    let w = IoRequest {
        op: IoOp::Write,
        offset: 4096 * 3,
        len: 8192,
        iov: &iov,
        fua: false,
    };
    assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));
    s.fill(0);
    let r = IoRequest {
        op: IoOp::Read,
        ..w
    };
    assert_eq!(ch.submit(2, &r), Some(IoStatus::Ok));
    let mut b = vec![0u8; 8192];
    s.read_into(0, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 7));
    let z = IoRequest {
        op: IoOp::Discard,
        offset: 4096 * 3 + 512,
        len: 4096,
        iov: &[],
        fua: false,
    };
    assert_eq!(ch.submit(3, &z), Some(IoStatus::Ok));
    assert_eq!(ch.submit(4, &r), Some(IoStatus::Ok));
    s.read_into(0, &mut b).unwrap();
    assert!(b[..512].iter().all(|x| *x == 7));
    assert!(b[512..4608].iter().all(|x| *x == 0));
    assert!(b[4608..].iter().all(|x| *x == 7));
    let oob = IoRequest {
        offset: (1 << 20) - 4096,
        ..r
    };
    assert_eq!(ch.submit(5, &oob), Some(IoStatus::OutOfRange));
    let wrap = IoRequest {
        offset: u64::MAX - 10,
        ..r
    };
    assert_eq!(ch.submit(6, &wrap), Some(IoStatus::OutOfRange));
}

/// Submits `reqs` as one batch; their inline statuses in order.
fn batch(ch: &mut dyn IoChannel, reqs: &[IoRequest<'_>]) -> Vec<Option<IoStatus>> {
    let mut list = RequestList::new(reqs.iter().enumerate().map(|(i, r)| (i as u64, *r)));
    assert_eq!(
        ch.submit_batch(&mut list),
        0,
        "a ram channel finishes inline"
    );
    list.inline()
}

/// `announce` gets ranges before anything checked them: past the end, wrapping,
/// empty, huge, other ops; none may fault or change data, and the request that
/// follows (another one) is served as without it.
#[test]
fn announce_takes_any_range_and_moves_no_data() {
    let d = RamDisk::new(1 << 20, 512).unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("p", 16384).unwrap();
    let s = buf.all();
    s.fill(3);
    let iov = [s.sub(0, 4096).unwrap(), s.sub(4096, 12288).unwrap()];
    let w = IoRequest {
        op: IoOp::Write,
        offset: 0,
        len: 16384,
        iov: &iov,
        fua: false,
    };
    assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));
    s.fill(0);
    for (op, offset, len) in [
        (IoOp::Read, (1 << 20) - 4096, 8192),
        (IoOp::Read, u64::MAX - 10, 4096),
        (IoOp::Read, 1 << 40, 4096),
        (IoOp::Read, 0, 0),
        (IoOp::Read, 0, 1 << 20),
        (IoOp::Read, 0, u64::MAX),
        (IoOp::Write, 1 << 40, 4096),
        (IoOp::Write, 0, 1),
        (IoOp::Flush, 0, 0),
        (IoOp::Discard, 0, 1 << 20),
        (IoOp::WriteZeroes, u64::MAX, u64::MAX),
    ] {
        ch.announce(op, offset, len);
    }
    let mut b = vec![1u8; 16384];
    s.read_into(0, &mut b).unwrap();
    assert!(
        b.iter().all(|x| *x == 0),
        "announce wrote the client's buffer"
    );
    let r = IoRequest {
        op: IoOp::Read,
        ..w
    };
    assert_eq!(batch(&mut *ch, &[r]), [Some(IoStatus::Ok)]);
    s.read_into(0, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 3), "announce changed the disk");
}

/// While one request of a batch is copied the next one's data is loaded, and the
/// copy runs in two halves around those loads: every split of the buffers (the
/// midpoint inside a buffer, on a boundary, odd lengths, across two mappings of a
/// grown disk) must move the right bytes, whatever follows (a read elsewhere, out
/// of range or at the same offset, a write in or out of range, nothing).
#[test]
fn batches_move_the_right_bytes_around_the_next_requests_loads() {
    const MIB: u64 = 1 << 20;
    let d = RamDisk::new(MIB, 512).unwrap().resize(2 * MIB).unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("split", 4 * 8192).unwrap();
    let s = buf.all();
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
    let other = [s.sub(3 * 8192, 4096).unwrap()];
    let next = |offset| IoRequest {
        op: IoOp::Read,
        offset,
        len: 4096,
        iov: &other,
        fua: false,
    };
    // (disk offset, buffer lengths): one buffer; the midpoint inside the second of
    // three; on the boundary of two; odd lengths; across the first mapping's end.
    let cases: [(u64, &[usize]); 5] = [
        (0, &[8192]),
        (8192, &[1000, 6000, 1192]),
        (65536, &[4096, 4096]),
        (4096 * 7, &[1, 4095, 3, 4093]),
        (MIB - 4096, &[512, 7680]),
    ];
    for (round, (offset, lens)) in cases.into_iter().enumerate() {
        // Buffers spread out in client memory, with gaps between them.
        let mut at = 0;
        let iov: Vec<_> = lens
            .iter()
            .map(|&n| {
                let b = s.sub(at, n).unwrap();
                at += n + 64;
                b
            })
            .collect();
        let write_data: Vec<u8> = data.iter().map(|b| b ^ round as u8).collect();
        let mut pos = 0;
        for b in &iov {
            b.write_from(0, &write_data[pos..pos + b.len()]).unwrap();
            pos += b.len();
        }
        let req = |op| IoRequest {
            op,
            offset,
            len: 8192,
            iov: &iov,
            fua: false,
        };
        // What follows: out of range, the request's own offset, a write, a write
        // out of range, elsewhere.
        let write_at = |offset| IoRequest {
            op: IoOp::Write,
            ..next(offset)
        };
        let after = match round {
            1 => next(u64::MAX - 100),
            2 => next(offset),
            3 => write_at(2 * MIB - 4096),
            4 => write_at(u64::MAX - 100),
            _ => next((offset + 3 * 4096) % MIB),
        };
        let st = batch(&mut *ch, &[req(IoOp::Write), after]);
        assert_eq!(st[0], Some(IoStatus::Ok), "case {round}: write");
        for b in &iov {
            b.fill(0);
        }
        let st = batch(&mut *ch, &[req(IoOp::Read), next((offset + 4096) % MIB)]);
        assert_eq!(st, [Some(IoStatus::Ok); 2], "case {round}: read");
        let mut got = Vec::new();
        for b in &iov {
            let mut v = vec![0u8; b.len()];
            b.read_into(0, &mut v).unwrap();
            got.extend(v);
        }
        assert_eq!(got, write_data, "case {round}: read back through the split");
        assert_eq!(read(&*d, offset, 8192), (IoStatus::Ok, write_data));
    }
}

/// A batch's bad requests fail as they would alone, and do not stop the others
/// or disturb their loads: buffers shorter than the length, a range past the
/// end, a request that wraps; a flush and a discard in between.
#[test]
fn a_batchs_bad_requests_fail_alone() {
    const MIB: u64 = 1 << 20;
    let d = RamDisk::new(MIB, 512).unwrap();
    let pattern: Vec<u8> = (0..MIB as u32).map(|i| (i % 249) as u8).collect();
    assert_eq!(write(&d, 0, &pattern), IoStatus::Ok);
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("bad", 4 * 4096).unwrap();
    let s = buf.all();
    let (a, b, c) = (
        [s.sub(0, 100).unwrap()],
        [s.sub(4096, 4096).unwrap()],
        [s.sub(8192, 8192).unwrap()],
    );
    let read = |offset, len, iov| IoRequest {
        op: IoOp::Read,
        offset,
        len,
        iov,
        fua: false,
    };
    let reqs = [
        read(0, 512, &a[..]),
        read(4096, 4096, &b[..]),
        read(MIB - 4096, 8192, &c[..]),
        IoRequest::without_data(IoOp::Flush, 0, 0, false),
        read(u64::MAX - 4095, 4096, &b[..]),
        IoRequest::without_data(IoOp::Discard, MIB - 512, 512, false),
        read(MIB - 8192, 8192, &c[..]),
    ];
    let st = batch(&mut *ch, &reqs);
    let (ok, range) = (IoStatus::Ok, IoStatus::OutOfRange);
    let want = [IoStatus::Invalid, ok, range, ok, range, ok, ok].map(Some);
    assert_eq!(st, want);
    let mut got = vec![0u8; 8192];
    s.read_into(8192, &mut got).unwrap();
    let end = MIB as usize;
    assert_eq!(got[..7680], pattern[end - 8192..end - 512]);
    assert!(
        got[7680..].iter().all(|x| *x == 0),
        "discarded before the read"
    );
    s.read_into(4096, &mut got[..4096]).unwrap();
    assert_eq!(got[..4096], pattern[4096..8192]);
}

/// An announced read gets the rest of its first blocks requested before its
/// copy: shorter than the announced lines, longer than the rest's cap, at the
/// device's end, across two mappings of a grown disk, announced for another
/// offset (or out of range), first of a longer batch, it moves exactly its own
/// bytes, and so do the requests after it.
#[test]
fn announced_reads_move_their_own_bytes() {
    const MIB: u64 = 1 << 20;
    let d = RamDisk::new(MIB, 512).unwrap().resize(2 * MIB).unwrap();
    let pattern: Vec<u8> = (0..2 * MIB as u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(write(&*d, 0, &pattern), IoStatus::Ok);
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("now", 4 * 8192).unwrap();
    let s = buf.all();
    let tail = [s.sub(3 * 8192, 8192).unwrap()];
    // (offset announced, offset and length read)
    let cases = [
        (0, 0, 64),
        (4096, 4096, 4096),
        (8192, 8192, 3 * 8192),
        (2 * MIB - 512, 2 * MIB - 512, 512),
        (MIB - 4096, MIB - 4096, 8192),
        (MIB - 64, MIB - 64, 128),
        (12288, 16384, 4096),
        (u64::MAX - 100, 0, 4096),
    ];
    for (announced, offset, len) in cases {
        s.fill(0);
        let iov = [s.sub(0, len).unwrap()];
        let req = IoRequest {
            op: IoOp::Read,
            offset,
            len: len as u64,
            iov: &iov,
            fua: false,
        };
        let second = IoRequest {
            offset: MIB - 4096,
            len: 8192,
            iov: &tail,
            ..req
        };
        ch.announce(IoOp::Read, announced, len as u64);
        assert_eq!(batch(&mut *ch, &[req, second]), [Some(IoStatus::Ok); 2]);
        let mut got = vec![0u8; len];
        s.read_into(0, &mut got).unwrap();
        let at = offset as usize;
        assert_eq!(got, pattern[at..at + len], "read of {len} at {offset}");
        let mut rest = vec![1u8; 3 * 8192 - len];
        s.read_into(len, &mut rest).unwrap();
        assert!(rest.iter().all(|b| *b == 0), "wrote past the buffer");
        let mut got = vec![0u8; 8192];
        tail[0].read_into(0, &mut got).unwrap();
        let at = (MIB - 4096) as usize;
        assert_eq!(got, pattern[at..at + 8192], "the request after it");
    }
}

#[test]
fn huge_pages_disk_reads_back() {
    let d = RamDisk::with_huge_pages(4 << 20, 512).unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("h", 4096).unwrap();
    let s = buf.all();
    s.fill(9);
    let iov = [s.sub(0, 4096).unwrap()];
    let w = IoRequest {
        op: IoOp::Write,
        offset: (2 << 20) - 2048,
        len: 4096,
        iov: &iov,
        fua: false,
    };
    assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));
    s.fill(0);
    let r = IoRequest {
        op: IoOp::Read,
        ..w
    };
    assert_eq!(ch.submit(2, &r), Some(IoStatus::Ok));
    let mut b = vec![0u8; 4096];
    s.read_into(0, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 9));
}

/// Reads `len` bytes at `off` through a fresh channel of `d`.
fn read(d: &dyn BlockDevice, off: u64, len: usize) -> (IoStatus, Vec<u8>) {
    let buf = SharedMem::new("r", len as u64).unwrap();
    let iov = [buf.all().sub(0, len).unwrap()];
    let r = IoRequest {
        op: IoOp::Read,
        offset: off,
        len: len as u64,
        iov: &iov,
        fua: false,
    };
    let st = d.channel().unwrap().submit(1, &r).unwrap();
    let mut b = vec![0u8; len];
    buf.all().read_into(0, &mut b).unwrap();
    (st, b)
}

fn write(d: &dyn BlockDevice, off: u64, data: &[u8]) -> IoStatus {
    let buf = SharedMem::new("w", data.len() as u64).unwrap();
    buf.all().write_from(0, data).unwrap();
    let iov = [buf.all().sub(0, data.len()).unwrap()];
    let w = IoRequest {
        op: IoOp::Write,
        offset: off,
        len: data.len() as u64,
        iov: &iov,
        fua: false,
    };
    d.channel().unwrap().submit(1, &w).unwrap()
}

#[test]
fn grows_beyond_its_first_mapping_and_keeps_the_data() {
    const MIB: u64 = 1 << 20;
    let d = RamDisk::new(MIB, 512).unwrap();
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(write(&d, MIB - 4096, &pattern[..4096]), IoStatus::Ok);
    let big = d.resize(3 * MIB).unwrap();
    assert_eq!(big.info().size_bytes(), 3 * MIB);
    assert_eq!(
        read(&*big, MIB - 4096, 4096),
        (IoStatus::Ok, pattern[..4096].to_vec())
    );
    // New space reads as zeroes; a request across the old end spans two mappings.
    assert_eq!(read(&*big, MIB, 4096), (IoStatus::Ok, vec![0; 4096]));
    assert_eq!(write(&*big, MIB - 2048, &pattern), IoStatus::Ok);
    assert_eq!(
        read(&*big, MIB - 2048, 8192),
        (IoStatus::Ok, pattern.clone())
    );
    let zero = IoRequest::without_data(IoOp::WriteZeroes, MIB - 1024, 2048, false);
    assert_eq!(big.channel().unwrap().submit(2, &zero), Some(IoStatus::Ok));
    let (_, b) = read(&*big, MIB - 2048, 8192);
    assert_eq!(&b[..1024], &pattern[..1024]);
    assert!(b[1024..3072].iter().all(|x| *x == 0));
    assert_eq!(&b[3072..], &pattern[3072..]);
    // The old handle still ends where it did.
    assert_eq!(read(&d, MIB, 512).0, IoStatus::OutOfRange);
    // Twice more: a third mapping.
    let bigger = big.resize(5 * MIB).unwrap();
    assert_eq!(
        write(&*bigger, 3 * MIB - 512, &pattern[..1024]),
        IoStatus::Ok
    );
    assert_eq!(
        read(&*bigger, 3 * MIB - 512, 1024),
        (IoStatus::Ok, pattern[..1024].to_vec())
    );
    assert_eq!(read(&*bigger, 5 * MIB - 512, 1024).0, IoStatus::OutOfRange);
}

#[test]
fn a_shrink_drops_the_tail_and_growing_again_shows_zeroes() {
    const MIB: u64 = 1 << 20;
    let d = RamDisk::new(4 * MIB, 512).unwrap();
    assert_eq!(write(&d, 2 * MIB, &[7u8; 4096]), IoStatus::Ok);
    assert_eq!(write(&d, MIB - 4096, &[5u8; 4096]), IoStatus::Ok);
    let small = d.resize(MIB).unwrap();
    assert_eq!(
        read(&*small, MIB - 4096, 4096),
        (IoStatus::Ok, vec![5; 4096])
    );
    assert_eq!(read(&*small, MIB, 512).0, IoStatus::OutOfRange);
    let again = small.resize(6 * MIB).unwrap();
    assert_eq!(read(&*again, 2 * MIB, 4096), (IoStatus::Ok, vec![0; 4096]));
    assert_eq!(
        read(&*again, MIB - 4096, 4096),
        (IoStatus::Ok, vec![5; 4096])
    );
    assert_eq!(write(&*again, 6 * MIB - 4096, &[3u8; 4096]), IoStatus::Ok);
    assert_eq!(
        read(&*again, 6 * MIB - 4096, 4096),
        (IoStatus::Ok, vec![3; 4096])
    );
    // A shrink below the second mapping drops it from the new handle.
    let tiny = again.resize(512).unwrap();
    assert_eq!(tiny.info().num_blocks, 1);
    assert_eq!(read(&*tiny, 0, 512), (IoStatus::Ok, vec![0; 512]));
    let huge = RamDisk::with_huge_pages(2 * MIB, 4096).unwrap();
    assert_eq!(huge.resize(8 * MIB).unwrap().info().num_blocks, 2048);
}

#[test]
fn bad_sizes_refused() {
    assert!(RamDisk::new(0, 512).is_err());
    assert!(RamDisk::new(1000, 512).is_err());
    assert!(RamDisk::new(4096, 1024).is_err());
}
