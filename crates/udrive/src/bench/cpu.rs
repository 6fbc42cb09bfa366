//! The CPU time of a run's processes over its measured window: the server's always;
//! with the matrix's `cpu = "roles"` also the clients' and the cluster's (the Ceph
//! daemons on this host), and with `cpu = "threads"` each of their threads, by name.
//! Where a datapath's CPU goes, not only its server's share, decides what a host
//! can pack: a server that saves a microsecond by making librbd's threads work
//! harder has saved nothing.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The kernel reports process times in USER_HZ ticks, 100 on every Linux ABI.
const TICKS_PER_S: f64 = 100.0;

/// How much of a run's CPU the harness accounts (the matrix's `cpu`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpuDetail {
    /// The server's processes (every matrix's main table).
    #[default]
    Server,
    /// Also the clients' and the cluster's: a "CPU per I/O" table.
    Roles,
    /// Also each of their threads by name: a "CPU per I/O by thread" table.
    Threads,
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

/// The CPU seconds of each role's processes over a run's measured window
/// (`cpu = "roles"` or `"threads"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuShare {
    pub wall_s: f64,
    /// `server`, `client`, `cluster`: a role is missing where it has no process
    /// (bare librbd has no server) or one exited within the window.
    pub roles: BTreeMap<String, f64>,
    /// `role:thread-name`, digits folded to `#` (`cluster:msgr-worker-#`): the
    /// seconds of every thread of that name. Only with `cpu = "threads"`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub threads: BTreeMap<String, f64>,
}

/// The roles whose processes a clock reads, besides the clients it learns of later.
pub struct Watched {
    pub server: Vec<u32>,
    /// Processes the datapath depends on that are neither server nor client (the
    /// Ceph daemons of an `rbd` run).
    pub cluster: Vec<u32>,
    pub detail: CpuDetail,
}

