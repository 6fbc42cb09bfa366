use test_support::nvme_cmd::*;
use test_support::nvme_host::*;

#[test]
fn bad_data_pointers() {
    let mut h = Host::new();
    h.ready(true);
    // Unmapped PRP1.
    assert_eq!(h.io(rw(2, 1, 0, 1, 0x1000, 0)).code(), (0, 0x04));
    // PRP1 not dword aligned.
    let a = h.alloc(4);
    assert_eq!(h.io(rw(2, 1, 0, 1, a + 2, 0)).code(), (0, 0x13));
    // PRP2 data pointer with an offset.
    assert_eq!(h.io(rw(2, 1, 0, 16, a, a + 0x1008)).code(), (0, 0x13));
    // PRP2 beyond guest memory.
    assert_eq!(h.io(rw(2, 1, 0, 16, a, BASE + MEM_SIZE)).code(), (0, 0x04));
    // A list entry with an offset.
    let l = h.alloc(1);
    h.write_mem(l, &(a + 4096).to_le_bytes());
    h.write_mem(l + 8, &(a + 8192 + 4).to_le_bytes());
    assert_eq!(h.io(rw(2, 1, 0, 24, a, l)).code(), (0, 0x13));
    // A list whose chain entry points to itself.
    let l = h.alloc(1);
    let start = l + 4096 - 16;
    h.write_mem(start, &(a + 4096).to_le_bytes());
    h.write_mem(start + 8, &l.to_le_bytes());
    assert_eq!(h.io(rw(2, 1, 0, 64, a, start)).code(), (0, 0x02));
    // Two list pages pointing at each other: bounded by the transfer size.
    let l1 = h.alloc(1);
    let l2 = h.alloc(1);
    let bufs = h.alloc(40);
    let s1 = l1 + 4096 - 16;
    h.write_mem(s1, &bufs.to_le_bytes());
    h.write_mem(s1 + 8, &l2.to_le_bytes());
    for i in 0..511u64 {
        h.write_mem(l2 + i * 8, &(bufs + ((i % 30) + 1) * 4096).to_le_bytes());
    }
    h.write_mem(l2 + 511 * 8, &l1.to_le_bytes());
    let c = h.io(rw(2, 1, 0, 256, bufs, s1));
    assert!(c.ok(), "bounded walk completes: {c:?}");
    // A list entry that is unmapped.
    let l = h.alloc(1);
    h.write_mem(l, &0x2000u64.to_le_bytes());
    h.write_mem(l + 8, &0x3000u64.to_le_bytes());
    assert_eq!(h.io(rw(2, 1, 0, 24, a, l)).code(), (0, 0x04));
    // Reserved PSDT.
    let mut s = rw(2, 1, 0, 1, a, 0);
    s.flags |= 3 << 6;
    assert_eq!(h.io(s).code(), (0, 0x02));
    // The controller is still fine.
    assert!(h.io(rw(2, 1, 0, 1, a, 0)).ok());
    assert_eq!(h.csts() & 2, 0);
}

#[test]
fn bad_sgls() {
    let mut h = Host::new();
    h.ready(true);
    let a = h.alloc(4);
    // Segment pointing to itself: loops until the descriptor cap.
    let seg = h.alloc(1);
    h.write_mem(seg, &sgl_desc(seg, 16, 2));
    let mut s = rw(2, 1, 0, 8, 0, 0);
    set_sgl(&mut s, sgl_desc(seg, 16, 2));
    assert_eq!(h.io(s).code(), (0, 0x0e));
    // Data block longer than the transfer.
    let mut s = rw(2, 1, 0, 1, 0, 0);
    set_sgl(&mut s, sgl_desc(a, 4096, 0));
    assert_eq!(h.io(s).code(), (0, 0x0f));
    // Shorter than the transfer.
    let mut s = rw(2, 1, 0, 8, 0, 0);
    set_sgl(&mut s, sgl_desc(a, 512, 0));
    assert_eq!(h.io(s).code(), (0, 0x0f));
    // Bit bucket unsupported.
    let mut s = rw(2, 1, 0, 1, 0, 0);
    set_sgl(&mut s, sgl_desc(a, 512, 1));
    assert_eq!(h.io(s).code(), (0, 0x11));
    // Segment with a length that is not a multiple of 16.
    let mut s = rw(2, 1, 0, 1, 0, 0);
    set_sgl(&mut s, sgl_desc(seg, 20, 3));
    assert_eq!(h.io(s).code(), (0, 0x0d));
    // Segment pointer in the middle of a segment.
    let seg2 = h.alloc(1);
    h.write_mem(seg2, &sgl_desc(seg, 16, 3));
    h.write_mem(seg2 + 16, &sgl_desc(a, 512, 0));
    let mut s = rw(2, 1, 0, 1, 0, 0);
    set_sgl(&mut s, sgl_desc(seg2, 32, 3));
    assert_eq!(h.io(s).code(), (0, 0x0d));
    // Unmapped segment.
    let mut s = rw(2, 1, 0, 1, 0, 0);
    set_sgl(&mut s, sgl_desc(0x4000, 16, 3));
    assert_eq!(h.io(s).code(), (0, 0x04));
    // Many tiny descriptors overflow the iovec: refused, no panic.
    let many = h.alloc(4);
    for i in 0..200u64 {
        h.write_mem(many + i * 16, &sgl_desc(a + i * 8, 4, 0));
    }
    let mut s = rw(2, 1, 0, 2, 0, 0);
    set_sgl(&mut s, sgl_desc(many, 200 * 16, 3));
    assert_eq!(h.io(s).code(), (0, 0x0e));
    assert!(h.io(rw(2, 1, 0, 1, a, 0)).ok());
}

#[test]
fn bad_commands() {
    let mut h = Host::new();
    h.ready(true);
    let a = h.alloc(64);
    assert_eq!(h.io(sqe(0x7f, 1)).code(), (0, 0x01), "unknown I/O opcode");
    for nsid in [0, 2, 0xffff_ffff] {
        assert_eq!(
            h.io(rw(2, nsid, 0, 1, a, 0)).code(),
            (0, 0x0b),
            "nsid {nsid:#x}"
        );
        assert_eq!(
            h.io(sqe(0x00, nsid)).code(),
            (0, 0x0b),
            "flush nsid {nsid:#x}"
        );
    }
    let blocks = (64u64 << 20) / 512;
    assert_eq!(
        h.io(rw(2, 1, u64::MAX - 1, 8, a, 0)).code(),
        (0, 0x80),
        "overflow"
    );
    assert_eq!(
        h.io(rw(2, 1, blocks - 1, 2, a, a + 4096)).code(),
        (0, 0x80),
        "beyond"
    );
    assert!(h.io(rw(2, 1, blocks - 1, 1, a, 0)).ok(), "last block");
    let mut wz = sqe(0x08, 1);
    wz.cdw10 = (blocks - 1) as u32;
    wz.cdw12 = 1;
    assert_eq!(h.io(wz).code(), (0, 0x80), "write zeroes beyond");
    // 256 KiB > MDTS (128 KiB).
    let l = h.alloc(1);
    assert_eq!(h.io(rw(2, 1, 0, 512, a, l)).code(), (0, 0x02));
    // Fused operations are not supported.
    let mut s = rw(2, 1, 0, 1, a, 0);
    s.flags |= 1;
    assert_eq!(h.io(s).code(), (0, 0x02));
    let st = h.ctrl.stats();
    assert!(st.io_errors >= 10, "{st:?}");
    assert!(st.error_log_count >= 10);
    assert!(h.io(rw(2, 1, 0, 1, a, 0)).ok());
}
