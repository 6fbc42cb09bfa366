//! Ceph RBD namespaces and disks against a throwaway single-node cluster
//! (`scripts/ceph-cluster`, see tests/common/ceph.rs): verified I/O through the
//! NVMe initiator and libblkio, data checked with `rbd export`, snapshots, clones
//! and online resize over RPC, OSD restarts and an unreachable cluster during I/O,
//! and configuration errors.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::rbd::{librbd_threads, rbd_ns, thread_cpus};
use common::*;
use initiator::workload::{self, NvmeTarget, Rw, WorkloadConfig};
use initiator::{DataMode, IoOp, NvmeDriver};
use serde_json::{json, Value};
use test_support::ceph::Cluster;

const MIB: u64 = 1 << 20;

fn ns_bytes(d: &NvmeDriver) -> u64 {
    let n = &d.namespaces()[0];
    n.nsze * u64::from(n.lba_size)
}

fn verified(d: &NvmeDriver, rw: Rw, qd: u32, time: Duration) -> workload::Report {
    let t = NvmeTarget::new(d, 1, DataMode::Prp).expect("target");
    let cfg = WorkloadConfig {
        rw,
        qd,
        jobs: 1,
        verify: true,
        time,
        wait: false,
        ..Default::default()
    };
    workload::run(&t, &cfg).expect("workload")
}

#[test]
fn verified_io_through_the_nvme_initiator_and_back_with_rbd_export() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("vm1", 32 * MIB);
    let dev = TestDev::start("rbd1", &[&rbd_ns(&c, "vm1", "")]);
    let d = dev.connect();
    assert_eq!(ns_bytes(&d), 32 * MIB);
    let r = verified(
        &d,
        Rw::RandRw { read_pct: 50 },
        16,
        Duration::from_millis(1500),
    );
    // Every slot went round at least once (how many more depends on the machine).
    assert!(r.ios >= 16, "{r:?}");
    assert_eq!((r.errors, r.verify_errors), (0, 0), "{r:?}");

    // Known data at known places, PRP and SGL, then flush: `rbd export` sees it.
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(64 << 10).unwrap();
    let mut rng = Rng::new(13);
    let writes: Vec<(u64, Vec<u8>)> = (0..4u64)
        .map(|i| {
            (
                i * 10_000 + rng.below(1000),
                rng.bytes(((i + 1) * 4096) as usize),
            )
        })
        .collect();
    for (i, (slba, data)) in writes.iter().enumerate() {
        let mode = if i % 2 == 0 {
            DataMode::Prp
        } else {
            DataMode::Sgl
        };
        write_read(&mut qp, &buf, *slba, data, mode);
    }
    assert_ok(
        &io(&mut qp, IoOp::Flush, 1, 0, 0, None, DataMode::Prp),
        "flush",
    );
    drop(qp);
    drop(d);
    drop(dev);
    let image = c.export("vm1");
    assert_eq!(image.len() as u64, 32 * MIB);
    for (slba, data) in &writes {
        let at = (*slba * 512) as usize;
        assert!(
            image[at..at + data.len()] == data[..],
            "export differs at LBA {slba}"
        );
    }
}

/// Decision 0026: with 16 requests in flight on RBD an adaptive reactor sleeps
/// between completions (on librbd's completion notifier) instead of spinning
/// through every OSD round trip; the I/O stays verified.
#[test]
fn a_deep_queue_on_rbd_lets_the_adaptive_reactor_sleep_between_completions() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("deep", 32 * MIB);
    // A reactor of its own: no other test's poller asks it to spin.
    let eng = engine::Engine::start(&[None]).expect("engine");
    let dev = TestDev::start_on(&eng, "deep", &[&rbd_ns(&c, "deep", "")], |cfg| {
        cfg.poll = engine::PollMode::Adaptive;
    });
    let d = dev.connect();
    let stats = eng.stats(0).expect("reactor 0");
    let sleeps = || stats.sleeps.load(std::sync::atomic::Ordering::Relaxed);
    let before = sleeps();
    // Reads: their round trips are short enough that, spinning, the reactor would
    // never idle through the time its mode asks before sleeping.
    let r = verified(&d, Rw::RandRead, 16, Duration::from_secs(2));
    let slept = sleeps() - before;
    eprintln!("deep queue: {slept} sleeps in {} I/Os", r.ios);
    assert_eq!((r.errors, r.verify_errors), (0, 0), "{r:?}");
    // Every slot went round at least once (how many more depends on the machine).
    assert!(r.ios >= 16, "{r:?}");
    // Spinning through the round trips, it would not sleep at all under load.
    assert!(
        slept * 10 >= r.ios,
        "the reactor slept {slept} times in {} I/Os at QD16",
        r.ios
    );
    drop(d);
    drop(dev);
    eng.shutdown();
}

