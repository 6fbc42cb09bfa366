//! SPDK as a peer: its NVMe-oF target `nvmf_tgt` serving a vfio-user controller
//! (`spdk-nvmf`), and its userspace NVMe driver `spdk_nvme_perf` as the client of
//! that target and of udrive's controller (`udrive-nvme-spdk`), so the two servers
//! are compared through one client that is neither's. The same for vhost-user-blk:
//! SPDK's `vhost` target (`spdk-vhost`) and udrive's device (`udrive-vhost-spdk`),
//! both driven by `bdevperf` over SPDK's virtio-user initiator (`spdk_vhost.rs`).
//! `SPDK_DIR` names an SPDK tree built with `./configure --with-vfio-user`, and
//! `--with-vhost --with-virtio` for the vhost pair.
//!
//! Facts these datapaths rest on: SPDK's driver writes doorbells into the mapped
//! doorbell page, which udrive offers in `--poll busy` only, so udrive serves it in
//! that mode whatever the matrix says; SPDK's processes take their memory from
//! hugepages (`-g`: one file per segment list, which vfio-user shares with the
//! server), which the harness reserves while it runs and gives back after; SPDK's
//! RAM disk (a malloc bdev) lives in hugepages, so udrive's `ram` disk does too
//! here (`hugepages=on`, decision 0017).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use super::cpu::{CpuClock, Watched};
use super::env::Env;
use super::matrix::{Backend, DatapathKind, Point, Rw};
use super::process::{output_within, outputs, tail, DatapathError, Deadline, Server};
use super::target::{Measured, Target};

/// The NVMe subsystem both servers are addressed by (udrive accepts any).
const NQN: &str = "nqn.2019-07.io.spdk:cnode1";

/// How long an SPDK client may take beyond its run before it is killed: DPDK's
/// start-up takes about a second; a client whose connection failed while it set
/// up spins on forever.
pub(super) fn limit(run_secs: u64) -> Duration {
    Duration::from_secs(run_secs + 60)
}

/// Free 2 MiB pages SPDK's two processes need besides a RAM disk.
const HUGEPAGES_BASE: u64 = 512;

/// The SPDK tree `SPDK_DIR` names.
pub fn dir() -> Option<PathBuf> {
    std::env::var_os("SPDK_DIR").map(PathBuf::from)
}

/// An SPDK program by its path in the tree (`build/bin/nvmf_tgt`).
pub(super) fn bin(path: &str) -> PathBuf {
    dir().unwrap_or_default().join(path)
}

/// The programs datapath `d` runs, and the configure option that builds them.
fn programs(d: &DatapathKind) -> Vec<(&'static str, &'static str)> {
    const PERF: (&str, &str) = ("build/bin/spdk_nvme_perf", "--with-vfio-user");
    const BDEVPERF: (&str, &str) = ("build/examples/bdevperf", "--with-virtio");
    match d {
        DatapathKind::SpdkNvmf => vec![PERF, ("build/bin/nvmf_tgt", "--with-vfio-user")],
        DatapathKind::SpdkVhost => vec![BDEVPERF, ("build/bin/vhost", "--with-vhost")],
        DatapathKind::UdriveVhostSpdk => vec![BDEVPERF],
        _ => vec![PERF],
    }
}

/// Why the SPDK datapaths cannot run here.
pub fn probe(d: &DatapathKind) -> Result<(), String> {
    let Some(root) = dir() else {
        return Err("SPDK_DIR is not set (an SPDK tree built with --with-vfio-user)".into());
    };
    for (prog, option) in programs(d) {
        let p = root.join(prog);
        if !p.is_file() {
            return Err(format!("no {} (build SPDK with {option})", p.display()));
        }
    }
    if !nix::unistd::geteuid().is_root() {
        return Err("SPDK's processes need hugepages: run as root".into());
    }
    Ok(())
}

/// The backends SPDK's target serves like udrive's: nothing, and memory.
pub fn applies(b: Backend) -> Result<(), String> {
    match b {
        Backend::Null | Backend::Ram => Ok(()),
        _ => Err("the SPDK datapaths serve null and ram (SPDK's file bdevs need O_DIRECT, which tmpfs lacks)".into()),
    }
}

