//! Telling the service manager how the server is doing (`Type=notify` units,
//! dist/udrive.service): ready once every socket listens, reloading, stopping.
//! Outside systemd (no `NOTIFY_SOCKET`) each call does nothing.

use sd_notify::NotifyState;

fn send(states: &[NotifyState]) {
    // Kept in the environment: a supervised child or a successor started by
    // `udrive upgrade` from inside the unit reports the same way.
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::debug!("cannot notify the service manager: {e}");
    }
}

/// Every device socket, the control socket and the metrics endpoint listen.
pub fn ready(devices: usize) {
    let status = format!("serving {devices} device(s)");
    send(&[NotifyState::Ready, NotifyState::Status(&status)]);
}

/// This process takes over from the unit's main process, which exits once it has
/// the confirmation: sent before that, so the service manager never sees its main
/// process gone.
pub fn main_pid() {
    send(&[NotifyState::MainPid(std::process::id())]);
}

/// A reload started; [`ready`] ends it.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[NotifyState::Reloading, now]),
        Err(_) => send(&[NotifyState::Reloading]),
    }
}

pub fn stopping() {
    send(&[NotifyState::Stopping]);
}
