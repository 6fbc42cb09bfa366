//! The RBD backend across processes: live handover (`udrive upgrade`) and a
//! supervised restart under verified I/O, with the image checked through
//! `rbd export`. Skipped without Ceph (see test_support::ceph).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::rbd::{librbd_threads, rbd_ns};
use common::served::Service;
use common::*;
use initiator::NvmeDriver;
use test_support::ceph::Cluster;
use test_support::gens::{self, submit_gen, verify, write_gen, GenClient, BLOCK, QD};
use test_support::pattern::is_block;

/// Blocks of the handover and supervise tests' images.
const BLOCKS: u64 = 512;
const UDRIVE: &str = env!("CARGO_BIN_EXE_udrive");

/// A server with one NVMe controller on an RBD image and a control socket, run
/// detached (the processes that take it over are not our children).
fn ho_service(c: &Cluster, image: &str) -> Service {
    ho_service_with(c, image, "")
}

/// As `ho_service`, with `top` (TOML lines) before the controller.
fn ho_service_with(c: &Cluster, image: &str, top: &str) -> Service {
    Service::start(|dir| {
        let p = |n: &str| dir.join(n).display().to_string();
        format!(
            "cpus = \"0\"\n{top}rpc = \"{}\"\n[[controller]]\nsocket = \"{}\"\nnamespaces = [\"{}\"]\n",
            p("rpc.sock"),
            p("nvme.sock"),
            rbd_ns(c, image, "")
        )
    })
}

/// The image as the client expects it, checked with `rbd export`.
fn check_export(c: &Cluster, image: &str, gens: &[u64]) {
    let data = c.export(image);
    for (lba, g) in gens.iter().enumerate() {
        let got = &data[lba * BLOCK..(lba + 1) * BLOCK];
        let ok = if *g == 0 {
            got.iter().all(|b| *b == 0)
        } else {
            is_block(got, *g, lba as u64)
        };
        assert!(ok, "rbd export: block {lba} is not generation {g}");
    }
}

