//! The control socket over a real `udrive serve --rpc` process: every method,
//! hostile input, devices in use, namespace hot add/remove under I/O seen by the
//! userspace initiator, and the Prometheus endpoint.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use initiator::{DataMode, DriverOpts, IoOp, NvmeDriver};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(10);

/// `udrive serve` in a temp dir; SIGTERM and wait on drop.
struct Serve {
    child: Child,
    dir: tempfile::TempDir,
    rpc: PathBuf,
    nvme: PathBuf,
    banner: Vec<String>,
}

impl Serve {
    fn start(extra: &[&str]) -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let rpc = dir.path().join("rpc.sock");
        let nvme = dir.path().join("a.sock");
        let mut child = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["serve", "--cpus", "0", "--ns", "ram:64M", "--vfio-user"])
            .arg(&nvme)
            .arg("--rpc")
            .arg(&rpc)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run udrive serve");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        let mut banner = Vec::new();
        loop {
            let l = rx.recv_timeout(T).expect("udrive serve did not start");
            let done = l.starts_with("Stop with");
            banner.push(l);
            if done {
                break;
            }
        }
        Serve {
            child,
            dir,
            rpc,
            nvme,
            banner,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn call(&self, method: &str, params: Value) -> Result<Value, (i64, String)> {
        call(&self.rpc, method, params)
    }

    fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params)
            .unwrap_or_else(|e| panic!("{method} failed: {e:?}"))
    }

    /// Calls that must fail with `code` and a message containing `want`.
    #[track_caller]
    fn err(&self, method: &str, params: Value, code: i64, want: &str) {
        match self.call(method, params) {
            Ok(v) => panic!("{method} succeeded: {v}"),
            Err((c, m)) => {
                assert_eq!(c, code, "{method}: {m}");
                assert!(m.contains(want), "{method}: `{want}` not in `{m}`");
            }
        }
    }
}

impl Serve {
    /// SIGTERM, then wait (bounded); `None` if it had to be killed.
    fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(st);
        }
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < T {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.terminate();
    }
}

fn connect(sock: &Path) -> UnixStream {
    let s = UnixStream::connect(sock).expect("connect control socket");
    s.set_read_timeout(Some(T)).unwrap();
    s
}

/// Reads one newline-terminated reply.
fn read_reply(s: &mut UnixStream) -> Option<Value> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return None,
            Ok(_) if b[0] == b'\n' => break,
            Ok(_) => line.push(b[0]),
        }
    }
    Some(serde_json::from_slice(&line).expect("reply is JSON"))
}

