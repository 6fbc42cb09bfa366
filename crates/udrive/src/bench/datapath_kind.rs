//! Which datapaths a matrix names: the kinds, their poll mode and which udrive
//! binary serves them and which of the matrix's variants they are, parsed from and
//! printed as the names the TOML uses (`udrive-nvme@busy+msgs~b`, `vm-qemu-virtio`,
//! `fake-NAME`).

use std::fmt;

use serde::{Deserialize, Serialize};

/// One way from a client to a backend. The process-backed ones start their server
/// per repetition; `Fake` gives deterministic numbers without processes (tests).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DatapathKind {
    /// udrive's NVMe controller over vfio-user, driven by udrive's initiator;
    /// `udrive-nvme@MODE` serves in that poll mode instead of the matrix's `poll`,
    /// `udrive-nvme+NAME` with the matrix's `[variant.NAME]` (client options, server
    /// environment), `udrive-nvme~b` (`@MODE+NAME~b`) is served by the second binary
    /// (`udrive_b`).
    UdriveNvme(Option<Poll>, Binary, Option<String>),
    /// udrive's vhost-user-blk device, driven by libblkio (`udrive-vhost@MODE`,
    /// `+NAME` and `~b` too).
    UdriveVhost(Option<Poll>, Binary, Option<String>),
    /// qemu-storage-daemon's vhost-user-blk export, driven by libblkio.
    QsdVhost,
    /// The backend file driven directly through io_uring (`perf --file`).
    IoUring,
    /// The RBD image driven directly through librbd (`perf --rbd`): the baseline
    /// of udrive's `rbd:` disks.
    Librbd,
    /// SPDK's `nvmf_tgt` serving a vfio-user controller, driven by SPDK's
    /// `spdk_nvme_perf` (`SPDK_DIR`).
    SpdkNvmf,
    /// udrive's NVMe controller (busy poll) driven by `spdk_nvme_perf`: the same
    /// client as `spdk-nvmf`.
    UdriveNvmeSpdk,
    /// SPDK's `vhost` target serving a vhost-user-blk controller, driven by SPDK's
    /// `bdevperf` over its virtio-user initiator (`SPDK_DIR`): libblkio cannot
    /// attach it, so `udrive perf` does not drive it.
    SpdkVhost,
    /// udrive's vhost-user-blk device driven by `bdevperf`: the same client as
    /// `spdk-vhost`.
    UdriveVhostSpdk,
    /// fio in a Linux guest under QEMU on this device (`vm-*`, `vm.rs`).
    Vm(VmDevice),
    /// Deterministic numbers, no processes: `fake` or `fake-NAME`.
    Fake(String),
}

/// Which udrive binary serves a udrive datapath: the one that runs the bench's
/// clients (`--udrive`), or the second one (`udrive_b`, `--udrive-b`), so that a
/// before/after changes the server only, under the same `perf`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
pub enum Binary {
    #[default]
    Main,
    B,
}

/// The disk a `vm-*` datapath's guest runs fio on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum VmDevice {
    /// udrive's NVMe controller through QEMU's `vfio-user-pci`.
    UdriveNvme,
    /// udrive's vhost-user-blk device through QEMU's `vhost-user-blk-pci`.
    UdriveVhost,
    /// QEMU's own emulated NVMe controller on the backing file.
    QemuNvme,
    /// QEMU's own virtio-blk on the backing file.
    QemuVirtio,
}

