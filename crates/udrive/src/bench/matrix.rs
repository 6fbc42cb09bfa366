//! What `udrive bench` runs: a matrix of datapaths × backends × client counts ×
//! workloads × repetitions, read from TOML (a preset embedded in the binary or a user's file),
//! checked whole before anything starts, and expanded into cells.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use super::datapath_kind::{Binary, DatapathKind, Poll, VmDevice};

/// The presets, embedded so that `udrive bench --print NAME` gives a file to copy.
pub const PRESETS: &[(&str, &str)] = &[
    ("quick", include_str!("presets/quick.toml")),
    ("readme", include_str!("presets/readme.toml")),
    ("headline", include_str!("presets/headline.toml")),
    ("file-disk", include_str!("presets/file-disk.toml")),
    ("file-uring", include_str!("presets/file-uring.toml")),
    ("poll-modes", include_str!("presets/poll-modes.toml")),
    ("rbd", include_str!("presets/rbd.toml")),
    ("rbd-threads", include_str!("presets/rbd-threads.toml")),
    ("thesis", include_str!("presets/thesis.toml")),
    ("qcow2", include_str!("presets/qcow2.toml")),
    ("many-vms", include_str!("presets/many-vms.toml")),
    ("spdk", include_str!("presets/spdk.toml")),
    ("spdk-vhost", include_str!("presets/spdk-vhost.toml")),
    ("luks", include_str!("presets/luks.toml")),
    ("ab", include_str!("presets/ab.toml")),
    ("vm", include_str!("presets/vm.toml")),
    ("dma-messages", include_str!("presets/dma-messages.toml")),
    ("dirty-log", include_str!("presets/dirty-log.toml")),
    ("trace-cost", include_str!("presets/trace-cost.toml")),
    ("vhost", include_str!("presets/vhost.toml")),
    ("poll-idle", include_str!("presets/poll-idle.toml")),
    ("poll-shared", include_str!("presets/poll-shared.toml")),
    ("qos", include_str!("presets/qos.toml")),
    ("handover", include_str!("presets/handover.toml")),
];

/// The most concurrent clients a cell may have: each is a process with its own
/// device (a socket, a backing, for qsd a whole server process).
pub const MAX_CLIENTS: u32 = 64;

/// The longest think time: an idle client for the longest run worth measuring.
const MAX_THINK_US: u32 = 600_000_000;

/// A preset's text by name.
pub fn preset(name: &str) -> Option<&'static str> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// Not TOML, or a field the matrix does not have (the message names it).
    #[error("matrix: {source}")]
    Toml {
        #[source]
        source: toml::de::Error,
    },
    /// A field with a value the harness cannot run.
    #[error("matrix: `{field}`: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> MatrixError {
    MatrixError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    Null,
    Ram,
    File,
    /// An RBD image of the cluster `[rbd] conf` (or `--rbd-conf`) names.
    Rbd,
    /// The `file` backend's data as a fully allocated qcow2 image (qemu-img
    /// convert), in `[file] dir`.
    Qcow2,
    /// A backing chain three images deep: two empty qcow2 overlays above the
    /// `file` backend's raw data, made afresh for every run, so every read goes
    /// through both and writes allocate in the top one.
    Qcow2Chain,
    /// An empty qcow2 image of 64 GiB (64 KiB clusters, no backing) made afresh
    /// for every run: a write to a cluster not yet written allocates it (the
    /// cost of first writes); reads of it return zeroes.
    Qcow2New,
    /// The RAM disk as a LUKS2 volume (`encrypt=luks,create=on`: formatted at every
    /// server start; aes-xts-plain64, 512-bit key, 4096-byte sectors).
    RamLuks,
    /// A LUKS2 volume whose payload is `[file] mib` (the header's 16 MiB more), in
    /// `[file] dir`, formatted by the first udrive to serve it and opened by the
    /// later ones; its payload is pseudo-random ciphertext (no holes), as the
    /// `file` backend's data is.
    FileLuks,
}

