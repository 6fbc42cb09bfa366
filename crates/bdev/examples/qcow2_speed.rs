//! What a qcow2 image's fast path costs per request over a raw file holding the
//! same data (docs/decisions/0038-qcow2.md): 4 KiB random reads of a fully
//! allocated image against the raw file, one request at a time, on one thread,
//! through the channels alone (no front end). Rounds alternate which goes first;
//! each prints nanoseconds per read, then the medians and the per-round
//! difference. Files on /dev/shm, 256 MiB, 64 KiB clusters.
//!
//! `cargo run --release -p bdev --example qcow2_speed [ROUNDS] [ENGINE]`
//! (ENGINE: `inline`, the default — one synchronous `preadv2` per read — or
//! `uring`: submit, enter, reap).

use std::time::Instant;

use bdev::{
    create_qcow2, BlockDevice, FileDisk, FileEngine, FileOptions, IoChannel, IoOp, IoRequest,
    Qcow2Create, Qcow2Disk, Qcow2Options,
};
use guest_mem::MappedRegion;

const SIZE: u64 = 256 << 20;
const READS: u64 = 20_000;

/// `READS` random 4 KiB reads; nanoseconds per read.
fn run(ch: &mut dyn IoChannel, buf: &MappedRegion, seed: &mut u64) -> f64 {
    let iov = [buf.slice(0, 4096).unwrap()];
    let t = Instant::now();
    for _ in 0..READS {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let offset = (*seed % (SIZE / 4096)) * 4096;
        let req = IoRequest {
            op: IoOp::Read,
            offset,
            len: 4096,
            iov: &iov,
            fua: false,
        };
        if ch.submit(1, &req).is_none() {
            ch.flush();
            while ch.poll(&mut |_, _| {}) == 0 {}
        }
    }
    t.elapsed().as_nanos() as f64 / READS as f64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(11);
    let engine: FileEngine = std::env::args()
        .nth(2)
        .map_or(FileEngine::Inline, |s| s.parse().unwrap());
    let raw = format!("/dev/shm/qcow2-speed-{}.raw", std::process::id());
    let img = format!("/dev/shm/qcow2-speed-{}.qcow2", std::process::id());
    let mut data = vec![0u8; SIZE as usize];
    let mut x = 0x1234_5678_9abc_def1u64;
    for c in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    std::fs::write(&raw, &data).unwrap();
    let o = Qcow2Create {
        size: SIZE,
        cluster_size: 65536,
        backing: None,
    };
    create_qcow2(img.as_ref(), &o).unwrap();
    let qopts = Qcow2Options {
        engine,
        ..Default::default()
    };
    let q = Qcow2Disk::open(&img, qopts).unwrap();
    let big = MappedRegion::anonymous(0, 1 << 20).unwrap();
    {
        // Every cluster allocated, in order, with the raw file's data.
        let mut ch = q.channel().unwrap();
        let iov = [big.slice(0, 1 << 20).unwrap()];
        for at in (0..SIZE).step_by(1 << 20) {
            iov[0]
                .write_from(0, &data[at as usize..(at + (1 << 20)) as usize])
                .unwrap();
            let req = IoRequest {
                op: IoOp::Write,
                offset: at,
                len: 1 << 20,
                iov: &iov,
                fua: false,
            };
            assert!(
                ch.submit(1, &req).is_some(),
                "allocating writes complete inline"
            );
        }
    }
    drop(data);
    let fopts = FileOptions {
        direct: false,
        engine,
        ..Default::default()
    };
    let f = FileDisk::open(&raw, fopts).unwrap();
    let buf = MappedRegion::anonymous(0, 4096).unwrap();
    let (mut qc, mut fc) = (q.channel().unwrap(), f.channel().unwrap());
    let (mut sq, mut sf) = (1u64, 1u64);
    // Warm the page cache and the L2 cache.
    run(&mut *qc, &buf, &mut sq);
    run(&mut *fc, &buf, &mut sf);
    let (mut tq, mut tf, mut diff) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let (a, b) = if r % 2 == 0 {
            let a = run(&mut *fc, &buf, &mut sf);
            (a, run(&mut *qc, &buf, &mut sq))
        } else {
            let b = run(&mut *qc, &buf, &mut sq);
            (run(&mut *fc, &buf, &mut sf), b)
        };
        println!("round {r}: raw {a:.0} ns, qcow2 {b:.0} ns per read");
        tf.push(a);
        tq.push(b);
        diff.push(b - a);
    }
    let (mf, mq) = (median(&mut tf), median(&mut tq));
    let lo = diff.iter().copied().fold(f64::MAX, f64::min);
    let hi = diff.iter().copied().fold(f64::MIN, f64::max);
    let md = median(&mut diff);
    println!("{engine:?}: raw {mf:.0} ns, qcow2 {mq:.0} ns; qcow2 - raw per round: median {md:.0} ns ({lo:.0} to {hi:.0}), {rounds} rounds of {READS} reads");
    let _ = std::fs::remove_file(&raw);
    let _ = std::fs::remove_file(&img);
}
