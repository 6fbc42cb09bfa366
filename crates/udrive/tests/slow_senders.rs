//! Slow senders: a message must arrive whole within a deadline once it has started
//! (vfio-user, vhost-user, JSON-RPC), and a flood of idle or slow control
//! connections must not lock the operator out. The deadline is shortened for this
//! test binary (`UDRIVE_MSG_DEADLINE_MS`), so nothing here waits for the default.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const DEADLINE_MS: &str = "400";

fn short_deadline() {
    // Read once per process by the servers; every test sets the same value first.
    std::env::set_var("UDRIVE_MSG_DEADLINE_MS", DEADLINE_MS);
}

/// Sends `first`, then one byte of `rest` every 100 ms; returns when the peer
/// closed the connection (true) or after 5 s (false).
fn trickle(s: &mut UnixStream, first: &[u8], rest: &[u8]) -> bool {
    s.write_all(first).unwrap();
    let start = Instant::now();
    for b in rest {
        std::thread::sleep(Duration::from_millis(100));
        if s.write_all(&[*b]).is_err() {
            return true;
        }
        let _ = s.set_read_timeout(Some(Duration::from_millis(1)));
        let mut x = [0u8; 64];
        match s.read(&mut x) {
            Ok(0) => return true,
            Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => return true,
            _ => {}
        }
        if start.elapsed() > Duration::from_secs(5) {
            return false;
        }
    }
    false
}

#[test]
fn vfio_user_message_trickled_byte_by_byte() {
    short_deadline();
    let by = bystander();
    by.check();
    let dev = TestDev::start("trickle", &["ram:16M"]);
    let mut s = UnixStream::connect(&dev.sock).unwrap();
    // VERSION declaring a 1 MiB message, then a byte every 100 ms.
    let mut hdr = Vec::new();
    hdr.extend_from_slice(&1u16.to_le_bytes()); // id
    hdr.extend_from_slice(&1u16.to_le_bytes()); // VERSION
    hdr.extend_from_slice(&(1u32 << 20).to_le_bytes());
    hdr.extend_from_slice(&0u32.to_le_bytes());
    hdr.extend_from_slice(&0u32.to_le_bytes());
    assert!(
        trickle(&mut s, &hdr, &[b'x'; 100]),
        "the device dropped the slow sender"
    );
    dev.check_fresh_client(41);
    by.check();
}

#[test]
fn vhost_user_message_trickled_byte_by_byte() {
    short_deadline();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let cfg = udrive::vhost_device::VhostBlkConfig::new(sock.clone(), "ram:4M".parse().unwrap());
    let e = engine::Engine::start(&[None]).unwrap();
    let dev = udrive::vhost_device::open_and_start(&cfg, &e, 1).unwrap();
    let mut s = UnixStream::connect(&sock).unwrap();
    // GET_FEATURES header, its size field saying 8 bytes follow, sent slowly.
    let mut hdr = Vec::new();
    hdr.extend_from_slice(&1u32.to_le_bytes());
    hdr.extend_from_slice(&1u32.to_le_bytes());
    hdr.extend_from_slice(&8u32.to_le_bytes());
    assert!(trickle(&mut s, &hdr[..4], &[0u8; 60]), "relay dropped it");
    // The device takes the next front end.
    let fe = vhost::vhost_user::Frontend::connect(&sock, 1).unwrap();
    use vhost::VhostBackend;
    fe.set_owner().unwrap();
    assert!(fe.get_features().is_ok());
    drop(fe);
    dev.stop();
    e.shutdown();
}

struct Serve {
    child: Child,
    rpc: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Serve {
    fn start() -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let rpc = dir.path().join("rpc.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["serve", "--cpus", "0", "--ns", "ram:16M", "--vfio-user"])
            .arg(dir.path().join("n.sock"))
            .arg("--rpc")
            .arg(&rpc)
            .env("UDRIVE_MSG_DEADLINE_MS", DEADLINE_MS)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_until("control socket", Duration::from_secs(20), || rpc.exists());
        Serve {
            child,
            rpc,
            _dir: dir,
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rpc_call(sock: &Path) -> bool {
    Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(["rpc", "--socket"])
        .arg(sock)
        .arg("get_devices")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn rpc_slow_and_idle_clients_cannot_lock_out_the_operator() {
    let s = Serve::start();
    // One byte per 100 ms: dropped by the message deadline, not the 60 s idle one.
    let mut slow = UnixStream::connect(&s.rpc).unwrap();
    assert!(
        trickle(&mut slow, b"{", &[b' '; 40]),
        "slow RPC sender dropped"
    );
    // Every slot taken by idle connections and slow senders...
    let mut hogs: Vec<UnixStream> = (0..udrive::rpc::MAX_CONNECTIONS + 16)
        .map(|i| {
            let mut c = UnixStream::connect(&s.rpc).unwrap();
            if i % 2 == 0 {
                let _ = c.write_all(b"{\"jsonrpc\":");
            }
            c
        })
        .collect();
    // ... and still the operator gets answers, again and again.
    for _ in 0..5 {
        assert!(rpc_call(&s.rpc), "a legitimate call was locked out");
    }
    hogs.clear();
    assert!(rpc_call(&s.rpc));
}
