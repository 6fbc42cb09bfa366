//! Block backends. A [`BlockDevice`] is shared by every queue that uses it; each
//! reactor opens its own [`IoChannel`] on it (SPDK's io_channel idea), so the I/O
//! path needs no locks: a channel belongs to one thread.

mod batch;
mod claim;
mod crypt;
mod error;
mod fault;
pub mod image_lock;
mod null;
mod qcow2;
mod qos;
mod ram;
#[cfg(feature = "rbd")]
pub mod rbd;
mod request;
mod slice;
mod uring;
mod wrapper;

pub use batch::{submit_each, Batch, RequestList};
pub use claim::{DiskClaim, RangeClaim, WriterClaim};
pub use crypt::{
    change_key, format_luks, luks_status, open_luks, open_or_format_luks, CryptDisk, Key,
    KeyChange, LuksError, LuksStatus, SectorCipher, SectorCrypter, MAX_CRYPT_IO,
};
pub use error::{typed, FixedSize, GeometryError};
pub use fault::{FaultConfig, FaultDisk, FaultError, FaultOps};
pub use null::NullDisk;
pub use qcow2::{
    create_qcow2, parse_header as parse_qcow2_header, BlockJob as Qcow2Job,
    CreateOptions as Qcow2Create, Header as Qcow2Header, HeaderError as Qcow2HeaderError,
    JobKind as Qcow2JobKind, Qcow2Claim, Qcow2Disk, Qcow2Error, Qcow2Options, Qcow2Status,
    RemoteTarget, DEFAULT_L2_CACHE as QCOW2_DEFAULT_L2_CACHE, MAX_BACKING_CHAIN,
};
pub use qos::{QosClock, QosDisk, QosError, QosLimits, BURST, QOS_MAX_NAP, QOS_QUEUE_DEPTH};
pub use ram::{RamDisk, RamError};
pub use request::{BlockInfo, IoOp, IoRequest, IoStatus};
pub use slice::{overlaps, SliceDisk, SliceError};
pub use uring::{FileDisk, FileEngine, FileError, FileOp, FileOptions};
pub use wrapper::{ChannelWrapper, DeviceWrapper};

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Instant;

/// A block backend: describes itself and opens per-thread channels.
///
/// # The backend contract
///
/// What front ends (NVMe queue groups, virtio-blk queues) and wrappers (slice, QoS,
/// fault injection) rely on, and what a new backend kind must provide:
///
/// - **One device, many channels.** The device is shared by every queue that uses it
///   (`Send + Sync`, behind an `Arc`); each reactor opens its own [`IoChannel`] and
///   uses it from that thread only, so the I/O path takes no locks. A backend whose
///   native handle must be shared (one image handle per device, e.g. a remote
///   volume's exclusive lock) keeps it in the device and gives channels a reference.
/// - **Buffers.** The memory behind a request's buffers belongs to the caller, who
///   keeps it valid and mapped until the request's completion is reported (front
///   ends pin the guest memory snapshot per request, see `guest_mem::MemPins`).
/// - **Borrowed for the call only.** `submit` may keep nothing it borrows past its
///   return: the [`IoRequest`] and its iovec array live on the caller's stack. A
///   channel that needs the buffer list later copies it (into preallocated slots:
///   `guest_mem::HeldIov` keeps a copy together with the promise above).
/// - **Batches.** A front end hands a channel the requests it parsed in one poll
///   together ([`IoChannel::submit_batch`]), keeping them in its own slots while
///   the channel reads them, and ends the poll with [`IoChannel::flush`]. The
///   channel orders its own work: `ram` copies one request while the next one's
///   data is on its way to the cache, io_uring queues them all for the one system
///   call of `flush`, librbd takes them one at a time. Each request's start is
///   reported as it happens ([`Batch::started`]), so an inline completion can be
///   posted while the rest of the batch runs. The first request of a batch may be
///   announced earlier, as soon as its range is known ([`IoChannel::announce`]):
///   its latency is the one nothing else in the batch hides
///   (docs/decisions/0033-backend-batches.md).
/// - **Completions** of asynchronous requests are handed out by [`IoChannel::poll`]
///   on the channel's own thread, exactly once per request that `submit` did not
///   finish inline, in any order. Backends that complete on threads of their own
///   queue completions to the channel and wake a sleeping reactor through the
///   notifier ([`IoChannel::arm_notifier`]).
/// - **Back-pressure.** [`IoChannel::room`] says how many more requests the channel
///   takes now without queueing them internally; front ends stop fetching new
///   commands while it is 0 and the commands wait in the guest's own ring. `submit`
///   never refuses for lack of room (a command already fetched, or one that needs
///   several requests, still goes in: the backend queues it).
/// - **Dropping a channel** with requests in flight must not return while the
///   backend may still touch their buffers (wait for or cancel them); their
///   completions are never reported. Front ends drain their channels (bounded)
///   before dropping them.
/// - **Size.** [`BlockDevice::info`] does not change for one device handle. A new
///   size (online resize) is a new handle over the same data
///   ([`BlockDevice::resize`]); front ends switch queues to it the way they add a
///   namespace, and the old handle's channels finish what they hold.
pub trait BlockDevice: Send + Sync {
    /// Short kind and parameters, e.g. `ram:1GiB`.
    fn describe(&self) -> String;
    fn info(&self) -> &BlockInfo;
    /// A channel for the calling thread. Cheap for inline backends.
    fn channel(&self) -> io::Result<Box<dyn IoChannel>>;

