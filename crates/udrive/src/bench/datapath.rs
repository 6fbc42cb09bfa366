//! The datapaths `udrive bench` drives: which backends each can serve, whether its
//! tool is on this machine, and a started target that runs one workload and returns
//! `udrive perf`'s JSON. A real datapath is a server process started per repetition
//! (udrive itself, qemu-storage-daemon) or none (bare io_uring), and a `udrive perf`
//! process per run; the fake one computes numbers without processes.
//!
//! Adding a datapath is a `DatapathKind` variant, its line in `applies`/`probe`, and
//! a `Target`, as the SPDK ones (`spdk.rs`) and the guest's fio (`vm.rs`) are.
//!
//! A cell with N clients starts N `perf` processes at once, each with its own device
//! (one udrive with N controllers or N vhost-user-blk devices; N qemu-storage-daemon
//! processes, one export each, as one per VM is how QEMU deployments run it) and its
//! own backing, and measures the server processes' CPU time over the run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::clients;
use super::cpu;
use super::matrix::{Backend, DatapathKind, Point, Poll};
use super::process::{output, outputs, which, DatapathError, Server};
use super::variant::TraceScope;

pub use super::env::Env;

/// Why a datapath does not run a backend at all (not a property of this machine).
pub fn applies(d: &DatapathKind, b: Backend) -> Result<(), String> {
    match (d, b) {
        (DatapathKind::IoUring, b) if b != Backend::File => {
            Err("bare io_uring drives raw files only".into())
        }
        (DatapathKind::Librbd, b) if b != Backend::Rbd => {
            Err("librbd drives RBD images only".into())
        }
        (d, b) if d.is_spdk() => super::spdk::applies(b),
        (DatapathKind::Vm(v), b) => super::vm::applies(*v, b),
        (DatapathKind::QsdVhost, Backend::Ram | Backend::RamLuks) => {
            Err("qemu-storage-daemon has no RAM disk driver".into())
        }
        (DatapathKind::QsdVhost, Backend::FileLuks) => Err(QSD_LUKS2.into()),
        _ => Ok(()),
    }
}

/// Why qemu-storage-daemon does not serve `file-luks`.
const QSD_LUKS2: &str = "qemu-storage-daemon's luks driver opens LUKS1 volumes only (10.0.2: \"LUKS version 2 is not supported\"), and udrive's create=on makes LUKS2";

/// Why a datapath does not run a backend with `n` clients: the RBD image and the
/// qcow2 images are one each, shared by every datapath, not made per client; the
/// SPDK datapaths start one `spdk_nvme_perf` against one controller.
pub fn applies_clients(d: &DatapathKind, b: Backend, n: u32) -> Result<(), String> {
    match b {
        _ if n > 1 && d.is_spdk() => Err(format!(
            "{n} clients: the SPDK datapaths drive one controller with one client"
        )),
        _ if n > 1 && matches!(d, DatapathKind::Vm(_)) => {
            Err(format!("{n} clients: a VM datapath boots one guest"))
        }
        b if n > 1 && (b == Backend::Rbd || b == Backend::FileLuks || b.is_qcow2()) => Err(
            format!("{n} clients need a backing each: only null, ram, ram-luks and file are split"),
        ),
        _ => Ok(()),
    }
}

/// Why a datapath cannot run on this machine (a missing tool), checked once.
pub fn probe(d: &DatapathKind, env: &Env) -> Result<(), String> {
    match d {
        DatapathKind::QsdVhost if env.qsd.is_none() => {
            Err("qemu-storage-daemon not found in PATH".into())
        }
        DatapathKind::Fake(_) => Ok(()),
        d if d.is_spdk() => super::spdk::probe(d),
        DatapathKind::Vm(v) if v.udrive().is_some() && !env.udrive.exists() => {
            Err(format!("{} does not exist", env.udrive.display()))
        }
        DatapathKind::Vm(_) => super::vm::probe(),
        DatapathKind::Librbd if !cfg!(feature = "rbd") => {
            Err("this udrive was built without the rbd feature".into())
        }
        d if d.is_b() => match &env.udrive_b {
            Some(b) if b.exists() => Ok(()),
            Some(b) => Err(format!("{} does not exist", b.display())),
            None => Err("no second udrive binary: give --udrive-b BIN".into()),
        },
        _ if !env.udrive.exists() => Err(format!("{} does not exist", env.udrive.display())),
        _ => Ok(()),
    }
}

