//! A throwaway Ceph cluster for the rbd backend's tests: one mon and one OSD on
//! 127.0.0.1 with cephx, pool `rbd`, everything in a temp dir, brought up by
//! `scripts/ceph-cluster` (about 1 s with memstore, 2 s with bluestore) and stopped and
//! removed on drop. Clusters are independent: tests may start several at once.
//!
//! Object stores: memstore (the default) keeps the data in the OSD's RAM and writes it
//! to the dir only on a clean shutdown, so it survives [`Cluster::osd_restart_clean`] but
//! not a SIGKILL. Tests that kill the OSD use [`Cluster::start_bluestore`].
//!
//! The `rbd` CLI runs under `timeout 60`: a hung cluster fails a test, it does not hang it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

/// The object store of a cluster's OSD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// In RAM; saved to the dir on a clean shutdown only. Fast, small images (≤ 256 MiB:
    /// it holds ~3x the bytes written).
    Memstore,
    /// A sparse 10 GiB file in the dir; survives the OSD being killed.
    Bluestore,
}

/// One running cluster; `Drop` stops its daemons and removes its dir.
pub struct Cluster {
    dir: tempfile::TempDir,
    conf: PathBuf,
    store: Store,
}

/// The cluster script, from the workspace's sources.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster")
}

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

/// Whether a cluster can be started here (ceph-mon, ceph-osd and the ceph-common tools
/// installed). Under CI (`CI` set) missing binaries are a failure, not a skip: CI
/// installs them (scripts/ensure-ceph.sh).
pub fn available() -> bool {
    let missing: Vec<&str> = [
        "ceph-mon",
        "ceph-osd",
        "ceph",
        "rados",
        "rbd",
        "ceph-authtool",
        "monmaptool",
    ]
    .into_iter()
    .filter(|b| !on_path(b))
    .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("CI without {missing:?}: scripts/ensure-ceph.sh installs them");
    }
    eprintln!("skipped: no Ceph here ({missing:?} missing; scripts/ensure-ceph.sh installs them)");
    false
}

