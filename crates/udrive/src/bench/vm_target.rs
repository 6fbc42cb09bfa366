//! The `vm-*` datapaths' target. A guest boot costs 30–45 s under TCG, so one boot
//! runs every workload of the matrix: the first `run` of a (datapath, backend,
//! repetition) boots the guest through `scripts/vm-bench` with all the points as fio
//! jobs, and every `run` answers from those results. udrive's server is started as
//! the `udrive-nvme` and `udrive-vhost` datapaths start theirs, before the boot.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use super::datapath::{self, Env, Measured, Target};
use super::matrix::{Backend, Point, VmDevice};
use super::process::DatapathError;
use super::vm::{fio_job, parse_console, script, to_perf};

/// A guest's disk, and the server behind it (none: QEMU's own device).
pub struct VmTarget<'e> {
    env: &'e Env,
    device: VmDevice,
    backend: Backend,
    /// Keeps udrive's server up while the guest runs.
    server: Option<datapath::Udrive<'e>>,
    /// Each point's fio numbers (perf's shape) once the guest ran, or why not.
    results: Option<BTreeMap<Point, Result<Value, String>>>,
}

/// Starts udrive's server for the guest's disk (none for QEMU's own devices); the
/// guest boots on the first `run`.
pub fn start<'e>(
    device: VmDevice,
    backend: Backend,
    env: &'e Env,
) -> Result<Box<dyn Target + 'e>, DatapathError> {
    super::images::make_fresh(backend, env)?;
    let server = match device.udrive() {
        Some(d) => Some(datapath::Udrive::start(&d, backend, env)?),
        None => None,
    };
    Ok(Box::new(VmTarget {
        env,
        device,
        backend,
        server,
        results: None,
    }))
}

impl VmTarget<'_> {
    /// Boots the guest once with every point as a fio job.
    fn boot(&self, rep: u32) -> Result<BTreeMap<Point, Result<Value, String>>, DatapathError> {
        let m = &self.env.matrix;
        let points = m.points();
        let dir = self
            .env
            .work
            .join(format!("{}-{}-r{rep}", self.device.name(), self.backend));
        let io = |what: &str, source| DatapathError::Io {
            what: format!("{what} {}", dir.display()),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(|e| io("creating", e))?;
        let jobs: Vec<String> = points.iter().map(|p| fio_job(p, m.time, m.ramp)).collect();
        let jobs_file = dir.join("jobs");
        std::fs::write(&jobs_file, jobs.join("\n") + "\n").map_err(|e| io("writing jobs in", e))?;
        let (kind, path) = match (&self.server, self.device) {
            (Some(s), VmDevice::UdriveNvme) => ("vfio-user", s.socket().to_path_buf()),
            (Some(s), _) => ("vhost-user", s.socket().to_path_buf()),
            (None, VmDevice::QemuNvme) => ("qemu-nvme", self.backing()),
            (None, _) => ("qemu-virtio", self.backing()),
        };
        let per_job = m.time + m.ramp + 20.0;
        let timeout = 180 + (per_job * points.len() as f64) as u64;
        let mut c = Command::new("bash");
        c.arg(script())
            .arg("--device")
            .arg(format!("{kind}:{}", path.display()))
            .arg("--jobs")
            .arg(&jobs_file)
            .arg("--out")
            .arg(&dir)
            .args([
                "--format",
                if self.backend.is_qcow2() {
                    "qcow2"
                } else {
                    "raw"
                },
            ])
            .args(["--direct", if m.file.direct { "on" } else { "off" }])
            .args(["--queues", &m.max_jobs().to_string()])
            .args(["--cpus", &m.cpus.client])
            .args(["--timeout", &timeout.to_string()]);
        let what = format!("the guest of {} on {}", self.device.name(), self.backend);
        let out = c.output().map_err(|source| DatapathError::Spawn {
            what: what.clone(),
            cmd: format!("{c:?}"),
            source,
        })?;
        let log = [out.stdout.as_slice(), out.stderr.as_slice()].concat();
        let _ = std::fs::write(dir.join("vm-bench.log"), &log);
        if !out.status.success() {
            let log = String::from_utf8_lossy(&log);
            let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
            return Err(DatapathError::Failed {
                what,
                status: out.status.to_string(),
                tail: lines[lines.len().saturating_sub(4)..].join(" / "),
            });
        }
        let accel = std::fs::read_to_string(dir.join("accel")).unwrap_or_default();
        let console = std::fs::read_to_string(dir.join("console.log"))
            .map_err(|e| io("reading console.log in", e))?;
        let mut by_job = parse_console(&console);
        Ok(points
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let r = by_job
                    .remove(&(i + 1))
                    .unwrap_or_else(|| Err("the guest printed no result for it".into()))
                    .and_then(|fio| to_perf(&fio, p, accel.trim()));
                (*p, r)
            })
            .collect())
    }

    /// The file QEMU's own device opens.
    fn backing(&self) -> PathBuf {
        match self.backend {
            Backend::File => self.env.data_file.clone(),
            b => self.env.image_of(b),
        }
    }
}

impl Target for VmTarget<'_> {
    fn run(&mut self, p: &Point, rep: u32) -> Result<Measured, DatapathError> {
        if self.results.is_none() {
            // A boot that failed fails every point: one boot per target, not per point.
            let r = self.boot(rep).unwrap_or_else(|e| {
                let why = e.to_string();
                let points = self.env.matrix.points();
                points.into_iter().map(|p| (p, Err(why.clone()))).collect()
            });
            self.results = Some(r);
        }
        let got = self.results.as_ref().and_then(|r| r.get(p));
        match got {
            Some(Ok(v)) => Ok(Measured {
                clients: vec![v.clone()],
                // The guest's boot and every other workload ran on the server too.
                server_cpu: None,
                cpu: None,
                upgrades_ms: Vec::new(),
            }),
            Some(Err(e)) => Err(DatapathError::Failed {
                what: format!("fio in the guest, {}", p.slug()),
                status: "no result".into(),
                tail: e.clone(),
            }),
            None => Err(DatapathError::Failed {
                what: format!("fio in the guest, {}", p.slug()),
                status: "not in the guest's job list".into(),
                tail: String::new(),
            }),
        }
    }
}
