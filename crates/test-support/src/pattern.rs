//! Data patterns that tell a test which write a block came from.
//!
//! A verifier writes a block with [`fill_block`] for a generation and checks it with
//! [`is_block`]: a block from another generation, another LBA or a shifted offset
//! reads back different. Generation 0 is "never written" and reads back zeros.

use crate::Rng;

/// `len` bytes whose value moves with the offset (`i * 31 + seed`): a buffer read
/// back at the wrong offset or from the wrong page does not match.
pub fn ramp(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Fills `out` with block `lba`'s contents in generation `gen`.
pub fn fill_block(out: &mut [u8], gen: u64, lba: u64) {
    Rng::new(gen << 32 | lba).fill(out);
}

/// Block `lba`'s contents in generation `gen`, `len` bytes.
pub fn block(gen: u64, lba: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_block(&mut v, gen, lba);
    v
}

/// Whether `buf` holds block `lba` of generation `gen` (zeros for generation 0).
pub fn is_block(buf: &[u8], gen: u64, lba: u64) -> bool {
    if gen == 0 {
        buf.iter().all(|b| *b == 0)
    } else {
        buf == block(gen, lba, buf.len())
    }
}
