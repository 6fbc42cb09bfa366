//! `udrive serve --supervise`: a small supervisor process runs the server as its
//! child and keeps, for it, the file descriptors a client cannot lose — each
//! vfio-user client's connected socket, its memory and interrupt fds, and the
//! controller's doorbell page. If the child dies (SIGKILL, a panic, SIGBUS) the
//! supervisor starts a new one and hands them back: the client stays connected and
//! sees a controller in fatal status, which its driver resets
//! (docs/decisions/0021-supervise.md).
//!
//! The supervisor parses no guest input and runs no device logic: it stores opaque
//! records (`lifecycle::keep`) under keys the child chooses and replays them to
//! the next child. The child's side is `crate::process` (a supervised
//! [`crate::process::Process`]). vhost-user-blk devices need none of this: their
//! clients reconnect and replay the inflight log.

mod supervisor;

pub use supervisor::run;
