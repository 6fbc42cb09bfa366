//! The LUKS data path's cipher speed on this CPU (docs/decisions/0037-luks-encryption.md):
//! AES-XTS-plain64 with a 512-bit key over 4 KiB requests (eight 512-byte
//! sectors, or one 4096-byte sector), encrypt and decrypt, in GB/s and cycles per
//! byte: the thread's CPU time (so that time other processes take on a shared
//! machine does not count) times the TSC's rate, measured against the clock here.
//! udrive's cipher (OpenSSL's EVP, the IV re-initialized per sector) runs next
//! to RustCrypto's `aes` with the XTS chaining written in Rust (tweaks computed
//! a group ahead so that AES-NI pipelines the blocks) and next to `xts-mode`
//! (RustCrypto's block-at-a-time XTS), on the same data, alternating rounds.
//!
//! `cargo run --release -p bdev --example xts_speed [SECONDS] [ROUNDS]`

use std::time::{Duration, Instant};

use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
use aes::{Aes256, Block};
use bdev::SectorCipher;
use xts_mode::{get_tweak_default, Xts128};

/// TSC ticks per nanosecond, measured over 200 ms.
fn tsc_per_ns() -> f64 {
    let (t0, c0) = (Instant::now(), tsc());
    std::thread::sleep(Duration::from_millis(200));
    let (c1, t1) = (tsc(), Instant::now());
    (c1 - c0) as f64 / (t1 - t0).as_nanos() as f64
}

/// This thread's CPU time in nanoseconds.
fn thread_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn tsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: RDTSC reads a counter; it has no memory effects.
    return unsafe { std::arch::x86_64::_rdtsc() };
    #[cfg(not(target_arch = "x86_64"))]
    return Instant::now().elapsed().as_nanos() as u64;
}

/// XTS over RustCrypto's `aes`: a sector's tweaks computed first, its blocks
/// then through `encrypt_blocks`/`decrypt_blocks` (AES-NI, eight at a time).
struct RustXts(Aes256, Aes256);

const GROUP: usize = 32;

impl RustXts {
    fn sector(&self, sector: &mut [u8], iv: u64, encrypt: bool) {
        let mut t = Block::default();
        t[..8].copy_from_slice(&iv.to_le_bytes());
        self.1.encrypt_block(&mut t);
        let mut tw = u128::from_le_bytes(t.into());
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
                let p = u128::from_le_bytes(p.try_into().expect("16 bytes"));
                *b = (p ^ tw).to_le_bytes().into();
                tw = (tw << 1) ^ (0x87 * (tw >> 127));
            }
            match encrypt {
                true => self.0.encrypt_blocks(&mut blocks[..n]),
                false => self.0.decrypt_blocks(&mut blocks[..n]),
            }
            for ((b, t), c) in blocks.iter().zip(&tweaks).zip(group.chunks_exact_mut(16)) {
                let v = u128::from_le_bytes((*b).into()) ^ t;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
    }

    fn apply(&self, data: &mut [u8], first: u64, unit: usize, encrypt: bool) {
        for (i, s) in data.chunks_exact_mut(unit).enumerate() {
            self.sector(s, first + (i * unit / 512) as u64, encrypt);
        }
    }
}

type Case<'a> = (String, Box<dyn FnMut(&mut [u8], u64) + 'a>);

fn main() {
    let mut args = std::env::args().skip(1);
    let secs: f64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let ghz = tsc_per_ns();
    let key: Vec<u8> = (0..64).collect();
    let mut buf = vec![0x5au8; 4096];
    println!("TSC {ghz:.2} GHz; 4 KiB requests, 512-bit key; cycles/byte, median (min–max) of {rounds} rounds");
    let aes = |k: &[u8]| Aes256::new_from_slice(k).expect("key");
    let reference = Xts128::new(aes(&key[..32]), aes(&key[32..]));
    let rust = RustXts(aes(&key[..32]), aes(&key[32..]));
    let mut cases: Vec<Case<'_>> = vec![(
        "xts-mode, 512, encrypt".into(),
        Box::new(|b: &mut [u8], n: u64| {
            for (i, s) in b.chunks_mut(512).enumerate() {
                reference.encrypt_sector(s, get_tweak_default(u128::from(n) + i as u128));
            }
        }),
    )];
    for unit in [512, 4096] {
        for encrypt in [true, false] {
            let dir = if encrypt { "encrypt" } else { "decrypt" };
            let rust = &rust;
            cases.push((
                format!("aes 0.8 + Rust XTS, {unit}, {dir}"),
                Box::new(move |b: &mut [u8], n: u64| rust.apply(b, n, unit, encrypt)),
            ));
            let mut c = SectorCipher::new(&key, unit)
                .expect("key")
                .crypter()
                .expect("contexts");
            cases.push((
                format!("OpenSSL EVP (udrive), {unit}, {dir}"),
                Box::new(move |b: &mut [u8], n: u64| {
                    let r = if encrypt {
                        c.encrypt(b, n)
                    } else {
                        c.decrypt(b, n)
                    };
                    r.expect("cipher")
                }),
            ));
        }
    }
    let mut results = vec![Vec::new(); cases.len()];
    for _ in 0..rounds {
        for ((_, f), r) in cases.iter_mut().zip(&mut results) {
            let mut n = 0u64;
            let t0 = thread_ns();
            while ((thread_ns() - t0) as f64) < secs * 1e9 {
                for _ in 0..256 {
                    f(&mut buf, n);
                    n += 8;
                }
            }
            r.push((thread_ns() - t0) as f64 * ghz / (n / 8 * 4096) as f64);
        }
    }
    for ((name, _), r) in cases.iter().zip(&mut results) {
        r.sort_by(f64::total_cmp);
        let med = r[r.len() / 2];
        println!(
            "{name:<40} {med:.2} cycles/byte ({:.2}–{:.2}), {:.2} GB/s",
            r[0],
            r[r.len() - 1],
            ghz / med
        );
    }
}
