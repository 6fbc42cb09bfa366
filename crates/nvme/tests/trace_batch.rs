//! Layer stamps of a batch of commands: the controller parses a doorbell's batch of
//! reads/writes before submitting it, and one clock read between two submits is
//! both the earlier command's "completed" and the later one's "submitted" stamp.
//! With a backend that spends a long time inside each (inline) submit, every
//! command's `backend` layer must be its own submit call only, and the waiting for
//! the submits before it must show in its `queue` layer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bdev::{BlockDevice, BlockInfo, IoChannel, IoRequest, IoStatus, RamDisk};
use frontend_core::Observed;
use test_support::layers::{assert_add_up, layer_p50};
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;
use test_support::T;
use trace::Breakdown;

/// Time each submit takes.
const SLOW: Duration = Duration::from_micros(200);
const N: usize = 16;

struct Slow(RamDisk);
struct SlowChan(Box<dyn IoChannel>);

impl BlockDevice for Slow {
    fn describe(&self) -> String {
        "slow".into()
    }
    fn info(&self) -> &BlockInfo {
        self.0.info()
    }
    fn channel(&self) -> std::io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(SlowChan(self.0.channel()?)))
    }
}

impl IoChannel for SlowChan {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        let t = Instant::now();
        while t.elapsed() < SLOW {
            std::hint::spin_loop();
        }
        self.0.submit(tag, req)
    }
}

#[test]
fn each_command_of_a_batch_has_only_its_own_submit_in_backend() {
    let disk: Arc<dyn BlockDevice> = Arc::new(Slow(RamDisk::new(16 << 20, 4096).unwrap()));
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![disk]);
    h.ready(true);
    h.ctrl.trace_start(1, T);
    let buf = h.alloc(N as u64);
    let cmds: Vec<Sqe> = (0..N as u64)
        .map(|i| rw(2, 1, i, 1, buf + i * 4096, 0))
        .collect();
    let mut cids = h.submit_batch(1, &cmds);
    let mut got: Vec<u16> = (0..N)
        .map(|_| {
            let c = h.reap(1);
            assert!(c.ok(), "{c:?}");
            c.cid
        })
        .collect();
    h.ctrl.trace_stop(T);
    got.sort_unstable();
    cids.sort_unstable();
    assert_eq!(got, cids);

    let b = Breakdown::from_queues(&h.ctrl.queue_stats(T));
    let count = b.op("read").and_then(|o| o.row("total")).map(|r| r.count);
    assert_eq!(count, Some(N as u64), "{b}");
    // Medians: a submit preempted on a busy machine makes its own backend sample
    // long (and the queue samples after it); most are not, and each queue sample
    // holds at least the spins before it.
    let (queue, backend) = (
        layer_p50(&b, "read", "queue"),
        layer_p50(&b, "read", "backend"),
    );
    let slow = SLOW.as_nanos() as u64;
    assert!(backend >= slow * 98 / 100, "backend p50 {backend} ns\n{b}");
    // Command k waited for k submits before its own: the queue layer's median is
    // about N / 2 submits, the backend layer's one. Had a command's stamps taken in
    // the submits of others, backend would be the larger one.
    assert!(
        queue > 3 * backend,
        "queue p50 {queue} ns vs backend p50 {backend} ns\n{b}"
    );
    assert_add_up(&b, "read", &trace::LAYERS);
}
