//! Decision 0029 for virtio: with at least `engine::DEFER_QUEUE` requests in flight
//! on a slow backend, an adaptive vhost-user-blk queue sleeps without asking the
//! guest to kick (avail_event one behind with EVENT_IDX, VRING_USED_F_NO_NOTIFY
//! without); a request the guest adds meanwhile waits in the avail ring until the
//! next completion wakes the queue. Below the threshold the queue asks for kicks
//! before it sleeps, as before.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bdev::BlockDevice;
use engine::{Engine, PollMode, DEFER_QUEUE};
use guest_mem::SharedMem;
use test_support::held::{HeldDisk, HeldGate};
use test_support::vhost_fe::*;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_blk::{BlkDeviceOptions, VhostUserBlk};

struct Setup {
    engine: Arc<Engine>,
    gate: Arc<HeldGate>,
    dev: Option<VhostUserBlk>,
    r: FakeFrontend,
}

/// An adaptive vhost-user-blk device on `disk` with a reactor of its own (no other
/// test's poller keeps it awake), and a raw driver connected to it.
fn start_device(
    sock: &Path,
    disk: Arc<dyn BlockDevice>,
    event_idx: bool,
) -> (Arc<Engine>, VhostUserBlk, FakeFrontend) {
    let engine = Engine::start(&[None]).unwrap();
    let opts = BlkDeviceOptions {
        poll: PollMode::Adaptive,
        ..Default::default()
    };
    let dev = VhostUserBlk::start(sock, disk, opts, &engine, &[0]).unwrap();
    let extra = if event_idx {
        virtio_blk::features::EVENT_IDX
    } else {
        0
    };
    let mem = SharedMem::new("deferred-kicks", MEM).unwrap();
    let r = FakeFrontend::connect_with(
        sock,
        Connect {
            protocol: VhostUserProtocolFeatures::CONFIG,
            virtio: extra,
            ..Connect::new(mem)
        },
    );
    (engine, dev, r)
}

impl Setup {
    fn start(sock: &Path, event_idx: bool) -> Setup {
        let (disk, gate) = HeldDisk::new(1 << 20, 512).unwrap();
        let (engine, dev, r) = start_device(sock, Arc::new(disk), event_idx);
        Setup {
            engine,
            gate,
            dev: Some(dev),
            r,
        }
    }

    fn sleeps(&self) -> u64 {
        common::sleeps_on(&self.engine, 0)
    }

    /// Queues a 4 KiB read of its own; kicks only if the device asked for it.
    fn read(&mut self, i: u64) -> bool {
        read(&mut self.r, i)
    }

    /// Waits until the queue sleeps with `n` requests taken by the backend.
    fn asleep_with(&self, n: usize) {
        common::wait_until("the queue took the requests", common::T, || {
            self.gate.submitted() == n
        });
        // Counted from here: a sleep that began before the last request was taken
        // (woken by its kick) says nothing about the queue's state now.
        let before = self.sleeps();
        common::wait_until("the queue went to sleep", common::T, || {
            self.sleeps() > before
        });
    }

    /// Whether the device, asleep, asked the guest to kick for its next request.
    fn asks_for_kicks(&self) -> bool {
        self.r
            .wants_kick(self.r.avail, self.r.avail.wrapping_add(1))
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        // A failed assertion leaves requests held: let them go so the device stops.
        self.gate.release(1 << 20);
        if let Some(dev) = self.dev.take() {
            dev.stop();
        }
        self.engine.shutdown();
    }
}

/// Queues read `i`: 4 KiB of its own (header, buffer, status byte); kicks only if
/// the device asked for it. Returns whether it kicked.
fn read(r: &mut FakeFrontend, i: u64) -> bool {
    let hdr = HDR + 16 * i;
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&T_IN.to_le_bytes());
    h[8..16].copy_from_slice(&(i * 8).to_le_bytes());
    r.put(hdr, &h);
    r.put(STATUSES + i, &[0xff]);
    r.push_polite(&[
        (hdr, 16, false),
        (DATA + 4096 * i, 4096, true),
        (STATUSES + i, 1, true),
    ])
}

