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
/// `main_pid`: this process took over from the unit's main process.
pub fn ready(devices: usize, main_pid: bool) {
    let status = format!("serving {devices} device(s)");
    let pid = std::process::id();
    if main_pid {
        send(&[
            NotifyState::MainPid(pid),
            NotifyState::Ready,
            NotifyState::Status(&status),
        ]);
    } else {
        send(&[NotifyState::Ready, NotifyState::Status(&status)]);
    }
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
