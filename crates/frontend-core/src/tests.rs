//! A toy front end on the core: counts once, traces, answers readers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bdev::{IoOp, IoStatus};
use trace::{OpClass, Stamps, TraceControl};

use crate::{Observed, Protocol, QueueCore, Queues, Refusal};

struct Toy;

const OK: u8 = 0;
const IOERR: u8 = 1;
const RO: u8 = 2;

impl Protocol for Toy {
    type Status = u8;
    const OK: u8 = OK;
    fn from_io(st: IoStatus, _op: IoOp) -> u8 {
        match st {
            IoStatus::Ok => OK,
            IoStatus::ReadOnly => RO,
            _ => IOERR,
        }
    }
    fn refused(r: Refusal) -> u8 {
        match r {
            Refusal::ReadOnly => RO,
            _ => IOERR,
        }
    }
    fn code(s: u8) -> u16 {
        u16::from(s)
    }
}

fn one_poll(q: &mut QueueCore<Toy>, reqs: &[(OpClass, u64, u8)], signalled: &mut u32) {
    q.begin_poll();
    let kick = q.kick();
    for &(op, bytes, st) in reqs {
        let k = q.sample(kick);
        let s = Stamps {
            kick: k,
            submitted: QueueCore::<Toy>::stamp(k),
            completed: QueueCore::<Toy>::stamp(k),
        };
        q.complete(1, op, bytes, st, s);
    }
    q.depth(reqs.len() as u32);
    q.end_poll(0, || {
        *signalled += 1;
        !reqs.is_empty()
    });
}

#[test]
fn counts_each_completion_once() {
    let ctl = Arc::new(TraceControl::default());
    let mut q = QueueCore::<Toy>::new(3, 1, 16, ctl);
    let counters = q.counters();
    let mut sig = 0;
    one_poll(
        &mut q,
        &[
            (OpClass::Read, 4096, OK),
            (OpClass::Write, 512, OK),
            (OpClass::Write, 512, Toy::refused(Refusal::ReadOnly)),
            (
                OpClass::Flush,
                0,
                Toy::from_io(IoStatus::IoError, IoOp::Flush),
            ),
        ],
        &mut sig,
    );
    one_poll(&mut q, &[], &mut sig);
    assert_eq!(sig, 2, "signal asked once per poll");
    let t = counters.totals();
    assert_eq!(
        (t.ops.read, t.ops.write, t.ops.flush, t.ops.other),
        (1, 2, 1, 0)
    );
    assert_eq!((t.bytes.read, t.bytes.write, t.bytes.flush), (4096, 512, 0));
    assert_eq!(t.errors, 2);
    assert_eq!(q.error_count(1, RO), 1);
    assert_eq!(q.error_count(1, IOERR), 1);
    let s = q.snapshot();
    assert_eq!(s.queue, 3);
    let ns = s.namespaces.iter().find(|n| n.nsid == 1).unwrap();
    assert_eq!(ns.ops, t.ops);
    assert_eq!(ns.bytes, t.bytes);
    assert_eq!(ns.errors.iter().map(|e| e.count).sum::<u64>(), t.errors);
    assert!(ns.layers.is_empty(), "not traced");
}

/// A device of two queues on their own "reactor" threads, read through
/// `Observed`: start, read, stop.
#[test]
fn toy_device_traces_and_reports_through_observed() {
    let ctl = Arc::new(TraceControl::default());
    let mut dev = Queues::new(ctl.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for id in 0..2u16 {
        let mut q = QueueCore::<Toy>::new(id, 1, 16, dev.control());
        dev.add(q.mailbox(), None);
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut sig = 0;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                one_poll(&mut q, &[(OpClass::Read, 4096, OK)], &mut sig);
                n += 1;
                std::thread::sleep(Duration::from_micros(50));
            }
            (n, q.counters().totals().ops.read)
        }));
    }
    let t = Duration::from_secs(10);
    dev.trace_start(1, t);
    assert!(ctl.settings().enabled);
    let stats = dev.queue_stats(t);
    assert_eq!(stats.iter().map(|q| q.queue).collect::<Vec<_>>(), [0, 1]);
    for q in &stats {
        assert!(q.trace.enabled);
        let ns = q.namespaces.iter().find(|n| n.nsid == 1).unwrap();
        let read = ns.layers.iter().find(|l| l.op == "read").unwrap();
        let total = &read.layers.last().unwrap().1;
        assert!(total.count > 0, "traced after start");
        assert!(total.count <= ns.ops.read);
    }
    dev.trace_stop(t);
    assert!(!ctl.settings().enabled);
    let after = dev.queue_stats(t);
    stop.store(true, Ordering::Relaxed);
    for (th, q) in threads.into_iter().zip(&after) {
        let (polls, counted) = th.join().unwrap();
        assert_eq!(polls, counted, "one count per completion");
        let ns = q.namespaces.iter().find(|n| n.nsid == 1).unwrap();
        assert!(ns.ops.read <= counted);
        assert!(!ns.layers.is_empty(), "data stays after stop");
    }
}

#[test]
fn a_queue_that_does_not_answer_is_left_out() {
    let ctl = Arc::new(TraceControl::default());
    let mut dev = Queues::new(ctl.clone());
    let q = QueueCore::<Toy>::new(0, 1, 16, ctl);
    dev.add(q.mailbox(), None);
    let t0 = std::time::Instant::now();
    assert!(dev.queue_stats(Duration::from_millis(20)).is_empty());
    assert!(t0.elapsed() >= Duration::from_millis(20));
}
