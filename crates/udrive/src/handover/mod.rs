//! Live handover: a new udrive process takes every device over from a running one
//! without its clients noticing more than a pause (`udrive upgrade`, `udrive serve
//! --takeover RPC_SOCKET`; docs/decisions/0022-live-handover.md).
//!
//! The new process listens on a private socket and asks the running one, over its
//! control socket (method `handover`), to hand over to it. The old process pauses
//! every device at a message boundary and quiesces its queues, then sends the
//! configuration as it runs now ([`snapshot::ServerSnapshot`]), each device's state,
//! and the file descriptors its clients depend on — listening sockets, connected
//! sockets, client memory and interrupt fds, doorbell pages — as records
//! ([`vfio_user::keep`]). The new process starts the devices from them and confirms;
//! the old one answers the control request and exits without touching a client.
//! Before the confirmation any failure (an abort, the new process dying, a timeout)
//! rolls back: the old process resumes its devices and says why.

mod give;
pub mod snapshot;
mod take;
pub mod upgrade;
mod vhost;

use std::sync::atomic::{AtomicBool, Ordering};

pub use give::handover;
pub use take::run as run_takeover;
pub use vhost::take_state as vhost_state;

/// Record keys besides the devices' own (`vfu:<socket>#…`).
pub(crate) const CONFIG_KEY: &str = "config";
pub(crate) const RPC_LISTENER_KEY: &str = "rpc#listen";
pub(crate) const METRICS_LISTENER_KEY: &str = "metrics#listen";

/// A record as sent to the new process: key, bytes, file descriptors.
pub type Record = (String, Vec<u8>, Vec<std::os::fd::OwnedFd>);

/// What a handover asks of each device (an NVMe controller, a vhost-user-blk
/// device): the one place that lists the device kinds a handover moves.
pub trait HandedOver {
    /// Old process: stop serving at a message boundary and finish what is in
    /// flight (bounded). On error nothing stays paused.
    fn pause_for_handover(&self, limit: std::time::Duration) -> anyhow::Result<()>;
    /// Old process: the handover failed; serve on as before.
    fn resume_after_handover_failed(&self);
    /// Old process, paused: what the new one needs besides the records the device
    /// keeps as it runs (`supervise::local_records`).
    fn handover_records(&self) -> anyhow::Result<Vec<Record>>;
    /// Its backends, each named for messages, with its spec.
    fn backends(&self) -> Vec<(String, &crate::nsspec::NsSpec, &bdev::QosDisk)>;
    /// New process: checks what it brought before the old one is told to let go.
    fn check_takeover_state(&self) -> anyhow::Result<()> {
        Ok(())
    }
    /// New process: the old one let go; serve.
    fn start_after_takeover(&mut self);
}

/// The device as a handover sees it (`None`: a kind it cannot move).
pub fn handed_over(d: &crate::server::Device) -> Option<&dyn HandedOver> {
    match d.as_nvme() {
        Some(n) => Some(n),
        None => d.as_vhost().map(|v| v as &dyn HandedOver),
    }
}

fn handed_over_mut(d: &mut crate::server::Device) -> Option<&mut dyn HandedOver> {
    if d.as_nvme().is_some() {
        return d.as_nvme_mut().map(|n| n as &mut dyn HandedOver);
    }
    d.as_vhost_mut().map(|v| v as &mut dyn HandedOver)
}

static HANDED_OVER: AtomicBool = AtomicBool::new(false);
static TAKING_OVER: AtomicBool = AtomicBool::new(false);

/// Whether devices start paused: this process takes them over and the old one has
/// not confirmed yet that it let go.
pub fn taking_over() -> bool {
    TAKING_OVER.load(Ordering::Acquire)
}

/// Record key of the new process's announcements to the old one: the address of
/// a RADOS client it is about to take image locks with (decision 0024).
pub(crate) const CLIENT_KEY: &str = "rbd-client";

/// The new process's connection to the old one while it takes over.
static TO_OLD: std::sync::Mutex<Option<std::os::fd::OwnedFd>> = std::sync::Mutex::new(None);

/// New process: tells the old one the address of a cluster client it is about to
/// take locks with, so that if we die before confirming, the old process knows
/// whose locks it may break to take its images back. Sent before any lock is
/// taken with it; nothing outside a takeover.
pub fn announce_client(addr: &str) {
    let conn = TO_OLD.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = conn.as_ref() {
        use std::os::fd::AsFd;
        if let Err(e) = crate::supervise::wire::send(
            c.as_fd(),
            crate::supervise::wire::Op::Record,
            CLIENT_KEY,
            addr.as_bytes(),
            &[],
        ) {
            tracing::warn!("takeover: cannot tell the old process our client address: {e}");
        }
    }
}

/// Called by the control socket after each reply: once the `handover` reply is
/// out, this process has nothing left to do — it exits at once, without running
/// the teardown that would disconnect clients or remove socket files the new
/// process now serves.
pub fn exit_if_handed_over() {
    if HANDED_OVER.load(Ordering::Acquire) {
        tracing::info!("handover complete: this process exits; the new one serves");
        std::process::exit(0);
    }
}