#[test]
fn write_zeroes_and_reads_past_the_end() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("z", 8 * MIB);
    let dev = TestDev::start("rbdz", &[&rbd_ns(&c, "z", "")]);
    let d = dev.connect();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(8192).unwrap();
    let data = Rng::new(3).bytes(8192);
    write_read(&mut qp, &buf, 100, &data, DataMode::Prp);
    let c1 = io(&mut qp, IoOp::WriteZeroes, 1, 100, 8, None, DataMode::Prp);
    assert_ok(&c1, "write zeroes");
    let c2 = io(&mut qp, IoOp::Read, 1, 100, 16, Some(&buf), DataMode::Prp);
    assert_ok(&c2, "read");
    let mut back = vec![0u8; 8192];
    buf.read(0, &mut back).unwrap();
    assert!(
        back[..4096].iter().all(|&b| b == 0),
        "write zeroes left data"
    );
    assert_eq!(back[4096..], data[4096..]);
    // The last block is fine, one past it is LBA Out of Range.
    let last = 8 * MIB / 512 - 1;
    assert_ok(
        &io(&mut qp, IoOp::Read, 1, last, 1, Some(&buf), DataMode::Prp),
        "last",
    );
    let c4 = io(&mut qp, IoOp::Read, 1, last, 2, Some(&buf), DataMode::Prp);
    assert_status(&c4, 0, 0x80, "past the end");
}

#[test]
fn a_snapshot_is_read_only_and_a_vhost_disk_works_through_libblkio() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("base", 16 * MIB);
    c.rbd(&["snap", "create", &format!("{}@empty", c.image_spec("base"))]);
    let snap = TestDev::start("rbdsnap", &[&rbd_ns(&c, "base", ",snap=empty")]);
    let d = snap.connect();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    let w = io(&mut qp, IoOp::Write, 1, 0, 8, Some(&buf), DataMode::Prp);
    assert_status(&w, 1, 0x82, "write to a snapshot");

    // The image itself as a vhost-user-blk disk, driven by libblkio.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let mut serve = Serve::spawn(&[
        "--vhost-user-blk",
        sock.to_str().unwrap(),
        "--disk",
        &rbd_ns(&c, "base", ""),
    ]);
    serve.wait_socket(&sock);
    let t = udrive::blkio_target::BlkioTarget::connect(&sock, 1, 8, 4096).expect("libblkio");
    let cfg = WorkloadConfig {
        rw: Rw::RandRw { read_pct: 50 },
        qd: 8,
        verify: true,
        time: Duration::from_millis(1000),
        ..Default::default()
    };
    let r = workload::run(&t, &cfg).expect("workload");
    // Every slot went round at least once (how many more depends on the machine).
    assert!(r.ios >= 8, "{r:?}");
    assert_eq!((r.errors, r.verify_errors), (0, 0), "{r:?}");
    drop(t);
    serve.stop();
}

/// A `udrive serve` child with a control socket.
struct Serve {
    child: Child,
    dir: tempfile::TempDir,
}

