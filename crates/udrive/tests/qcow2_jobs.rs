//! Live snapshots and block jobs of a qcow2 namespace over RPC while the
//! initiator does verified I/O (decision 0041): a snapshot, a rate-limited
//! commit paused and resumed with writes meanwhile, a stream, a mirror with a
//! pivot; the images pass
//! `qemu-img check` and `qemu-img compare` against what was written; hostile
//! calls get their reasons. Live handovers (`udrive upgrade`) after a snapshot
//! and with a commit, a stream and a mirror mid-way (decision 0043): the jobs
//! go on in the new server under the same ids and end with the same images; a
//! handover that fails leaves them running in the old one. Images a running
//! server holds are checked as an operator would, past QEMU's image locks
//! (`qemu-img check -U`). Skipped, saying so, where qemu-img is not installed
//! (Debian: qemu-utils).

mod common;

use std::path::Path;

use common::control::{serve_opts, udrive_ok, wait_disconnected, Serve};
use common::*;
use initiator::{DataMode, DmaBuf, IoOp, QueuePair};
use serde_json::{json, Value};
use test_support::qemu::{
    have_qemu_tools, qemu_check, qemu_check_held, qemu_compare, qemu_compare_held, qemu_img,
};

const SIZE: usize = 16 << 20;

/// Reads namespace 2 whole and compares it with `want`, then flushes it
/// (which writes the image's metadata back for qemu-img).
fn verify_and_flush(qp: &mut QueuePair, buf: &DmaBuf, want: &[u8]) {
    let got = ns2_read_all(qp, buf, SIZE);
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("data at {at}");
    }
    assert_ok(&io(qp, IoOp::Flush, 2, 0, 0, None, DataMode::Prp), "flush");
}

#[test]
fn snapshot_commit_and_stream_over_rpc_under_io() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let srv = Serve::start(&["--allow-dir", dir.path().to_str().unwrap()]);
    let a = srv.nvme.to_str().unwrap();
    let base = dir.path().join("base.qcow2");
    let spec = format!("qcow2:{},create=16M", base.display());
    srv.ok("nvme_add_namespace", json!({"socket": a, "spec": spec}));
    let d = initiator::NvmeDriver::connect(&srv.nvme, serve_opts()).unwrap();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(64 << 10).unwrap();
    let mut rng = Rng::new(60);
    let mut want = vec![0u8; SIZE];
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 60);

    // Hostile: not a qcow2 disk, a target that exists, no backing file.
    let top = dir.path().join("top.qcow2");
    let snap = |nsid: u32, path: &Path| json!({"socket": a, "nsid": nsid, "path": path});
    srv.err(
        "qcow2_snapshot_create",
        snap(1, &top),
        -32000,
        "not a whole qcow2 image",
    );
    srv.err(
        "qcow2_snapshot_create",
        snap(2, &base),
        -32000,
        "already exists",
    );
    srv.err(
        "block_commit",
        json!({"socket": a, "nsid": 2}),
        -32000,
        "no backing file",
    );
    srv.err("job_cancel", json!({"id": 99}), -32000, "no job 99");

    let r = srv.ok("qcow2_snapshot_create", snap(2, &top));
    assert!(r["image"].as_str().unwrap().ends_with("top.qcow2"), "{r}");
    assert!(r["pause_us"].as_u64().is_some(), "{r}");
    eprintln!("snapshot: device paused {} us", r["pause_us"]);
    let before = want.clone();
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 60);
    verify_and_flush(&mut qp, &buf, &want);
    qemu_check_held(&top);
    qemu_compare_held(&base, &before);
    let info = qemu_img(&["info", "-U", top.to_str().unwrap()]);
    assert!(info.contains("backing file: base.qcow2"), "{info}");

    // Commit at 1 MiB/s, paused with writes meanwhile, then unlimited.
    let id = srv.ok(
        "block_commit",
        json!({"socket": a, "nsid": 2, "rate": "1M"}),
    )["job"]
        .clone();
    srv.err(
        "qcow2_snapshot_create",
        snap(2, &dir.path().join("x.qcow2")),
        -32000,
        "block job",
    );
    srv.ok("job_pause", json!({"id": id}));
    let paused = srv.wait_job(&id, "paused");
    assert_eq!(paused["type"], "commit");
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 40);
    srv.ok("job_resume", json!({"id": id}));
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 20);
    srv.ok("job_set_rate", json!({"id": id, "rate": 0}));
    let done = srv.wait_job(&id, "completed");
    assert_eq!(done["done"], done["total"], "{done}");
    srv.err("job_resume", json!({"id": id}), -32000, "completed already");
    let metrics = srv.ok("get_metrics", json!({}));
    let line = format!("udrive_block_job_total_bytes{{id=\"{id}\",type=\"commit\"");
    assert!(metrics.as_str().unwrap().contains(&line), "{metrics}");
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 30);
    verify_and_flush(&mut qp, &buf, &want);
    let ns = &srv.ok("get_devices", json!({"socket": a}))[0]["namespaces"][1]["image"];
    assert!(ns["path"].as_str().unwrap().ends_with("base.qcow2"), "{ns}");
    qemu_check_held(&base);
    qemu_compare_held(&base, &want);

    stream_then_mirror(&srv, dir.path(), &mut qp, &buf, &mut rng, &mut want);
}

