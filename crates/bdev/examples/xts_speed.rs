//! The LUKS data path's cipher speed on this CPU (docs/decisions/0037-luks-encryption.md):
//! AES-XTS-plain64 with a 512-bit key over 4 KiB requests (eight 512-byte
//! sectors, or one 4096-byte sector), encrypt and decrypt, in GB/s and cycles per
//! byte (cycles from the TSC, whose rate is measured against the clock here),
//! next to `xts-mode` (RustCrypto's block-at-a-time XTS) on the same data.
//!
//! `cargo run --release -p bdev --example xts_speed [SECONDS]`

use std::time::{Duration, Instant};

use aes::cipher::KeyInit;
use aes::Aes256;
use bdev::SectorCipher;
use xts_mode::{get_tweak_default, Xts128};

/// TSC ticks per nanosecond, measured over 200 ms.
fn tsc_per_ns() -> f64 {
    let (t0, c0) = (Instant::now(), tsc());
    std::thread::sleep(Duration::from_millis(200));
    let (c1, t1) = (tsc(), Instant::now());
    (c1 - c0) as f64 / (t1 - t0).as_nanos() as f64
}

fn tsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: RDTSC reads a counter; it has no memory effects.
    return unsafe { std::arch::x86_64::_rdtsc() };
    #[cfg(not(target_arch = "x86_64"))]
    return Instant::now().elapsed().as_nanos() as u64;
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let ghz = tsc_per_ns();
    let key: Vec<u8> = (0..64).collect();
    let mut buf = vec![0x5au8; 4096];
    println!("TSC {ghz:.2} GHz; 4 KiB requests, 512-bit key");
    let reference = Xts128::new(
        Aes256::new_from_slice(&key[..32]).expect("key"),
        Aes256::new_from_slice(&key[32..]).expect("key"),
    );
    let mut measure = |name: &str, f: &mut dyn FnMut(&mut [u8], u64)| {
        let mut n = 0u64;
        let t = Instant::now();
        let c0 = tsc();
        while t.elapsed().as_secs_f64() < secs {
            for _ in 0..256 {
                f(&mut buf, n);
                n += 8;
            }
        }
        let cycles = (tsc() - c0) as f64;
        let bytes = (n / 8 * 4096) as f64;
        let gbs = bytes / t.elapsed().as_secs_f64() / 1e9;
        println!(
            "{name:<36} {gbs:.2} GB/s, {:.2} cycles/byte",
            cycles / bytes
        );
    };
    measure("xts-mode, 512-byte sectors, encrypt", &mut |b, n| {
        for (i, s) in b.chunks_mut(512).enumerate() {
            reference.encrypt_sector(s, get_tweak_default(u128::from(n) + i as u128));
        }
    });
    for unit in [512, 4096] {
        let c = SectorCipher::new(&key, unit).expect("key");
        measure(
            &format!("udrive, {unit}-byte sectors, encrypt"),
            &mut |b, n| c.encrypt(b, n),
        );
        measure(
            &format!("udrive, {unit}-byte sectors, decrypt"),
            &mut |b, n| c.decrypt(b, n),
        );
    }
}
