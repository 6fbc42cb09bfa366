//! A qcow2 image between processes (docs/decisions/0044-image-locking.md): QEMU's
//! image locks keep qemu-img off an image udrive writes and udrive off one QEMU
//! writes, and a live migration's two udrive processes hand the image over
//! with its metadata — the destination, opened while the source allocated
//! clusters, reads what the source wrote once it takes the image. Skipped,
//! saying so, where qemu-img is not installed (Debian: qemu-utils).

mod common;

use std::path::Path;
use std::process::Command;

use common::control::{wait_disconnected, Serve};
use serde_json::{json, Value};
use test_support::blkio::BlkioSession;
use test_support::qemu::{have_qemu_tools, qemu_check, qemu_compare, qemu_create};

const SIZE: usize = 16 << 20;
const CHUNK: usize = 64 << 10;

/// `qemu-img ARGS` expected to fail: its error text.
fn qemu_img_refused(args: &[&str]) -> String {
    let out = Command::new("qemu-img").args(args).output().unwrap();
    assert!(!out.status.success(), "qemu-img {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Writes `CHUNK` bytes of `byte` at each of `offsets` through `s` and
/// flushes; records them in `want`.
fn write_chunks(s: &mut BlkioSession, offsets: &[usize], byte: u8, want: &mut [u8]) {
    for &off in offsets {
        s.fill(byte, CHUNK);
        s.q.write(off as u64, s.buf(), CHUNK, 1, blkio::ReqFlags::empty());
        assert_eq!(s.wait(), 0, "write at {off}");
        want[off..off + CHUNK].fill(byte);
    }
    s.q.flush(1, blkio::ReqFlags::empty());
    assert_eq!(s.wait(), 0, "flush");
}

fn read_back(s: &mut BlkioSession, offsets: &[usize], want: &[u8]) {
    for &off in offsets {
        assert_eq!(s.read(off as u64, CHUNK), 0, "read at {off}");
        assert!(
            s.bytes(CHUNK) == want[off..off + CHUNK],
            "data at {off} is not what the other process wrote"
        );
    }
}

/// `get_devices`' `state.writer` of the device on `sock`.
fn writer(s: &Serve, sock: &Path) -> Value {
    let all = s.ok("get_devices", json!({}));
    let dev = all
        .as_array()
        .and_then(|a| a.iter().find(|d| d["socket"] == json!(sock)));
    dev.unwrap_or_else(|| panic!("{} not in {all}", sock.display()))["state"]["writer"].clone()
}

fn add(s: &Serve, sock: &Path, disk: String) {
    s.ok("vhost_user_blk_add", json!({"socket": sock, "disk": disk}));
}

#[test]
fn a_qcow2_image_moves_between_processes_with_its_metadata_and_locks() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.qcow2");
    qemu_create(&img, "16M", None, None);
    let (i, allow) = (img.to_str().unwrap(), dir.path().to_str().unwrap());
    let mut want = vec![0u8; SIZE];

    // The source writes the image; the destination opens it meanwhile.
    let a = Serve::start(&["--allow-dir", allow]);
    let b = Serve::start(&["--allow-dir", allow]);
    let (va, vb) = (a.path("src.sock"), b.path("dst.sock"));
    add(&a, &va, format!("qcow2:{i}"));
    add(&b, &vb, format!("qcow2:{i},incoming"));
    // The destination changes nothing of an image it does not write yet.
    assert_eq!(writer(&b, &vb), json!(false));
    let snap = dir.path().join("snap.qcow2");
    let params = json!({"socket": vb, "path": snap});
    b.err(
        "qcow2_snapshot_create",
        params,
        -32000,
        "runs in another process",
    );
    assert!(!snap.exists());
    let mut s = BlkioSession::open(&va).unwrap();
    write_chunks(&mut s, &[0, 3 << 20, 9 << 20], 0xa1, &mut want);

    // While the source writes it, QEMU's tools are refused as by a QEMU, and
    // so is the destination's front end.
    let e = qemu_img_refused(&["info", i]);
    assert!(e.contains("lock"), "{e}");
    let e = qemu_img_refused(&["check", i]);
    assert!(e.contains("lock"), "{e}");
    let out = Command::new("qemu-img")
        .args(["info", "-U", i])
        .output()
        .unwrap();
    assert!(out.status.success(), "qemu-img info -U while served");
    assert!(BlkioSession::open(&vb).is_err(), "two writers at once");

    // The source lets go (its VM left); the destination reads the clusters
    // the source allocated after the destination opened the image.
    drop(s);
    wait_disconnected(&a, &va);
    a.ok("vhost_user_blk_remove", json!({"socket": va}));
    // The source's image closes with its device; its locks go with it.
    let until = std::time::Instant::now() + common::T;
    let mut s = loop {
        match BlkioSession::open(&vb) {
            Ok(s) => break s,
            Err(e) if std::time::Instant::now() > until => panic!("destination: {e}"),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    };
    read_back(&mut s, &[0, 3 << 20, 9 << 20], &want);
    assert_eq!(writer(&b, &vb), json!(true));
    write_chunks(&mut s, &[1 << 20, 3 << 20, 15 << 20], 0xb2, &mut want);
    drop(s);
    wait_disconnected(&b, &vb);
    b.ok("vhost_user_blk_remove", json!({"socket": vb}));
    qemu_check(&img);
    qemu_compare(&img, &want);
    drop((a, b));
}

#[test]
fn udrive_refuses_an_image_qemu_writes() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("busy.qcow2");
    qemu_create(&img, "4M", None, None);
    let i = img.to_str().unwrap();
    // qemu-io holds the image as a writer while it waits on its stdin.
    let mut qemu = Command::new("qemu-io")
        .args(["-f", "qcow2", i])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&img).unwrap());
    let busy = || {
        std::fs::read_to_string("/proc/locks")
            .unwrap_or_default()
            .contains(&format!(":{ino} 201 "))
    };
    let until = std::time::Instant::now() + common::T;
    while !busy() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let allow = dir.path().to_str().unwrap();
    let s = Serve::start(&["--allow-dir", allow]);
    let e = s
        .call(
            "vhost_user_blk_add",
            json!({"socket": s.path("v.sock"), "disk": format!("qcow2:{i}")}),
        )
        .unwrap_err();
    assert!(e.1.contains("another process"), "{e:?}");
    // Read-only is refused too: QEMU does not share "write" with a reader
    // that wants the data to stay put.
    let e = s
        .call(
            "vhost_user_blk_add",
            json!({"socket": s.path("v.sock"), "disk": format!("qcow2:{i},ro")}),
        )
        .unwrap_err();
    assert!(e.1.contains("another process"), "{e:?}");
    // `locking=off` is the operator's word that it is safe (as QEMU's).
    s.ok(
        "vhost_user_blk_add",
        json!({"socket": s.path("v.sock"), "disk": format!("qcow2:{i},ro,locking=off")}),
    );
    drop(qemu.stdin.take());
    let _ = qemu.wait();
    // Two writers across processes are never `shared` for qcow2.
    let e = format!("qcow2:{i},shared")
        .parse::<udrive::nsspec::NsSpec>()
        .unwrap_err();
    assert!(e.to_string().contains("one writer"), "{e}");
}
