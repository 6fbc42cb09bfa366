//! Cost of wrapping a namespace in an unlimited `QosDisk` (every namespace is, so
//! `set_qos` can limit it at run time): ns per submit, direct vs wrapped, best of 20.
//! `cargo run --release -p bdev --example qos_passthrough`
use bdev::{BlockDevice, IoOp, IoRequest, NullDisk, QosDisk, QosLimits};
use std::sync::Arc;
use std::time::Instant;

fn run(dev: &dyn BlockDevice, n: u64) -> f64 {
    let mut ch = dev.channel().unwrap();
    let req = IoRequest {
        op: IoOp::Flush,
        offset: 0,
        len: 0,
        iov: &[],
        fua: false,
    };
    let t = Instant::now();
    for i in 0..n {
        std::hint::black_box(ch.submit(i, std::hint::black_box(&req)));
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

fn main() {
    let null: Arc<dyn BlockDevice> = Arc::new(NullDisk::new(1 << 30, 512).unwrap());
    let qos = QosDisk::new(null.clone(), QosLimits::default()).unwrap();
    let (mut a, mut b) = (f64::MAX, f64::MAX);
    for _ in 0..20 {
        a = a.min(run(null.as_ref(), 2_000_000));
        b = b.min(run(&qos, 2_000_000));
    }
    println!(
        "null direct: {a:.2} ns/submit, through unlimited QosDisk: {b:.2} ns/submit, +{:.2} ns",
        b - a
    );
}
