//! Online resize over the control socket of a real `udrive serve` process
//! (docs/decisions/0018-online-resize.md): NVMe namespaces (ram and file) grown
//! and shrunk under verified I/O, seen by udrive's initiator through the
//! Namespace Attribute Changed event; a vhost-user-blk disk whose front end gets
//! the configuration change message and reads the new capacity; and the refusals,
//! each naming its cause, after which nothing has changed.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{opts, wait_until, Rng, T};
use guest_mem::SharedMem;
use initiator::{DataMode, DmaBuf, IoOp, NvmeDriver, QueuePair};
use serde_json::{json, Value};
use test_support::vhost_fe::{Connect, FakeFrontend, DATA, HDR, MEM, STATUS, T_IN, T_OUT};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;

const MIB: u64 = 1 << 20;

/// `udrive serve --config` in a temp dir (the config names its files relative to
/// `{dir}`); SIGTERM and wait on drop.
struct Serve {
    child: Child,
    dir: tempfile::TempDir,
}

impl Serve {
    /// Creates `files` (name, bytes) in the temp dir, then starts udrive with the
    /// TOML `devices` (`{dir}` replaced) and waits for `sockets`.
    fn start(files: &[(&str, u64)], devices: &str, sockets: &[&str]) -> Serve {
        let dir = tempfile::tempdir().unwrap();
        for (name, len) in files {
            std::fs::File::create(dir.path().join(name))
                .unwrap()
                .set_len(*len)
                .unwrap();
        }
        let d = dir.path().display().to_string();
        let cfg = format!(
            "cpus = \"0\"\nrpc = \"{d}/rpc.sock\"\n{}",
            devices.replace("{dir}", &d)
        );
        std::fs::write(dir.path().join("u.toml"), cfg).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["serve", "--config"])
            .arg(dir.path().join("u.toml"))
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
            .spawn()
            .expect("run udrive serve");
        // Drain stdout (the banner) so the server never blocks on it.
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || for _ in BufReader::new(out).lines().map_while(Result::ok) {});
        let s = Serve { child, dir };
        let until = Instant::now() + Duration::from_secs(30);
        for n in sockets.iter().chain(&["rpc.sock"]) {
            while !s.path(n).exists() {
                assert!(
                    Instant::now() < until,
                    "udrive serve did not start: {}",
                    s.log()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        s
    }

    fn path(&self, n: &str) -> PathBuf {
        self.dir.path().join(n)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("stderr.log")).unwrap_or_default()
    }

    fn call(&self, method: &str, params: Value) -> Result<Value, (i64, String)> {
        let mut s = UnixStream::connect(self.path("rpc.sock")).expect("connect rpc");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let req = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        s.write_all(format!("{req}\n").as_bytes()).unwrap();
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while s.read(&mut b).unwrap_or(0) == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        let r: Value = serde_json::from_slice(&line).expect("reply is JSON");
        match r.get("error") {
            Some(e) => Err((
                e["code"].as_i64().unwrap(),
                e["message"].as_str().unwrap().to_string(),
            )),
            None => Ok(r["result"].clone()),
        }
    }

    #[track_caller]
    fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params)
            .unwrap_or_else(|e| panic!("{method} failed: {e:?}"))
    }

    /// A call that must fail with `code` and a message containing `want`.
    #[track_caller]
    fn err(&self, method: &str, params: Value, code: i64, want: &str) {
        match self.call(method, params.clone()) {
            Ok(v) => panic!("{method} {params} succeeded: {v}"),
            Err((c, m)) => {
                assert_eq!(c, code, "{method} {params}: {m}");
                assert!(m.contains(want), "{method} {params}: `{want}` not in `{m}`");
            }
        }
    }

    /// The NVMe namespaces (or the vhost-user-blk config) `get_devices` shows.
    fn device(&self, sock: &str) -> Value {
        self.ok("get_devices", json!({"socket": self.path(sock)}))[0].clone()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let until = Instant::now() + T;
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One command; its status as (SCT, SC).
fn rw(qp: &mut QueuePair, op: IoOp, nsid: u32, byte: u64, buf: &DmaBuf) -> (u8, u8) {
    let c = qp
        .submit_io(op, nsid, byte / 512, 8, Some(buf), DataMode::Prp)
        .unwrap();
    qp.ring().unwrap();
    let st = qp.wait(c, T).unwrap().status;
    (st.sct, st.sc)
}

/// Writes `data` (4 KiB) at `byte` of `nsid` and reads it back.
fn write_read(qp: &mut QueuePair, nsid: u32, byte: u64, data: &[u8], buf: &DmaBuf) {
    buf.write(0, data).unwrap();
    assert_eq!(
        rw(qp, IoOp::Write, nsid, byte, buf),
        (0, 0),
        "write ns {nsid} at {byte}"
    );
    check(qp, nsid, byte, data, buf);
}

fn check(qp: &mut QueuePair, nsid: u32, byte: u64, data: &[u8], buf: &DmaBuf) {
    buf.fill(0);
    assert_eq!(
        rw(qp, IoOp::Read, nsid, byte, buf),
        (0, 0),
        "read ns {nsid} at {byte}"
    );
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert!(back == data, "ns {nsid} at {byte}: data differs");
}

/// Waits for the Namespace Attribute Changed event; the namespaces it lists.
fn changed(d: &mut NvmeDriver) -> Vec<u32> {
    let ev = d.wait_event(T).unwrap();
    assert!(ev.is_namespace_change(), "{ev:?}");
    d.rescan_namespaces().unwrap()
}

fn ns_bytes(d: &NvmeDriver, nsid: u32) -> u64 {
    let n = d.namespace(nsid).unwrap();
    n.nsze * u64::from(n.lba_size)
}

fn file_len(s: &Serve, name: &str) -> u64 {
    std::fs::metadata(s.path(name)).unwrap().len()
}

/// Verified 4 KiB writes and reads on namespaces 1 and 2 (first 4 MiB) on `bq`
/// until `stop`; rounds in `ops`, failures or mismatches in `bad`. Gives the queue
/// pair back.
fn spawn_verifier(
    mut bq: QueuePair,
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    bad: Arc<AtomicU64>,
) -> std::thread::JoinHandle<QueuePair> {
    std::thread::spawn(move || {
        let b = bq.alloc_buf(4096).unwrap();
        let mut rng = Rng::new(7);
        while !stop.load(Ordering::Relaxed) {
            let nsid = 1 + (rng.below(2) as u32);
            let at = rng.below(1024) * 4096;
            let data = rng.bytes(4096);
            b.write(0, &data).unwrap();
            let w = rw(&mut bq, IoOp::Write, nsid, at, &b);
            b.fill(0);
            let r = rw(&mut bq, IoOp::Read, nsid, at, &b);
            let mut back = vec![0u8; 4096];
            b.read(0, &mut back).unwrap();
            if w != (0, 0) || r != (0, 0) || back != data {
                bad.fetch_add(1, Ordering::Relaxed);
            }
            ops.fetch_add(1, Ordering::Relaxed);
        }
        bq
    })
}

#[test]
fn nvme_ram_and_file_namespaces_grow_and_shrink_under_verified_io() {
    let s = Serve::start(
        &[("disk.img", 16 * MIB)],
        "[[controller]]\nsocket = \"{dir}/n.sock\"\nnamespaces = [\"ram:16M\", \"file:{dir}/disk.img\"]\n",
        &["n.sock"],
    );
    let n = s.path("n.sock");
    let mut d = NvmeDriver::connect(&n, opts()).unwrap();
    d.enable_ns_events().unwrap();
    let mut qp = d.create_qpair(16, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    let mut rng = Rng::new(13);
    // What lies at the old end of each namespace must survive every resize.
    let old_end = 16 * MIB - 4096;
    let marks = [rng.bytes(4096), rng.bytes(4096)];
    for (i, m) in marks.iter().enumerate() {
        write_read(&mut qp, i as u32 + 1, old_end, m, &buf);
        assert_eq!(
            rw(&mut qp, IoOp::Read, i as u32 + 1, 16 * MIB, &buf),
            (0, 0x80)
        );
    }

    // Verified I/O on both namespaces (first 4 MiB) for the whole test.
    let stop = Arc::new(AtomicBool::new(false));
    let (ops, bad) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let bq = d.create_qpair(16, false).unwrap();
    let bg = spawn_verifier(bq, stop.clone(), ops.clone(), bad.clone());
    let wait_ops = |more: u64| {
        let until = ops.load(Ordering::Relaxed) + more;
        wait_until("verified I/O", T, || ops.load(Ordering::Relaxed) >= until);
    };
    wait_ops(50);

    // Grow the ram namespace (size as a string) and the file one (a number).
    let r = s.ok("resize", json!({"socket": n, "nsid": 1, "size": "32M"}));
    assert_eq!(r["old_size_bytes"], 16 * MIB);
    assert_eq!(r["size_bytes"], 32 * MIB);
    assert_eq!(r["block_size"], 512);
    assert_eq!(r["notified"], true, "{r}");
    assert_eq!(changed(&mut d), vec![1]);
    assert_eq!(ns_bytes(&d, 1), 32 * MIB);
    wait_ops(50);
    let r = s.ok("resize", json!({"socket": n, "nsid": 2, "size": 32 * MIB}));
    assert_eq!(r["notified"], true, "{r}");
    assert_eq!(changed(&mut d), vec![2]);
    assert_eq!(ns_bytes(&d, 2), 32 * MIB);
    assert_eq!(file_len(&s, "disk.img"), 32 * MIB, "the file grew");
    for (i, m) in marks.iter().enumerate() {
        let nsid = i as u32 + 1;
        check(&mut qp, nsid, old_end, m, &buf);
        write_read(&mut qp, nsid, 32 * MIB - 4096, &rng.bytes(4096), &buf);
        write_read(&mut qp, nsid, 16 * MIB, &rng.bytes(4096), &buf);
        assert_eq!(rw(&mut qp, IoOp::Read, nsid, 32 * MIB, &buf), (0, 0x80));
    }
    let dev = s.device("n.sock");
    assert_eq!(dev["namespaces"][0]["spec"], "ram:32M");
    assert_eq!(dev["namespaces"][0]["size_bytes"], 32 * MIB);
    assert_eq!(dev["namespaces"][1]["size_bytes"], 32 * MIB);
    wait_ops(50);

    // Shrinking needs the flag; refused, nothing changes.
    s.err(
        "resize",
        json!({"socket": n, "nsid": 1, "size": "8M"}),
        -32000,
        "\"shrink\": true",
    );
    assert_eq!(s.device("n.sock")["namespaces"][0]["size_bytes"], 32 * MIB);
    for nsid in [1, 2] {
        let r = s.ok(
            "resize",
            json!({"socket": n, "nsid": nsid, "size": "8M", "shrink": true}),
        );
        assert_eq!(r["size_bytes"], 8 * MIB);
        assert_eq!(changed(&mut d), vec![nsid]);
        assert_eq!(ns_bytes(&d, nsid), 8 * MIB);
        // Beyond the new end: LBA Out of Range; below it, I/O and data as before.
        assert_eq!(rw(&mut qp, IoOp::Read, nsid, 8 * MIB, &buf), (0, 0x80));
        assert_eq!(rw(&mut qp, IoOp::Write, nsid, 16 * MIB, &buf), (0, 0x80));
        write_read(&mut qp, nsid, 8 * MIB - 4096, &rng.bytes(4096), &buf);
    }
    assert_eq!(file_len(&s, "disk.img"), 8 * MIB, "the file was truncated");
    assert_eq!(s.device("n.sock")["namespaces"][0]["spec"], "ram:8M");
    wait_ops(50);
    stop.store(true, Ordering::Relaxed);
    let bq = bg.join().unwrap();
    assert_eq!(bad.load(Ordering::Relaxed), 0, "verified I/O saw errors");
    d.delete_qpair(bq).unwrap();
    d.delete_qpair(qp).unwrap();
    assert!(!s.log().contains(" ERROR "), "{}", s.log());
}

#[test]
fn refusals_name_the_cause_and_change_nothing() {
    let s = Serve::start(
        &[("a.img", 16 * MIB), ("b.img", 16 * MIB), ("c.img", 16 * MIB)],
        "[[controller]]\nsocket = \"{dir}/n.sock\"\nnamespaces = [\"file:{dir}/a.img,offset=0,size=8M\", \
         \"file:{dir}/b.img,shared\", \"file:{dir}/c.img,ro\", \"null:16M\"]\n\
         [[vhost_user_blk]]\nsocket = \"{dir}/v.sock\"\ndisk = \"ram:16M\"\n",
        &["n.sock", "v.sock"],
    );
    let (n, v) = (s.path("n.sock"), s.path("v.sock"));
    let before = s.device("n.sock")["namespaces"].clone();
    for (params, code, want) in refused_resizes(&n, &v, &s.path("x.sock")) {
        s.err("resize", params, code, want);
    }
    assert_eq!(s.device("n.sock")["namespaces"], before, "nothing changed");
    assert_eq!(file_len(&s, "a.img"), 16 * MIB);
    assert_eq!(file_len(&s, "c.img"), 16 * MIB);

    resized_with_nobody_to_tell(&s, &n, &v);
}

/// Resizes of `n`'s namespaces (1: a slice, 2: shared, 3: read-only, 4: null),
/// of vhost-user-blk device `v` and of a socket `x` with no device that are
/// refused, with the error code and a part of the message each gets.
fn refused_resizes(n: &Path, v: &Path, x: &Path) -> Vec<(Value, i64, &'static str)> {
    vec![
        (
            json!({"socket": n, "nsid": 1, "size": "16M"}),
            -32000,
            "is a slice",
        ),
        (
            json!({"socket": n, "nsid": 2, "size": "32M"}),
            -32000,
            "`shared`",
        ),
        (
            json!({"socket": n, "nsid": 3, "size": "32M"}),
            -32000,
            "read-only",
        ),
        (
            json!({"socket": n, "nsid": 4, "size": 0}),
            -32602,
            "above 0",
        ),
        (
            json!({"socket": n, "nsid": 4, "size": "0"}),
            -32602,
            "above 0",
        ),
        (
            json!({"socket": n, "nsid": 4, "size": 1000}),
            -32602,
            "multiple of the block size 512",
        ),
        (
            json!({"socket": n, "nsid": 4, "size": "12X"}),
            -32602,
            "unknown unit",
        ),
        (
            json!({"socket": n, "nsid": 4, "size": -1}),
            -32602,
            "invalid params",
        ),
        (
            json!({"socket": n, "nsid": 4, "size": 1.5}),
            -32602,
            "invalid params",
        ),
        (
            json!({"socket": n, "nsid": 4}),
            -32602,
            "missing field `size`",
        ),
        (
            json!({"socket": n, "nsid": 4, "size": "32M", "grow": true}),
            -32602,
            "unknown field",
        ),
        (
            json!({"socket": n, "nsid": 4, "size": "8M"}),
            -32000,
            "\"shrink\": true",
        ),
        (
            json!({"socket": n, "nsid": 9, "size": "32M"}),
            -32000,
            "no namespace 9",
        ),
        (json!({"socket": n, "size": "32M"}), -32000, "give the nsid"),
        (json!({"socket": x, "size": "32M"}), -32000, "no device"),
        (
            json!({"socket": v, "nsid": 2, "size": "32M"}),
            -32000,
            "its one disk is nsid 1",
        ),
        (
            json!({"socket": v, "size": "8M"}),
            -32000,
            "\"shrink\": true",
        ),
    ]
}

/// No host attached: resized, but nobody to tell yet; a host that connects later
/// sees the new size.
fn resized_with_nobody_to_tell(s: &Serve, n: &Path, v: &Path) {
    let r = s.ok("resize", json!({"socket": n, "nsid": 4, "size": "1G"}));
    assert_eq!(r["notified"], false);
    assert!(r["notice"].as_str().unwrap().contains("not enabled"), "{r}");
    let ns = &s.device("n.sock")["namespaces"][3];
    assert_eq!(
        (ns["spec"].clone(), ns["size_bytes"].clone()),
        (json!("null:1G"), json!(1u64 << 30))
    );
    let r = s.ok("resize", json!({"socket": n, "nsid": 4, "size": "1G"}));
    assert_eq!(r["old_size_bytes"], r["size_bytes"]);
    assert!(r["notice"]
        .as_str()
        .unwrap()
        .contains("already has this size"));
    let r = s.ok("resize", json!({"socket": v, "nsid": 1, "size": "32M"}));
    assert_eq!(r["notified"], false);
    assert!(
        r["notice"].as_str().unwrap().contains("no front end"),
        "{r}"
    );
    assert_eq!(s.device("v.sock")["config"]["disk"], "ram:32M");
    assert_eq!(s.device("v.sock")["size_bytes"], 32 * MIB);
    // A host that connects now sees the new size.
    let d = NvmeDriver::connect(n, opts()).unwrap();
    assert_eq!(ns_bytes(&d, 4), 1 << 30);
}

/// A loop device (root only; skipped otherwise): a block device takes only the
/// size it has, so the namespace follows the volume after it grew.
#[test]
fn a_block_device_namespace_follows_its_volume() {
    // The loop device is added after start-up: beneath a directory the server may
    // open (Landlock).
    let s = Serve::start(
        &[("e.img", 16 * MIB)],
        "allow_dirs = [\"/dev\"]\n[[controller]]\nsocket = \"{dir}/n.sock\"\nnamespaces = [\"null:1M\"]\n",
        &["n.sock"],
    );
    let out = Command::new("losetup")
        .args(["--find", "--show"])
        .arg(s.path("e.img"))
        .output();
    let Some(dev) = out
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|p| p.trim().to_string())
    else {
        eprintln!("skipped: cannot attach a loop device (not root?)");
        return;
    };
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = Command::new("losetup").args(["-d", &self.0]).status();
        }
    }
    let _detach = Detach(dev.clone());
    let n = s.path("n.sock");
    let r = s.ok(
        "nvme_add_namespace",
        json!({"socket": n, "spec": format!("file:{dev}")}),
    );
    let nsid = r["nsid"].as_u64().unwrap();
    s.err(
        "resize",
        json!({"socket": n, "nsid": nsid, "size": "32M"}),
        -32000,
        "the block device has 16777216",
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(s.path("e.img"))
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    assert!(Command::new("losetup")
        .args(["--set-capacity", &dev])
        .status()
        .unwrap()
        .success());
    let r = s.ok("resize", json!({"socket": n, "nsid": nsid, "size": "32M"}));
    assert_eq!(r["size_bytes"], 32 * MIB);
    let d = NvmeDriver::connect(&n, opts()).unwrap();
    assert_eq!(ns_bytes(&d, nsid as u32), 32 * MIB);
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    write_read(&mut qp, nsid as u32, 32 * MIB - 4096, &[0x6b; 4096], &buf);
    d.delete_qpair(qp).unwrap();
    drop(d);
    s.ok("nvme_remove_namespace", json!({"socket": n, "nsid": nsid}));
}

