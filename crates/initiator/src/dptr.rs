//! Builds data pointers (PRP entries/lists, SGLs) into preallocated list memory.
//!
//! Memory page size is fixed at 4 KiB (CC.MPS = 0). To exercise PRP list chaining
//! with small transfers, the first list may hold fewer than 512 entries: the
//! controller reads a list until the end of the memory page PRP2 lands in, so we
//! place it `entries * 8` bytes before a page end. Only PRP2 may carry an offset; the
//! lists it chains to are page aligned and full size, as the spec requires.

use guest_mem::DmaSlice;

pub const PAGE: u64 = 4096;
pub const MAX_PRP_PER_PAGE: u32 = (PAGE / 8) as u32;
pub const SGL_DESC: usize = 16;

pub const SGL_DATA_BLOCK: u8 = 0x00;
pub const SGL_SEGMENT: u8 = 0x20;
pub const SGL_LAST_SEGMENT: u8 = 0x30;

/// Memory where lists for one command go: `slice` is mapped at `iova`, page aligned.
#[derive(Clone, Copy, Debug)]
pub struct ListArea<'a> {
    pub slice: DmaSlice<'a>,
    pub iova: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuildError {
    /// The lists for this transfer do not fit the area reserved for one command.
    ListTooSmall,
    Misaligned,
    BadKnob,
}

/// Entries list `k` can hold (the last one may be a chain pointer).
fn list_capacity(k: u64, per_list: u32) -> u64 {
    if k == 0 {
        per_list as u64
    } else {
        MAX_PRP_PER_PAGE as u64
    }
}

/// PRP list pages needed for a buffer at `iova` of `len` bytes.
pub fn prp_list_pages(iova: u64, len: u64, per_list: u32) -> u64 {
    let mut left = prp_tail_entries(iova, len);
    if left <= 1 {
        return 0;
    }
    let mut pages = 0;
    loop {
        let cap = list_capacity(pages, per_list);
        pages += 1;
        if left <= cap {
            return pages;
        }
        left -= cap - 1;
    }
}

/// Pages of the transfer after the first (the ones PRP2 or the list must name).
fn prp_tail_entries(iova: u64, len: u64) -> u64 {
    let first = PAGE - (iova % PAGE);
    if len <= first {
        0
    } else {
        (len - first).div_ceil(PAGE)
    }
}

/// Returns (PRP1, PRP2) for a buffer at `iova`, writing lists into `area` if needed.
pub fn build_prp(
    iova: u64,
    len: u64,
    per_list: u32,
    area: &ListArea<'_>,
) -> Result<[u64; 2], BuildError> {
    if !iova.is_multiple_of(4) {
        return Err(BuildError::Misaligned);
    }
    if !(2..=MAX_PRP_PER_PAGE).contains(&per_list) {
        return Err(BuildError::BadKnob);
    }
    let n = prp_tail_entries(iova, len);
    let base = (iova & !(PAGE - 1)) + PAGE;
    match n {
        0 => return Ok([iova, 0]),
        1 => return Ok([iova, base]),
        _ => {}
    }
    let pages = prp_list_pages(iova, len, per_list);
    if pages * PAGE > area.slice.len() as u64 {
        return Err(BuildError::ListTooSmall);
    }
    let skip = PAGE - per_list as u64 * 8;
    let list_off = |k: u64| if k == 0 { skip } else { k * PAGE };
    let list_iova = |k: u64| area.iova + list_off(k);
    let mut written = 0u64;
    for k in 0..pages {
        let mut off = list_off(k) as usize;
        let left = n - written;
        let cap = list_capacity(k, per_list);
        let here = if left <= cap { left } else { cap - 1 };
        for i in 0..here {
            let e = base + (written + i) * PAGE;
            area.slice
                .write_from(off, &e.to_le_bytes())
                .map_err(|_| BuildError::ListTooSmall)?;
            off += 8;
        }
        written += here;
        if written < n {
            area.slice
                .write_from(off, &list_iova(k + 1).to_le_bytes())
                .map_err(|_| BuildError::ListTooSmall)?;
        }
    }
    Ok([iova, list_iova(0)])
}

pub fn sgl_desc(addr: u64, len: u32, ty: u8) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[15] = ty;
    d
}

/// Number of data blocks a split produces and the descriptor bytes the chain needs.
pub fn sgl_area_bytes(len: u64, split: u32, per_segment: u32) -> u64 {
    let k = sgl_chunks(len, split) as u64;
    if k <= 1 {
        return 0;
    }
    let segs = segment_count(k, per_segment as u64);
    (k + segs - 1) * SGL_DESC as u64
}

fn sgl_chunks(len: u64, split: u32) -> u32 {
    // Chunks stay dword multiples, so a short buffer cannot be split finer than that.
    (split.max(1) as u64).min(len.div_ceil(4).max(1)) as u32
}