impl VmDevice {
    pub const ALL: [VmDevice; 4] = [
        VmDevice::UdriveNvme,
        VmDevice::UdriveVhost,
        VmDevice::QemuNvme,
        VmDevice::QemuVirtio,
    ];
    pub fn name(self) -> &'static str {
        match self {
            VmDevice::UdriveNvme => "vm-udrive-nvme",
            VmDevice::UdriveVhost => "vm-udrive-vhost",
            VmDevice::QemuNvme => "vm-qemu-nvme",
            VmDevice::QemuVirtio => "vm-qemu-virtio",
        }
    }
    /// The udrive datapath whose server this guest's disk is (none: QEMU's own).
    pub fn udrive(self) -> Option<DatapathKind> {
        match self {
            VmDevice::UdriveNvme => Some(DatapathKind::UdriveNvme(None, Binary::Main, None)),
            VmDevice::UdriveVhost => Some(DatapathKind::UdriveVhost(None, Binary::Main, None)),
            VmDevice::QemuNvme | VmDevice::QemuVirtio => None,
        }
    }
}

impl DatapathKind {
    pub const REAL: [&'static str; 13] = [
        "udrive-nvme",
        "udrive-vhost",
        "qsd-vhost",
        "io-uring",
        "librbd",
        "spdk-nvmf",
        "udrive-nvme-spdk",
        "spdk-vhost",
        "udrive-vhost-spdk",
        "vm-udrive-nvme",
        "vm-udrive-vhost",
        "vm-qemu-nvme",
        "vm-qemu-virtio",
    ];

    /// Driven by one of SPDK's clients (`spdk_nvme_perf`, `bdevperf`).
    pub fn is_spdk(&self) -> bool {
        matches!(
            self,
            Self::SpdkNvmf | Self::UdriveNvmeSpdk | Self::SpdkVhost | Self::UdriveVhostSpdk
        )
    }

    /// Served by udrive to one of SPDK's clients.
    pub fn is_udrive_for_spdk(&self) -> bool {
        matches!(self, Self::UdriveNvmeSpdk | Self::UdriveVhostSpdk)
    }

    /// Served by the second udrive binary (`~b`).
    pub fn is_b(&self) -> bool {
        matches!(
            self,
            Self::UdriveNvme(_, Binary::B, _) | Self::UdriveVhost(_, Binary::B, _)
        )
    }

    /// The matrix variant it names (`+NAME`).
    pub fn variant(&self) -> Option<&str> {
        match self {
            Self::UdriveNvme(.., v) | Self::UdriveVhost(.., v) => v.as_deref(),
            _ => None,
        }
    }

    /// Served by udrive with udrive's own client (`perf`).
    pub fn is_udrive(&self) -> bool {
        matches!(self, Self::UdriveNvme(..) | Self::UdriveVhost(..))
    }
}

/// A variant's name: what `+NAME` may be, so that it reads back as one datapath.
fn variant_name(s: &str, name: &str) -> Result<String, String> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    match ok {
        true => Ok(name.to_string()),
        false => Err(format!(
            "datapath `{s}`: variant `{name}` must be 1-32 of a-z, 0-9 and -"
        )),
    }
}

