//! Helpers of the RBD tests (rbd.rs, rbd_handover.rs): namespace specs on a
//! throwaway cluster, and the CPUs librbd's threads run on.

use test_support::ceph::Cluster;

/// An `rbd:` namespace spec for `image` of `c`, with `extra` options appended.
pub fn rbd_ns(c: &Cluster, image: &str, extra: &str) -> String {
    format!(
        "rbd:{},conf={}{extra}",
        c.image_spec(image),
        c.conf().display()
    )
}

/// A thread's name and the CPUs it may run on.
pub type ThreadCpus = (String, Vec<usize>);

/// The CPUs each thread of process `pid` may run on, reactors and librados'/librbd's
/// threads apart (udrive's own other threads left out).
pub fn thread_cpus(pid: u32) -> (Vec<Vec<usize>>, Vec<ThreadCpus>) {
    let (mut reactors, mut librbd) = (Vec::new(), Vec::new());
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let read = |f: &str| std::fs::read_to_string(t.path().join(f));
        let (Ok(comm), Ok(status)) = (read("comm"), read("status")) else {
            continue; // the thread ended while we looked: it runs nowhere
        };
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(|l| l.trim().to_string())
            .unwrap_or_default();
        let comm = comm.trim();
        let allowed = engine::parse_cpu_list(&cpus).unwrap();
        if comm.starts_with("reactor") {
            reactors.push(allowed);
        } else if !["udrive", "nvme-admin", "vfu-hub", "rpc-accept", "spawner"].contains(&comm) {
            librbd.push((comm.to_string(), allowed));
        }
    }
    (reactors, librbd)
}

/// The librados/librbd threads of process `pid` and their CPUs; there are always
/// several once an image is open.
pub fn librbd_threads(pid: u32) -> Vec<ThreadCpus> {
    let librbd = thread_cpus(pid).1;
    assert!(
        librbd.len() >= 5,
        "only {} librados/librbd threads found",
        librbd.len()
    );
    librbd
}
