//! Each thread role of a serving server runs under its own filter: when a
//! thread of the role makes a call the role does not allow, the server stops
//! and its last line names the role and the call. The thread is picked with
//! `$UDRIVE_FORBIDDEN_CALL` (a prefix of its name), which only a build with the
//! `test-hooks` feature reads:
//! `cargo test -p udrive --features test-hooks --test sandbox_roles`.
#![cfg(feature = "test-hooks")]

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::control::serve_opts;
use initiator::NvmeDriver;
use serde_json::json;
use test_support::wait::poll_until;

/// How long a server may take to reach the thread and stop.
const LIMIT: Duration = Duration::from_secs(60);

/// What brings a thread of the role into being once the server runs.
#[derive(Clone, Copy)]
enum Provoke {
    /// It starts with the server.
    Nothing,
    /// An NVMe client connects and enables the controller.
    NvmeClient,
    /// A vhost-user-blk device is added over the control socket.
    VhostDevice,
    /// ... and a libblkio client starts its queues.
    VhostClient,
}

fn start(dir: &Path, thread: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(["serve", "--cpus", "0", "--ns", "ram:16M", "--vfio-user"])
        .arg(dir.join("a.sock"))
        .arg("--rpc")
        .arg(dir.join("rpc.sock"))
        .args(["--metrics-listen", "127.0.0.1:0"])
        .env(sandbox::hook::VAR, thread)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run udrive serve")
}

/// Waits for `path` to exist while `child` runs; false if it stopped first.
fn wait_for(child: &mut Child, path: &Path) -> bool {
    poll_until(LIMIT, || {
        path.exists() || matches!(child.try_wait(), Ok(Some(_)))
    }) && path.exists()
}

/// Does what `how` says; each step may fail once the server has stopped, so
/// failures are ignored (the exit status and the log are what is checked).
fn provoke(child: &mut Child, dir: &Path, how: Provoke) {
    let (rpc, nvme, vhost) = (dir.join("rpc.sock"), dir.join("a.sock"), dir.join("v.sock"));
    match how {
        Provoke::Nothing => {}
        Provoke::NvmeClient => {
            if wait_for(child, &nvme) {
                let _ = NvmeDriver::connect(&nvme, serve_opts());
            }
        }
        Provoke::VhostDevice | Provoke::VhostClient => {
            if !wait_for(child, &rpc) {
                return;
            }
            let params = json!({"socket": vhost, "disk": "ram:8M"});
            let added = send(&rpc, "vhost_user_blk_add", params);
            if added && matches!(how, Provoke::VhostClient) {
                let _ = test_support::blkio::BlkioSession::open(&vhost);
            }
        }
    }
}

/// Sends one request; whether it succeeded. The server may stop before it
/// answers (the thread it starts breaks its filter at once): no answer is a
/// `false`, not a failure.
fn send(rpc: &Path, method: &str, params: serde_json::Value) -> bool {
    use std::io::{BufRead, Write};
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(rpc) else {
        return false;
    };
    let req = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": 1});
    if s.write_all(format!("{req}\n").as_bytes()).is_err() {
        return false;
    }
    let _ = s.set_read_timeout(Some(LIMIT));
    let mut line = String::new();
    let _ = std::io::BufReader::new(s).read_line(&mut line);
    serde_json::from_str::<serde_json::Value>(&line).is_ok_and(|r| r.get("result").is_some())
}

fn wait_exit(child: &mut Child) -> Option<std::process::ExitStatus> {
    let mut status = None;
    poll_until(LIMIT, || {
        status = child.try_wait().ok().flatten();
        status.is_some()
    });
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    status
}

/// Starts a server whose thread named `thread…` breaks its filter, provokes
/// the thread, and checks the server stopped naming `role`.
fn check(thread: &str, role: &str, how: Provoke) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = start(dir.path(), thread);
    let mut stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    provoke(&mut child, dir.path(), how);
    let status = wait_exit(&mut child);
    let log = log.join().unwrap_or_default();
    let code = status.and_then(|s| s.code());
    assert_eq!(
        code,
        Some(128 + libc::SIGSYS),
        "{thread}: {status:?}\n{log}"
    );
    let want = format!("the {role} thread made the system call ptrace (101)");
    assert!(log.contains(&want), "{thread}: no {want:?} in\n{log}");
}

#[test]
fn a_control_thread_breaking_its_filter_stops_the_server() {
    check("rpc-accept", "control", Provoke::Nothing);
}

#[test]
fn the_metrics_thread_breaking_its_filter_stops_the_server() {
    check("metrics-http", "metrics", Provoke::Nothing);
}

#[test]
fn the_vfio_user_hub_breaking_its_filter_stops_the_server() {
    check("vfu-hub", "vfio-user hub", Provoke::Nothing);
}

#[test]
fn a_vfio_user_connection_thread_breaking_its_filter_stops_the_server() {
    check("vfu-UD", "vfio-user connection", Provoke::NvmeClient);
}

#[test]
fn the_nvme_admin_thread_breaking_its_filter_stops_the_server() {
    check("nvme-admin", "nvme admin", Provoke::NvmeClient);
}

#[test]
fn a_reactor_breaking_its_filter_stops_the_server() {
    check("reactor0", "reactor", Provoke::Nothing);
}

#[test]
fn a_vhost_user_device_thread_breaking_its_filter_stops_the_server() {
    check("vhost-blk", "vhost-user device", Provoke::VhostDevice);
}

#[test]
fn a_vhost_user_kick_thread_breaking_its_filter_stops_the_server() {
    check("vhost-blk-kick", "vhost-user kick", Provoke::VhostClient);
}