/// What a clock read at one edge of the window.
#[derive(Default)]
struct Snapshot {
    /// (role, pid) → seconds of the whole process (its exited threads too).
    procs: BTreeMap<(&'static str, u32), f64>,
    /// (role, tid) → (`role:name`, seconds).
    threads: BTreeMap<(&'static str, u32), (String, f64)>,
}

/// A stopwatch of the processes' CPU time over a run's measured window: from the end
/// of its warm-up to the end of its time. What clients cost while they set up
/// (connect, map memory, create queues) and tear down is not the cost of serving
/// them.
pub struct CpuClock {
    clients: Arc<Mutex<Vec<u32>>>,
    window: Option<std::thread::JoinHandle<(Option<ServerCpu>, Option<CpuShare>)>>,
}

impl CpuClock {
    /// Reads the processes' times `warmup` from now and `time` after that, in a
    /// thread of its own: the run goes on meanwhile.
    pub fn start(w: Watched, warmup: Duration, time: Duration) -> CpuClock {
        let clients = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::clone(&clients);
        let idle = w.server.is_empty() && w.detail == CpuDetail::Server;
        let window = (!idle).then(|| {
            std::thread::spawn(move || {
                std::thread::sleep(warmup);
                let clients = wait_for_clients(&shared, w.detail);
                let started = Instant::now();
                let before = snapshot(&w, &clients);
                // The window's end counts from its start, not from the end of a
                // snapshot that may take long on a busy host.
                let end = started + window(time);
                std::thread::sleep(end.saturating_duration_since(Instant::now()));
                let ended = Instant::now();
                let after = snapshot(&w, &clients);
                let wall_s = ended.duration_since(started).as_secs_f64();
                let server = server_cpu(&w.server, &before, &after, wall_s);
                let share = (w.detail != CpuDetail::Server).then(|| share(&before, &after, wall_s));
                (server, share)
            })
        });
        CpuClock { clients, window }
    }

    /// The clients' processes, once they run.
    pub fn clients(&self, pids: &[u32]) {
        if let Ok(mut c) = self.clients.lock() {
            c.extend_from_slice(pids);
        }
    }

    /// The server's CPU (none without a server, or if its times could not be read:
    /// it exited within the window) and, when the matrix asks, every role's. A run
    /// that ended early waits for the window's end.
    pub fn stop(self) -> (Option<ServerCpu>, Option<CpuShare>) {
        self.window
            .and_then(|w| w.join().ok())
            .unwrap_or((None, None))
    }
}

/// The part of a run's measured `time` the clock reads. The clients measure the same
/// time but from their own start, and they exit right after it: a client gone before
/// the last reading has no total. Leaving out the window's last fifth (at most a
/// second) gives the reading that slack on a host busy with other work; CPU per I/O
/// is a rate, so a window inside the measured one gives the same rate.
fn window(time: Duration) -> Duration {
    time.saturating_sub((time / 5).min(Duration::from_secs(1)))
}

/// The clients' pids once they run: they start right after the clock, but with no
/// warm-up the window would open before them and miss their role.
fn wait_for_clients(shared: &Mutex<Vec<u32>>, detail: CpuDetail) -> Vec<u32> {
    let give_up = Instant::now() + Duration::from_secs(1);
    loop {
        let clients = shared.lock().map(|c| c.clone()).unwrap_or_default();
        if !clients.is_empty() || detail == CpuDetail::Server || Instant::now() > give_up {
            return clients;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn snapshot(w: &Watched, clients: &[u32]) -> Snapshot {
    let mut s = Snapshot::default();
    let (clients, cluster): (&[u32], &[u32]) = match w.detail {
        CpuDetail::Server => (&[], &[]),
        _ => (clients, &w.cluster),
    };
    // Clients first: they are the ones that exit soon after the window.
    let roles = (clients.iter().map(|&p| ("client", p)))
        .chain(w.server.iter().map(|&p| ("server", p)))
        .chain(cluster.iter().map(|&p| ("cluster", p)));
    for (role, pid) in roles {
        if let Some(t) = process_cpu_s(pid) {
            s.procs.insert((role, pid), t);
        }
        if w.detail == CpuDetail::Threads {
            read_threads(role, pid, &mut s.threads);
        }
    }
    s
}

/// Every thread of `pid` as `role:name` with its seconds.
fn read_threads(
    role: &'static str,
    pid: u32,
    into: &mut BTreeMap<(&'static str, u32), (String, f64)>,
) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let dir = t.path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if let Some(secs) = thread_cpu_s(&dir) {
            into.insert(
                (role, tid),
                (format!("{role}:{}", fold_digits(name.trim())), secs),
            );
        }
    }
}

/// `msgr-worker-2` → `msgr-worker-#`: threads of one pool add up.
fn fold_digits(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if !c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('#') {
            out.push('#');
        }
    }
    out
}

fn server_cpu(pids: &[u32], before: &Snapshot, after: &Snapshot, wall_s: f64) -> Option<ServerCpu> {
    if pids.is_empty() {
        return None;
    }
    let total = |s: &Snapshot| -> Option<f64> {
        pids.iter()
            .map(|&p| s.procs.get(&("server", p)).copied())
            .sum()
    };
    Some(ServerCpu {
        cpu_s: total(after)? - total(before)?,
        wall_s,
        threads: pids.iter().map(|&p| process_threads(p)).sum(),
    })
}

fn share(before: &Snapshot, after: &Snapshot, wall_s: f64) -> CpuShare {
    let mut roles: BTreeMap<String, f64> = BTreeMap::new();
    let mut lost: Vec<&str> = Vec::new();
    for key @ (role, _) in before.procs.keys() {
        match after.procs.get(key) {
            Some(a) => *roles.entry(role.to_string()).or_default() += a - before.procs[key],
            None => lost.push(role),
        }
    }
    // A role with a process that exited within the window has no true total.
    roles.retain(|r, _| !lost.contains(&r.as_str()));
    let mut threads: BTreeMap<String, f64> = BTreeMap::new();
    for (key, (name, secs)) in &after.threads {
        // A thread that started within the window counts from zero.
        let was = before.threads.get(key).map_or(0.0, |(_, s)| *s);
        *threads.entry(name.clone()).or_default() += secs - was;
    }
    CpuShare {
        wall_s,
        roles,
        threads,
    }
}

/// The CPU time of a whole process (its exited threads too), in seconds. Its CPU clock
/// counts nanoseconds, `/proc/PID/stat` 10 ms ticks: a client that a busy host
/// lets run for a few milliseconds of a short window has a time, not zero.
fn process_cpu_s(pid: u32) -> Option<f64> {
    // The clock of pid 0 is the caller's own.
    let pid = i32::try_from(pid).ok().filter(|&p| p > 0)?;
    let clock = nix::time::clock_getcpuclockid(nix::unistd::Pid::from_raw(pid)).ok();
    match clock.and_then(|c| nix::time::clock_gettime(c).ok()) {
        Some(t) => Some(t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9),
        None => stat_cpu_s(&format!("/proc/{pid}/stat")),
    }
}

/// A thread's CPU time in seconds: the nanoseconds that lead its `schedstat`, or
/// the ticks of its `stat` where the kernel keeps no schedstat.
fn thread_cpu_s(dir: &std::path::Path) -> Option<f64> {
    let ns = std::fs::read_to_string(dir.join("schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
    match ns {
        Some(ns) => Some(ns as f64 * 1e-9),
        None => stat_cpu_s(&dir.join("stat").to_string_lossy()),
    }
}

/// User and system time of a process or thread (`/proc/.../stat`), in seconds.
fn stat_cpu_s(path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn busy(ms: u128) {
        let t = Instant::now();
        while t.elapsed().as_millis() < ms {
            std::hint::black_box(t.elapsed());
        }
    }

    #[test]
    fn a_process_has_cpu_time() {
        let ms = Duration::from_millis;
        let me = std::process::id();
        let w = Watched {
            server: vec![me],
            cluster: Vec::new(),
            detail: CpuDetail::Server,
        };
        let c = CpuClock::start(w, ms(1), ms(20));
        busy(30);
        let (s, share) = c.stop();
        let s = s.expect("own /proc/PID/stat");
        assert!(s.cpu_s >= 0.0 && s.wall_s >= window(ms(20)).as_secs_f64());
        assert!(
            s.threads.is_some_and(|n| n >= 2),
            "this thread and the clock's"
        );
        assert!(share.is_none(), "the server's CPU only");
        let none = Watched {
            server: Vec::new(),
            cluster: Vec::new(),
            detail: CpuDetail::Server,
        };
        assert_eq!(CpuClock::start(none, ms(0), ms(0)).stop(), (None, None));
    }

    #[test]
    fn roles_and_threads_are_read_by_name() {
        let ms = Duration::from_millis;
        let me = std::process::id();
        let w = Watched {
            server: Vec::new(),
            cluster: vec![me],
            detail: CpuDetail::Threads,
        };
        let c = CpuClock::start(w, ms(1), ms(30));
        c.clients(&[me]);
        let spinner = std::thread::Builder::new()
            .name("spin-7".into())
            .spawn(|| busy(60))
            .expect("a thread");
        busy(40);
        let _ = spinner.join();
        let (server, share) = c.stop();
        assert!(server.is_none(), "no server watched");
        let share = share.expect("roles asked for");
        assert!(share.roles.contains_key("cluster"), "{share:?}");
        assert!(
            share.threads.keys().any(|k| k == "cluster:spin-#"),
            "digits folded: {share:?}"
        );
        // A process that is not running (pid 0 is never a process's) drops its role.
        let w = Watched {
            server: Vec::new(),
            cluster: vec![0],
            detail: CpuDetail::Roles,
        };
        let (_, share) = CpuClock::start(w, ms(0), ms(1)).stop();
        assert!(share.expect("asked for").roles.is_empty());
    }

    #[test]
    fn times_are_finer_than_ticks() {
        // Longer than a scheduler tick, which is when a running thread's
        // schedstat is brought up to date.
        busy(30);
        let me = std::process::id();
        // The thread first: its time then is at most the process's after.
        let thread = thread_cpu_s(std::path::Path::new("/proc/thread-self"));
        let stat = || stat_cpu_s(&format!("/proc/{me}/stat")).expect("own stat");
        let before = stat();
        let own = process_cpu_s(me).expect("own CPU clock");
        let after = stat();
        // Ticks are whole hundredths of a second; the clock's time is one but
        // for 1 in 10^7. It is the time `stat` gives in ticks, read between two
        // of them (however long a busy host kept us off the CPU in between):
        // `stat` truncates user and system time to a tick each, and lags the
        // threads running elsewhere by up to a tick.
        let ns = (own * 1e9).round() as u64;
        assert_ne!(ns % 10_000_000, 0, "{own}");
        assert!(
            before <= own + 0.001 && own <= after + 0.05,
            "{before} <= {own} <= {after}"
        );
        assert!(
            thread.is_some_and(|t| t > 0.0 && t <= own),
            "{thread:?} of {own}"
        );
        assert_eq!(process_cpu_s(0), None, "pid 0's clock would be our own");
    }

    #[test]
    fn the_window_leaves_the_clients_time_to_be_read() {
        let s = Duration::from_secs_f64;
        assert_eq!(window(s(1.0)), s(0.8));
        assert_eq!(window(s(10.0)), s(9.0));
        assert_eq!(window(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn digits_fold_into_one_mark() {
        assert_eq!(fold_digits("msgr-worker-12"), "msgr-worker-#");
        assert_eq!(fold_digits("tp_osd_tp"), "tp_osd_tp");
        assert_eq!(fold_digits("r0q1"), "r#q#");
    }
}
