//! Helpers over udrive's initiator (`NvmeDriver`, `QueuePair`) for tests that talk
//! to an NVMe controller over vfio-user: options sized for tests, one command and
//! its completion, verified write/read checks, and a well-behaved client doing
//! verified I/O until told to stop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use initiator::{Completion, DataMode, DmaBuf, DriverOpts, IoOp, NvmeDriver, QueuePair, Sqe};

use crate::nvme_cmd::assert_ok;
use crate::wait::{wait_until, T};
use crate::Rng;

/// An IOVA no test maps (the driver's pool lives at 0x1_0000_0000).
pub const UNMAPPED: u64 = 0x7_0000_0000;

/// Driver options for tests: a small pool, 8 I/O queues, an admin timeout short
/// enough that a wedged controller fails a test instead of hanging it.
pub fn opts() -> DriverOpts {
    DriverOpts {
        pool_bytes: 16 << 20,
        io_queues: 8,
        admin_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Submits a raw SQE, rings, waits; the completion whatever its status.
#[track_caller]
pub fn raw(qp: &mut QueuePair, sqe: Sqe) -> Completion {
    let cid = qp.submit(sqe).expect("submit");
    qp.ring().expect("ring");
    qp.wait(cid, T).expect("completion")
}

/// Read/Write/Flush/Write Zeroes through the driver's PRP/SGL builder.
#[track_caller]
pub fn io(
    qp: &mut QueuePair,
    op: IoOp,
    nsid: u32,
    slba: u64,
    nlb: u32,
    buf: Option<&DmaBuf>,
    mode: DataMode,
) -> Completion {
    let cid = qp
        .submit_io(op, nsid, slba, nlb, buf, mode)
        .expect("submit_io");
    qp.ring().expect("ring");
    qp.wait(cid, T).expect("completion")
}

/// Writes `data` at `slba` (namespace 1, 512-byte blocks) from the start of `buf`
/// and reads it back into the same (cleared) buffer.
#[track_caller]
pub fn write_read(qp: &mut QueuePair, buf: &DmaBuf, slba: u64, data: &[u8], mode: DataMode) {
    write_read_ns(qp, 1, buf, slba, data, mode);
}

/// [`write_read`] on namespace `nsid`.
pub fn write_read_ns(
    qp: &mut QueuePair,
    nsid: u32,
    buf: &DmaBuf,
    slba: u64,
    data: &[u8],
    mode: DataMode,
) {
    let nlb = u32::try_from(data.len() / 512).expect("block count");
    let buf = buf.sub(0, data.len()).expect("buffer large enough");
    buf.write(0, data).expect("fill");
    let c = io(qp, IoOp::Write, nsid, slba, nlb, Some(&buf), mode);
    assert_ok(&c, "write");
    buf.fill(0);
    assert_ok(
        &io(qp, IoOp::Read, nsid, slba, nlb, Some(&buf), mode),
        "read",
    );
    let mut back = vec![0u8; data.len()];
    buf.read(0, &mut back).expect("read back");
    assert!(back == data, "data mismatch at LBA {slba}");
}

/// A good write and read on `qp` (namespace 1, 512-byte blocks, at `slba`): proves
/// the queue still works after a rejected command.
#[track_caller]
pub fn qp_still_works(qp: &mut QueuePair, slba: u64, seed: u64) {
    let buf = qp.alloc_buf(4096).expect("buffer");
    let data = Rng::new(seed).bytes(4096);
    buf.write(0, &data).expect("fill");
    let c = io(qp, IoOp::Write, 1, slba, 8, Some(&buf), DataMode::Prp);
    assert_ok(&c, "write after hostile command");
    buf.fill(0);
    let c = io(qp, IoOp::Read, 1, slba, 8, Some(&buf), DataMode::Sgl);
    assert_ok(&c, "read after hostile command");
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).expect("read back");
    assert!(back == data, "data mismatch after hostile command");
}

/// Verified writes and reads at random LBAs of namespace 1, PRP and SGL, on a new
/// queue pair.
#[track_caller]
pub fn check_io(d: &NvmeDriver, seed: u64) {
    let ns = d.namespace(1).expect("namespace 1").clone();
    let bs = u64::from(ns.lba_size);
    let mut qp = d.create_qpair(16, false).expect("create queue pair");
    let buf = qp.alloc_buf(64 << 10).expect("buffer");
    let mut rng = Rng::new(seed);
    for i in 0..8u32 {
        let nlb = rng.range(1, (64 << 10) / bs);
        let slba = rng.below(ns.nsze - nlb + 1);
        let len = (nlb * bs) as usize;
        let b = buf.sub(0, len).expect("sub buffer");
        let data = rng.bytes(len);
        b.write(0, &data).expect("fill");
        let mode = if i.is_multiple_of(2) {
            DataMode::Prp
        } else {
            DataMode::Sgl
        };
        let c = io(&mut qp, IoOp::Write, 1, slba, nlb as u32, Some(&b), mode);
        assert_ok(&c, "check_io write");
        b.fill(0);
        let c = io(&mut qp, IoOp::Read, 1, slba, nlb as u32, Some(&b), mode);
        assert_ok(&c, "check_io read");
        let mut back = vec![0u8; len];
        b.read(0, &mut back).expect("read back");
        assert!(back == data, "check_io: data mismatch at LBA {slba} x{nlb}");
    }
    d.delete_qpair(qp).expect("delete queue pair");
}

/// Waits for CSTS.CFS through the register interface.
#[track_caller]
pub fn wait_fatal(d: &NvmeDriver) {
    wait_until("CSTS.CFS", T, || {
        let csts = d.read_reg32(initiator::regs::CSTS).expect("read CSTS");
        csts & initiator::regs::CSTS_CFS != 0
    });
}

/// What a [`verified_io`] client does.
#[derive(Clone, Copy)]
pub struct Verifier {
    pub seed: u64,
    /// Requests are 1..=`max_nlb` blocks...
    pub max_nlb: u64,
    /// ...within the first `lbas` blocks of namespace 1 (all of it if larger).
    pub lbas: u64,
    /// Between two rounds, so a bystander leaves the reactor to the test.
    pub pause: Duration,
}

/// Writes random data, reads it back and compares, PRP and SGL in turn, until
/// `stop`; counts rounds in `ops`. The first error or mismatch ends it.
pub fn verified_io(
    d: &NvmeDriver,
    v: Verifier,
    stop: &AtomicBool,
    ops: &AtomicU64,
) -> Result<(), String> {
    let mut qp = d
        .create_qpair(16, false)
        .map_err(|e| format!("create queue pair: {e}"))?;
    let buf = qp
        .alloc_buf((v.max_nlb * 512) as usize)
        .map_err(|e| format!("buffer: {e}"))?;
    let nsze = d.namespace(1).map_or(0, |n| n.nsze).min(v.lbas);
    let mut rng = Rng::new(v.seed);
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let nlb = rng.range(1, v.max_nlb.min(nsze));
        let slba = rng.below(nsze - nlb + 1);
        let mode = if i.is_multiple_of(2) {
            DataMode::Prp
        } else {
            DataMode::Sgl
        };
        i += 1;
        let b = buf.sub(0, (nlb * 512) as usize).ok_or("sub buffer")?;
        round(&mut qp, &b, slba, mode, &mut rng)?;
        ops.fetch_add(1, Ordering::Relaxed);
        if !v.pause.is_zero() {
            std::thread::sleep(v.pause);
        }
    }
    Ok(())
}

/// One write, read back and compare of all of `b` at `slba`.
fn round(
    qp: &mut QueuePair,
    b: &DmaBuf,
    slba: u64,
    mode: DataMode,
    rng: &mut Rng,
) -> Result<(), String> {
    let len = b.len();
    let nlb = (len / 512) as u32;
    let data = rng.bytes(len);
    b.write(0, &data).map_err(|e| e.to_string())?;
    for op in [IoOp::Write, IoOp::Read] {
        if op == IoOp::Read {
            b.fill(0);
        }
        let c = qp
            .submit_io(op, 1, slba, nlb, Some(b), mode)
            .and_then(|cid| qp.ring().map(|_| cid))
            .and_then(|cid| qp.wait(cid, T))
            .map_err(|e| format!("{op:?} LBA {slba}: {e}"))?;
        if !c.status.is_ok() {
            return Err(format!("{op:?} LBA {slba}: {}", c.status));
        }
    }
    let mut back = vec![0u8; len];
    b.read(0, &mut back).map_err(|e| e.to_string())?;
    if back != data {
        return Err(format!("data mismatch at LBA {slba} x{nlb}"));
    }
    Ok(())
}
