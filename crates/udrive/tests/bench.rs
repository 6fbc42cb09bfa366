//! `udrive bench` against the fake datapath (deterministic numbers, no processes): the
//! report has every figure, every cell its repetitions, medians that are those of the
//! raw runs, the execution order asked for; a cell of N clients has N results and the
//! "many clients" figures; a broken matrix is refused naming its field. The real
//! datapaths and backends: bench_datapaths.rs.

mod common;

use std::collections::BTreeMap;

use common::bench::{bench, bench_cmd, json, median, raw_runs, FAKE, POINTS};
use serde_json::Value;
use udrive::bench::matrix::{Backend, Matrix, MatrixError};

#[test]
fn report_of_the_fake_datapath_is_whole() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // --reps overrides the file's 2.
    let o = bench(FAKE, &out, &["--reps", "3"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(!html.contains("<script") && !html.contains("<link") && !html.contains("src=\"http"));
    let mut want = Vec::new();
    for b in ["null", "file"] {
        want.push(format!("bars-{b}-iops"));
        want.push(format!("bars-{b}-lat"));
        for d in ["fake-a", "fake-b", "fake-c"] {
            // QD × jobs only where both vary: randread, not the single randrw point.
            want.push(format!("heat-{d}-{b}-randread-4k"));
        }
        // Percentile curves per kind of workload at its fewest jobs; no layers
        // without a trace.
        want.push(format!("pct-{b}-randread-4k-j1"));
        want.push(format!("pct-{b}-randrw70-4k-j1"));
    }
    for id in &want {
        assert!(
            html.contains(&format!("<svg id=\"{id}\"")),
            "figure {id} missing"
        );
        assert!(
            out.join(format!("figures/{id}.svg")).exists(),
            "figures/{id}.svg"
        );
    }
    assert_eq!(
        html.matches("<svg ").count(),
        want.len(),
        "unexpected figures"
    );

    let runs = raw_runs(&out);
    assert_eq!(runs.len(), 3 * 2 * 3 * POINTS);
    let mut by_cell: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut by_rep: BTreeMap<String, f64> = BTreeMap::new();
    for r in &runs {
        let key = format!("{} {} {}", r["datapath"], r["backend"], r["point"]);
        let iops = r["perf"]["iops"].as_f64().unwrap();
        by_rep.insert(format!("{key} {}", r["rep"]), iops);
        by_cell.entry(key).or_default().push(iops);
    }
    let summary = json(&out.join("summary.json"));
    let cells = summary["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 3 * 2 * POINTS);
    for c in cells {
        assert_eq!(c["n"], 3, "{c}");
        assert_eq!(c["failed"], 0, "{c}");
        let key = format!("{} {} {}", c["datapath"], c["backend"], c["point"]);
        let m = median(by_cell[&key].clone());
        let got = c["iops"]["median"].as_f64().unwrap();
        assert!(
            (got - m).abs() <= m * 1e-12,
            "{key}: summary {got}, raw median {m}"
        );
        // The fake's numbers differ between repetitions, so min < median < max.
        assert!(
            c["iops"]["min"].as_f64().unwrap() < got && got < c["iops"]["max"].as_f64().unwrap()
        );
        let vs = c["vs"].as_array().unwrap();
        assert_eq!(vs.is_empty(), c["datapath"] == "fake-a", "{c}");
        if let Some(v) = vs.first() {
            // Against fake-a, repetition by repetition.
            let base = format!("\"fake-a\" {} {}", c["backend"], c["point"]);
            let r: Vec<f64> = (1..=3)
                .map(|rep| by_rep[&format!("{key} {rep}")] / by_rep[&format!("{base} {rep}")])
                .collect();
            let got = v["iops_ratio"]["median"].as_f64().unwrap();
            assert!(
                (got - median(r.clone())).abs() < 1e-9,
                "{key}: {got} vs {r:?}"
            );
        }
    }
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert_eq!(md.matches("| fake-b | 3 |").count(), 2 * POINTS, "{md}");
    assert_eq!(md.matches("against fake-a").count(), 2, "{md}");

    // Repetition-major, backends, then datapaths flipped on even repetitions.
    let mut want_order = Vec::new();
    for rep in 1..=3 {
        for b in ["null", "file"] {
            let mut ds = vec!["fake-a", "fake-b", "fake-c"];
            if rep % 2 == 0 {
                ds.reverse();
            }
            for d in ds {
                for _ in 0..POINTS {
                    want_order.push(format!("{rep} {d} {b}"));
                }
            }
        }
    }
    let got: Vec<String> = runs
        .iter()
        .map(|r| {
            format!(
                "{} {} {}",
                r["rep"],
                r["datapath"].as_str().unwrap(),
                r["backend"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(got, want_order);
}

#[test]
fn fixed_order_keeps_the_datapaths_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = FAKE
        .replace("reps = 2", "reps = 2\norder = \"fixed\"")
        .replace("[\"null\", \"file\"]", "[\"null\"]");
    let o = bench(&m, &out, &["--cpus", "1:0-1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = json(&out.join("summary.json"));
    assert_eq!(
        (s["cpus"]["server"].as_str(), s["cpus"]["client"].as_str()),
        (Some("1"), Some("0-1"))
    );
    let order: Vec<String> = s["order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let want = [
        "1 fake-a null",
        "1 fake-b null",
        "1 fake-c null",
        "2 fake-a null",
        "2 fake-b null",
        "2 fake-c null",
    ];
    assert_eq!(order, want);
}

#[test]
fn a_missing_tool_skips_its_datapath_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = FAKE.replace(
        r#"["fake-a", "fake-b", "fake-c"]"#,
        r#"["fake-a", "qsd-vhost"]"#,
    );
    let o = bench_cmd(&m, &out)
        .env("PATH", dir.path()) // no qemu-storage-daemon here
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = json(&out.join("summary.json"));
    let skipped = s["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert_eq!(skipped[0]["datapath"], "qsd-vhost");
    assert!(skipped[0]["reason"]
        .as_str()
        .unwrap()
        .contains("qemu-storage-daemon"));
    assert!(s["cells"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["datapath"] == "fake-a"));
}

/// FAKE with a `clients` axis.
/// A traced matrix: every run has a layer table, every cell the median of each
/// layer over its runs (layers in request order, adding up to the total), the
/// report a time-per-layer figure per backend and kind of workload, and the
/// percentile curves have every point.
#[test]
fn traced_runs_give_each_cell_its_time_per_layer() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = FAKE.replace(
        "baselines = [\"fake-a\"]",
        "baselines = [\"fake-a\"]\ntrace = true",
    );
    let o = bench(&m, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for r in raw_runs(&out) {
        assert!(r["perf"]["trace"]["ops"].is_array(), "{r}");
    }
    let s = json(&out.join("summary.json"));
    for c in s["cells"].as_array().unwrap() {
        let layers = c["layers"].as_array().unwrap();
        let names: Vec<&str> = layers
            .iter()
            .map(|l| l["layer"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "submit",
                "queue",
                "backend",
                "complete",
                "notify",
                "transport",
                "reap",
                "total"
            ]
        );
        // A 70 % read mix shows its reads.
        let op = if c["point"]["rw"] == "randwrite" {
            "write"
        } else {
            "read"
        };
        assert!(layers.iter().all(|l| l["op"] == op), "{c}");
        let med = |l: &Value| l["mean_us"]["median"].as_f64().unwrap();
        let parts: f64 = layers[..7].iter().map(med).sum();
        let total = med(&layers[7]);
        assert!((parts - total).abs() <= total * 1e-9, "{parts} vs {total}");
        for k in [
            "min_us",
            "p50_us",
            "p99_us",
            "p99_9_us",
            "p99_99_us",
            "max_us",
        ] {
            assert!(c[k]["median"].as_f64().unwrap() > 0.0, "{k}: {c}");
        }
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    for b in [Backend::Null, Backend::File] {
        for (what, k) in [
            ("pct", "randread-4k-j1"),
            ("pct", "randrw70-4k-j1"),
            ("layers", "randread-4k-j1-qd1"),
            ("layers", "randread-4k-j1-qd8"),
            ("layers", "randrw70-4k-j1-qd4"),
        ] {
            let id = udrive::bench::report::latency::figure_id(what, b, k);
            assert!(html.contains(&format!("<svg id=\"{id}\"")), "{id} missing");
            assert!(out.join(format!("figures/{id}.svg")).exists(), "{id}.svg");
        }
    }
    // randread at QD1 and QD8, jobs 1: a figure per QD, a bar per datapath.
    for q in [1, 8] {
        let f = out.join(format!("figures/layers-null-randread-4k-j1-qd{q}.svg"));
        let svg = std::fs::read_to_string(f).unwrap();
        for d in ["fake-a", "fake-b", "fake-c"] {
            assert!(svg.contains(&format!(">{d} (read)<")), "{d} QD{q}");
        }
    }
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        md.contains("### null: time per layer") && md.contains("### file: time per layer"),
        "{md}"
    );
}

fn with_clients(list: &str) -> String {
    FAKE.replace(
        "baselines = [\"fake-a\"]",
        &format!("baselines = [\"fake-a\"]\nclients = {list}"),
    )
}

/// Three clients at once on one (fake) server: every run has a result per client,
/// the cell's IOPS are their sum, its fairness and server CPU per I/O are there,
/// and the report has the "many clients on one server" figures.
#[test]
fn many_clients_give_a_result_each_and_their_figures() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = with_clients("[1, 3]").replace("[\"null\", \"file\"]", "[\"null\"]");
    let o = bench(&m, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let runs = raw_runs(&out);
    // 2 reps × 2 client counts × 3 datapaths × the points.
    assert_eq!(runs.len(), 2 * 2 * 3 * POINTS);
    let mut sums: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in &runs {
        let n = r["clients"].as_u64().unwrap();
        let each = r["per_client"].as_array().unwrap();
        assert_eq!(each.len() as u64, n, "{r}");
        let sum: f64 = each.iter().map(|c| c["iops"].as_f64().unwrap()).sum();
        assert!((r["perf"]["iops"].as_f64().unwrap() - sum).abs() <= sum * 1e-12);
        let key = format!("{} {n} {}", r["datapath"], r["point"]);
        sums.entry(key).or_default().push(sum);
    }
    let s = json(&out.join("summary.json"));
    let cells = s["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2 * 3 * POINTS);
    for c in cells {
        let n = c["clients"].as_u64().unwrap();
        let key = format!("{} {n} {}", c["datapath"], c["point"]);
        let got = c["iops"]["median"].as_f64().unwrap();
        let want = median(sums[&key].clone());
        assert!((got - want).abs() <= want * 1e-12, "{key}");
        // The fake gives later clients less: one client is fair to itself.
        let fair = c["fairness"]["median"].as_f64().unwrap();
        assert_eq!(fair == 1.0, n == 1, "{c}");
        assert!(c["client_iops_min"]["median"].as_f64().unwrap() <= got / n as f64);
        assert!(
            c["server_us_per_io"]["median"].as_f64().unwrap() > 0.0,
            "{c}"
        );
        // Compared with fake-a at the same client count.
        assert_eq!(
            c["vs"].as_array().unwrap().is_empty(),
            c["datapath"] == "fake-a"
        );
    }
    assert!(s["order"]
        .as_array()
        .unwrap()
        .contains(&Value::from("1 fake-b null ×3")));
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    let mut points: Vec<Value> = cells.iter().map(|c| c["point"].clone()).collect();
    points.dedup();
    assert_eq!(points.len(), POINTS);
    for p in &points {
        let p: udrive::bench::matrix::Point = serde_json::from_value(p.clone()).unwrap();
        for what in ["iops", "cpu"] {
            let id = udrive::bench::report::many_clients_id(
                udrive::bench::matrix::Backend::Null,
                &p,
                what,
            );
            assert!(html.contains(&format!("<svg id=\"{id}\"")), "{id} missing");
            assert!(out.join(format!("figures/{id}.svg")).exists(), "{id}.svg");
        }
    }
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("### null: many clients on one server"), "{md}");
    // The cells' table and the one against fake-a.
    assert_eq!(
        md.matches(", 3 clients | fake-b |").count(),
        2 * POINTS,
        "{md}"
    );
}

/// `cpu = "threads"`: each cell's CPU per I/O by role is what its runs used over
/// their IOPS, and summary.md tables the roles and the threads by name.
#[test]
fn cpu_by_role_and_thread_is_tabled() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = FAKE.replace("reps = 2", "reps = 3\ncpu = \"threads\"");
    let o = bench(&m, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let runs = raw_runs(&out);
    let s = json(&out.join("summary.json"));
    for c in s["cells"].as_array().unwrap() {
        let mine: Vec<&Value> = runs
            .iter()
            .filter(|r| {
                r["datapath"] == c["datapath"]
                    && r["backend"] == c["backend"]
                    && r["point"] == c["point"]
            })
            .collect();
        assert_eq!(mine.len(), 3, "{c}");
        let per_io = |role: &str| -> Vec<f64> {
            mine.iter()
                .map(|r| {
                    let cpu = &r["cpu"];
                    cpu["roles"][role].as_f64().unwrap()
                        / cpu["wall_s"].as_f64().unwrap()
                        / r["perf"]["iops"].as_f64().unwrap()
                        * 1e6
                })
                .collect()
        };
        let u = &c["cpu"];
        for role in ["server", "client"] {
            let got = u["roles"][role]["median"].as_f64().unwrap();
            assert!((got - median(per_io(role))).abs() < 1e-9, "{role}: {c}");
        }
        assert!(u["roles"].get("cluster").is_none(), "no cluster: {c}");
        let total = u["total_us"]["median"].as_f64().unwrap();
        let parts: Vec<f64> = per_io("server")
            .iter()
            .zip(per_io("client"))
            .map(|(a, b)| a + b)
            .collect();
        assert!((total - median(parts)).abs() < 1e-9, "{c}");
        assert!(u["threads"]["server:reactor-#"]["median"].as_f64().unwrap() > 0.0);
    }
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    for heading in [
        "### null: CPU per I/O (µs)",
        "### file: CPU per I/O by thread",
    ] {
        assert!(md.contains(heading), "{heading}: {md}");
    }
    assert!(md.contains("server:reactor-# "), "{md}");
    // Without `cpu`, the server's column only.
    let out = dir.path().join("plain");
    assert!(bench(FAKE, &out, &[]).status.success());
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(!md.contains("CPU per I/O (µs)"), "{md}");
    assert!(raw_runs(&out).iter().all(|r| r.get("cpu").is_none()));
}

fn invalid_field(text: &str) -> String {
    match Matrix::from_toml(text) {
        Err(MatrixError::Invalid { field, .. }) => field,
        other => panic!("not refused as invalid: {other:?}"),
    }
}

#[test]
fn a_broken_variant_is_refused_naming_the_field() {
    let cases = [
        // A variant named but not defined, or one that sets what the cell decides.
        (
            FAKE.replace("\"fake-c\"]", "\"udrive-nvme+x\"]"),
            "datapaths[2]",
        ),
        (
            format!("{FAKE}\n[variant.x]\nperf = [\"--irq\", \"--qd=4\"]\n"),
            "variant.x.perf[1]",
        ),
        (
            format!("{FAKE}\n[variant.x]\nserve_env = [\"RUST_LOG\", \"A=1\"]\n"),
            "variant.x.serve_env[0]",
        ),
        (
            format!("{FAKE}\n[variant.x]\nexpect_log = \"\"\n"),
            "variant.x.expect_log",
        ),
        (
            format!("{FAKE}\n[variant.x]\nplacement = \"everywhere\"\n"),
            "variant.x.placement",
        ),
        (
            format!("{FAKE}\n[variant.x]\ndisk = [\"iops=1000,rd_iops=5\"]\n"),
            "variant.x.disk[0]",
        ),
        (
            format!("{FAKE}\n[variant.x.neighbour]\nperf = [\"--qd\", \"8\", \"--time=9\"]\n"),
            "variant.x.neighbour.perf[2]",
        ),
        (
            format!("{FAKE}\n[variant.x.neighbour]\ndisk = [\"iops\"]\n"),
            "variant.x.neighbour.disk[0]",
        ),
        (
            format!("{FAKE}\n[variant.x]\nceph = [\"a = 1\", \"[osd]\"]\n"),
            "variant.x.ceph[1]",
        ),
        (
            format!("{FAKE}\n[variant.x]\nhandovers = 1001\n"),
            "variant.x.handovers",
        ),
        (
            format!(
                "{FAKE}\n[variant.x]\nhandovers = 3\nperf = [\"--verify\", \"--gaps\", \"9\"]\n"
            ),
            "variant.x.perf[1]",
        ),
    ];
    for (bad, field) in cases {
        assert_eq!(invalid_field(&bad), field);
    }
}

#[test]
fn a_broken_matrix_is_refused_naming_the_field() {
    let cases = [
        (FAKE.replace("qd = [4]", "qd = [0]"), "workload[1].qd"),
        (
            FAKE.replace("jobs = [1, 2]", "jobs = []"),
            "workload[0].jobs",
        ),
        (FAKE.replace("reps = 2", "reps = 0"), "reps"),
        (
            FAKE.replace("[\"fake-a\"]", "[\"fake-a\", \"io-uring\"]"),
            "baselines[1]",
        ),
        (FAKE.replace("\"fake-c\"]", "\"fake-a\"]"), "datapaths[2]"),
        (
            FAKE.replace("rwmixread = 70", "rwmixread = 170"),
            "workload[1].rwmixread",
        ),
        (format!("{FAKE}\nbs = 1000"), "workload[1].bs"),
        (
            format!("{FAKE}\nthink_us = 600000001"),
            "workload[1].think_us",
        ),
        (with_clients("[0]"), "clients[0]"),
        (with_clients("[1, 100000]"), "clients[1]"),
        (with_clients("[65]"), "clients[0]"),
        (with_clients("[2, 2]"), "clients[1]"),
        (with_clients("[]"), "clients"),
        // 64 clients would each get less than 1 MiB of a 16 MiB RAM disk.
        (
            with_clients("[64]").replace("reps = 2", "reps = 2\nram_mib = 16"),
            "clients",
        ),
        (
            format!(
                "{}\n[cpus]\nserver = \"0\"\nclient = \"x\"\n",
                with_clients("[2]")
            ),
            "cpus.client",
        ),
        (
            format!("{FAKE}\n[rbd]\nconf = \"/etc/ceph/ceph.conf\"\nthrowaway = true\n"),
            "rbd.throwaway",
        ),
    ];
    for (bad, field) in cases {
        assert_eq!(invalid_field(&bad), field);
    }
    // Fields the matrix does not have, and values of the wrong kind: TOML's error
    // names them.
    for (bad, name) in [
        (FAKE.replace("qd = [4]", "qdepth = [4]"), "qdepth"),
        (FAKE.replace("\"fake-c\"", "\"spdk\""), "spdk"),
        (
            FAKE.replace("rw = \"randrw\"", "rw = \"seqread\""),
            "seqread",
        ),
        (FAKE.replace("\"fake-c\"", "\"udrive-nvme@fast\""), "fast"),
        (with_clients("[-1]"), "clients"),
        (
            FAKE.replace("reps = 2", "reps = 2\npoll = \"spin\""),
            "spin",
        ),
        (
            FAKE.replace("reps = 2", "reps = 2\ncpu = \"everyone\""),
            "everyone",
        ),
    ] {
        match Matrix::from_toml(&bad) {
            Err(e @ MatrixError::Toml { .. }) => assert!(e.to_string().contains(name), "{e}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    // On the command line: a non-zero exit and the field on stderr, before any run.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = bench(&FAKE.replace("qd = [4]", "qd = [0]"), &out, &[]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("workload[1].qd"));
    assert!(!out.join("raw").exists());
}

/// A suite runs each matrix into its own directory and links their reports; a
/// member that is missing is refused before anything runs.
#[test]
fn a_suite_runs_each_matrix_into_its_own_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("first.toml"), FAKE.replace("reps = 2", "reps = 1")).unwrap();
    let second = FAKE
        .replace("reps = 2", "reps = 1")
        .replace("fake datapaths", "second matrix");
    std::fs::write(d.join("second.toml"), second).unwrap();
    let suite = d.join("suite.toml");
    std::fs::write(
        &suite,
        "description = \"two fakes\"\nsuite = [\"first.toml\", \"second.toml\"]\n",
    )
    .unwrap();
    let out = d.join("out");
    let run = |suite: &std::path::Path, out: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["bench", "--matrix"])
            .arg(suite)
            .arg("--out")
            .arg(out)
            .output()
            .unwrap()
    };
    let o = run(&suite, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for m in ["first", "second"] {
        assert!(out.join(m).join("report.html").is_file(), "{m}");
        assert_eq!(raw_runs(&out.join(m)).len(), 3 * 2 * POINTS, "{m}");
    }
    let index = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(index.contains("href=\"first/report.html\""), "{index}");
    assert!(index.contains("href=\"second/report.html\""), "{index}");
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("# first") && md.contains("# second"), "{md}");
    assert!(md.contains("second matrix"), "{md}");

    std::fs::write(&suite, "suite = [\"first.toml\", \"missing.toml\"]\n").unwrap();
    let out = d.join("out2");
    let o = run(&suite, &out);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("suite[1]"), "{err}");
    assert!(!out.join("first").exists(), "nothing ran");
}
