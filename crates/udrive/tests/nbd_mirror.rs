//! A disk moves to another host without shared storage (decision 0045): one
//! udrive exports a fresh qcow2 namespace over NBD (`nbd_server_start`,
//! `nbd_server_add`), another mirrors its running qcow2 chain into it
//! (`blockdev_mirror` with a `target`) while the initiator writes, the job
//! turns `ready` and keeps following the guest until `job_complete`; the
//! destination's own namespace then reads what the guest wrote, and its image
//! passes `qemu-img check`. QEMU's NBD client writes into and reads from an
//! export too. Hostile calls get their reasons. Skipped, saying so, where
//! qemu-img is not installed (Debian: qemu-utils).

mod common;

use std::path::Path;
use std::process::Command;

use common::control::{serve_opts, Serve};
use common::*;
use initiator::{DataMode, IoOp};
use serde_json::{json, Value};
use test_support::qemu::{have_qemu_tools, qemu_check_held};

const SIZE: usize = 16 << 20;

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Whoever connects to the NBD socket may write the exported disks.
fn assert_owner_only(sock: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{} is not owner-only", sock.display());
}

/// A server with namespace 2 on a new qcow2 image `name` in `dir`.
fn serve_qcow2(dir: &Path, name: &str) -> Serve {
    let srv = Serve::start(&["--allow-dir", dir.to_str().unwrap()]);
    let spec = format!("qcow2:{},create=16M", dir.join(name).display());
    let a = srv.nvme.to_str().unwrap();
    srv.ok("nvme_add_namespace", json!({"socket": a, "spec": spec}));
    srv
}

#[test]
fn a_running_disk_moves_to_another_udrive_over_nbd() {
    if !have_qemu_tools() {
        return;
    }
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let src = serve_qcow2(src_dir.path(), "base.qcow2");
    let dst = serve_qcow2(dst_dir.path(), "moved.qcow2");
    let (a, b) = (src.nvme.to_str().unwrap(), dst.nvme.to_str().unwrap());

    // The source's guest writes, takes a snapshot, writes more: a chain.
    let d = initiator::NvmeDriver::connect(&src.nvme, serve_opts()).unwrap();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(64 << 10).unwrap();
    let mut rng = Rng::new(70);
    let mut want = vec![0u8; SIZE];
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 60);
    let top = src_dir.path().join("top.qcow2");
    src.ok(
        "qcow2_snapshot_create",
        json!({"socket": a, "nsid": 2, "path": top}),
    );
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 60);

    // The destination exports its empty image.
    let nbd_sock = dst_dir.path().join("nbd.sock");
    dst.err(
        "nbd_server_add",
        json!({"socket": b, "nsid": 2}),
        -32000,
        "nbd_server_start first",
    );
    let listen = format!("unix:{}", nbd_sock.display());
    dst.ok("nbd_server_start", json!({"listen": listen}));
    assert_owner_only(&nbd_sock);
    dst.err(
        "nbd_server_start",
        json!({"listen": listen}),
        -32000,
        "already",
    );
    dst.ok(
        "nbd_server_add",
        json!({"socket": b, "nsid": 2, "name": "ro"}),
    );
    dst.ok(
        "nbd_server_add",
        json!({"socket": b, "nsid": 2, "name": "vm1", "writable": true}),
    );
    dst.err(
        "nbd_server_add",
        json!({"socket": b, "nsid": 2, "name": "vm1"}),
        -32000,
        "exists already",
    );
    let uri = |name: &str| format!("nbd+unix:///{name}?socket={}", nbd_sock.display());

    // Hostile mirrors: no such export, a read-only one, pivot, both targets.
    let m = |t: &str| json!({"socket": a, "nsid": 2, "target": t});
    src.err("blockdev_mirror", m(&uri("nope")), -32000, "cannot connect");
    src.err("blockdev_mirror", m(&uri("ro")), -32000, "read-only");
    src.err("blockdev_mirror", m("http://example.com/x"), -32000, "nbd");
    let pivot = json!({"socket": a, "nsid": 2, "target": uri("vm1"), "pivot": true});
    src.err("blockdev_mirror", pivot, -32000, "pivot");
    let both = json!({"socket": a, "nsid": 2, "target": uri("vm1"), "path": src_dir.path().join("x.qcow2")});
    src.err("blockdev_mirror", both, -32000, "not both");

    // The mirror, slowed down so the guest writes while it copies (16 s at
    // 1 MiB/s: still copying when job_complete is refused below, however
    // busy the machine).
    let params = json!({"socket": a, "nsid": 2, "target": uri("vm1"), "rate": "1M"});
    let id = src.ok("blockdev_mirror", params)["job"].clone();
    let j = src.job(&id);
    assert_eq!(j["target"], uri("vm1"), "{j}");
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 40);
    src.err("job_complete", json!({"id": id}), -32000, "not ready");
    assert_eq!(
        dst.ok("get_nbd_exports", json!({}))["exports"][1]["connections"],
        1
    );
    src.ok("job_set_rate", json!({"id": id, "rate": 0}));
    src.wait_job(&id, "ready");
    // Ready: every write still reaches the destination, as the guest runs.
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 40);
    assert_eq!(src.job(&id)["state"], "ready");
    src.ok("job_complete", json!({"id": id}));
    let done = src.wait_job(&id, "completed");
    assert_eq!(done["done"], done["total"], "{done}");
    // The source goes on as it was, on its own image.
    let at_switch = want.clone();
    ns2_writes(&mut qp, &buf, &mut rng, &mut want, 10);
    assert_eq!(
        first_difference(&ns2_read_all(&mut qp, &buf, SIZE), &want),
        None
    );

    // The destination's own namespace reads what the guest had written.
    wait_until("the mirror's connection closed", T, || {
        dst.ok("get_nbd_exports", json!({}))["exports"][1]["connections"] == 0
    });
    dst.ok("nbd_server_stop", json!({}));
    assert!(!nbd_sock.exists());
    assert_eq!(dst.ok("get_nbd_exports", json!({})), Value::Null);
    let d2 = initiator::NvmeDriver::connect(&dst.nvme, serve_opts()).unwrap();
    let mut qp2 = d2.create_qpair(8, false).unwrap();
    let buf2 = qp2.alloc_buf(64 << 10).unwrap();
    assert_eq!(
        first_difference(&ns2_read_all(&mut qp2, &buf2, SIZE), &at_switch),
        None
    );
    assert_ok(
        &io(&mut qp2, IoOp::Flush, 2, 0, 0, None, DataMode::Prp),
        "flush",
    );
    qemu_check_held(&dst_dir.path().join("moved.qcow2"));
}