/// A second snapshot, streamed (the new image stands alone), then mirrored
/// with a pivot.
fn stream_then_mirror(
    srv: &Serve,
    dir: &Path,
    qp: &mut QueuePair,
    buf: &DmaBuf,
    rng: &mut Rng,
    want: &mut [u8],
) {
    let a = srv.nvme.to_str().unwrap();
    let snap = |path: &Path| json!({"socket": a, "nsid": 2, "path": path});
    let top2 = dir.join("top2.qcow2");
    srv.ok("qcow2_snapshot_create", snap(&top2));
    ns2_writes(qp, buf, rng, want, 30);
    // Through `udrive rpc --wait`, which returns once the job ended.
    let rpc = srv.rpc.clone();
    let params = json!({"socket": a, "nsid": 2, "rate": "64M"}).to_string();
    let waiter = std::thread::spawn(move || {
        let rpc = rpc.to_str().unwrap();
        udrive_ok(&["rpc", "--rpc", rpc, "--wait", "block_stream", &params])
    });
    ns2_writes(qp, buf, rng, want, 30);
    let out = waiter.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("\"state\": \"completed\""), "{text}");
    verify_and_flush(qp, buf, want);
    let info = qemu_img(&["info", "-U", top2.to_str().unwrap()]);
    assert!(!info.contains("backing file"), "{info}");
    qemu_check_held(&top2);
    qemu_compare_held(&top2, want);

    // A mirror into a new image, pivoting: the disk moves there.
    let moved = dir.join("moved.qcow2");
    let m = |path: &Path| json!({"socket": a, "nsid": 2, "path": path, "pivot": true});
    srv.err("blockdev_mirror", m(&top2), -32000, "already exists");
    let id = srv.ok("blockdev_mirror", m(&moved))["job"].clone();
    ns2_writes(qp, buf, rng, want, 30);
    assert_eq!(srv.wait_job(&id, "completed")["type"], "mirror");
    ns2_writes(qp, buf, rng, want, 10);
    verify_and_flush(qp, buf, want);
    let ns = &srv.ok("get_devices", json!({"socket": a}))[0]["namespaces"][1]["image"];
    assert!(
        ns["path"].as_str().unwrap().ends_with("moved.qcow2"),
        "{ns}"
    );
    qemu_check_held(&moved);
    qemu_compare_held(&moved, want);
}