/// One 4 KiB request of the raw front end at byte `at`; its virtio status.
fn vio(r: &mut FakeFrontend, t: u32, at: u64) -> u8 {
    r.header(t, at / 512);
    r.request(&[(HDR, 16, false), (DATA, 4096, t == T_IN), (STATUS, 1, true)])
}

/// The capacity (in 512-byte sectors) the front end reads from the config space.
fn capacity(r: &mut FakeFrontend) -> u64 {
    let (_, buf) =
        r.fe.get_config(0, 8, VhostUserConfigFlags::empty(), &[0u8; 8])
            .unwrap();
    u64::from_le_bytes(buf[..8].try_into().unwrap())
}

/// Reads one message from the backend request channel: (request, flags, size).
fn backend_msg(s: &mut UnixStream) -> (u32, u32, u32) {
    let mut h = [0u8; 12];
    s.read_exact(&mut h)
        .expect("a message on the backend channel");
    let u = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
    (u(0), u(4), u(8))
}

fn wait_disconnected(s: &Serve, sock: &str, conns: u64) {
    let until = Instant::now() + T;
    while s.device(sock)["connected"] == true || s.device(sock)["connections"] != conns {
        assert!(Instant::now() < until, "front end still connected");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn vhost_user_blk_front_end_gets_the_config_change() {
    let s = Serve::start(
        &[("v.img", 16 * MIB)],
        "[[vhost_user_blk]]\nsocket = \"{dir}/v.sock\"\ndisk = \"file:{dir}/v.img\"\n",
        &["v.sock"],
    );
    let v = s.path("v.sock");
    let pf = VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::BACKEND_REQ;
    let mem = SharedMem::new("guest", MEM).unwrap();
    let mut r = FakeFrontend::connect_with(
        &v,
        Connect {
            protocol: pf,
            ..Connect::new(mem)
        },
    );
    let (mut mine, theirs) = UnixStream::pair().unwrap();
    mine.set_read_timeout(Some(T)).unwrap();
    r.fe.set_backend_request_fd(&theirs).unwrap();
    assert_eq!(capacity(&mut r), 16 * MIB / 512);
    let mark = [0x42u8; 4096];
    r.put(DATA, &mark);
    assert_eq!(vio(&mut r, T_OUT, 16 * MIB - 4096), 0);
    assert_eq!(vio(&mut r, T_IN, 16 * MIB), 1, "past the end: IOERR");

    let res = s.ok("resize", json!({"socket": v, "size": "32M"}));
    assert_eq!(res["notified"], true, "{res}");
    assert_eq!(
        backend_msg(&mut mine),
        (2, 1, 0),
        "CONFIG_CHANGE_MSG, version 1, no body"
    );
    assert_eq!(capacity(&mut r), 32 * MIB / 512);
    assert_eq!(file_len(&s, "v.img"), 32 * MIB);
    r.put(DATA, &[0u8; 4096]);
    assert_eq!(vio(&mut r, T_IN, 16 * MIB - 4096), 0);
    assert_eq!(r.get(DATA, 4096), mark, "data kept");
    r.put(DATA, &[0x24; 4096]);
    assert_eq!(vio(&mut r, T_OUT, 32 * MIB - 4096), 0, "the new space");
    assert_eq!(vio(&mut r, T_IN, 32 * MIB), 1);
    assert_eq!(s.device("v.sock")["size_bytes"], 32 * MIB);
    assert_eq!(
        s.device("v.sock")["config"]["disk"],
        format!("file:{}/v.img", s.dir.path().display())
    );

    let res = s.ok("resize", json!({"socket": v, "size": "8M", "shrink": true}));
    assert_eq!(res["notified"], true);
    assert_eq!(backend_msg(&mut mine).0, 2);
    assert_eq!(capacity(&mut r), 8 * MIB / 512);
    assert_eq!(vio(&mut r, T_IN, 8 * MIB), 1, "past the new end: IOERR");
    assert_eq!(vio(&mut r, T_IN, 8 * MIB - 4096), 0);
    drop(r);
    wait_disconnected(&s, "v.sock", 1);

    // A front end that hands over a pipe instead of a socket: refused; the resize
    // still happens and says the front end was not told.
    let mem = SharedMem::new("guest", MEM).unwrap();
    let mut r = FakeFrontend::connect_with(
        &v,
        Connect {
            protocol: pf,
            ..Connect::new(mem)
        },
    );
    let (_rd, wr) = nix_pipe();
    let _ = r.fe.set_backend_request_fd(&wr);
    let res = s.ok("resize", json!({"socket": v, "size": "12M"}));
    assert_eq!(res["notified"], false, "{res}");
    assert!(
        res["notice"].as_str().unwrap().contains("not notified"),
        "{res}"
    );
    assert_eq!(capacity(&mut r), 12 * MIB / 512);
    assert_eq!(vio(&mut r, T_OUT, 12 * MIB - 4096), 0);
    drop(r);
    wait_disconnected(&s, "v.sock", 2);

    // One that did not negotiate BACKEND_REQ: the same.
    let mem = SharedMem::new("guest", MEM).unwrap();
    let mut r = FakeFrontend::connect_with(&v, Connect::new(mem));
    let res = s.ok("resize", json!({"socket": v, "size": "16M"}));
    assert_eq!(res["notified"], false);
    assert!(
        res["notice"]
            .as_str()
            .unwrap()
            .contains("did not negotiate"),
        "{res}"
    );
    assert_eq!(capacity(&mut r), 16 * MIB / 512);
    assert_eq!(vio(&mut r, T_OUT, 16 * MIB - 4096), 0);
    drop(r);
    wait_disconnected(&s, "v.sock", 3);

    // libblkio reads the capacity when it connects.
    let mut c = test_support::blkio::BlkioSession::open(&v).unwrap();
    c.round(16 * MIB - 4096, 0x99).unwrap();
    assert!(!s.log().contains(" ERROR "), "{}", s.log());
}

/// A pipe (read end, write end).
fn nix_pipe() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills two fds that we take ownership of right away.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fresh descriptors owned by nobody else.
    unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    }
}

