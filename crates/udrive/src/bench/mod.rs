//! `udrive bench`: udrive's measurements side by side with its peers, reproducibly.
//! A matrix (a preset or a TOML file) of datapaths × backends × workloads ×
//! repetitions runs alternated (`run`), every run's JSON is kept (`raw/`), and the
//! cells are summarized (`summary`) into summary.json, summary.md and a
//! self-contained report.html with SVG figures (`report`).
//! Design: docs/decisions/0039-bench-harness.md.

pub mod ceph;
pub mod clients;
pub mod cpu;
pub mod cpu_table;
pub mod datapath;
pub mod datapath_kind;
pub mod env;
mod fake;
pub mod floor;
pub mod handovers;
pub mod images;
pub mod layers;
pub mod matrix;
pub mod process;
pub mod report;
pub mod run;
pub mod spdk;
pub mod spdk_vhost;
pub mod stat;
pub mod suite;
pub mod summary;
pub mod target;
pub mod variant;
pub mod vm;
pub mod vm_target;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};

use matrix::{Matrix, PRESETS};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// A preset matrix (`--list` shows them)
    #[arg(conflicts_with = "matrix")]
    pub preset: Option<String>,
    /// A matrix file (TOML; `--print quick` gives one to start from)
    #[arg(long, value_name = "FILE.toml")]
    pub matrix: Option<PathBuf>,
    /// Where raw/, summary.json, summary.md, report.html and figures/ go
    #[arg(long, value_name = "DIR", default_value = "bench-out")]
    pub out: PathBuf,
    /// CPUs of the server and of the client, SERVER:CLIENT (CPU lists, e.g. 0:1 or 0-1:2-3)
    #[arg(long, value_name = "SERVER:CLIENT")]
    pub cpus: Option<String>,
    /// Repetitions (overrides the matrix's)
    #[arg(long, value_name = "N")]
    pub reps: Option<u32>,
    /// Measured seconds per run (overrides the matrix's)
    #[arg(long, value_name = "SECS")]
    pub time: Option<f64>,
    /// The udrive binary that serves and drives (default: this one), e.g. a build to
    /// compare against
    #[arg(long, value_name = "PATH")]
    pub udrive: Option<PathBuf>,
    /// A second udrive binary that serves the `~b` datapaths (`udrive-nvme~b`,
    /// `udrive-vhost~b`) while the clients stay the first one's: a before/after of
    /// the server (preset `ab`)
    #[arg(long, value_name = "BIN")]
    pub udrive_b: Option<PathBuf>,
    /// The Ceph cluster of the `rbd` backend (overrides the matrix's `[rbd] conf` and
    /// its throwaway cluster); its image (`[rbd] image`, default rbd/udrive-bench) is
    /// made if missing
    #[arg(long, value_name = "PATH")]
    pub rbd_conf: Option<PathBuf>,
    /// List the presets
    #[arg(long)]
    pub list: bool,
    /// Print a preset's matrix (to copy and edit)
    #[arg(long, value_name = "PRESET")]
    pub print: Option<String>,
}

fn preset_text(name: &str) -> Result<&'static str> {
    match matrix::preset(name) {
        Some(t) => Ok(t),
        None => {
            let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
            bail!("no preset `{name}` (presets: {})", names.join(", "))
        }
    }
}

/// The text of the matrix or suite asked for, and the directory its relative
/// names start from.
fn source(a: &BenchArgs) -> Result<(String, PathBuf)> {
    match (&a.preset, &a.matrix) {
        (_, Some(f)) => {
            let t =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            let dir = f.parent().map_or_else(PathBuf::new, Path::to_path_buf);
            Ok((t, dir))
        }
        (Some(p), None) => Ok((preset_text(p)?.to_string(), PathBuf::new())),
        (None, None) => bail!("name a preset (udrive bench --list) or --matrix FILE.toml"),
    }
}

/// The matrix in `text`, with the command line's overrides applied and checked.
fn load(a: &BenchArgs, text: &str) -> Result<Matrix> {
    let mut m = Matrix::parse(text)?;
    if let Some(r) = a.reps {
        m.reps = r;
    }
    if let Some(t) = a.time {
        m.time = t;
    }
    if let Some(c) = &a.cpus {
        let Some((s, cl)) = c.split_once(':') else {
            bail!("--cpus {c}: SERVER:CLIENT, e.g. 0:1");
        };
        m.cpus.server = s.into();
        m.cpus.client = cl.into();
    }
    if let Some(c) = &a.rbd_conf {
        m.rbd.conf = Some(c.display().to_string());
        // The cluster named replaces the one the matrix would start.
        m.rbd.throwaway = false;
    }
    if let Some(b) = &a.udrive_b {
        m.udrive_b = Some(b.display().to_string());
    }
    // The overrides go through the same checks as the file.
    let text = toml::to_string(&m).context("matrix back to TOML")?;
    let m = Matrix::from_toml(&text)?;
    if let Some(b) = m.udrive_b.as_deref().filter(|b| !Path::new(b).is_file()) {
        bail!("the second udrive binary {b} (--udrive-b, udrive_b) is not a file");
    }
    Ok(m)
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.list {
        for (name, text) in PRESETS {
            let d = match suite::parse(text) {
                Ok(Some(s)) => format!("{} (suite: {})", s.description, s.suite.join(", ")),
                _ => Matrix::parse(text)
                    .map(|m| m.description)
                    .unwrap_or_default(),
            };
            println!("{name:12} {d}");
        }
        return Ok(());
    }
    if let Some(p) = &a.print {
        print!("{}", preset_text(p)?);
        return Ok(());
    }
    let (text, base) = source(&a)?;
    match suite::parse(&text)? {
        Some(s) => suite::run(&a, &s, &base),
        None => run_matrix(&a, &text),
    }
}