fn log_numbers<'a>(log: &'a str, line_has: &'a str, key: &'a str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains(line_has))
        .filter_map(|l| {
            let at = l.find(&format!("{key}="))? + key.len() + 1;
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

#[test]
fn an_rbd_namespace_survives_handovers_under_verified_io() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("ho", BLOCKS * BLOCK as u64);
    // librbd's threads on every CPU (decision 0030): each new process keeps that.
    let all = engine::allowed_cpus();
    let list = engine::format_cpu_list(&all);
    let s = ho_service_with(&c, "ho", &format!("rbd_cpus = \"{list}\"\n"));
    let client = GenClient::start(s.path("nvme.sock"), 7, BLOCKS);
    common::wait_until("client running", Duration::from_secs(60), || {
        client.ops() > 0
    });
    let n = std::env::var("UDRIVE_TEST_HANDOVERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    // Pause between handovers (ms): back to back, a handover's release waits for
    // the previous one's lock notification to time out (see decision 0024).
    let gap = std::env::var("UDRIVE_TEST_HANDOVER_GAP_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5500);
    let mut pid = s.pid();
    for i in 0..n {
        std::thread::sleep(Duration::from_millis(gap));
        let before = client.ops();
        let t = Instant::now();
        s.upgrade_ok(&format!("handover {i}"));
        let upgrade_ms = t.elapsed().as_millis();
        let now = s.pid();
        assert_ne!(now, pid, "handover {i}: a new process serves");
        pid = now;
        for (comm, cpus) in librbd_threads(now as u32) {
            assert_eq!(cpus, all, "handover {i}: {comm} lost rbd_cpus = {list:?}");
        }
        common::wait_until("I/O after the handover", Duration::from_secs(60), || {
            client.ops() > before
        });
        eprintln!("handover {i}: `udrive upgrade` took {upgrade_ms} ms");
    }
    let gens = client
        .finish()
        .unwrap_or_else(|e| panic!("client: {e}\n{}", s.log()));
    let log = s.log();
    assert_eq!(log.matches("took every device over").count(), n, "{log}");
    assert!(!log.contains("panicked"), "{log}");
    for l in log
        .lines()
        .filter(|l| l.contains("handover confirmed") || l.contains("took every device over"))
    {
        eprintln!("{l}");
    }
    let totals = log_numbers(&log, "handover confirmed", "total_us");
    eprintln!("old process's handover (pause to confirm), µs: {totals:?}");
    s.stop();
    check_export(&c, "ho", &gens);
}

#[test]
fn an_rbd_handover_that_dies_rolls_back_and_the_old_process_writes() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("rb", BLOCKS * BLOCK as u64);
    let s = ho_service(&c, "rb");
    let client = GenClient::start(s.path("nvme.sock"), 9, BLOCKS);
    common::wait_until("client running", Duration::from_secs(60), || {
        client.ops() > 0
    });
    let pid = s.pid();
    let steps: Vec<String> = std::env::var("UDRIVE_TEST_DIE_AT")
        .map(|v| v.split(',').map(String::from).collect())
        .unwrap_or_else(|_| ["receive", "start", "confirm"].map(String::from).to_vec());
    for step in &steps {
        let out = Command::new(UDRIVE)
            .args(["serve", "--takeover"])
            .arg(s.path("rpc.sock"))
            .env("UDRIVE_TAKEOVER_DIE_AT", step)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{step}: the takeover died");
        eprintln!(
            "takeover dying at {step}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(s.pid(), pid, "{step}: the old process still serves");
        // Writes go through: the old process holds the image's lock again.
        let before = client.ops();
        let t = Instant::now();
        while client.ops() <= before + 200 {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no I/O after the rollback at {step}:\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "died at {step}: rolled back; 200 more verified ops within {} ms",
            t.elapsed().as_millis()
        );
    }
    // And a real handover still works afterwards.
    s.upgrade_ok("the handover after the rollbacks");
    let before = client.ops();
    common::wait_until("I/O after the handover", Duration::from_secs(60), || {
        client.ops() > before
    });
    let gens = client
        .finish()
        .unwrap_or_else(|e| panic!("client: {e}\n{}", s.log()));
    let log = s.log();
    assert_eq!(
        log.matches("handover failed, devices resumed").count(),
        steps.len(),
        "{log}"
    );
    assert!(!log.contains("cannot take its backend back"), "{log}");
    for l in log
        .lines()
        .filter(|l| l.contains("broke the exclusive lock"))
    {
        eprintln!("{l}");
    }
    s.stop();
    check_export(&c, "rb", &gens);
}

#[test]
fn a_supervised_server_killed_with_an_rbd_namespace_reopens_the_image_at_once() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    c.create_image("sv", BLOCKS * BLOCK as u64);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let sock = dir.path().join("nvme.sock");
    let logp = dir.path().join("stderr.log");
    let mut sup = Command::new(UDRIVE)
        .args(["serve", "--supervise", "--cpus", "0", "--vfio-user"])
        .arg(&sock)
        .arg("--ns")
        .arg(rbd_ns(&c, "sv", ""))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&logp).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&logp).unwrap_or_default();
    let me = sup.id();
    let server_pid = || -> Option<u32> {
        let kids = std::fs::read_to_string(format!("/proc/{me}/task/{me}/children")).ok()?;
        kids.split_whitespace().next()?.parse().ok()
    };
    common::wait_until("device socket", Duration::from_secs(60), || sock.exists());
    let d = NvmeDriver::connect(&sock, opts()).expect("attach");
    let bufs = gens::bufs(&d);
    let mut qp = d.create_qpair(64, false).unwrap();
    let all: Vec<u64> = (0..BLOCKS).collect();
    assert_eq!(write_gen(&mut qp, &bufs, 1, &all).len(), all.len());
    let mut want = vec![1u64; BLOCKS as usize];
    let rounds = 2u64;
    for round in 0..rounds {
        let gen = round + 2;
        let first = server_pid().expect("a server child");
        let lbas: Vec<u64> = (0..QD as u64).map(|i| i * 7 % BLOCKS).collect();
        submit_gen(&mut qp, &bufs, gen, &lbas);
        let t = Instant::now();
        let _ = Command::new("kill")
            .args(["-9", &first.to_string()])
            .status();
        // The new child answers for the controller once it has opened the image.
        let csts = d
            .read_reg32(initiator::regs::CSTS)
            .expect("CSTS after the crash");
        let answered = t.elapsed();
        assert_eq!(
            csts & (initiator::regs::CSTS_CFS | initiator::regs::CSTS_RDY),
            initiator::regs::CSTS_CFS | initiator::regs::CSTS_RDY,
            "round {round}: CSTS {csts:#x}\n{}",
            log()
        );
        assert_ne!(server_pid(), Some(first), "a new server process");
        d.reset_controller().expect("reset after the crash");
        qp = d.create_qpair(64, false).unwrap();
        assert_eq!(
            write_gen(&mut qp, &bufs, gen, &lbas).len(),
            lbas.len(),
            "round {round}: writes after the restart\n{}",
            log()
        );
        let io_back = t.elapsed();
        for lba in &lbas {
            want[*lba as usize] = gen;
        }
        verify(&mut qp, &bufs, &all, &want).unwrap();
        eprintln!(
            "round {round}: SIGKILL to the new child answering {} ms, to writes done after the reset {} ms",
            answered.as_millis(),
            io_back.as_millis()
        );
    }
    let l = log();
    let broke = log_numbers(&l, "broke the exclusive lock", "ms");
    eprintln!("lock breaks (ms each): {broke:?}");
    assert_eq!(
        broke.len() as u64,
        rounds,
        "one lock broken per crash:\n{l}"
    );
    let _ = Command::new("kill")
        .args(["-TERM", &me.to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(30);
    while sup.try_wait().unwrap().is_none() {
        assert!(Instant::now() < until, "supervisor did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    check_export(&c, "sv", &want);
}
