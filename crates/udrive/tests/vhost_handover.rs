//! Live handover of a vhost-user-blk front end between two devices without a
//! reconnect: pause device A, save, restore device B from the saved state,
//! stop A; the front end (libblkio at QD32 doing verified I/O, or a hand-driven
//! front end) never notices beyond a pause. Also: calling a handover off, a
//! handover with no front end or with one halfway through its setup, and corrupt
//! saved states.

mod common;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bdev::BlockDevice;
use common::engine;
use guest_mem::SharedMem;
use test_support::blkio::blkio_round;
use test_support::blkio_load::{Qd32Client, QD};
use test_support::vhost_fe::*;
use test_support::{wait_until, T};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::VhostUserFrontend;
use vhost_user_blk::{BlkDeviceOptions, HandoverState, PollMode, VhostUserBlk};
use vmm_sys_util::eventfd::EventFd;

const DISK: u64 = 16 << 20;
const PAUSE: Duration = Duration::from_secs(10);

fn disk() -> Arc<dyn BlockDevice> {
    Arc::new(bdev::RamDisk::new(DISK, 512).unwrap())
}

fn opts(poll: PollMode) -> BlkDeviceOptions {
    BlkDeviceOptions {
        poll,
        ..Default::default()
    }
}

fn start(sock: &Path, disk: &Arc<dyn BlockDevice>, poll: PollMode) -> VhostUserBlk {
    VhostUserBlk::start(sock, disk.clone(), opts(poll), &engine(), &[0]).unwrap()
}

/// A's saved state through JSON (as it would cross processes) and B started from it.
fn hand_over(
    a: &VhostUserBlk,
    sock: &Path,
    disk: &Arc<dyn BlockDevice>,
    poll: PollMode,
) -> vhost_user_blk::Result<VhostUserBlk> {
    a.pause(PAUSE)?;
    let (state, fds) = a.save()?;
    let json = serde_json::to_string(&state).unwrap();
    let state: HandoverState = serde_json::from_str(&json).unwrap();
    VhostUserBlk::restore(sock, disk.clone(), opts(poll), &engine(), &[0], state, fds)
}

fn handover_loop(poll: PollMode, rounds: usize) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let disk = disk();
    let mut dev = start(&sock, &disk, poll);
    let client = Qd32Client::start(&sock);
    let mut pauses = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let t = Instant::now();
        let next =
            hand_over(&dev, &sock, &disk, poll).unwrap_or_else(|e| panic!("handover {i}: {e}"));
        // A goes without disconnecting the front end (its fds moved to B), then B
        // is let run: the commit.
        dev.stop();
        next.resume();
        pauses.push(t.elapsed());
        dev = next;
        assert!(sock.exists(), "handover {i}: the socket path is gone");
        client.wait_progress(1000);
    }
    let tally = client.finish();
    assert!(tally.verified > 0);
    pauses.sort();
    eprintln!(
        "{poll:?}: {rounds} handovers, pause (pause A .. B runs): median {:?}, max {:?}; {tally:?}",
        pauses[rounds / 2],
        pauses[rounds - 1]
    );
    // One connection for the whole run on the last device, never a new one.
    assert_eq!(dev.connections(), 1);
    dev.stop();
}

#[test]
fn handover_under_qd32_io_50_times() {
    handover_loop(PollMode::Busy, 50);
}

#[test]
fn handover_under_qd32_io_adaptive_polling() {
    handover_loop(PollMode::Adaptive, 20);
}

/// Event mode: the reactors sleep until kicked, so a kick the new device's handler
/// does not see (still read by the old one) would stall the client.
#[test]
fn handover_under_qd32_io_event_mode() {
    handover_loop(PollMode::Event, 20);
}

#[test]
fn pause_then_resume_under_io() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let disk = disk();
    let dev = start(&sock, &disk, PollMode::Adaptive);
    let client = Qd32Client::start(&sock);
    for _ in 0..20 {
        dev.pause(PAUSE).unwrap();
        assert!(dev.paused());
        // Nothing moves while paused: the client reaps at most what was in
        // flight (one request per slot) and completed while draining, however
        // late it gets to them.
        let before = client.progress.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        let moved = client.progress.load(Ordering::Relaxed) - before;
        assert!(moved <= QD as u64, "{moved} completions while paused");
        if before.is_multiple_of(2) {
            // Exported and then called off: the same.
            let (_state, fds) = dev.save().unwrap();
            drop(fds);
        }
        dev.resume();
        client.wait_progress(100);
    }
    let tally = client.finish();
    assert!(tally.verified > 0);
    assert_eq!(dev.connections(), 1);
    dev.stop();
}

/// A handover called off after the new device started (before the commit):
/// dropping it hands everything back, and the old device runs on.
#[test]
fn rollback_after_the_new_device_started() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let disk = disk();
    let a = start(&sock, &disk, PollMode::Adaptive);
    let client = Qd32Client::start(&sock);
    for i in 0..10 {
        let b = hand_over(&a, &sock, &disk, PollMode::Adaptive).unwrap();
        if i % 2 == 0 {
            b.stop();
        } else {
            drop(b);
        }
        assert!(sock.exists());
        a.resume();
        client.wait_progress(1000);
    }
    let tally = client.finish();
    assert!(tally.verified > 0);
    assert_eq!(a.connections(), 1);
    a.stop();
}