impl Serve {
    fn spawn(args: &[&str]) -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["serve", "--cpus", "0", "--rpc"])
            .arg(dir.path().join("rpc.sock"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run udrive serve");
        Serve { child, dir }
    }

    fn wait_socket(&mut self, sock: &Path) {
        let start = Instant::now();
        while !sock.exists() {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("udrive serve exited: {st}");
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no socket");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn rpc_path(&self) -> PathBuf {
        self.dir.path().join("rpc.sock")
    }

    fn call(&self, method: &str, params: Value) -> Result<Value, String> {
        let out = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["rpc", "--rpc"])
            .arg(self.rpc_path())
            .args([method, &params.to_string()])
            .output()
            .expect("run udrive rpc");
        if out.status.success() {
            Ok(serde_json::from_slice(&out.stdout).expect("json reply"))
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    #[track_caller]
    fn ok(&mut self, method: &str, params: Value) -> Value {
        match self.call(method, params) {
            Ok(v) => v,
            Err(e) => panic!("{method}: {e} (server: {:?})", self.child.try_wait()),
        }
    }

    #[track_caller]
    fn err(&self, method: &str, params: Value, want: &str) {
        match self.call(method, params) {
            Ok(v) => panic!("{method} succeeded: {v}"),
            Err(e) => assert!(e.contains(want), "{method}: `{want}` not in `{e}`"),
        }
    }

    fn stop(&mut self) {
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.stop();
    }
}

#[test]
fn snapshots_rollback_clones_and_online_resize_over_rpc() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    let conf = c.conf().display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    // The cluster's files are named only by the calls below.
    let cluster_dir = c.conf().parent().unwrap().display().to_string();
    let mut s = Serve::spawn(&[
        "--vfio-user",
        sock.to_str().unwrap(),
        "--ns",
        "ram:1M",
        "--allow-dir",
        &cluster_dir,
    ]);
    s.wait_socket(&sock);
    let at = |image: &str| json!({"image": image, "conf": conf});

    s.ok(
        "rbd_create_image",
        json!({"image": "rbd/gold", "size": "16M", "conf": conf}),
    );
    s.err(
        "rbd_create_image",
        json!({"image": "rbd/gold", "size": "16M", "conf": conf}),
        "exists already",
    );
    let ns = s.ok(
        "nvme_add_namespace",
        json!({"socket": sock, "spec": format!("rbd:rbd/gold,conf={conf}")}),
    )["nsid"]
        .as_u64()
        .unwrap();
    // Write a pattern, snapshot it, overwrite, and see both versions.
    let d = NvmeDriver::connect(&sock, opts()).unwrap();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    let v1 = Rng::new(1).bytes(4096);
    let v2 = Rng::new(2).bytes(4096);
    write_ns(&mut qp, &buf, ns as u32, 64, &v1);
    let dev = json!({"socket": sock, "nsid": ns});
    let mut snap = dev.clone();
    snap["snap"] = json!("v1");
    s.ok("rbd_snapshot_create", snap.clone());
    write_ns(&mut qp, &buf, ns as u32, 64, &v2);
    let list = s.ok("rbd_snapshot_list", dev.clone());
    assert_eq!(list[0]["name"], "v1", "{list}");
    assert_eq!(list[0]["protected"], false);

    // Rollback is refused while attached, by device and by image.
    s.err(
        "rbd_snapshot_rollback",
        snap.clone(),
        "refused while a device has the image open",
    );
    let mut by_image = at("rbd/gold");
    by_image["snap"] = json!("v1");
    s.err(
        "rbd_snapshot_rollback",
        by_image.clone(),
        "it is open by namespace",
    );
    s.err(
        "rbd_remove_image",
        at("rbd/gold"),
        "it is open by namespace",
    );

    // Clone the protected snapshot and attach the clone: it holds v1.
    s.ok("rbd_snapshot_protect", snap.clone());
    let mut clone = by_image.clone();
    clone["clone"] = json!("rbd/vm2");
    s.ok("rbd_clone_image", clone);
    let ns2 = s.ok(
        "nvme_add_namespace",
        json!({"socket": sock, "spec": format!("rbd:rbd/vm2,conf={conf}")}),
    )["nsid"]
        .as_u64()
        .unwrap() as u32;
    assert_eq!(read_ns(&mut qp, &buf, ns2, 64), v1);
    s.err(
        "rbd_snapshot_remove",
        snap.clone(),
        "clones of it still exist",
    );

    // Detach the original, roll it back, attach again: v1 is back.
    drop(qp);
    drop(d);
    s.ok("nvme_remove_namespace", json!({"socket": sock, "nsid": ns}));
    s.ok("rbd_snapshot_rollback", by_image.clone());
    let ns = s.ok(
        "nvme_add_namespace",
        json!({"socket": sock, "spec": format!("rbd:rbd/gold,conf={conf}")}),
    )["nsid"]
        .as_u64()
        .unwrap() as u32;
    reattached_image_resizes_online(&mut s, &c, &sock, ns, &v1, &v2);
    s.stop();
    // The clone's data as rbd sees it.
    assert_eq!(c.export("vm2")[64 * 512..65 * 512], v1[..512]);
}

/// On the rolled-back image (namespace `ns` of `sock`, holding `v1` at LBA 64):
/// online resize, the image grows, the host is told, the new space works (`v2`
/// written at its end); shrinking needs the flag, and with it the image shrinks
/// too.
fn reattached_image_resizes_online(
    s: &mut Serve,
    c: &Cluster,
    sock: &Path,
    ns: u32,
    v1: &[u8],
    v2: &[u8],
) {
    let mut d = NvmeDriver::connect(sock, opts()).unwrap();
    d.enable_ns_events().unwrap();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    assert_eq!(read_ns(&mut qp, &buf, ns, 64), v1);

    // Online resize: the image grows, the host is told, the new space works.
    let r = s.ok("resize", json!({"socket": sock, "nsid": ns, "size": "24M"}));
    assert_eq!(r["notified"], true, "{r}");
    let ev = d.wait_event(T).unwrap();
    assert!(ev.is_namespace_change(), "{ev:?}");
    assert!(d.rescan_namespaces().unwrap().contains(&ns));
    let n = d.namespace(ns).unwrap();
    assert_eq!(n.nsze * u64::from(n.lba_size), 24 * MIB);
    let info = c.rbd(&["info", "--format", "json", "rbd/gold"]);
    assert!(info.contains(&format!("\"size\":{}", 24 * MIB)), "{info}");
    let last = 24 * MIB / 512 - 8;
    write_ns(&mut qp, &buf, ns, last, v2);
    assert_eq!(read_ns(&mut qp, &buf, ns, last), v2);
    assert_eq!(read_ns(&mut qp, &buf, ns, 64), v1);
    // Shrinking needs the flag; with it the image shrinks too.
    s.err(
        "resize",
        json!({"socket": sock, "nsid": ns, "size": "8M"}),
        "shrink",
    );
    s.ok(
        "resize",
        json!({"socket": sock, "nsid": ns, "size": "8M", "shrink": true}),
    );
    let info = c.rbd(&["info", "--format", "json", "rbd/gold"]);
    assert!(info.contains(&format!("\"size\":{}", 8 * MIB)), "{info}");
    drop(qp);
    drop(d);
}

fn write_ns(
    qp: &mut initiator::QueuePair,
    buf: &initiator::DmaBuf,
    ns: u32,
    slba: u64,
    data: &[u8],
) {
    buf.write(0, data).unwrap();
    let c = io(
        qp,
        IoOp::Write,
        ns,
        slba,
        (data.len() / 512) as u32,
        Some(buf),
        DataMode::Prp,
    );
    assert_ok(&c, "write");
}

fn read_ns(qp: &mut initiator::QueuePair, buf: &initiator::DmaBuf, ns: u32, slba: u64) -> Vec<u8> {
    let c = io(qp, IoOp::Read, ns, slba, 8, Some(buf), DataMode::Prp);
    assert_ok(&c, "read");
    let mut b = vec![0u8; 4096];
    buf.read(0, &mut b).unwrap();
    b
}

#[test]
fn an_osd_killed_and_restarted_during_verified_io_gives_no_errors() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start_bluestore();
    c.create_image("f", 32 * MIB);
    let dev = TestDev::start("rbdosd", &[&rbd_ns(&c, "f", "")]);
    let d = dev.connect();
    let io_thread = std::thread::scope(|sc| {
        let h = sc.spawn(|| verified(&d, Rw::RandRw { read_pct: 50 }, 8, Duration::from_secs(8)));
        // The OSD goes down under running I/O (not after a guess at when it runs).
        wait_until(
            "verified I/O before the kill",
            Duration::from_secs(60),
            || {
                let st = dev.ctrl().stats();
                st.reads + st.writes > 100
            },
        );
        c.osd_stop();
        std::thread::sleep(Duration::from_secs(1));
        c.osd_start();
        h.join().unwrap()
    });
    let r = io_thread;
    assert!(r.ios > 100, "{r:?}");
    assert_eq!((r.errors, r.verify_errors), (0, 0), "{r:?}");
    assert_eq!(dev.ctrl().stats().io_errors, 0);
}

