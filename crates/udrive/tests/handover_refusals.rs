//! The NVMe controller handover's refusals: states it will not save or restore
//! (wrong version, hostile contents), the versioned JSON, and a pause that
//! waits for the backend or times out. The rig is in handover_rig/.

mod common;
mod handover_rig;

use std::sync::Arc;
use std::time::Duration;

use engine::PollMode;
use frontend_core::Observed;
use handover_rig::*;
use initiator::{DataMode, DmaBuf, DriverOpts, IoOp, QueuePair};
use test_support::{wait_until, T};

/// A refused handover leaves the old controller serving: pause refuses a
/// controller whose client's memory moves by DMA messages, save refuses one
/// that is not paused.
#[test]
fn refusals() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(false)));
    let ctrl = rig.ctrl();
    assert!(matches!(ctrl.save(), Err(nvme::SaveError::NotPaused)));
    // Restoring into a controller that is running is refused.
    ctrl.pause(Duration::from_secs(1)).unwrap();
    let st = ctrl.save().unwrap();
    assert!(matches!(
        ctrl.restore(st.clone()),
        Err(nvme::RestoreError::NotFresh)
    ));
    ctrl.resume();
    common::check_io(&d, 11);

    // A client whose memory moves by DMA messages cannot be handed over (yet).
    let rig = Rig::start(PollMode::Adaptive);
    let d = rig.connect(DriverOpts {
        dma_messages: true,
        ..opts(None)
    });
    let ctrl = rig.ctrl();
    assert!(ctrl.dma_messages());
    assert!(matches!(
        ctrl.pause(Duration::from_secs(1)),
        Err(nvme::PauseError::DmaMessages)
    ));
    common::check_io(&d, 13);
}

use nvme::RestoreError as E;
use serde_json::json;

type Check = fn(&E) -> bool;
type Change = Box<dyn Fn(&mut serde_json::Value)>;

fn invalid(e: &E) -> bool {
    matches!(e, E::Invalid(_))
}

fn unmapped(e: &E) -> bool {
    matches!(e, E::Unmapped { .. })
}

fn config(e: &E) -> bool {
    matches!(e, E::Config(_))
}

/// Hostile queue state: ids, sizes, bases, vectors, heads and tails.
fn queue_cases() -> Vec<(&'static str, Change, Check)> {
    vec![
        (
            "unknown version",
            Box::new(|v| v["version"] = json!(2)),
            |e| matches!(e, E::Version(2)),
        ),
        (
            "CQ id 0",
            Box::new(|v| v["cqs"][0]["qid"] = json!(0)),
            invalid,
        ),
        (
            "CQ id too big",
            Box::new(|v| v["cqs"][0]["qid"] = json!(500)),
            invalid,
        ),
        (
            "CQ size 0",
            Box::new(|v| v["cqs"][0]["size"] = json!(0)),
            invalid,
        ),
        (
            "CQ too big",
            Box::new(|v| v["cqs"][0]["size"] = json!(65535)),
            invalid,
        ),
        (
            "SQ size 0",
            Box::new(|v| v["sqs"][0]["size"] = json!(0)),
            invalid,
        ),
        (
            "CQ base unaligned",
            Box::new(|v| {
                let b = v["cqs"][0]["base"].as_u64().unwrap();
                v["cqs"][0]["base"] = json!(b + 8);
            }),
            invalid,
        ),
        (
            "SQ unmapped",
            Box::new(|v| v["sqs"][0]["base"] = json!(common::UNMAPPED)),
            unmapped,
        ),
        (
            "CQ vector",
            Box::new(|v| v["cqs"][0]["vector"] = json!(9)),
            invalid,
        ),
        (
            "CQ tail",
            Box::new(|v| v["cqs"][0]["tail"] = json!(16)),
            invalid,
        ),
        (
            "SQ head",
            Box::new(|v| v["sqs"][0]["head"] = json!(65535)),
            invalid,
        ),
        (
            "SQ on no CQ",
            Box::new(|v| v["sqs"][0]["cqid"] = json!(7)),
            invalid,
        ),
        (
            "SQ repeated",
            Box::new(|v| {
                let q = v["sqs"][1]["qid"].clone();
                v["sqs"][0]["qid"] = q;
            }),
            invalid,
        ),
    ]
}

