//! `udrive serve --supervise`: a small supervisor process runs the server as its
//! child and keeps, for it, the file descriptors a client cannot lose — each
//! vfio-user client's connected socket, its memory and interrupt fds, and the
//! controller's doorbell page. If the child dies (SIGKILL, a panic, SIGBUS) the
//! supervisor starts a new one and hands them back: the client stays connected and
//! sees a controller in fatal status, which its driver resets
//! (docs/decisions/0021-supervise.md).
//!
//! The supervisor parses no guest input and runs no device logic: it stores opaque
//! records ([`vfio_user::keep`]) under keys the child chooses and replays them to
//! the next child. vhost-user-blk devices need none of this: their clients
//! reconnect and replay the inflight log.

mod child;
mod store;
mod supervisor;
pub(crate) mod wire;

pub use child::{
    attach, inherit, keeper, local_records, notes, ready, supervised, take, take_one, NOTE_PREFIX,
};
pub use store::RecordStore;
pub use supervisor::run;
