//! What a cell with several clients needs besides its processes: each client's CPUs,
//! the server's CPU time over a run, and the clients' numbers taken together.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// The kernel reports process times in USER_HZ ticks, 100 on every Linux ABI.
const TICKS_PER_S: f64 = 100.0;

/// The CPU lists of `n` clients over the CPUs of `list` (a list the matrix checked):
/// with as many CPUs as clients or more, each client has its own share of them;
/// with fewer, every client may run on all of them and the scheduler shares them.
/// Pinning them in turn instead would pin client i beside the reactor that serves
/// it whenever the server's CPUs are the clients' too (controllers are placed in
/// turn as well): each I/O would then wait a whole time slice (8 clients on 2
/// shared CPUs: 0.5 k IOPS pinned, 250 k floating).
pub fn spread(list: &str, n: u32) -> Vec<String> {
    let cpus = engine::parse_cpu_list(list).unwrap_or_default();
    let n = n as usize;
    if cpus.len() < n {
        return vec![list.to_string(); n];
    }
    (0..n)
        .map(|i| engine::format_cpu_list(&cpus[i * cpus.len() / n..(i + 1) * cpus.len() / n]))
        .collect()
}

/// CPU time the server's processes used over one run, and the run's wall time:
/// `cpu_s / wall_s` is the cores it kept busy, and that over the run's IOPS its CPU
/// per I/O (both over the measured window, as the IOPS are).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServerCpu {
    pub cpu_s: f64,
    pub wall_s: f64,
    /// The server processes' threads at the end of the run.
    #[serde(default)]
    pub threads: Option<u32>,
}

impl ServerCpu {
    /// Cores the server kept busy.
    pub fn cores(&self) -> Option<f64> {
        (self.wall_s > 0.0).then(|| self.cpu_s / self.wall_s)
    }
}

/// User and system time of a process and its threads, in seconds.
fn process_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of proc(5): utime, stime; `rest` starts at field 3.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / TICKS_PER_S)
}

/// Threads of a process.
fn process_threads(pid: u32) -> Option<u32> {
    let n = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.count();
    u32::try_from(n).ok()
}

/// A stopwatch of the server processes' CPU time over a run's measured window: from
/// the end of its warm-up to the end of its time. What clients cost while they set
/// up (connect, map memory, create queues) and tear down is not the cost of serving
/// them.
pub struct CpuClock {
    window: Option<std::thread::JoinHandle<Option<ServerCpu>>>,
}

impl CpuClock {
    /// Reads the servers' times `warmup` from now and `time` after that, in a thread
    /// of its own: the run goes on meanwhile.
    pub fn start(pids: &[u32], warmup: Duration, time: Duration) -> CpuClock {
        let window = (!pids.is_empty()).then(|| {
            let pids = pids.to_vec();
            std::thread::spawn(move || {
                std::thread::sleep(warmup);
                let before = Self::total(&pids);
                let started = Instant::now();
                std::thread::sleep(time);
                let after = Self::total(&pids)?;
                Some(ServerCpu {
                    cpu_s: after - before?,
                    wall_s: started.elapsed().as_secs_f64(),
                    threads: pids.iter().map(|&p| process_threads(p)).sum(),
                })
            })
        });
        CpuClock { window }
    }

    fn total(pids: &[u32]) -> Option<f64> {
        pids.iter().map(|&p| process_cpu_s(p)).sum()
    }

    /// None without a server, or if a server's times could not be read (it exited
    /// within the window). A run that ended early waits for the window's end.
    pub fn stop(self) -> Option<ServerCpu> {
        self.window?.join().ok()?
    }
}

/// The clients' `perf --json` taken together, in its shape: IOPS, I/Os and errors
/// added, the mean latency over every I/O (each client's weighted by its I/Os), the
/// percentiles and the maximum those of the worst client, the minimum of the best.
/// One client's is its own.
pub fn aggregate(clients: &[Value]) -> Value {
    if let [one] = clients {
        return one.clone();
    }
    let f = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64);
    let lat = |v: &Value, k: &str| {
        v.get("lat_ns")
            .and_then(|l| l.get(k))
            .and_then(Value::as_f64)
    };
    let sum = |k: &str| clients.iter().filter_map(|v| f(v, k)).sum::<f64>();
    let weight = |v: &Value| f(v, "ios").or_else(|| f(v, "iops")).unwrap_or(0.0);
    let total_w: f64 = clients.iter().map(weight).sum();
    let mean = clients
        .iter()
        .filter_map(|v| Some(lat(v, "mean")? * weight(v)))
        .sum::<f64>()
        / total_w;
    let mut l = Map::new();
    l.insert("mean".into(), json!(mean));
    let worst = |k: &str, best: bool| {
        let it = clients.iter().filter_map(|v| lat(v, k));
        if best {
            it.fold(f64::INFINITY, f64::min)
        } else {
            it.fold(f64::NEG_INFINITY, f64::max)
        }
    };
    l.insert("min".into(), json!(worst("min", true)));
    for k in ["p50", "p99", "p99_9", "p99_99", "max"] {
        l.insert(k.into(), json!(worst(k, false)));
    }
    let first = clients.first().cloned().unwrap_or(Value::Null);
    let mut o = Map::new();
    for k in ["rw", "bs", "qd", "jobs_count"] {
        if let Some(v) = first.get(k) {
            o.insert(k.into(), v.clone());
        }
    }
    o.insert("clients".into(), json!(clients.len()));
    for k in ["iops", "ios", "errors"] {
        o.insert(k.into(), json!(sum(k)));
    }
    o.insert("lat_ns".into(), Value::Object(l));
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_share_or_take_turns_on_cpus() {
        assert_eq!(spread("2-5", 2), ["2-3", "4-5"]);
        assert_eq!(spread("2-4", 2), ["2", "3-4"]);
        assert_eq!(spread("1", 3), ["1", "1", "1"]);
        assert_eq!(spread("0,1", 3), ["0,1", "0,1", "0,1"]);
    }

    #[test]
    fn clients_add_up() {
        let c = |iops: f64, ios: f64, mean: f64, p99: f64| {
            json!({"iops": iops, "ios": ios, "errors": 0,
                "lat_ns": {"mean": mean, "min": mean / 2.0, "p50": mean, "p99": p99,
                "p99_9": p99, "p99_99": p99, "max": p99}})
        };
        let one = c(10.0, 10.0, 5.0, 9.0);
        assert_eq!(aggregate(std::slice::from_ref(&one)), one);
        let a = aggregate(&[c(100.0, 300.0, 10.0, 20.0), c(50.0, 100.0, 30.0, 90.0)]);
        assert_eq!(a["iops"], 150.0);
        assert_eq!(a["clients"], 2);
        // (300 × 10 + 100 × 30) / 400
        assert_eq!(a["lat_ns"]["mean"], 15.0);
        assert_eq!(a["lat_ns"]["p99"], 90.0);
        assert_eq!(a["lat_ns"]["min"], 5.0);
    }

    #[test]
    fn a_process_has_cpu_time() {
        let ms = Duration::from_millis;
        let c = CpuClock::start(&[std::process::id()], ms(1), ms(20));
        let t = Instant::now();
        while t.elapsed().as_millis() < 30 {
            std::hint::black_box(t.elapsed());
        }
        let s = c.stop().expect("own /proc/PID/stat");
        assert!(s.cpu_s >= 0.0 && s.wall_s >= 0.02);
        assert!(
            s.threads.is_some_and(|n| n >= 2),
            "this thread and the clock's"
        );
        assert!(CpuClock::start(&[], ms(0), ms(0)).stop().is_none());
    }
}