/// Hostile controller state: registers, shadow doorbells, features, events,
/// namespaces and limits.
fn controller_cases() -> Vec<(&'static str, Change, Check)> {
    vec![
        (
            "admin SQ head",
            Box::new(|v| v["admin"]["sq_head"] = json!(4095)),
            invalid,
        ),
        (
            "AQA",
            Box::new(|v| v["regs"]["aqa"] = json!(u32::MAX)),
            invalid,
        ),
        (
            "CC",
            Box::new(|v| v["regs"]["cc"] = json!(0x460071)),
            invalid,
        ),
        (
            "ASQ unaligned",
            Box::new(|v| v["regs"]["asq"] = json!(0x1000_0010u64)),
            invalid,
        ),
        (
            "ACQ unmapped",
            Box::new(|v| v["regs"]["acq"] = json!(common::UNMAPPED)),
            unmapped,
        ),
        (
            "shadow unmapped",
            Box::new(|v| v["shadow"]["doorbells"] = json!(common::UNMAPPED)),
            unmapped,
        ),
        (
            "vector config",
            Box::new(|v| v["features"]["no_coalesce"] = json!([])),
            invalid,
        ),
        (
            "queues granted",
            Box::new(|v| v["features"]["queues"] = json!(0xffff_ffffu32)),
            config,
        ),
        (
            "AERs",
            Box::new(|v| v["aer_cids"] = json!([1, 2, 3, 4, 5, 6])),
            invalid,
        ),
        (
            "changed NSID",
            Box::new(|v| v["changed_ns"] = json!([0])),
            invalid,
        ),
        (
            "namespaces",
            Box::new(|v| v["namespaces"] = json!([])),
            config,
        ),
        (
            "LBA size",
            Box::new(|v| v["namespaces"][0]["block_size"] = json!(12345)),
            |e| matches!(e, E::Namespace { .. }),
        ),
        (
            "limits",
            Box::new(|v| v["limits"]["max_io_queues"] = json!(3)),
            config,
        ),
        (
            "queues without admin",
            Box::new(|v| v["admin"] = serde_json::Value::Null),
            invalid,
        ),
    ]
}

/// Corrupt and hostile states: each is refused with an error (no panic), and the
/// controller that refused them is still fresh and takes the good state after.
#[test]
fn hostile_states_are_refused() {
    let rig = Rig::start(PollMode::Busy);
    let d = rig.connect(opts(Some(true)));
    let mut qp = d.create_qpair(16, true).expect("queue pair");
    common::qp_still_works(&mut qp, 10, 1);
    let mut qp2 = d.create_qpair(16, false).expect("queue pair");
    let cur = rig.ctrl();
    cur.pause(Duration::from_secs(1)).unwrap();
    let good = serde_json::to_value(cur.save().unwrap()).unwrap();
    let next = rig.successor(&cur);

    let cases = queue_cases().into_iter().chain(controller_cases());
    for (what, change, expect) in cases {
        let mut v = good.clone();
        change(&mut v);
        let st: nvme::ControllerState = serde_json::from_value(v).expect(what);
        match next.restore(st) {
            Err(e) => assert!(expect(&e), "{what}: unexpected error {e}"),
            Ok(()) => panic!("{what}: hostile state accepted"),
        }
    }
    // What serde refuses never gets that far.
    for change in [
        json!({"extra": 1}),
        json!({"cqs": "x"}),
        json!({"cqs": [{"qid": -1}]}),
        json!({"version": null}),
    ] {
        let mut v = good.clone();
        for (k, x) in change.as_object().unwrap() {
            v[k] = x.clone();
        }
        assert!(serde_json::from_value::<nvme::ControllerState>(v).is_err());
    }
    // Still fresh: the good state goes in, and the client goes on.
    let st: nvme::ControllerState = serde_json::from_value(good).unwrap();
    next.restore(st).expect("restore the good state");
    {
        let mut w = rig.switch.0.write().unwrap();
        let old = std::mem::replace(&mut *w, next);
        drop(w);
        old.shutdown();
    }
    common::qp_still_works(&mut qp, 20, 2);
    common::qp_still_works(&mut qp2, 30, 3);
    common::check_io(&d, 12);
}

