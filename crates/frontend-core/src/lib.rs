//! What every udrive front end shares, below the protocol: a front end (NVMe over
//! vfio-user, virtio-blk over vhost-user, the next one) decodes its own commands and
//! moves its own data, and uses this crate for the rest of a request's life:
//!
//! - **Policy** ([`Disk`]): the block→byte range check, the read-only rule and FUA
//!   when the guest turned the write cache off, before the backend sees a request.
//! - **Status** ([`Protocol`]): one table per protocol from `bdev::IoStatus` and
//!   [`Refusal`] to the wire status, and the code the counters use.
//! - **Accounting and tracing** ([`QueueCore`], one per queue, on the poller's
//!   thread): each completion is counted once — NVMe's SMART page, controller stats,
//!   virtio-blk's worker stats, `get_stats` and Prometheus all read the same
//!   counters — and per-poll trace stamps are taken the same way everywhere.
//! - **Readers** ([`Observed`], [`collect`], [`Queues`]): trace start/stop and
//!   snapshot collection, waiting a bounded time (`engine::wait_until`) and waking
//!   sleeping reactors.
//!
//! See `docs/decisions/0015-front-end-core.md` for why it is shaped this way.
//!
//! # A third front end
//!
//! It gets metrics and tracing by giving each queue a [`QueueCore`] and the device
//! an [`Observed`] (here through [`Queues`]). udrive's `FrontEnd` then serves it in
//! `get_stats`, Prometheus and `udrive trace` with no further code.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use bdev::{IoOp, IoStatus};
//! use frontend_core::{Observed, Protocol, QueueCore, Queues, Refusal};
//! use trace::{OpClass, Stamps, TraceControl};
//!
//! /// A toy protocol: status byte 0 is success, 1 is an error.
//! struct Toy;
//! impl Protocol for Toy {
//!     type Status = u8;
//!     const OK: u8 = 0;
//!     fn from_io(st: IoStatus, _op: IoOp) -> u8 { u8::from(st != IoStatus::Ok) }
//!     fn refused(_: Refusal) -> u8 { 1 }
//!     fn code(s: u8) -> u16 { u16::from(s) }
//! }
//!
//! let ctl = Arc::new(TraceControl::default());
//! let mut queue = QueueCore::<Toy>::new(0, 1, 64, ctl.clone());
//! let mut device = Queues::new(ctl);
//! device.add(queue.mailbox(), None);
//! let counters = queue.counters();
//!
//! // The queue's poller (a reactor thread in a real front end).
//! let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
//! let poller = {
//!     let stop = stop.clone();
//!     std::thread::spawn(move || {
//!         while !stop.load(std::sync::atomic::Ordering::Relaxed) {
//!             queue.begin_poll();
//!             let kick = queue.kick();
//!             let s = queue.sample(kick);
//!             let stamps = Stamps { kick: s, submitted: QueueCore::<Toy>::stamp(s), completed: QueueCore::<Toy>::stamp(s) };
//!             queue.complete(1, OpClass::Read, 4096, Toy::from_io(IoStatus::Ok, IoOp::Read), stamps);
//!             queue.end_poll(0, || true);
//!         }
//!     })
//! };
//!
//! device.trace_start(1, Duration::from_secs(5));
//! let stats = device.queue_stats(Duration::from_secs(5));
//! stop.store(true, std::sync::atomic::Ordering::Relaxed);
//! poller.join().unwrap();
//! let ns = stats[0].namespaces.iter().find(|n| n.nsid == 1).unwrap();
//! assert!(ns.ops.read > 0);
//! assert!(ns.layers.iter().any(|l| l.op == "read"), "traced");
//! // The same counters, without asking the poller:
//! assert!(counters.totals().ops.read >= ns.ops.read);
//! ```

#![forbid(unsafe_code)]

mod observe;
mod policy;
mod queue;
mod status;

pub use observe::{collect, current_trace, Observed, Queues};
pub use policy::{ByteRange, Disk, Refusal};
pub use queue::QueueCore;
pub use status::Protocol;

#[cfg(test)]
mod tests;
