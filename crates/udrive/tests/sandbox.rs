//! The sandbox of a running `udrive serve` (docs/security.md): every thread
//! under a seccomp filter with no new privileges, and files outside the
//! configured paths and `--allow-dir` refused with a clear error.

mod common;

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
