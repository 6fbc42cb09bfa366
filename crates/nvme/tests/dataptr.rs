use test_support::nvme_cmd::*;
use test_support::nvme_host::*;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn prp1_with_offset_and_prp1_prp2() {
    let mut h = Host::new();
    h.ready(true);
    let a = h.alloc(1);
    let p = pattern(512, 1);
    h.write_mem(a + 0x200, &p);
    assert!(h.io(rw(1, 1, 5, 1, a + 0x200, 0)).ok());
    let b = h.alloc(1);
    assert!(h.io(rw(2, 1, 5, 1, b + 0x400, 0)).ok());
    assert_eq!(h.read_mem(b + 0x400, 512), p);

    // 8 KiB from two separate pages, PRP1 offset so it spans three pages.
    let pages: Vec<u64> = (0..3)
        .map(|_| {
            let x = h.alloc(1);
            h.alloc(1); // gap: not physically contiguous
            x
        })
        .collect();
    let p = pattern(8192, 2);
    h.write_mem(pages[0], &p[..4096]);
    h.write_mem(pages[1], &p[4096..]);
    assert!(h.io(rw(1, 1, 64, 16, pages[0], pages[1])).ok());
    let r = h.alloc(2);
    assert!(h.io(rw(2, 1, 64, 16, r, r + 4096)).ok());
    assert_eq!(h.read_mem(r, 8192), p);
}

#[test]
fn prp_list_chained_across_pages() {
    let mut h = Host::new();
    h.ready(true);
    // 128 KiB = MDTS: PRP1 + 31 list entries.
    let data: Vec<u64> = (0..32)
        .map(|_| {
            let x = h.alloc(1);
            h.alloc(1);
            x
        })
        .collect();
    let p = pattern(128 * 1024, 3);
    for (i, d) in data.iter().enumerate() {
        h.write_mem(*d, &p[i * 4096..(i + 1) * 4096]);
    }
    // First list starts 3 entries before its page end: 2 data entries + chain.
    let l1 = h.alloc(1);
    let l2 = h.alloc(1);
    let start = l1 + 4096 - 24;
    h.write_mem(start, &data[1].to_le_bytes());
    h.write_mem(start + 8, &data[2].to_le_bytes());
    h.write_mem(start + 16, &l2.to_le_bytes());
    for (i, d) in data[3..].iter().enumerate() {
        h.write_mem(l2 + i as u64 * 8, &d.to_le_bytes());
    }
    let c = h.io(rw(1, 1, 1000, 256, data[0], start));
    assert!(c.ok(), "{c:?}");
    // Read back through a contiguous buffer (one PRP list, merged iovec).
    let r = h.alloc(32);
    let l = h.alloc(1);
    for i in 1..32u64 {
        h.write_mem(l + (i - 1) * 8, &(r + i * 4096).to_le_bytes());
    }
    assert!(h.io(rw(2, 1, 1000, 256, r, l)).ok());
    assert_eq!(h.read_mem(r, 128 * 1024), p);
}

#[test]
fn sgl_data_block_and_segments() {
    let mut h = Host::new();
    h.ready(true);
    let p = pattern(8192, 4);
    // Single data block.
    let a = h.alloc(2);
    h.write_mem(a, &p);
    let mut s = rw(1, 1, 10, 16, 0, 0);
    set_sgl(&mut s, sgl_desc(a, 8192, 0));
    assert!(h.io(s).ok());
    let r = h.alloc(2);
    assert!(h.io(rw(2, 1, 10, 16, r, r + 4096)).ok());
    assert_eq!(h.read_mem(r, 8192), p);

    // Segment -> Last Segment, odd-sized pieces.
    let out = h.alloc(3);
    let seg1 = h.alloc(1);
    let seg2 = h.alloc(1);
    h.write_mem(seg1, &sgl_desc(out, 1000, 0));
    h.write_mem(seg1 + 16, &sgl_desc(seg2, 32, 3));
    h.write_mem(seg2, &sgl_desc(out + 5000, 3000, 0));
    h.write_mem(seg2 + 16, &sgl_desc(out + 9000, 4192, 0));
    let mut s = rw(2, 1, 10, 16, 0, 0);
    set_sgl(&mut s, sgl_desc(seg1, 32, 2));
    let c = h.io(s);
    assert!(c.ok(), "{c:?}");
    let mut got = h.read_mem(out, 1000);
    got.extend(h.read_mem(out + 5000, 3000));
    got.extend(h.read_mem(out + 9000, 4192));
    assert_eq!(got, p);

    // Last Segment directly in SGL1.
    let seg = h.alloc(1);
    h.write_mem(seg, &sgl_desc(out, 4096, 0));
    h.write_mem(seg + 16, &sgl_desc(out + 4096, 4096, 0));
    let mut s = rw(2, 1, 10, 16, 0, 0);
    set_sgl(&mut s, sgl_desc(seg, 32, 3));
    assert!(h.io(s).ok());
    assert_eq!(h.read_mem(out, 8192), p);
}

#[test]
fn write_zeroes_and_deallocate_read_zero() {
    let mut h = Host::new();
    h.ready(true);
    let a = h.alloc(2);
    h.write_mem(a, &[0xaa; 8192]);
    assert!(h.io(rw(1, 1, 0, 16, a, a + 4096)).ok());
    // Write Zeroes blocks 2..4.
    let mut s = sqe(0x08, 1);
    s.cdw10 = 2;
    s.cdw12 = 1;
    assert!(h.io(s).ok());
    // Deallocate blocks 8..10 and 12.
    let ranges = h.alloc(1);
    let mut r = [0u8; 32];
    r[4..8].copy_from_slice(&2u32.to_le_bytes());
    r[8..16].copy_from_slice(&8u64.to_le_bytes());
    r[20..24].copy_from_slice(&1u32.to_le_bytes());
    r[24..32].copy_from_slice(&12u64.to_le_bytes());
    h.write_mem(ranges, &r);
    let mut s = sqe(0x09, 1);
    set_prp(&mut s, ranges, 0);
    s.cdw10 = 1; // two ranges
    s.cdw11 = 1 << 2;
    assert!(h.io(s).ok());
    let out = h.alloc(2);
    assert!(h.io(rw(2, 1, 0, 16, out, out + 4096)).ok());
    let got = h.read_mem(out, 8192);
    for blk in 0..16 {
        let zero = matches!(blk, 2 | 3 | 8 | 9 | 12);
        let b = &got[blk * 512..(blk + 1) * 512];
        assert!(
            b.iter().all(|x| *x == if zero { 0 } else { 0xaa }),
            "block {blk}"
        );
    }
    // A range beyond the namespace is refused.
    r[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    h.write_mem(ranges, &r);
    assert_eq!(h.io(s).code(), (0, 0x80));
}
