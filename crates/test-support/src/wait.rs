//! Waiting for a condition instead of sleeping for a guess.
//!
//! A test that sleeps "long enough" for something to happen fails when the machine
//! is busy; one that waits for the thing itself only gets slower. Every deadline
//! here is a bound for a broken build, never a measurement: a test must not assert
//! how soon something happened.

use std::time::Duration;

/// Generous bound for one step (a command, a reply, a reconnect); reached only
/// when something is broken.
pub const T: Duration = Duration::from_secs(10);

/// Polls `f` until it holds or `timeout` passes; whether it held. The pause between
/// polls grows from 20 µs to 2 ms, so a quick condition is seen at once and a slow
/// one costs little CPU.
pub fn poll_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let mut pause = Duration::from_micros(20);
    // The control path's bounded wait, with the pause taken here so it can grow.
    engine::wait_until(timeout, Duration::ZERO, || {
        if f() {
            return true;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(2));
        false
    })
}

/// Polls `f` until it holds; fails the test with `what` after `timeout`.
#[track_caller]
pub fn wait_until(what: &str, timeout: Duration, f: impl FnMut() -> bool) {
    assert!(poll_until(timeout, f), "gave up waiting for {what}");
}
