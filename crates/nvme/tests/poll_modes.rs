//! Queue groups in `busy`, `adaptive` and `event` mode with doorbells that arrive as
//! register writes (vfio-user messages): sleeping, EventIdx, wake-ups, switching.

use std::time::{Duration, Instant};

use engine::PollMode;
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;
use test_support::{wait_until, T};

/// A host with Doorbell Buffer Config (shadow + EventIdx, as Linux uses it) and
/// one I/O queue pair, on a controller in `mode`.
fn host_with_shadow(mode: PollMode) -> (Host, u64) {
    let cfg = nvme::ControllerConfig {
        poll: mode,
        ..Default::default()
    };
    let disk = std::sync::Arc::new(bdev::RamDisk::new(64 << 20, 512).unwrap());
    let mut h = Host::with(cfg, vec![disk]);
    let ei = h.ready_with_shadow();
    (h, ei)
}

fn read_u32(h: &Host, addr: u64) -> u32 {
    u32::from_le_bytes(h.read_mem(addr, 4).try_into().unwrap())
}

#[test]
fn busy_mode_with_event_idx_asks_the_driver_not_to_ring() {
    let (mut h, ei) = host_with_shadow(PollMode::Busy);
    let a = h.alloc(1);
    let before = h.rung;
    for i in 0..200u64 {
        assert!(h.io(rw(2, 1, i, 1, a, 0)).ok());
    }
    // The first command rings (EventIdx starts at 0); from then on the controller
    // keeps EventIdx one behind the tail while it polls.
    assert!(
        h.rung - before <= 2,
        "{} rings for 200 commands",
        h.rung - before
    );
    // EventIdx trails the tail by at most a quarter of the queue (it is moved
    // lazily while polling), never at or past it.
    let tail = u32::from(h.io[1].tail);
    let lag = (tail + 64 - 1 - read_u32(&h, ei + 8)) % 64;
    assert!(
        lag <= 16,
        "EventIdx {} for tail {tail}",
        read_u32(&h, ei + 8)
    );
    assert_eq!(h.sleeps(), 0, "busy mode never sleeps");
}

#[test]
fn event_mode_sleeps_publishes_event_idx_and_wakes_on_the_doorbell() {
    let (mut h, ei) = host_with_shadow(PollMode::Event);
    let a = h.alloc(1);
    let rung_at_start = h.rung;
    wait_until("the group did not go to sleep", T, || h.sleeps() > 0);
    for i in 0..100u64 {
        // Asleep: EventIdx is the tail we stopped at, so the next command rings.
        let tail = h.io[1].tail;
        wait_until("EventIdx not published at the tail", T, || {
            read_u32(&h, ei + 8) == u32::from(tail)
        });
        let (rung, before) = (h.rung, h.sleeps());
        let c = h.io(rw(if i % 2 == 0 { 1 } else { 2 }, 1, i, 1, a, 0));
        assert!(c.ok(), "command {i}: {c:?}");
        assert!(h.rung > rung, "a sleeping group must be rung");
        wait_until("the group did not go back to sleep", T, || {
            h.sleeps() > before
        });
    }
    // One ring per command (the SQ tail); the CQ head doorbell is kept quiet by
    // its EventIdx (at most the very first reap rings it).
    let rings = h.rung - rung_at_start;
    assert!(
        (100..=101).contains(&rings),
        "{rings} rings for 100 commands"
    );
}

#[test]
fn event_mode_without_shadow_doorbells_traps_every_write() {
    let mut h = Host::new();
    h.ctrl.set_poll_mode(PollMode::Event);
    h.enable();
    assert!(h.create_cq(1, 32, true, 1).ok());
    assert!(h.create_sq(1, 32, 1).ok());
    let a = h.alloc(8);
    let mut pending = Vec::new();
    for round in 0..50u64 {
        let before = h.sleeps();
        // A few commands at once, then a pause long enough to sleep.
        for k in 0..4u64 {
            pending.push(h.submit(1, rw(2, 1, round * 4 + k, 1, a + k * 4096, 0)));
        }
        while !pending.is_empty() {
            let c = h.reap(1);
            assert!(c.ok(), "{c:?}");
            pending.retain(|&cid| cid != c.cid);
        }
        wait_until("no sleep between rounds", T, || h.sleeps() > before);
    }
    assert_eq!(h.ctrl.stats().reads, 200);
}

#[test]
fn adaptive_mode_stays_awake_under_load_and_sleeps_when_idle() {
    let cfg = nvme::ControllerConfig {
        poll: PollMode::Adaptive,
        adaptive_idle: Duration::from_millis(50),
        ..Default::default()
    };
    let mut h = Host::with(
        cfg,
        vec![std::sync::Arc::new(
            bdev::RamDisk::new(1 << 20, 512).unwrap(),
        )],
    );
    h.enable();
    assert!(h.create_cq(1, 64, true, 1).ok());
    assert!(h.create_sq(1, 64, 1).ok());
    let a = h.alloc(1);
    wait_until("an idle adaptive group sleeps", T, || h.sleeps() > 0);
    let before = h.sleeps();
    // Back to back, well within the idle time: one wake-up, then polling.
    for i in 0..300u64 {
        assert!(h.io(rw(1, 1, i % 64, 1, a, 0)).ok());
    }
    let during = h.sleeps() - before;
    assert!(during <= 2, "slept {during} times under continuous load");
    wait_until("sleeps again once idle", T, || h.sleeps() > before + during);
}

