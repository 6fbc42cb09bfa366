//! Configuration mistakes stop `udrive serve` with a message naming the problem,
//! a non-zero exit, and no socket left behind.

use std::process::Command;

use test_support::files::sized_file;

fn serve(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .arg("serve")
        .args(args)
        .output()
        .expect("run udrive");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_namespaces_fail_before_any_socket() {
    let dir = tempfile::tempdir().unwrap();
    let img = sized_file(dir.path(), "disk.img", 64 << 20);
    let odd = sized_file(dir.path(), "odd.img", 1000);
    let sock = dir.path().join("s.sock");
    let sock = sock.to_str().unwrap();
    let img = img.to_str().unwrap();
    let cases = [
        (
            format!("file:{}/missing.img", dir.path().display()),
            "does not exist",
        ),
        (format!("file:{img},offset=60M,size=8M"), "beyond the end"),
        (format!("file:{img},offset=64M"), "beyond the end"),
        (format!("file:{}", odd.display()), "multiple"),
        ("ram:12345".to_string(), "multiple of the block size"),
        ("ram:1G,bs=1000".to_string(), "bs must be 512 or 4096"),
        ("tape:1G".to_string(), "unknown kind"),
    ];
    for (ns, want) in cases {
        let (ok, err) = serve(&["--vfio-user", sock, "--ns", &ns]);
        assert!(!ok, "{ns} was accepted");
        assert!(err.contains(want), "{ns}: expected `{want}` in: {err}");
        assert!(!std::path::Path::new(sock).exists(), "{ns} left a socket");
    }
}

#[test]
fn overlapping_writable_slices_are_refused_unless_shared() {
    let dir = tempfile::tempdir().unwrap();
    let img = sized_file(dir.path(), "disk.img", 64 << 20);
    let cfg = |a: &str, b: &str| {
        let p = dir.path().join("u.toml");
        std::fs::write(
            &p,
            format!(
                "[[controller]]\nsocket = \"{d}/a.sock\"\nnamespaces = [\"file:{i},{a}\"]\n\
                 [[controller]]\nsocket = \"{d}/b.sock\"\nnamespaces = [\"file:{i},{b}\"]\n",
                d = dir.path().display(),
                i = img.display()
            ),
        )
        .unwrap();
        p
    };
    let (ok, err) = serve(&[
        "--config",
        cfg("offset=0,size=32M", "offset=16M,size=32M")
            .to_str()
            .unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("overlap"), "{err}");
    assert!(!dir.path().join("a.sock").exists());
    // Read-only overlaps are fine; so are overlaps both sides mark shared. Check them
    // without serving: the validation is the same code path.
    for (a, b) in [
        ("offset=0,size=32M,ro", "offset=16M,size=32M,ro"),
        ("offset=0,size=32M,shared", "offset=16M,size=32M,shared"),
        ("offset=0,size=32M", "offset=32M,size=32M"),
    ] {
        let c = udrive::config::Config::load(&cfg(a, b)).unwrap();
        udrive::backends::open_all(&c.controllers)
            .unwrap_or_else(|e| panic!("{a} / {b} refused: {e:#}"));
    }
}
