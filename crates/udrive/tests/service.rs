//! What a systemd unit drives, with a datagram socket in `NOTIFY_SOCKET` standing in
//! for the service manager: READY, RELOADING and STOPPING; reloading the
//! configuration file (SIGHUP, `reload_config`: devices and namespaces added,
//! changed and removed, a device with a connected client left alone); and
//! `udrive upgrade` of a service, whose successor the server starts itself and
//! which names itself the main process.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::control::{serve_opts, Serve};
use initiator::NvmeDriver;
use serde_json::{json, Value};
use test_support::T;

/// A stand-in for systemd's notification socket.
struct Notify {
    sock: UnixDatagram,
}

impl Notify {
    fn bind(path: &Path) -> Notify {
        let sock = UnixDatagram::bind(path).unwrap();
        sock.set_read_timeout(Some(T)).unwrap();
        Notify { sock }
    }

    /// The next message, as its `KEY=value` lines.
    fn next(&self) -> Vec<String> {
        let mut buf = [0u8; 4096];
        let n = self.sock.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n])
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Waits for a message with `line`, skipping others.
    fn expect(&self, line: &str) -> Vec<String> {
        loop {
            let m = self.next();
            if m.iter().any(|l| l == line) {
                return m;
            }
        }
    }
}

fn write_config(dir: &Path, body: &str) {
    let text = format!(
        "cpus = \"0\"\nrpc = \"{}\"\n{body}",
        dir.join("rpc.sock").display()
    );
    std::fs::write(dir.join("udrive.toml"), text).unwrap();
}

fn controller(dir: &Path, name: &str, extra: &str) -> String {
    format!(
        "[[controller]]\nsocket = \"{}\"\n{extra}\n",
        dir.join(name).display()
    )
}

fn vhost(dir: &Path, name: &str, disk: &str) -> String {
    format!(
        "[[vhost_user_blk]]\nsocket = \"{}\"\ndisk = \"{disk}\"\n",
        dir.join(name).display()
    )
}

fn start(dir: tempfile::TempDir, notify: &Path) -> Serve {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_udrive"));
    cmd.args(["serve", "--config"])
        .arg(dir.path().join("udrive.toml"))
        .env("NOTIFY_SOCKET", notify);
    let (rpc, nvme) = (dir.path().join("rpc.sock"), dir.path().join("a.sock"));
    Serve::spawn(cmd, dir, rpc, nvme)
}

fn devices(s: &Serve) -> Vec<Value> {
    s.ok("get_devices", json!({})).as_array().unwrap().clone()
}

