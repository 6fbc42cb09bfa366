//! Wake-up stress: many I/Os with random pauses around the adaptive idle
//! threshold, on several queues of several controllers, so queue groups keep
//! falling asleep and being woken by doorbell messages. A lost wake-up shows as a
//! reactor sleep that runs to its 500 ms limit while a command waits; none may
//! happen, and every I/O must complete with the data written.
//!
//! `UDRIVE_WAKE_STRESS_IOS` sets the total (default 200 000; runs of 1 000 000
//! pass too).

mod common;
use common::*;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use engine::PollMode;
use initiator::{DataMode, DmaBuf, IoOp, NvmeDriver};

const IDLE_US: u64 = 100;

/// Drives one queue pair on its own share of the namespace (`part` of `parts`).
fn stress_queue(d: &NvmeDriver, seed: u64, part: u64, parts: u64, ios: u64) {
    let mut qp = d.create_qpair(32, false).expect("queue pair");
    let bufs: Vec<DmaBuf> = (0..4)
        .map(|_| qp.alloc_buf(4096).expect("buffer"))
        .collect();
    let mut rng = Rng::new(seed);
    let blocks = d.namespace(1).expect("ns 1").nsze / 8 / parts;
    let first = part * blocks;
    let mut done = 0u64;
    while done < ios {
        let depth = rng.range(1, 4) as usize;
        let mut cids = Vec::with_capacity(depth);
        let mut lbas = Vec::with_capacity(depth);
        for b in bufs.iter().take(depth) {
            // A distinct block per slot, tagged with the round so stale data shows.
            let lba = (first + rng.below(blocks / 4) * 4 + lbas.len() as u64) * 8;
            b.fill((done as u8) ^ (lba as u8));
            let c = qp
                .submit_io(IoOp::Write, 1, lba, 8, Some(b), DataMode::Prp)
                .expect("submit write");
            cids.push(c);
            lbas.push(lba);
        }
        qp.ring().expect("ring");
        for c in cids.drain(..) {
            let w = qp.wait(c, T).expect("write completion");
            assert!(w.status.is_ok(), "write: {}", w.status);
        }
        pause(&mut rng);
        for (b, &lba) in bufs.iter().zip(&lbas) {
            b.fill(0xee);
            cids.push(
                qp.submit_io(IoOp::Read, 1, lba, 8, Some(b), DataMode::Prp)
                    .expect("submit read"),
            );
        }
        qp.ring().expect("ring");
        for (c, (b, &lba)) in cids.drain(..).zip(bufs.iter().zip(&lbas)) {
            let r = qp.wait(c, T).expect("read completion");
            assert!(r.status.is_ok(), "read: {}", r.status);
            let mut back = [0u8; 4096];
            b.read(0, &mut back).expect("read back");
            let want = (done as u8) ^ (lba as u8);
            assert!(back.iter().all(|&x| x == want), "lba {lba}: stale data");
        }
        done += 2 * depth as u64;
        pause(&mut rng);
    }
    d.delete_qpair(qp).expect("delete queue pair");
}

/// None, shorter than the idle threshold, just past it, or well past it.
fn pause(rng: &mut Rng) {
    let us = match rng.below(4) {
        0 => return,
        1 => rng.below(IDLE_US),
        2 => IDLE_US + rng.below(IDLE_US),
        _ => 4 * IDLE_US + rng.below(1000),
    };
    let until = Instant::now() + Duration::from_micros(us);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

#[test]
fn no_lost_wake_up_across_the_idle_threshold() {
    let total: u64 = std::env::var("UDRIVE_WAKE_STRESS_IOS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let modes = [PollMode::Adaptive, PollMode::Event];
    let devs: Vec<TestDev> = modes
        .iter()
        .enumerate()
        .map(|(i, &m)| {
            TestDev::start_with(&format!("stress{i}"), &["ram:32M"], |c| {
                c.poll = m;
                c.poll_idle_us = IDLE_US;
            })
        })
        .collect();
    let drivers: Vec<NvmeDriver> = devs.iter().map(|d| d.connect()).collect();
    let stats = engine().stats(0).expect("reactor 0");
    let (sleeps0, timeouts0) = (
        stats.sleeps.load(Ordering::Relaxed),
        stats.sleep_timeouts.load(Ordering::Relaxed),
    );
    let started = Instant::now();
    let queues_per_ctrl = 2u64;
    let per_queue = total / (drivers.len() as u64 * queues_per_ctrl);
    std::thread::scope(|s| {
        for (i, d) in drivers.iter().enumerate() {
            for q in 0..queues_per_ctrl {
                s.spawn(move || {
                    stress_queue(d, 1 + i as u64 * 10 + q, q, queues_per_ctrl, per_queue)
                });
            }
        }
    });
    let sleeps = stats.sleeps.load(Ordering::Relaxed) - sleeps0;
    let timeouts = stats.sleep_timeouts.load(Ordering::Relaxed) - timeouts0;
    eprintln!(
        "wake stress: {} I/Os in {:.1} s, {sleeps} reactor sleeps, {timeouts} ran to the limit",
        per_queue * drivers.len() as u64 * queues_per_ctrl,
        started.elapsed().as_secs_f64()
    );
    assert!(
        sleeps > 100,
        "the groups hardly slept ({sleeps}): the stress tested nothing"
    );
    assert_eq!(
        timeouts, 0,
        "a sleep ran to its limit while I/O waited: lost wake-up"
    );
    for d in &devs {
        let st = d.ctrl().stats();
        assert_eq!((st.io_errors, st.fatal), (0, false));
    }
}
