//! Live handover: a new udrive process takes every device over from a running one
//! without its clients noticing more than a pause (`udrive upgrade`, `udrive serve
//! --takeover RPC_SOCKET`; docs/decisions/0022-live-handover.md).
//!
//! The new process listens on a private socket and asks the running one, over its
//! control socket (method `handover`), to hand over to it. The old process pauses
//! every device ([`crate::frontend::FrontEnd::pause`]) and then its backends, and
//! sends the configuration as it runs now ([`snapshot::ServerSnapshot`]), each
//! device's saved state, and the records its process keeps — connected sockets,
//! client memory and interrupt fds, doorbell pages, the control plane's listeners
//! ([`crate::process::Process`]). The new process restores the devices from them,
//! paused, and confirms; the old one answers the control request and exits without
//! touching a client, and the new one resumes its devices. Before the
//! confirmation any failure (an abort, the new process dying, a timeout) rolls
//! back: the old process resumes its backends and devices and says why.
//!
//! `give` is the old process's side, `take` the new one's (whose start-up `serve`
//! runs in between), `upgrade` the command that starts a new process.

mod give;
pub mod launcher;
pub mod snapshot;
pub mod successor;
pub mod take;
pub mod upgrade;

pub use give::handover;

/// Record key of the configuration a handover sends first.
pub(crate) const CONFIG_KEY: &str = "config";