/// Set by SIGINT or SIGTERM: the runs stop, the results so far are written (and a
/// suite starts no further matrix). Registered once per process.
fn stop_flag() -> Result<&'static AtomicBool> {
    static STOP: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    if let Some(s) = STOP.get() {
        return Ok(s);
    }
    let s = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&s)).context("installing a signal handler")?;
    }
    Ok(STOP.get_or_init(|| s))
}

/// Whether SIGINT or SIGTERM asked to stop.
fn stopped() -> bool {
    stop_flag().is_ok_and(|s| s.load(Ordering::Relaxed))
}

/// Runs the matrix in `text` into `a.out`.
fn run_matrix(a: &BenchArgs, text: &str) -> Result<()> {
    let mut m = load(a, text)?;
    let raw = a.out.join("raw");
    // Old runs would mix into this one's summary.
    if raw.exists() {
        std::fs::remove_dir_all(&raw).with_context(|| format!("clearing {}", raw.display()))?;
    }
    let work = a.out.join("work");
    for d in [&raw, &work, &a.out.join("figures")] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let udrive = match &a.udrive {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("finding this binary")?,
    };
    let data_file =
        PathBuf::from(&m.file.dir).join(format!("udrive-bench-{}.img", std::process::id()));
    let cluster = ceph::Throwaway::start_for(&mut m, &work.join("ceph"))?;
    let ceph_daemons = match (&cluster, m.backends.contains(&matrix::Backend::Rbd)) {
        (Some(c), _) => c.daemons(),
        (None, true) => ceph::host_daemons(),
        (None, false) => Vec::new(),
    };
    let env = datapath::Env {
        udrive,
        udrive_b: m.udrive_b.as_ref().map(PathBuf::from),
        qsd: process::which("qemu-storage-daemon"),
        work,
        data_file,
        ceph_daemons,
        matrix: m,
    };
    let stop = stop_flag()?;
    let result = measure(&env, &raw, &a.out, stop);
    for (f, _) in data_files(&env) {
        let _ = std::fs::remove_file(f);
    }
    for f in env.qcow2_files() {
        let _ = std::fs::remove_file(f);
    }
    let _ = std::fs::remove_file(env.luks_file());
    let failed = result?;
    if stop.load(Ordering::Relaxed) {
        bail!("interrupted; the runs so far are in {}", a.out.display());
    }
    eprintln!(
        "udrive bench: report in {}",
        a.out.join("report.html").display()
    );
    if failed > 0 {
        bail!("{failed} runs failed (see summary.md and raw/)");
    }
    Ok(())
}