/// Why datapath `d` cannot serve backend `b` on this machine (a missing module).
pub fn pair_probe(d: &DatapathKind, b: Backend) -> Result<(), String> {
    let qsd_rbd = [
        "/usr/lib/x86_64-linux-gnu/qemu/block-rbd.so",
        "/usr/lib/qemu/block-rbd.so",
    ];
    match (d, b) {
        (DatapathKind::QsdVhost, Backend::Rbd)
            if !qsd_rbd.iter().any(|p| Path::new(p).exists()) =>
        {
            Err("qemu-storage-daemon has no rbd driver here: install Debian's qemu-block-extra of qemu-utils' version (apt-get install qemu-block-extra=$(dpkg-query -W -f='${Version}' qemu-utils), from bookworm-backports where qemu-utils came from there)".into())
        }
        _ => Ok(()),
    }
}

/// Why a backend cannot be served on this machine (real datapaths only).
pub fn backend_probe(b: Backend, env: &Env) -> Result<(), String> {
    match b {
        Backend::Rbd if env.matrix.rbd.conf.is_none() => Err(match env.matrix.rbd.throwaway {
            true => super::ceph::probe()
                .err()
                .unwrap_or_else(|| "the throwaway Ceph cluster did not start".into()),
            false => "no Ceph cluster: give --rbd-conf PATH (or [rbd] conf, or [rbd] \
                      throwaway = true for one the harness starts)"
                .into(),
        }),
        Backend::Rbd if which("rbd").is_none() => {
            Err("the rbd tool (Debian's ceph-common) is not in PATH".into())
        }
        b if b.is_qcow2() && which("qemu-img").is_none() => {
            Err("qemu-img (Debian's qemu-utils) is not in PATH".into())
        }
        _ => Ok(()),
    }
}

/// The `rbd:` spec options of the `rbd` backend's image, for `d`: its variant's
/// `ceph` settings are in a conf of its own ([`write_ceph_conf`]).
fn rbd_spec(d: &DatapathKind, env: &Env) -> String {
    let o = &env.matrix.rbd;
    let conf = match ceph_conf_of(d, env) {
        Some(own) => own.display().to_string(),
        None => o.conf.clone().unwrap_or_default(),
    };
    format!("{},conf={conf}", o.image())
}

/// The conf of `d`'s server when its variant has `ceph` settings.
fn ceph_conf_of(d: &DatapathKind, env: &Env) -> Option<PathBuf> {
    let v = env.matrix.variant_of(d)?;
    (!v.ceph.is_empty()).then(|| env.work.join(format!("{d}-ceph.conf")))
}

/// The cluster's conf with `d`'s variant's `ceph` settings in a `[client]` section
/// after the rest (Ceph reads the last value of a key).
fn write_ceph_conf(d: &DatapathKind, env: &Env) -> Result<(), DatapathError> {
    let (Some(own), Some(v)) = (ceph_conf_of(d, env), env.matrix.variant_of(d)) else {
        return Ok(());
    };
    let base = env.matrix.rbd.conf.clone().unwrap_or_default();
    let io = |what: String, source| DatapathError::Io { what, source };
    let mut text = std::fs::read_to_string(&base).map_err(|e| io(format!("reading {base}"), e))?;
    text.push_str("\n[client]\n");
    for line in &v.ceph {
        text.push_str(line);
        text.push('\n');
    }
    std::fs::write(&own, text).map_err(|e| io(format!("writing {}", own.display()), e))
}

