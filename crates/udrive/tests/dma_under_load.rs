//! DMA_MAP and DMA_UNMAP while an asynchronous backend always has commands in flight
//! (a `fault_latency_us` namespace completes every command later, like a file on
//! disk or a remote image): commands into a region mapped under load work, and an
//! unmap under load is answered as soon as the commands that used the old map are
//! done, never while one of them still is.

mod common;

use std::time::{Duration, Instant};

use common::*;
use frontend_core::Observed;
use guest_mem::{Prot, SharedMem};
use initiator::{Completion, QueuePair};

const LOAD_QD: usize = 8;
const LATENCY_US: u64 = 2000;

/// Keeps `LOAD_QD` reads in flight on the driver's pool, their completions staggered,
/// and hands back completions of any other command.
struct Load {
    bufs: Vec<initiator::DmaBuf>,
    cids: Vec<u16>,
    done: u64,
}

impl Load {
    fn start(qp: &mut QueuePair) -> Load {
        let mut l = Load {
            bufs: Vec::new(),
            cids: Vec::new(),
            done: 0,
        };
        for i in 0..LOAD_QD {
            let b = qp.alloc_buf(4096).unwrap();
            l.cids.push(Self::submit(qp, &b, i as u64));
            l.bufs.push(b);
            // Staggered, so the group never sees all of them complete at once.
            std::thread::sleep(Duration::from_micros(LATENCY_US / LOAD_QD as u64));
        }
        l
    }

    fn submit(qp: &mut QueuePair, b: &initiator::DmaBuf, i: u64) -> u16 {
        let cid = qp
            .submit_io(
                initiator::IoOp::Read,
                1,
                i * 8,
                8,
                Some(b),
                initiator::DataMode::Prp,
            )
            .unwrap();
        qp.ring().unwrap();
        cid
    }

    /// One pass: reaps and resubmits the load's reads; returns completions that
    /// are not the load's.
    fn pump_once(&mut self, qp: &mut QueuePair) -> Vec<Completion> {
        let mut other = Vec::new();
        for c in qp.poll(64).unwrap() {
            match self.cids.iter().position(|x| *x == c.cid) {
                Some(i) => {
                    assert_ok(&c, "load read");
                    self.done += 1;
                    self.cids[i] = Self::submit(qp, &self.bufs[i], i as u64);
                }
                None => other.push(c),
            }
        }
        other
    }

    /// Pumps until `n` more of the load's reads completed.
    fn pump_for(&mut self, qp: &mut QueuePair, n: u64) {
        let want = self.done + n;
        wait_until("the load's reads", T, || {
            let other = self.pump_once(qp);
            assert!(other.is_empty(), "unexpected completions {other:?}");
            self.done >= want
        });
    }

    /// Pumps until the command `cid` completes.
    fn until(&mut self, qp: &mut QueuePair, cid: u16) -> Completion {
        let mut got = None;
        wait_until(&format!("command {cid}"), T, || {
            got = self.pump_once(qp).into_iter().find(|c| c.cid == cid);
            got.is_some()
        });
        got.expect("completed")
    }
}

/// Requests of queue `qid` at the backend now.
fn in_flight(dev: &TestDev, qid: u16) -> u32 {
    dev.ctrl()
        .queue_stats(T)
        .iter()
        .filter(|q| q.queue == qid)
        .map(|q| q.inflight)
        .sum()
}

#[test]
fn dma_map_and_unmap_under_sustained_load() {
    let dev = TestDev::start("load", &[&format!("ram:16M,fault_latency_us={LATENCY_US}")]);
    let d = dev.connect();
    let mut qp = d.create_qpair(64, false).unwrap();
    let mut load = Load::start(&mut qp);
    load.pump_for(&mut qp, 50);

    // A region mapped while commands are in flight is usable at once.
    let extra = SharedMem::new("extra", 64 << 10).unwrap();
    let xi = 0x2_0000_0000;
    d.client()
        .dma_map(extra.fd(), 0, xi, 64 << 10, Prot::RW)
        .unwrap();
    let data = Rng::new(7).bytes(4096);
    extra.all().write_from(0, &data).unwrap();
    for round in 0..5u64 {
        let cid = qp.submit(rw(WRITE, 1, 1000 + round * 8, 8, xi, 0)).unwrap();
        qp.ring().unwrap();
        let c = load.until(&mut qp, cid);
        assert_ok(&c, "write from a region mapped under load");
    }
    extra.all().fill(0);
    let cid = qp.submit(rw(READ, 1, 1000, 8, xi, 0)).unwrap();
    qp.ring().unwrap();
    assert_ok(&load.until(&mut qp, cid), "read into it");
    let mut back = vec![0u8; 4096];
    extra.all().read_into(0, &mut back).unwrap();
    assert!(back == data, "the data went through the new region");

    // An unmap under load waits for the command still using the region, and for no
    // more than the commands in flight: it is answered before the 2 s give-up
    // (the line between waiting for them and giving up on them, not a speed). The
    // read goes on a queue of its own, so the test sees it reach the backend.
    let mut qp2 = d.create_qpair(16, false).unwrap();
    let cid = qp2.submit(rw(READ, 1, 1000, 8, xi, 0)).unwrap();
    qp2.ring().unwrap();
    let mut done = None;
    wait_until("the read in flight", T, || {
        done = qp2.try_take(cid).unwrap();
        done.is_some() || in_flight(&dev, qp2.qid()) > 0
    });
    let t = Instant::now();
    d.client().dma_unmap(xi, 64 << 10).unwrap();
    let took = t.elapsed();
    let c = done
        .or_else(|| qp2.try_take(cid).unwrap())
        .expect("the read into the region completed before the unmap was answered");
    assert_ok(&c, "read in flight across the unmap");
    assert!(
        took < Duration::from_secs(2),
        "the unmap waited {took:?}: it should wait only for the commands in flight"
    );
    // The load keeps running after the unmap.
    load.pump_for(&mut qp, LOAD_QD as u64);
    assert!(!dev.ctrl().stats().fatal);
}