/// The same on a vhost-user-blk disk (its own pause path) under libblkio: a
/// snapshot, then a commit with writes while it runs.
#[test]
fn a_vhost_user_blk_disk_is_snapshotted_and_committed_under_libblkio() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let srv = Serve::start(&["--allow-dir", dir.path().to_str().unwrap()]);
    let v = srv.path("v.sock");
    let base = dir.path().join("base.qcow2");
    let disk = format!("qcow2:{},create=8M", base.display());
    srv.ok("vhost_user_blk_add", json!({"socket": v, "disk": disk}));
    let mut s = Rounds::open(&v);
    s.run(20);
    let top = dir.path().join("top.qcow2");
    srv.ok("qcow2_snapshot_create", json!({"socket": v, "path": top}));
    s.run(20);
    let id = srv.ok("block_commit", json!({"socket": v, "rate": "4M"}))["job"].clone();
    s.run(20);
    srv.wait_job(&id, "completed");
    s.run(20);
    let want = s.close();
    wait_disconnected(&srv, &v);
    srv.ok("vhost_user_blk_remove", json!({"socket": v}));
    qemu_check(&base);
    qemu_compare(&base, &want);
}

/// A libblkio client writing 4 KiB rounds (write, read back) over 8 MiB of a
/// vhost-user-blk disk, and what the disk must hold.
struct Rounds {
    s: test_support::blkio::BlkioSession,
    want: Vec<u8>,
    n: u8,
}

impl Rounds {
    fn open(sock: &Path) -> Rounds {
        let s = test_support::blkio::BlkioSession::open(sock).unwrap();
        Rounds {
            s,
            want: vec![0u8; 8 << 20],
            n: 0,
        }
    }
    fn run(&mut self, k: u64) {
        for i in 0..k {
            self.n = self.n.wrapping_add(1);
            let off = (u64::from(self.n) * 37 + i * 301) % 2000 * 4096;
            self.s.round(off, self.n).unwrap();
            self.want[off as usize..off as usize + 4096].fill(self.n);
        }
    }
    fn close(self) -> Vec<u8> {
        self.want
    }
}

/// A commit on a vhost-user-blk disk across `udrive upgrade`: the connection
/// and the job are taken over, guest writes go on through the new process
/// (written through to the base), and the job ends there.
#[test]
fn a_commit_on_a_vhost_user_blk_disk_goes_on_after_a_live_handover() {
    if !have_qemu_tools() {
        return;
    }
    let s = common::served::Service::start(|dir| {
        format!(
            "cpus = \"0\"\nrpc = \"{}\"\n[[vhost_user_blk]]\nsocket = \"{}\"\n\
             disk = \"qcow2:{},create=8M\"\n",
            dir.join("rpc.sock").display(),
            dir.join("v.sock").display(),
            dir.join("base.qcow2").display()
        )
    });
    let (v, base) = (s.path("v.sock"), s.path("base.qcow2"));
    let ok = |m: &str, p: Value| {
        s.rpc(m, p)
            .unwrap_or_else(|e| panic!("{m}: {e}\n{}", s.log()))
    };
    let job = |id: &Value| {
        let jobs = ok("get_jobs", json!({}));
        let j = jobs.as_array().unwrap().iter().find(|j| j["id"] == *id);
        j.cloned()
            .unwrap_or_else(|| panic!("job {id} not in {jobs}"))
    };
    let mut r = Rounds::open(&v);
    r.run(20);
    ok(
        "qcow2_snapshot_create",
        json!({"socket": v, "path": s.path("top.qcow2")}),
    );
    r.run(40);
    let id = ok("block_commit", json!({"socket": v, "rate": "64K"}))["job"].clone();
    r.run(10);
    wait_until("the commit copies", T, || {
        job(&id)["done"].as_u64() > Some(0)
    });
    let before = job(&id);
    assert!(
        before["done"].as_u64() < before["total"].as_u64(),
        "{before}"
    );
    let pid = s.pid();
    s.upgrade_ok("commit running on a vhost-user-blk disk");
    assert_ne!(s.pid(), pid, "a new process serves");
    let after = job(&id);
    assert_eq!(after["state"], "running", "{after}");
    assert!(after["done"].as_u64() >= before["done"].as_u64(), "{after}");
    r.run(20);
    ok("job_set_rate", json!({"id": id, "rate": 0}));
    wait_until("commit completed", T, || job(&id)["state"] == "completed");
    r.run(20);
    let want = r.close();
    // A clean stop writes the metadata back.
    s.stop();
    qemu_check(&base);
    qemu_compare(&base, &want);
}