    /// The same data seen with a size of `bytes` (a multiple of the block size): a
    /// new handle, sharing this one's storage. Backends that cannot change size say
    /// why ([`io::ErrorKind::Unsupported`]).
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        let _ = bytes;
        Err(FixedSize {
            device: self.describe(),
        }
        .into())
    }
    /// The backend itself, for control operations of its kind (RBD snapshots);
    /// wrappers that leave the backend whole (QoS, fault injection) pass it on.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
    /// The backend holding the LUKS volume this device shows the payload of, for
    /// its header's control operations (keyslots); wrappers pass it on.
    fn encrypted_volume(&self) -> Option<&dyn BlockDevice> {
        None
    }
    /// Whether a front end may reformat this backend (NVMe Format NVM): present it
    /// with another logical block size and erase it. The default: it may not.
    fn format_support(&self) -> FormatSupport {
        FormatSupport::Unsupported
    }
    /// The process pauses for a handover (udrive's decision 0022): the front end
    /// has paused (no request in flight) and a successor process is about to
    /// open this backend by its spec. Give up what would keep a successor from
    /// opening it (an RBD image's exclusive lock); the device need not serve
    /// writes until [`BlockDevice::resume`]. Idempotent; the default has nothing
    /// to give up. Wrappers pass it on ([`DeviceWrapper`]).
    fn pause(&self) -> io::Result<()> {
        Ok(())
    }
    /// The handover failed and the process resumes: take back what
    /// [`BlockDevice::pause`] gave up, so that the device's channels work as
    /// before. `dead_owners` names clients known dead (the failed successor's
    /// cluster clients, announced before it took anything) whose claims may be
    /// broken. Idempotent.
    fn resume(&self, dead_owners: &[String]) -> io::Result<()> {
        let _ = dead_owners;
        Ok(())
    }
}

/// What a front end may do when a guest asks to reformat a backend (see
/// [`BlockDevice::format_support`]). Channels address bytes, so a new block size
/// needs no new channel; only the backend's I/O alignment limits it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatSupport {
    /// The device is the namespace's alone: any power-of-two block size from
    /// `min_block_size` (the backend's I/O alignment) up can be presented, and
    /// erasing it (Write Zeroes over the whole range) touches no one else's data.
    Exclusive { min_block_size: u32 },
    /// A window on a backend that other namespaces or devices may use (a slice, a
    /// `shared` namespace): its bounds were chosen for the configured block size
    /// and the guest may not erase what lies around it.
    Shared,
    /// The backend cannot be reformatted.
    Unsupported,
}

/// Per-thread submission path to a backend (see [`BlockDevice`] for the contract).
///
/// Channels that wrap another one implement [`ChannelWrapper`] instead: a method
/// added here gets its forwarding default there, once (and devices that wrap
/// another one implement [`DeviceWrapper`]).
pub trait IoChannel: Send {
    /// Starts `req`. Inline backends finish at once and return `Some(status)`;
    /// asynchronous ones return `None` and report `tag` from [`IoChannel::poll`] later.
    /// The request's buffers must stay valid until then.
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus>;

