//! Metrics and traces of a controller's I/O queues, for the control socket.

use std::sync::Arc;
use std::time::Duration;

use frontend_core::Observed;
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

/// Trace start/stop and snapshots through the front-end core, like every front end.
impl Observed for Controller {
    fn trace_control(&self) -> &TraceControl {
        &self.inner.shared.trace
    }

    /// Metrics and trace histograms of every I/O queue group (one per completion
    /// queue, including deleted ones), ordered by CQ id. Running groups answer
    /// through their mailbox at the end of their next poll (a sleeping reactor is
    /// woken for it); a group that does not answer within `timeout` (its reactor is
    /// gone) is left out.
    fn queue_stats(&self, timeout: Duration) -> Vec<QueueSnapshot> {
        let mut live = Vec::new();
        let mut running: Vec<(Arc<Mailbox>, Option<engine::Waker>)> = Vec::new();
        let retired: Vec<QueueSnapshot> = {
            let st = self.inner.lock();
            for e in st.groups.values() {
                match &e.place {
                    Place::Parked(g) => live.push(g.out.rec.snapshot()),
                    Place::Running { id, .. } => {
                        running.push((e.mailbox.clone(), self.inner.engine.waker(id.reactor)))
                    }
                    Place::Out => {}
                }
            }
            st.retired_queues.values().cloned().collect()
        };
        let refs: Vec<&Mailbox> = running.iter().map(|(b, _)| b.as_ref()).collect();
        live.extend(frontend_core::collect(&refs, timeout, |i| {
            if let Some(w) = &running[i].1 {
                w.wake();
            }
        }));
        let epoch = self.inner.shared.trace.settings().epoch;
        let mut out = retired;
        for q in live {
            match out.iter_mut().find(|o| o.queue == q.queue) {
                Some(o) => o.absorb(&q, epoch),
                None => out.push(q),
            }
        }
        // Layer data of an earlier trace is not part of the current one.
        frontend_core::current_trace(&mut out, epoch);
        out
    }
}
