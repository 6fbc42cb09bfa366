//! The data path's cipher: AES-XTS over encryption sectors (512 or 4096 bytes,
//! LUKS2's `sector_size`) with dm-crypt's `plain64` IV: the number of the
//! sector's first 512-byte unit relative to the start of the encrypted data, as a
//! 64-bit little-endian number padded with zeroes to the 16-byte tweak. (LUKS
//! never sets dm-crypt's `iv_large_sectors`, so a 4096-byte sector's IVs go 0, 8,
//! 16, ...) That is what LUKS's `aes-xts-plain64` means.
//!
//! The AES-XTS is OpenSSL's EVP `aes-{128,256}-xts`: its assembly computes the
//! tweaks in vector registers between interleaved AES rounds, and with 4096-byte
//! sectors runs at what the AES rounds alone cost, 1.55x RustCrypto's `aes` with
//! XTS chained in Rust (8 % slower with 512-byte sectors, where the IV's init per
//! sector shows; docs/decisions/0037-luks-encryption.md). A volume keys one pair of contexts
//! ([`SectorCipher`]); each channel works on its own copies ([`SectorCrypter`]),
//! because a context carries the sector's tweak, and changes only the IV per
//! sector (no key schedule per I/O, no allocation).
//!
//! The key schedules live in OpenSSL's heap, not in memory of ours: OpenSSL wipes
//! them when a context is freed, but it neither locks them in memory nor keeps
//! them out of core dumps (what `madvise(MADV_DONTDUMP)` would do).

use std::fmt;

use openssl::cipher::{Cipher, CipherRef};
use openssl::cipher_ctx::CipherCtx;
use openssl::error::ErrorStack;

/// The unit plain64 IVs count in.
pub const SECTOR: usize = 512;

/// AES-XTS with the plain64 IV, keyed with a LUKS volume key: the keyed
/// contexts channels copy. Shared between threads (only read).
pub struct SectorCipher {
    enc: CipherCtx,
    dec: CipherCtx,
    /// Bytes encrypted under one tweak (512 or 4096).
    unit: usize,
    /// The volume key's length in bits (256 or 512).
    bits: usize,
}

/// One channel's copy of a [`SectorCipher`]: the contexts an I/O re-initializes
/// with each sector's IV.
pub struct SectorCrypter {
    enc: CipherCtx,
    dec: CipherCtx,
    unit: usize,
}

/// Never prints key material.
impl fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SectorCipher(aes-xts-plain64, {}-bit key, {}-byte sectors)",
            self.bits, self.unit
        )
    }
}

/// Never prints key material.
impl fmt::Debug for SectorCrypter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SectorCrypter({}-byte sectors)", self.unit)
    }
}

/// Both contexts keyed with `key` for `cipher`.
fn keyed(cipher: &CipherRef, key: &[u8]) -> Result<(CipherCtx, CipherCtx), ErrorStack> {
    // No `set_padding(false)`: XTS never pads, and OpenSSL 3.0 would pass the
    // setting to the provider again at every IV's init.
    let mut enc = CipherCtx::new()?;
    enc.encrypt_init(Some(cipher), Some(key), None)?;
    let mut dec = CipherCtx::new()?;
    dec.decrypt_init(Some(cipher), Some(key), None)?;
    Ok((enc, dec))
}

impl SectorCipher {
    /// The cipher for `key` (32 or 64 bytes: the two XTS halves) and encryption
    /// sectors of `unit` bytes (512 or 4096); `None` for anything else, and for
    /// a key whose two halves are equal (OpenSSL refuses to encrypt with one, as
    /// IEEE 1619 requires; LUKS keys are random).
    pub fn new(key: &[u8], unit: usize) -> Option<SectorCipher> {
        if unit != 512 && unit != 4096 {
            return None;
        }
        let cipher = match key.len() {
            32 => Cipher::aes_128_xts(),
            64 => Cipher::aes_256_xts(),
            _ => return None,
        };
        let (enc, dec) = keyed(cipher, key).ok()?;
        Some(SectorCipher {
            enc,
            dec,
            unit,
            bits: key.len() * 8,
        })
    }

    /// Bytes encrypted under one tweak: requests must be aligned to it.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// Contexts of its own for one channel (copies of the keyed ones).
    pub fn crypter(&self) -> Result<SectorCrypter, ErrorStack> {
        let mut enc = CipherCtx::new()?;
        enc.copy(&self.enc)?;
        let mut dec = CipherCtx::new()?;
        dec.copy(&self.dec)?;
        Ok(SectorCrypter {
            enc,
            dec,
            unit: self.unit,
        })
    }
}

impl SectorCrypter {
    /// Bytes encrypted under one tweak.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// Encrypts `data` (whole encryption sectors; a partial tail is left alone)
    /// that starts at 512-byte unit `first` of the encrypted data.
    pub fn encrypt(&mut self, data: &mut [u8], first: u64) -> Result<(), ErrorStack> {
        sectors(&mut self.enc, true, self.unit, data, first)
    }

