//! The data path's cipher: AES-XTS over encryption sectors (512 or 4096 bytes,
//! LUKS2's `sector_size`) with dm-crypt's `plain64` IV: the number of the
//! sector's first 512-byte unit relative to the start of the encrypted data, as a
//! 64-bit little-endian number padded with zeroes to the 16-byte tweak. (LUKS
//! never sets dm-crypt's `iv_large_sectors`, so a 4096-byte sector's IVs go 0, 8,
//! 16, ...) That is what LUKS's `aes-xts-plain64` means. RustCrypto's `aes` picks AES-NI at run time;
//! The XTS chaining is written here rather than taken from `xts-mode`, which
//! encrypts one block at a time and so waits out each block's AES latency: a
//! sector's tweaks are computed first and its blocks go through
//! `encrypt_blocks`, which AES-NI pipelines eight at a time (measured in
//! docs/decisions/0037-luks-encryption.md). `xts-mode` stays as the tests'
//! reference.
//!
//! The key schedule is the volume key in another form, so it lives in a
//! [`Secret`]: a private mapping of its own, excluded from core dumps, locked in
//! memory where the process may, and wiped when dropped.

use std::fmt;
use std::io;
use std::ptr::NonNull;

use aes::cipher::consts::U16;
use aes::cipher::{BlockDecrypt, BlockEncrypt, BlockSizeUser, KeyInit};
use aes::{Aes128, Aes256, Block};
use zeroize::Zeroize;

/// The unit plain64 IVs count in.
pub const SECTOR: usize = 512;

/// AES-XTS with the plain64 IV, keyed with a LUKS volume key.
pub struct SectorCipher {
    xts: Keyed,
    /// Bytes encrypted under one tweak (512 or 4096).
    unit: usize,
}

// Boxing the larger variant would move key schedules out of the `Secret`
// mapping onto the heap.
#[allow(clippy::large_enum_variant)]
enum Keyed {
    /// A 256-bit volume key: two AES-128 keys (data, tweak).
    Aes128(Aes128, Aes128),
    /// A 512-bit volume key (LUKS2's default): two AES-256 keys.
    Aes256(Aes256, Aes256),
}

/// Blocks handed to the block cipher at once (a 512-byte sector).
const GROUP: usize = 32;

/// The first tweak of the sector with plain64 IV `iv`: the IV encrypted with
/// the tweak key.
fn first_tweak(iv: u64, encrypt: impl FnOnce(&mut Block)) -> Block {
    let mut t = Block::default();
    t[..8].copy_from_slice(&iv.to_le_bytes());
    encrypt(&mut t);
    t
}