fn deep_queue_sleeps_without_kicks(event_idx: bool) {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Setup::start(&dir.path().join("blk.sock"), event_idx);
    let shallow = DEFER_QUEUE - 1;
    for i in 0..shallow as u64 {
        s.read(i);
    }
    s.asleep_with(shallow);
    // Waited for, not sampled: a sleep that reaches its time limit wakes the
    // queue, which polls with kicks off for a moment before it sleeps again.
    common::wait_until(
        "below the threshold the sleeping queue asks for kicks",
        common::T,
        || s.asks_for_kicks(),
    );
    assert!(
        s.read(shallow as u64),
        "the request that deepens the queue kicks"
    );
    s.asleep_with(DEFER_QUEUE);

    // Deep: no kick asked for; the next request stays in the ring meanwhile.
    assert!(
        !s.asks_for_kicks(),
        "deep on a slow backend: kicks deferred"
    );
    if event_idx {
        assert_eq!(s.r.avail_event(), s.r.avail.wrapping_sub(1), "one behind");
    }
    let timeouts = common::sleep_timeouts_on(&s.engine, 0);
    assert!(
        !s.read(DEFER_QUEUE as u64),
        "the guest was told not to kick"
    );
    // Nothing to wait for: give a wrong take time to show. Only a sleep that ran
    // to its 500 ms limit (which a slow run may reach) may have taken it.
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        s.gate.submitted() == DEFER_QUEUE || common::sleep_timeouts_on(&s.engine, 0) > timeouts,
        "taken while nothing woke the queue"
    );

    // A completion wakes the queue, which takes the waiting request.
    s.gate.release(1);
    assert!(s.r.wait_used(1), "the released request completed");
    common::wait_until(
        "the waiting request was taken after the wake-up",
        common::T,
        || s.gate.submitted() == DEFER_QUEUE + 1,
    );
    s.gate.release(DEFER_QUEUE);
    let all = DEFER_QUEUE as u16 + 1;
    assert!(s.r.wait_used(all), "every request completed");
    for i in 0..u64::from(all) {
        assert_eq!(s.r.get(STATUSES + i, 1)[0], 0, "status of read {i}");
    }
    // Shallow again: the queue asks for kicks before it sleeps.
    common::wait_until("the idle queue asks for kicks again", common::T, || {
        s.asks_for_kicks()
    });
}

#[test]
fn with_event_idx_a_deep_slow_queue_sleeps_with_avail_event_behind() {
    deep_queue_sleeps_without_kicks(true);
}

#[test]
fn without_event_idx_a_deep_slow_queue_sleeps_with_no_notify_set() {
    deep_queue_sleeps_without_kicks(false);
}

/// Requests waiting for QoS tokens are as slow as a remote backend's, and a new one
/// queues behind them anyway: with `DEFER_QUEUE` of them held the queue sleeps
/// without asking for kicks, and the timer's wake-up takes what came meanwhile.
#[test]
fn requests_held_for_tokens_defer_kicks() {
    let dir = tempfile::tempdir().unwrap();
    let ram = Arc::new(bdev::RamDisk::new(1 << 20, 512).unwrap());
    // 1 IOPS: one read goes at once (the burst), the next a second later, so the
    // checks below run with DEFER_QUEUE held however slowly this test gets to them.
    let limits = bdev::QosLimits {
        iops: Some(1),
        ..Default::default()
    };
    let qos = Arc::new(bdev::QosDisk::new(ram, limits).unwrap());
    let (engine, dev, mut r) = start_device(&dir.path().join("blk.sock"), qos.clone(), true);
    let n = DEFER_QUEUE as u64 + 1;
    for i in 0..n {
        read(&mut r, i);
    }
    assert!(r.wait_used(1), "the burst completed");
    let sleeps = || common::sleeps_on(&engine, 0);
    // Asleep between two tokens.
    let slept = sleeps();
    common::wait_until(
        "the queue sleeps while reads wait for tokens",
        common::T,
        || sleeps() > slept,
    );
    assert!(
        !r.wants_kick(r.avail, r.avail.wrapping_add(1)),
        "kicks deferred"
    );
    assert!(!read(&mut r, n), "the guest was told not to kick");
    // The limit lifted, the QoS timer wakes the queue (no kick): it takes them all.
    qos.set_limits(bdev::QosLimits::default()).unwrap();
    assert!(
        r.wait_used(n as u16 + 1),
        "the timer's wake-ups took every read"
    );
    for i in 0..=n {
        assert_eq!(r.get(STATUSES + i, 1)[0], 0, "status of read {i}");
    }
    dev.stop();
    engine.shutdown();
}