#[test]
fn an_unreachable_cluster_fails_requests_after_the_timeout_then_recovers() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("t", 8 * MIB);
    let dev = TestDev::start("rbdto", &[&rbd_ns(&c, "t", ",timeout=2")]);
    let d = dev.connect();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    let data = Rng::new(9).bytes(4096);
    write_read(&mut qp, &buf, 8, &data, DataMode::Prp);
    c.osd_stop_clean();
    let start = Instant::now();
    let w = io(&mut qp, IoOp::Write, 1, 16, 8, Some(&buf), DataMode::Prp);
    let took = start.elapsed();
    assert!(!w.status.is_ok(), "a write with the OSD down succeeded");
    assert!(
        took >= Duration::from_millis(1500),
        "failed before the timeout: {took:?}"
    );
    c.osd_start();
    // Recovers: the same queue pair, the old data, new writes.
    let start = Instant::now();
    loop {
        let r = io(&mut qp, IoOp::Read, 1, 8, 8, Some(&buf), DataMode::Prp);
        if r.status.is_ok() {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "did not recover");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    write_read(&mut qp, &buf, 24, &data, DataMode::Prp);
}

/// `udrive serve` refuses to start, before any socket exists, with `want` in its
/// error.
#[track_caller]
fn refused(spec: &str, want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("x.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args([
            "serve",
            "--cpus",
            "0",
            "--vfio-user",
            sock.to_str().unwrap(),
            "--ns",
            spec,
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run udrive serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{spec}: started");
    assert!(err.contains(want), "{spec}: `{want}` not in:\n{err}");
    assert!(!sock.exists(), "{spec}: socket created");
}

#[test]
fn cluster_configuration_errors_are_clear() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("held", 8 * MIB);
    let conf = c.conf().display().to_string();
    refused(
        &format!("rbd:nopool/x,conf={conf}"),
        "pool \"nopool\" does not exist",
    );
    refused(&format!("rbd:rbd/missing,conf={conf}"), "does not exist");
    refused(
        &format!("rbd:rbd/held,conf={conf},snap=nope"),
        "does not exist",
    );
    refused("rbd:rbd/x,conf=/nonexistent/ceph.conf", "does not exist");
    // Authentication refused: a keyring with another key for client.admin.
    let bad = c.dir().join("bad.keyring");
    std::fs::write(
        &bad,
        "[client.admin]\n\tkey = AQBXZ2xnAAAAABAAWHp3aJHhbmK6q3C1bxlHmQ==\n",
    )
    .unwrap();
    refused(
        &format!("rbd:rbd/held,conf={conf},keyring={}", bad.display()),
        "authentication refused",
    );
    // Locked by another client: this test process holds the image open.
    let dev = TestDev::start("rbdheld", &[&rbd_ns(&c, "held", "")]);
    refused(
        &format!("rbd:rbd/held,conf={conf}"),
        "in use by another client",
    );
    drop(dev);
    // A cluster nobody answers for: a conf pointing at a dead port, 2 s timeout.
    let dead = c.dir().join("dead.conf");
    let text = std::fs::read_to_string(c.conf()).unwrap();
    let port = c.mon_addr().rsplit(':').next().unwrap().to_string();
    std::fs::write(&dead, text.replace(&port, "9")).unwrap();
    let start = Instant::now();
    refused(
        &format!("rbd:rbd/held,conf={},timeout=2", dead.display()),
        "no monitor answered",
    );
    // Within the 2 s asked for, not librados' 300 s default (a bound that tells the
    // two apart, not a speed).
    assert!(start.elapsed() < Duration::from_secs(60));
    // create= makes a missing image.
    let dev = TestDev::start("rbdnew", &[&rbd_ns(&c, "fresh", ",create=4M")]);
    assert_eq!(ns_bytes(&dev.connect()), 4 * MIB);

    // `udrive check` contacts the cluster: the image is there (and its size bounds
    // a slice), or it says what is wrong; --offline only reads the files.
    check(&format!("rbd:rbd/held,conf={conf}"), &[], None);
    check(
        &format!("rbd:rbd/held,conf={conf},offset=4M,size=8M"),
        &[],
        Some("reaches beyond the end of the backend (8388608 bytes)"),
    );
    check(
        &format!("rbd:rbd/missing,conf={conf}"),
        &[],
        Some("does not exist"),
    );
    check(
        &format!("rbd:rbd/missing,conf={conf}"),
        &["--offline"],
        None,
    );
    check(
        &format!("rbd:rbd/held,conf={},timeout=2", dead.display()),
        &[],
        Some("no monitor answered"),
    );
}

