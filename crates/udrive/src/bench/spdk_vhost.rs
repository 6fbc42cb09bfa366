//! SPDK's vhost-user-blk pair: SPDK's `vhost` target serving the backend's bdev as
//! one vhost-user-blk controller (`spdk-vhost`), and `bdevperf` over SPDK's
//! virtio-user initiator as the client of that target and of udrive's device
//! (`udrive-vhost-spdk`). libblkio 1.x refuses SPDK's target ("Backend doesn't
//! support required protocol features"), so `udrive perf` cannot be the common
//! client here as it is for qemu-storage-daemon.
//!
//! bdevperf has no warm-up option: a run of its own, `ramp` seconds long, warms
//! the target first, and its numbers are dropped. A cell runs one job: one
//! bdevperf core on one queue.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use super::env::Env;
use super::matrix::{Backend, Point};
use super::process::{output_within, tail, DatapathError};
use super::spdk::{
    bdev_config, bin, core_mask, forget_exited, limit, total, with_percentiles, workload,
};

/// The vhost-user-blk controller's name: its socket's file name.
pub const CONTROLLER: &str = "vhost.0";

/// Virtqueues bdevperf asks for; its one job uses one. With one, SPDK's
/// initiator fails against SPDK's target every second connection or so ("no more
/// unused virtio queues"); with two it does not. udrive's device gets two too, so
/// both servers poll the same rings.
pub const VQ_COUNT: u32 = 2;

/// Descriptors per virtqueue: udrive's default queue size (the device offers no
/// more unless configured to), as SPDK's target's. A request takes three
/// descriptors (header, data, status), so this carries QD 85 without indirect ones.
const VQ_SIZE: u32 = 256;

/// The block size of a fill's writes, and how many it keeps in flight.
const FILL_BS: u64 = 128 << 10;
const FILL_QD: u32 = 8;

/// SPDK `vhost`'s configuration: the backend's bdev behind one vhost-user-blk
/// controller (its socket is `-S DIR`/[`CONTROLLER`]).
pub fn target_config(b: Backend, env: &Env) -> Value {
    json!({"subsystems": [
        {"subsystem": "bdev", "config": [bdev_config(b, env)]},
        {"subsystem": "vhost_blk", "config": [
            {"method": "vhost_create_blk_controller",
             "params": {"ctrlr": CONTROLLER, "dev_name": "D0"}}
        ]}
    ]})
}

/// Writes `bdevperf`'s configuration into `dir`: one virtio-user blk bdev on the
/// controller at `sock`.
pub fn client_config(dir: &Path, sock: &Path) -> Result<PathBuf, DatapathError> {
    let v = json!({"subsystems": [
        {"subsystem": "bdev", "config": [
            {"method": "bdev_virtio_attach_controller",
             "params": {"name": "V0", "trtype": "user", "traddr": sock,
                        "dev_type": "blk", "vq_count": VQ_COUNT, "vq_size": VQ_SIZE}}
        ]}
    ]});
    super::spdk::write_config(dir, "bdevperf.json", &v)
}

/// `bdevperf` on the client's CPUs with its latency summary (`-l`); the caller
/// adds the workload and the time.
pub fn bdevperf(conf: &Path, cpus: &str, p: &Point) -> Result<Command, DatapathError> {
    if p.jobs > 1 {
        return Err(DatapathError::Failed {
            what: format!("bdevperf on {}", p.slug()),
            status: format!("{} jobs", p.jobs),
            tail: "bdevperf drives the vhost pair from one core: jobs = 1".into(),
        });
    }
    Ok(base(conf, cpus))
}

/// Hugepage memory bdevperf takes up front (`-s`, MiB): virtio-user refuses a
/// memory map that changes once the device is up.
const CLIENT_MIB: u32 = 256;

fn base(conf: &Path, cpus: &str) -> Command {
    let mut c = Command::new(bin("build/examples/bdevperf"));
    c.args([
        "-m",
        &core_mask(cpus),
        "-g",
        "-s",
        &CLIENT_MIB.to_string(),
        "--json",
    ])
    .arg(conf)
    .arg("-l");
    c
}

