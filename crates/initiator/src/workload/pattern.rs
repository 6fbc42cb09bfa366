//! Verify pattern: every 512-byte sector says which LBA, generation and job wrote it,
//! so a misdirected, stale or torn write is caught and explained.

pub const SECTOR: usize = 512;
const MAGIC: u64 = u64::from_le_bytes(*b"UDRVPATT");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Byte offset of the first bad sector within the buffer.
    pub at: usize,
    pub found_lba: u64,
    pub found_gen: u32,
    pub found_job: u32,
}

fn mix(mut z: u64) -> u64 {
    // splitmix64: cheap and different in every word.
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn word(sector_lba: u64, gen: u32, job: u32, i: usize) -> u64 {
    match i {
        0 => MAGIC,
        1 => sector_lba,
        2 => gen as u64 | (job as u64) << 32,
        _ => mix(sector_lba ^ (gen as u64) << 40 ^ (job as u64) << 56 ^ i as u64),
    }
}

/// Fills `buf` (a multiple of 512 bytes) for data starting at byte `offset` on disk.
pub fn fill(buf: &mut [u8], offset: u64, gen: u32, job: u32) {
    for (s, sector) in buf.chunks_exact_mut(SECTOR).enumerate() {
        let lba = offset / SECTOR as u64 + s as u64;
        for (i, w) in sector.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&word(lba, gen, job, i).to_le_bytes());
        }
    }
}

/// Checks `buf` against what `fill(buf, offset, gen, job)` wrote.
pub fn check(buf: &[u8], offset: u64, gen: u32, job: u32) -> Result<(), Mismatch> {
    for (s, sector) in buf.chunks_exact(SECTOR).enumerate() {
        let lba = offset / SECTOR as u64 + s as u64;
        let ok = sector
            .chunks_exact(8)
            .enumerate()
            .all(|(i, w)| w == word(lba, gen, job, i).to_le_bytes());
        if !ok {
            let rd = |i: usize| {
                u64::from_le_bytes(sector[i * 8..i * 8 + 8].try_into().unwrap_or_default())
            };
            let gj = rd(2);
            return Err(Mismatch {
                at: s * SECTOR,
                found_lba: rd(1),
                found_gen: gj as u32,
                found_job: (gj >> 32) as u32,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_detection() {
        let mut b = vec![0u8; 4096];
        fill(&mut b, 8192, 3, 1);
        assert!(check(&b, 8192, 3, 1).is_ok());
        let e = check(&b, 8192, 4, 1).unwrap_err();
        assert_eq!((e.at, e.found_lba, e.found_gen, e.found_job), (0, 16, 3, 1));
        assert!(check(&b, 8192 + 512, 3, 1).is_err(), "misdirected write");
        assert!(check(&b, 8192, 3, 2).is_err(), "other job's data");
        b[3 * 512 + 100] ^= 1;
        assert_eq!(check(&b, 8192, 3, 1).unwrap_err().at, 3 * 512);
        let z = vec![0u8; 512];
        assert_eq!(check(&z, 0, 1, 0).unwrap_err().found_gen, 0);
    }
}
