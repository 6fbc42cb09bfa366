//! QEMU's image tools as the independent implementation qcow2 tests check
//! against: `qemu-img` (create, convert, check, compare, info) and `qemu-io`
//! (writes with patterns and zeroes). Tests skip, saying so, where they are not
//! installed (Debian: qemu-utils).

use std::path::Path;
use std::process::Command;

/// Whether `qemu-img` and `qemu-io` run; prints why a test skips if not.
pub fn have_qemu_tools() -> bool {
    let runs = |t: &str| {
        Command::new(t)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let ok = runs("qemu-img") && runs("qemu-io");
    if !ok {
        eprintln!("skipped: qemu-img/qemu-io not installed (Debian: qemu-utils)");
    }
    ok
}

/// `qemu-img ARGS`; its stdout. Fails the test with its output if it fails.
pub fn qemu_img(args: &[&str]) -> String {
    let out = Command::new("qemu-img").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "qemu-img {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `qemu-io` commands (`write -P 0xab 0 64k`) on a qcow2 image, each of which
/// must succeed.
pub fn qemu_io(img: &Path, cmds: &[String]) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "qcow2"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = c.arg(img).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("failed"),
        "qemu-io: {text}"
    );
}

/// `qemu-img check`: no corruption (leaked clusters are allowed: exit 3).
pub fn qemu_check(img: &Path) {
    check(img, &[]);
}

/// [`qemu_check`] of an image a disk of this process still holds (`-U`: QEMU's
/// image locks would refuse it).
pub fn qemu_check_held(img: &Path) {
    check(img, &["-U"]);
}

fn check(img: &Path, opts: &[&str]) {
    let run = || {
        Command::new("qemu-img")
            .args(["check", "-q"])
            .args(opts)
            .arg(img)
            .output()
            .unwrap()
    };
    let locked =
        |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).contains("Failed to get");
    let mut out = run();
    // A server just killed with I/O in flight keeps its locks until the
    // kernel has finished that I/O, after the process is reaped.
    crate::wait::poll_until(std::time::Duration::from_secs(10), || {
        if locked(&out) {
            out = run();
        }
        !locked(&out)
    });
    assert!(
        matches!(out.status.code(), Some(0) | Some(3)),
        "qemu-img check {}: {:?} {}{}",
        img.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `qemu-img compare`: the qcow2 image holds exactly `want` (written to a raw
/// file beside it).
pub fn qemu_compare(img: &Path, want: &[u8]) {
    compare(img, want, &[]);
}

/// [`qemu_compare`] of an image a disk of this process still holds.
pub fn qemu_compare_held(img: &Path, want: &[u8]) {
    compare(img, want, &["-U"]);
}

fn compare(img: &Path, want: &[u8], opts: &[&str]) {
    let raw = img.with_extension("want.raw");
    std::fs::write(&raw, want).unwrap();
    let (i, r) = (img.to_str().unwrap(), raw.to_str().unwrap());
    let mut args = vec!["compare", "-q"];
    args.extend(opts);
    args.extend(["-f", "qcow2", "-F", "raw", i, r]);
    qemu_img(&args);
    let _ = std::fs::remove_file(&raw);
}

/// `qemu-img create -f qcow2 [-b BACKING -F FORMAT] [-o cluster_size=C] IMG SIZE`
/// (`backing`: name and format; `cluster`, `size` as qemu-img takes them).
pub fn qemu_create(img: &Path, size: &str, backing: Option<(&str, &str)>, cluster: Option<&str>) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if let Some((name, format)) = backing {
        args.extend(["-b", name, "-F", format]);
    }
    let opt = cluster.map(|c| format!("cluster_size={c}"));
    if let Some(o) = &opt {
        args.extend(["-o", o]);
    }
    args.extend([img.to_str().unwrap(), size]);
    qemu_img(&args);
}
