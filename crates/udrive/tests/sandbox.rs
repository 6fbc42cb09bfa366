//! The sandbox of a running `udrive serve` (docs/security.md): every thread
//! under a seccomp filter with no new privileges, and files outside the
//! configured paths and `--allow-dir` refused with a clear error.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use common::control::{serve_opts, Serve};
use initiator::{DataMode, NvmeDriver};
use serde_json::json;

const SERVER_ERROR: i64 = -32000;

/// `(thread name, Seccomp:, NoNewPrivs:)` of every thread of `pid`.
fn threads(pid: i32) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let field = |name: &str| field_of(&status, name);
        out.push((
            comm.trim().to_owned(),
            field("Seccomp:"),
            field("NoNewPrivs:"),
        ));
    }
    out
}

#[test]
fn every_thread_of_a_serving_server_is_filtered() {
    let s = Serve::start(&[]);
    let vhost = s.path("v.sock");
    s.ok(
        "vhost_user_blk_add",
        json!({"socket": vhost, "disk": "ram:8M"}),
    );
    // A client, so that connection and admin threads exist too.
    let d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    common::control::round_trip(&d, 7);
    let all = threads(s.pid());
    for want in [
        "reactor0",
        "vfu-hub",
        "nvme-admin",
        "rpc-accept",
        "vhost-blk",
        "spawner",
    ] {
        assert!(all.iter().any(|(n, ..)| n == want), "no {want} in {all:?}");
    }
    assert!(all.iter().any(|(n, ..)| n.starts_with("vfu-UD")), "{all:?}");
    for (name, seccomp, nnp) in &all {
        assert_eq!(
            (seccomp.as_str(), nnp.as_str()),
            ("2", "1"),
            "thread {name}"
        );
    }
    drop(d);
}

#[test]
fn without_the_sandbox_no_thread_is_filtered() {
    let s = Serve::start(&["--seccomp", "off", "--landlock", "off"]);
    for (name, seccomp, _) in threads(s.pid()) {
        assert_eq!(seccomp, "0", "thread {name}");
    }
}

#[test]
fn a_disk_outside_the_allowed_directories_is_refused() {
    let elsewhere = tempfile::tempdir().unwrap();
    let img = elsewhere.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let spec = format!("file:{},direct=off", img.display());
    let s = Serve::start(&[]);
    let add = json!({"socket": s.nvme, "spec": spec});
    s.err(
        "nvme_add_namespace",
        add.clone(),
        SERVER_ERROR,
        "--allow-dir",
    );
    let dir = elsewhere.path().display().to_string();
    let allowed = Serve::start(&["--allow-dir", &dir]);
    let add = json!({"socket": allowed.nvme, "spec": spec});
    let ns = allowed.ok("nvme_add_namespace", add);
    assert_eq!(ns["nsid"], 2);
}

/// A qcow2 image inside the allowed directories whose header names a backing
/// file outside them: refused at open, saying where and what to do.
#[test]
fn a_backing_file_outside_the_allowed_directories_is_refused_by_name() {
    if !test_support::qemu::have_qemu_tools() {
        return;
    }
    let (inside, elsewhere) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let base = elsewhere.path().join("secret.raw");
    std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
    let top = inside.path().join("top.qcow2");
    let base_name = base.display().to_string();
    test_support::qemu::qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        &base_name,
        "-F",
        "raw",
        top.to_str().unwrap(),
        "1M",
    ]);
    let s = Serve::start(&["--allow-dir", inside.path().to_str().unwrap()]);
    let add = json!({"socket": s.nvme, "spec": format!("qcow2:{}", top.display())});
    let want = format!("a backing file of the image: {base_name} is outside the directories");
    s.err("nvme_add_namespace", add, SERVER_ERROR, &want);
}

/// The value of `name` (`"Uid:"`) in a `/proc/.../status` text.
fn field_of(status: &str, name: &str) -> String {
    let line = status.lines().find_map(|l| l.strip_prefix(name));
    line.unwrap_or_default().trim().to_owned()
}

fn status_field(pid: i32, name: &str) -> String {
    field_of(
        &std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap(),
        name,
    )
}

