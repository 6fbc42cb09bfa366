//! What the `udrive bench` tests share: running the harness on a matrix and
//! reading what it wrote.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

pub const FAKE: &str = r#"
description = "fake datapaths"
reps = 2
time = 1.0
datapaths = ["fake-a", "fake-b", "fake-c"]
backends = ["null", "file"]
baselines = ["fake-a"]
[[workload]]
rw = "randread"
qd = [1, 8]
jobs = [1, 2]
[[workload]]
rw = "randrw"
rwmixread = 70
qd = [4]
"#;

pub const POINTS: usize = 5;

/// `udrive bench --matrix OUT.toml --out OUT` on `matrix`, to run.
pub fn bench_cmd(matrix: &str, out: &Path) -> Command {
    let f = out.with_extension("toml");
    std::fs::write(&f, matrix).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_udrive"));
    c.args(["bench", "--matrix"]).arg(&f).arg("--out").arg(out);
    c
}

pub fn bench(matrix: &str, out: &Path, extra: &[&str]) -> std::process::Output {
    bench_cmd(matrix, out).args(extra).output().unwrap()
}

/// A temporary directory (kept while the first value lives) with `data/` made for
/// a matrix's `[file] dir`, and where the report goes (`out/`, made by the bench).
pub fn data_and_out() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let out = dir.path().join("out");
    (dir, data, out)
}

pub fn json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// The raw runs in execution order.
pub fn raw_runs(out: &Path) -> Vec<Value> {
    let mut v: Vec<Value> = std::fs::read_dir(out.join("raw"))
        .unwrap()
        .map(|e| json(&e.unwrap().path()))
        .collect();
    v.sort_by_key(|r| r["seq"].as_u64().unwrap());
    v
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Why the run in `out` skipped datapath `d` (it must have).
pub fn skip_reason(out: &Path, d: &str) -> String {
    let s = json(&out.join("summary.json"));
    let skipped = s["skipped"].as_array().unwrap();
    let why = skipped
        .iter()
        .find(|k| k["datapath"] == d)
        .unwrap_or_else(|| panic!("{d} not skipped: {skipped:?}"));
    why["reason"].as_str().unwrap().to_owned()
}

/// The run in `out` ran datapath `d` alone, once.
pub fn ran_only(out: &Path, d: &str) {
    let runs = raw_runs(out);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["datapath"], d);
}