pub use super::target::{Measured, Target};

/// Start datapath `d` on backend `b` for `n` clients (a fresh server: no state from
/// another run). The `vm-*` datapaths start in `vm_target::start`.
pub fn start<'e>(
    d: &DatapathKind,
    b: Backend,
    n: u32,
    env: &'e Env,
) -> Result<Box<dyn Target + 'e>, DatapathError> {
    if let DatapathKind::Fake(name) = d {
        return Ok(Box::new(super::fake::Fake {
            name: name.clone(),
            backend: b,
            clients: n,
            trace: env.matrix.trace,
            cpu: env.matrix.cpu,
        }));
    }
    super::images::make_fresh(b, env)?;
    if d.is_spdk() {
        let udrive = match d.is_udrive_for_spdk() {
            true => {
                let sock = super::spdk::socket(d, b, env);
                Some(udrive_serve(d, b, env, std::slice::from_ref(&sock))?)
            }
            false => None,
        };
        return super::spdk::start(d, b, env, udrive);
    }
    Ok(Box::new(perf_target(d, b, n, env)?))
}

/// udrive serving one client for a client other than `perf` (a guest), started as
/// the `udrive-nvme` and `udrive-vhost` datapaths start it; it ends when this is dropped.
pub(super) struct Udrive<'e>(PerfTarget<'e>);

impl<'e> Udrive<'e> {
    pub(super) fn start(d: &DatapathKind, b: Backend, env: &'e Env) -> Result<Self, DatapathError> {
        perf_target(d, b, 1, env).map(Udrive)
    }

    /// The device's socket.
    pub(super) fn socket(&self) -> &Path {
        &self.0.socks[0]
    }
}

/// A process-backed datapath's servers, with `perf` as the client.
fn perf_target<'e>(
    d: &DatapathKind,
    b: Backend,
    n: u32,
    env: &'e Env,
) -> Result<PerfTarget<'e>, DatapathError> {
    let socks: Vec<PathBuf> = (0..n)
        .map(|i| match n {
            1 => env.work.join(format!("{d}-{b}.sock")),
            _ => env.work.join(format!("{d}-{b}-c{n}-{i}.sock")),
        })
        .collect();
    let servers = match d {
        DatapathKind::Fake(_)
        | DatapathKind::Vm(_)
        | DatapathKind::IoUring
        | DatapathKind::Librbd
        | DatapathKind::SpdkNvmf
        | DatapathKind::UdriveNvmeSpdk
        | DatapathKind::SpdkVhost
        | DatapathKind::UdriveVhostSpdk => Vec::new(),
        DatapathKind::UdriveNvme(..) | DatapathKind::UdriveVhost(..) => vec![Server::start_within(
            udrive_serve(d, b, env, &socks)?,
            &format!("udrive serve ({d}, {b}, {n} clients)"),
            &socks
                .iter()
                .cloned()
                .chain(control_socket(d, b, env, n))
                .chain(
                    env.matrix
                        .variant_of(d)
                        .and_then(|v| v.neighbour.as_ref())
                        .map(|_| neighbour_socket(d, b, env, n)),
                )
                .collect::<Vec<_>>(),
            // Formatting a LUKS2 volume benchmarks and runs argon2id: 11 s here.
            if b.clear().is_some() { 120 } else { 20 },
        )?],
        DatapathKind::QsdVhost => (0..n)
            .zip(&socks)
            .map(|(i, sock)| {
                Server::start(
                    qsd_cmd(b, env, sock, &env.data_file_of(n, i)),
                    &format!("qemu-storage-daemon ({b}, client {i})"),
                    std::slice::from_ref(sock),
                )
            })
            .collect::<Result<_, _>>()?,
    };
    let cpus = clients::spread(&env.matrix.cpus.client, n);
    let t = PerfTarget {
        env,
        kind: d.clone(),
        backend: b,
        socks,
        cpus,
        servers,
    };
    if matches!(b, Backend::Ram | Backend::RamLuks)
        && matches!(
            d,
            DatapathKind::UdriveNvme(..) | DatapathKind::UdriveVhost(..)
        )
    {
        t.fill()?;
    }
    Ok(t)
}