/// One encryption sector in place: each block XORed with its tweak, through the
/// block cipher `op` (a group of blocks at a time, which AES-NI pipelines),
/// XORed again. Each tweak after `first` is the previous one times x in
/// GF(2^128) (IEEE 1619's little-endian convention).
fn xts_sector(sector: &mut [u8], first: Block, op: impl Fn(&mut [Block])) {
    let mut tw = u128::from_le_bytes(first.into());
    let mut tweaks = [0u128; GROUP];
    let mut blocks = [Block::default(); GROUP];
    for group in sector.chunks_mut(GROUP * 16) {
        let n = group.len() / 16;
        for ((b, t), p) in blocks
            .iter_mut()
            .zip(&mut tweaks)
            .zip(group.chunks_exact(16))
        {
            *t = tw;
            let p = u128::from_le_bytes(p.try_into().unwrap_or_default());
            *b = (p ^ tw).to_le_bytes().into();
            tw = (tw << 1) ^ (0x87 * (tw >> 127));
        }
        op(&mut blocks[..n]);
        for ((b, t), c) in blocks.iter().zip(&tweaks).zip(group.chunks_exact_mut(16)) {
            let v = u128::from_le_bytes((*b).into()) ^ t;
            c.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// Never prints key material.
impl fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bits = match self.xts {
            Keyed::Aes128(..) => 256,
            Keyed::Aes256(..) => 512,
        };
        write!(
            f,
            "SectorCipher(aes-xts-plain64, {bits}-bit key, {}-byte sectors)",
            self.unit
        )
    }
}

impl SectorCipher {
    /// The cipher for `key` (32 or 64 bytes: the two XTS halves) and encryption
    /// sectors of `unit` bytes (512 or 4096); `None` for anything else.
    pub fn new(key: &[u8], unit: usize) -> Option<SectorCipher> {
        if unit != 512 && unit != 4096 {
            return None;
        }
        let (k1, k2) = key.split_at(key.len() / 2);
        let xts = match key.len() {
            32 => Keyed::Aes128(
                Aes128::new_from_slice(k1).ok()?,
                Aes128::new_from_slice(k2).ok()?,
            ),
            64 => Keyed::Aes256(
                Aes256::new_from_slice(k1).ok()?,
                Aes256::new_from_slice(k2).ok()?,
            ),
            _ => return None,
        };
        Some(SectorCipher { xts, unit })
    }

    /// Bytes encrypted under one tweak: requests must be aligned to it.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// The plain64 IV of the `i`-th encryption sector from 512-byte unit `first`.
    fn iv(&self, first: u64, i: usize) -> u64 {
        first.wrapping_add((i * (self.unit / SECTOR)) as u64)
    }

    /// Encrypts `data` (whole encryption sectors; a partial tail is left alone)
    /// that starts at 512-byte unit `first` of the encrypted data.
    pub fn encrypt(&self, data: &mut [u8], first: u64) {
        self.apply(data, first, true)
    }

    /// Decrypts `data`, as [`SectorCipher::encrypt`] encrypted it.
    pub fn decrypt(&self, data: &mut [u8], first: u64) {
        self.apply(data, first, false)
    }

    fn apply(&self, data: &mut [u8], first: u64, encrypt: bool) {
        for (i, s) in data.chunks_exact_mut(self.unit).enumerate() {
            let iv = self.iv(first, i);
            match &self.xts {
                Keyed::Aes128(k, t) => keyed_sector(k, t, s, iv, encrypt),
                Keyed::Aes256(k, t) => keyed_sector(k, t, s, iv, encrypt),
            }
        }
    }
}

/// One sector with data key `k` and tweak key `t`.
fn keyed_sector<C>(k: &C, t: &C, sector: &mut [u8], iv: u64, encrypt: bool)
where
    C: BlockEncrypt + BlockDecrypt + BlockSizeUser<BlockSize = U16>,
{
    let first = first_tweak(iv, |b| t.encrypt_block(b));
    match encrypt {
        true => xts_sector(sector, first, |b| k.encrypt_blocks(b)),
        false => xts_sector(sector, first, |b| k.decrypt_blocks(b)),
    }
}

/// A value kept in a private anonymous mapping of its own that core dumps leave
/// out (`MADV_DONTDUMP`) and that is locked in memory when the process may
/// (`mlock`; refused without `CAP_IPC_LOCK` beyond the memlock limit, which only
/// costs the protection from swap). Dropping it drops the value and wipes the
/// mapping. Read-only once made, so it is shared between threads.
pub struct Secret<T> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone and only read through `&T`
// after construction, so it is as thread-safe as `T` itself.
unsafe impl<T: Send> Send for Secret<T> {}
// SAFETY: as above; shared access hands out `&T` only.
unsafe impl<T: Sync> Sync for Secret<T> {}

impl<T> Secret<T> {
    /// Moves `value` into a mapping of its own.
    pub fn new(value: T) -> io::Result<Secret<T>> {
        let page = 4096;
        let len = std::mem::size_of::<T>().max(1).div_ceil(page) * page;
        if std::mem::align_of::<T>() > page {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "alignment"));
        }
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `p..p+len` is the mapping made above. Advice and locking only
        // change how the kernel treats it; a refused lock leaves it usable.
        unsafe {
            if libc::madvise(p, len, libc::MADV_DONTDUMP) != 0 {
                let e = io::Error::last_os_error();
                libc::munmap(p, len);
                return Err(e);
            }
            libc::mlock(p, len);
        }
        let ptr = p.cast::<T>();
        // SAFETY: the mapping is page aligned (>= align_of::<T>, checked), at least
        // size_of::<T> bytes, writable and not yet holding a value.
        unsafe { ptr.write(value) };
        Ok(Secret {
            // SAFETY: mmap succeeded, so `p` is not null.
            ptr: unsafe { NonNull::new_unchecked(ptr) },
            len,
        })
    }
}

impl<T> std::ops::Deref for Secret<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: initialized in `new`, alive until `drop`, never mutated.
        unsafe { self.ptr.as_ref() }
    }
}