    /// Decrypts `data`, as [`SectorCrypter::encrypt`] encrypted it.
    pub fn decrypt(&mut self, data: &mut [u8], first: u64) -> Result<(), ErrorStack> {
        sectors(&mut self.dec, false, self.unit, data, first)
    }
}

/// Each `unit`-byte sector of `data` in place through `ctx` (keyed for the
/// direction `encrypt` says), under its own plain64 IV from unit `first`.
fn sectors(
    ctx: &mut CipherCtx,
    encrypt: bool,
    unit: usize,
    data: &mut [u8],
    first: u64,
) -> Result<(), ErrorStack> {
    for (i, s) in data.chunks_exact_mut(unit).enumerate() {
        let iv = plain64(first, i, unit);
        match encrypt {
            true => ctx.encrypt_init(None, None, Some(&iv))?,
            false => ctx.decrypt_init(None, None, Some(&iv))?,
        }
        ctx.cipher_update_inplace(s, unit)?;
    }
    Ok(())
}

/// The plain64 IV of the `i`-th `unit`-byte sector from 512-byte unit `first`.
fn plain64(first: u64, i: usize, unit: usize) -> [u8; 16] {
    let n = first.wrapping_add((i * (unit / SECTOR)) as u64);
    let mut iv = [0; 16];
    iv[..8].copy_from_slice(&n.to_le_bytes());
    iv
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
        let mut c = SectorCipher::new(&key, 512).unwrap().crypter().unwrap();
        let mut data: Vec<u8> = (0..512).map(|i| i as u8).collect();
        c.encrypt(&mut data, 0).unwrap();
        assert_eq!(
            data[..32],
            hex("27a7479befa1d476489f308cd4cfa6e2a96e4bbe3208ff25287dd3819616e89c")[..]
        );
        // The last block, as OpenSSL's EVP computes it.
        assert_eq!(data[496..], hex("0a282df920147beabe421ee5319d0568")[..]);
        c.decrypt(&mut data, 0).unwrap();
        assert!(data.iter().enumerate().all(|(i, b)| *b == i as u8));
    }

    #[test]
    fn round_trip_and_sector_numbers() {
        let key: Vec<u8> = (0..64).collect();
        let cipher = SectorCipher::new(&key, 512).unwrap();
        let mut c = cipher.crypter().unwrap();
        let plain: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let mut whole = plain.clone();
        c.encrypt(&mut whole, 1000).unwrap();
        assert_ne!(whole, plain);
        // Sector by sector, each with its own number: the same bytes.
        for (i, s) in plain.chunks(SECTOR).enumerate() {
            let mut one = s.to_vec();
            c.encrypt(&mut one, 1000 + i as u64).unwrap();
            assert_eq!(one, whole[i * SECTOR..(i + 1) * SECTOR]);
        }
        // Another sector number is another ciphertext.
        let mut moved = plain.clone();
        c.encrypt(&mut moved, 1001).unwrap();
        assert_ne!(moved[..SECTOR], whole[..SECTOR]);
        c.decrypt(&mut whole, 1000).unwrap();
        assert_eq!(whole, plain);
        assert!(SectorCipher::new(&key[..48], 512).is_none());
        assert!(SectorCipher::new(&key, 1024).is_none());
        // 4096-byte sectors: one tweak per 4096 bytes, numbered in 512-byte units.
        let mut big = SectorCipher::new(&key, 4096).unwrap().crypter().unwrap();
        let mut two = plain.clone();
        two.extend_from_slice(&plain);
        big.encrypt(&mut two, 16).unwrap();
        let mut second = plain.clone();
        big.encrypt(&mut second, 24).unwrap();
        assert_eq!(two[4096..], second[..]);
        let mut first = plain.clone();
        big.encrypt(&mut first, 16).unwrap();
        assert_eq!(two[..4096], first[..]);
        assert_ne!(first, second);
        assert_eq!(
            format!("{cipher:?}"),
            "SectorCipher(aes-xts-plain64, 512-bit key, 512-byte sectors)"
        );
        assert_eq!(format!("{c:?}"), "SectorCrypter(512-byte sectors)");
        // IEEE 1619's rule, which OpenSSL holds: no key of two equal halves.
        let mut same = key[..32].to_vec();
        same.extend_from_slice(&key[..32]);
        assert!(SectorCipher::new(&same, 512).is_none());
    }

    /// Against `xts-mode` (RustCrypto's XTS over RustCrypto's AES), both key
    /// sizes and sector sizes, IVs past 32 bits.
    #[test]
    fn same_as_xts_mode() {
        use aes::cipher::KeyInit;
        use aes::{Aes128, Aes256};
        use xts_mode::{get_tweak_default, Xts128};
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(151)).collect();
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 13 + 7) as u8).collect();
        for (klen, unit) in [(32, 512), (64, 512), (64, 4096), (32, 4096)] {
            let mut ours = SectorCipher::new(&key[..klen], unit)
                .unwrap()
                .crypter()
                .unwrap();
            let mut a = data.clone();
            let first = (1u64 << 33) + 8;
            ours.encrypt(&mut a, first).unwrap();
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
            ours.decrypt(&mut a, first).unwrap();
            assert!(a == data);
        }
    }
}