/// Hugepages reserved for the SPDK datapaths, given back when dropped.
pub struct Hugepages {
    before: Option<u64>,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

fn meminfo(key: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

impl Hugepages {
    /// Makes a RAM disk of `ram_mib` MiB (SPDK's malloc bdev, or udrive's
    /// `hugepages=on` one against it, never both at once) plus SPDK's own share
    /// free in 2 MiB pages.
    pub fn reserve(ram_mib: u64) -> Result<Hugepages, DatapathError> {
        let io = |source| DatapathError::Io {
            what: format!("reserving hugepages through {NR_HUGEPAGES}"),
            source,
        };
        let want = ram_mib.div_ceil(2) + HUGEPAGES_BASE;
        let free = meminfo("HugePages_Free:");
        if free >= want {
            return Ok(Hugepages { before: None });
        }
        let total = meminfo("HugePages_Total:");
        std::fs::write(NR_HUGEPAGES, (total + want - free).to_string()).map_err(io)?;
        let got = meminfo("HugePages_Free:");
        let undo = Hugepages {
            before: Some(total),
        };
        if got < want {
            return Err(DatapathError::Failed {
                what: "reserving hugepages".into(),
                status: format!("{got} of {want} 2 MiB pages free"),
                tail: "free memory, or run with fewer datapaths".into(),
            });
        }
        Ok(undo)
    }
}

impl Drop for Hugepages {
    fn drop(&mut self) {
        forget_exited();
        if let Some(n) = self.before {
            let _ = std::fs::write(NR_HUGEPAGES, n.to_string());
        }
    }
}

/// A CPU list (`1`, `0-1`, `2,3`) as an SPDK core mask (CPUs 0–63; none for a
/// list that does not parse).
pub(super) fn core_mask(list: &str) -> String {
    let cpus = engine::parse_cpu_list(list).unwrap_or_default();
    let mask = cpus
        .into_iter()
        .filter(|&c| c < 64)
        .fold(0u64, |m, c| m | 1 << c);
    format!("{mask:#x}")
}

/// The backend as SPDK's bdev `D0`: a malloc bdev (in hugepages) or a null one,
/// the sizes of udrive's `ram:` and `null:64G`.
pub(super) fn bdev_config(b: Backend, env: &Env) -> Value {
    match b {
        Backend::Ram => json!({"method": "bdev_malloc_create",
            "params": {"name": "D0", "num_blocks": env.matrix.ram_mib * 2048, "block_size": 512}}),
        _ => json!({"method": "bdev_null_create",
            "params": {"name": "D0", "num_blocks": 64u64 << 21, "block_size": 512}}),
    }
}

/// `nvmf_tgt`'s configuration: one subsystem, the backend's bdev as NSID 1, a
/// vfio-user listener in `dir`.
fn target_config(b: Backend, env: &Env, dir: &Path) -> Value {
    let bdev = bdev_config(b, env);
    json!({"subsystems": [
        {"subsystem": "bdev", "config": [bdev]},
        {"subsystem": "nvmf", "config": [
            {"method": "nvmf_create_transport", "params": {"trtype": "VFIOUSER"}},
            {"method": "nvmf_create_subsystem",
             "params": {"nqn": NQN, "allow_any_host": true, "serial_number": "SPDK1"}},
            {"method": "nvmf_subsystem_add_ns",
             "params": {"nqn": NQN, "namespace": {"bdev_name": "D0"}}},
            {"method": "nvmf_subsystem_add_listener",
             "params": {"nqn": NQN, "listen_address":
                 {"trtype": "VFIOUSER", "traddr": dir, "trsvcid": "0"}}}
        ]}
    ]})
}

/// The directory SPDK's initiator addresses a datapath's controller by (its
/// `traddr`): the controller's socket is `<traddr>/cntrl`.
fn target_dir(d: &DatapathKind, b: Backend, env: &Env) -> PathBuf {
    env.work.join(format!("{d}-{b}"))
}

/// The vhost-user-blk pair, driven by `bdevperf` (the others by `spdk_nvme_perf`).
fn is_vhost(d: &DatapathKind) -> bool {
    matches!(d, DatapathKind::SpdkVhost | DatapathKind::UdriveVhostSpdk)
}

/// The socket of datapath `d`'s controller on backend `b`: vfio-user's `cntrl`,
/// or the vhost-user-blk controller's.
pub fn socket(d: &DatapathKind, b: Backend, env: &Env) -> PathBuf {
    let name = match is_vhost(d) {
        true => super::spdk_vhost::CONTROLLER,
        false => "cntrl",
    };
    target_dir(d, b, env).join(name)
}

/// Writes an SPDK process's JSON configuration into `dir`.
pub(super) fn write_config(dir: &Path, name: &str, v: &Value) -> Result<PathBuf, DatapathError> {
    let conf = dir.join(name);
    std::fs::write(&conf, v.to_string()).map_err(|source| DatapathError::Io {
        what: format!("writing {}", conf.display()),
        source,
    })?;
    Ok(conf)
}

/// Starts the server of an SPDK datapath: `udrive` (udrive's, serving
/// [`socket`]) or else `nvmf_tgt` or `vhost`.
pub fn start<'e>(
    d: &DatapathKind,
    b: Backend,
    env: &'e Env,
    udrive: Option<Command>,
) -> Result<Box<dyn Target + 'e>, DatapathError> {
    let dir = target_dir(d, b, env);
    std::fs::create_dir_all(&dir).map_err(|source| DatapathError::Io {
        what: format!("making {}", dir.display()),
        source,
    })?;
    let sock = socket(d, b, env);
    let server = if let Some(udrive) = udrive {
        Server::start(
            udrive,
            &format!("udrive serve ({d}, {b})"),
            std::slice::from_ref(&sock),
        )?
    } else if *d == DatapathKind::SpdkVhost {
        let conf = write_config(
            &dir,
            "vhost.json",
            &super::spdk_vhost::target_config(b, env),
        )?;
        let mut c = Command::new(bin("build/bin/vhost"));
        c.args(["-m", &core_mask(&env.matrix.cpus.server), "-g", "-S"])
            .arg(&dir)
            .arg("--json")
            .arg(&conf)
            .args(["-s", &(env.matrix.ram_mib + 512).to_string()]);
        Server::start(c, &format!("SPDK vhost ({b})"), std::slice::from_ref(&sock))?
    } else {
        let conf = write_config(&dir, "nvmf.json", &target_config(b, env, &dir))?;
        let mut c = Command::new(bin("build/bin/nvmf_tgt"));
        c.args(["-m", &core_mask(&env.matrix.cpus.server), "-g", "--json"])
            .arg(&conf)
            .args(["-s", &(env.matrix.ram_mib + 512).to_string()]);
        Server::start(c, &format!("nvmf_tgt ({b})"), std::slice::from_ref(&sock))?
    };
    let client = match is_vhost(d) {
        true => Client::Bdevperf(super::spdk_vhost::client_config(&dir, &sock)?),
        false => Client::NvmePerf,
    };
    let t = SpdkTarget {
        env,
        dir,
        client,
        server: Some(server),
    };
    if b == Backend::Ram {
        t.fill()?;
    }
    Ok(Box::new(t))
}

