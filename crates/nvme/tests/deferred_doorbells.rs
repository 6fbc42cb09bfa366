//! With at least `engine::DEFER_QUEUE` requests in flight on a slow backend, an
//! adaptive group with shadow doorbells sleeps without asking the driver to ring:
//! EventIdx stays one behind the SQ head, a new command waits in the SQ, and the
//! next completion wakes the group, which then fetches it
//! (docs/decisions/0029-deferred-doorbells.md). Below the threshold a sleeping
//! group asks for the doorbell as before.

use std::sync::Arc;
use std::time::Duration;

use bdev::BlockDevice;
use engine::{PollMode, DEFER_QUEUE};
use test_support::held::{HeldDisk, HeldGate};
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;
use test_support::{wait_until, T};

struct Setup {
    h: Host,
    ei: u64,
    gate: Arc<HeldGate>,
    buf: u64,
}

/// An enabled adaptive controller (1 ms idle spin) on `disks` with shadow doorbells
/// and one I/O queue pair; the shadow/EventIdx buffer's address.
fn adaptive_host(disks: Vec<Arc<dyn BlockDevice>>) -> (Host, u64) {
    let cfg = nvme::ControllerConfig {
        poll: PollMode::Adaptive,
        adaptive_idle: Duration::from_millis(1),
        ..Default::default()
    };
    let mut h = Host::with(cfg, disks);
    let ei = h.ready_with_shadow();
    (h, ei)
}

fn setup() -> Setup {
    let (disk, gate) = HeldDisk::new(1 << 20, 4096).unwrap();
    let (mut h, ei) = adaptive_host(vec![Arc::new(disk)]);
    let buf = h.alloc(2 * DEFER_QUEUE as u64);
    Setup { h, ei, gate, buf }
}

impl Setup {
    fn sleeps(&self) -> u64 {
        self.h.sleeps()
    }
    fn sq_event_idx(&self) -> u16 {
        self.h.sq1_event_idx(self.ei)
    }
    fn submitted(&self) -> usize {
        self.gate.submitted()
    }
    fn read(&mut self, i: u64) {
        let c = rw(2, 1, i, 1, self.buf + i * 4096, 0);
        self.h.submit(1, c);
    }
    fn release(&mut self, n: usize) {
        self.gate.release(n);
    }
    /// Waits until the group sleeps with `submitted` requests taken by the backend.
    fn asleep_with(&self, submitted: usize) {
        wait_until("the group took the commands", T, || {
            self.submitted() == submitted
        });
        // Counted from here: a sleep that began before the last command was taken
        // (ended by its doorbell) says nothing about the group's state now.
        let before = self.sleeps();
        wait_until("the group went to sleep", T, || self.sleeps() > before);
    }
}

#[test]
fn a_deep_slow_queue_sleeps_without_asking_for_doorbells() {
    let mut s = setup();
    let shallow = DEFER_QUEUE - 1;
    for i in 0..shallow as u64 {
        s.read(i);
    }
    s.asleep_with(shallow);
    // Shallow: EventIdx at the tail, so the driver's next command rings.
    let tail = s.h.io[1].tail;
    assert_eq!(
        s.sq_event_idx(),
        tail,
        "below the threshold the group asks to be rung"
    );
    let rung = s.h.rung;
    s.read(shallow as u64);
    assert_eq!(
        s.h.rung,
        rung + 1,
        "the command that deepens the queue rings"
    );
    s.asleep_with(DEFER_QUEUE);

    // Deep: EventIdx one behind the head; the next command does not ring and stays
    // in the SQ while the group sleeps.
    let tail = s.h.io[1].tail;
    assert_eq!(
        s.sq_event_idx(),
        tail.wrapping_sub(1),
        "deferred: one behind"
    );
    let (rung, timeouts) = (s.h.rung, s.h.sleep_timeouts());
    s.read(DEFER_QUEUE as u64);
    assert_eq!(s.h.rung, rung, "the driver was told not to ring");
    // Nothing to wait for: give a wrong fetch time to show. Only a sleep that ran
    // to its 500 ms limit (which a slow run may reach) may have fetched it.
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        s.submitted() == DEFER_QUEUE || s.h.sleep_timeouts() > timeouts,
        "fetched while nothing woke the group"
    );

    // A completion wakes the group, which fetches the waiting command.
    s.release(1);
    let c = s.h.reap(1);
    assert!(c.ok(), "{c:?}");
    wait_until(
        "the waiting command was fetched after the wake-up",
        T,
        || s.submitted() == DEFER_QUEUE + 1,
    );
    s.release(DEFER_QUEUE);
    for _ in 0..DEFER_QUEUE {
        let c = s.h.reap(1);
        assert!(c.ok(), "{c:?}");
    }
    assert_eq!(s.h.ctrl.stats().reads, DEFER_QUEUE as u64 + 1);
}