impl TryFrom<String> for DatapathKind {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        if let Some(a) = s.strip_suffix("~b") {
            return match Self::try_from(a.to_string()) {
                Ok(Self::UdriveNvme(p, Binary::Main, v)) => Ok(Self::UdriveNvme(p, Binary::B, v)),
                Ok(Self::UdriveVhost(p, Binary::Main, v)) => {
                    Ok(Self::UdriveVhost(p, Binary::B, v))
                }
                _ => Err(format!(
                    "datapath `{s}`: only udrive-nvme and udrive-vhost (with or without @MODE) take ~b"
                )),
            };
        }
        if let Some((a, name)) = s.split_once('+') {
            let v = Some(variant_name(&s, name)?);
            // One spelling per datapath: `+NAME` before `~b`.
            return match Self::try_from(a.to_string()) {
                Ok(Self::UdriveNvme(p, Binary::Main, None)) => Ok(Self::UdriveNvme(p, Binary::Main, v)),
                Ok(Self::UdriveVhost(p, Binary::Main, None)) => {
                    Ok(Self::UdriveVhost(p, Binary::Main, v))
                }
                _ => Err(format!(
                    "datapath `{s}`: only udrive-nvme and udrive-vhost (with or without @MODE) take +VARIANT"
                )),
            };
        }
        if let Some((base, mode)) = s.split_once('@') {
            let poll = Poll::ALL
                .into_iter()
                .find(|p| p.as_str() == mode)
                .ok_or_else(|| {
                    format!("datapath `{s}`: poll mode `{mode}` is not busy, adaptive or event")
                })?;
            return match base {
                "udrive-nvme" => Ok(Self::UdriveNvme(Some(poll), Binary::Main, None)),
                "udrive-vhost" => Ok(Self::UdriveVhost(Some(poll), Binary::Main, None)),
                _ => Err(format!(
                    "datapath `{s}`: only udrive-nvme and udrive-vhost take @MODE"
                )),
            };
        }
        Ok(match s.as_str() {
            "udrive-nvme" => Self::UdriveNvme(None, Binary::Main, None),
            "udrive-vhost" => Self::UdriveVhost(None, Binary::Main, None),
            "qsd-vhost" => Self::QsdVhost,
            "io-uring" => Self::IoUring,
            "librbd" => Self::Librbd,
            "spdk-nvmf" => Self::SpdkNvmf,
            "udrive-nvme-spdk" => Self::UdriveNvmeSpdk,
            "spdk-vhost" => Self::SpdkVhost,
            "udrive-vhost-spdk" => Self::UdriveVhostSpdk,
            v if v.starts_with("vm-") => match VmDevice::ALL.into_iter().find(|d| d.name() == v) {
                Some(d) => Self::Vm(d),
                None => {
                    return Err(format!(
                        "unknown datapath `{s}` (the VM ones: vm-udrive-nvme, vm-udrive-vhost, vm-qemu-nvme, vm-qemu-virtio)"
                    ))
                }
            },
            f if f == "fake" || f.starts_with("fake-") => Self::Fake(s),
            _ => {
                return Err(format!(
                    "unknown datapath `{s}` (one of {}, udrive-nvme@MODE, udrive-vhost@MODE, each of those four with +VARIANT and ~b, fake, fake-NAME)",
                    Self::REAL.join(", ")
                ))
            }
        })
    }
}

impl From<DatapathKind> for String {
    fn from(d: DatapathKind) -> String {
        d.to_string()
    }
}

impl fmt::Display for DatapathKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, poll) = match self {
            Self::UdriveNvme(p, ..) => ("udrive-nvme", p),
            Self::UdriveVhost(p, ..) => ("udrive-vhost", p),
            Self::QsdVhost => ("qsd-vhost", &None),
            Self::IoUring => ("io-uring", &None),
            Self::Librbd => ("librbd", &None),
            Self::SpdkNvmf => ("spdk-nvmf", &None),
            Self::UdriveNvmeSpdk => ("udrive-nvme-spdk", &None),
            Self::SpdkVhost => ("spdk-vhost", &None),
            Self::UdriveVhostSpdk => ("udrive-vhost-spdk", &None),
            Self::Vm(v) => (v.name(), &None),
            Self::Fake(n) => (n.as_str(), &None),
        };
        f.write_str(name)?;
        if let Some(p) = poll {
            write!(f, "@{}", p.as_str())?;
        }
        if let Some(v) = self.variant() {
            write!(f, "+{v}")?;
        }
        if self.is_b() {
            f.write_str("~b")?;
        }
        Ok(())
    }
}

/// udrive's poll modes (`serve --poll`, docs/poll-modes.md).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
#[serde(rename_all = "kebab-case")]
pub enum Poll {
    #[default]
    Busy,
    Adaptive,
    Event,
}

impl Poll {
    const ALL: [Poll; 3] = [Poll::Busy, Poll::Adaptive, Poll::Event];
    pub fn as_str(self) -> &'static str {
        match self {
            Poll::Busy => "busy",
            Poll::Adaptive => "adaptive",
            Poll::Event => "event",
        }
    }
}
