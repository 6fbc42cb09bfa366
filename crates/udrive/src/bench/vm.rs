//! The `vm-*` datapaths: fio inside a Linux guest under QEMU, on udrive's NVMe
//! controller (vfio-user), udrive's vhost-user-blk device, or QEMU's own emulated
//! NVMe and virtio-blk on the same backing file (the in-VMM peers). This file says
//! whether they can run and turns the guest's fio output into `perf`'s shape; the
//! target that boots the guest is `vm_target.rs`.
//!
//! The guest's kernel, busybox, fio and QEMU come from the chroot the VM tests
//! build (`scripts/vm-test`); the harness never builds it. Without KVM (a kernel that
//! does not boot on /dev/kvm) QEMU emulates the vCPUs (TCG): such a run's JSON
//! carries `not_meaningful`, and the summary shows it, as its numbers are the
//! emulator's speed, not the datapath's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::matrix::{Backend, Point, Rw, VmDevice};

/// Where the VM tests keep their chroots and the guest kernel.
pub fn cache() -> PathBuf {
    std::env::var_os("UDRIVE_VM_CACHE").map_or_else(|| "/var/cache/udrive-vm".into(), PathBuf::from)
}

/// The host side of a boot: `UDRIVE_VM_BENCH`, else this source tree's script.
pub(super) fn script() -> PathBuf {
    std::env::var_os("UDRIVE_VM_BENCH").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vm-bench"),
        PathBuf::from,
    )
}

/// Why the VM datapaths cannot run here.
pub fn probe() -> Result<(), String> {
    if std::env::var("UDRIVE_VM_TESTS").as_deref() == Ok("0") {
        return Err("UDRIVE_VM_TESTS=0".into());
    }
    if !nix::unistd::geteuid().is_root() {
        return Err("a guest needs root (chroot, mounts): run as root".into());
    }
    let sid = cache().join("sid");
    if !sid.join(".udrive-vm-ready").is_file() {
        return Err(format!(
            "no guest chroot in {}: run scripts/vm-test once to build the guest chroot",
            sid.display()
        ));
    }
    let s = script();
    if !s.is_file() {
        return Err(format!(
            "no {} (set UDRIVE_VM_BENCH to scripts/vm-bench of a udrive tree)",
            s.display()
        ));
    }
    Ok(())
}

/// QEMU's own devices open the file or the qcow2 image; chains and RBD are udrive's.
pub fn applies(v: VmDevice, b: Backend) -> Result<(), String> {
    match (v.udrive(), b) {
        (None, Backend::File | Backend::Qcow2) => Ok(()),
        (None, _) => {
            Err("QEMU's own devices run on the file-like backends only (file, qcow2)".into())
        }
        (Some(_), _) => Ok(()),
    }
}

/// fio's options for one point (the guest adds the disk, engine and reporting).
pub fn fio_job(p: &Point, time: f64, ramp: f64) -> String {
    let ms = |s: f64| (s * 1000.0).round() as u64;
    let mut j = format!(
        "--rw={} --bs={} --iodepth={} --numjobs={} --runtime={}ms --ramp_time={}ms",
        p.rw,
        p.bs,
        p.qd,
        p.jobs,
        ms(time),
        ms(ramp)
    );
    if p.rw == Rw::Randrw {
        j.push_str(&format!(" --rwmixread={}", p.rwmixread));
    }
    if p.think_us > 0 {
        j.push_str(&format!(" --thinktime={}", p.think_us));
    }
    j
}

