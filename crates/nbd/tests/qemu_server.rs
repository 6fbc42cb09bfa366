//! Our server against independent clients (qemu-io, qemu-img) and our client.

mod common;

use std::process::Command;

use common::{pattern, require, run, TestServer};
use nbd::{Client, Uri};

const SIZE: usize = 4 << 20;

#[test]
fn qemu_io_writes_zeroes_reads_and_flushes() {
    require("qemu-io");
    let srv = TestServer::start("disk0", SIZE, false);
    srv.data.lock().unwrap()[64 << 10..128 << 10].fill(0x55);
    let out = run(Command::new("qemu-io")
        .args(["-f", "raw", &srv.uri("disk0")])
        .args([
            "-c",
            "write -P 0xab 0 64k",
            "-c",
            "write -z 64k 64k",
            "-c",
            "read -P 0xab 0 64k",
            "-c",
            "read -P 0 64k 64k",
            "-c",
            "flush",
        ]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("Pattern verification failed"), "{stdout}");
    let data = srv.data.lock().unwrap();
    assert!(data[..64 << 10].iter().all(|&b| b == 0xab));
    assert!(data[64 << 10..128 << 10].iter().all(|&b| b == 0));
    assert!(data[128 << 10..].iter().all(|&b| b == 0));
    assert!(
        *srv.flushes.lock().unwrap() >= 1,
        "flush reached the export"
    );
}

#[test]
fn qemu_io_read_pattern_mismatch_is_seen() {
    // The check above must be able to fail: a wrong pattern is reported.
    require("qemu-io");
    let srv = TestServer::start("disk0", SIZE, false);
    let (_, all) = qemu_io_once(&srv.uri("disk0"), "read -P 0xab 0 4k");
    assert!(all.contains("Pattern verification failed"), "{all}");
}

#[test]
fn qemu_img_converts_into_our_export_and_reads_its_size() {
    require("qemu-img");
    let srv = TestServer::start("disk0", SIZE, false);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.raw");
    let mut bytes = pattern(7, SIZE);
    bytes[1 << 20..2 << 20].fill(0); // a zero run, which qemu-img may send as WRITE_ZEROES
    std::fs::write(&src, &bytes).unwrap();
    srv.data.lock().unwrap().fill(0xee);

    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(srv.uri("disk0")));
    assert!(
        *srv.data.lock().unwrap() == bytes,
        "export differs from the converted file"
    );

    let out = run(Command::new("qemu-img").args(["info", "--output=json", &srv.uri("disk0")]));
    let info = String::from_utf8_lossy(&out.stdout);
    assert!(
        info.contains(&format!("\"virtual-size\": {SIZE}")),
        "{info}"
    );
    for r in srv.results.lock().unwrap().iter() {
        assert!(r.is_ok(), "serve failed: {r:?}");
    }
}

#[test]
fn qemu_io_sees_a_read_only_export_and_unknown_names_fail() {
    require("qemu-io");
    let srv = TestServer::start("ro", SIZE, true);
    let (ok, all) = qemu_io_once(&srv.uri("ro"), "write -P 1 0 4k");
    // qemu opens read-write by default and refuses an export flagged read-only.
    assert!(!ok || all.contains("not permitted"), "{all}");
    assert!(
        all.contains("Permission denied") || all.contains("not permitted"),
        "{all}"
    );
    assert!(srv.data.lock().unwrap().iter().all(|&b| b == 0));
    run(Command::new("qemu-io").args(["-r", "-f", "raw", &srv.uri("ro"), "-c", "read -P 0 0 64k"]));

    let out = Command::new("qemu-io")
        .args(["-f", "raw", &srv.uri("other"), "-c", "read 0 4k"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no export \"other\""),
        "our message reaches qemu: {err}"
    );
}

#[test]
fn our_client_against_our_server() {
    let big = 40 << 20; // over MAX_PAYLOAD: the client must split it
    let srv = TestServer::start("disk0", big + (8 << 20), false);
    let uri = Uri::parse(&srv.uri("disk0")).unwrap();
    let mut c = Client::connect(&uri).unwrap();
    assert_eq!(c.size(), (big + (8 << 20)) as u64);

    let a = pattern(3, big);
    c.write(4096, &a, true).unwrap();
    let mut back = vec![0u8; big];
    c.read(4096, &mut back).unwrap();
    assert!(back == a, "large write and read round trip");

    c.write_zeroes(8192, 1 << 20).unwrap();
    c.trim(big as u64 + (4 << 20), 4096).unwrap();
    c.flush().unwrap();
    let mut small = vec![0u8; 4096];
    for i in 0..100u64 {
        c.write(i * 4096, &pattern(i as u8, 4096), false).unwrap();
        c.read(i * 4096, &mut small).unwrap();
        assert_eq!(small, pattern(i as u8, 4096));
    }
    let e = c.read(c.size(), &mut small).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    c.disconnect().unwrap();

    let data = srv.data.lock().unwrap();
    assert!(
        data[400 << 10..(1 << 20) + 8192].iter().all(|&b| b == 0),
        "write_zeroes"
    );
    assert_eq!(&data[(1 << 20) + 8192..4096 + big], &a[(1 << 20) + 4096..]);
    let t = big + (4 << 20);
    assert!(
        data[t..t + 4096].iter().all(|&b| b == 0xdd),
        "trim reached the export"
    );
    assert!(
        *srv.flushes.lock().unwrap() >= 2,
        "FUA and flush reached the export"
    );
}

#[test]
fn our_client_gets_errors_from_a_read_only_export() {
    let srv = TestServer::start("ro", 1 << 20, true);
    let mut c = Client::connect(&Uri::parse(&srv.uri("ro")).unwrap()).unwrap();
    assert!(c.read_only());
    for (what, e) in [
        ("write", c.write(0, &[1; 512], false).unwrap_err()),
        ("write_zeroes", c.write_zeroes(0, 4096).unwrap_err()),
        ("trim", c.trim(0, 4096).unwrap_err()),
    ] {
        assert_eq!(nbd::errno(&e), Some(libc::EPERM), "{what}: {e}");
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{what}");
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
    let wrong = Uri::parse(&srv.uri("rw")).unwrap();
    let e = Client::connect(&wrong).err().unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
    assert!(e.to_string().contains("try \"ro\""), "{e}");
}

/// `qemu-io -f raw URI -c CMD`: whether it exited 0, and its stdout and
/// stderr together.
fn qemu_io_once(uri: &str, cmd: &str) -> (bool, String) {
    let out = Command::new("qemu-io")
        .args(["-f", "raw", uri, "-c", cmd])
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), all)
}