fn qemu_img(args: &[&str]) -> std::process::Output {
    Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img (apt-get install qemu-utils)")
}

/// `qemu-img compare` of the raw file `raw` with the export `uri`.
fn assert_same(raw: &Path, uri: &str) {
    let out = qemu_img(&[
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        raw.to_str().unwrap(),
        uri,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

fn qemu_io(uri: &str, cmd: &str) -> std::process::Output {
    Command::new("qemu-io")
        .args(["-f", "raw", uri, "-c", cmd])
        .output()
        .expect("qemu-io (apt-get install qemu-utils)")
}

#[test]
fn qemu_img_writes_into_and_reads_from_an_export() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dst = serve_qcow2(dir.path(), "disk.qcow2");
    let b = dst.nvme.to_str().unwrap();
    let reply = dst.ok("nbd_server_start", json!({"listen": "127.0.0.1:0"}));
    let addr = reply["listen"].as_str().unwrap().to_string();
    assert!(!addr.ends_with(":0"), "{reply}");
    dst.ok(
        "nbd_server_add",
        json!({"socket": b, "nsid": 2, "name": "d", "writable": true}),
    );
    dst.ok(
        "nbd_server_add",
        json!({"socket": b, "nsid": 2, "name": "r"}),
    );
    let raw = dir.path().join("data.raw");
    let mut data = vec![0u8; SIZE];
    Rng::new(71).fill(&mut data);
    data[4 << 20..8 << 20].fill(0);
    std::fs::write(&raw, &data).unwrap();
    let (w, r) = (format!("nbd://{addr}/d"), format!("nbd://{addr}/r"));
    let out = qemu_img(&[
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        raw.to_str().unwrap(),
        &w,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for export in [&w, &r] {
        assert_same(&raw, export);
    }
    let info = qemu_img(&["info", "-f", "raw", &r]);
    assert!(String::from_utf8_lossy(&info.stdout).contains("16 MiB"));
    // The read-only export refuses writes; an unaligned write is made whole
    // by the client (the export says its block size).
    let out = qemu_io(&r, "write -P 1 0 4k");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("failed") || said.contains("Permission denied"),
        "{said}"
    );
    let out = qemu_io(&w, "write -P 7 1 100");
    assert!(out.status.success(), "{out:?}");
    data[1..101].fill(7);
    std::fs::write(&raw, &data).unwrap();
    // Removing an export ends its use; the other stays.
    dst.ok("nbd_server_remove", json!({"name": "d"}));
    dst.err(
        "nbd_server_remove",
        json!({"name": "d"}),
        -32000,
        "no NBD export",
    );
    let out = qemu_img(&["info", "-f", "raw", &w]);
    assert!(!out.status.success());
    assert_same(&raw, &r);
    // Stopped, the TCP listener is gone.
    dst.ok("nbd_server_stop", json!({}));
    assert!(!qemu_img(&["info", "-f", "raw", &r]).status.success());
    assert!(std::net::TcpStream::connect(&addr).is_err());
    dst.ok("nbd_server_start", json!({"listen": addr}));
}