/// Resizes while libblkio does verified I/O: each queue switches to the new disk
/// between requests, and no request fails or reads wrong data.
#[test]
fn vhost_user_blk_resizes_under_libblkio_io() {
    let s = Serve::start(
        &[("w.img", 16 * MIB)],
        "[[vhost_user_blk]]\nsocket = \"{dir}/w.sock\"\ndisk = \"file:{dir}/w.img\"\nqueues = 2\n",
        &["w.sock"],
    );
    let w = s.path("w.sock");
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(std::sync::Mutex::new(None::<String>));
    let io = {
        let (stop, ops, w, failed) = (stop.clone(), ops.clone(), w.clone(), failed.clone());
        std::thread::spawn(move || {
            let run = || -> Result<(), String> {
                let mut c = test_support::blkio::BlkioSession::open(&w)?;
                let mut rng = Rng::new(3);
                while !stop.load(Ordering::Relaxed) {
                    c.round(rng.below(1024) * 4096, rng.below(255) as u8 + 1)?;
                    ops.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            };
            if let Err(e) = run() {
                *failed.lock().unwrap() = Some(e);
            }
        })
    };
    let wait_ops = |more: u64| {
        let until = ops.load(Ordering::Relaxed) + more;
        wait_until("libblkio I/O", T, || {
            if let Some(e) = failed.lock().unwrap().as_ref() {
                panic!("libblkio I/O: {e}\n{}", s.log());
            }
            ops.load(Ordering::Relaxed) >= until
        });
    };
    wait_ops(20);
    for (mib, shrink) in [(20, false), (24, false), (12, true), (32, false), (8, true)] {
        let r = s.ok(
            "resize",
            json!({"socket": w, "size": format!("{mib}M"), "shrink": shrink}),
        );
        assert_eq!(r["size_bytes"], mib * MIB);
        assert_eq!(file_len(&s, "w.img"), mib * MIB);
        wait_ops(20);
    }
    stop.store(true, Ordering::Relaxed);
    io.join().unwrap();
    assert_eq!(failed.lock().unwrap().take(), None, "libblkio I/O");
    assert!(!s.log().contains(" ERROR "), "{}", s.log());
}