impl<T> Drop for Secret<T> {
    fn drop(&mut self) {
        let p = self.ptr.as_ptr();
        // SAFETY: the value was written in `new` and is dropped once, here; the
        // mapping is then ours alone to wipe and unmap (no reference outlives
        // `self`).
        unsafe {
            std::ptr::drop_in_place(p);
            std::slice::from_raw_parts_mut(p.cast::<u8>(), self.len).zeroize();
            libc::munlock(p.cast(), self.len);
            libc::munmap(p.cast(), self.len);
        }
    }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// IEEE 1619-2007 annex B, vector 4: a 512-byte data unit, data unit
    /// sequence number 0, AES-128 keys.
    #[test]
    fn ieee_1619_vector_4() {
        let key = hex("2718281828459045235360287471352631415926535897932384626433832795");
        let c = SectorCipher::new(&key, 512).unwrap();
        let mut data: Vec<u8> = (0..512).map(|i| i as u8).collect();
        c.encrypt(&mut data, 0);
        assert_eq!(
            data[..32],
            hex("27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c")[..]
        );
        // The last block, as OpenSSL's EVP computes it.
        assert_eq!(data[496..], hex("0a282df920147beabe421ee5319d0568")[..]);
        c.decrypt(&mut data, 0);
        assert!(data.iter().enumerate().all(|(i, b)| *b == i as u8));
    }

    #[test]
    fn round_trip_and_sector_numbers() {
        let key: Vec<u8> = (0..64).collect();
        let c = SectorCipher::new(&key, 512).unwrap();
        let plain: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let mut whole = plain.clone();
        c.encrypt(&mut whole, 1000);
        assert_ne!(whole, plain);
        // Sector by sector, each with its own number: the same bytes.
        for (i, s) in plain.chunks(SECTOR).enumerate() {
            let mut one = s.to_vec();
            c.encrypt(&mut one, 1000 + i as u64);
            assert_eq!(one, whole[i * SECTOR..(i + 1) * SECTOR]);
        }
        // Another sector number is another ciphertext.
        let mut moved = plain.clone();
        c.encrypt(&mut moved, 1001);
        assert_ne!(moved[..SECTOR], whole[..SECTOR]);
        c.decrypt(&mut whole, 1000);
        assert_eq!(whole, plain);
        assert!(SectorCipher::new(&key[..48], 512).is_none());
        assert!(SectorCipher::new(&key, 1024).is_none());
        // 4096-byte sectors: one tweak per 4096 bytes, numbered in 512-byte units.
        let big = SectorCipher::new(&key, 4096).unwrap();
        let mut two = plain.clone();
        two.extend_from_slice(&plain);
        big.encrypt(&mut two, 16);
        let mut second = plain.clone();
        big.encrypt(&mut second, 24);
        assert_eq!(two[4096..], second[..]);
        let mut first = plain.clone();
        big.encrypt(&mut first, 16);
        assert_eq!(two[..4096], first[..]);
        assert_ne!(first, second);
        assert!(!format!("{c:?}").contains("00"));
    }

    /// Against `xts-mode` (RustCrypto's XTS, block by block), both key sizes and
    /// sector sizes, IVs past 32 bits.
    #[test]
    fn same_as_xts_mode() {
        use xts_mode::{get_tweak_default, Xts128};
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(151)).collect();
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 13 + 7) as u8).collect();
        for (klen, unit) in [(32, 512), (64, 512), (64, 4096), (32, 4096)] {
            let ours = SectorCipher::new(&key[..klen], unit).unwrap();
            let mut a = data.clone();
            let first = (1u64 << 33) + 8;
            ours.encrypt(&mut a, first);
            let mut b = data.clone();
            for (i, s) in b.chunks_mut(unit).enumerate() {
                let t = get_tweak_default(u128::from(first) + (i * unit / 512) as u128);
                let (k1, k2) = key[..klen].split_at(klen / 2);
                if klen == 32 {
                    let x = Xts128::new(
                        Aes128::new_from_slice(k1).unwrap(),
                        Aes128::new_from_slice(k2).unwrap(),
                    );
                    x.encrypt_sector(s, t);
                } else {
                    let x = Xts128::new(
                        Aes256::new_from_slice(k1).unwrap(),
                        Aes256::new_from_slice(k2).unwrap(),
                    );
                    x.encrypt_sector(s, t);
                }
            }
            assert!(a == b, "{klen}-byte key, {unit}-byte sectors");
            ours.decrypt(&mut a, first);
            assert!(a == data);
        }
    }

    #[test]
    fn secret_holds_and_derefs() {
        let s = Secret::new([7u64; 3]).unwrap();
        assert_eq!(s[2], 7);
        assert_eq!(format!("{s:?}"), "Secret(..)");
    }
}