/// The backing of client `i` of `n` as a udrive disk spec.
fn udrive_spec(d: &DatapathKind, b: Backend, env: &Env, n: u32, i: u32) -> String {
    let m = &env.matrix;
    let file = |p: &Path| {
        let direct = if m.file.direct { "on" } else { "off" };
        format!(
            "file:{},direct={direct},engine={}",
            p.display(),
            m.file.engine
        )
    };
    match b {
        Backend::Null => "null:64G".to_string(),
        // Against SPDK's malloc bdev, which lives in hugepages, so does the RAM disk.
        Backend::Ram if d.is_udrive_for_spdk() => {
            format!("ram:{}M,hugepages=on", m.ram_mib / u64::from(n))
        }
        Backend::Ram => format!("ram:{}M", m.ram_mib / u64::from(n)),
        Backend::File => file(&env.data_file_of(n, i)),
        Backend::Rbd => format!("rbd:{}", rbd_spec(d, env)),
        Backend::Qcow2 | Backend::Qcow2Chain | Backend::Qcow2New => {
            format!("qcow2:{}", env.image_of(b).display())
        }
        Backend::RamLuks | Backend::FileLuks => {
            let clear = match b {
                Backend::FileLuks => file(&env.luks_file()),
                _ => udrive_spec(d, Backend::Ram, env, n, i),
            };
            let key = env.luks_key();
            format!("{clear},encrypt=luks,key-file={},create=on", key.display())
        }
    }
}

/// `udrive serve` with one NVMe controller or vhost-user-blk device per socket, from
/// a configuration file written to the work directory.
pub(super) fn udrive_serve(
    d: &DatapathKind,
    b: Backend,
    env: &Env,
    socks: &[PathBuf],
) -> Result<Command, DatapathError> {
    if b == Backend::Rbd {
        write_ceph_conf(d, env)?;
    }
    let cfg = env.work.join(format!("{d}-{b}-c{}.toml", socks.len()));
    std::fs::write(&cfg, udrive_config(d, b, env, socks)).map_err(|source| DatapathError::Io {
        what: format!("writing {}", cfg.display()),
        source,
    })?;
    let bin = server_binary(d, env);
    // Under taskset like qemu-storage-daemon: the reactors have their CPUs from the
    // configuration, but the threads that carry doorbell messages and wake a
    // sleeping reactor would otherwise run on the client's CPU and wait there
    // behind a spinning client (2 ms p99 for the first I/O after idle).
    let mut c = server_command(b, env, bin);
    c.arg("serve").arg("--config").arg(&cfg);
    c.env("RUST_LOG", "warn").env("NO_COLOR", "1");
    for kv in env.matrix.variant_of(d).map_or(&[][..], |v| &v.serve_env) {
        if let Some((k, v)) = kv.split_once('=') {
            c.env(k, v);
        }
    }
    Ok(c)
}

/// A server's command on the server's CPUs (`taskset`), but on `rbd`: librbd's and
/// librados' threads are part of that datapath, and pinned beside a polling reactor
/// on its one CPU they starve (a 2-CPU host served reads at half bare librbd's
/// rate). udrive then pins its reactors from its configuration and runs those
/// threads on the CPUs the reactors leave, as it does by default;
/// qemu-storage-daemon leaves them to the kernel.
fn server_command(b: Backend, env: &Env, bin: &Path) -> Command {
    if b == Backend::Rbd {
        return Command::new(bin);
    }
    let mut c = Command::new("taskset");
    c.args(["-c", &env.matrix.cpus.server]).arg(bin);
    c
}