impl Backend {
    /// Served from a qcow2 image.
    pub fn is_qcow2(self) -> bool {
        matches!(self, Self::Qcow2 | Self::Qcow2Chain | Self::Qcow2New)
    }

    /// The clear backend an encrypted one is compared with (`ram` for `ram-luks`).
    pub fn clear(self) -> Option<Backend> {
        match self {
            Self::RamLuks => Some(Self::Ram),
            Self::FileLuks => Some(Self::File),
            _ => None,
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Null => "null",
            Self::Ram => "ram",
            Self::File => "file",
            Self::Rbd => "rbd",
            Self::Qcow2 => "qcow2",
            Self::Qcow2Chain => "qcow2-chain",
            Self::Qcow2New => "qcow2-new",
            Self::RamLuks => "ram-luks",
            Self::FileLuks => "file-luks",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rw {
    Randread,
    Randwrite,
    Randrw,
}

impl fmt::Display for Rw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Randread => "randread",
            Self::Randwrite => "randwrite",
            Self::Randrw => "randrw",
        })
    }
}

/// The order of datapaths within a repetition. Every repetition runs each datapath
/// once before the next repetition starts; `flip` also reverses the order on every
/// second repetition, so no datapath always runs first (after an idle machine) or
/// right after the same neighbour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    #[default]
    Flip,
    Fixed,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cpus {
    /// CPU list for the server (udrive's reactors, qemu-storage-daemon).
    pub server: String,
    /// CPU list for the client's jobs.
    pub client: String,
}