/// Run the matrix and write the results; the number of failed runs.
fn measure(
    env: &datapath::Env,
    raw: &std::path::Path,
    out: &std::path::Path,
    stop: &AtomicBool,
) -> Result<usize> {
    let m = &env.matrix;
    let (groups, skipped) = run::plan(env);
    for s in &skipped {
        let on = s.backend.map_or(String::new(), |b| format!(" on {b}"));
        eprintln!("udrive bench: skipping {}{on}: {}", s.datapath, s.reason);
    }
    let needs = |b: matrix::Backend| {
        groups
            .iter()
            .any(|g| g.backend == b && !matches!(g.datapath, matrix::DatapathKind::Fake(_)))
    };
    let needs_qcow2 = needs(matrix::Backend::Qcow2);
    let needs_data = [matrix::Backend::File, matrix::Backend::Qcow2Chain];
    if needs_qcow2 || needs_data.into_iter().any(needs) {
        for (f, mib) in data_files(env) {
            write_data_file(&f, mib, 0)?;
        }
    }
    if needs(matrix::Backend::RamLuks) || needs(matrix::Backend::FileLuks) {
        let key = env.luks_key();
        let mut pass = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut r| std::io::Read::read_exact(&mut r, &mut pass))
            .context("reading a passphrase from /dev/urandom")?;
        std::fs::write(&key, pass).with_context(|| format!("writing {}", key.display()))?;
    }
    if needs(matrix::Backend::FileLuks) {
        // Blank where the header goes, so that the first server formats it there
        // (create=on), and ciphertext after it.
        write_data_file(
            &env.luks_file(),
            m.file.mib + LUKS_HEADER_MIB,
            LUKS_HEADER_MIB,
        )?;
    }
    if needs_qcow2 {
        images::make_qcow2(env)?;
    }
    if needs(matrix::Backend::Rbd) {
        eprintln!(
            "udrive bench: writing the RBD image {} once ...",
            m.rbd.image()
        );
        images::prepare_rbd_image(env)?;
    }
    let _hugepages = if groups.iter().any(|g| g.datapath.is_spdk()) {
        Some(spdk::Hugepages::reserve(m.ram_mib)?)
    } else {
        None
    };
    let mut host = host_facts(env);
    host.insert("load average before".into(), loadavg());
    let real = groups
        .iter()
        .any(|g| !matches!(g.datapath, matrix::DatapathKind::Fake(_)));
    if real {
        eprintln!("udrive bench: measuring the copy floor of this host ...");
        host.insert(
            "copy floor (scripts/copy-floor.c)".into(),
            floor::measure(env),
        );
    }
    let runs = run::execute(env, &groups, raw, stop).context("writing raw results")?;
    host.insert("load average after".into(), loadavg());
    let s = summary::summarize(m, &runs, skipped, host);
    let md = summary::markdown(&s);
    let figs = report::figures(&s);
    let w = |name: &str, body: &[u8]| {
        let p = out.join(name);
        std::fs::write(&p, body).with_context(|| format!("writing {}", p.display()))
    };
    w("summary.json", &serde_json::to_vec_pretty(&s)?)?;
    w("summary.md", md.as_bytes())?;
    w("report.html", report::html(&s, &figs, &md).as_bytes())?;
    for f in &figs {
        w(&format!("figures/{}.svg", f.id), f.svg.as_bytes())?;
    }
    Ok(runs.iter().filter(|r| r.error.is_some()).count())
}

/// The `file` backend's data files and their sizes in MiB: for each client count N,
/// N files of 1/N of `[file] mib` (one client's is the data file itself).
fn data_files(env: &datapath::Env) -> Vec<(PathBuf, u64)> {
    let m = &env.matrix;
    m.clients
        .iter()
        .flat_map(|&n| (0..n).map(move |i| (env.data_file_of(n, i), m.file.mib / u64::from(n))))
        .collect()
}

/// What a LUKS2 volume made by `create=on` keeps before its payload
/// (libcryptsetup's default header and keyslot area).
const LUKS_HEADER_MIB: u64 = 16;

/// The `file` backend's data: written whole with pseudo-random bytes, so that no read
/// lands on a hole; the first `zero_mib` MiB are zeroes.
fn write_data_file(p: &Path, mib: u64, zero_mib: u64) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?;
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..mib {
        if i < zero_mib {
            buf.fill(0);
        } else {
            for c in buf.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes());
            }
        }
        f.write_all(&buf)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    f.sync_all()
        .with_context(|| format!("syncing {}", p.display()))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn host_facts(env: &datapath::Env) -> BTreeMap<String, String> {
    let mut h = BTreeMap::new();
    h.insert(
        "udrive".into(),
        format!("{} {}", env.udrive.display(), env!("CARGO_PKG_VERSION")),
    );
    if let Some(b) = &env.udrive_b {
        h.insert("udrive B (serves ~b)".into(), b.display().to_string());
    }
    let version = |tool: &std::path::Path| {
        std::process::Command::new(tool)
            .arg("--version")
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string()
            })
            .unwrap_or_default()
    };
    if let Some(q) = &env.qsd {
        h.insert("qemu-storage-daemon".into(), version(q));
    }
    if let Some(conf) = &env.matrix.rbd.conf {
        let throwaway = match env.matrix.rbd.throwaway {
            true => " (throwaway: one mon, one OSD on memstore, 127.0.0.1; scripts/ceph-cluster)",
            false => "",
        };
        h.insert("ceph conf".into(), format!("{conf}{throwaway}"));
        if let Some(rbd) = process::which("rbd") {
            h.insert("rbd".into(), version(&rbd));
        }
    }
    if env.matrix.datapaths.iter().any(|d| d.is_spdk()) {
        if let Some(dir) = spdk::dir() {
            let v = std::fs::read_to_string(dir.join("VERSION")).unwrap_or_default();
            h.insert(
                "SPDK".into(),
                format!("{} {}", dir.display(), v.lines().next().unwrap_or("")),
            );
        }
    }
    if env
        .matrix
        .datapaths
        .iter()
        .any(|d| matches!(d, matrix::DatapathKind::Vm(_)))
    {
        h.insert(
            "VM guest".into(),
            format!(
                "QEMU of {} (scripts/vm-bench), 2 vCPUs, 1 GiB; KVM or TCG: each run's `accel`",
                vm::cache().join("sid").display()
            ),
        );
    }
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    h.insert("CPUs".into(), cpus.to_string());
    h.insert("data file".into(), env.data_file.display().to_string());
    h
}
