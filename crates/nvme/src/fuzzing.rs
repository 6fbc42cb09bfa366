//! Entry points for the coverage-guided fuzzer (`fuzz/`, cargo feature `fuzzing`).

use std::sync::Arc;

use guest_mem::{Access, MappedRegion, MemoryMap};

use crate::iov::Iov;

/// Guest memory of the data-pointer target: a 64 KiB region at 0x10000 and a
/// 16 KiB one at 0x40000, filled from the input.
const REGIONS: [(u64, u64); 2] = [(0x10000, 0x10000), (0x40000, 0x4000)];

fn le<const N: usize>(d: &[u8], at: usize) -> [u8; N] {
    let mut b = [0u8; N];
    for (i, x) in b.iter_mut().enumerate() {
        *x = d.get(at + i).copied().unwrap_or(0);
    }
    b
}

/// A command's data pointer (PRP1/PRP2 with PRP lists, or SGL1 with segments)
/// walked against guest memory whose bytes (the lists and descriptors) come from
/// the input. Layout: `[psdt][write][len u32][prp1 u64][prp2 u64][sgl1 16]`, then
/// the memory image.
pub fn data_pointer(data: &[u8]) {
    let Ok(map) = memory(data.get(38..).unwrap_or_default()) else {
        return;
    };
    let psdt = data.first().copied().unwrap_or(0) % 3;
    let access = if data.get(1).copied().unwrap_or(0) & 1 == 0 {
        Access::Read
    } else {
        Access::Write
    };
    // Up to 2 MiB + a page: beyond MDTS the caller refuses before walking.
    let len = u64::from(u32::from_le_bytes(le(data, 2)) % ((2 << 20) + 4096));
    let prp1 = u64::from_le_bytes(le(data, 6));
    let prp2 = u64::from_le_bytes(le(data, 14));
    let sgl1: [u8; 16] = le(data, 22);
    let mut iov = Iov::new();
    iov.next_command();
    let r = match psdt {
        0 => crate::prp::walk(&map, prp1, prp2, len, access, &mut iov),
        _ => crate::sgl::walk(&map, sgl1, len, access, &mut iov),
    };
    if r.is_ok() && iov.has_room() {
        let got: u64 = iov
            .segments(iov.range())
            .iter()
            .map(|s| s.len() as u64)
            .sum();
        assert_eq!(got, len, "a successful walk covers exactly the transfer");
    }
}

fn memory(image: &[u8]) -> std::io::Result<MemoryMap> {
    let mut map = MemoryMap::new();
    let mut at = 0usize;
    for (iova, len) in REGIONS {
        let r = MappedRegion::anonymous(iova, len)?;
        let take = image.len().saturating_sub(at).min(len as usize);
        if let Some(s) = r.slice(0, take) {
            let _ = s.write_from(0, &image[at..at + take]);
        }
        at += take;
        map = map
            .with_region(Arc::new(r))
            .map_err(|e| std::io::Error::other(e.to_string()))?;
    }
    Ok(map)
}