impl Default for Cpus {
    fn default() -> Self {
        Cpus {
            server: "0".into(),
            client: "1".into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileOpts {
    /// Where the data file is made (tmpfs by default: the software path, not a disk).
    #[serde(default = "default_dir")]
    pub dir: String,
    #[serde(default = "default_mib")]
    pub mib: u64,
    /// O_DIRECT on every datapath (tmpfs has no real O_DIRECT: keep it off there).
    #[serde(default)]
    pub direct: bool,
    /// udrive's and bare io_uring's engine (`engine=` of a file spec: auto, uring,
    /// inline); qemu-storage-daemon always uses aio=io_uring.
    #[serde(default = "default_engine")]
    pub engine: String,
}

fn default_engine() -> String {
    "auto".into()
}

fn default_dir() -> String {
    "/dev/shm".into()
}
fn default_mib() -> u64 {
    256
}

/// The `rbd` backend: an image of an existing cluster, made and written through
/// once per bench run if it is missing.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RbdOpts {
    /// The cluster's configuration; none: `rbd` entries are skipped, unless
    /// `throwaway` starts a cluster.
    #[serde(default)]
    pub conf: Option<String>,
    /// With no `conf`, start a throwaway cluster for the matrix (one mon, one OSD
    /// on memstore: scripts/ceph-cluster) and purge it after.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub throwaway: bool,
    /// POOL/IMAGE [default: rbd/udrive-bench].
    #[serde(default)]
    pub image: Option<String>,
    /// The image's size when it is made [default: 256].
    #[serde(default)]
    pub mib: Option<u64>,
}

impl RbdOpts {
    pub fn image(&self) -> &str {
        self.image.as_deref().unwrap_or("rbd/udrive-bench")
    }
    pub fn mib(&self) -> u64 {
        self.mib.unwrap_or(256)
    }
    /// `(POOL, IMAGE)` of [`RbdOpts::image`] (empty if it has no '/').
    pub fn pool_image(&self) -> (&str, &str) {
        self.image().split_once('/').unwrap_or(("", ""))
    }
}

impl Default for FileOpts {
    fn default() -> Self {
        FileOpts {
            dir: default_dir(),
            mib: default_mib(),
            direct: false,
            engine: default_engine(),
        }
    }
}

/// One line of workloads: every `qd` × every `jobs`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub rw: Rw,
    /// Percentage of reads (randrw only).
    #[serde(default = "default_mix")]
    pub rwmixread: u8,
    #[serde(default = "default_bs")]
    pub bs: u32,
    pub qd: Vec<u32>,
    #[serde(default = "default_jobs")]
    pub jobs: Vec<u32>,
    /// µs each job waits after a completion before its next I/O (`perf --think-us`):
    /// at QD1 every I/O is the first after the server went idle. As long as the
    /// run (warm-up and time) it makes idle clients: each job's first I/Os, then
    /// nothing until the run ends (the server's CPU while its clients idle).
    #[serde(default)]
    pub think_us: u32,
}

fn default_mix() -> u8 {
    70
}
fn default_bs() -> u32 {
    4096
}
fn default_jobs() -> Vec<u32> {
    vec![1]
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Matrix {
    #[serde(default)]
    pub description: String,
    pub reps: u32,
    /// Measured seconds per run.
    pub time: f64,
    /// Warm-up seconds per run, before measuring (`perf --ramp`).
    #[serde(default)]
    pub ramp: f64,
    #[serde(default)]
    pub order: Order,
    pub datapaths: Vec<DatapathKind>,
    pub backends: Vec<Backend>,
    /// Every cell is compared with each of these datapaths where it ran the same
    /// backend and workload (ratios and added latency, per repetition).
    #[serde(default)]
    pub baselines: Vec<DatapathKind>,
    /// udrive's poll mode (`serve --poll`) where a datapath names none.
    #[serde(default)]
    pub poll: Poll,
    /// udrive's vhost-user-blk placement with several queues (`serve --placement`).
    #[serde(default = "default_placement")]
    pub placement: String,
    #[serde(default)]
    pub cpus: Cpus,
    #[serde(default)]
    pub file: FileOpts,
    #[serde(default)]
    pub rbd: RbdOpts,
    /// Clients sleep on completions instead of spinning (`perf --wait`, with
    /// `--irq` on NVMe): leaves the CPUs to the server and a cluster.
    #[serde(default)]
    pub wait: bool,
    /// Every run traced (`perf --trace`; udrive's servers also give their layers
    /// through their control socket): the report draws each datapath's time per
    /// layer. Tracing every I/O costs udrive a few % of IOPS at most.
    #[serde(default)]
    pub trace: bool,
    /// Whose CPU each run accounts: `"server"` (the main table's column), `"roles"`
    /// (also the clients' and the cluster's: a "CPU per I/O" table) or `"threads"`
    /// (also each of their threads by name).
    #[serde(default)]
    pub cpu: super::cpu::CpuDetail,
    /// Size of the RAM backend; udrive fills it before measuring.
    #[serde(default = "default_ram_mib")]
    pub ram_mib: u64,
    /// Concurrent clients per cell, each a `perf` process with its own device on one
    /// server (N NVMe controllers or N vhost-user-blk devices on one udrive; N
    /// qemu-storage-daemon processes; N bare io_uring processes), each on its own
    /// backing: the `file` backend's data in N files and the RAM disk in N disks of
    /// 1/N of the size each, so the data the cell touches stays the same.
    #[serde(default = "default_clients")]
    pub clients: Vec<u32>,
    /// The udrive binary that serves the `~b` datapaths (`--udrive-b`): the other
    /// side of a before/after, whose clients stay the main binary's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udrive_b: Option<String>,
    /// `[variant.NAME]`: what `udrive-nvme+NAME` / `udrive-vhost+NAME` change.
    #[serde(
        default,
        rename = "variant",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub variants: BTreeMap<String, super::variant::Variant>,
    #[serde(rename = "workload")]
    pub workloads: Vec<Workload>,
}

fn default_clients() -> Vec<u32> {
    vec![1]
}

fn default_placement() -> String {
    "single".into()
}
fn default_ram_mib() -> u64 {
    1024
}

/// One workload as run: what `perf` is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Point {
    pub rw: Rw,
    pub rwmixread: u8,
    pub bs: u32,
    pub qd: u32,
    pub jobs: u32,
    pub think_us: u32,
}

impl Point {
    /// A short name, unique within a matrix: `randread-4k-qd1-j1`.
    pub fn slug(&self) -> String {
        let mix = match self.rw {
            Rw::Randrw => format!("{}", self.rwmixread),
            _ => String::new(),
        };
        format!(
            "{}{mix}-{}-qd{}-j{}",
            self.rw,
            bs_name(self.bs),
            self.qd,
            self.jobs
        )
    }
}

/// 4096 -> `4k`, 131072 -> `128k`, 1000 -> `1000`.
pub fn bs_name(bs: u32) -> String {
    if bs.is_multiple_of(1024) {
        format!("{}k", bs / 1024)
    } else {
        bs.to_string()
    }
}

const ENGINES: [&str; 3] = ["auto", "uring", "inline"];
pub(super) const PLACEMENTS: [&str; 3] = ["single", "dedicated", "round-robin"];

impl Matrix {
    /// Parse and check a matrix; the error names the field at fault.
    pub fn from_toml(text: &str) -> Result<Matrix, MatrixError> {
        let m = Matrix::parse(text)?;
        m.check()?;
        Ok(m)
    }