struct SpdkTarget<'a> {
    env: &'a Env,
    dir: PathBuf,
    client: Client,
    server: Option<Server>,
}

/// Which of SPDK's programs drives the target.
enum Client {
    /// `spdk_nvme_perf` over vfio-user.
    NvmePerf,
    /// `bdevperf` over a virtio-user bdev; its configuration file.
    Bdevperf(PathBuf),
}

impl Drop for SpdkTarget<'_> {
    fn drop(&mut self) {
        drop(self.server.take());
        forget_exited();
    }
}

/// Removes the hugepage files and runtime directories DPDK leaves behind for
/// SPDK processes that have exited (`spdk_pid<PID>…`): left, they keep the pages.
pub(super) fn forget_exited() {
    let exited = |name: &str| {
        let Some(rest) = name.strip_prefix("spdk_pid") else {
            return false;
        };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        !pid.is_empty() && !Path::new("/proc").join(&pid).exists()
    };
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let huge = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"hugetlbfs")).then(|| PathBuf::from(f[1]))
        })
        .chain([PathBuf::from("/var/run/dpdk")]);
    for dir in huge {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if exited(&e.file_name().to_string_lossy()) {
                let p = e.path();
                let _ = std::fs::remove_file(&p).or_else(|_| std::fs::remove_dir_all(&p));
            }
        }
    }
}

