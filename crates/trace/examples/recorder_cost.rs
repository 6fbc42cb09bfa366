//! Cost per request of the recorder alone (no device): batches of 32 requests,
//! tracing off, every request traced and 1 in 16, plus the raw clock read, and
//! every request traced with synthetic stamps (no clock reads per request: the
//! recording alone, less noisy on a loaded machine than the clock).
//!   cargo run --release -p trace --example recorder_cost

use std::sync::Arc;
use std::time::Instant;

use trace::{clock, OpClass, QueueRecorder, Stamps, TraceControl};

fn run(rec: &mut QueueRecorder, batches: u64, synthetic: bool) -> f64 {
    let t = Instant::now();
    for _ in 0..batches {
        rec.begin_poll();
        let kick = rec.kick();
        for _ in 0..32 {
            let k = rec.sample(kick);
            let (submitted, completed) = if synthetic {
                (k + 300, k + 310)
            } else {
                (QueueRecorder::stamp(k), QueueRecorder::stamp(k))
            };
            let s = Stamps {
                kick: k,
                submitted,
                completed,
            };
            rec.complete(1, OpClass::Read, 4096, 0, std::hint::black_box(s));
        }
        rec.depth(32);
        let p = match (rec.has_finished(), synthetic) {
            (false, _) => 0,
            (true, false) => clock::now(),
            (true, true) => kick + 400,
        };
        rec.end_poll(p, p);
    }
    t.elapsed().as_nanos() as f64 / (batches * 32) as f64
}

fn main() {
    let ctl = Arc::new(TraceControl::default());
    let mut rec = QueueRecorder::new(1, 1, 64, ctl.clone());
    let n = 200_000;
    for _ in 0..3 {
        ctl.stop();
        let off = run(&mut rec, n, false);
        ctl.start(1);
        let on = run(&mut rec, n, false);
        let rec_only = run(&mut rec, n, true);
        ctl.start(16);
        let s16 = run(&mut rec, n, false);
        let t = Instant::now();
        let mut x = 0u64;
        for _ in 0..n * 32 {
            x = x.wrapping_add(clock::now());
        }
        let c = t.elapsed().as_nanos() as f64 / (n * 32) as f64;
        println!(
            "per request: off {off:.1} ns, every request traced {on:.1} ns, 1 in 16 {s16:.1} ns; \
             clock read {c:.1} ns; traced with synthetic stamps {rec_only:.1} ns ({})",
            x & 1
        );
    }
}
