//! What the qcow2 test programs share: reading a whole disk back, the
//! expected content, random verified operations.
#![allow(dead_code)]

use std::path::Path;

use bdev::{BlockDevice, IoOp, IoStatus, Qcow2Disk, Qcow2Options};
use guest_mem::MappedRegion;
use test_support::channel::one as io;
use test_support::rng::Rng;

pub const MIB: u64 = 1 << 20;

/// The whole device, read through udrive in 1 MiB requests.
pub fn read_all(d: &Qcow2Disk) -> Vec<u8> {
    let size = d.info().size_bytes() as usize;
    let mut ch = d.channel().unwrap();
    let buf = MappedRegion::anonymous(0, MIB).unwrap();
    let mut out = vec![0u8; size];
    for at in (0..size).step_by(MIB as usize) {
        let n = (MIB as usize).min(size - at);
        assert_eq!(
            io(&mut *ch, IoOp::Read, at as u64, &buf, n),
            IoStatus::Ok,
            "read at {at}"
        );
        buf.slice(0, n)
            .unwrap()
            .read_into(0, &mut out[at..at + n])
            .unwrap();
    }
    out
}

pub fn open(p: &Path) -> Qcow2Disk {
    Qcow2Disk::open(p, Qcow2Options::default()).unwrap()
}

/// Applies `write -P pat off len` to the expected content.
pub fn fill(want: &mut [u8], pat: u8, off: u64, len: u64) {
    want[off as usize..(off + len) as usize].fill(pat);
}

pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// `n` random writes, write zeroes, discards and flushes through `ch`, each
/// applied to `want`.
pub fn random_ops(ch: &mut dyn bdev::IoChannel, rng: &mut Rng, want: &mut [u8], n: usize) {
    let size = want.len() as u64;
    let buf = MappedRegion::anonymous(0, 256 << 10).unwrap();
    let mut data = vec![0u8; 256 << 10];
    for i in 0..n {
        let len = rng.range(1, 128) * 512;
        let off = rng.below((size - len) / 512) * 512;
        let op = match rng.below(10) {
            0 => IoOp::Discard,
            1 => IoOp::WriteZeroes,
            2 => IoOp::Flush,
            _ => IoOp::Write,
        };
        let r = off as usize..(off + len) as usize;
        match op {
            IoOp::Write => {
                rng.fill(&mut data[..len as usize]);
                buf.slice(0, len as usize)
                    .unwrap()
                    .write_from(0, &data[..len as usize])
                    .unwrap();
                want[r].copy_from_slice(&data[..len as usize]);
            }
            IoOp::WriteZeroes => want[r].fill(0),
            _ => {}
        }
        assert_eq!(
            io(ch, op, off, &buf, len as usize),
            IoStatus::Ok,
            "op {i}: {op:?} {off} {len}"
        );
        if op == IoOp::Discard {
            // Whole clusters read as zeroes after a discard, the rest as
            // before: take what udrive reads as the expectation there, and
            // check it is one of the two.
            assert_eq!(io(ch, IoOp::Read, off, &buf, len as usize), IoStatus::Ok);
            let mut got = vec![0u8; len as usize];
            buf.slice(0, len as usize)
                .unwrap()
                .read_into(0, &mut got)
                .unwrap();
            for (k, b) in got.iter().enumerate() {
                let w = &mut want[off as usize + k];
                assert!(*b == 0 || *b == *w, "discard at {off}: byte {k}");
                *w = *b;
            }
        }
    }
}

/// `size` random bytes written to `dir/base.raw` (a raw backing file).
pub fn raw_base(dir: &Path, size: u64, rng: &mut Rng) -> Vec<u8> {
    let mut base = vec![0u8; size as usize];
    rng.fill(&mut base);
    std::fs::write(dir.join("base.raw"), &base).unwrap();
    base
}
