//! The sandbox of a running `udrive serve` (docs/security.md): every thread
//! under a seccomp filter with no new privileges, and files outside the
//! configured paths and `--allow-dir` refused with a clear error.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use common::control::{serve_opts, Serve};
use initiator::NvmeDriver;
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
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_owned())
                .unwrap_or_default()
        };
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

fn status_field(pid: i32, name: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find_map(|l| l.strip_prefix(name));
    line.unwrap_or_default().trim().to_owned()
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