/// The udrive binary serving `d`: the second one for the `~b` datapaths.
fn server_binary<'e>(d: &DatapathKind, env: &'e Env) -> &'e Path {
    match (&env.udrive_b, d.is_b()) {
        (Some(b), true) => b,
        _ => &env.udrive,
    }
}

/// Live handovers a run of `d` has (its variant's `handovers`).
fn handovers(d: &DatapathKind, env: &Env) -> u32 {
    env.matrix.variant_of(d).map_or(0, |v| v.handovers)
}

/// The socket of the neighbour's device, when `d` is a variant with one.
fn neighbour_socket(d: &DatapathKind, b: Backend, env: &Env, n: u32) -> PathBuf {
    env.work.join(format!("{d}-{b}-c{n}-neighbour.sock"))
}

/// The control socket of udrive serving `d` on `b` to `n` clients, when its runs
/// are traced (`perf --trace --rpc` reads the server's layers through it) or hand
/// the server over (`udrive upgrade --rpc`).
fn control_socket(d: &DatapathKind, b: Backend, env: &Env, n: u32) -> Option<PathBuf> {
    let wanted = env.matrix.tracing(d).is_some() || handovers(d, env) > 0;
    (wanted && d.is_udrive()).then(|| env.work.join(format!("{d}-{b}-c{n}.rpc")))
}

/// udrive's configuration: one NVMe controller or vhost-user-blk device per socket,
/// all on the reactors of the server's CPUs.
fn udrive_config(d: &DatapathKind, b: Backend, env: &Env, socks: &[PathBuf]) -> String {
    use std::fmt::Write as _;
    let m = &env.matrix;
    let q = |s: &str| toml::Value::String(s.to_string()).to_string();
    let poll = match d {
        DatapathKind::UdriveNvme(Some(p), ..) | DatapathKind::UdriveVhost(Some(p), ..) => *p,
        // SPDK's driver writes doorbells into the mapped page, which busy poll offers.
        DatapathKind::UdriveNvmeSpdk => Poll::Busy,
        _ => m.poll,
    };
    let variant = m.variant_of(d);
    let placement = variant.and_then(|v| v.placement.as_deref());
    let with_opts =
        |spec: String, opts: &[String]| opts.iter().fold(spec, |s, o| format!("{s},{o}"));
    let n = socks.len() as u32;
    let mut t = format!("cpus = {}\n", q(&m.cpus.server));
    if let Some(rpc) = control_socket(d, b, env, n) {
        let _ = writeln!(t, "rpc = {}", q(&rpc.display().to_string()));
    }
    let disk_opts = variant.map_or(&[][..], |v| &v.disk);
    let specs = (0..n).map(|i| with_opts(udrive_spec(d, b, env, n, i), disk_opts));
    let neighbour = variant.and_then(|v| v.neighbour.as_ref()).map(|nb| {
        let spec = with_opts(udrive_spec(d, Backend::Null, env, 1, 0), &nb.disk);
        (spec, neighbour_socket(d, b, env, n))
    });
    let devices = specs.zip(socks.iter().cloned()).chain(neighbour);
    for (spec, sock) in devices {
        let spec = q(&spec);
        let sock = q(&sock.display().to_string());
        let _ = if let DatapathKind::UdriveNvme(..) | DatapathKind::UdriveNvmeSpdk = d {
            // round-robin: `serve --vfio-user`'s default placement.
            writeln!(
                t,
                "[[controller]]\nsocket = {sock}\nnamespaces = [{spec}]\n\
                 placement = {}\npoll = \"{}\"",
                q(placement.unwrap_or("round-robin")),
                poll.as_str()
            )
        } else {
            writeln!(
                t,
                "[[vhost_user_blk]]\nsocket = {sock}\ndisk = {spec}\nqueues = {}\n\
                 placement = {}\npoll = \"{}\"",
                match d {
                    DatapathKind::UdriveVhostSpdk => super::spdk_vhost::VQ_COUNT,
                    _ => m.max_jobs(),
                },
                q(placement.unwrap_or(&m.placement)),
                poll.as_str()
            )
        };
    }
    t
}