/// Requests held back by QoS are as slow as a remote backend's, and a new command
/// would queue behind them anyway: with `DEFER_QUEUE` of them waiting for tokens the
/// adaptive group sleeps with EventIdx one behind (no doorbell for the next
/// command) and lets the token timer wake it, which then fetches what came meanwhile.
#[test]
fn commands_held_for_tokens_defer_doorbells() {
    let ram = Arc::new(bdev::RamDisk::new(1 << 20, 4096).unwrap());
    // 1 IOPS: one read goes at once (the burst), the next a second later, so the
    // checks below run with DEFER_QUEUE held however slowly this test gets to them.
    let limits = bdev::QosLimits {
        iops: Some(1),
        ..Default::default()
    };
    let qos = Arc::new(bdev::QosDisk::new(ram, limits).unwrap());
    let (mut h, ei) = adaptive_host(vec![qos.clone()]);
    let buf = h.alloc(1);
    let n = DEFER_QUEUE as u64 + 1;
    let cmds: Vec<Sqe> = (0..n).map(|i| rw(2, 1, i, 1, buf, 0)).collect();
    h.submit_batch(1, &cmds);
    assert!(h.reap(1).ok());
    // Asleep between two tokens.
    let slept = h.sleeps();
    wait_until("the group sleeps while reads wait for tokens", T, || {
        h.sleeps() > slept
    });
    let event_idx = h.sq1_event_idx(ei);
    assert_eq!(
        event_idx,
        h.io[1].tail.wrapping_sub(1),
        "deferred: one behind"
    );
    let rung = h.rung;
    h.submit(1, rw(2, 1, n, 1, buf, 0));
    assert_eq!(h.rung, rung, "the driver was told not to ring");
    // The limit lifted, the QoS timer wakes the group (no doorbell): the held reads
    // and the new one complete.
    qos.set_limits(bdev::QosLimits::default()).unwrap();
    for _ in 0..=DEFER_QUEUE {
        assert!(h.reap(1).ok());
    }
    assert_eq!(h.ctrl.stats().reads, n + 1);
}

/// A fast namespace beside the slow one keeps the doorbells: a command for it must
/// not wait in the SQ for the slow namespace's next completion.
#[test]
fn a_fast_namespace_beside_keeps_doorbells() {
    let (held, gate) = HeldDisk::new(1 << 20, 4096).unwrap();
    let ram = Arc::new(bdev::RamDisk::new(1 << 20, 4096).unwrap());
    let (mut h, ei) = adaptive_host(vec![Arc::new(held), ram]);
    let buf = h.alloc(1);
    let cmds: Vec<Sqe> = (0..DEFER_QUEUE as u64)
        .map(|i| rw(2, 1, i, 1, buf, 0))
        .collect();
    h.submit_batch(1, &cmds);
    wait_until("deep on the slow namespace", T, || {
        gate.submitted() == DEFER_QUEUE
    });
    let slept = h.sleeps();
    wait_until("asleep", T, || h.sleeps() > slept);
    let event_idx = h.sq1_event_idx(ei);
    assert_eq!(event_idx, h.io[1].tail, "asleep, it asks to be rung");
    // A read of the RAM namespace rings and completes while the others wait.
    let rung = h.rung;
    h.submit(1, rw(2, 2, 0, 1, buf, 0));
    assert_eq!(h.rung, rung + 1, "rang for the fast namespace");
    let c = h.reap(1);
    assert!(c.ok(), "{c:?}");
    assert_eq!(gate.submitted(), DEFER_QUEUE);
    gate.release(DEFER_QUEUE);
    for _ in 0..DEFER_QUEUE {
        assert!(h.reap(1).ok());
    }
}