/// Each job's fio JSON (by job number, from 1) between the guest's marker lines, or
/// what fio said when it failed.
pub fn parse_console(console: &str) -> BTreeMap<usize, Result<Value, String>> {
    let mut out = BTreeMap::new();
    let mut cur: Option<(usize, String)> = None;
    let num = |l: &str| -> Option<usize> { l.split_once("n=")?.1.split(' ').next()?.parse().ok() };
    for line in console.lines() {
        if let Some(rest) = line.strip_prefix("UDRIVE-FIO-BEGIN ") {
            cur = num(rest).map(|n| (n, String::new()));
        } else if let Some(rest) = line.strip_prefix("UDRIVE-FIO-END ") {
            let Some((n, text)) = cur.take() else {
                continue;
            };
            let ok = rest.ends_with("rc=0");
            let r = match ok {
                true => serde_json::from_str(&text).map_err(|e| format!("fio's JSON: {e}")),
                false => Err(format!("fio failed ({rest}): {}", text.trim())),
            };
            out.insert(n, r);
        } else if let Some((_, text)) = cur.as_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    out
}

/// fio's JSON of one job (group_reporting) in the shape of `perf --json`: IOPS, I/Os
/// and errors of reads and writes added, the mean weighted by their I/Os, the
/// percentiles the worse of the two (of completion plus submission: fio's
/// `lat_percentiles`), in ns. The whole of fio's job is kept under `fio`.
pub fn to_perf(fio: &Value, p: &Point, accel: &str) -> Result<Value, String> {
    let job = fio
        .get("jobs")
        .and_then(|j| j.get(0))
        .ok_or("fio's JSON has no job")?;
    let dirs: Vec<&Value> = ["read", "write"]
        .iter()
        .filter_map(|k| job.get(*k))
        .filter(|d| d.get("total_ios").and_then(Value::as_u64).unwrap_or(0) > 0)
        .collect();
    if dirs.is_empty() {
        return Err("fio completed no I/O".into());
    }
    let f = |d: &Value, k: &str| d.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let lat = |d: &Value, k: &str| {
        d.get("lat_ns")
            .and_then(|l| l.get(k))
            .and_then(Value::as_f64)
    };
    let pct = |d: &Value, k: &str| {
        d.get("lat_ns")
            .and_then(|l| l.get("percentile"))
            .and_then(|l| l.get(k))
            .and_then(Value::as_f64)
    };
    let ios: f64 = dirs.iter().map(|d| f(d, "total_ios")).sum();
    let mean = dirs
        .iter()
        .map(|d| lat(d, "mean").unwrap_or(0.0) * f(d, "total_ios"))
        .sum::<f64>()
        / ios;
    let worst = |g: &dyn Fn(&Value) -> Option<f64>| {
        dirs.iter().filter_map(|d| g(d)).fold(f64::NAN, f64::max)
    };
    let best = dirs
        .iter()
        .filter_map(|d| lat(d, "min"))
        .fold(f64::NAN, f64::min);
    let mut v = json!({
        "rw": p.rw.to_string(), "bs": p.bs, "qd": p.qd, "jobs_count": p.jobs,
        "iops": dirs.iter().map(|d| f(d, "iops")).sum::<f64>(),
        "ios": ios,
        "errors": job.get("error").and_then(Value::as_u64).unwrap_or(0),
        "lat_ns": {
            "mean": mean, "min": best,
            "p50": worst(&|d| pct(d, "50.000000")),
            "p99": worst(&|d| pct(d, "99.000000")),
            "p99_9": worst(&|d| pct(d, "99.900000")),
            "p99_99": worst(&|d| pct(d, "99.990000")),
            "max": worst(&|d| lat(d, "max")),
        },
        "accel": accel,
        "fio": job,
    });
    if accel != "kvm" {
        let accel = match accel {
            "" => "an unknown accelerator".to_string(),
            a => a.to_uppercase(),
        };
        v["not_meaningful"] = json!(format!(
            "QEMU ran under {accel} (no usable KVM): emulated vCPUs, a functional check, not a measurement"
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(rw: Rw) -> Point {
        Point {
            rw,
            rwmixread: 70,
            bs: 4096,
            qd: 32,
            jobs: 2,
            think_us: 0,
        }
    }

    #[test]
    fn qemus_own_devices_take_file_like_backends_only() {
        assert!(applies(VmDevice::QemuNvme, Backend::Null).is_err());
        assert!(applies(VmDevice::QemuVirtio, Backend::Ram).is_err());
        assert!(applies(VmDevice::QemuVirtio, Backend::Qcow2).is_ok());
        assert!(applies(VmDevice::QemuNvme, Backend::File).is_ok());
        assert!(applies(VmDevice::UdriveNvme, Backend::Null).is_ok());
    }

    #[test]
    fn a_point_is_a_fio_job() {
        assert_eq!(
            fio_job(&point(Rw::Randrw), 1.0, 0.5),
            "--rw=randrw --bs=4096 --iodepth=32 --numjobs=2 --runtime=1000ms --ramp_time=500ms --rwmixread=70"
        );
    }

    #[test]
    fn the_console_gives_each_jobs_numbers() {
        let dir = |iops: f64, ios: u64, mean: f64| {
            json!({"iops": iops, "total_ios": ios, "lat_ns": {"min": 10.0, "max": 900.0, "mean": mean,
                "percentile": {"50.000000": 100, "99.000000": 500, "99.900000": 600, "99.990000": 700}}})
        };
        let fio = json!({"jobs": [{"error": 0, "read": dir(300.0, 600, 100.0), "write": dir(100.0, 200, 300.0)}]});
        let console = format!(
            "UDRIVE-BENCH-BOOT dev=/dev/vda\nUDRIVE-FIO-BEGIN n=1 engine=io_uring\n{}\nUDRIVE-FIO-END n=1 rc=0\n\
             UDRIVE-FIO-BEGIN n=2 engine=io_uring\nfio: bad\nUDRIVE-FIO-END n=2 rc=1\nUDRIVE-BENCH-DONE jobs=2\n",
            serde_json::to_string_pretty(&fio).unwrap()
        );
        let mut jobs = parse_console(&console);
        assert!(jobs.remove(&2).unwrap().unwrap_err().contains("fio: bad"));
        let v = to_perf(
            &jobs.remove(&1).unwrap().unwrap(),
            &point(Rw::Randrw),
            "tcg",
        )
        .unwrap();
        assert_eq!(v["iops"], 400.0);
        assert_eq!(v["ios"], 800.0);
        // (600 × 100 + 200 × 300) / 800
        assert_eq!(v["lat_ns"]["mean"], 150.0);
        assert_eq!(v["lat_ns"]["p99"], 500.0);
        assert!(v["not_meaningful"].as_str().unwrap().contains("TCG"));
        let kvm = to_perf(&fio, &point(Rw::Randrw), "kvm").unwrap();
        assert!(kvm.get("not_meaningful").is_none());
    }
}