#[test]
fn switching_modes_at_run_time_keeps_io_going() {
    let (mut h, _) = host_with_shadow(PollMode::Adaptive);
    let a = h.alloc(1);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let modes = [
        PollMode::Event,
        PollMode::Busy,
        PollMode::Adaptive,
        PollMode::Event,
    ];
    for (i, mode) in modes.iter().cycle().take(40).enumerate() {
        h.ctrl.set_poll_mode(*mode);
        let lba = i as u64;
        let mut data = pattern.clone();
        data[0] = i as u8;
        h.write_mem(a, &data);
        assert!(h.io(rw(1, 1, lba * 8, 8, a, 0)).ok());
        h.write_mem(a, &[0u8; 4096]);
        assert!(h.io(rw(2, 1, lba * 8, 8, a, 0)).ok());
        assert_eq!(h.read_mem(a, 4096), data, "mode {mode}, round {i}");
        if i % 3 == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    assert_eq!(h.ctrl.poll_mode(), PollMode::Event);
}

#[test]
fn mapped_doorbells_keep_every_mode_busy() {
    let mut h = Host::new();
    assert!(
        !h.ctrl.offer_doorbell_mmap(),
        "adaptive (the default) does not"
    );
    h.ctrl.set_poll_mode(PollMode::Busy);
    assert!(h.ctrl.offer_doorbell_mmap(), "busy mode offers the page");
    h.ctrl.set_poll_mode(PollMode::Event);
    assert!(
        h.ctrl.offer_doorbell_mmap(),
        "sticky for the connected client"
    );
    h.enable();
    assert!(h.create_cq(1, 16, true, 1).ok());
    assert!(h.create_sq(1, 16, 1).ok());
    let a = h.alloc(1);
    assert!(h.io(rw(2, 1, 0, 1, a, 0)).ok());
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        h.sleeps(),
        0,
        "a client with mapped doorbells cannot wake us"
    );
    // The next client is asked again: event mode does not offer the page.
    h.ctrl.client_gone();
    assert!(!h.ctrl.offer_doorbell_mmap());
}

fn set_feature(h: &mut Host, fid: u32, cdw11: u32) {
    let mut s = sqe(0x09, 0);
    s.cdw10 = fid;
    s.cdw11 = cdw11;
    assert!(h.admin(s).ok(), "Set Features {fid:#x}");
}

/// An enabled controller in `mode` on `disk` with I/O queue pair 1 whose CQ signals
/// interrupt vector 1.
fn host_with_irq_queue(mode: PollMode, disk: std::sync::Arc<dyn bdev::BlockDevice>) -> Host {
    let cfg = nvme::ControllerConfig {
        poll: mode,
        ..Default::default()
    };
    let mut h = Host::with(cfg, vec![disk]);
    h.enable();
    assert!(h.create_cq(1, 64, true, 1).ok());
    assert!(h.create_sq(1, 64, 1).ok());
    h
}

/// The aggregation time the coalescing tests set (255 x 100 µs).
const AGGREGATION: Duration = Duration::from_micros(25_500);

/// Coalescing signals once a threshold is reached or an aggregation time after the
/// first unsignalled completion: `irqs` since `start` may be one, plus one for each
/// aggregation time that passed. Unloaded that is one interrupt; load only
/// stretches the time, which only raises the allowance, so it never fails a correct
/// controller (one that signals before every sleep or poll does, when unloaded).
#[track_caller]
fn assert_coalesced(irqs: u64, start: Instant) {
    let windows = start.elapsed().as_micros() / AGGREGATION.as_micros();
    let allowed = 1 + u64::try_from(windows).unwrap_or(u64::MAX);
    assert!(
        irqs <= allowed,
        "{irqs} interrupts within {:?}: at most {allowed}",
        start.elapsed()
    );
}