fn call(sock: &Path, method: &str, params: Value) -> Result<Value, (i64, String)> {
    let mut s = connect(sock);
    let req = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": 7});
    s.write_all(format!("{req}\n").as_bytes()).unwrap();
    let r = read_reply(&mut s).expect("a reply");
    // A refusal at accept time (connection limit) cannot know the request's id.
    if r["id"].is_null()
        && r["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("too many"))
    {
        return Err((
            r["error"]["code"].as_i64().unwrap_or(0),
            r["error"]["message"].to_string(),
        ));
    }
    assert_eq!(r["id"], 7);
    match r.get("error") {
        Some(e) => Err((
            e["code"].as_i64().unwrap(),
            e["message"].as_str().unwrap().to_string(),
        )),
        None => Ok(r["result"].clone()),
    }
}

/// `get_stats`: the sum of `what` (ops or bytes) of `op` over every queue and
/// namespace of device `dev`.
fn ns_sum(st: &Value, dev: usize, what: &str, op: &str) -> u64 {
    st["devices"][dev]["queues"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|q| q["namespaces"].as_array().unwrap())
        .map(|n| n[what][op].as_u64().unwrap())
        .sum()
}

fn error_code(v: &Value) -> i64 {
    v["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("no error in {v}"))
}

fn opts() -> DriverOpts {
    DriverOpts {
        pool_bytes: 16 << 20,
        io_queues: 4,
        admin_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Writes a pattern to `nsid` and reads it back; panics on any error.
fn verified_io(d: &NvmeDriver, nsid: u32, seed: u8) {
    let mut qp = d.create_qpair(16, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    let data = vec![seed; 4096];
    buf.write(0, &data).unwrap();
    let lba = u64::from(seed) * 8;
    let c = qp
        .submit_io(IoOp::Write, nsid, lba, 8, Some(&buf), DataMode::Prp)
        .unwrap();
    qp.ring().unwrap();
    let w = qp.wait(c, T).unwrap();
    assert!(w.status.is_ok(), "write to ns {nsid}: {}", w.status);
    buf.fill(0);
    let c = qp
        .submit_io(IoOp::Read, nsid, lba, 8, Some(&buf), DataMode::Prp)
        .unwrap();
    qp.ring().unwrap();
    let r = qp.wait(c, T).unwrap();
    assert!(r.status.is_ok(), "read from ns {nsid}: {}", r.status);
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    d.delete_qpair(qp).unwrap();
}

#[test]
fn every_method_over_the_socket() {
    let s = Serve::start(&[]);
    let mode = std::fs::metadata(&s.rpc).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "control socket mode");
    let a = s.nvme.to_str().unwrap().to_string();
    let b = s.path("b.sock").to_str().unwrap().to_string();

    let v = s.ok("get_version", Value::Null);
    assert_eq!(v["name"], "udrive");
    let m = s.ok("rpc_get_methods", json!({}));
    for name in [
        "get_version",
        "rpc_get_methods",
        "get_devices",
        "nvme_add_controller",
        "nvme_remove_controller",
        "nvme_add_namespace",
        "nvme_remove_namespace",
        "set_qos",
        "clear_qos",
        "resize",
        "set_placement",
        "set_poll_mode",
        "vhost_user_blk_add",
        "vhost_user_blk_remove",
        "get_stats",
        "get_metrics",
    ] {
        assert!(
            m.as_array().unwrap().contains(&json!(name)),
            "{name} missing"
        );
    }

    let d = s.ok("get_devices", json!({}));
    assert_eq!(d.as_array().unwrap().len(), 1);
    assert_eq!(d[0]["socket"], a);
    assert_eq!(d[0]["connected"], false);
    assert_eq!(d[0]["namespaces"][0]["spec"], "ram:64M");

    let added = s.ok(
        "nvme_add_controller",
        json!({"socket": b, "namespaces": ["ram:16M", "null:1G,bs=4096"], "io_queues": 4, "placement": "single", "serial": "vm-b"}),
    );
    assert_eq!(added["serial"], "vm-b");
    assert_eq!(added["namespaces"][1]["block_size"], 4096);
    assert!(Path::new(&b).exists());
    s.err(
        "nvme_add_controller",
        json!({"socket": b, "namespaces": ["ram:1M"]}),
        -32000,
        "already has a device",
    );
    let d = s.ok("get_devices", json!({"socket": b}));
    assert_eq!(d[0]["placement"], "single");
    assert_eq!(d[0]["io_queues"], 4);

    let ns = s.ok("nvme_add_namespace", json!({"socket": b, "spec": "ram:8M"}));
    assert_eq!(ns["nsid"], 3);
    let ns = s.ok(
        "nvme_add_namespace",
        json!({"socket": b, "spec": "null:1G", "nsid": 10}),
    );
    assert_eq!(ns["nsid"], 10);
    s.err(
        "nvme_add_namespace",
        json!({"socket": b, "spec": "null:1G", "nsid": 10}),
        -32000,
        "already exists",
    );
    s.err(
        "nvme_add_namespace",
        json!({"socket": b, "spec": "null:1G", "nsid": 33}),
        -32000,
        "out of range",
    );
    s.err(
        "nvme_add_namespace",
        json!({"socket": b, "spec": "disk:1G"}),
        -32602,
        "unknown kind",
    );

    let q = s.ok(
        "set_qos",
        json!({"socket": b, "nsid": 3, "iops": 5000, "bw": "100M"}),
    );
    assert_eq!(q["iops"], 5000);
    assert_eq!(q["bw"], 100 << 20);
    let q = s.ok("set_qos", json!({"socket": b, "nsid": 3, "iops": 0}));
    assert_eq!(q["iops"], Value::Null, "0 removes one limit");
    assert_eq!(q["bw"], 100 << 20, "others stay");
    let d = s.ok("get_devices", json!({"socket": b}));
    let ns3 = d[0]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["nsid"] == 3)
        .unwrap()
        .clone();
    assert_eq!(ns3["qos"]["bw"], 100 << 20);
    let q = s.ok("clear_qos", json!({"socket": b, "nsid": 3}));
    assert_eq!(q["bw"], Value::Null);
    s.err(
        "set_qos",
        json!({"socket": b, "nsid": 3}),
        -32602,
        "at least one",
    );
    s.err(
        "set_qos",
        json!({"socket": b, "nsid": 4, "iops": 1}),
        -32000,
        "no namespace 4",
    );

    s.ok(
        "set_placement",
        json!({"socket": b, "placement": "round-robin"}),
    );
    s.err(
        "set_placement",
        json!({"socket": b, "placement": "fastest"}),
        -32602,
        "unknown placement",
    );

    let st = s.ok("get_stats", json!({}));
    assert_eq!(st["devices"].as_array().unwrap().len(), 2);
    assert_eq!(st["reactors"].as_array().unwrap().len(), 1);
    assert_eq!(ns_sum(&st, 0, "ops", "read"), 0);
    let st = s.ok("get_stats", json!({"socket": a}));
    assert_eq!(st["devices"].as_array().unwrap().len(), 1);

    let text = s.ok("get_metrics", json!({}));
    let text = text.as_str().unwrap();
    assert!(
        text.contains("# TYPE udrive_io_ops_total counter"),
        "{text}"
    );
    assert!(text.contains("udrive_reactor_polls_total{reactor=\"0\",state=\"busy\"}"));

    s.ok("nvme_remove_namespace", json!({"socket": b, "nsid": 10}));
    s.err(
        "nvme_remove_namespace",
        json!({"socket": b, "nsid": 10}),
        -32000,
        "does not exist",
    );
    s.ok("nvme_remove_controller", json!({"socket": b}));
    assert!(!Path::new(&b).exists(), "socket removed");
    s.err(
        "nvme_remove_controller",
        json!({"socket": b}),
        -32000,
        "no device",
    );

    // The CLI: pretty result, and a message + non-zero exit on errors.
    let out = udrive_ok(&[
        "rpc",
        "--socket",
        s.rpc.to_str().unwrap(),
        "get_devices",
        &json!({"socket": a}).to_string(),
    ]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v[0]["socket"], a);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\n  "),
        "pretty"
    );
    let out = udrive(&[
        "rpc",
        "--socket",
        s.rpc.to_str().unwrap(),
        "nvme_remove_namespace",
        "{\"socket\":\"nope.sock\",\"nsid\":1}",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no device on socket nope.sock"), "{err}");
    let out = udrive_ok(&["metrics", "--rpc", s.rpc.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("udrive_reactor_polls_total"));

    // SIGTERM: clean exit, control and device sockets removed.
    let mut s = s;
    let st = s.terminate().expect("exits after SIGTERM");
    assert!(st.success(), "{st:?}");
    assert!(!s.rpc.exists() && !s.nvme.exists(), "sockets removed");
}

#[test]
fn hostile_input_gets_clear_errors_and_the_server_keeps_serving() {
    let s = Serve::start(&[]);
    let a = s.nvme.to_str().unwrap().to_string();

    // Malformed JSON that can be delimited: -32700, the connection stays usable.
    let mut c = connect(&s.rpc);
    c.write_all(b"{\"jsonrpc\":\"2.0\",,}\n").unwrap();
    let r = read_reply(&mut c).unwrap();
    assert_eq!(error_code(&r), -32700);
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("malformed JSON"));
    // Back-to-back objects without separators, and a notification (no reply).
    c.write_all(
        br#"{"jsonrpc":"2.0","method":"get_version"}{"jsonrpc":"2.0","method":"get_version","id":"x"}"#,
    )
    .unwrap();
    let r = read_reply(&mut c).unwrap();
    assert_eq!(r["id"], "x");
    assert_eq!(r["result"]["name"], "udrive");

    let cases: Vec<(Value, i64, &str)> = vec![
        (
            json!({"jsonrpc": "2.0", "method": "get_devices", "params": {"socket": 5}, "id": 1}),
            -32602,
            "invalid type",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "get_devices", "params": {"bogus": 1}, "id": 1}),
            -32602,
            "unknown field `bogus`",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "get_devices", "params": [1], "id": 1}),
            -32602,
            "object of named parameters",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "nvme_remove_namespace", "params": {"socket": a}, "id": 1}),
            -32602,
            "missing field `nsid`",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "nvme_remove_namespace", "params": {"socket": a, "nsid": -1}, "id": 1}),
            -32602,
            "invalid value",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "make_coffee", "id": 1}),
            -32601,
            "unknown method `make_coffee`",
        ),
        (
            json!({"method": "get_version", "id": 1}),
            -32600,
            "\"jsonrpc\" must be \"2.0\"",
        ),
        (
            json!({"jsonrpc": "2.0", "method": 3, "id": 1}),
            -32600,
            "\"method\" must be a string",
        ),
        (
            json!({"jsonrpc": "2.0", "id": 1}),
            -32600,
            "\"method\" is missing",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "get_version", "id": [1]}),
            -32600,
            "\"id\"",
        ),
        (json!([]), -32600, "empty batch"),
    ];
    for (req, code, want) in cases {
        c.write_all(format!("{req}\n").as_bytes()).unwrap();
        let r = read_reply(&mut c).expect("reply");
        assert_eq!(error_code(&r), code, "{req}: {r}");
        let m = r["error"]["message"].as_str().unwrap();
        assert!(m.contains(want), "{req}: `{want}` not in `{m}`");
    }
    // A batch: one reply array, in order, errors per entry.
    c.write_all(
        br#"[{"jsonrpc":"2.0","method":"get_version","id":1},7,{"jsonrpc":"2.0","method":"nope","id":2}]"#,
    )
    .unwrap();
    let r = read_reply(&mut c).unwrap();
    let r = r.as_array().unwrap();
    assert_eq!(r.len(), 3);
    assert_eq!(r[0]["result"]["name"], "udrive");
    assert_eq!(error_code(&r[1]), -32600);
    assert_eq!(error_code(&r[2]), -32601);

    // Bytes that cannot start JSON: -32700, then the connection closes.
    let mut j = connect(&s.rpc);
    j.write_all(b"hello\n").unwrap();
    assert_eq!(error_code(&read_reply(&mut j).unwrap()), -32700);
    assert!(read_reply(&mut j).is_none(), "closed after junk");

    // A huge message: -32600 once it passes 1 MiB, then close.
    let mut h = connect(&s.rpc);
    let huge = format!(
        "{{\"jsonrpc\":\"2.0\",\"method\":\"get_version\",\"params\":{{\"x\":\"{}\"}},\"id\":1}}",
        "a".repeat(2 << 20)
    );
    let _ = h.write_all(huge.as_bytes());
    let r = read_reply(&mut h).unwrap();
    assert_eq!(error_code(&r), -32600);
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("larger than"));

    // Half a message, then the client goes away.
    for _ in 0..20 {
        let mut p = connect(&s.rpc);
        p.write_all(b"{\"jsonrpc\":\"2.0\",\"method\":\"get_dev")
            .unwrap();
    }

    // Many connections at once: over the limit, a new connection closes the one
    // idle longest; every connection is either served or closed, never stuck.
    let mut many: Vec<UnixStream> = (0..80).map(|_| connect(&s.rpc)).collect();
    let mut served = 0;
    let mut closed = 0;
    for m in many.iter_mut() {
        let _ = m.write_all(b"{\"jsonrpc\":\"2.0\",\"method\":\"get_version\",\"id\":1}\n");
        match read_reply(m) {
            Some(r) if r.get("result").is_some() => served += 1,
            Some(r) => panic!("unexpected reply {r}"),
            None => closed += 1,
        }
    }
    assert_eq!(served + closed, 80);
    assert!(served >= 64, "served {served}");
    drop(many);

    // The server still serves: a follow-up call, and I/O on the device.
    let start = Instant::now();
    loop {
        match s.call("get_version", json!({})) {
            Ok(_) => break,
            Err(e) if start.elapsed() < T => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("server stopped serving: {e:?}"),
        }
    }
    let d = NvmeDriver::connect(&s.nvme, opts()).unwrap();
    verified_io(&d, 1, 3);
}