/// qemu-storage-daemon with its best settings for the backend (null-co, or the file with
/// io_uring), on the server's CPUs through taskset; `data` is this export's file.
fn qsd_cmd(b: Backend, env: &Env, sock: &Path, data: &Path) -> Command {
    let m = &env.matrix;
    let qsd = env
        .qsd
        .clone()
        .unwrap_or_else(|| "qemu-storage-daemon".into());
    let blockdev = match b {
        Backend::File => format!(
            "driver=file,node-name=d0,filename={},cache.direct={},aio=io_uring",
            data.display(),
            if m.file.direct { "on" } else { "off" }
        ),
        b if b.is_qcow2() => format!(
            "driver=qcow2,node-name=d0,file.driver=file,file.filename={},file.aio=io_uring,cache.direct={}",
            env.image_of(b).display(),
            if m.file.direct { "on" } else { "off" }
        ),
        Backend::Rbd => {
            let o = &m.rbd;
            let (pool, image) = o.pool_image();
            format!(
                "driver=rbd,node-name=d0,pool={pool},image={image},conf={},cache.direct=on",
                o.conf.as_deref().unwrap_or_default()
            )
        }
        _ => "driver=null-co,node-name=d0,size=68719476736".to_string(),
    };
    let mut c = server_command(b, env, &qsd);
    c.args(["--blockdev", &blockdev, "--export"]);
    c.arg(format!(
        "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path={},writable=on,num-queues={}",
        sock.display(),
        m.max_jobs()
    ));
    c
}

/// The thread of a run's handovers: each `udrive upgrade`'s time in ms.
type HandoverThread = std::thread::JoinHandle<Result<Vec<f64>, DatapathError>>;

struct PerfTarget<'a> {
    env: &'a Env,
    kind: DatapathKind,
    backend: Backend,
    /// One device per client.
    socks: Vec<PathBuf>,
    /// Each client's CPU list.
    cpus: Vec<String>,
    servers: Vec<Server>,
}

