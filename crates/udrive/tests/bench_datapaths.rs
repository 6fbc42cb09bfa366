//! `udrive bench` on its real datapaths and backends where this machine may lack
//! them: rbd without a cluster and with a throwaway one, the qcow2 images made for
//! every run, SPDK without `SPDK_DIR`, the VM datapaths without the guest chroot,
//! a `~b` datapath served by `--udrive-b` and refused without it, and encrypted
//! backends compared with their clear ones, traced runs with the server's layers.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::bench::{
    bench, bench_cmd, data_and_out, json, median, ran_only, raw_runs, skip_reason, FAKE, POINTS,
};
use serde_json::Value;
use udrive::bench::matrix::{preset, Binary, DatapathKind, Matrix, MatrixError};

const RBD: &str = r#"
reps = 1
time = 0.3
datapaths = ["udrive-nvme", "udrive-vhost", "librbd", "fake-a"]
backends = ["rbd"]
baselines = ["librbd"]
poll = "adaptive"
wait = true
[rbd]
image = "rbd/bench-test"
mib = 16
[[workload]]
rw = "randread"
qd = [4]
"#;

#[test]
fn rbd_without_a_cluster_is_skipped_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = bench(RBD, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = json(&out.join("summary.json"));
    let skipped = s["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 3, "{skipped:?}");
    for k in skipped {
        assert_eq!(k["backend"], "rbd", "{k}");
        assert!(k["reason"].as_str().unwrap().contains("--rbd-conf"), "{k}");
    }
    assert!(raw_runs(&out).iter().all(|r| r["datapath"] == "fake-a"));
}

/// udrive's `rbd:` disks and bare librbd on one image of a throwaway cluster,
/// which the harness makes and writes once.
#[test]
fn the_rbd_backend_runs_against_a_cluster() {
    if !test_support::ceph::available() {
        eprintln!("skipped: no Ceph packages");
        return;
    }
    let c = test_support::ceph::Cluster::start();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let conf = c.conf().to_str().unwrap().to_string();
    let o = bench(
        &RBD.replace(r#", "fake-a""#, ""),
        &out,
        &["--rbd-conf", &conf],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let runs = raw_runs(&out);
    let names: Vec<&str> = runs
        .iter()
        .map(|r| r["datapath"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["udrive-nvme", "udrive-vhost", "librbd"], "{runs:?}");
    for r in &runs {
        assert!(r["error"].is_null(), "{r}");
        assert!(r["perf"]["iops"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(c.rbd(&["ls", "rbd"]).contains("bench-test"));
    let s = json(&out.join("summary.json"));
    assert_eq!(s["host"]["ceph conf"], conf.as_str());
}

/// `[rbd] throwaway = true`: the harness starts a cluster for the matrix, counts its
/// daemons as the `cluster` role of each run's CPU (`cpu = "threads"`), serves a
/// variant with its own Ceph settings, and purges the cluster when the matrix ends.
#[test]
fn a_throwaway_cluster_serves_the_matrix_and_is_purged() {
    if !test_support::ceph::available() {
        eprintln!("skipped: no Ceph packages");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = RBD
        .replace(
            r#""udrive-vhost", "librbd", "fake-a""#,
            r#""udrive-nvme+ops", "librbd""#,
        )
        .replace("wait = true", "wait = true\ncpu = \"threads\"")
        // Long enough for every role to have run within the window.
        .replace("time = 0.3", "time = 1.0\nramp = 0.5")
        .replace("mib = 16", "mib = 16\nthrowaway = true")
        + "[variant.ops]\nceph = [\"rbd_op_threads = 2\"]\n";
    let o = bench(&m, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = json(&out.join("summary.json"));
    assert!(
        s["host"]["ceph conf"]
            .as_str()
            .unwrap()
            .contains("throwaway"),
        "{}",
        s["host"]
    );
    let cells = s["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 3, "{cells:?}");
    for c in cells {
        assert_eq!(c["n"], 1, "{c}");
        let roles = &c["cpu"]["roles"];
        assert!(roles["cluster"]["median"].as_f64().unwrap() > 0.0, "{c}");
        assert!(roles["client"]["median"].as_f64().unwrap() > 0.0, "{c}");
        // Bare librbd has no server.
        assert_eq!(roles.get("server").is_some(), c["datapath"] != "librbd");
        let threads = c["cpu"]["threads"].as_object().unwrap();
        assert!(threads.keys().any(|k| k.starts_with("cluster:")), "{c}");
    }
    // The variant's server read the cluster's conf with its setting last.
    let own = std::fs::read_to_string(out.join("work/udrive-nvme+ops-ceph.conf")).unwrap();
    assert!(
        own.trim_end().ends_with("[client]\nrbd_op_threads = 2"),
        "{own}"
    );
    let ceph = out.join("work/ceph");
    assert!(!ceph.exists(), "the cluster's directory is purged");
    let ps = Command::new("pgrep")
        .args(["-f", ceph.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(ps.stdout.is_empty(), "a daemon of the cluster still runs");
}

const QCOW2_FRESH: &str = r#"
reps = 2
time = 0.2
ramp = 0.0
datapaths = ["udrive-nvme", "udrive-vhost"]
backends = ["qcow2-chain", "qcow2-new"]
poll = "adaptive"
[file]
dir = "DIR"
mib = 16
[[workload]]
rw = "randwrite"
qd = [4]
"#;

/// The chain and empty-image backends: every run gets images made for it (the
/// chain's overlays over the raw data, the empty image), both udrive datapaths
/// serve them, and the images are gone when the bench ends.
#[test]
fn qcow2_chain_and_new_images_are_made_for_every_run() {
    if !test_support::qemu::have_qemu_tools() {
        eprintln!("skipped: no qemu-img");
        return;
    }
    let (_dir, data, out) = data_and_out();
    let matrix = QCOW2_FRESH.replace("DIR", data.to_str().unwrap());
    let o = bench(&matrix, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let runs = raw_runs(&out);
    assert_eq!(runs.len(), 8, "{runs:?}");
    served_by_each(&runs);
    let left: Vec<_> = std::fs::read_dir(&data).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// No run failed, and every datapath served I/O on every backend in some run: a
/// single short run may complete nothing on a loaded machine (a first write to a
/// qcow2 image allocates and waits for the disk), all of them would not.
fn served_by_each(runs: &[Value]) {
    let mut served: BTreeMap<String, f64> = BTreeMap::new();
    for r in runs {
        assert!(r["error"].is_null(), "{r}");
        let key = format!("{} on {}", r["datapath"], r["backend"]);
        *served.entry(key).or_default() += r["perf"]["ios"].as_f64().unwrap();
    }
    for (key, ios) in served {
        assert!(ios > 0.0, "{key}: no I/O completed in any run");
    }
}

/// Runs `datapaths` beside `fake-a` with `SPDK_DIR` set to `spdk_dir` (unset for
/// none): the run succeeds and runs `fake-a` alone; the reason each of
/// `datapaths` was skipped, in order.
fn spdk_skip_reasons(datapaths: &[&str], spdk_dir: Option<&Path>) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let names: Vec<String> = datapaths.iter().map(|d| format!("\"{d}\"")).collect();
    let matrix = format!(
        "reps = 1\ntime = 0.2\ndatapaths = [{}, \"fake-a\"]\nbackends = [\"null\"]\n\
         [[workload]]\nrw = \"randread\"\nqd = [1]\n",
        names.join(", ")
    );
    let mut c = bench_cmd(&matrix, &out);
    match spdk_dir {
        Some(d) => c.env("SPDK_DIR", d),
        None => c.env_remove("SPDK_DIR"),
    };
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    ran_only(&out, "fake-a");
    datapaths.iter().map(|d| skip_reason(&out, d)).collect()
}

/// Without `SPDK_DIR` the SPDK datapaths are skipped with the reason, and the
/// others still run.
#[test]
fn spdk_without_spdk_dir_is_skipped_with_the_reason() {
    let all = [
        "spdk-nvmf",
        "udrive-nvme-spdk",
        "spdk-vhost",
        "udrive-vhost-spdk",
    ];
    for why in spdk_skip_reasons(&all, None) {
        assert!(why.contains("SPDK_DIR"), "{why}");
    }
}

/// An SPDK tree built without vhost and virtio (as `--with-vfio-user` alone
/// builds it) has no `vhost` or `bdevperf`: the vhost pair is skipped naming the
/// program and the configure option that builds it.
#[test]
fn spdk_without_its_vhost_programs_names_the_configure_option() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("spdk");
    std::fs::create_dir_all(tree.join("build/bin")).unwrap();
    for p in ["spdk_nvme_perf", "nvmf_tgt", "vhost"] {
        std::fs::write(tree.join("build/bin").join(p), "").unwrap();
    }
    for why in spdk_skip_reasons(&["spdk-vhost", "udrive-vhost-spdk"], Some(&tree)) {
        assert!(
            why.contains("build/examples/bdevperf") && why.contains("--with-virtio"),
            "{why}"
        );
    }
}

/// The `ab` preset names `udrive-nvme~b`, which needs the second binary: refused
/// without it naming the flag, complete with it, and the same through TOML and back.
#[test]
fn a_b_datapath_needs_the_second_binary() {
    let text = preset("ab").unwrap();
    let m = Matrix::parse(text).unwrap();
    assert_eq!(
        m.baselines,
        [DatapathKind::UdriveNvme(None, Binary::Main, None)]
    );
    match m.check() {
        Err(MatrixError::Invalid { field, reason }) => {
            assert_eq!(field, "datapaths[1]");
            assert!(reason.contains("--udrive-b"), "{reason}");
        }
        other => panic!("not refused: {other:?}"),
    }
    let with_b = text.replace("reps =", "udrive_b = \"/usr/bin/true\"\nreps =");
    let m = Matrix::from_toml(&with_b).unwrap();
    let names: Vec<String> = m.datapaths.iter().map(|d| d.to_string()).collect();
    assert_eq!(names, ["udrive-nvme", "udrive-nvme~b"]);
    let again = Matrix::from_toml(&toml::to_string(&m).unwrap()).unwrap();
    assert_eq!(again.datapaths, m.datapaths);
    assert_eq!(again.udrive_b.as_deref(), Some("/usr/bin/true"));

    // On the command line: before any run, naming the flag; a B that is not there.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["bench", "ab", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap()
    };
    for (extra, says) in [
        (&[][..], "--udrive-b"),
        (
            &["--udrive-b", "/nonexistent/udrive"][..],
            "/nonexistent/udrive",
        ),
    ] {
        let o = run(extra);
        assert!(!o.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!out.join("raw").exists());
    }
}

/// Cells on `ram-luks` are compared per repetition with the same datapath on
/// `ram`; qemu-storage-daemon is skipped on both with the reason.
#[test]
fn an_encrypted_backend_is_compared_with_its_clear_one() {
    let matrix = FAKE
        .replace(r#"["null", "file"]"#, r#"["ram", "ram-luks"]"#)
        .replace(r#""fake-c"]"#, r#""qsd-vhost"]"#);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = bench(&matrix, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = json(&out.join("summary.json"));
    let skipped = s["skipped"].as_array().unwrap();
    // Per backend, or once if it is not installed.
    assert!(!skipped.is_empty());
    assert!(
        skipped.iter().all(|k| k["datapath"] == "qsd-vhost"),
        "{skipped:?}"
    );
    let runs = raw_runs(&out);
    let iops = |d: &Value, b: &str, p: &Value, rep: &Value| {
        runs.iter()
            .find(|r| {
                r["datapath"] == *d && r["backend"] == b && r["point"] == *p && r["rep"] == *rep
            })
            .map(|r| r["perf"]["iops"].as_f64().unwrap())
            .unwrap()
    };
    let mut compared = 0;
    for c in s["cells"].as_array().unwrap() {
        let clear: Vec<&Value> = c["vs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["backend"] == "ram")
            .collect();
        if c["backend"] == "ram" {
            assert!(clear.is_empty(), "{c}");
            continue;
        }
        assert_eq!(clear.len(), 1, "{c}");
        assert_eq!(clear[0]["baseline"], c["datapath"]);
        let ratios: Vec<f64> = [1, 2]
            .iter()
            .map(|rep| {
                let rep = Value::from(*rep);
                iops(&c["datapath"], "ram-luks", &c["point"], &rep)
                    / iops(&c["datapath"], "ram", &c["point"], &rep)
            })
            .collect();
        let got = clear[0]["iops_ratio"]["median"].as_f64().unwrap();
        assert!((got - median(ratios)).abs() < 1e-9, "{c}");
        compared += 1;
    }
    assert_eq!(compared, 2 * POINTS);
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        md.contains("### ram-luks: against ram, same datapath"),
        "{md}"
    );
    assert_eq!(md.matches("against fake-a").count(), 2, "{md}");
}

/// udrive serves `file` and `file-luks` (made by the first server's `create=on`,
/// opened by the next one) on both its datapaths; the volume and its key are gone
/// when the bench ends.
#[test]
fn luks_volumes_are_served_and_compared_with_clear() {
    let (_dir, data, out) = data_and_out();
    let matrix = format!(
        r#"
reps = 1
time = 0.3
datapaths = ["udrive-nvme", "udrive-vhost"]
backends = ["file", "file-luks"]
poll = "adaptive"
[file]
dir = "{}"
mib = 16
[[workload]]
rw = "randread"
qd = [1, 8]
"#,
        data.display()
    );
    let o = bench(&matrix, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let runs = raw_runs(&out);
    assert_eq!(runs.len(), 8, "{runs:?}");
    served_by_each(&runs);
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        md.contains("### file-luks: against file, same datapath"),
        "{md}"
    );
    let left: Vec<_> = std::fs::read_dir(&data).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// `udrive-nvme~b` is served by the binary `--udrive-b` names (here a wrapper that
/// notes its calls), and driven by this one's `perf`.
#[test]
fn the_b_side_is_served_by_the_second_binary() {
    let dir = tempfile::tempdir().unwrap();
    let calls = dir.path().join("b-calls");
    let b = dir.path().join("udrive-b");
    std::fs::write(
        &b,
        format!(
            "#!/bin/sh\necho \"$1\" >> {}\nexec {} \"$@\"\n",
            calls.display(),
            env!("CARGO_BIN_EXE_udrive")
        ),
    )
    .unwrap();
    let mut perm = std::fs::metadata(&b).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&b, perm).unwrap();
    let out = dir.path().join("out");
    let matrix = r#"
reps = 2
time = 0.2
datapaths = ["udrive-nvme", "udrive-nvme~b"]
backends = ["null"]
baselines = ["udrive-nvme"]
poll = "adaptive"
[[workload]]
rw = "randread"
qd = [1]
"#;
    let o = bench(matrix, &out, &["--udrive-b", b.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let runs = raw_runs(&out);
    let names: Vec<&str> = runs
        .iter()
        .map(|r| r["datapath"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "udrive-nvme",
            "udrive-nvme~b",
            "udrive-nvme~b",
            "udrive-nvme"
        ]
    );
    assert!(runs.iter().all(|r| r["error"].is_null()), "{runs:?}");
    // One server per repetition, no client.
    assert_eq!(std::fs::read_to_string(&calls).unwrap(), "serve\nserve\n");
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("| udrive-nvme~b | 2 |"), "{md}");
    assert!(md.contains("### null: against udrive-nvme"), "{md}");
    let s = json(&out.join("summary.json"));
    assert_eq!(s["host"]["udrive B (serves ~b)"], b.to_str().unwrap());
}

/// Without the guest chroot (here: `UDRIVE_VM_CACHE` names an empty directory) the
/// VM datapaths are skipped with the reason, never started (no debootstrap); the
/// others still run.
#[test]
fn vm_datapaths_without_the_guest_chroot_are_skipped_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let matrix = r#"
reps = 1
time = 0.2
datapaths = ["vm-udrive-nvme", "vm-udrive-vhost", "vm-qemu-nvme", "vm-qemu-virtio", "fake-a"]
backends = ["null"]
[[workload]]
rw = "randread"
qd = [1]
"#;
    let o = bench_cmd(matrix, &out)
        .env("UDRIVE_VM_CACHE", dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for d in [
        "vm-udrive-nvme",
        "vm-udrive-vhost",
        "vm-qemu-nvme",
        "vm-qemu-virtio",
    ] {
        let why = skip_reason(&out, d);
        // Not root: that reason comes first; root: the missing chroot.
        assert!(
            why.contains("scripts/vm-test once") || why.contains("root"),
            "{why}"
        );
    }
    ran_only(&out, "fake-a");
}

/// `trace = true` on real datapaths: udrive's cells have the server's layers
/// between the client's (read through the server's control socket, each client's
/// device its own with two clients on one server), bare io_uring only the client's,
/// and the report has the layer figure.
#[test]
fn traced_runs_have_the_servers_layers() {
    let (_dir, data, out) = data_and_out();
    let matrix = format!(
        r#"
reps = 1
time = 0.3
datapaths = ["udrive-nvme", "udrive-vhost", "io-uring"]
backends = ["file"]
poll = "adaptive"
trace = true
clients = [1, 2]
[file]
dir = "{}"
mib = 16
[[workload]]
rw = "randread"
qd = [1, 4]
"#,
        data.display()
    );
    let o = bench(&matrix, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for r in raw_runs(&out) {
        assert!(r["error"].is_null(), "{r}");
    }
    let s = json(&out.join("summary.json"));
    let cells = s["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 3 * 2 * 2);
    for c in cells {
        let names: Vec<&str> = c["layers"]
            .as_array()
            .unwrap_or_else(|| panic!("no layers: {c}"))
            .iter()
            .map(|l| l["layer"].as_str().unwrap())
            .collect();
        let want: &[&str] = match c["datapath"].as_str().unwrap() {
            "io-uring" => &["submit", "device", "reap", "total"],
            _ => &[
                "submit",
                "queue",
                "backend",
                "complete",
                "notify",
                "transport",
                "reap",
                "total",
            ],
        };
        assert_eq!(names, want, "{c}");
    }
    let id = udrive::bench::report::latency::figure_id(
        "layers",
        udrive::bench::matrix::Backend::File,
        "randread-4k-j1-qd1",
    );
    assert!(out.join(format!("figures/{id}.svg")).exists(), "{id}");
}

/// `[variant.NAME]`: its perf options reach that datapath's clients only, its
/// environment that server only, and a knob whose log line is missing fails the
/// variant's runs (naming the text) instead of measuring the plain server.
#[test]
fn a_variant_changes_its_datapath_only() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let matrix = r#"
reps = 1
time = 0.3
datapaths = ["udrive-nvme", "udrive-nvme+gaps", "udrive-vhost+logged", "udrive-vhost+missing"]
backends = ["null"]
poll = "adaptive"
[variant.gaps]
perf = ["--gaps", "3"]
[variant.logged]
serve_env = ["RUST_LOG=info"]
expect_log = "reactors started"
[variant.missing]
expect_log = "reactors started"
[[workload]]
rw = "randread"
qd = [1]
"#;
    let o = bench(matrix, &out, &[]);
    assert!(!o.status.success(), "a run failed: the status says so");
    let runs = raw_runs(&out);
    assert_eq!(runs.len(), 4, "{runs:?}");
    for r in &runs {
        let d = r["datapath"].as_str().unwrap();
        match d {
            "udrive-vhost+missing" => {
                let e = r["error"].as_str().unwrap_or_default();
                assert!(e.contains("does not say `reactors started`"), "{r}");
            }
            _ => assert!(r["error"].is_null(), "{r}"),
        }
        let gaps = r["perf"]["gaps"].as_array().map_or(0, Vec::len);
        assert_eq!(gaps > 0, d == "udrive-nvme+gaps", "{r}");
    }
}

/// A variant's disk options reach its namespaces, and its neighbour is a second
/// device on the same server whose client runs through each run; a neighbour that
/// cannot run fails the variant's runs instead of leaving them unloaded.
#[test]
fn a_variant_limits_its_disk_and_loads_a_neighbour() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let matrix = r#"
reps = 1
time = 1.0
ramp = 0.2
datapaths = ["udrive-nvme+limited", "udrive-nvme+crowded", "udrive-vhost+crowded", "udrive-nvme+broken"]
backends = ["null"]
poll = "adaptive"
[variant.limited]
disk = ["iops=200"]
[variant.crowded.neighbour]
disk = ["iops=100"]
perf = ["--qd", "64"]
idle_priority = true
[variant.broken.neighbour]
perf = ["--bs", "1000"]
[[workload]]
rw = "randread"
qd = [8]
"#;
    let o = bench(matrix, &out, &[]);
    assert!(!o.status.success(), "the broken neighbour's run failed");
    let runs = raw_runs(&out);
    assert_eq!(runs.len(), 4, "{runs:?}");
    for r in &runs {
        let d = r["datapath"].as_str().unwrap();
        if d == "udrive-nvme+broken" {
            let e = r["error"].as_str().unwrap_or_default();
            assert!(e.contains("the neighbour's client"), "{r}");
            continue;
        }
        assert!(r["error"].is_null(), "{r}");
        if d == "udrive-nvme+limited" {
            // 200 a second and the limiter's start burst; a busy machine only does less.
            let ios = r["perf"]["ios"].as_f64().unwrap();
            assert!(ios <= 300.0, "{ios} I/Os in 1 s at iops=200: {r}");
        }
    }
    let work = out.join("work");
    let config = |name: &str| std::fs::read_to_string(work.join(name)).unwrap();
    assert!(config("udrive-nvme+limited-null-c1.toml").contains("null:64G,iops=200"));
    for d in ["udrive-nvme+crowded", "udrive-vhost+crowded"] {
        let c = config(&format!("{d}-null-c1.toml"));
        assert!(c.contains("null:64G,iops=100"), "{c}");
        assert!(c.contains("-neighbour.sock"), "{c}");
        assert!(!c.contains("null:64G,iops=200"), "{c}");
    }
}

/// Processes whose command line names `path`: what a bench run left behind.
fn processes_naming(path: &std::path::Path) -> Vec<String> {
    let needle = path.display().to_string();
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter(|e| e.file_name().to_string_lossy() != me)
        .filter_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(&needle).then_some(cmd)
        })
        .collect()
}

/// A variant's handovers run `udrive upgrade` during each run: the clients report
/// that many pauses, the run keeps every upgrade's time, the server that took over
/// serves the next workload, and the last successor is stopped with the run.
#[test]
fn handovers_during_a_run_are_timed_and_their_successor_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let matrix = r#"
reps = 1
time = 1.5
ramp = 0.2
datapaths = ["udrive-nvme+ho", "udrive-vhost+ho"]
# A RAM disk lives in the server's memory: it refuses a handover.
backends = ["file"]
[file]
mib = 64
[variant.ho]
handovers = 2
perf = ["--verify"]
[[workload]]
rw = "randrw"
qd = [4]
[[workload]]
rw = "randread"
qd = [1]
"#;
    let o = bench(matrix, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let runs = raw_runs(&out);
    assert_eq!(runs.len(), 4, "{runs:?}");
    for r in &runs {
        assert!(r["error"].is_null(), "{r}");
        assert_eq!(r["upgrades_ms"].as_array().map(Vec::len), Some(2), "{r}");
        assert!(
            r["server_cpu"].is_null(),
            "the process measured handed over: {r}"
        );
        assert_eq!(r["perf"]["gaps"].as_array().map(Vec::len), Some(2), "{r}");
        assert_eq!(r["perf"]["verify_errors"].as_u64().unwrap_or(0), 0, "{r}");
    }
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(summary.contains("### file: live handovers"), "{summary}");
    assert_eq!(processes_naming(&out), Vec::<String>::new());

    // A RAM disk refuses: the run fails saying why, and nothing is left running.
    let out = dir.path().join("ram");
    let o = bench(&matrix.replace("\"file\"]", "\"ram\"]"), &out, &[]);
    assert!(!o.status.success());
    for r in raw_runs(&out) {
        let e = r["error"].as_str().unwrap_or_default();
        assert!(e.contains("refused the handover"), "{r}");
    }
    assert_eq!(processes_naming(&out), Vec::<String>::new());
}