#[test]
fn interrupt_coalescing_holds_interrupts_until_threshold_or_time() {
    let disk = std::sync::Arc::new(bdev::RamDisk::new(1 << 20, 512).unwrap());
    let mut h = host_with_irq_queue(PollMode::Busy, disk);
    let a = h.alloc(1);
    let batch = |h: &mut Host, n: u64| {
        let cmds: Vec<Sqe> = (0..n).map(|i| rw(2, 1, i, 1, a, 0)).collect();
        let cids = h.submit_batch(1, &cmds);
        for _ in &cids {
            assert!(h.reap(1).ok());
        }
    };
    // Off: every poll that posts signals.
    let before = h.irq_count(1);
    for _ in 0..4 {
        batch(&mut h, 1);
    }
    // The reactor signals after posting: the last interrupt may trail the reap.
    wait_until("four interrupts", T, || h.irq_count(1) - before >= 4);
    assert_eq!(h.irq_count(1) - before, 4);
    // 8 completions per interrupt (threshold is 0's based), at most 25.5 ms late.
    set_feature(&mut h, 0x08, 7 | (255 << 8));
    let (before, start) = (h.irq_count(1), Instant::now());
    batch(&mut h, 8);
    wait_until("a full batch signals", T, || h.irq_count(1) > before);
    assert_coalesced(h.irq_count(1) - before, start);
    // Three commands one after the other (each completion in its own poll): posted
    // at once, signalled together when the aggregation time runs out.
    let (before, start) = (h.irq_count(1), Instant::now());
    for _ in 0..3 {
        batch(&mut h, 1);
    }
    wait_until("the aggregation time ends the wait", T, || {
        h.irq_count(1) > before
    });
    // A wrongly early interrupt for the last completion would show by now.
    std::thread::sleep(AGGREGATION);
    assert_coalesced(h.irq_count(1) - before, start);
    // Coalescing Disable for vector 1 (Feature 09h): every batch signals again.
    set_feature(&mut h, 0x09, 1 | (1 << 16));
    let before = h.irq_count(1);
    for _ in 0..3 {
        batch(&mut h, 1);
    }
    wait_until("three interrupts", T, || h.irq_count(1) - before >= 3);
    assert_eq!(h.irq_count(1) - before, 3);
}

/// On a slow backend the reactor sleeps between completions and each one wakes it:
/// coalescing still holds the interrupt across those sleeps until the threshold
/// or the aggregation time (it used to fire before every sleep), and an interrupt
/// held when nothing else is coming still arrives once its time is up.
#[test]
fn coalescing_holds_across_sleeps_on_a_slow_backend() {
    use test_support::held::HeldDisk;
    let (disk, gate) = HeldDisk::new(1 << 20, 4096).unwrap();
    let mut h = host_with_irq_queue(PollMode::Event, std::sync::Arc::new(disk));
    let a = h.alloc(4);
    // 4 completions per interrupt, at most 25.5 ms late.
    set_feature(&mut h, 0x08, 3 | (255 << 8));
    for i in 0..4u64 {
        h.submit(1, rw(2, 1, i, 1, a + i * 4096, 0));
    }
    wait_until("the backend took the reads", T, || gate.submitted() == 4);
    let (before, start) = (h.irq_count(1), Instant::now());
    for _ in 0..4 {
        let slept = h.sleeps();
        gate.release(1);
        // Posted by a poll of its own, and the group asleep again after it.
        assert!(h.reap(1).ok());
        wait_until("the group went back to sleep", T, || h.sleeps() > slept);
    }
    wait_until("the fourth completion signals", T, || {
        h.irq_count(1) > before
    });
    assert_coalesced(h.irq_count(1) - before, start);
    // One completion and nothing after it: the aggregation time (100 µs) ends the
    // sleep that holds its interrupt.
    set_feature(&mut h, 0x08, 3 | (1 << 8));
    let before = h.irq_count(1);
    h.submit(1, rw(2, 1, 0, 1, a, 0));
    wait_until("the backend took the read", T, || gate.submitted() == 5);
    gate.release(1);
    wait_until("the held interrupt arrives", T, || h.irq_count(1) > before);
    assert!(h.try_reap(1).is_some_and(|c| c.ok()));
}

/// Reads throttled by QoS wait for tokens, which only time brings: an event-mode
/// group sleeps until they are due rather than polling for them (it used to spin
/// until the last one was admitted), and each still completes.
#[test]
fn qos_throttled_reads_let_the_reactor_sleep() {
    let ram = std::sync::Arc::new(bdev::RamDisk::new(1 << 20, 512).unwrap());
    // 20 IOPS: three reads go at once (the burst), the other three 50 ms apart.
    let limits = bdev::QosLimits {
        iops: Some(20),
        ..Default::default()
    };
    let disk = std::sync::Arc::new(bdev::QosDisk::new(ram, limits).unwrap());
    let mut h = host_with_irq_queue(PollMode::Event, disk);
    let a = h.alloc(1);
    let (polls, slept) = (h.reactor_iterations(), h.sleeps());
    let cmds: Vec<Sqe> = (0..6).map(|i| rw(2, 1, i, 1, a, 0)).collect();
    let start = std::time::Instant::now();
    for _ in h.submit_batch(1, &cmds) {
        assert!(h.reap(1).ok());
    }
    assert!(start.elapsed() >= Duration::from_millis(100), "throttled");
    let polls = h.reactor_iterations() - polls;
    // Spinning makes hundreds of thousands of polls in 150 ms (the count is
    // published every 4096); sleeping one per wake-up (a doorbell, a token due).
    assert!(
        polls < 20_000,
        "{polls} polls: the reactor spun on held reads"
    );
    assert!(h.sleeps() - slept >= 3, "slept between the throttled reads");
}
