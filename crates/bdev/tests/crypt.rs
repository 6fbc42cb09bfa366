//! The LUKS data path (`bdev::CryptDisk`): what reaches the backend, what
//! reaches the client, and what it refuses.

use std::sync::Arc;

use bdev::{BlockDevice, CryptDisk, IoOp, IoRequest, IoStatus, LuksError, RamDisk, SectorCipher};
use guest_mem::{DmaSlice, MappedRegion};
use test_support::held::HeldDisk;

const KIB: u64 = 1 << 10;
/// Where the payload starts in these tests' volumes.
const DATA: u64 = 64 * KIB;

fn key() -> Vec<u8> {
    (0..64u8)
        .map(|i| i.wrapping_mul(37).wrapping_add(5))
        .collect()
}

fn crypt_over(inner: Arc<dyn BlockDevice>) -> CryptDisk {
    CryptDisk::with_key(inner, &key(), 512, DATA).unwrap()
}

fn rq<'a>(op: IoOp, offset: u64, iov: &'a [DmaSlice<'a>]) -> IoRequest<'a> {
    IoRequest {
        op,
        offset,
        len: iov.iter().map(|s| s.len() as u64).sum(),
        iov,
        fua: false,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn writes_are_ciphertext_below_and_read_back_plain() {
    let ram = Arc::new(RamDisk::new(DATA + 256 * KIB, 512).unwrap());
    let disk = crypt_over(ram.clone());
    assert_eq!(disk.info().size_bytes(), 256 * KIB);
    assert!(!disk.info().write_zeroes && !disk.info().discard);
    let mut ch = disk.channel().unwrap();
    let mem = MappedRegion::anonymous(0, 64 * KIB).unwrap();
    let plain = pattern(8192, 3);
    let buf = mem.slice(0, 8192).unwrap();
    buf.write_from(0, &plain).unwrap();
    // Uneven segments: a sector straddles two of them.
    let iov = [buf.sub(0, 100).unwrap(), buf.sub(100, 8092).unwrap()];
    assert_eq!(
        ch.submit(1, &rq(IoOp::Write, 4096, &iov)),
        Some(IoStatus::Ok)
    );
    let mut seen = vec![0u8; 8192];
    buf.read_into(0, &mut seen).unwrap();
    assert_eq!(
        seen, plain,
        "the client's buffer is never encrypted in place"
    );

    // Below: the payload's sector 8 on, encrypted with its own sector numbers.
    let mut raw_ch = ram.channel().unwrap();
    let raw = mem.slice(16 * KIB, 8192).unwrap();
    let r = [raw];
    let st = raw_ch.submit(2, &rq(IoOp::Read, DATA + 4096, &r));
    assert_eq!(st, Some(IoStatus::Ok));
    let mut below = vec![0u8; 8192];
    raw.read_into(0, &mut below).unwrap();
    let mut expect = plain.clone();
    SectorCipher::new(&key(), 512)
        .unwrap()
        .crypter()
        .unwrap()
        .encrypt(&mut expect, 8)
        .unwrap();
    assert_eq!(below, expect);

    let out = mem.slice(32 * KIB, 8192).unwrap();
    let o = [out.sub(0, 1000).unwrap(), out.sub(1000, 7192).unwrap()];
    assert_eq!(ch.submit(3, &rq(IoOp::Read, 4096, &o)), Some(IoStatus::Ok));
    out.read_into(0, &mut seen).unwrap();
    assert_eq!(seen, plain);
}

#[test]
fn asynchronous_reads_are_decrypted_at_completion() {
    let (held, gate) = HeldDisk::new(DATA + 64 * KIB, 512).unwrap();
    let disk = crypt_over(Arc::new(held));
    let mut ch = disk.channel().unwrap();
    let mem = MappedRegion::anonymous(0, 16 * KIB).unwrap();
    let plain = pattern(4096, 9);
    let w = mem.slice(0, 4096).unwrap();
    w.write_from(0, &plain).unwrap();
    let wi = [w];
    assert_eq!(ch.submit(10, &rq(IoOp::Write, 8192, &wi)), None);
    let r = mem.slice(8192, 4096).unwrap();
    let ri = [r];
    assert_eq!(ch.submit(11, &rq(IoOp::Read, 8192, &ri)), None);
    gate.open();
    let mut done = Vec::new();
    for _ in 0..10_000 {
        ch.poll(&mut |t, st| done.push((t, st)));
        if done.len() == 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(done, vec![(10, IoStatus::Ok), (11, IoStatus::Ok)]);
    let mut seen = vec![0u8; 4096];
    r.read_into(0, &mut seen).unwrap();
    assert_eq!(seen, plain);
}

#[test]
fn requests_it_cannot_encrypt_fail_cleanly() {
    let ram = Arc::new(RamDisk::new(DATA + 64 * KIB, 512).unwrap());
    let disk = crypt_over(ram);
    let mut ch = disk.channel().unwrap();
    let mem = MappedRegion::anonymous(0, 16 * KIB).unwrap();
    let b = mem.slice(0, 4096).unwrap();
    let one = [b];
    let odd = [b.sub(0, 100).unwrap()];
    let cases = [
        (rq(IoOp::Read, 100, &one), IoStatus::Invalid),
        (rq(IoOp::Write, 0, &odd), IoStatus::Invalid),
        (rq(IoOp::Write, 64 * KIB, &one), IoStatus::OutOfRange),
        (rq(IoOp::Read, u64::MAX - 10, &one), IoStatus::OutOfRange),
        (
            IoRequest {
                len: 8192,
                ..rq(IoOp::Write, 0, &one)
            },
            IoStatus::Invalid,
        ),
        (
            IoRequest::without_data(IoOp::WriteZeroes, 0, 4096, false),
            IoStatus::Unsupported,
        ),
        (
            IoRequest::without_data(IoOp::Discard, 0, 4096, false),
            IoStatus::Unsupported,
        ),
        (
            IoRequest::without_data(IoOp::Flush, 0, 0, false),
            IoStatus::Ok,
        ),
        (
            IoRequest::without_data(IoOp::Flush, u64::MAX, 0, false),
            IoStatus::Ok,
        ),
    ];
    for (i, (r, st)) in cases.iter().enumerate() {
        assert_eq!(ch.submit(i as u64, r), Some(*st), "case {i}: {r:?}");
    }
    // A header that does not leave room for data is refused.
    let small = Arc::new(RamDisk::new(DATA, 512).unwrap());
    assert!(matches!(
        CryptDisk::with_key(small, &key(), 512, DATA),
        Err(LuksError::Layout { .. })
    ));
    let ram = Arc::new(RamDisk::new(DATA * 2, 512).unwrap());
    assert!(matches!(
        CryptDisk::with_key(ram, &key()[..48], 512, DATA),
        Err(LuksError::KeySize { bytes: 48 })
    ));
    let mut twice = key()[..32].to_vec();
    twice.extend_from_slice(&key()[..32]);
    let ram = Arc::new(RamDisk::new(DATA * 2, 512).unwrap());
    assert!(matches!(
        CryptDisk::with_key(ram, &twice, 512, DATA),
        Err(LuksError::KeyRefused)
    ));
    let shown = format!("{disk:?}");
    assert!(shown.starts_with("CryptDisk") && !shown.contains("SectorCipher"));
}
