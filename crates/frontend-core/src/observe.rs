//! The control side: trace start/stop and snapshot collection, the same for every
//! front end. A device implements [`Observed`] (its trace switch and how to reach
//! its queues' mailboxes); `get_stats`, Prometheus, `udrive trace` and the RPC
//! methods use nothing else.

use std::sync::Arc;
use std::time::Duration;

use trace::{Mailbox, QueueSnapshot, TraceControl};

/// How often a reader looks for answers while it waits.
const PAUSE: Duration = Duration::from_micros(200);

/// Asks every mailbox for a snapshot and waits up to `timeout` for the answers.
/// `wake(i)` is called for queue `i` each round it has not answered (a reactor that
/// sleeps in adaptive/event mode would not poll, hence not answer); it costs a
/// reactor that is awake one atomic swap. A queue that does not answer in time
/// (its reactor is stuck or gone) is left out; the rest come in mailbox order.
pub fn collect(
    boxes: &[&Mailbox],
    timeout: Duration,
    mut wake: impl FnMut(usize),
) -> Vec<QueueSnapshot> {
    for b in boxes {
        let _ = b.take();
        b.request();
    }
    let mut out: Vec<Option<QueueSnapshot>> = boxes.iter().map(|_| None).collect();
    engine::wait_until(timeout, PAUSE, || {
        let mut all = true;
        for (i, (b, o)) in boxes.iter().zip(out.iter_mut()).enumerate() {
            if o.is_none() {
                *o = b.take();
                if o.is_none() {
                    wake(i);
                    all = false;
                }
            }
        }
        all
    });
    out.into_iter().flatten().collect()
}

/// Drops the layer data of queues that belong to an earlier trace than `epoch`
/// (the device's current one) and orders the queues by id.
pub fn current_trace(queues: &mut [QueueSnapshot], epoch: u32) {
    for q in queues.iter_mut() {
        if q.trace.epoch != epoch {
            q.clear_trace();
        }
    }
    queues.sort_by_key(|q| q.queue);
}

/// A device whose queues count and trace requests. Implementing the two required
/// methods gives a front end trace start/stop, and through udrive's control plane
/// `get_stats`, Prometheus metrics and `udrive trace`.
pub trait Observed {
    /// The trace switch all the device's queues share.
    fn trace_control(&self) -> &TraceControl;

    /// Every queue's snapshot (for NVMe including deleted queues), ordered by
    /// queue id, with layer data only of the current trace; queues that do not
    /// answer within `timeout` are left out.
    fn queue_stats(&self, timeout: Duration) -> Vec<QueueSnapshot>;

    /// Starts a trace of one request in `sample_every` (dropping the previous
    /// trace's layer data) and returns once running queues applied it.
    fn trace_start(&self, sample_every: u32, timeout: Duration) {
        self.trace_control().start(sample_every);
        let _ = self.queue_stats(timeout);
    }

    /// Stops tracing and returns once running queues applied it; the data stays.
    fn trace_stop(&self, timeout: Duration) {
        self.trace_control().stop();
        let _ = self.queue_stats(timeout);
    }
}

/// The queues of a simple front end (every queue alive as long as the device,
/// reachable by mailbox, optionally on a reactor that may sleep): enough to
/// implement [`Observed`] by delegation.
#[derive(Default)]
pub struct Queues {
    ctl: Arc<TraceControl>,
    queues: Vec<(Arc<Mailbox>, Option<engine::Waker>)>,
}

impl Queues {
    /// Queues sharing the trace switch `ctl` (give each queue's
    /// [`crate::QueueCore`] the same one).
    pub fn new(ctl: Arc<TraceControl>) -> Queues {
        Queues {
            ctl,
            queues: Vec::new(),
        }
    }

    /// The trace switch, for new queues.
    pub fn control(&self) -> Arc<TraceControl> {
        self.ctl.clone()
    }

    /// Adds a queue by its mailbox, with the waker of its reactor if that may sleep.
    pub fn add(&mut self, mailbox: Arc<Mailbox>, waker: Option<engine::Waker>) {
        self.queues.push((mailbox, waker));
    }
}

impl Observed for Queues {
    fn trace_control(&self) -> &TraceControl {
        &self.ctl
    }

    fn queue_stats(&self, timeout: Duration) -> Vec<QueueSnapshot> {
        let boxes: Vec<&Mailbox> = self.queues.iter().map(|(b, _)| b.as_ref()).collect();
        let mut out = collect(&boxes, timeout, |i| {
            if let Some(w) = &self.queues[i].1 {
                w.wake();
            }
        });
        current_trace(&mut out, self.ctl.settings().epoch);
        out
    }
}