#[test]
fn removing_a_device_in_use_needs_force() {
    let s = Serve::start(&[]);
    let b = s.path("b.sock");
    s.ok(
        "nvme_add_controller",
        json!({"socket": b, "namespaces": ["ram:16M"]}),
    );
    let in_use = NvmeDriver::connect(&b, opts()).unwrap();
    verified_io(&in_use, 1, 1);
    let d = s.ok("get_devices", json!({"socket": b}));
    assert_eq!(d[0]["connected"], true);
    assert_eq!(d[0]["state"]["ready"], true);
    s.err(
        "nvme_remove_controller",
        json!({"socket": b}),
        -32000,
        "connected client",
    );
    // Still there and working.
    verified_io(&in_use, 1, 2);
    s.ok(
        "nvme_remove_controller",
        json!({"socket": b, "force": true}),
    );
    assert!(!b.exists());
    // The other device and the control socket are unaffected.
    let other = NvmeDriver::connect(&s.nvme, opts()).unwrap();
    verified_io(&other, 1, 4);
    s.ok("get_devices", json!({}));
    drop(in_use);
}

#[test]
fn hot_add_and_remove_namespace_while_io_runs_on_another() {
    let s = Serve::start(&[]);
    let mut d = NvmeDriver::connect(&s.nvme, opts()).unwrap();
    assert_eq!(d.namespaces().len(), 1);
    d.enable_ns_events().unwrap();

    // Background I/O on namespace 1 for the whole test; every error is counted.
    let stop = Arc::new(AtomicBool::new(false));
    let (ops, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut qp = d.create_qpair(32, false).unwrap();
    let bg = {
        let (stop, ops, errors) = (stop.clone(), ops.clone(), errors.clone());
        std::thread::spawn(move || {
            let buf = qp.alloc_buf(4096).unwrap();
            let mut lba = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let op = if lba.is_multiple_of(2) {
                    IoOp::Write
                } else {
                    IoOp::Read
                };
                let cid = qp
                    .submit_io(op, 1, lba % 1000 * 8, 8, Some(&buf), DataMode::Prp)
                    .unwrap();
                qp.ring().unwrap();
                let c = qp.wait(cid, T).unwrap();
                if !c.status.is_ok() {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                ops.fetch_add(1, Ordering::Relaxed);
                lba += 1;
            }
            qp
        })
    };
    while ops.load(Ordering::Relaxed) < 100 {
        std::thread::sleep(Duration::from_millis(1));
    }

    let a = s.nvme.to_str().unwrap();
    let r = s.ok(
        "nvme_add_namespace",
        json!({"socket": a, "spec": "ram:16M,bs=4096"}),
    );
    assert_eq!(r["nsid"], 2);
    let ev = d.wait_event(T).unwrap();
    assert!(ev.is_namespace_change(), "{ev:?}");
    assert_eq!(ev.log_page, 4);
    assert_eq!(d.rescan_namespaces().unwrap(), vec![2]);
    let ns2 = d.namespace(2).expect("new namespace identified").clone();
    assert_eq!((ns2.lba_size, ns2.size_bytes()), (4096, 16 << 20));
    // I/O on the new namespace (4 KiB blocks).
    {
        let mut q2 = d.create_qpair(8, false).unwrap();
        let buf = q2.alloc_buf(4096).unwrap();
        buf.write(0, &[0xab; 4096]).unwrap();
        let c = q2
            .submit_io(IoOp::Write, 2, 5, 1, Some(&buf), DataMode::Prp)
            .unwrap();
        q2.ring().unwrap();
        assert!(q2.wait(c, T).unwrap().status.is_ok());
        buf.fill(0);
        let c = q2
            .submit_io(IoOp::Read, 2, 5, 1, Some(&buf), DataMode::Prp)
            .unwrap();
        q2.ring().unwrap();
        assert!(q2.wait(c, T).unwrap().status.is_ok());
        let mut back = vec![0u8; 4096];
        buf.read(0, &mut back).unwrap();
        assert_eq!(back, vec![0xab; 4096]);

        // Hot remove while a thread keeps I/O going on it: every command either
        // completes normally or gets Invalid Namespace; nothing hangs.
        let ops2 = Arc::new(AtomicU64::new(0));
        let io2 = {
            let ops2 = ops2.clone();
            std::thread::spawn(move || {
                let mut lba = 0u64;
                loop {
                    let op = if lba.is_multiple_of(2) {
                        IoOp::Write
                    } else {
                        IoOp::Read
                    };
                    let c = q2
                        .submit_io(op, 2, lba % 4000, 1, Some(&buf), DataMode::Prp)
                        .unwrap();
                    q2.ring().unwrap();
                    let st = q2.wait(c, T).unwrap().status;
                    ops2.fetch_add(1, Ordering::Relaxed);
                    lba += 1;
                    if !st.is_ok() {
                        return (q2, st);
                    }
                }
            })
        };
        while ops2.load(Ordering::Relaxed) < 100 {
            std::thread::sleep(Duration::from_millis(1));
        }
        s.ok("nvme_remove_namespace", json!({"socket": a, "nsid": 2}));
        let (q2, st) = io2.join().unwrap();
        assert_eq!((st.sct, st.sc), (0, 0x0b), "Invalid Namespace, got {st}");
        let ev = d.wait_event(T).unwrap();
        assert!(ev.is_namespace_change());
        assert_eq!(d.rescan_namespaces().unwrap(), vec![2]);
        assert!(d.namespace(2).is_none());
        d.delete_qpair(q2).unwrap();
    }
    let before = ops.load(Ordering::Relaxed);
    while ops.load(Ordering::Relaxed) < before + 100 {
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    let qp = bg.join().unwrap();
    d.delete_qpair(qp).unwrap();
    assert_eq!(
        errors.load(Ordering::Relaxed),
        0,
        "I/O on namespace 1 unaffected"
    );
    // The counters saw the Invalid Namespace error and nothing else failed.
    let st = s.ok("get_stats", json!({"socket": a}));
    let errors: u64 = st["devices"][0]["queues"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|q| q["namespaces"].as_array().unwrap())
        .flat_map(|n| n["errors"].as_array().unwrap())
        .map(|e| e["count"].as_u64().unwrap())
        .sum();
    assert_eq!(errors, 1);
}

#[test]
fn metrics_endpoint_answers_and_rejects_junk() {
    let s = Serve::start(&["--metrics-listen", "127.0.0.1:0"]);
    let line = s
        .banner
        .iter()
        .find(|l| l.contains("metrics on http://"))
        .expect("metrics address printed");
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .trim_end_matches("/metrics")
        .to_string();
    let http = |req: &[u8]| -> String {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(T)).unwrap();
        let _ = c.write_all(req);
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    };
    let ok = http(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
    assert!(ok.contains("text/plain; version=0.0.4"));
    assert!(ok.contains("# TYPE udrive_io_ops_total counter"));
    assert!(ok.contains("udrive_reactor_polls_total{reactor=\"0\",state=\"idle\"}"));
    let body = ok.split("\r\n\r\n").nth(1).unwrap();
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .expect("the endpoint serves Prometheus text");
    assert!(http(b"BLAH\r\n\r\n").starts_with("HTTP/1.1 400"));
    assert!(http(b"GET /metrics HTTP/9\r\n\r\n").starts_with("HTTP/1.1 400"));
    let big = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "y".repeat(20000));
    assert!(http(big.as_bytes()).starts_with("HTTP/1.1 400"));
    assert!(http(b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    assert!(http(b"GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    // A client that sends half a request and leaves does not wedge the endpoint.
    {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.write_all(b"GET /met").unwrap();
    }
    assert!(http(b"GET /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 200"));
}

/// `n` writes then `n` reads of 4 KiB on namespace 1, one at a time.
fn sync_io(d: &NvmeDriver, n: u64) {
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    for op in [IoOp::Write, IoOp::Read] {
        for i in 0..n {
            let c = qp
                .submit_io(op, 1, i * 8, 8, Some(&buf), DataMode::Prp)
                .unwrap();
            qp.ring().unwrap();
            assert!(qp.wait(c, T).unwrap().status.is_ok());
        }
    }
    d.delete_qpair(qp).unwrap();
}

#[test]
fn trace_methods_and_metrics_count_what_the_initiator_issued() {
    let s = Serve::start(&[]);
    let a = s.nvme.to_str().unwrap().to_string();
    for bad in [
        json!(0),
        json!(-1),
        json!(1u64 << 31),
        json!("x"),
        json!(1.5),
    ] {
        s.err("trace_start", json!({"sample": bad}), -32602, "sample");
    }
    s.err(
        "trace_start",
        json!({"socket": "nope.sock"}),
        -32000,
        "no device",
    );
    let r = s.ok("trace_start", json!({"sample": (1u64 << 31) - 1}));
    assert_eq!(r["devices"][0], a);
    let r = s.ok("trace_start", json!({"socket": a}));
    assert_eq!(r["sample"], 1);

    let d = NvmeDriver::connect(&s.nvme, opts()).unwrap();
    sync_io(&d, 50);
    s.ok("trace_stop", json!({}));
    // Not traced: the counters still see it, the breakdown does not.
    sync_io(&d, 10);

    let b: trace::Breakdown =
        serde_json::from_value(s.ok("trace_read", json!({"socket": a}))).unwrap();
    for op in ["read", "write"] {
        let o = b.op(op).unwrap_or_else(|| panic!("no {op} in {b:?}"));
        for l in trace::LAYERS.iter().chain([&trace::TOTAL]) {
            let row = o.row(l).unwrap_or_else(|| panic!("no {op} {l} row"));
            assert_eq!(row.count, 50, "{op} {l}");
        }
        assert!(o.row("backend").unwrap().max_ns > 0);
    }

    let st = s.ok("get_stats", json!({}));
    assert_eq!(ns_sum(&st, 0, "ops", "read"), 60);
    assert_eq!(ns_sum(&st, 0, "ops", "write"), 60);
    assert_eq!(ns_sum(&st, 0, "bytes", "write"), 60 * 4096);

    let text = s.ok("get_metrics", json!({}));
    let scrape =
        prometheus_parse::Scrape::parse(text.as_str().unwrap().lines().map(|l| Ok(l.to_string())))
            .expect("get_metrics is Prometheus text");
    let sum = |name: &str, op: &str| -> f64 {
        scrape
            .samples
            .iter()
            .filter(|x| x.metric == name && x.labels.get("op") == Some(op))
            .map(|x| match x.value {
                prometheus_parse::Value::Counter(v) => v,
                ref v => panic!("{name} is {v:?}, not a counter"),
            })
            .sum()
    };
    assert_eq!(sum("udrive_io_ops_total", "read"), 60.0);
    assert_eq!(sum("udrive_io_ops_total", "write"), 60.0);
    assert_eq!(sum("udrive_io_bytes_total", "read"), 60.0 * 4096.0);
    assert_eq!(sum("udrive_io_ops_total", "flush"), 0.0);
}

#[test]
fn udrive_trace_and_perf_trace_over_the_socket() {
    let s = Serve::start(&[]);
    let stop = Arc::new(AtomicBool::new(false));
    let bg = {
        let (stop, sock) = (stop.clone(), s.nvme.clone());
        std::thread::spawn(move || {
            let d = NvmeDriver::connect(&sock, opts()).unwrap();
            while !stop.load(Ordering::Relaxed) {
                sync_io(&d, 20);
            }
        })
    };
    let out = udrive_ok(&["trace", "--time", "1", "--rpc", s.rpc.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    for w in ["read", "write", "backend", "notify", "total", "p99.9"] {
        assert!(text.contains(w), "{w} missing in\n{text}");
    }
    let out = udrive_ok(&[
        "trace",
        "--time",
        "0.5",
        "--sample",
        "2",
        "--json",
        "--rpc",
        s.rpc.to_str().unwrap(),
    ]);
    let b: trace::Breakdown = serde_json::from_slice(&out.stdout).unwrap();
    assert!(b
        .op("read")
        .is_some_and(|o| o.row("total").unwrap().count > 0));
    let out = udrive(&[
        "trace",
        "--time",
        "0",
        "--sample",
        "0",
        "--rpc",
        s.rpc.to_str().unwrap(),
    ]);
    assert!(!out.status.success(), "--sample 0 refused");
    stop.store(true, Ordering::Relaxed);
    bg.join().unwrap();

    // perf --trace --rpc: initiator layers and the server's in one table.
    let out = udrive_ok(&[
        "perf",
        "--time",
        "0.5",
        "--rw",
        "randrw",
        "--trace",
        "--vfio-user",
        s.nvme.to_str().unwrap(),
        "--rpc",
        s.rpc.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    for w in ["submit", "reap", "queue", "backend", "notify", "transport"] {
        assert!(text.contains(w), "{w} missing in\n{text}");
    }
}

#[test]
fn vhost_user_blk_devices_have_stats_and_traces() {
    let vdir = tempfile::tempdir().unwrap();
    let v = vdir.path().join("v.sock");
    let vs = v.to_str().unwrap().to_string();
    let s = Serve::start(&[
        "--vhost-user-blk",
        &vs,
        "--disk",
        "ram:16M",
        "--queues",
        "2",
    ]);
    let a = s.nvme.to_str().unwrap().to_string();
    let st = s.ok("get_stats", json!({}));
    let kinds: Vec<&str> = st["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["nvme", "vhost-user-blk"]);
    let st = s.ok("get_stats", json!({"socket": vs}));
    assert_eq!(st["devices"][0]["name"], "v");
    let queues: Vec<u64> = st["devices"][0]["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["queue"].as_u64().unwrap())
        .collect();
    assert_eq!(queues, [0, 1]);

    let r = s.ok("trace_start", json!({}));
    assert_eq!(r["devices"], json!([a, vs]));
    let r = s.ok("trace_start", json!({"socket": vs, "sample": 1}));
    assert_eq!(r["devices"], json!([vs]));
    // I/O through libblkio while the trace runs.
    let t = udrive::blkio_target::BlkioTarget::connect(&v, 1, 4, 4096).expect("libblkio");
    let cfg = initiator::workload::WorkloadConfig {
        rw: initiator::workload::Rw::RandRw { read_pct: 50 },
        qd: 4,
        time: Duration::from_millis(200),
        ..Default::default()
    };
    let rep = initiator::workload::run(&t, &cfg).expect("workload");
    drop(t);
    s.ok("trace_stop", json!({"socket": vs}));
    let b = s.ok("trace_read", json!({"socket": vs}));
    let b: trace::Breakdown = serde_json::from_value(b).unwrap();
    let reads = b
        .op("read")
        .and_then(|o| o.row("total"))
        .expect("read total");
    assert!(reads.count >= rep.reads, "{b}");
    assert!(
        b.op("write").and_then(|o| o.row("backend")).is_some(),
        "{b}"
    );

    // `udrive trace` on the vhost-user-blk device while libblkio runs I/O.
    let (out, rep) = std::thread::scope(|sc| {
        let io = sc.spawn(|| blkio_io(&v, 2));
        let out = udrive_ok(&[
            "trace",
            "--time",
            "0.3",
            "--json",
            "--device",
            v.to_str().unwrap(),
            "--rpc",
            s.rpc.to_str().unwrap(),
        ]);
        (out, io.join().unwrap())
    });
    let b: trace::Breakdown = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        b.op("write")
            .is_some_and(|o| o.row("queue").unwrap().count > 0),
        "{b} ({} I/Os)",
        rep.ios
    );

    let text = s.ok("get_metrics", json!({}));
    let text = text.as_str().unwrap();
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .expect("get_metrics is Prometheus text");
    assert!(
        text.contains("udrive_io_ops_total{device=\"v\",namespace=\"1\",queue=\"0\",op=\"read\"}"),
        "{text}"
    );
}

/// Verified random I/O through libblkio on a vhost-user-blk socket.
fn blkio_io(sock: &Path, jobs: u32) -> initiator::workload::Report {
    let t = udrive::blkio_target::BlkioTarget::connect(sock, jobs, 4, 4096).expect("libblkio");
    let cfg = initiator::workload::WorkloadConfig {
        rw: initiator::workload::Rw::RandRw { read_pct: 50 },
        qd: 4,
        jobs,
        verify: true,
        time: Duration::from_millis(600),
        ..Default::default()
    };
    let r = initiator::workload::run(&t, &cfg).expect("workload");
    assert!(r.ios > 0);
    assert_eq!((r.errors, r.verify_errors), (0, 0));
    r
}

/// The server notices a client's disconnect on its own thread.
fn wait_disconnected(s: &Serve, v: &Path) {
    let until = Instant::now() + T;
    while s.ok("get_devices", json!({"socket": v}))[0]["connected"] != false {
        assert!(Instant::now() < until, "disconnect not seen");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// set_qos / clear_qos reach a vhost-user-blk device's disk (no nsid) and apply to
/// its I/O at once.
#[test]
fn vhost_user_blk_disks_take_qos_limits() {
    let s = Serve::start(&[]);
    let v = s.path("v.sock");
    s.ok(
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M"}),
    );
    let q = s.ok("set_qos", json!({"socket": v, "iops": 100}));
    assert_eq!(q["iops"], 100);
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["qos"]["iops"],
        100
    );
    // 0.6 s at 100 IOPS plus the 100 ms burst: never more than a second's worth,
    // however fast the machine.
    let limited = blkio_io(&v, 1);
    assert!(limited.ios <= 100, "{} requests at 100 IOPS", limited.ios);
    wait_disconnected(&s, &v);
    let q = s.ok("clear_qos", json!({"socket": v, "nsid": 1}));
    assert_eq!(q["iops"], Value::Null);
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["qos"]["iops"],
        Value::Null
    );
    blkio_io(&v, 1);
    s.err(
        "set_qos",
        json!({"socket": v, "nsid": 2, "iops": 1}),
        -32000,
        "its one disk is nsid 1",
    );
    s.err(
        "set_qos",
        json!({"socket": s.nvme, "iops": 1}),
        -32000,
        "give the nsid",
    );
}

#[test]
fn vhost_user_blk_add_and_remove() {
    let s = Serve::start(&[]);
    let v = s.path("v.sock");
    let added = s.ok(
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M", "queues": 2, "poll_mode": "event", "serial": "vm-v"}),
    );
    assert_eq!(added["kind"], "vhost-user-blk");
    assert_eq!(added["config"]["queues"], 2);
    assert_eq!(added["config"]["poll"], "event");
    assert_eq!(added["config"]["read_only"], false);
    assert!(v.exists());
    let d = s.ok("get_devices", json!({}));
    assert_eq!(d.as_array().unwrap().len(), 2);
    blkio_io(&v, 2);
    // The queues count what went through them.
    let st = s.ok("get_stats", json!({"socket": v}));
    assert!(ns_sum(&st, 0, "ops", "read") > 0);

    // In use: refused unless forced.
    let in_use = udrive::blkio_target::BlkioTarget::connect(&v, 1, 4, 4096).expect("libblkio");
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["connected"],
        true
    );
    s.err(
        "vhost_user_blk_remove",
        json!({"socket": v}),
        -32000,
        "connected client",
    );
    s.ok("vhost_user_blk_remove", json!({"socket": v, "force": true}));
    assert!(!v.exists());
    drop(in_use);
    s.err("get_devices", json!({"socket": v}), -32000, "no device");

    // The socket and the disk's file range are free again.
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let spec = format!("file:{},size=4M", img.display());
    s.ok("vhost_user_blk_add", json!({"socket": v, "disk": spec}));
    blkio_io(&v, 1);
    wait_disconnected(&s, &v);
    s.ok("vhost_user_blk_remove", json!({"socket": v}));
    s.ok(
        "vhost_user_blk_add",
        json!({"socket": v, "disk": spec, "read_only": true}),
    );
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["config"]["read_only"],
        true
    );
    // libblkio refuses a read-write session on a read-only device.
    assert!(udrive::blkio_target::BlkioTarget::connect(&v, 1, 4, 4096).is_err());
    wait_disconnected(&s, &v);
    s.ok("vhost_user_blk_remove", json!({"socket": v}));
    // The NVMe controller was never affected.
    let other = NvmeDriver::connect(&s.nvme, opts()).unwrap();
    verified_io(&other, 1, 5);
}

#[test]
fn vhost_user_blk_add_hostile_params() {
    let s = Serve::start(&[]);
    let v = s.path("v.sock");
    let dir = tempfile::tempdir().unwrap();
    let add = |p: Value, code: i64, want: &str| s.err("vhost_user_blk_add", p, code, want);
    add(json!({"socket": v}), -32602, "disk");
    add(
        json!({"socket": v, "disk": "ram:1M", "colour": 1}),
        -32602,
        "unknown field",
    );
    add(json!({"socket": v, "disk": 5}), -32602, "invalid type");
    add(
        json!({"socket": v, "disk": "disk:1G"}),
        -32602,
        "unknown kind",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "queues": 0}),
        -32602,
        "queues must be",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "queues": 70000}),
        -32602,
        "invalid value",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "queues": -1}),
        -32602,
        "invalid value",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "queue_size": 100}),
        -32602,
        "power of two",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "placement": "everywhere"}),
        -32602,
        "placement",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "poll_mode": "sometimes"}),
        -32602,
        "sometimes",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "cpus": "0-"}),
        -32602,
        "cpus",
    );
    add(
        json!({"socket": dir.path().join("no/such/dir.sock"), "disk": "ram:1M"}),
        -32602,
        "does not exist",
    );
    add(
        json!({"socket": v, "disk": format!("file:{}", dir.path().join("missing.img").display())}),
        -32000,
        "does not exist",
    );
    // Sockets that are taken: a device's, another process's file.
    add(
        json!({"socket": s.nvme, "disk": "ram:1M"}),
        -32000,
        "already has a device",
    );
    let precious = dir.path().join("precious.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    add(
        json!({"socket": precious, "disk": "ram:1M"}),
        -32000,
        "not a socket",
    );
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
    // Removing: wrong kind, unknown socket, bad params.
    s.err(
        "vhost_user_blk_remove",
        json!({"socket": s.nvme}),
        -32000,
        "nvme_remove_controller",
    );
    s.err(
        "vhost_user_blk_remove",
        json!({"socket": v}),
        -32000,
        "no device",
    );
    s.err("vhost_user_blk_remove", json!({}), -32602, "socket");
    s.err(
        "vhost_user_blk_remove",
        json!({"socket": v, "force": "yes"}),
        -32602,
        "invalid type",
    );
    // Nothing was left behind, and the server still works.
    assert!(!v.exists());
    assert_eq!(s.ok("get_devices", json!({})).as_array().unwrap().len(), 1);
    s.ok("vhost_user_blk_add", json!({"socket": v, "disk": "ram:1M"}));
    blkio_io(&v, 1);
}

