//! Generation-stamped verified I/O through udrive's initiator, for tests that
//! disturb a server under a client (handover, supervised restart, RBD faults).
//!
//! The disk is a row of 4 KiB blocks; the client writes a block with a generation
//! ([`crate::pattern::fill_block`]) and remembers it, so whatever happens to the
//! server, each block must read back at the generation last written (0: never
//! written, zeros). [`GenClient`] runs such a client at QD32 on a thread of its own;
//! [`write_gen`] and [`verify`] are its steps for tests that drive them by hand.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use initiator::{DataMode, DmaBuf, IoOp, NvmeDriver, QueuePair};

use crate::driver::opts;
use crate::pattern::{fill_block, is_block};
use crate::Rng;

pub const BLOCK: usize = 4096;
/// Requests a [`GenClient`] keeps in flight (and buffers it needs).
pub const QD: usize = 32;
/// How long a request may take before the client gives up on it: far beyond what
/// any request takes on a loaded machine, short enough to fail a test.
pub const WAIT: Duration = Duration::from_secs(30);
const NLB: u32 = (BLOCK / 512) as u32;

/// [`QD`] block buffers of `d`.
pub fn bufs(d: &NvmeDriver) -> Vec<DmaBuf> {
    (0..QD)
        .map(|_| d.alloc_buf(BLOCK).expect("block buffer"))
        .collect()
}

/// Submits `op` of block `lbas[i]` from `bufs[i]` for each `i` at once (after
/// `fill(i, lba)`), rings once and waits for every completion.
pub fn burst(
    qp: &mut QueuePair,
    bufs: &[DmaBuf],
    op: IoOp,
    lbas: &[u64],
    fill: impl Fn(usize, u64),
) -> Result<(), String> {
    let mut cids = Vec::with_capacity(lbas.len());
    for (i, lba) in lbas.iter().enumerate() {
        fill(i, *lba);
        let cid = qp
            .submit_io(
                op,
                1,
                lba * u64::from(NLB),
                NLB,
                Some(&bufs[i]),
                DataMode::Prp,
            )
            .map_err(|e| format!("submit: {e}"))?;
        cids.push((cid, *lba));
    }
    qp.ring().map_err(|e| format!("ring: {e}"))?;
    for (cid, lba) in cids {
        let c = qp
            .wait(cid, WAIT)
            .map_err(|e| format!("{op:?} of block {lba}: no completion: {e}"))?;
        if !c.status.is_ok() {
            return Err(format!("{op:?} of block {lba}: status {}", c.status));
        }
    }
    Ok(())
}

/// Submits writes of `lbas` with generation `gen` (one buffer each) and rings,
/// without waiting: a burst in flight for a test to disturb.
pub fn submit_gen(qp: &mut QueuePair, bufs: &[DmaBuf], gen: u64, lbas: &[u64]) -> Vec<u16> {
    let cids = lbas
        .iter()
        .enumerate()
        .map(|(i, lba)| {
            write_block(&bufs[i], gen, *lba);
            qp.submit_io(
                IoOp::Write,
                1,
                lba * u64::from(NLB),
                NLB,
                Some(&bufs[i]),
                DataMode::Prp,
            )
            .expect("submit write")
        })
        .collect();
    qp.ring().expect("ring");
    cids
}

/// Writes `lbas` with generation `gen`, `bufs.len()` at a time; the blocks whose
/// completions came (all, unless the server died meanwhile: the first completion
/// that does not come ends it).
pub fn write_gen(qp: &mut QueuePair, bufs: &[DmaBuf], gen: u64, lbas: &[u64]) -> Vec<u64> {
    let mut done = Vec::new();
    for chunk in lbas.chunks(bufs.len()) {
        let fill = |i: usize, lba: u64| write_block(&bufs[i], gen, lba);
        if burst(qp, bufs, IoOp::Write, chunk, fill).is_err() {
            break;
        }
        done.extend_from_slice(chunk);
    }
    done
}

fn write_block(buf: &DmaBuf, gen: u64, lba: u64) {
    let mut b = vec![0u8; BLOCK];
    fill_block(&mut b, gen, lba);
    buf.write(0, &b).expect("fill block buffer");
}

/// Reads `lbas` back, `bufs.len()` at a time, and checks each holds generation
/// `gens[lba]`.
pub fn verify(
    qp: &mut QueuePair,
    bufs: &[DmaBuf],
    lbas: &[u64],
    gens: &[u64],
) -> Result<(), String> {
    let mut back = vec![0u8; BLOCK];
    for chunk in lbas.chunks(bufs.len()) {
        burst(qp, bufs, IoOp::Read, chunk, |i, _| bufs[i].fill(0))?;
        for (i, lba) in chunk.iter().enumerate() {
            bufs[i].read(0, &mut back).map_err(|e| e.to_string())?;
            let want = gens[*lba as usize];
            if !is_block(&back, want, *lba) {
                return Err(format!("block {lba}: not generation {want}"));
            }
        }
    }
    Ok(())
}

/// A client writing generations of blocks at QD32 on the first `blocks` blocks
/// and reading a sample back after every burst; at the end it reads every block
/// back.
pub struct GenClient {
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    thread: JoinHandle<Result<Vec<u64>, String>>,
}

impl GenClient {
    pub fn start(sock: PathBuf, seed: u64, blocks: u64) -> GenClient {
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let (st, op) = (stop.clone(), ops.clone());
        let thread = std::thread::spawn(move || run(&sock, seed, blocks, &st, &op));
        GenClient { stop, ops, thread }
    }

    /// Blocks written or verified so far.
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::Relaxed)
    }

    /// Stops the client; the generation it expects each block to hold, or the
    /// first thing that went wrong.
    pub fn finish(self) -> Result<Vec<u64>, String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| "client panicked".to_string())?
    }
}

fn run(
    sock: &std::path::Path,
    seed: u64,
    blocks: u64,
    stop: &AtomicBool,
    ops: &AtomicU64,
) -> Result<Vec<u64>, String> {
    let d = NvmeDriver::connect(sock, opts()).map_err(|e| format!("attach: {e}"))?;
    let mut qp = d.create_qpair(64, false).map_err(|e| e.to_string())?;
    let bufs = bufs(&d);
    let mut gens = vec![0u64; blocks as usize];
    let mut rng = Rng::new(seed);
    let mut gen = 0u64;
    while !stop.load(Ordering::Relaxed) {
        gen += 1;
        // Distinct blocks per burst, so the order of completions does not matter.
        let start = rng.below(blocks);
        let lbas: Vec<u64> = (0..QD as u64).map(|i| (start + i * 13) % blocks).collect();
        let g = seed << 40 | gen;
        burst(&mut qp, &bufs, IoOp::Write, &lbas, |i, lba| {
            write_block(&bufs[i], g, lba)
        })?;
        for lba in &lbas {
            gens[*lba as usize] = g;
        }
        let mut sample: Vec<u64> = (0..QD as u64).map(|_| rng.below(blocks)).collect();
        sample.sort_unstable();
        sample.dedup();
        verify(&mut qp, &bufs, &sample, &gens)?;
        ops.fetch_add((lbas.len() + sample.len()) as u64, Ordering::Relaxed);
    }
    let all: Vec<u64> = (0..blocks).collect();
    verify(&mut qp, &bufs, &all, &gens)?;
    Ok(gens)
}
