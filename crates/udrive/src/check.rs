//! `udrive check`: validates a configuration without starting anything. It runs
//! the checks `serve` runs before it creates anything (`Config::problems`), and
//! what `serve` would only find while starting — files missing or not writable,
//! slices past a backend's end or overlapping, Ceph files unreadable, a Ceph
//! cluster that does not answer or lacks the image, sockets a live process
//! serves, CPUs outside this process's affinity — without opening a local
//! backend for writing, taking a lock or creating a socket (`--offline` also
//! leaves the clusters alone). Every problem is listed, not only the first.

use anyhow::Result;

use crate::backends::BackendSet;
use crate::config::Config;
use crate::nsspec::NsSpec;
use crate::serve::ServeArgs;

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// Do not contact Ceph clusters (by default each `rbd:` image is opened
    /// read-only, at most 10 s per cluster, to see that it is there)
    #[arg(long)]
    pub offline: bool,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// The configuration has problems (each was printed).
#[derive(Debug, thiserror::Error)]
#[error("{0} problem(s) in the configuration")]
pub struct CheckFailed(pub usize);

pub fn run(a: CheckArgs) -> Result<()> {
    // A file that is not valid TOML, or a spec that does not parse, stops here.
    let cfg = a.serve.into_unchecked_config()?;
    let problems = problems(&cfg, !a.offline);
    if problems.is_empty() {
        crate::outln!("udrive check: ok: {}", summary(&cfg))?;
        return Ok(());
    }
    for p in &problems {
        eprintln!("udrive check: {p}");
    }
    Err(CheckFailed(problems.len()).into())
}

/// Every problem of `cfg`, as `serve` would meet them; `reach`: also contact the
/// clusters its disks are in.
pub fn problems(cfg: &Config, reach: bool) -> Vec<String> {
    let mut p = cfg.problems();
    if let Ok(cpus) = engine::parse_cpu_list(&cfg.cpus) {
        if let Err(e) = engine::check_allowed(&cpus) {
            p.push(format!("cpus {}: {e}", cfg.cpus));
        }
    }
    backend_problems(cfg, reach, &mut p);
    let sockets = cfg
        .controllers
        .iter()
        .map(|c| c.socket.as_path())
        .chain(cfg.vhost_user_blk.iter().map(|d| d.socket.as_path()))
        .chain(cfg.rpc.as_deref());
    for s in sockets {
        if let Err(e) = sockfile::probe(s) {
            p.push(format!("socket {}: {e}", s.display()));
        }
    }
    p
}

/// Each namespace and disk: its backend's own checks, then its slice and its
/// overlap with the others, as `serve` would open them.
fn backend_problems(cfg: &Config, reach: bool, p: &mut Vec<String>) {
    let mut set = BackendSet::default();
    for c in &cfg.controllers {
        for (i, ns) in c.namespaces.iter().enumerate() {
            let nsid = c.nsid(i);
            let what = format!("namespace {nsid} ({ns}) of {}", c.socket.display());
            if let Some(total) = spec_size(ns, &what, reach, p) {
                if let Err(e) = set.check_namespace(ns, &c.socket, nsid, total) {
                    p.push(format!("{e:#}"));
                }
            }
        }
    }
    for d in &cfg.vhost_user_blk {
        let what = format!("disk {} of {}", d.disk, d.socket.display());
        if let Some(total) = spec_size(&d.disk, &what, reach, p) {
            if let Err(e) = set.check_disk(&d.disk, &d.socket, total) {
                p.push(format!("{e:#}"));
            }
        }
    }
}

/// The backend's size if its kind knows it without opening it; its problems go
/// to `p`, each prefixed with `what`.
fn spec_size(ns: &NsSpec, what: &str, reach: bool, p: &mut Vec<String>) -> Option<u64> {
    let mut found = Vec::new();
    let mut size = ns.kind.0.check(ns.read_only, &mut found);
    if reach && found.is_empty() {
        match ns.kind.0.reach() {
            Ok(s) => size = size.or(s),
            Err(e) => found.push(format!("{e:#}")),
        }
    }
    // The key file only: whether it unlocks the volume needs the header, which
    // `check` does not read (the slice checks use the raw size for the same reason).
    // A `key-secret=` lives in the running server only.
    if let Some(path) = ns.encrypt.as_ref().and_then(|e| e.key.file()) {
        if let Err(err) = std::fs::File::open(path) {
            found.push(format!("key file {}: {err}", path.display()));
        }
    }
    let ok = found.is_empty();
    p.extend(found.into_iter().map(|f| format!("{what}: {f}")));
    size.filter(|_| ok)
}

fn summary(cfg: &Config) -> String {
    let namespaces: usize = cfg.controllers.iter().map(|c| c.namespaces.len()).sum();
    let rpc = cfg
        .rpc
        .as_deref()
        .map(|r| format!(", control socket {}", r.display()))
        .unwrap_or_default();
    format!(
        "{} NVMe controller(s) with {namespaces} namespace(s), {} vhost-user-blk device(s), reactors on CPUs {}{rpc}",
        cfg.controllers.len(),
        cfg.vhost_user_blk.len(),
        cfg.cpus,
    )
}