/// A server from a configuration (so that `udrive upgrade` can replace it)
/// with a qcow2 image as namespace 2 of an NVMe controller, and a client
/// doing verified I/O on it, before and after a live snapshot.
struct Handed {
    s: common::served::Service,
    qp: QueuePair,
    buf: DmaBuf,
    rng: Rng,
    want: Vec<u8>,
    _d: initiator::NvmeDriver,
}

impl Handed {
    fn start(seed: u64) -> Handed {
        let s = common::served::Service::start(|dir| {
            format!(
                "cpus = \"0\"\nrpc = \"{}\"\n[[controller]]\nsocket = \"{}\"\n\
                 namespaces = [\"null:16M\", \"qcow2:{},create=16M\"]\n",
                dir.join("rpc.sock").display(),
                dir.join("a.sock").display(),
                dir.join("base.qcow2").display()
            )
        });
        let d = initiator::NvmeDriver::connect(s.path("a.sock"), serve_opts()).unwrap();
        let mut qp = d.create_qpair(8, false).unwrap();
        let buf = qp.alloc_buf(64 << 10).unwrap();
        let (mut rng, mut want) = (Rng::new(seed), vec![0u8; SIZE]);
        ns2_writes(&mut qp, &buf, &mut rng, &mut want, 60);
        let mut h = Handed {
            s,
            qp,
            buf,
            rng,
            want,
            _d: d,
        };
        let top = h.s.path("top.qcow2");
        h.ok("qcow2_snapshot_create", h.params(json!({"path": top})));
        h.writes(40);
        h
    }
    fn ok(&self, method: &str, params: Value) -> Value {
        self.s
            .rpc(method, params)
            .unwrap_or_else(|e| panic!("{method}: {e}\n{}", self.s.log()))
    }
    fn params(&self, more: Value) -> Value {
        let mut p = json!({"socket": self.s.path("a.sock"), "nsid": 2});
        p.as_object_mut()
            .unwrap()
            .extend(more.as_object().unwrap().clone());
        p
    }
    fn writes(&mut self, n: usize) {
        ns2_writes(&mut self.qp, &self.buf, &mut self.rng, &mut self.want, n);
    }
    fn verify(&mut self) {
        verify_and_flush(&mut self.qp, &self.buf, &self.want);
    }
    fn job(&self, id: &Value) -> Value {
        let jobs = self.ok("get_jobs", json!({}));
        let job = jobs.as_array().unwrap().iter().find(|j| j["id"] == *id);
        job.cloned()
            .unwrap_or_else(|| panic!("job {id} not in {jobs}"))
    }
    /// Starts `method` (rate-limited by `more`) and waits until it moved on.
    fn start_job(&mut self, method: &str, more: Value) -> Value {
        let id = self.ok(method, self.params(more))["job"].clone();
        self.writes(10);
        wait_until("the job copies", T, || {
            self.job(&id)["done"].as_u64() > Some(0)
        });
        id
    }
    /// `udrive upgrade` with job `id` part-way: it goes on in the new process
    /// with its id, its type, its state and at least its progress.
    fn upgrade_mid_job(&mut self, id: &Value, what: &str) -> Value {
        let before = self.job(id);
        assert!(
            before["done"].as_u64() < before["total"].as_u64(),
            "{before}"
        );
        let pid = self.s.pid();
        self.s.upgrade_ok(what);
        assert_ne!(self.s.pid(), pid, "{what}: a new process serves");
        let after = self.job(id);
        for k in ["type", "state", "total", "socket", "nsid"] {
            assert_eq!(after[k], before[k], "{what}: {k}: {after}");
        }
        assert!(after["done"].as_u64() >= before["done"].as_u64(), "{after}");
        after
    }
    fn image(&self) -> Value {
        self.ok("get_devices", json!({"socket": self.s.path("a.sock")}))[0]["namespaces"][1]
            ["image"]
            .clone()
    }
}