impl SpdkTarget<'_> {
    fn perf(&self) -> Command {
        let mut c = Command::new(bin("build/bin/spdk_nvme_perf"));
        c.arg("-g").arg("-r").arg(format!(
            "trtype:VFIOUSER traddr:{} subnqn:{NQN} ns:1",
            self.dir.display()
        ));
        c.args(["-c", &core_mask(&self.env.matrix.cpus.client)]);
        c
    }

    /// Writes the RAM disk once, as `PerfTarget::fill` does for udrive's clients.
    fn fill(&self) -> Result<(), DatapathError> {
        let mib = self.env.matrix.ram_mib;
        if let Client::Bdevperf(conf) = &self.client {
            return super::spdk_vhost::fill(conf, &self.env.matrix.cpus.client, mib);
        }
        let mut c = self.perf();
        c.args(["-q", "8", "-o", "131072", "-w", "write", "-t", "60"]);
        c.args(["-d", &(mib * 8).to_string()]);
        let out = output_within(c, "spdk_nvme_perf (filling the RAM disk)", limit(60));
        forget_exited();
        parse(&String::from_utf8_lossy(&out?.stdout)).map(drop)
    }
}

impl Target for SpdkTarget<'_> {
    fn run(&mut self, p: &Point, _rep: u32) -> Result<Measured, DatapathError> {
        let m = &self.env.matrix;
        // Whole seconds only; the warm-up rounds up so that it is never shorter.
        let (secs, ramp) = ((m.time.ceil() as u64).max(1), m.ramp.ceil() as u64);
        let (mut c, program) = match &self.client {
            Client::NvmePerf => {
                let mut c = self.perf();
                c.args(["-P", &p.jobs.to_string()]);
                c.args(["-a", &ramp.to_string(), "-L"]);
                (c, "spdk_nvme_perf")
            }
            Client::Bdevperf(conf) => {
                let cpus = &m.cpus.client;
                super::spdk_vhost::warm_up(conf, cpus, p, ramp)?;
                (super::spdk_vhost::bdevperf(conf, cpus, p)?, "bdevperf")
            }
        };
        workload(&mut c, p);
        c.args(["-t", &secs.to_string()]);
        let what = format!("{program} on {}", p.slug());
        let ramp = match self.client {
            Client::NvmePerf => ramp,
            // bdevperf's warm-up was a run of its own.
            Client::Bdevperf(_) => 0,
        };
        let watched = Watched {
            server: self.server.iter().map(Server::pid).collect(),
            cluster: Vec::new(),
            detail: m.cpu,
        };
        let clock = CpuClock::start(
            watched,
            Duration::from_secs(ramp),
            Duration::from_secs(secs),
        );
        let mut deadline = None;
        let out = outputs(vec![(c, what.clone())], |pids| {
            clock.clients(pids);
            deadline = Some(Deadline::start(pids, limit(ramp + secs)));
        });
        let out = match deadline.take() {
            Some(d) => d.explain(out),
            None => out,
        };
        let out = out.and_then(|o| {
            o.into_iter().next().ok_or_else(|| DatapathError::Io {
                what: what.clone(),
                source: std::io::Error::other("no output"),
            })
        });
        let (server_cpu, cpu) = clock.stop();
        forget_exited();
        let text = String::from_utf8_lossy(&out?.stdout).into_owned();
        let parsed = match self.client {
            Client::NvmePerf => parse(&text),
            Client::Bdevperf(_) => super::spdk_vhost::parse(&text),
        };
        let v = parsed.map_err(|e| match e {
            DatapathError::Failed { status, tail, .. } => {
                DatapathError::Failed { what, status, tail }
            }
            other => other,
        })?;
        Ok(Measured {
            clients: vec![v],
            server_cpu,
            cpu,
            upgrades_ms: Vec::new(),
        })
    }
}

/// The point's workload in the options both SPDK clients take (fio's names):
/// pattern, read share of a mix, queue depth, block size.
pub(super) fn workload(c: &mut Command, p: &Point) {
    let rw = match p.rw {
        Rw::Randread => "randread",
        Rw::Randwrite => "randwrite",
        Rw::Randrw => "randrw",
    };
    c.args(["-w", rw]);
    if p.rw == Rw::Randrw {
        c.args(["-M", &p.rwmixread.to_string()]);
    }
    c.args(["-q", &p.qd.to_string(), "-o", &p.bs.to_string()]);
}