#[test]
fn handover_without_a_front_end() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let disk = disk();
    let a = start(&sock, &disk, PollMode::Adaptive);
    blkio_round(&sock, 0x11);
    // (A front end that just hung up may still be handed over: the new device
    // reads its end of file. Here it is gone first.)
    wait_until("the front end gone", T, || a.disconnections() >= 1);
    a.pause(PAUSE).unwrap();
    let (state, fds) = a.save().unwrap();
    assert!(state.connection.is_none());
    assert_eq!(fds.len(), 1);
    let b = VhostUserBlk::restore(
        &sock,
        disk.clone(),
        opts(PollMode::Adaptive),
        &engine(),
        &[0],
        state,
        fds,
    )
    .unwrap();
    // A front end connecting now waits in the backlog: A holds, B is serving it.
    let client = std::thread::spawn({
        let sock = sock.clone();
        move || blkio_round(&sock, 0x22)
    });
    std::thread::sleep(Duration::from_millis(50));
    a.stop();
    assert!(sock.exists());
    b.resume();
    client.join().unwrap();
    blkio_round(&sock, 0x33);
    assert_eq!(b.connections(), 2);
    b.stop();
    assert!(!sock.exists());
}

/// A hand-driven front end stopped in the middle of its setup: what it sent is
/// replayed, and it finishes the setup with the new device.
#[test]
fn handover_with_a_front_end_halfway_through_setup() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let disk = disk();
    let a = start(&sock, &disk, PollMode::Adaptive);
    // Features negotiated and the memory table set, no vring yet.
    let fe = negotiate(&sock, VhostUserProtocolFeatures::CONFIG);
    let mut raw = FakeFrontend {
        fe,
        mem: SharedMem::new("halfway", MEM).unwrap().into(),
        next_desc: 0,
        avail: 0,
        kick: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        call: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        event_idx: false,
    };
    raw.set_mem_table();
    let b = hand_over(&a, &sock, &disk, PollMode::Adaptive).unwrap();
    a.stop();
    b.resume();
    raw.start_vring();
    raw.header(T_OUT, 8);
    raw.put(DATA, &[0x5a; 512]);
    let st = raw.request(&[(HDR, 16, false), (DATA, 512, false), (STATUS, 1, true)]);
    assert_eq!(st, 0);
    // And once more, now with a running vring, to a third device.
    let c = hand_over(&b, &sock, &disk, PollMode::Adaptive).unwrap();
    b.stop();
    c.resume();
    raw.header(T_IN, 8);
    raw.put(DATA, &[0; 512]);
    let st = raw.request(&[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)]);
    assert_eq!(st, 0);
    assert_eq!(raw.get(DATA, 512), vec![0x5a; 512]);
    c.stop();
}

/// A change to a saved state (or to the fds passed with it).
type Corrupt = Box<dyn Fn(&mut HandoverState, &mut Vec<std::os::fd::OwnedFd>)>;

/// Every way [`corrupt_states_are_refused`] breaks a saved state, by name.
fn corruptions() -> Vec<(&'static str, Corrupt)> {
    vec![
        ("version", Box::new(|s, _| s.version += 1)),
        ("queue count", Box::new(|s, _| s.num_queues += 1)),
        ("capacity", Box::new(|s, _| s.capacity_bytes += 512)),
        (
            "vring index",
            Box::new(|s, _| {
                let v = &mut s.connection.as_mut().unwrap().vrings[0];
                v.base += 1;
            }),
        ),
        (
            "vring size 0",
            Box::new(|s, _| s.connection.as_mut().unwrap().vrings[0].num = 0),
        ),
        (
            "vring size too big",
            Box::new(|s, _| s.connection.as_mut().unwrap().vrings[0].num = 4096),
        ),
        (
            "extra vring",
            Box::new(|s, _| {
                let r = s.connection.as_mut().unwrap();
                let v = r.vrings[0].clone();
                r.vrings.push(v);
            }),
        ),
        (
            "too few fds",
            Box::new(|_, fds| {
                fds.pop();
            }),
        ),
        (
            "too many fds",
            Box::new(|_, fds| {
                let extra = fds[0].try_clone().unwrap();
                fds.push(extra);
            }),
        ),
        (
            "fd index out of range",
            Box::new(|s, _| s.connection.as_mut().unwrap().front_fd = 99),
        ),
        (
            "fd used twice",
            Box::new(|s, _| {
                let c = s.connection.as_mut().unwrap();
                c.vrings[0].call = c.vrings[0].kick;
            }),
        ),
        (
            "started without a kick",
            Box::new(|s, _| s.connection.as_mut().unwrap().vrings[0].kick = None),
        ),
        (
            "listener is the memory file",
            Box::new(|s, _| {
                let c = s.connection.as_mut().unwrap();
                std::mem::swap(&mut c.mem[0].fd, &mut s.listener_fd);
            }),
        ),
        (
            "memory region past its file",
            Box::new(|s, _| s.connection.as_mut().unwrap().mem[0].memory_size *= 2),
        ),
        (
            "vring addresses outside memory",
            Box::new(|s, _| {
                let v = &mut s.connection.as_mut().unwrap().vrings[0];
                if let Some(a) = v.addr.as_mut() {
                    a.used = a.used.wrapping_add(1 << 40);
                }
            }),
        ),
    ]
}

