//! What outlives a udrive process, and the words for getting there.
//!
//! - [`keep`]: records (key, bytes, file descriptors) that devices leave with a
//!   [`Keeper`] as their clients change state, and that the next process inherits
//!   ([`Inherited`]): a supervisor's restarted child, or the process a live
//!   handover starts.
//! - [`RecordStore`]: the bounded store a supervisor (or an unsupervised server,
//!   for a handover) keeps them in.
//! - [`fdpass`]: SCM_RIGHTS over Unix sockets, for the transports, the supervisor
//!   channel and the handover channel.
//! - [`channel`]: the message format between two udrive processes (supervisor and
//!   child, old and new process of a handover).
//!
//! # The lifecycle vocabulary
//!
//! Every front end (NVMe over vfio-user, virtio-blk over vhost-user), the
//! transports under them and the backends speak the same four words, in the manner
//! of Cloud Hypervisor's `Pausable`/`Snapshottable` and Firecracker's `Persist`:
//!
//! - **pause**: stop taking new work at a message boundary and let what is in
//!   flight finish (bounded); on error nothing stays paused. A backend pauses by
//!   giving up what would keep another process from opening it (an exclusive lock).
//! - **resume**: go on after a pause (a handover that failed), or start serving a
//!   restored device once its predecessor let go.
//! - **save**: while paused, the state and descriptors a successor needs, as
//!   [`Record`]s.
//! - **restore**: build a device from saved records; it starts paused.
//!
//! Live handover, crash supervision and VM migration are sequences of these.

pub mod channel;
pub mod fdpass;
pub mod keep;
mod store;

pub use keep::{Inherited, KeepHandle, Keeper, Kept, KeptRecords, Record};
pub use store::{RecordStore, Records};