fn specs(d: &Value) -> Vec<(u64, String)> {
    d["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["nsid"].as_u64().unwrap(),
                n["spec"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn sighup(s: &Serve) {
    // SAFETY: kill(2) on our own child's pid has no memory effects.
    assert_eq!(unsafe { libc::kill(s.pid(), libc::SIGHUP) }, 0);
}

#[test]
fn reload_applies_the_file_and_spares_connected_devices() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let notify_path = d.join("notify");
    let notify = Notify::bind(&notify_path);
    write_config(
        &d,
        &(controller(&d, "a.sock", "namespaces = [\"ram:64M\"]") + &vhost(&d, "v.sock", "ram:32M")),
    );
    let mut s = start(dir, &notify_path);
    let ready = notify.expect("READY=1");
    assert!(ready
        .iter()
        .any(|l| l.starts_with("STATUS=serving 2 device")));

    // SIGHUP: a namespace and a controller added, QoS set, a device removed.
    write_config(
        &d,
        &(controller(
            &d,
            "a.sock",
            "namespaces = [\"ram:64M,iops=1000\", \"ram:16M\"]",
        ) + &controller(&d, "b.sock", "namespaces = [\"null:1G\"]")),
    );
    sighup(&s);
    notify.expect("RELOADING=1");
    notify.expect("READY=1");
    let devs = devices(&s);
    assert_eq!(devs.len(), 2, "{devs:?}");
    assert_eq!(
        specs(&devs[0]),
        [(1, "ram:64M".to_string()), (2, "ram:16M".to_string())]
    );
    assert_eq!(devs[0]["namespaces"][0]["qos"]["iops"], 1000);
    assert!(devs[1]["socket"].as_str().unwrap().ends_with("b.sock"));
    assert!(
        !d.join("v.sock").exists(),
        "removed device's socket is gone"
    );

    // The guest-visible effect: a driver sees both namespaces.
    let drv = NvmeDriver::connect(d.join("a.sock"), serve_opts()).unwrap();
    let ns: Vec<u32> = drv.namespaces().iter().map(|n| n.nsid).collect();
    assert_eq!(ns, [1, 2]);

    // A fixed setting changed: the idle controller b is re-created, the connected
    // one (a) is left alone and the reload says so; `cpus` needs a restart.
    let text = |cpus: &str| {
        format!(
            "cpus = \"{cpus}\"\nrpc = \"{}\"\n{}{}",
            d.join("rpc.sock").display(),
            controller(
                &d,
                "a.sock",
                "io_queues = 2\nnamespaces = [\"ram:64M,iops=1000\", \"ram:16M\"]"
            ),
            controller(&d, "b.sock", "io_queues = 3\nnamespaces = [\"null:1G\"]")
        )
    };
    std::fs::write(d.join("udrive.toml"), text("0-1")).unwrap();
    let (code, msg) = s.call("reload_config", json!({})).unwrap_err();
    assert_eq!(code, -32000);
    assert!(msg.contains("a client is connected"), "{msg}");
    assert!(msg.contains("b.sock (io_queues changed)"), "{msg}");
    let devs = devices(&s);
    assert_eq!(devs.len(), 2);
    assert_eq!(devs[0]["connected"], true, "the connected controller stays");
    drop(drv);

    // Once the client is gone the same file applies; the report names the rest.
    common::control::wait_disconnected(&s, &d.join("a.sock"));
    let r = s.ok("reload_config", json!({}));
    assert!(r["failed"].as_array().unwrap().is_empty(), "{r}");
    assert!(
        r["needs_restart"][0].as_str().unwrap().contains("cpus"),
        "{r}"
    );
    assert!(
        r["applied"][0]
            .as_str()
            .unwrap()
            .contains("io_queues changed"),
        "{r}"
    );

    // A broken file changes nothing.
    std::fs::write(d.join("udrive.toml"), "controller = 3").unwrap();
    let (_, msg) = s.call("reload_config", json!({})).unwrap_err();
    assert!(msg.contains("is not valid"), "{msg}");
    assert_eq!(devices(&s).len(), 2);

    s.terminate().expect("exits after SIGTERM");
    notify.expect("STOPPING=1");
}

#[test]
fn reload_without_a_config_file_says_what_to_do() {
    let s = Serve::start(&[]);
    let (_, msg) = s.call("reload_config", json!({})).unwrap_err();
    assert!(msg.contains("--config"), "{msg}");
    // SIGHUP without a file is logged, not fatal.
    sighup(&s);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.ok("get_version", json!({}))["name"], "udrive");
}

#[test]
fn upgrade_of_a_service_keeps_the_client_and_moves_the_main_pid() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let notify_path = d.join("notify");
    let notify = Notify::bind(&notify_path);
    // A ram disk's data would not move with a handover: a file.
    let img = d.join("a.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let ns = format!("namespaces = [\"file:{}\"]", img.display());
    write_config(&d, &controller(&d, "a.sock", &ns));
    let mut s = start(dir, &notify_path);
    notify.expect("READY=1");
    let old = s.pid();
    assert_eq!(s.ok("get_version", json!({}))["service_manager"], true);

    let drv = NvmeDriver::connect(d.join("a.sock"), serve_opts()).unwrap();
    common::control::round_trip(&drv, 3);
    // A client may not pick the binary a service execs.
    let out = common::control::udrive(&[
        "upgrade",
        "--rpc",
        d.join("rpc.sock").to_str().unwrap(),
        "--binary",
        "/bin/true",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("service manager"));

    common::control::udrive_ok(&["upgrade", "--rpc", d.join("rpc.sock").to_str().unwrap()]);
    let new = s.ok("get_version", json!({}))["pid"].as_u64().unwrap();
    let successor = KillOnDrop(new as i32);
    assert_ne!(new, old as u64);
    let m = notify.expect(&format!("MAINPID={new}"));
    assert!(!m.iter().any(|l| l == "STOPPING=1"), "{m:?}");
    notify.expect("READY=1");
    // The old process exited without telling the manager it stops.
    let st = s.terminate().expect("the old server exited");
    assert!(st.success(), "{st:?}");
    common::control::round_trip(&drv, 4);
    drop(drv);

    drop(successor);
    notify.expect("STOPPING=1");
}

/// The successor is no child of this test: SIGTERM on drop, also when an
/// assertion fails.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the successor's pid has no memory effects.
        unsafe { libc::kill(self.0, libc::SIGTERM) };
    }
}