/// The state is plain JSON with a version.
#[test]
fn state_is_versioned_json() {
    let rig = Rig::start(PollMode::Adaptive);
    let d = rig.connect(opts(None));
    let _qp = d.create_qpair(32, true).expect("queue pair");
    let ctrl = rig.ctrl();
    ctrl.pause(Duration::from_secs(1)).unwrap();
    let st = ctrl.save().unwrap();
    ctrl.resume();
    assert_eq!(st.version, nvme::STATE_VERSION);
    let v = serde_json::to_value(&st).unwrap();
    for k in [
        "regs",
        "admin",
        "cqs",
        "sqs",
        "features",
        "shadow",
        "aer_cids",
        "error_log",
    ] {
        assert!(v.get(k).is_some(), "{k} missing");
    }
    assert_eq!(st.cqs.len(), 1);
    assert_eq!((st.cqs[0].size, st.sqs[0].size), (32, 32));
    assert!(st.shadow.is_some());
    assert!(!st.doorbells_mapped);
    let back: nvme::ControllerState =
        serde_json::from_str(&serde_json::to_string(&st).unwrap()).expect("round trip");
    assert_eq!(back, st);
}

/// Requests slower than the pause timeout: the pause fails and the controller
/// runs on (they complete, once); with time enough, the pause returns only when
/// their completions are posted.
#[test]
fn pause_waits_for_the_backend_or_times_out() {
    let slow = bdev::FaultDisk::new(
        ram(16 << 20),
        bdev::FaultConfig {
            // Far beyond the 30 ms pause below, whatever delays the test between
            // the submits and that pause.
            latency: Duration::from_secs(1),
            ..Default::default()
        },
    )
    .expect("fault disk");
    let rig = Rig::start_with(PollMode::Busy, Arc::new(slow));
    let d = rig.connect(opts(Some(false)));
    let mut qp = d.create_qpair(16, true).expect("queue pair");
    let bufs: Vec<DmaBuf> = (0..8).map(|_| qp.alloc_buf(BLOCK).unwrap()).collect();
    let submit = |qp: &mut QueuePair| -> Vec<u16> {
        let cids = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| {
                b.fill(i as u8 + 1);
                qp.submit_io(IoOp::Write, 1, i as u64 * 8, 8, Some(b), DataMode::Prp)
                    .unwrap()
            })
            .collect();
        qp.ring().unwrap();
        // Fetched by the (busy) group: all eight at the backend.
        wait_until("the writes at the backend", T, || {
            rig.ctrl()
                .queue_stats(T)
                .iter()
                .map(|q| q.inflight)
                .sum::<u32>()
                == 8
        });
        cids
    };
    let ctrl = rig.ctrl();
    let cids = submit(&mut qp);
    match ctrl.pause(Duration::from_millis(30)) {
        Err(nvme::PauseError::Timeout { requests, .. }) => assert_eq!(requests, 8),
        other => panic!("pause with slow requests: {other:?}"),
    }
    for cid in cids {
        let c = qp.wait(cid, T).expect("completion");
        assert!(c.status.is_ok());
    }
    assert!(qp.poll(16).unwrap().is_empty(), "a completion came twice");
    let cids = submit(&mut qp);
    ctrl.pause(Duration::from_secs(5)).expect("pause");
    // Posted before the pause returned.
    for cid in cids {
        let c = qp
            .try_take(cid)
            .unwrap()
            .expect("completion posted by the pause");
        assert!(c.status.is_ok());
    }
    ctrl.resume();
    rig.handover();
    common::qp_still_works(&mut qp, 100, 1);
    assert!(!rig.ctrl().stats().fatal);
}