fn output_text(out: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

impl Cluster {
    /// A memstore cluster; panics with the script's output if it does not come up.
    pub fn start() -> Cluster {
        Self::start_with(Store::Memstore)
    }

    /// A bluestore cluster (for tests that kill the OSD).
    pub fn start_bluestore() -> Cluster {
        Self::start_with(Store::Bluestore)
    }

    pub fn start_with(store: Store) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("udrive-ceph.")
            .tempdir()
            .expect("temp dir for a Ceph cluster");
        let mut cmd = Command::new(script());
        cmd.arg("start").arg(dir.path());
        if store == Store::Bluestore {
            cmd.arg("--bluestore");
        }
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .expect("run scripts/ceph-cluster");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let conf = stdout
            .lines()
            .last()
            .and_then(|l| l.strip_prefix("CEPH_CONF="))
            .map(PathBuf::from);
        match conf {
            Some(conf) if out.status.success() => Cluster { dir, conf, store },
            _ => {
                // The script stopped what it started; the dir goes with `dir`.
                panic!("ceph-cluster start failed: {}", output_text(&out));
            }
        }
    }

    /// `DIR/ceph.conf`: what librbd's `rados_conf_read_file` takes.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// The client.admin keyring (the conf's `keyring`).
    pub fn keyring(&self) -> PathBuf {
        self.dir().join("ceph.client.admin.keyring")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn store(&self) -> Store {
        self.store
    }

    /// The pool every cluster has (8 PGs, application rbd).
    pub fn pool(&self) -> &str {
        "rbd"
    }

    /// `127.0.0.1:PORT` of the mon.
    pub fn mon_addr(&self) -> String {
        let conf = std::fs::read_to_string(&self.conf).expect("read ceph.conf");
        conf.lines()
            .find_map(|l| l.strip_prefix("mon host = [v2:"))
            .and_then(|l| l.strip_suffix(']'))
            .expect("mon host in ceph.conf")
            .to_string()
    }

    /// `rbd --conf DIR/ceph.conf` under `timeout 60`, ready for arguments.
    pub fn rbd_cmd(&self) -> Command {
        let mut c = Command::new("timeout");
        c.args(["--kill-after=5", "60", "rbd", "--conf"])
            .arg(&self.conf)
            .stdin(Stdio::null());
        c
    }

    /// Runs `rbd ARGS`; panics with its stderr if it fails; returns its stdout.
    pub fn rbd(&self, args: &[&str]) -> String {
        let out = self.rbd_status(args);
        assert!(out.status.success(), "rbd {args:?}: {}", output_text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `rbd ARGS` and returns what happened (no panic on failure).
    pub fn rbd_status(&self, args: &[&str]) -> Output {
        self.rbd_cmd().args(args).output().expect("run rbd")
    }

    /// `POOL/NAME`.
    pub fn image_spec(&self, name: &str) -> String {
        format!("{}/{name}", self.pool())
    }

    /// A new, zeroed image of exactly `size` bytes (default features: layering,
    /// exclusive-lock, object-map, fast-diff, deep-flatten; 4 MiB objects).
    pub fn create_image(&self, name: &str, size: u64) {
        self.rbd(&[
            "create",
            "--size",
            &format!("{size}B"),
            &self.image_spec(name),
        ]);
    }

    /// The whole image (`rbd export IMAGE -`).
    pub fn export(&self, name: &str) -> Vec<u8> {
        let out = self
            .rbd_cmd()
            .args(["export", "--no-progress", &self.image_spec(name), "-"])
            .output()
            .expect("run rbd export");
        assert!(
            out.status.success(),
            "rbd export {name}: {}",
            output_text(&out)
        );
        out.stdout
    }

    /// A new image holding `data` (its size is `data.len()`).
    pub fn import(&self, name: &str, data: &[u8]) {
        static N: AtomicU64 = AtomicU64::new(0);
        let path = self
            .dir()
            .join(format!("import-{}.tmp", N.fetch_add(1, Ordering::Relaxed)));
        std::fs::File::create(&path)
            .and_then(|mut f| f.write_all(data))
            .expect("write the import file");
        let p = path.to_str().expect("utf-8 temp path");
        self.rbd(&["import", "--no-progress", p, &self.image_spec(name)]);
        let _ = std::fs::remove_file(&path);
    }

    /// Runs `scripts/ceph-cluster CMD DIR ARGS` and returns what happened.
    pub fn script_status(&self, cmd: &str, args: &[&str]) -> Output {
        Command::new(script())
            .arg(cmd)
            .arg(self.dir())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run scripts/ceph-cluster")
    }

    fn script(&self, cmd: &str, args: &[&str]) {
        let out = self.script_status(cmd, args);
        assert!(
            out.status.success(),
            "ceph-cluster {cmd}: {}",
            output_text(&out)
        );
    }

    /// Kills the OSD (SIGKILL) and waits until it is gone. I/O to the cluster blocks
    /// until [`Cluster::osd_start`]. A memstore OSD loses its data this way.
    pub fn osd_stop(&self) {
        self.script("osd-stop", &[]);
    }

    /// Stops the OSD cleanly (SIGTERM; memstore saves its data).
    pub fn osd_stop_clean(&self) {
        self.script("osd-stop", &["--term"]);
    }

    /// Starts the OSD on its data and waits until the pool serves again (all PGs
    /// active). Panics after a SIGKILL on memstore (the data is gone; the script says so).
    pub fn osd_start(&self) {
        self.script("osd-start", &[]);
    }

    /// [`Cluster::osd_stop`] + [`Cluster::osd_start`]: bluestore only.
    pub fn osd_restart(&self) {
        self.script("osd-restart", &[]);
    }

    /// [`Cluster::osd_stop_clean`] + [`Cluster::osd_start`]: either store.
    pub fn osd_restart_clean(&self) {
        self.script("osd-restart", &["--term"]);
    }

    /// Kills the mon: clients cannot connect (`rados_connect` fails with ETIMEDOUT after
    /// `client_mount_timeout`, 300 s by default) and OSD map changes stop.
    pub fn mon_stop(&self) {
        self.script("mon-stop", &[]);
    }

    /// Starts the mon again on the same port.
    pub fn mon_start(&self) {
        self.script("mon-start", &[]);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let out = self.script_status("stop", &["--purge"]);
        if !out.status.success() {
            eprintln!("ceph-cluster stop --purge: {}", output_text(&out));
        }
    }
}

/// Pids of live processes whose command line mentions `needle` (zombies have none).
pub fn processes_mentioning(needle: &Path) -> Vec<u32> {
    let needle = needle.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(&needle)
                })
                .unwrap_or(false)
        })
        .collect()
}
