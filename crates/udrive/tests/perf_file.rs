//! `udrive perf --file`: the bare-metal baseline drives a file through io_uring with
//! the same workload generator, verify mode included.

mod common;

use std::process::Command;

use common::disk_file;

fn perf(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .arg("perf")
        .args(args)
        .output()
        .expect("run udrive perf");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn field(json: &str, key: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect("JSON report");
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no {key} in {json}"))
}

#[test]
fn verified_mixed_io_on_a_file() {
    let (_dir, img) = disk_file("bare.img", 8 << 20);
    let img = img.to_str().unwrap();
    for direct in ["on", "off"] {
        let (ok, out, err) = perf(&[
            "--file", img, "--direct", direct, "--rw", "randrw", "--qd", "8", "--jobs", "2",
            "--time", "0.5", "--verify", "--json",
        ]);
        assert!(ok, "direct={direct}: {err}");
        assert!(field(&out, "ios") > 0.0, "no I/O: {out}");
        assert!(field(&out, "writes") > 0.0 && field(&out, "reads") > 0.0);
        assert_eq!(field(&out, "errors"), 0.0, "{out}");
        assert_eq!(field(&out, "verify_errors"), 0.0, "{out}");
    }
}

#[test]
fn bad_file_arguments_are_reported() {
    let (_dir, img) = disk_file("odd.img", 1000);
    let (ok, _, err) = perf(&["--file", img.to_str().unwrap(), "--time", "0.1"]);
    assert!(!ok);
    assert!(err.contains("multiple of the block size"), "{err}");
    let (ok, _, err) = perf(&["--file", "/nonexistent/x.img", "--time", "0.1"]);
    assert!(!ok);
    assert!(err.contains("No such file"), "{err}");
    let (ok, _, err) = perf(&["--time", "0.1"]);
    assert!(!ok, "perf without a target succeeded");
    assert!(
        err.contains("--vfio-user") || err.contains("--file"),
        "{err}"
    );
}
