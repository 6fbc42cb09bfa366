//! Handing a running NVMe controller over to another one under a client
//! that keeps doing verified I/O on its existing queues: pause, save, JSON,
//! restore into a second controller over the same guest memory and doorbell page,
//! switch the transport, shut the old one down. The client must not notice more
//! than a pause: no reset, no request lost or completed twice, every byte right.
//!
//! The rig (handover_rig/) is a vfio-user server whose device model is a switch.

mod common;
mod handover_rig;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use engine::PollMode;
use handover_rig::*;

#[test]
fn handovers_busy_mapped_doorbells() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(false)));
    assert!(d.doorbells_mapped());
    assert!(!d.shadow_doorbells());
    handovers_under_io(&rig, &d, 50, 1);
}

#[test]
fn handovers_busy_shadow_doorbells() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(true)));
    assert!(d.shadow_doorbells());
    handovers_under_io(&rig, &d, 50, 2);
    assert!(rig.ctrl().stats().doorbell_buffer_configured);
}

/// Doorbells by message and shadow doorbells (as a Linux guest drives `adaptive`);
/// an Asynchronous Event Request posted to the first controller is completed by
/// the last one.
#[test]
fn handovers_adaptive_with_outstanding_aer() {
    let rig = Rig::start(PollMode::Adaptive);
    let mut d = rig.connect(opts(None));
    assert!(!d.doorbells_mapped());
    assert!(d.shadow_doorbells());
    d.enable_ns_events().expect("enable namespace events");
    handovers_under_io(&rig, &d, 50, 3);
    // A namespace arrives: the AER the client posted long ago reports it.
    let ns2 = ram(1 << 20);
    rig.namespaces.lock().unwrap().push(Some(ns2.clone()));
    rig.ctrl().add_namespace(2, ns2).expect("add namespace");
    rig.handover();
    let ev = d.wait_event(Duration::from_secs(5)).expect("event");
    assert!(ev.is_namespace_change(), "{ev:?}");
    // The Changed Namespace List moved over too.
    assert_eq!(d.rescan_namespaces().expect("rescan"), vec![2]);
    handovers_under_io(&rig, &d, 5, 4);
}

/// Every doorbell a message (no shadow doorbells) and groups that sleep whenever
/// idle: a restored group must still be woken by the next doorbell.
#[test]
fn handovers_event_mode_every_doorbell_a_message() {
    let rig = Rig::start(PollMode::Event);
    let d = rig.connect(opts(Some(false)));
    assert!(!d.doorbells_mapped());
    assert!(!d.shadow_doorbells());
    handovers_under_io(&rig, &d, 50, 5);
    // Idle, then one command at a time: each must wake a sleeping group.
    std::thread::sleep(Duration::from_millis(50));
    let mut qp = d.create_qpair(8, false).expect("queue pair");
    for i in 0..20 {
        rig.handover();
        std::thread::sleep(Duration::from_millis(2));
        common::qp_still_works(&mut qp, 2000 + i, i);
    }
}

/// Pause and unpause (and a save that is rolled back) under I/O: nothing is
/// fetched while paused, and everything goes on afterwards.
#[test]
fn pause_rollback_under_io() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(false)));
    let mut qps = qpairs(&d);
    let stop = AtomicBool::new(false);
    let progress = AtomicU64::new(0);
    let done = std::thread::scope(|s| {
        let io = s.spawn(|| verified_io(&mut qps, &stop, &progress, 7));
        for i in 0..20 {
            let p = progress.load(Ordering::Relaxed);
            while progress.load(Ordering::Relaxed) < p + 200 {
                assert!(!io.is_finished(), "the I/O thread stopped");
                std::thread::sleep(Duration::from_millis(1));
            }
            let ctrl = rig.ctrl();
            ctrl.pause(Duration::from_secs(5)).expect("pause");
            // Completions posted by the pause may still reach the client; the
            // controller's own counters must not move.
            let before = ctrl.stats();
            std::thread::sleep(Duration::from_millis(5));
            if i % 2 == 1 {
                let st = ctrl.save().expect("save");
                assert_eq!(st.sqs.len(), QUEUES);
            }
            let after = ctrl.stats();
            assert_eq!(
                (before.reads, before.writes),
                (after.reads, after.writes),
                "commands ran while paused"
            );
            ctrl.resume();
        }
        stop.store(true, Ordering::Relaxed);
        io.join().expect("I/O thread")
    });
    assert!(done.reads > 0);
    assert!(!rig.ctrl().stats().fatal);
}

/// The Keep Alive Timer stops during the pause (a pause longer than KATO is no
/// timeout) and moves over: without Keep Alive commands the last controller still
/// fails after KATO. KATO is 1 s, far beyond what a busy machine delays a Keep
/// Alive by. (Not beside handover_refusals.rs's slow pause: a pause holds its
/// controller's lock while it waits for the backend, and the process's one
/// nvme-admin thread, which runs every controller's Keep Alive timer, can wait on
/// that lock.)
#[test]
fn keep_alive_timer_moves_over() {
    use initiator::cmd::opc;
    use initiator::Sqe;
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(false)));
    let ok = |sqe: Sqe, what: &str| {
        let c = d.admin(sqe).expect(what);
        assert!(c.status.is_ok(), "{what}: {}", c.status);
    };
    ok(Sqe::set_features(0x0f, 1000), "set KATO 1 s");
    for _ in 0..3 {
        ok(Sqe::new(opc::KEEP_ALIVE), "keep alive");
        rig.handover_with_pause(Duration::from_millis(1500));
        ok(Sqe::new(opc::KEEP_ALIVE), "keep alive after a long pause");
        assert!(!rig.ctrl().stats().fatal);
    }
    common::wait_until("keep alive timeout", Duration::from_secs(5), || {
        rig.ctrl().stats().fatal
    });
}