/// `--user`: the server drops to that user before it starts anything, keeps no
/// capability, and cannot be dumped.
#[test]
fn with_user_the_server_runs_unprivileged_and_serves() {
    if status_field(std::process::id() as i32, "Uid:")
        .split_whitespace()
        .next()
        != Some("0")
    {
        eprintln!("skipped: not root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let (rpc, nvme) = (dir.path().join("rpc.sock"), dir.path().join("a.sock"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_udrive"));
    cmd.args(["serve", "--cpus", "0", "--ns", "ram:16M", "--vfio-user"])
        .arg(&nvme)
        .arg("--rpc")
        .arg(&rpc)
        .args(["--user", "nobody"]);
    let s = Serve::spawn(cmd, dir, rpc, nvme);
    let uids = status_field(s.pid(), "Uid:");
    assert!(uids.split_whitespace().all(|u| u != "0"), "Uid: {uids}");
    assert_eq!(status_field(s.pid(), "CapEff:"), "0000000000000000");
    assert_eq!(status_field(s.pid(), "CapPrm:"), "0000000000000000");
    let d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    common::control::round_trip(&d, 3);
}

/// Each file engine does its I/O under the reactor's filter: io_uring (with its
/// restricted ring) and the inline engine's plain system calls.
#[test]
fn file_engines_serve_under_the_filters() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = Vec::new();
    for engine in ["uring", "inline"] {
        let img = dir.path().join(format!("{engine}.img"));
        std::fs::write(&img, vec![0u8; 4 << 20]).unwrap();
        args.push("--ns".to_owned());
        args.push(format!("file:{},direct=off,engine={engine}", img.display()));
    }
    args.extend(["--allow-dir".to_owned(), dir.path().display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let s = Serve::start(&args);
    let d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    for nsid in [2, 3] {
        let mut qp = d.create_qpair(16, false).unwrap();
        let buf = qp.alloc_buf(4096).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + nsid) as u8).collect();
        test_support::driver::write_read_ns(&mut qp, nsid, &buf, 8, &data, DataMode::Prp);
    }
    drop(d);
    for (name, seccomp, _) in threads(s.pid()) {
        assert_eq!(seccomp, "2", "thread {name}");
    }
}

/// A live migration's destination device (`incoming`) takes the file's writer
/// claim on its own thread when the front end starts it: the lock goes through
/// the descriptor opened when the device was built, which the device thread's
/// filter (files read-only) allows.
#[test]
fn a_migration_destination_takes_the_writer_claim_under_the_filters() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 4 << 20]).unwrap();
    let allow = dir.path().display().to_string();
    let s = Serve::start(&["--allow-dir", &allow]);
    let vhost = s.path("v.sock");
    s.ok(
        "vhost_user_blk_add",
        json!({"socket": vhost, "disk": format!("file:{},incoming", img.display())}),
    );
    test_support::blkio::blkio_round(&vhost, 0x5a);
    // Still serving, and the claim is held: another writer's lock is refused.
    s.ok("get_version", json!({}));
    let other = bdev::RangeClaim::new(img, 0, 0).unwrap();
    let e = bdev::WriterClaim::take(&other).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ResourceBusy, "{e}");
}

/// A qcow2 image on tmpfs over a raw backing file, engine chosen by probing the
/// files: the probe runs when the image opens (control thread), not when a
/// client's queue makes a channel on the connection's thread, whose filter has
/// no file reads.
#[test]
fn a_qcow2_image_on_tmpfs_serves_under_the_filters() {
    if !test_support::qemu::have_qemu_tools() {
        eprintln!("skipped: no qemu-img");
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let base = dir.path().join("base.raw");
    std::fs::write(&base, vec![0x5au8; 4 << 20]).unwrap();
    let img = dir.path().join("top.qcow2");
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(&base)
        .arg(&img)
        .status()
        .unwrap();
    assert!(st.success());
    let ns = format!("qcow2:{}", img.display());
    let allow = dir.path().display().to_string();
    let s = Serve::start(&["--ns", &ns, "--allow-dir", &allow]);
    let d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    let mut qp = d.create_qpair(16, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
    test_support::driver::write_read_ns(&mut qp, 2, &buf, 8, &data, DataMode::Prp);
    drop(d);
    s.ok("get_version", json!({}));
}