/// A run of `ramp` seconds of the point's workload whose numbers are dropped
/// (none when `ramp` is 0).
pub fn warm_up(conf: &Path, cpus: &str, p: &Point, ramp: u64) -> Result<(), DatapathError> {
    if ramp == 0 {
        return Ok(());
    }
    let mut c = bdevperf(conf, cpus, p)?;
    workload(&mut c, p);
    c.args(["-t", &ramp.to_string()]);
    let what = format!("bdevperf warming up for {}", p.slug());
    let out = output_within(c, &what, limit(ramp));
    forget_exited();
    parse(&String::from_utf8_lossy(&out?.stdout)).map(drop)
}

/// Writes the whole RAM disk of `mib` MiB once, sequentially, and checks that the
/// run wrote at least that much (bdevperf runs for a time, not a size).
pub fn fill(conf: &Path, cpus: &str, mib: u64) -> Result<(), DatapathError> {
    // 64 MiB/s is far below any of these datapaths: the check below, not this
    // guess, is what says the disk was covered.
    let secs = (mib / 64).max(2);
    let mut c = base(conf, cpus);
    c.args(["-w", "write", "-q", &FILL_QD.to_string()]);
    c.args(["-o", &FILL_BS.to_string(), "-t", &secs.to_string()]);
    let what = "bdevperf (filling the RAM disk)";
    let out = output_within(c, what, limit(secs));
    forget_exited();
    let v = parse(&String::from_utf8_lossy(&out?.stdout))?;
    let written_mib = v["iops"].as_f64().unwrap_or(0.0) * secs as f64 * FILL_BS as f64 / 1048576.0;
    match written_mib >= mib as f64 {
        true => Ok(()),
        false => Err(DatapathError::Failed {
            what: what.into(),
            status: format!("{written_mib:.0} of {mib} MiB written in {secs} s"),
            tail: "the disk was not covered: a smaller ram_mib, or a quieter machine".into(),
        }),
    }
}

/// `bdevperf`'s text as `perf --json`'s shape. Its `Total` line holds IOPS, MiB/s,
/// failed and timed-out I/Os per second, then the mean, min and max latency (µs);
/// its latency summary (`-l`) the percentiles. A run with failed I/Os is an error,
/// not a number.
pub fn parse(text: &str) -> Result<Value, DatapathError> {
    let [iops, _mib, failed, timed_out, mean_us, min_us, max_us] = total(text, "bdevperf")?;
    if failed > 0.0 || timed_out > 0.0 {
        return Err(DatapathError::Failed {
            what: "bdevperf".into(),
            status: format!("{failed} failed and {timed_out} timed-out I/Os per second"),
            tail: tail(text),
        });
    }
    let known = [("mean", mean_us), ("min", min_us), ("max", max_us)];
    Ok(with_percentiles(text, iops, &known, "bdevperf"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "\
Running I/O for 3 seconds...

                                                                                                           Latency(us)
\r Device Information          : runtime(s)       IOPS      MiB/s     Fail/s     TO/s    Average        min        max
\r Job: V0 (Core Mask 0x2, workload: randread, depth: 1, IO size: 4096)
\t V0                          :       3.00  201234.50     786.07       0.00     0.00       4.85       3.10     120.40
\r ===================================================================================================================
\r Total                       :             201234.50     786.07       0.00     0.00       4.85       3.10     120.40

 Latency summary
\r =============================================
\r Job: V0 (Core Mask 0x2)
  1.00000% :     3.512us
 50.00000% :     4.712us
 99.00000% :     7.901us
 99.99000% :    30.250us
";

    #[test]
    fn bdevperf_text_becomes_perf_json() {
        let v = parse(OUT).unwrap();
        assert_eq!(v["iops"], 201234.5);
        assert_eq!(v["lat_ns"]["mean"], 4850.0);
        assert_eq!(v["lat_ns"]["p50"], 4712.0);
        assert_eq!(v["lat_ns"]["p99"], 7901.0);
        assert_eq!(v["lat_ns"]["p99_99"], 30250.0);
        assert_eq!(v["lat_ns"]["min"], 3100.0);
        assert_eq!(v["lat_ns"]["max"], 120400.0);
        assert_eq!(v["client"], "bdevperf");
    }

    #[test]
    fn failed_ios_or_no_total_are_errors() {
        let failed = OUT.replace("786.07       0.00", "786.07      12.00");
        assert!(parse(&failed).is_err());
        assert!(parse("bdev_virtio_user: connect failed\n").is_err());
        assert!(parse("\r Total : 5.0 1.0\n").is_err());
    }
}
