//! Tracing overhead benchmark: one in-process NVMe controller (`null` and
//! `ram` namespaces) on one reactor pinned to CPU 0, udrive's initiator on CPU 1,
//! 4 KiB random reads at QD1 and QD32, tracing off and on (every I/O) alternating.
//! Prints a Markdown table of IOPS (median, min–max) and the overhead; then, with
//! tracing on and the initiator's layers too, writes the full-path breakdown for
//! each namespace as text and PNG into OUT_DIR: `null`, `ram`, and a `file`
//! namespace on a 256 MiB file in TRACE_BENCH_FILE_DIR (default /var/tmp, O_DIRECT).
//!
//!   cargo run --release -p udrive --example trace_bench -- [REPS=5] [SECONDS=3] [OUT_DIR]

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use frontend_core::Observed;
use initiator::workload::{self, NvmeTarget, Rw, WorkloadConfig};
use initiator::{DataMode, DriverOpts, NvmeDriver};
use trace::Breakdown;
use udrive::config::ControllerConfig;
use udrive::device::NvmeDevice;
use udrive::nsspec::NsSpec;

fn pin(cpu: usize) -> Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)?;
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One measured configuration: a namespace at a queue depth, tracing off or on,
/// and the IOPS of each repetition.
struct Row {
    ns: &'static str,
    nsid: u32,
    qd: u32,
    trace: bool,
    iops: Vec<f64>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let reps: usize = args.first().map_or(Ok(5), |s| s.parse())?;
    let secs: f64 = args.get(1).map_or(Ok(3.0), |s| s.parse())?;
    let out = args.get(2).map(std::path::PathBuf::from);
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let engine = engine::Engine::start(&[Some(0)]).context("engine")?;
    let dir = tempfile::tempdir()?;
    let sock = dir.path().join("bench.sock");
    let file_dir = std::env::var("TRACE_BENCH_FILE_DIR").unwrap_or_else(|_| "/var/tmp".into());
    let file = data_file(&file_dir)?;
    let dev = start_device(&engine, &sock, file.path())?;
    // The initiator's job threads inherit this.
    pin(if ncpu > 1 { 1 } else { 0 })?;
    let base = WorkloadConfig {
        bs: 4096,
        jobs: 1,
        time: Duration::from_secs_f64(secs),
        ..Default::default()
    };
    let driver = connect_and_fill(&sock, &base)?;
    let mut rows = measure_overhead(&dev.ctrl, &driver, &base, reps, secs)?;
    print_overhead(&mut rows, reps);
    if let Some(out) = out {
        write_breakdowns(&dev.ctrl, &driver, &base, &out, &file_dir)?;
    }
    drop(Arc::clone(&engine));
    dev.stop();
    engine.shutdown();
    Ok(())
}

/// A 256 MiB file in `dir` for the `file` namespace, of written blocks, not holes:
/// reads of holes never reach the disk.
fn data_file(dir: &str) -> Result<tempfile::NamedTempFile> {
    let file = tempfile::Builder::new()
        .prefix("udrive-trace-bench")
        .tempfile_in(dir)
        .with_context(|| format!("temp file in {dir}"))?;
    {
        use std::io::Write;
        let mut f = file.as_file();
        let chunk = vec![0x5au8; 1 << 20];
        for _ in 0..256 {
            f.write_all(&chunk)?;
        }
        f.sync_all()?;
    }
    Ok(file)
}

/// The controller on `sock`: namespaces 1 `null`, 2 `ram`, 3 `file` (O_DIRECT).
fn start_device(
    engine: &Arc<engine::Engine>,
    sock: &std::path::Path,
    file: &std::path::Path,
) -> Result<NvmeDevice> {
    let file_spec = format!("file:{},direct=on", file.display());
    let specs: Vec<NsSpec> = ["null:64G", "ram:1G", file_spec.as_str()]
        .iter()
        .map(|s| s.parse().map_err(anyhow::Error::msg))
        .collect::<Result<_>>()?;
    let cfg = ControllerConfig::new(sock.to_path_buf(), specs);
    let devs = udrive::backends::open_all(std::slice::from_ref(&cfg))?.remove(0);
    NvmeDevice::start(
        &cfg,
        devs,
        1,
        engine,
        engine.num_reactors(),
        udrive::process::DeviceLife::standalone(&NvmeDevice::keep_prefix(&cfg.socket)),
    )
}

/// The initiator on one queue pair, with the `ram` namespace written all over so
/// that reads copy real pages.
fn connect_and_fill(sock: &std::path::Path, base: &WorkloadConfig) -> Result<NvmeDriver> {
    let driver = NvmeDriver::connect(
        sock,
        DriverOpts {
            pool_bytes: workload::pool_bytes_for(&WorkloadConfig {
                qd: 32,
                ..base.clone()
            }),
            io_queues: 1,
            ..Default::default()
        },
    )?;
    let ram = NvmeTarget::new(&driver, 2, DataMode::Prp)?;
    workload::run(
        &ram,
        &WorkloadConfig {
            rw: Rw::Write,
            bs: 131072,
            qd: 8,
            time: Duration::from_secs(2),
            ..base.clone()
        },
    )?;
    Ok(driver)
}

