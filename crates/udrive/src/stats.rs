//! The data behind the control socket's `get_stats` and `trace_start/stop/read`
//! methods: small functions over the running devices and the engine, so the RPC
//! layer only parses parameters and serializes the results.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use frontend_core::Observed;
use trace::{Breakdown, DeviceStats, ReactorSnapshot, StatsSnapshot};

/// How long a stats or trace read waits for busy reactors to answer.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// A device whose queues keep counters and trace data (NVMe controllers,
/// vhost-user-blk devices): its name and the front-end core's view of its queues.
pub trait Traced {
    fn socket(&self) -> &Path;
    /// `nvme` or `vhost-user-blk`.
    fn kind(&self) -> &'static str;
    /// Queue snapshots and trace start/stop (`frontend_core::Observed`).
    fn observed(&self) -> &dyn Observed;
}

/// The name a device has in stats and metrics: its socket's file stem.
pub fn device_name<D: Traced + ?Sized>(d: &D) -> String {
    let s = d.socket();
    s.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| s.display().to_string())
}

/// Counters of every reactor of `engine`.
pub fn reactors(engine: &engine::Engine) -> Vec<ReactorSnapshot> {
    (0..engine.num_reactors())
        .filter_map(|i| {
            engine.stats(i).map(|s| ReactorSnapshot {
                reactor: i,
                polls: s.iterations.load(Ordering::Relaxed),
                busy_polls: s.busy_iterations.load(Ordering::Relaxed),
                work_items: s.work_items.load(Ordering::Relaxed),
                cpu_ns: s.cpu_ns.load(Ordering::Relaxed),
                sleeps: s.sleeps.load(Ordering::Relaxed),
            })
        })
        .collect()
}

/// One device's queues.
pub fn device_stats<D: Traced + ?Sized>(d: &D, timeout: Duration) -> DeviceStats {
    DeviceStats {
        name: device_name(d),
        kind: d.kind().into(),
        queues: d.observed().queue_stats(timeout),
    }
}

/// `get_stats`: every device and reactor. Render with [`trace::render_prometheus`]
/// for `udrive metrics` and the HTTP endpoint.
pub fn get_stats<D: Traced + ?Sized>(devices: &[&D], engine: &engine::Engine) -> StatsSnapshot {
    StatsSnapshot {
        devices: devices
            .iter()
            .map(|d| device_stats(*d, READ_TIMEOUT))
            .collect(),
        reactors: reactors(engine),
    }
}

/// `trace_start`: traces one request in `sample_every` (1: all) on `devices`,
/// dropping the layer data of an earlier trace. Returns once the queues apply it.
pub fn trace_start<D: Traced + ?Sized>(devices: &[&D], sample_every: u32) {
    for d in devices {
        d.observed().trace_start(sample_every, READ_TIMEOUT);
    }
}

/// `trace_stop`: stops tracing; the data stays readable.
pub fn trace_stop<D: Traced + ?Sized>(devices: &[&D]) {
    for d in devices {
        d.observed().trace_stop(READ_TIMEOUT);
    }
}

/// `trace_read`: the layer table over all queues and namespaces of `devices`.
pub fn trace_read<D: Traced + ?Sized>(devices: &[&D]) -> Breakdown {
    let queues: Vec<_> = devices
        .iter()
        .flat_map(|d| d.observed().queue_stats(READ_TIMEOUT))
        .collect();
    Breakdown::from_queues(&queues)
}
