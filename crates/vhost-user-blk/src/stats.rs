//! Counters and traces of a device's virtqueues, for the control socket, through
//! the front-end core like every front end. Each queue's poller owns its
//! `frontend_core::QueueCore`; readers reach it through the queue's mailbox
//! (docs/decisions/0007-tracing.md, 0015-front-end-core.md).

use std::time::Duration;

use frontend_core::Observed;
use trace::{Mailbox, QueueSnapshot, TraceControl};

use crate::VhostUserBlk;

impl Observed for VhostUserBlk {
    fn trace_control(&self) -> &TraceControl {
        &self.trace
    }

    /// Counters and trace histograms of every virtqueue, in queue order (queue ids
    /// are virtqueue indexes, from 0). The disk's counters are under namespace
    /// [`virtio_blk::DISK_NSID`]. Pollers answer at the end of their next poll; a
    /// sleeping reactor (adaptive/event polling) is woken for it. A queue that does
    /// not answer within `timeout` is left out.
    fn queue_stats(&self, timeout: Duration) -> Vec<QueueSnapshot> {
        let boxes: Vec<&Mailbox> = self.mailboxes.iter().map(|b| b.as_ref()).collect();
        let mut out = frontend_core::collect(&boxes, timeout, |i| {
            if let Some(q) = self.shared.queues.get(i) {
                q.waker.load().wake();
            }
        });
        frontend_core::current_trace(&mut out, self.trace.settings().epoch);
        out
    }
}