    /// Parse without the checks, for a caller that applies the command line's
    /// overrides (`--udrive-b` completes the `ab` preset) and then checks.
    pub fn parse(text: &str) -> Result<Matrix, MatrixError> {
        toml::from_str(text).map_err(|source| MatrixError::Toml { source })
    }

    /// Whether the harness can run this matrix; the error names the field at fault.
    pub fn check(&self) -> Result<(), MatrixError> {
        if self.reps == 0 || self.reps > 1000 {
            return Err(invalid("reps", "must be 1..=1000"));
        }
        if !(self.time > 0.0 && self.time <= 3600.0) {
            return Err(invalid("time", "must be > 0 and at most 3600 seconds"));
        }
        if !(0.0..=600.0).contains(&self.ramp) {
            return Err(invalid("ramp", "must be 0..=600 seconds"));
        }
        check_list("datapaths", &self.datapaths)?;
        check_list("backends", &self.backends)?;
        if let Some(i) = self.datapaths.iter().position(DatapathKind::is_b) {
            if self.udrive_b.as_deref().is_none_or(str::is_empty) {
                return Err(invalid(
                    format!("datapaths[{i}]"),
                    format!(
                        "`{}` is served by a second udrive binary: give --udrive-b BIN (or udrive_b = \"PATH\" in the matrix)",
                        self.datapaths[i]
                    ),
                ));
            }
        }
        self.check_clients()?;
        if self.rbd.throwaway && self.rbd.conf.is_some() {
            return Err(invalid(
                "rbd.throwaway",
                "a cluster is named by `conf` already: drop one of them",
            ));
        }
        super::variant::check(&self.datapaths, &self.variants)?;
        for (i, b) in self.baselines.iter().enumerate() {
            if !self.datapaths.contains(b) {
                return Err(invalid(
                    format!("baselines[{i}]"),
                    format!("`{b}` is not in `datapaths`"),
                ));
            }
        }
        if !PLACEMENTS.contains(&self.placement.as_str()) {
            return Err(invalid(
                "placement",
                format!("one of {}", PLACEMENTS.join(", ")),
            ));
        }
        if !ENGINES.contains(&self.file.engine.as_str()) {
            return Err(invalid(
                "file.engine",
                format!("one of {}", ENGINES.join(", ")),
            ));
        }
        if self.file.mib == 0 || self.file.mib > 1 << 20 {
            return Err(invalid("file.mib", "must be 1..=1048576"));
        }
        if self.ram_mib == 0 || self.ram_mib > 1 << 20 {
            return Err(invalid("ram_mib", "must be 1..=1048576"));
        }
        if !(1..=1 << 20).contains(&self.rbd.mib()) {
            return Err(invalid("rbd.mib", "must be 1..=1048576"));
        }
        let (pool, image) = self.rbd.pool_image();
        let name_ok = |n: &str| {
            !n.is_empty()
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        };
        if !name_ok(pool) || !name_ok(image) {
            return Err(invalid("rbd.image", "POOL/IMAGE, e.g. rbd/udrive-bench"));
        }
        if self.workloads.is_empty() {
            return Err(invalid("workload", "at least one [[workload]]"));
        }
        for (i, w) in self.workloads.iter().enumerate() {
            check_workload(&format!("workload[{i}]"), w)?;
        }
        Ok(())
    }