#[test]
fn jobs_and_changed_chains_go_on_after_a_live_handover() {
    if !have_qemu_tools() {
        return;
    }
    let mut h = Handed::start(70);
    let base = h.s.path("base.qcow2");
    // A snapshot, a handover, I/O: the new process serves the overlay.
    let chain = h.image();
    h.s.upgrade_ok("after a snapshot");
    assert_eq!(h.image()["path"], chain["path"]);
    assert_eq!(h.image()["backing_chain"], chain["backing_chain"]);
    h.writes(40);
    h.verify();

    // A commit handed over while it runs: it ends in the new process.
    let id = h.start_job("block_commit", json!({"rate": "128K"}));
    let after = h.upgrade_mid_job(&id, "commit running");
    assert_eq!(after["state"], "running", "{after}");
    h.writes(20);
    h.ok("job_set_rate", json!({"id": id, "rate": 0}));
    wait_until("commit completed", T, || h.job(&id)["state"] == "completed");
    h.writes(20);
    h.verify();
    assert!(h.image()["path"].as_str().unwrap().ends_with("base.qcow2"));
    qemu_check_held(&base);
    qemu_compare_held(&base, &h.want);

    // A stream followed by `udrive rpc --wait`, across a handover.
    let top2 = h.s.path("top2.qcow2");
    h.ok("qcow2_snapshot_create", h.params(json!({"path": top2})));
    h.writes(20);
    let (rpc, params) = (h.s.path("rpc.sock"), h.params(json!({"rate": "256K"})));
    let waiter = std::thread::spawn(move || {
        let (rpc, params) = (rpc.to_str().unwrap(), params.to_string());
        udrive_ok(&["rpc", "--rpc", rpc, "--wait", "block_stream", &params])
    });
    wait_until("stream listed", T, || {
        h.ok("get_jobs", json!({})).as_array().unwrap().len() == 2
    });
    let id = h.ok("get_jobs", json!({}))[1]["id"].clone();
    wait_until("the stream copies", T, || {
        h.job(&id)["done"].as_u64() > Some(0)
    });
    h.upgrade_mid_job(&id, "stream running");
    h.writes(20);
    h.ok("job_set_rate", json!({"id": id, "rate": 0}));
    let out = waiter.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("\"state\": \"completed\""), "{text}");
    h.verify();
    let info = qemu_img(&["info", "-U", top2.to_str().unwrap()]);
    assert!(!info.contains("backing file"), "{info}");
    qemu_check_held(&top2);
    qemu_compare_held(&top2, &h.want);
    mirror_paused_across_a_handover(&mut h);
}

/// A mirror with pivot, paused when handed over: paused in the new process,
/// resumed there, the disk moves to the copy.
fn mirror_paused_across_a_handover(h: &mut Handed) {
    let moved = h.s.path("moved.qcow2");
    let id = h.start_job(
        "blockdev_mirror",
        json!({"path": moved, "pivot": true, "rate": "256K"}),
    );
    h.ok("job_pause", json!({"id": id}));
    wait_until("mirror paused", T, || h.job(&id)["state"] == "paused");
    h.writes(20);
    h.upgrade_mid_job(&id, "mirror paused");
    h.writes(20);
    h.ok("job_set_rate", json!({"id": id, "rate": 0}));
    h.ok("job_resume", json!({"id": id}));
    wait_until("mirror completed", T, || h.job(&id)["state"] == "completed");
    h.writes(10);
    h.verify();
    assert!(h.image()["path"].as_str().unwrap().ends_with("moved.qcow2"));
    // Ids go on from the old process's.
    let top3 = h.s.path("top3.qcow2");
    h.ok("qcow2_snapshot_create", h.params(json!({"path": top3})));
    let next = h.ok("block_stream", h.params(json!({})))["job"].clone();
    assert!(next.as_u64() > id.as_u64(), "{next} after {id}");
    wait_until("stream completed", T, || {
        h.job(&next)["state"] == "completed"
    });
    h.verify();
    qemu_check_held(&moved);
    qemu_check_held(&top3);
    qemu_compare_held(&top3, &h.want);
    let log = h.s.log();
    assert_eq!(log.matches("block job taken over").count(), 3, "{log}");
    assert!(
        log.contains("changed this disk's chain before the handover"),
        "{log}"
    );
}

