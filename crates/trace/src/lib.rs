//! Tracing and metrics for udrive's devices, independent of any protocol.
//!
//! A device keeps one [`QueueRecorder`] per queue (or queue group) inside the poller
//! that owns the queue, so recording is plain memory writes on one thread: no locks,
//! no atomics read-modify-write, no allocation. Per request the device keeps a
//! [`Stamps`] (three raw clock values) in its request slot; stamps shared by a whole
//! poll batch (doorbell seen, completions posted, interrupt signalled) are taken once
//! per batch.
//!
//! Readers (the control socket, tests, `udrive perf`) ask a queue for a
//! [`QueueSnapshot`] through its [`Mailbox`]: the poller answers at the end of its next
//! poll. See `docs/decisions/0007-tracing.md` for why.
//!
//! Layers, in the order a request crosses them (names are generic so NVMe and
//! virtio-blk devices share them):
//!
//! | layer | from | to |
//! |---|---|---|
//! | `queue` | doorbell/kick observed | request fetched, parsed and submitted to the backend |
//! | `backend` | submitted to the backend | backend completed |
//! | `complete` | backend completed | completion posted to the guest's ring |
//! | `notify` | completion posted | interrupt signalled (0 when the guest polls) |
//! | `total` | doorbell/kick observed | interrupt signalled |

#![forbid(unsafe_code)]

mod breakdown;
pub mod clock;
mod control;
mod counters;
mod hist;
mod layerset;
mod loglimit;
mod prom;
mod recorder;
mod snapshot;
mod ticks;

pub use breakdown::{Breakdown, LayerRow, OpBreakdown, Side, DEVICE};
pub use control::{Mailbox, TraceControl, TraceSettings};
pub use counters::{IoCounters, IoTotals};
pub use hist::HistSnapshot;
pub use layerset::LayerSet;
pub use loglimit::{LogLimiter, LINES_PER_WINDOW, WINDOW_MS};
pub use prom::{labels as prometheus_labels, render_prometheus};
pub use recorder::{QueueRecorder, Stamps};
pub use snapshot::{
    DeviceStats, LayerHists, NsSnapshot, OpCounts, QueueSnapshot, ReactorSnapshot, StatsSnapshot,
    StatusCount,
};

/// Server-side layers, in request order (see the crate docs).
pub const LAYERS: [&str; 4] = ["queue", "backend", "complete", "notify"];
/// Name of the end-to-end row that follows the layers.
pub const TOTAL: &str = "total";
/// An initiator's layers: application submit -> doorbell written, doorbell ->
/// completion seen (the device, which [`Breakdown::full_path`] replaces by the
/// server's layers), completion seen -> handed to the application, and the total.
pub const INITIATOR_LAYERS: [&str; 4] = ["submit", DEVICE, "reap", TOTAL];

/// Kind of operation, for counters and per-op layer tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpClass {
    Read = 0,
    Write = 1,
    Flush = 2,
    /// Everything else (write zeroes, discard, rejected opcodes).
    Other = 3,
}

impl OpClass {
    pub const ALL: [OpClass; 4] = [
        OpClass::Read,
        OpClass::Write,
        OpClass::Flush,
        OpClass::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpClass::Read => "read",
            OpClass::Write => "write",
            OpClass::Flush => "flush",
            OpClass::Other => "other",
        }
    }
}
