//! Cost per request of the recorder alone (no device), in batches of 1 (QD1) and
//! 32 requests: tracing off, every request traced with the stamps a device takes
//! (kick per batch, then two clock reads per request, or one when the read after a
//! request's submit is also the next one's "submitted" stamp), 1 in 16, the raw
//! clock read, and every request traced with synthetic stamps (no clock reads: the
//! recording alone; the layer times vary around 256 ticks like real ones, so a
//! mispredicted branch on them would show).
//!
//! Each figure is the minimum over ROUNDS short rounds of N requests (default 300
//! of 64 Ki, a few ms each): on a machine shared with other work, short rounds
//! often run undisturbed, so the minimum moves far less than the mean.
//!   cargo run --release -p trace --example recorder_cost [-- ROUNDS [N]]

use std::sync::Arc;
use std::time::Instant;

use trace::{clock, OpClass, QueueRecorder, Stamps, TraceControl};

#[derive(Clone, Copy, PartialEq)]
enum Stamping {
    /// Two clock reads per request, around its submit.
    TwoReads,
    /// One clock read per request: the read after request i's submit is request
    /// i+1's "submitted" stamp (commands parsed before the batch is submitted).
    Chained,
    /// No clock reads at all.
    Synthetic,
}

/// Pseudo-random layer times between ~60 and ~600 ticks.
fn jitter(i: u64) -> u64 {
    60 + (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 55)
}

fn run(rec: &mut QueueRecorder, batches: u64, batch: u64, how: Stamping) -> f64 {
    let t = Instant::now();
    let mut seq = 0u64;
    for _ in 0..batches {
        rec.begin_poll();
        let kick = rec.kick();
        let mut prev = QueueRecorder::stamp(if how == Stamping::Chained { kick } else { 0 });
        for _ in 0..batch {
            seq += 1;
            let k = rec.sample(kick);
            let (submitted, completed) = match how {
                Stamping::TwoReads => (QueueRecorder::stamp(k), QueueRecorder::stamp(k)),
                Stamping::Chained => {
                    let done = QueueRecorder::stamp(k);
                    let s = prev;
                    prev = done;
                    (if k == 0 { 0 } else { s }, done)
                }
                Stamping::Synthetic => {
                    let s = k + jitter(seq);
                    (s, s + jitter(seq + 7))
                }
            };
            let s = Stamps {
                kick: k,
                submitted,
                completed,
            };
            rec.complete(1, OpClass::Read, 4096, 0, std::hint::black_box(s));
        }
        rec.depth(batch as u32);
        let p = match (rec.has_finished(), how) {
            (false, _) => 0,
            (true, Stamping::Synthetic) => kick + 2000 + jitter(seq),
            (true, _) => clock::now(),
        };
        rec.end_poll(p, p);
    }
    t.elapsed().as_nanos() as f64 / (batches * batch) as f64
}

fn main() {
    let arg = |i: usize, default: u64| {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let rounds = arg(1, 300);
    let n = arg(2, 1 << 16);
    let ctl = Arc::new(TraceControl::default());
    let mut rec = QueueRecorder::new(1, 1, 64, ctl.clone());
    for batch in [1u64, 32] {
        let mut best = [f64::MAX; 6];
        for _ in 0..rounds {
            let b = n / batch;
            ctl.stop();
            let off = run(&mut rec, b, batch, Stamping::Synthetic);
            ctl.start(1);
            let two = run(&mut rec, b, batch, Stamping::TwoReads);
            let chained = run(&mut rec, b, batch, Stamping::Chained);
            let synthetic = run(&mut rec, b, batch, Stamping::Synthetic);
            ctl.start(16);
            let s16 = run(&mut rec, b, batch, Stamping::TwoReads);
            let t = Instant::now();
            let mut x = 0u64;
            for _ in 0..n {
                x = x.wrapping_add(clock::now());
            }
            std::hint::black_box(x);
            let c = t.elapsed().as_nanos() as f64 / n as f64;
            for (m, v) in best.iter_mut().zip([off, two, chained, synthetic, s16, c]) {
                *m = m.min(v);
            }
        }
        let [off, two, chained, synthetic, s16, c] = best;
        println!(
            "batch {batch:2}, ns per request (min of {rounds}): off {off:.1}, every request: \
             two reads {two:.1}, chained {chained:.1}, synthetic stamps {synthetic:.1}; \
             1 in 16 {s16:.1}; clock read {c:.1}"
        );
    }
}