#[test]
fn a_failed_handover_leaves_the_jobs_running_in_the_old_process() {
    if !have_qemu_tools() {
        return;
    }
    let mut h = Handed::start(71);
    let base = h.s.path("base.qcow2");
    let id = h.start_job("block_commit", json!({"rate": "64K"}));
    let pid = h.s.pid();
    // The new process dies after it received everything, then after it set
    // the job up again (the commit's base opened, written through).
    for step in ["start", "confirm"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["serve", "--takeover"])
            .arg(h.s.path("rpc.sock"))
            .env("UDRIVE_TAKEOVER_DIE_AT", step)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{step}");
        assert_eq!(h.s.pid(), pid, "{step}: the old process serves on");
        let job = h.job(&id);
        assert_eq!(job["state"], "running", "{step}: {job}");
        let done = job["done"].as_u64();
        h.writes(10);
        wait_until("the job goes on", T, || h.job(&id)["done"].as_u64() > done);
    }
    h.ok("job_set_rate", json!({"id": id, "rate": 0}));
    wait_until("commit completed", T, || h.job(&id)["state"] == "completed");
    h.writes(20);
    h.verify();
    qemu_check_held(&base);
    qemu_compare_held(&base, &h.want);
}

/// A mirror into another server's NBD export (decision 0045), handed over
/// while it copies: the new process connects again and goes on; ready, it
/// follows the guest until `job_complete`, and the export holds the guest's
/// data.
#[test]
fn a_mirror_to_another_host_goes_on_after_a_live_handover() {
    if !have_qemu_tools() {
        return;
    }
    let mut h = Handed::start(72);
    let dst = Serve::start(&[]);
    let dst_img = dst.dir.path().join("moved.qcow2");
    let spec = format!("qcow2:{},create=16M", dst_img.display());
    let b = dst.nvme.to_str().unwrap();
    dst.ok("nvme_add_namespace", json!({"socket": b, "spec": spec}));
    let nbd_sock = dst.dir.path().join("nbd.sock");
    let listen = format!("unix:{}", nbd_sock.display());
    dst.ok("nbd_server_start", json!({"listen": listen}));
    dst.ok(
        "nbd_server_add",
        json!({"socket": b, "nsid": 2, "name": "vm", "writable": true}),
    );
    let uri = format!("nbd+unix:///vm?socket={}", nbd_sock.display());
    let id = h.start_job("blockdev_mirror", json!({"target": uri, "rate": "256K"}));
    let after = h.upgrade_mid_job(&id, "mirror to another host");
    assert_eq!(after["target"], uri.as_str(), "{after}");
    h.writes(20);
    h.ok("job_set_rate", json!({"id": id, "rate": 0}));
    wait_until("mirror ready", T, || h.job(&id)["state"] == "ready");
    h.writes(20);
    h.ok("job_complete", json!({"id": id}));
    wait_until("mirror completed", T, || h.job(&id)["state"] == "completed");
    let want = dst.dir.path().join("want.raw");
    std::fs::write(&want, &h.want).unwrap();
    let out = std::process::Command::new("qemu-img")
        .args([
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            want.to_str().unwrap(),
            &uri,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    h.verify();
}