#[test]
fn set_poll_mode_and_placement_while_libblkio_runs() {
    let s = Serve::start(&[]);
    let v = s.path("v.sock");
    let added = s.ok(
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M", "queues": 2}),
    );
    assert_eq!(added["state"]["poll_mode"], "adaptive", "the default");
    let r = std::thread::scope(|sc| {
        let io = sc.spawn(|| {
            let t = udrive::blkio_target::BlkioTarget::connect(&v, 2, 4, 4096).expect("libblkio");
            let cfg = initiator::workload::WorkloadConfig {
                rw: initiator::workload::Rw::RandRw { read_pct: 50 },
                qd: 4,
                jobs: 2,
                verify: true,
                time: Duration::from_millis(1000),
                ..Default::default()
            };
            initiator::workload::run(&t, &cfg).expect("workload")
        });
        let placements = [
            "dedicated",
            "single",
            "round-robin",
            "dedicated",
            "single",
            "single",
        ];
        for (mode, placement) in ["event", "adaptive", "busy", "event", "busy", "adaptive"]
            .into_iter()
            .zip(placements)
        {
            std::thread::sleep(Duration::from_millis(120));
            assert_eq!(
                s.ok("set_poll_mode", json!({"socket": v, "mode": mode})),
                true
            );
            s.ok(
                "set_placement",
                json!({"socket": v, "placement": placement}),
            );
            let d = s.ok("get_devices", json!({"socket": v}));
            assert_eq!(d[0]["state"]["poll_mode"], mode);
            assert_eq!(d[0]["config"]["poll"], mode);
            assert_eq!(d[0]["config"]["placement"], placement);
            let on: Vec<u64> = d[0]["state"]["queue_reactors"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_u64().unwrap())
                .collect();
            // One shared reactor (--cpus 0): everything but dedicated is on reactor 0.
            assert_eq!(
                on.iter().all(|r| *r >= 1),
                placement == "dedicated",
                "{placement}: {on:?}"
            );
        }
        io.join().unwrap()
    });
    assert!(r.ios > 0);
    assert_eq!((r.errors, r.verify_errors), (0, 0));
    // NVMe queues stay on the shared reactor (--cpus 0 = reactor 0) though the
    // engine grew reactors for the dedicated vhost device.
    s.ok(
        "set_placement",
        json!({"socket": s.nvme, "placement": "round-robin"}),
    );
    assert_eq!(
        s.ok("get_devices", json!({"socket": s.nvme}))[0]["poll"],
        "adaptive",
        "the default"
    );
    s.ok("set_poll_mode", json!({"socket": s.nvme, "mode": "busy"}));
    let d = NvmeDriver::connect(&s.nvme, opts()).unwrap();
    let qps: Vec<_> = (0..3).map(|_| d.create_qpair(16, false).unwrap()).collect();
    let dev = s.ok("get_devices", json!({"socket": s.nvme}));
    let groups = dev[0]["state"]["queue_groups"].as_array().unwrap().clone();
    assert_eq!(groups.len(), 3);
    assert!(
        groups.iter().all(|g| g["reactor"] == 0),
        "NVMe queues on dedicated reactors: {groups:?}"
    );
    // NVMe poll modes switch at run time; this client mapped the doorbell page
    // (busy mode when it connected), so its queues cannot sleep until it reconnects.
    assert_eq!(
        s.ok("set_poll_mode", json!({"socket": s.nvme, "mode": "event"})),
        true
    );
    let dev = s.ok("get_devices", json!({"socket": s.nvme}));
    assert_eq!(dev[0]["poll"], "event");
    assert_eq!(dev[0]["state"]["poll_mode"], "event");
    assert_eq!(dev[0]["state"]["doorbells"], "mapped");
    assert_eq!(dev[0]["state"]["can_sleep"], false);
    for qp in qps {
        d.delete_qpair(qp).unwrap();
    }
    verified_io(&d, 1, 5);
    drop(d);
    let d = NvmeDriver::connect(&s.nvme, opts()).unwrap();
    assert!(!d.doorbells_mapped(), "event mode offers no doorbell mmap");
    assert!(d.shadow_doorbells());
    // In event mode the reactor sleeps whenever its queues are idle: between these
    // I/Os too, and get_stats counts it.
    let sleeps = |s: &Serve| -> u64 {
        s.ok("get_stats", json!({}))["reactors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["sleeps"].as_u64().unwrap())
            .sum()
    };
    let before = sleeps(&s);
    verified_io(&d, 1, 6);
    assert!(sleeps(&s) > before, "no reactor slept in event mode");
    let dev = s.ok("get_devices", json!({"socket": s.nvme}));
    assert_eq!(dev[0]["state"]["doorbells"], "messages");
    assert_eq!(dev[0]["state"]["can_sleep"], true);
    drop(d);
    // Bad modes and sockets get clear errors.
    s.err(
        "set_placement",
        json!({"socket": s.nvme, "placement": "dedicated"}),
        -32000,
        "vhost-user-blk devices only",
    );
    s.err(
        "set_placement",
        json!({"socket": v, "placement": "everywhere"}),
        -32602,
        "placement",
    );
    s.err(
        "set_poll_mode",
        json!({"socket": v, "mode": "lazy"}),
        -32602,
        "unknown poll mode",
    );
    s.err(
        "set_poll_mode",
        json!({"socket": v, "mode": 1}),
        -32602,
        "invalid type",
    );
    s.err("set_poll_mode", json!({"socket": v}), -32602, "mode");
    s.err(
        "set_poll_mode",
        json!({"socket": s.path("none.sock"), "mode": "busy"}),
        -32000,
        "no device",
    );
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["state"]["poll_mode"],
        "adaptive"
    );
    blkio_io(&v, 2);
}