    fn check_clients(&self) -> Result<(), MatrixError> {
        check_list("clients", &self.clients)?;
        if let Some(i) = self.clients.iter().position(|&n| n == 0 || n > MAX_CLIENTS) {
            return Err(invalid(
                format!("clients[{i}]"),
                format!("must be 1..={MAX_CLIENTS}"),
            ));
        }
        let n = u64::from(self.max_clients());
        if self.file.mib < n || self.ram_mib < n {
            return Err(invalid(
                "clients",
                format!("{n} clients need file.mib and ram_mib of at least {n} (1 MiB each)"),
            ));
        }
        if let Err(e) = engine::parse_cpu_list(&self.cpus.client) {
            return Err(invalid("cpus.client", e));
        }
        Ok(())
    }

    /// The most clients any cell has.
    pub fn max_clients(&self) -> u32 {
        self.clients.iter().copied().max().unwrap_or(1)
    }

    /// Every workload point, in the matrix's order, without repeats.
    pub fn points(&self) -> Vec<Point> {
        let mut out: Vec<Point> = Vec::new();
        for w in &self.workloads {
            for &jobs in &w.jobs {
                for &qd in &w.qd {
                    let p = Point {
                        rw: w.rw,
                        rwmixread: if w.rw == Rw::Randrw { w.rwmixread } else { 100 },
                        bs: w.bs,
                        qd,
                        jobs,
                        think_us: w.think_us,
                    };
                    if !out.contains(&p) {
                        out.push(p);
                    }
                }
            }
        }
        out
    }

    /// The most jobs any workload asks for: the queues a vhost-user server exports.
    /// The variant datapath `d` names, if any.
    pub fn variant_of(&self, d: &DatapathKind) -> Option<&super::variant::Variant> {
        self.variants.get(d.variant()?)
    }

    /// Which sides `d`'s runs trace, if any: its variant's `trace`, else the
    /// matrix's.
    pub fn tracing(&self, d: &DatapathKind) -> Option<super::variant::TraceScope> {
        use super::variant::{TraceOpt, TraceScope};
        match self.variant_of(d).map(|v| v.trace) {
            Some(TraceOpt::Side(_)) => Some(TraceScope::Server),
            Some(TraceOpt::Flag(true)) => Some(TraceScope::Both),
            _ => self.trace.then_some(TraceScope::Both),
        }
    }

    pub fn max_jobs(&self) -> u32 {
        self.points().iter().map(|p| p.jobs).max().unwrap_or(1)
    }