/// Corrupt saved states are refused with an error (no panic, nothing taken from the
/// rings), and the old device runs on after `resume`.
#[test]
fn corrupt_states_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let disk = disk();
    let a = start(&sock, &disk, PollMode::Adaptive);
    let mut raw = FakeFrontend::connect(&sock);
    raw.header(T_OUT, 0);
    raw.put(DATA, &[0x77; 512]);
    assert_eq!(
        raw.request(&[(HDR, 16, false), (DATA, 512, false), (STATUS, 1, true)]),
        0
    );
    a.pause(PAUSE).unwrap();
    for (what, corrupt) in corruptions() {
        let (mut state, mut fds) = a.save().unwrap();
        corrupt(&mut state, &mut fds);
        let r = VhostUserBlk::restore(
            &sock,
            disk.clone(),
            opts(PollMode::Adaptive),
            &engine(),
            &[0],
            state,
            fds,
        );
        assert!(r.is_err(), "{what}: accepted");
        eprintln!("{what}: {}", r.err().unwrap());
    }
    // Nothing was taken from the ring meanwhile; A runs on.
    a.resume();
    raw.header(T_IN, 0);
    raw.put(DATA, &[0; 512]);
    assert_eq!(
        raw.request(&[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)]),
        0
    );
    assert_eq!(raw.get(DATA, 512), vec![0x77; 512]);
    assert_eq!(a.connections(), 1);
    a.stop();
}

#[test]
fn save_needs_a_pause() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let disk = disk();
    let a = start(&sock, &disk, PollMode::Adaptive);
    assert!(a.save().is_err());
    a.pause(PAUSE).unwrap();
    a.pause(PAUSE).unwrap();
    assert!(a.save().is_ok());
    a.resume();
    assert!(a.save().is_err());
    blkio_round(&sock, 0x44);
    a.stop();
}

/// The relay's own channels move too: the inflight area (the new device logs in
/// it) and the backend request channel (a resize after the handover is announced
/// on it).
#[test]
fn inflight_area_and_backend_channel_move() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let disk = disk();
    let a = start(&sock, &disk, PollMode::Adaptive);
    let area = get_inflight_area(&sock);
    let pf = VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::BACKEND_REQ
        | VhostUserProtocolFeatures::REPLY_ACK;
    let mem = SharedMem::new("guest", MEM).unwrap();
    let mut raw = FakeFrontend::connect_with(
        &sock,
        Connect {
            inflight: Some(&area),
            protocol: pf,
            ..Connect::new(mem)
        },
    );
    let (mut mine, theirs) = UnixStream::pair().unwrap();
    mine.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    raw.fe.set_backend_request_fd(&theirs).unwrap();
    raw.header(T_OUT, 0);
    raw.put(DATA, &[0x66; 512]);
    assert_eq!(
        raw.request(&[(HDR, 16, false), (DATA, 512, false), (STATUS, 1, true)]),
        0
    );
    a.pause(PAUSE).unwrap();
    let (state, fds) = a.save().unwrap();
    let rec = state.connection.as_ref().unwrap();
    assert!(rec.inflight.is_some() && rec.backend_req.is_some());
    assert_eq!(rec.vrings[0].base, 1);
    let b = VhostUserBlk::restore(
        &sock,
        disk.clone(),
        opts(PollMode::Adaptive),
        &engine(),
        &[0],
        state,
        fds,
    )
    .unwrap();
    a.stop();
    b.resume();
    raw.header(T_IN, 0);
    raw.put(DATA, &[0; 512]);
    assert_eq!(
        raw.request(&[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)]),
        0
    );
    assert_eq!(raw.get(DATA, 512), vec![0x66; 512]);
    // The area's used index (bytes 14..16 of queue 0's region) follows the ring.
    let mut log = [0u8; 16];
    std::os::unix::fs::FileExt::read_exact_at(&area, &mut log, 0).unwrap();
    assert_eq!(u16::from_le_bytes([log[14], log[15]]), 2);
    let bigger = disk.resize(DISK * 2).unwrap();
    assert_eq!(
        b.resize(bigger).unwrap(),
        vhost_user_blk::ConfigNotice::Sent
    );
    let mut hdr = [0u8; 12];
    mine.read_exact(&mut hdr).unwrap();
    assert_eq!(u32::from_le_bytes(hdr[0..4].try_into().unwrap()), 2);
    b.stop();
}
