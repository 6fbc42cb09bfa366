//! Metrics and traces of a controller's I/O queues, for the control socket.

use std::sync::Arc;
use std::time::Duration;

use trace::{Mailbox, QueueSnapshot, TraceControl};

use crate::ctrl::{Place, State};
use crate::io::QueueGroup;
use crate::Controller;

impl State {
    /// Keeps the totals, metrics and trace data of a group being deleted.
    pub(crate) fn retire(&mut self, g: &QueueGroup) {
        self.retired.add(&g.out.counters());
        let snap = g.out.rec.snapshot();
        let epoch = snap.trace.epoch;
        match self.retired_queues.get_mut(&snap.queue) {
            Some(old) => old.absorb(&snap, epoch),
            None => {
                self.retired_queues.insert(snap.queue, snap);
            }
        }
    }
}

impl Controller {
    /// The trace switch of all this controller's I/O queues
    /// ([`TraceControl::start`] / [`TraceControl::stop`]).
    pub fn trace_control(&self) -> Arc<TraceControl> {
        self.inner.shared.trace.clone()
    }

    /// Starts a trace of one request in `sample_every` on every I/O queue (dropping
    /// the previous trace's layer data) and returns once running queues applied it.
    pub fn trace_start(&self, sample_every: u32, timeout: Duration) {
        self.inner.shared.trace.start(sample_every);
        let _ = self.queue_stats(timeout);
    }

    /// Stops tracing and returns once running queues applied it; the data stays.
    pub fn trace_stop(&self, timeout: Duration) {
        self.inner.shared.trace.stop();
        let _ = self.queue_stats(timeout);
    }

    /// Metrics and trace histograms of every I/O queue group (one per completion
    /// queue, including deleted ones), ordered by CQ id. Running groups answer
    /// through their mailbox at the end of their next poll; a group that does not
    /// answer within `timeout` (its reactor is gone) is left out.
    pub fn queue_stats(&self, timeout: Duration) -> Vec<QueueSnapshot> {
        let mut live = Vec::new();
        let mut boxes: Vec<Arc<Mailbox>> = Vec::new();
        let retired: Vec<QueueSnapshot> = {
            let st = self.inner.lock();
            for e in st.groups.values() {
                match &e.place {
                    Place::Parked(g) => live.push(g.out.rec.snapshot()),
                    Place::Running { .. } => boxes.push(e.mailbox.clone()),
                    Place::Out => {}
                }
            }
            st.retired_queues.values().cloned().collect()
        };
        let refs: Vec<&Mailbox> = boxes.iter().map(|b| b.as_ref()).collect();
        live.extend(Mailbox::collect(&refs, timeout));
        let epoch = self.inner.shared.trace.settings().epoch;
        let mut out = retired;
        for q in live {
            match out.iter_mut().find(|o| o.queue == q.queue) {
                Some(o) => o.absorb(&q, epoch),
                None => out.push(q),
            }
        }
        // Layer data of an earlier trace is not part of the current one.
        for q in out.iter_mut() {
            if q.trace.epoch != epoch {
                q.clear_trace();
            }
        }
        out.sort_by_key(|q| q.queue);
        out
    }
}