    /// The datapath order of repetition `rep` (1-based).
    pub fn order_of(&self, rep: u32) -> Vec<DatapathKind> {
        let mut d = self.datapaths.clone();
        if self.order == Order::Flip && rep.is_multiple_of(2) {
            d.reverse();
        }
        d
    }
}

fn check_list<T: PartialEq + fmt::Debug>(field: &str, v: &[T]) -> Result<(), MatrixError> {
    if v.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    for (i, x) in v.iter().enumerate() {
        if v[..i].contains(x) {
            return Err(invalid(
                format!("{field}[{i}]"),
                format!("{x:?} appears twice"),
            ));
        }
    }
    Ok(())
}

fn check_workload(at: &str, w: &Workload) -> Result<(), MatrixError> {
    if w.bs < 512 || w.bs > 1 << 20 || !w.bs.is_multiple_of(512) {
        return Err(invalid(format!("{at}.bs"), "a multiple of 512 up to 1 MiB"));
    }
    if w.rwmixread > 100 {
        return Err(invalid(format!("{at}.rwmixread"), "a percentage, 0..=100"));
    }
    if w.qd.is_empty() || w.qd.iter().any(|&q| q == 0 || q > 1024) {
        return Err(invalid(format!("{at}.qd"), "a non-empty list of 1..=1024"));
    }
    if w.jobs.is_empty() || w.jobs.iter().any(|&j| j == 0 || j > 64) {
        return Err(invalid(format!("{at}.jobs"), "a non-empty list of 1..=64"));
    }
    if w.think_us > MAX_THINK_US {
        return Err(invalid(
            format!("{at}.think_us"),
            "at most 600000000 (10 min)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_variants_name_themselves() {
        for (s, d) in [
            (
                "udrive-nvme",
                DatapathKind::UdriveNvme(None, Binary::Main, None),
            ),
            (
                "udrive-nvme@adaptive",
                DatapathKind::UdriveNvme(Some(Poll::Adaptive), Binary::Main, None),
            ),
            (
                "udrive-vhost@event",
                DatapathKind::UdriveVhost(Some(Poll::Event), Binary::Main, None),
            ),
            (
                "udrive-nvme~b",
                DatapathKind::UdriveNvme(None, Binary::B, None),
            ),
            (
                "udrive-vhost@adaptive~b",
                DatapathKind::UdriveVhost(Some(Poll::Adaptive), Binary::B, None),
            ),
            (
                "udrive-nvme+msgs",
                DatapathKind::UdriveNvme(None, Binary::Main, Some("msgs".into())),
            ),
            (
                "udrive-vhost@busy+dirty-log-2~b",
                DatapathKind::UdriveVhost(Some(Poll::Busy), Binary::B, Some("dirty-log-2".into())),
            ),
        ] {
            assert_eq!(DatapathKind::try_from(s.to_string()), Ok(d.clone()));
            assert_eq!(d.to_string(), s);
        }
        for bad in [
            "udrive-nvme@fast",
            "qsd-vhost@busy",
            "fake-a@busy",
            "udrive-nvme@",
            "udrive-nvme~b@busy",
            "udrive-nvme~b~b",
            "udrive-nvme~a",
            "qsd-vhost~b",
            "io-uring~b",
            "udrive-nvme-spdk~b",
            "fake-a~b",
            "~b",
            "udrive-nvme+",
            "udrive-nvme+Msgs",
            "udrive-nvme+a+b",
            "udrive-nvme+a@busy",
            "udrive-nvme~b+a",
            "io-uring+a",
            "fake-a+a",
            "udrive-nvme+aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ] {
            assert!(DatapathKind::try_from(bad.to_string()).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_preset_parses() {
        for (name, text) in PRESETS {
            // A suite's members are presets: checked in `suite`.
            if super::super::suite::parse(text).unwrap().is_some() {
                continue;
            }
            let mut m = Matrix::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            // A before/after preset is complete with the second binary only.
            if m.datapaths.iter().any(DatapathKind::is_b) {
                assert!(m.check().is_err(), "{name}");
                m.udrive_b = Some("/usr/bin/true".into());
            }
            m.check().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!m.points().is_empty(), "{name}");
        }
    }

    #[test]
    fn flip_reverses_even_repetitions() {
        let mut m = Matrix::from_toml(preset("quick").unwrap()).unwrap();
        let nvme = DatapathKind::UdriveNvme(None, Binary::Main, None);
        m.datapaths = vec![nvme.clone(), DatapathKind::IoUring];
        assert_eq!(m.order_of(1), m.datapaths);
        assert_eq!(m.order_of(2), vec![DatapathKind::IoUring, nvme]);
        m.order = Order::Fixed;
        assert_eq!(m.order_of(2), m.datapaths);
    }
}