impl PerfTarget<'_> {
    /// Client `i`'s `perf` command, up to its workload.
    fn perf(&self, i: usize) -> Command {
        let mut c = Command::new(&self.env.udrive);
        c.arg("perf");
        let n = self.socks.len() as u32;
        match self.kind {
            DatapathKind::UdriveNvme(..) => c.arg("--vfio-user").arg(&self.socks[i]),
            DatapathKind::IoUring => {
                let direct = if self.env.matrix.file.direct {
                    "on"
                } else {
                    "off"
                };
                c.arg("--file")
                    .arg(self.env.data_file_of(n, i as u32))
                    .args(["--direct", direct]);
                c.args(["--engine", &self.env.matrix.file.engine])
            }
            DatapathKind::Librbd => c.args(["--rbd", &rbd_spec(&self.kind, self.env)]),
            _ => c.arg("--vhost-user").arg(&self.socks[i]),
        };
        if self.env.matrix.wait {
            if let DatapathKind::UdriveNvme(..) = self.kind {
                c.arg("--irq");
            }
            c.arg("--wait");
        }
        if let Some(v) = self.env.matrix.variant_of(&self.kind) {
            c.args(&v.perf);
        }
        c.args(["--cpus", &self.cpus[i], "--json"]);
        c.env("RUST_LOG", "warn").env("NO_COLOR", "1");
        c
    }

    /// The variant's neighbour's client, started with its queue filled; it stops
    /// when the returned process is dropped (after the run).
    fn load_neighbour(&self) -> Result<Option<Server>, DatapathError> {
        let m = &self.env.matrix;
        let Some(nb) = m.variant_of(&self.kind).and_then(|v| v.neighbour.as_ref()) else {
            return Ok(None);
        };
        let n = self.socks.len() as u32;
        let sock = neighbour_socket(&self.kind, self.backend, self.env, n);
        let mut c = if nb.idle_priority {
            let mut c = Command::new("chrt");
            c.args(["--idle", "0"]).arg(&self.env.udrive);
            c
        } else {
            Command::new(&self.env.udrive)
        };
        let device = match self.kind {
            DatapathKind::UdriveVhost(..) => "--vhost-user",
            _ => "--vfio-user",
        };
        // Longer than the run: stopped when it ends.
        let secs = m.ramp + m.time + 60.0;
        c.arg("perf").arg(device).arg(&sock);
        c.args(["--time", &secs.to_string(), "--cpus", &m.cpus.client]);
        c.args(&nb.perf);
        c.env("RUST_LOG", "warn").env("NO_COLOR", "1");
        let what = format!("the neighbour's client of {}", self.kind);
        let mut p = Server::spawn(c, &what, sock.with_extension("perf.log"))?;
        // Its queue full before the measured clients start.
        std::thread::sleep(Duration::from_secs(1));
        p.still_running(&what)?;
        Ok(Some(p))
    }

    /// `n` live handovers of the server (`udrive upgrade` to its own binary, under
    /// taskset on the server's CPUs like the server), evenly spaced over the run's
    /// measured time, in a thread of their own; how long each command took, in ms.
    fn start_handovers(&self, n: u32) -> Option<HandoverThread> {
        if n == 0 {
            return None;
        }
        let m = &self.env.matrix;
        let rpc = control_socket(&self.kind, self.backend, self.env, self.socks.len() as u32)?;
        let bin = server_binary(&self.kind, self.env).to_path_buf();
        let log = rpc.with_extension("upgrades.log");
        let cpus = m.cpus.server.clone();
        let (ramp, time) = (m.ramp, m.time);
        Some(std::thread::spawn(move || {
            let start = Instant::now();
            let mut took = Vec::new();
            for k in 0..n {
                // Each in the middle of its share of the measured time.
                let at = ramp + time * (f64::from(k) + 0.5) / f64::from(n);
                if let Some(wait) = Duration::from_secs_f64(at).checked_sub(start.elapsed()) {
                    std::thread::sleep(wait);
                }
                let t = Instant::now();
                let mut c = Command::new("taskset");
                c.args(["-c", &cpus]).arg(&bin).arg("upgrade");
                c.arg("--rpc").arg(&rpc).arg("--log").arg(&log);
                let what = format!("udrive upgrade {} of {n}", k + 1);
                output(c, &what).map_err(|e| {
                    // Why the new server gave up is in its log, not the command's.
                    let log = std::fs::read_to_string(&log).unwrap_or_default();
                    DatapathError::Failed {
                        what,
                        status: e.to_string(),
                        tail: super::process::tail(&log),
                    }
                })?;
                took.push(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok(took)
        }))
    }

    /// After handovers: the server process is the last successor, which the
    /// control socket names.
    fn adopt_successor(&mut self) -> Result<(), DatapathError> {
        let n = self.socks.len() as u32;
        let Some(rpc) = control_socket(&self.kind, self.backend, self.env, n) else {
            return Ok(());
        };
        let v = crate::rpc_client::call(&rpc, "get_version", json!({}), Duration::from_secs(10))
            .map_err(|e| DatapathError::Io {
                what: format!("asking {} for the server's pid", rpc.display()),
                source: std::io::Error::other(e.to_string()),
            })?;
        let pid = v
            .get("pid")
            .and_then(Value::as_u64)
            .and_then(|p| u32::try_from(p).ok());
        match (pid, self.servers.first_mut()) {
            (Some(pid), Some(s)) if pid != s.pid() => s.adopt(pid),
            _ => {}
        }
        Ok(())
    }

    /// Every client runs `args` at once; their JSON in client order. `started`
    /// learns their pids.
    fn exec_all(
        &self,
        args: &[String],
        what: &str,
        started: impl FnOnce(&[u32]),
    ) -> Result<Vec<Value>, DatapathError> {
        let n = self.socks.len();
        let cmds = (0..n)
            .map(|i| {
                let mut c = self.perf(i);
                c.args(args);
                let who = match n {
                    1 => what.to_string(),
                    _ => format!("{what}, client {i}"),
                };
                (c, who)
            })
            .collect();
        outputs(cmds, started)?
            .iter()
            .map(|o| {
                serde_json::from_slice(&o.stdout).map_err(|source| DatapathError::BadJson {
                    what: what.into(),
                    source,
                })
            })
            .collect()
    }

    /// Write each RAM disk once, so that reads copy real pages rather than untouched ones.
    fn fill(&self) -> Result<(), DatapathError> {
        let args = [
            "--rw", "write", "--bs", "131072", "--qd", "8", "--time", "1",
        ];
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let what = format!("filling {} {}", self.kind, self.backend);
        self.exec_all(&args, &what, |_| {}).map(drop)
    }
}

impl Target for PerfTarget<'_> {
    fn run(&mut self, p: &Point, _rep: u32) -> Result<Measured, DatapathError> {
        let m = &self.env.matrix;
        let mut args: Vec<String> = [
            ("--rw", p.rw.to_string()),
            ("--rwmixread", p.rwmixread.to_string()),
            ("--bs", p.bs.to_string()),
            ("--qd", p.qd.to_string()),
            ("--jobs", p.jobs.to_string()),
            ("--think-us", p.think_us.to_string()),
            ("--time", m.time.to_string()),
            ("--ramp", m.ramp.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if let Some(scope) = m.tracing(&self.kind) {
            args.push(match scope {
                TraceScope::Both => "--trace".into(),
                TraceScope::Server => "--trace-server".into(),
            });
            let n = self.socks.len() as u32;
            if let Some(rpc) = control_socket(&self.kind, self.backend, self.env, n) {
                args.extend(["--rpc".into(), rpc.display().to_string()]);
            }
        }
        let handovers = handovers(&self.kind, self.env);
        if handovers > 0 {
            args.extend(["--gaps".into(), handovers.to_string()]);
        }
        let _neighbour = self.load_neighbour()?;
        let watched = cpu::Watched {
            server: self.servers.iter().map(Server::pid).collect(),
            cluster: match (self.backend, m.cpu) {
                (_, cpu::CpuDetail::Server) => Vec::new(),
                (Backend::Rbd, _) => self.env.ceph_daemons.clone(),
                _ => Vec::new(),
            },
            detail: m.cpu,
        };
        let clock = cpu::CpuClock::start(
            watched,
            Duration::from_secs_f64(m.ramp),
            Duration::from_secs_f64(m.time),
        );
        let what = format!("perf on {} {} {}", self.kind, self.backend, p.slug());
        let upgrades = self.start_handovers(handovers);
        let clients = self.exec_all(&args, &what, |pids| clock.clients(pids));
        let upgrades_ms = match upgrades {
            Some(h) => {
                let took = h.join().unwrap_or_else(|_| {
                    Err(DatapathError::Io {
                        what: "the handovers".into(),
                        source: std::io::Error::other("their thread panicked"),
                    })
                });
                // Whatever happened, the server to stop later is the one serving now.
                self.adopt_successor()?;
                took?
            }
            None => Vec::new(),
        };
        let clients = clients?;
        // After a run: a device may apply its knob only once a client attached.
        if let Some(text) = m
            .variant_of(&self.kind)
            .and_then(|v| v.expect_log.as_deref())
        {
            for s in &self.servers {
                s.expect_log(&format!("udrive serve ({})", self.kind), text)?;
            }
        }
        // The process measured handed over and ended (a zombie until reaped).
        let (server_cpu, cpu) = clock.stop();
        let server_cpu = server_cpu.filter(|_| handovers == 0);
        Ok(Measured {
            clients,
            server_cpu,
            cpu: cpu.filter(|_| handovers == 0),
            upgrades_ms,
        })
    }
}