/// The first `N` numbers of the last `Total` line of an SPDK client's text (what
/// follows its colon), or why there are none.
pub(super) fn total<const N: usize>(text: &str, program: &str) -> Result<[f64; N], DatapathError> {
    let line = text
        .lines()
        .rev()
        .find_map(|l| l.trim_start().strip_prefix("Total")?.split_once(':'));
    let Some((_, v)) = line else {
        return Err(DatapathError::Failed {
            what: program.into(),
            status: "no Total line".into(),
            tail: tail(text),
        });
    };
    let nums: Vec<f64> = v
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    nums.get(..N)
        .and_then(|n| n.try_into().ok())
        .ok_or_else(|| DatapathError::Failed {
            what: program.into(),
            status: "a short Total line".into(),
            tail: tail(text),
        })
}

/// `spdk_nvme_perf`'s text as `perf --json`'s shape: the `Total` line's IOPS,
/// mean, min and max, and the percentiles of its latency summary (`-L`).
pub fn parse(text: &str) -> Result<Value, DatapathError> {
    let [iops, _mib, mean_us, min_us, max_us] = total(text, "spdk_nvme_perf")?;
    let known = [("mean", mean_us), ("min", min_us), ("max", max_us)];
    Ok(with_percentiles(text, iops, &known, "spdk_nvme_perf"))
}

/// `perf --json`'s shape from an SPDK client's IOPS, the latencies its `Total`
/// line gives (µs, by `perf`'s key) and the percentiles of its latency summary
/// (both clients print `  50.00000% :  2.950us`).
pub(super) fn with_percentiles(
    text: &str,
    iops: f64,
    known: &[(&str, f64)],
    client: &str,
) -> Value {
    let pct = |want: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == want)
                .then(|| v.trim().trim_end_matches("us").trim().parse::<f64>().ok())?
        })
    };
    let mut lat = json!({});
    for &(key, us) in known {
        lat[key] = json!(us * 1e3);
    }
    let lines = [
        ("p50", "50.00000%"),
        ("p99", "99.00000%"),
        ("p99_9", "99.90000%"),
        ("p99_99", "99.99000%"),
    ];
    for (key, line) in lines {
        if let Some(us) = pct(line) {
            lat[key] = json!(us * 1e3);
        }
    }
    json!({"iops": iops, "lat_ns": lat, "client": client})
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "\
========================================================
                                                                           Latency(us)
Device Information                                     :       IOPS      MiB/s    Average        min        max
VFIOUSER (/tmp/x) NSID 1 from core  1:  312345.67    1220.10       3.19       1.02     812.33
========================================================
Total                                                  :  312345.67    1220.10       3.19       1.02     812.33

Summary latency data for VFIOUSER (/tmp/x) NSID 1 from core 1:
=================================================================================
  1.00000% :     2.101us
 50.00000% :     2.950us
 99.00000% :     6.480us
 99.90000% :     9.120us
";

    #[test]
    fn perf_text_becomes_perf_json() {
        let v = parse(OUT).unwrap();
        assert_eq!(v["iops"], 312345.67);
        assert_eq!(v["lat_ns"]["mean"], 3190.0);
        assert_eq!(v["lat_ns"]["p50"], 2950.0);
        assert_eq!(v["lat_ns"]["p99"], 6480.0);
        assert_eq!(v["lat_ns"]["p99_9"], 9120.0);
        assert_eq!(v["lat_ns"]["min"], 1020.0);
        assert_eq!(v["lat_ns"]["max"], 812330.0);
        assert!(v["lat_ns"].get("p99_99").is_none());
    }

    #[test]
    fn text_without_a_total_is_an_error() {
        assert!(parse("EAL: cannot map hugepages\n").is_err());
        assert!(parse("Total : x y\n").is_err());
    }

    #[test]
    fn cpu_lists_become_core_masks() {
        assert_eq!(core_mask("1"), "0x2");
        assert_eq!(core_mask("0-1"), "0x3");
        assert_eq!(core_mask("0,2-3"), "0xd");
        assert_eq!(core_mask("99"), "0x0");
    }
}