/// `udrive check` of an NVMe namespace `spec`: passes, or lists `want`.
#[track_caller]
fn check(spec: &str, extra: &[&str], want: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("x.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .arg("check")
        .args(extra)
        .args(["--vfio-user", sock.to_str().unwrap(), "--ns", spec])
        .stdin(Stdio::null())
        .output()
        .expect("run udrive check");
    let err = String::from_utf8_lossy(&out.stderr);
    match want {
        None => assert!(out.status.success(), "{spec}: {err}"),
        Some(w) => {
            assert!(!out.status.success(), "{spec}: passed");
            assert!(err.contains(w), "{spec}: `{w}` not in:\n{err}");
        }
    }
}

/// librados/librbd start their threads while udrive opens the image; they inherit
/// a CPU mask without the reactors' CPUs, or the one `--rbd-cpus` gives. Also: an
/// image in a RADOS namespace.
#[test]
fn librbd_threads_stay_off_the_reactor_cpu() {
    if !test_support::ceph::available() {
        return;
    }
    let all = engine::allowed_cpus();
    if all.len() < 2 {
        return; // one CPU: nothing to keep apart
    }
    let c = Cluster::start();
    c.rbd(&["namespace", "create", "rbd/tenant"]);
    c.rbd(&["create", "--size", "8M", "rbd/tenant/img"]);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("aff.sock");
    let spec = format!("rbd:rbd/tenant/img,conf={}", c.conf().display());
    let mut s = Serve::spawn(&["--vfio-user", sock.to_str().unwrap(), "--ns", &spec]);
    s.wait_socket(&sock);
    assert_eq!(thread_cpus(s.child.id()).0, [vec![0]]);
    for (comm, cpus) in &librbd_threads(s.child.id()) {
        assert!(
            !cpus.contains(&0),
            "{comm} may run on the reactor's CPU 0: {cpus:?}"
        );
    }
    s.stop();

    // An operator whose reactors sleep (adaptive) lets librbd use every CPU.
    let list = engine::format_cpu_list(&all);
    let mut s = Serve::spawn(&[
        "--vfio-user",
        sock.to_str().unwrap(),
        "--ns",
        &spec,
        "--rbd-cpus",
        &list,
    ]);
    s.wait_socket(&sock);
    for (comm, cpus) in &librbd_threads(s.child.id()) {
        assert_eq!(cpus, &all, "{comm} with --rbd-cpus {list}");
    }
    s.stop();

    // A CPU this process may not use is refused before any socket exists.
    let out = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args([
            "serve",
            "--vfio-user",
            sock.to_str().unwrap(),
            "--ns",
            &spec,
        ])
        .args(["--rbd-cpus", "4095"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--rbd-cpus 4095"),
        "{err}"
    );
    assert!(!sock.exists());
}
