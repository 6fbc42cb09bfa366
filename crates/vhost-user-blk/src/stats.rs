//! Counters and traces of a device's virtqueues, for the control socket. Each
//! queue's poller owns its `trace::QueueRecorder`; readers reach it through the
//! queue's mailbox (docs/decisions/0007-tracing.md).

use std::sync::Arc;
use std::time::{Duration, Instant};

use trace::{QueueSnapshot, TraceControl};

use crate::VhostUserBlk;

impl VhostUserBlk {
    /// The trace switch of all this device's virtqueues.
    pub fn trace_control(&self) -> Arc<TraceControl> {
        self.trace.clone()
    }

    /// Starts a trace of one request in `sample_every` on every virtqueue (dropping
    /// the previous trace's layer data); returns once the queues applied it.
    pub fn trace_start(&self, sample_every: u32, timeout: Duration) {
        self.trace.start(sample_every);
        let _ = self.queue_stats(timeout);
    }

    /// Stops tracing and returns once the queues applied it; the data stays.
    pub fn trace_stop(&self, timeout: Duration) {
        self.trace.stop();
        let _ = self.queue_stats(timeout);
    }

    /// Counters and trace histograms of every virtqueue, in queue order (queue ids
    /// are virtqueue indexes, from 0). The disk's counters are under namespace
    /// [`virtio_blk::DISK_NSID`]. Pollers answer at the end of their next poll; a
    /// sleeping reactor (adaptive/event polling) is woken for it. A queue that does
    /// not answer within `timeout` is left out.
    pub fn queue_stats(&self, timeout: Duration) -> Vec<QueueSnapshot> {
        for b in &self.mailboxes {
            let _ = b.take();
            b.request();
        }
        let start = Instant::now();
        let mut out: Vec<Option<QueueSnapshot>> = self.mailboxes.iter().map(|_| None).collect();
        loop {
            let queues = self.mailboxes.iter().zip(&self.shared.queues);
            for ((b, q), o) in queues.zip(out.iter_mut()) {
                if o.is_none() {
                    *o = b.take();
                    // One atomic swap while the reactor is awake.
                    q.waker.load().wake();
                }
            }
            if out.iter().all(Option::is_some) || start.elapsed() >= timeout {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let epoch = self.trace.settings().epoch;
        let mut out: Vec<QueueSnapshot> = out.into_iter().flatten().collect();
        // Layer data of an earlier trace is not part of the current one.
        for q in out.iter_mut() {
            if q.trace.epoch != epoch {
                q.clear_trace();
            }
        }
        out
    }
}
