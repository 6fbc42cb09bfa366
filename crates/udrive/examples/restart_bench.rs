//! Crash recovery under `udrive serve --supervise` (decision 0021), seen by a client
//! that reacts at once (a guest's driver first waits for its I/O timeout): a
//! supervised server serves a file namespace; udrive's initiator keeps writes in
//! flight at QD32; the server is SIGKILLed; the client polls CSTS until the new
//! server presents the controller (fatal status), resets it, re-creates its queue
//! and times its first completed write. Repeated; prints median and max.
//!
//!   cargo run --release -p udrive --example restart_bench -- [UDRIVE_BIN] [KILLS=10]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use initiator::regs::{CSTS, CSTS_CFS};
use initiator::{DataMode, DriverOpts, IoOp, NvmeDriver};

fn child_of(pid: u32) -> Option<u32> {
    let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    kids.split_whitespace().next()?.parse().ok()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[v.len() - 1])
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bin = args
        .first()
        .cloned()
        .unwrap_or_else(|| "target/release/udrive".into());
    let kills: usize = args.get(1).map_or(Ok(10), |s| s.parse())?;
    let dir = tempfile::tempdir()?;
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)?.set_len(256 << 20)?;
    let sock = dir.path().join("nvme.sock");
    let mut sup = Command::new(&bin)
        .args(["serve", "--supervise", "--cpus", "0", "--vfio-user"])
        .arg(&sock)
        .arg("--ns")
        .arg(format!("file:{}", disk.display()))
        // Kills 1 s apart are not a crash loop: no back-off.
        .env("UDRIVE_SUPERVISE_STABLE_MS", "500")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {bin}"))?;
    let r = run(&sock, sup.id(), kills);
    let _ = Command::new("kill").arg(sup.id().to_string()).status();
    let _ = sup.wait();
    let (held, first) = r?;
    let (hm, hx) = stats(held);
    let (fm, fx) = stats(first);
    println!("| kills | SIGKILL → new server holds the client (ms) | SIGKILL → first write completed after reset (ms) |");
    println!("|---|---|---|");
    println!("| {kills} | {hm:.1} median, {hx:.1} max | {fm:.1} median, {fx:.1} max |");
    Ok(())
}

fn run(sock: &Path, sup: u32, kills: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let until = Instant::now() + Duration::from_secs(30);
    while !sock.exists() {
        if Instant::now() > until {
            bail!("the server did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let d = NvmeDriver::connect(sock, DriverOpts::default())?;
    let buf = d.alloc_buf(4096)?;
    let mut qp = d.create_qpair(64, false)?;
    let (mut held, mut first) = (Vec::new(), Vec::new());
    for round in 0..kills {
        for i in 0..32u64 {
            qp.submit_io(IoOp::Write, 1, i * 8, 8, Some(&buf), DataMode::Prp)?;
        }
        qp.ring()?;
        let server = child_of(sup).context("no server child")?;
        let t0 = Instant::now();
        Command::new("kill")
            .args(["-9", &server.to_string()])
            .status()?;
        // Register reads wait in the socket until the new server answers them.
        loop {
            let csts = d.read_reg32(CSTS)?;
            if csts & CSTS_CFS != 0 {
                break;
            }
            if t0.elapsed() > Duration::from_secs(30) {
                bail!("round {round}: no fatal status after 30 s");
            }
        }
        held.push(ms(t0.elapsed()));
        d.reset_controller()?;
        qp = d.create_qpair(64, false)?;
        let cid = qp.submit_io(IoOp::Write, 1, 0, 8, Some(&buf), DataMode::Prp)?;
        qp.ring()?;
        let c = qp.wait(cid, Duration::from_secs(10))?;
        if !c.status.is_ok() {
            bail!("round {round}: write failed after recovery: {}", c.status);
        }
        first.push(ms(t0.elapsed()));
        // A quick death in a row backs off; let the supervisor see a stable child.
        std::thread::sleep(Duration::from_millis(1000));
    }
    Ok((held, first))
}