/// Random reads on `null` and `ram` at QD1 and QD32, tracing off and on (every
/// I/O), each configuration once per repetition, in turn.
fn measure_overhead(
    ctrl: &nvme::Controller,
    driver: &NvmeDriver,
    base: &WorkloadConfig,
    reps: usize,
    secs: f64,
) -> Result<Vec<Row>> {
    let t = Duration::from_secs(2);
    let mut rows = Vec::new();
    for (ns, nsid) in [("null", 1u32), ("ram", 2)] {
        for qd in [1u32, 32] {
            for trace in [false, true] {
                rows.push(Row {
                    ns,
                    nsid,
                    qd,
                    trace,
                    iops: Vec::new(),
                });
            }
        }
    }
    eprintln!("{reps} reps x {} configs x {secs}s ...", rows.len());
    for r in 0..reps {
        // Off before on in even reps, on before off in odd ones.
        let order: Vec<usize> = (0..rows.len()).map(|i| i ^ (r & 1)).collect();
        for i in order {
            let row = &mut rows[i];
            let target = NvmeTarget::new(driver, row.nsid, DataMode::Prp)?;
            if row.trace {
                ctrl.trace_start(1, t);
            } else {
                ctrl.trace_stop(t);
            }
            let rep = workload::run(
                &target,
                &WorkloadConfig {
                    qd: row.qd,
                    seed: r as u64 + 1,
                    ..base.clone()
                },
            )?;
            row.iops.push(rep.iops);
            eprint!("\r  rep {r} {} qd{} trace={}   ", row.ns, row.qd, row.trace);
        }
    }
    eprintln!();
    Ok(rows)
}

/// The Markdown table: per namespace and QD, IOPS tracing off and on (median,
/// min–max) and the difference of the medians.
fn print_overhead(rows: &mut [Row], reps: usize) {
    println!("| backend | QD | tracing off IOPS (k) | every I/O IOPS (k) | cost (pairs) |");
    println!("|---|---|---|---|---|");
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::MAX, f64::min);
        let hi = v.iter().copied().fold(f64::MIN, f64::max);
        (lo, hi)
    };
    for pair in rows.chunks_mut(2) {
        let (a, b) = pair.split_at_mut(1);
        let (off, on) = (&mut a[0], &mut b[0]);
        // The machine's speed drifts between runs far more than tracing costs: the
        // cost is taken per adjacent pair (off and on run back to back), then the
        // median of those.
        let mut cost: Vec<f64> = off
            .iops
            .iter()
            .zip(&on.iops)
            .map(|(o, n)| (1.0 - n / o) * 100.0)
            .collect();
        let (cl, ch) = range(&cost);
        let (ol, oh) = range(&off.iops);
        let (nl, nh) = range(&on.iops);
        println!(
            "| {} | {} | {:.0} ({:.0}–{:.0}) | {:.0} ({:.0}–{:.0}) | {:.1} % ({:.1}–{:.1}) |",
            off.ns,
            off.qd,
            median(&mut off.iops) / 1e3,
            ol / 1e3,
            oh / 1e3,
            median(&mut on.iops) / 1e3,
            nl / 1e3,
            nh / 1e3,
            median(&mut cost),
            cl,
            ch
        );
    }
    println!(
        "\n{reps} runs each, off and on back to back (order swapped every rep); median (min–max)."
    );
}

/// With tracing on in the server and the initiator, the full path's breakdown per
/// namespace at 4 KiB randrw50 QD1, printed and written to `out` as text and PNG.
fn write_breakdowns(
    ctrl: &nvme::Controller,
    driver: &NvmeDriver,
    base: &WorkloadConfig,
    out: &std::path::Path,
    file_dir: &str,
) -> Result<()> {
    let t = Duration::from_secs(2);
    std::fs::create_dir_all(out)?;
    for (ns, nsid) in [("null", 1u32), ("ram", 2), ("file", 3)] {
        let target = NvmeTarget::new(driver, nsid, DataMode::Prp)?;
        ctrl.trace_start(1, t);
        let rep = workload::run(
            &target,
            &WorkloadConfig {
                rw: Rw::RandRw { read_pct: 50 },
                qd: 1,
                trace: true,
                ..base.clone()
            },
        )?;
        ctrl.trace_stop(t);
        let server = Breakdown::from_queues(&ctrl.queue_stats(t));
        let init = rep.trace.clone().context("initiator trace")?;
        let full = Breakdown::full_path(&init, &server);
        let text = udrive::trace_view::table(&full);
        let what = if ns == "file" {
            format!("file ({file_dir}, O_DIRECT)")
        } else {
            ns.to_string()
        };
        println!("\n{what}, 4 KiB randrw50, QD1 (µs):\n{text}");
        std::fs::write(out.join(format!("trace-{ns}.txt")), &text)?;
        udrive::trace_view::plot(
            &full,
            &format!("udrive {ns} namespace, 4 KiB randrw QD1: mean time per layer"),
            &out.join(format!("trace-{ns}.png")),
        )?;
    }
    Ok(())
}