/// Runs the `udrive` binary with `args`.
fn udrive(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(args)
        .output()
        .expect("run udrive")
}

/// Runs the `udrive` binary with `args`; it must succeed (else its output is shown).
fn udrive_ok(args: &[&str]) -> std::process::Output {
    let out = udrive(args);
    assert!(
        out.status.success(),
        "udrive {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Device sockets are owner-only unless the operator says otherwise: on the command
/// line (for every device), per device over RPC, and in the TOML config.
#[test]
fn device_sockets_get_the_mode_and_group_asked_for() {
    use std::os::unix::fs::MetadataExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
    let s = Serve::start(&[]);
    assert_eq!(mode(&s.nvme), 0o600, "default: owner only");
    let v = s.dir.path().join("v.sock");
    call(
        &s.rpc,
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M"}),
    )
    .unwrap();
    assert_eq!(mode(&v), 0o600, "RPC-added devices too");
    drop(s);

    let s = Serve::start(&["--socket-mode", "0660", "--socket-group", "root"]);
    assert_eq!(mode(&s.nvme), 0o660);
    assert_eq!(std::fs::metadata(&s.nvme).unwrap().gid(), 0);
    let v = s.dir.path().join("v.sock");
    call(
        &s.rpc,
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M"}),
    )
    .unwrap();
    assert_eq!(
        mode(&v),
        0o660,
        "the CLI's default reaches RPC-added devices"
    );
    let w = s.dir.path().join("w.sock");
    call(
        &s.rpc,
        "vhost_user_blk_add",
        json!({"socket": w, "disk": "ram:16M", "socket_mode": "0640"}),
    )
    .unwrap();
    assert_eq!(mode(&w), 0o640);
    let c = s.dir.path().join("c.sock");
    call(
        &s.rpc,
        "nvme_add_controller",
        json!({"socket": c, "namespaces": ["ram:16M"], "socket_mode": "0620"}),
    )
    .unwrap();
    assert_eq!(mode(&c), 0o620);
    let devs = call(&s.rpc, "get_devices", json!({})).unwrap();
    let modes: Vec<&str> = devs
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["socket_access"]["mode"].as_str().unwrap())
        .collect();
    assert!(modes.contains(&"0640") && modes.contains(&"0620"), "{devs}");
    for bad in [
        json!({"socket": s.dir.path().join("x.sock"), "disk": "ram:1M", "socket_mode": "999"}),
        json!({"socket": s.dir.path().join("y.sock"), "disk": "ram:1M", "socket_group": "no-such-group-here"}),
    ] {
        let (_, msg) = call(&s.rpc, "vhost_user_blk_add", bad).unwrap_err();
        assert!(msg.contains("octal") || msg.contains("no group"), "{msg}");
    }
    drop(s);

    // TOML: a top-level default and a per-device override.
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let cfg = dir.path().join("u.toml");
    std::fs::write(
        &cfg,
        format!(
            "cpus = \"0\"\nsocket_mode = \"0640\"\n\n[[controller]]\nsocket = \"{}\"\nnamespaces = [\"ram:16M\"]\n\n[[vhost_user_blk]]\nsocket = \"{}\"\ndisk = \"ram:16M\"\nsocket_mode = \"0660\"\n",
            a.display(),
            b.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = std::time::Instant::now() + T;
    while !(a.exists() && b.exists()) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ma, mb) = (mode(&a), mode(&b));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!((ma, mb), (0o640, 0o660));
}
