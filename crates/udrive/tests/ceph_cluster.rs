//! The throwaway Ceph cluster that the rbd backend's tests start (`scripts/ceph-cluster`
//! through `tests/common/ceph.rs`): it serves images, keeps their data across an OSD
//! restart (a SIGKILL during I/O with bluestore, a clean one with memstore), runs next
//! to other clusters, refuses a wrong key, and leaves no process or file behind.
//!
//! Without Ceph installed these tests skip, except under CI (`CI` set), where they fail.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use test_support::ceph::{self, Cluster};

use common::Rng;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    Rng::new(seed).bytes(len)
}

/// Asserts that no live ceph-mon/ceph-osd of this cluster remains and its dir is gone.
fn assert_gone(dir: &std::path::Path, conf: &std::path::Path) {
    let left = ceph::processes_mentioning(conf);
    assert!(
        left.is_empty(),
        "processes of {} left: {left:?}",
        dir.display()
    );
    assert!(!dir.exists(), "{} still exists", dir.display());
}

#[test]
fn image_round_trip_and_clean_osd_restart() {
    if !ceph::available() {
        return;
    }
    let c = Cluster::start();
    assert_eq!(c.store(), ceph::Store::Memstore);
    assert!(c.conf().is_file() && c.keyring().is_file());

    c.create_image("blank", 4 << 20);
    assert!(
        c.export("blank").iter().all(|&b| b == 0),
        "a new image reads zeros"
    );

    // Not a multiple of the 4 MiB object size.
    let data = pattern(1, (6 << 20) + 4096);
    c.import("pat", &data);
    assert!(c.export("pat") == data, "export differs from import");
    let ls = c.rbd(&["ls", c.pool()]);
    assert_eq!(ls.lines().collect::<Vec<_>>(), ["blank", "pat"]);

    // Writes through librbd (not only import), then the memstore OSD restarted cleanly.
    c.rbd(&[
        "bench",
        "--io-type",
        "write",
        "--io-size",
        "4K",
        "--io-total",
        "1M",
        "--io-pattern",
        "rand",
        "blank",
    ]);
    let blank = c.export("blank");
    assert!(blank.iter().any(|&b| b != 0), "rbd bench wrote nothing");
    c.osd_restart_clean();
    assert!(
        c.export("pat") == data,
        "data lost across a clean OSD restart"
    );
    assert!(
        c.export("blank") == blank,
        "bench data lost across a clean OSD restart"
    );
}

/// The fault tests' case: the OSD killed (SIGKILL) while a client writes, down for a
/// while, started again on the same data. The client's I/O stalls and then completes.
#[test]
fn osd_killed_during_io_comes_back_with_the_data() {
    if !ceph::available() {
        return;
    }
    let c = Cluster::start_bluestore();
    let data = pattern(2, 5 << 20);
    c.import("pat", &data);
    c.create_image("busy", 16 << 20);

    let bench = c
        .rbd_cmd()
        .args([
            "bench",
            "--io-type",
            "write",
            "--io-size",
            "4K",
            "--io-threads",
            "4",
            "--io-total",
            "8M",
            "--io-pattern",
            "rand",
            "busy",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rbd bench");
    std::thread::sleep(Duration::from_millis(300));
    c.osd_stop();
    std::thread::sleep(Duration::from_secs(2));
    let t = Instant::now();
    c.osd_start();
    eprintln!("OSD back in {:?}", t.elapsed());
    let out = bench.wait_with_output().expect("rbd bench");
    assert!(
        out.status.success(),
        "rbd bench across the OSD kill: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(c.export("pat") == data, "data lost across an OSD SIGKILL");

    // Once more without I/O in flight, with restart.
    c.osd_restart();
    assert!(
        c.export("pat") == data,
        "data lost across a second OSD SIGKILL"
    );
}

/// memstore keeps the data in RAM and saves it only on a clean shutdown: after a
/// SIGKILL the store on disk is an old one (the OSD would hang on PGs that never become
/// active, or serve old data), so `osd-start` refuses at once and points at bluestore.
#[test]
fn memstore_osd_kill_is_refused_clearly() {
    if !ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.import("pat", &pattern(3, 1 << 20));
    c.osd_stop();
    let t = Instant::now();
    let out = c.script_status("osd-start", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "osd-start after a memstore SIGKILL succeeded"
    );
    assert!(err.contains("--bluestore"), "no hint at bluestore: {err}");
    assert!(err.contains("killed"), "{err}");
    // Refused, not left to wait the script's 30 s for the pool (a bound that tells
    // the two apart, not a speed).
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn two_clusters_at_once_then_nothing_left() {
    if !ceph::available() {
        return;
    }
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(Cluster::start);
        let b = s.spawn(Cluster::start);
        (a.join().expect("cluster a"), b.join().expect("cluster b"))
    });
    assert_ne!(a.mon_addr(), b.mon_addr());
    a.create_image("only-a", 1 << 20);
    b.import("only-b", &pattern(4, 1 << 20));
    assert_eq!(a.rbd(&["ls"]).trim(), "only-a");
    assert_eq!(b.rbd(&["ls"]).trim(), "only-b");
    assert!(b.export("only-b") == pattern(4, 1 << 20));

    let (dir, conf) = (a.dir().to_path_buf(), a.conf().to_path_buf());
    assert_eq!(
        ceph::processes_mentioning(&conf).len(),
        2,
        "mon + osd of cluster a"
    );
    drop(a);
    assert_gone(&dir, &conf);
    // The other one is unaffected.
    assert_eq!(b.rbd(&["ls"]).trim(), "only-b");
    let (dir, conf) = (b.dir().to_path_buf(), b.conf().to_path_buf());
    drop(b);
    assert_gone(&dir, &conf);
}

/// What the backend's "auth refused" and "cluster unreachable" tests will see from the
/// C API's `rados_connect`: EACCES (13) at once for a wrong key, ETIMEDOUT (110) after
/// `client_mount_timeout` without a mon.
#[test]
fn wrong_key_refused_and_mon_down_times_out() {
    if !ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("img", 1 << 20);

    // A well-formed key that the cluster does not know.
    let key = std::process::Command::new("ceph-authtool")
        .arg("--gen-print-key")
        .output()
        .expect("ceph-authtool");
    let bad = c.dir().join("wrong.keyring");
    std::fs::write(
        &bad,
        format!(
            "[client.admin]\n\tkey = {}\n",
            String::from_utf8_lossy(&key.stdout).trim()
        ),
    )
    .expect("write keyring");
    let t = Instant::now();
    let out = c
        .rbd_cmd()
        .arg("--keyring")
        .arg(&bad)
        .arg("ls")
        .output()
        .expect("rbd ls");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(13), "wrong key: {err}");
    assert!(err.contains("(13) Permission denied"), "{err}");
    // Refused, not left to `client_mount_timeout` (300 s by default).
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "refusal took {:?}",
        t.elapsed()
    );
    // An unknown user is refused the same way.
    let out = c.rbd_status(&["--id", "nobody", "ls"]);
    assert_eq!(out.status.code(), Some(13));
    // The right key still works.
    assert_eq!(c.rbd(&["ls"]).trim(), "img");

    c.mon_stop();
    let out = c.rbd_status(&["--client-mount-timeout", "2", "ls"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(110), "mon down: {err}");
    assert!(err.contains("(110) Connection timed out"), "{err}");
    c.mon_start();
    assert_eq!(c.rbd(&["ls"]).trim(), "img");
}
