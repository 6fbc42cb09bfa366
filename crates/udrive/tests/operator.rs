//! What a new operator meets first: output into a closed pipe, `--help`, the
//! banner's suggested commands, `udrive check`, and the generated man pages and
//! shell completions.

mod common;

use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::control::{udrive, Serve};

const UDRIVE: &str = env!("CARGO_BIN_EXE_udrive");

/// Runs udrive with `args`, its stdout a pipe whose reader has already gone.
fn into_closed_pipe(args: &[&str]) -> Output {
    let (r, w): (OwnedFd, OwnedFd) = nix::unistd::pipe().unwrap();
    drop(r);
    Command::new(UDRIVE)
        .args(args)
        .stdout(Stdio::from(w))
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let s = Serve::start(&[]);
    let rpc = s.rpc.to_str().unwrap();
    let nvme = s.nvme.to_str().unwrap();
    for args in [
        &["rpc", "--rpc", rpc, "rpc_get_methods"][..],
        &["rpc", "--rpc", rpc, "get_stats"],
        &["metrics", "--rpc", rpc],
        &["trace", "--time", "0.2", "--rpc", rpc],
        &["perf", "--time", "0.2", "--qd", "1", "--vfio-user", nvme],
        &["generate", "completions", "bash"],
    ] {
        let out = into_closed_pipe(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "udrive {args:?}: {:?} {err}",
            out.status
        );
        // Progress lines (perf, trace) may come; a panic or an error may not.
        assert!(
            !err.contains("panicked") && !err.contains("error"),
            "udrive {args:?} wrote: {err}"
        );
    }
    // A call that fails still says so.
    let out = into_closed_pipe(&["rpc", "--rpc", rpc, "no_such_method"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_method"));
}

#[test]
fn help_names_both_front_ends() {
    for args in [&["--help"][..], &["serve", "--help"], &["help"]] {
        let out = udrive(args);
        assert!(out.status.success(), "{args:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        for want in ["NVMe", "vfio-user", "virtio-blk", "vhost-user"] {
            assert!(text.contains(want), "udrive {args:?} lacks {want}:\n{text}");
        }
    }
}

/// The commands the banner suggests run as printed: the binary is named by a path
/// that works from any directory, or as `udrive` only when that is on the PATH.
#[test]
fn banner_commands_run_as_printed() {
    let s = Serve::start(&[]);
    let mut hints = 0;
    for (h, marker) in s
        .banner
        .iter()
        .flat_map(|l| [" perf --", " rpc --rpc "].map(|m| (l, m)))
        .filter(|(l, m)| l.contains(m))
    {
        hints += 1;
        // The word before the subcommand.
        let before = h.split(marker).next().unwrap();
        let cmd = before.rsplit([' ', '(']).next().unwrap();
        let out = Command::new(cmd)
            .arg("--version")
            .current_dir("/")
            .output()
            .unwrap_or_else(|e| panic!("`{cmd}` from `{h}` does not run: {e}"));
        assert!(out.status.success(), "{h}");
    }
    assert_eq!(hints, 2, "{:#?}", s.banner);
}

fn check(args: &[&str]) -> (bool, String, String) {
    let out = udrive(&[&["check"][..], args].concat());
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn check_lists_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let small = write(dir.path(), "small.img", &"x".repeat(64 << 10));
    std::fs::write(dir.path().join("not-a-socket"), "").unwrap();
    let cfg = format!(
        r#"
        rpc = "/nonexistent-dir/rpc.sock"
        [[controller]]
        socket = "{d}/a.sock"
        namespaces = ["file:{d}/missing.img", "file:{small},offset=0,size=1M", "ram:1G,offset=2G"]
        io_queues = 0
        [[controller]]
        socket = "{d}/a.sock"
        namespaces = ["file:{small},offset=0,size=32K", "file:{small},offset=16K,size=16K", "ram:64M,encrypt=luks,key-file={d}/no.key,create=on"]
        [[vhost_user_blk]]
        socket = "{d}/not-a-socket"
        disk = "rbd:rbd/vm,conf={d}/no-ceph.conf"
        queues = 0
        "#
    );
    let file = write(dir.path(), "bad.toml", &cfg);
    let (ok, _, err) = check(&["--config", &file]);
    assert!(!ok);
    let want = [
        "io_queues must be 1..=511",
        "a.sock is used by two controllers",
        "missing.img does not exist",
        "reaches beyond the end of the backend (65536 bytes)",
        "offset 2147483648 is at or beyond the end",
        "overlap on",
        "queues must be 1..=64",
        "not-a-socket exists and is not a socket",
        "no-ceph.conf",
        "rpc socket: directory /nonexistent-dir does not exist",
        "no.key: No such file",
    ];
    for w in want {
        assert!(err.contains(w), "`{w}` missing from:\n{err}");
    }
    let lines = err
        .lines()
        .filter(|l| l.starts_with("udrive check: "))
        .count();
    assert_eq!(lines, want.len(), "{err}");
    assert!(err.contains(&format!("{} problem(s)", want.len())), "{err}");
}

#[test]
fn check_passes_a_good_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let img = write(dir.path(), "vm.img", &"x".repeat(1 << 20));
    // Two devices on disjoint halves of one file (inline tables, as TOML allows).
    let cfg = format!(
        r#"
        rpc = "{d}/rpc.sock"
        controller = [{{ socket = "{d}/a.sock", namespaces = ["file:{img},size=512K", "ram:64M"] }}]
        vhost_user_blk = [{{ socket = "{d}/b.sock", disk = "file:{img},offset=512K,size=512K" }}]
        "#
    );
    let file = write(dir.path(), "good.toml", &cfg);
    let (ok, out, err) = check(&["--config", &file]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(out.starts_with("udrive check: ok: 1 NVMe controller(s) with 2 namespace(s), 1 vhost-user-blk device(s)"), "{out}");
    // Nothing was created.
    for s in ["rpc.sock", "a.sock", "b.sock"] {
        assert!(!dir.path().join(s).exists(), "{s}");
    }
    // The arguments of `serve` work as well, and a live socket is a problem.
    let (ok, _, err) = check(&[
        "--vfio-user",
        &format!("{d}/c.sock"),
        "--ns",
        &format!("file:{img}"),
    ]);
    assert!(ok, "{err}");
    let s = Serve::start(&[]);
    let (ok, _, err) = check(&["--vfio-user", s.nvme.to_str().unwrap(), "--ns", "ram:1M"]);
    assert!(!ok);
    assert!(err.contains("served by a live process"), "{err}");
}

#[test]
fn man_pages_render_and_completions_load() {
    let dir = tempfile::tempdir().unwrap();
    let man = dir.path().join("man");
    let out = udrive(&["generate", "man", man.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = man.join("udrive-serve.1");
    let roff = std::fs::read_to_string(&page).unwrap();
    for opt in [
        "vfio\\-user",
        "vhost\\-user\\-blk",
        "config",
        "socket\\-group",
    ] {
        assert!(roff.contains(opt), "{opt} not in udrive-serve.1");
    }
    for p in ["udrive.1", "udrive-check.1", "udrive-rpc.1"] {
        assert!(man.join(p).exists(), "{p}");
    }
    // Rendered, where a formatter is installed.
    if let Ok(out) = Command::new("groff")
        .args(["-man", "-Tutf8"])
        .arg(&page)
        .output()
    {
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("--vhost-user-blk") || text.contains("‐‐vhost‐user‐blk"),
            "{text}"
        );
    }
    let out = udrive(&["generate", "completions", "bash"]);
    assert!(out.status.success());
    let script = dir.path().join("udrive.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("source {} && complete -p udrive", script.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("-F _udrive udrive"));
    let zsh = udrive(&["generate", "completions", "zsh"]);
    assert!(zsh.status.success() && zsh.stdout.starts_with(b"#compdef udrive"));
}