    /// Starts every request of `batch`, in order, reporting each start to
    /// [`Batch::started`] as it happens; returns how many did not finish inline
    /// (they are reported by [`IoChannel::poll`]). A channel may read requests of
    /// the batch ahead of the one it starts, to prepare them. The default starts
    /// them one by one with [`IoChannel::submit`].
    fn submit_batch(&mut self, batch: &mut dyn Batch) -> usize {
        submit_each(batch, |tag, req| self.submit(tag, req))
    }

    /// The caller has decoded the request it will submit first in its next batch
    /// on this channel, and is preparing its buffers now (mapping guest memory:
    /// hundreds of nanoseconds). A channel may start work that needs only the
    /// range: a copying backend starts loading the first bytes a read will copy,
    /// so that their page walk and memory access overlap the caller's work. Only
    /// the first request is announced: the channel prepares the others itself
    /// while it works on the ones before them. The default does nothing, which is
    /// right for every backend whose work starts with a system call or a message.
    /// Never required for correctness: the range is not checked yet, and the
    /// request may not come (its buffers fail to map).
    fn announce(&mut self, _op: IoOp, _offset: u64, _len: u64) {}

    /// Hands finished asynchronous requests to `done`; returns how many.
    fn poll(&mut self, _done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        0
    }

    /// Pushes queued submissions to the kernel (once per poll iteration).
    fn flush(&mut self) {}

    /// How many more requests the channel takes now without queueing them
    /// internally (back-pressure); unbounded by default.
    fn room(&self) -> usize {
        usize::MAX
    }

    /// Prepares the channel's completion notifier before its reactor sleeps with
    /// requests in flight. The default, [`Armed::Unsupported`], keeps the reactor
    /// polling until they complete.
    fn arm_notifier(&mut self) -> Armed {
        Armed::Unsupported
    }

    /// After [`IoChannel::arm_notifier`] returned [`Armed::Fd`] or [`Armed::Timer`]:
    /// the latest instant the channel must be polled again although its notifier
    /// stayed quiet — requests it holds back until time passes (a rate limit, an
    /// injected latency). `None` (the default): only the notifier matters.
    fn wake_by(&self) -> Option<Instant> {
        None
    }

    /// The descriptor that becomes readable when an armed channel has completions
    /// to hand out (valid after [`IoChannel::arm_notifier`] returned
    /// [`Armed::Fd`]).
    fn notifier(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// Whether a request takes a network round trip or longer (hundreds of µs) to
    /// complete. With a deep queue on such a channel an adaptive reactor sleeps on
    /// the notifier between completions instead of spinning through every round
    /// trip (docs/decisions/0026-deep-queue-naps.md).
    fn slow_completions(&self) -> bool {
        false
    }
}

/// What arming a channel's completion notifier found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Armed {
    /// Completions are waiting already: poll instead of sleeping.
    Ready,
    /// [`IoChannel::notifier`] will become readable on the next completion.
    Fd,
    /// Nothing completes until time passes (requests held back by a rate limit or
    /// an injected latency, none with the backend): sleep, but poll again by
    /// [`IoChannel::wake_by`]. [`IoChannel::notifier`] may be `None`.
    Timer,
    /// The channel cannot wake a sleeping reactor: keep polling.
    Unsupported,
}

/// How a wrapper that holds some requests back until a time (QoS, injected
/// latency) arms: as its inner channel while that one's notifier counts (it has
/// requests, or the wrapper holds none), else on its own deadline
/// ([`Armed::Timer`]). `inner_counts` also decides whether the wrapper hands out
/// the inner notifier and deadline.
fn arm_holding(inner: &mut dyn IoChannel, inner_counts: bool) -> Armed {
    if inner_counts {
        inner.arm_notifier()
    } else {
        Armed::Timer
    }
}

/// The earlier of two optional deadlines.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    a.into_iter().chain(b).min()
}

/// Checks that `[offset, offset+len)` lies inside a device of `size` bytes.
pub fn in_range(offset: u64, len: u64, size: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= size)
}