fn segment_count(k: u64, s: u64) -> u64 {
    if k <= s {
        1
    } else {
        (k - 1).div_ceil(s - 1)
    }
}

fn chunk_bounds(len: u64, k: u32, i: u32) -> u64 {
    if i >= k {
        len
    } else {
        (len * i as u64 / k as u64) & !3
    }
}

/// Returns the 16-byte SGL1 for a buffer at `iova`: one Data Block, or the buffer split
/// into `split` data blocks in segments of at most `per_segment` descriptors, chained
/// with Segment descriptors and ended by a Last Segment.
pub fn build_sgl(
    iova: u64,
    len: u64,
    split: u32,
    per_segment: u32,
    area: &ListArea<'_>,
) -> Result<[u8; 16], BuildError> {
    let len32 = u32::try_from(len).map_err(|_| BuildError::BadKnob)?;
    let k = sgl_chunks(len, split);
    if k <= 1 {
        return Ok(sgl_desc(iova, len32, SGL_DATA_BLOCK));
    }
    if per_segment < 2 {
        return Err(BuildError::BadKnob);
    }
    if sgl_area_bytes(len, split, per_segment) > area.slice.len() as u64 {
        return Err(BuildError::ListTooSmall);
    }
    let s = per_segment as u64;
    let segs = segment_count(k as u64, s);
    let mut off = 0usize;
    let mut next_chunk = 0u32;
    let mut first = [0u8; 16];
    for seg in 0..segs {
        let last = seg + 1 == segs;
        let left = (k - next_chunk) as u64;
        let blocks = if last { left } else { s - 1 };
        let descs = if last { blocks } else { blocks + 1 };
        let seg_ty = if last { SGL_LAST_SEGMENT } else { SGL_SEGMENT };
        let ptr = sgl_desc(area.iova + off as u64, (descs * 16) as u32, seg_ty);
        if seg == 0 {
            first = ptr;
        } else {
            // The previous segment reserved its last slot for this pointer.
            area.slice
                .write_from(off - SGL_DESC, &ptr)
                .map_err(|_| BuildError::ListTooSmall)?;
        }
        for _ in 0..blocks {
            let a = chunk_bounds(len, k, next_chunk);
            let b = chunk_bounds(len, k, next_chunk + 1);
            let d = sgl_desc(iova + a, (b - a) as u32, SGL_DATA_BLOCK);
            area.slice
                .write_from(off, &d)
                .map_err(|_| BuildError::ListTooSmall)?;
            off += SGL_DESC;
            next_chunk += 1;
        }
        if !last {
            off += SGL_DESC;
        }
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_mem::SharedMem;

    const AREA_IOVA: u64 = 0x10_0000;

    fn entry(m: &SharedMem, off: u64) -> u64 {
        m.all().read_obj::<u64>(off as usize).unwrap()
    }

    #[test]
    fn prp1_only_and_prp2() {
        let m = SharedMem::new("a", 4 * PAGE).unwrap();
        let a = ListArea {
            slice: m.all(),
            iova: AREA_IOVA,
        };
        assert_eq!(build_prp(0x5000, 4096, 512, &a).unwrap(), [0x5000, 0]);
        assert_eq!(build_prp(0x5200, 0xe00, 512, &a).unwrap(), [0x5200, 0]);
        assert_eq!(build_prp(0x5200, 0xe04, 512, &a).unwrap(), [0x5200, 0x6000]);
        assert_eq!(build_prp(0x5000, 8192, 512, &a).unwrap(), [0x5000, 0x6000]);
        assert_eq!(build_prp(0x5002, 8, 512, &a), Err(BuildError::Misaligned));
    }

    #[test]
    fn prp_single_list() {
        let m = SharedMem::new("a", 4 * PAGE).unwrap();
        let a = ListArea {
            slice: m.all(),
            iova: AREA_IOVA,
        };
        let p = build_prp(0x10000, 4 * PAGE, 512, &a).unwrap();
        assert_eq!(p, [0x10000, AREA_IOVA]);
        for i in 0..3 {
            assert_eq!(entry(&m, i * 8), 0x11000 + i * PAGE);
        }
    }

    #[test]
    fn prp_lists_chain_with_small_pages() {
        let m = SharedMem::new("a", 8 * PAGE).unwrap();
        let a = ListArea {
            slice: m.all(),
            iova: AREA_IOVA,
        };
        // 1 + 9 pages, first list 4 entries: it holds 3 + chain, the page-aligned
        // second list the other 6.
        let len = 10 * PAGE;
        assert_eq!(prp_list_pages(0x20000, len, 4), 2);
        let p = build_prp(0x20000, len, 4, &a).unwrap();
        let skip = PAGE - 32;
        assert_eq!(p, [0x20000, AREA_IOVA + skip]);
        let mut expect = 0x21000;
        for i in 0..3 {
            assert_eq!(entry(&m, skip + i * 8), expect, "first list entry {i}");
            expect += PAGE;
        }
        assert_eq!(
            entry(&m, skip + 24),
            AREA_IOVA + PAGE,
            "chain is page aligned"
        );
        for i in 0..6 {
            assert_eq!(entry(&m, PAGE + i * 8), expect, "second list entry {i}");
            expect += PAGE;
        }
        assert_eq!(expect, 0x20000 + len);
        // Exactly filling the last list needs no extra chain.
        assert_eq!(prp_list_pages(0x20000, 8 * PAGE, 4), 2);
        // Too many for the area.
        let small = ListArea {
            slice: m.slice(0, PAGE as usize).unwrap(),
            iova: AREA_IOVA,
        };
        assert_eq!(
            build_prp(0x20000, len, 4, &small),
            Err(BuildError::ListTooSmall)
        );
    }

    fn desc(m: &SharedMem, i: usize) -> (u64, u32, u8) {
        let mut d = [0u8; 16];
        m.all().read_into(i * 16, &mut d).unwrap();
        (
            u64::from_le_bytes(d[..8].try_into().unwrap()),
            u32::from_le_bytes(d[8..12].try_into().unwrap()),
            d[15],
        )
    }

    #[test]
    fn sgl_single_block() {
        let m = SharedMem::new("s", PAGE).unwrap();
        let a = ListArea {
            slice: m.all(),
            iova: AREA_IOVA,
        };
        let d = build_sgl(0x9000, 8192, 1, 256, &a).unwrap();
        assert_eq!(d, sgl_desc(0x9000, 8192, SGL_DATA_BLOCK));
    }

    #[test]
    fn sgl_last_segment_only() {
        let m = SharedMem::new("s", PAGE).unwrap();
        let a = ListArea {
            slice: m.all(),
            iova: AREA_IOVA,
        };
        let d = build_sgl(0x9000, 8192, 4, 256, &a).unwrap();
        assert_eq!(d, sgl_desc(AREA_IOVA, 64, SGL_LAST_SEGMENT));
        for i in 0..4 {
            assert_eq!(
                desc(&m, i),
                (0x9000 + i as u64 * 2048, 2048, SGL_DATA_BLOCK)
            );
        }
    }

    #[test]
    fn sgl_segment_chain() {
        let m = SharedMem::new("s", PAGE).unwrap();
        let a = ListArea {
            slice: m.all(),
            iova: AREA_IOVA,
        };
        // 7 blocks, 3 per segment: [b0 b1 seg->] [b2 b3 last->] [b4 b5 b6]
        let d = build_sgl(0x9000, 7 * 512, 7, 3, &a).unwrap();
        assert_eq!(d, sgl_desc(AREA_IOVA, 48, SGL_SEGMENT));
        assert_eq!(desc(&m, 0), (0x9000, 512, 0));
        assert_eq!(desc(&m, 1), (0x9200, 512, 0));
        assert_eq!(desc(&m, 2), (AREA_IOVA + 48, 48, SGL_SEGMENT));
        assert_eq!(desc(&m, 3), (0x9400, 512, 0));
        assert_eq!(desc(&m, 4), (0x9600, 512, 0));
        assert_eq!(desc(&m, 5), (AREA_IOVA + 96, 48, SGL_LAST_SEGMENT));
        for i in 0..3 {
            assert_eq!(desc(&m, 6 + i), (0x9800 + i as u64 * 512, 512, 0));
        }
        assert_eq!(sgl_area_bytes(7 * 512, 7, 3), 9 * 16);
        // 5 blocks fit two segments: [b0 b1 last->] [b2 b3 b4]
        let d = build_sgl(0x9000, 5 * 512, 5, 3, &a).unwrap();
        assert_eq!(d, sgl_desc(AREA_IOVA, 48, SGL_SEGMENT));
        assert_eq!(desc(&m, 2), (AREA_IOVA + 48, 48, SGL_LAST_SEGMENT));
    }

    #[test]
    fn sgl_uneven_split_covers_everything() {
        let m = SharedMem::new("s", PAGE).unwrap();
        let a = ListArea {
            slice: m.all(),
            iova: AREA_IOVA,
        };
        build_sgl(0x9000, 1000, 3, 256, &a).unwrap();
        let total: u32 = (0..3).map(|i| desc(&m, i).1).sum();
        assert_eq!(total, 1000);
        assert_eq!(desc(&m, 0).0, 0x9000);
        assert_eq!(desc(&m, 1).0, 0x9000 + desc(&m, 0).1 as u64);
    }
}
