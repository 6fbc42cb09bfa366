//! vhost-user-blk devices in `udrive serve`: reactor placement, starting one, and
//! the QEMU command line that attaches one. Their config table
//! (`crate::config::VhostBlkConfig`):
//!
//! ```toml
//! [[vhost_user_blk]]
//! socket = "/run/udrive/vm1-blk.sock"
//! disk = "file:/srv/vm1.img"
//! queues = 2                 # virtqueues (give the guest at least as many vCPUs)
//! placement = "dedicated"    # dedicated | round-robin | single
//! poll = "adaptive"          # busy | adaptive | event
//! cpus = "0-1"               # CPUs for dedicated reactors (cycled); default: top-level cpus
//! ```

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::os::fd::OwnedFd;

use anyhow::{anyhow, Context, Result};
use engine::{Engine, Placement, Placer, PollMode};
use lifecycle::{KeptRecords, Record};
use vhost_user_blk::{BlkDeviceOptions, DeviceOptions, HandoverState, VhostUserBlk};

use crate::frontend::{DiskRef, FrontEnd};
use crate::nsspec::NsSpec;

pub use crate::config::{default_queues, validate, VhostBlkConfig};

/// Reactors for each queue of one device. `base` is the number of shared reactors
/// (from `--cpus`); `dedicated` adds reactors of the device's own.
pub fn reactors_for(
    cfg: &VhostBlkConfig,
    index: usize,
    engine: &Engine,
    base: usize,
) -> Result<Vec<usize>> {
    let policy = cfg.placement;
    let nq = usize::from(cfg.queues);
    if let Placement::Dedicated = policy {
        let cpus = match &cfg.cpus {
            Some(c) => engine::parse_cpu_list(c)
                .map_err(anyhow::Error::msg)?
                .into_iter()
                .map(Some)
                .collect(),
            // Default: the CPUs of the shared reactors (`--cpus`), cycled.
            None => {
                let shared: Vec<Option<usize>> = (0..base).map(|i| engine.cpu_of(i)).collect();
                if shared.is_empty() {
                    vec![None]
                } else {
                    shared
                }
            }
        };
        return (0..nq)
            .map(|q| {
                engine
                    .add_reactor(cpus[q % cpus.len()])
                    .context("cannot start a dedicated reactor")
            })
            .collect();
    }
    let placer = Placer::new(policy, index, base);
    Ok((0..nq).map(|q| placer.reactor_for(q)).collect())
}

/// Where a device on `socket` keeps its records.
pub fn keep_prefix(socket: &Path) -> String {
    format!("vhost:{}#", socket.display())
}

/// Starts one device on `disk`; restored from `restore`, the records a
/// predecessor saved for it (see [`FrontEnd::save`]), if there are any.
pub fn start(
    cfg: &VhostBlkConfig,
    disk: Arc<dyn bdev::BlockDevice>,
    index: usize,
    engine: &Arc<Engine>,
    base_reactors: usize,
    restore: KeptRecords,
) -> Result<VhostUserBlk> {
    let access = cfg.socket_perms().access().with_context(|| cfg.what())?;
    let reactors = reactors_for(cfg, index, engine, base_reactors)?;
    let opts = BlkDeviceOptions {
        device: DeviceOptions {
            num_queues: cfg.queues,
            queue_size: cfg.queue_size,
            serial: cfg.serial(),
            ..Default::default()
        },
        poll: cfg.poll,
        access,
        migration: migration_options(&cfg.disk, &disk)?,
    };
    // A handover: the device as the old process saved it, restored paused.
    if let Some((state, fds)) = saved_state(&cfg.socket, restore)? {
        return VhostUserBlk::restore(&cfg.socket, disk, opts, engine, &reactors, state, fds)
            .with_context(|| format!("cannot take over {}", cfg.what()));
    }
    VhostUserBlk::start(&cfg.socket, disk, opts, engine, &reactors)
        .with_context(|| format!("cannot start {}", cfg.what()))
}

/// How the device on `spec` (opened as `disk`) takes part in a live migration:
/// whether its data can follow the VM, its writer claim (none for a `shared` or
/// read-only disk: it writes beside others, or not at all) and whether it is the
/// destination.
fn migration_options(
    spec: &NsSpec,
    disk: &Arc<dyn bdev::BlockDevice>,
) -> Result<vhost_user_blk::MigrationOptions> {
    let kind = &spec.kind.0;
    let claim = if spec.shared || spec.read_only {
        None
    } else {
        let range = spec.slice.map_or((0, 0), |(o, s)| (o, s.unwrap_or(0)));
        kind.writer_claim(disk, range)?
    };
    Ok(vhost_user_blk::MigrationOptions {
        refusal: kind.migration_refusal().map(String::from),
        claim,
        incoming: spec.incoming,
    })
}

/// How to attach QEMU to a device.
pub fn qemu_command(socket: &Path, queues: u16) -> String {
    format!(
        "qemu-system-x86_64 -machine q35,accel=kvm -m 1G -smp {queues} \\\n  \
         -object memory-backend-memfd,id=mem,size=1G,share=on -numa node,memdev=mem \\\n  \
         -chardev socket,id=c0,path={},reconnect=1 \\\n  \
         -device vhost-user-blk-pci,chardev=c0,num-queues={queues} ...",
        socket.display()
    )
}

impl FrontEnd for VhostBlkDevice {
    fn what(&self) -> &'static str {
        "a vhost-user-blk device"
    }
    fn remove_method(&self) -> &'static str {
        "vhost_user_blk_remove"
    }
    fn connected(&self) -> bool {
        self.dev.connected()
    }
    fn writes_disk(&self) -> bool {
        self.dev.writes_disk()
    }
    fn stop(self: Box<Self>) {
        self.dev.stop()
    }
    fn json(&self) -> Value {
        let v = self;
        let mut out = json!({
            "kind": "vhost-user-blk",
            "socket": v.cfg.socket,
            "socket_access": crate::json::socket_access_json(&v.cfg.socket_perms()),
            "connected": v.dev.connected(),
            "connections": v.dev.connections(),
            "config": {
                "disk": v.cfg.disk.to_string(),
                "queues": v.cfg.queues,
                "queue_size": v.cfg.queue_size,
                "placement": v.cfg.placement.as_str(),
                "poll": v.cfg.poll.as_str(),
                "read_only": v.cfg.disk.read_only,
            },
            // What the config space reports (a resize changes it).
            "size_bytes": v.dev.capacity_bytes(),
            "qos": crate::json::qos_json(v.disk.limits()),
            "state": {
                "writer": v.dev.writes_disk(),
                "poll_mode": v.dev.poll_mode().as_str(),
                "queue_reactors": v.dev.queue_reactors(),
            },
        });
        if let Some(image) = crate::json::image_json(&*v.disk) {
            out["image"] = image;
        }
        out
    }
    fn banner(&self) -> String {
        format!(
            "udrive: vhost-user-blk device on {} with disk {} ({} queues, placement {}, poll {})",
            self.cfg.socket.display(),
            self.cfg.disk,
            self.cfg.queues,
            self.cfg.placement,
            self.cfg.poll
        )
    }
    fn attach_hint(&self) -> String {
        format!(
            "\nAttach a VM (guest RAM must be a shared memfd):\n\n{}\n\n{}",
            qemu_command(&self.cfg.socket, self.cfg.queues),
            crate::frontend::measure_hint("vhost-user", &self.cfg.socket)
        )
    }
    fn qos(&self, nsid: Option<u32>) -> Result<Arc<bdev::QosDisk>> {
        if nsid.is_some_and(|n| n != 1) {
            anyhow::bail!(
                "{} is a vhost-user-blk device: its one disk is nsid 1 (or leave nsid out)",
                self.cfg.socket.display()
            );
        }
        Ok(self.disk.clone())
    }
    fn set_poll_mode(&mut self, mode: PollMode) -> Result<()> {
        self.dev.set_poll_mode(mode);
        self.cfg.poll = mode;
        Ok(())
    }
    fn resize(
        &mut self,
        nsid: Option<u32>,
        req: &crate::resize::ResizeRequest,
    ) -> std::result::Result<crate::resize::Resized, crate::resize::ResizeError> {
        use bdev::BlockDevice;
        use vhost_user_blk::ConfigNotice;
        if nsid.is_some_and(|n| n != 1) {
            return Err(anyhow::anyhow!(
                "{} is a vhost-user-blk device: its one disk is nsid 1 (or leave nsid out)",
                self.cfg.socket.display()
            )
            .into());
        }
        let who = format!(
            "the disk ({}) of {}",
            self.cfg.disk,
            self.cfg.socket.display()
        );
        let info = self.disk.info().clone();
        let old_bytes = info.size_bytes();
        crate::resize::check(&who, &self.cfg.disk, old_bytes, info.block_size, req)?;
        if req.bytes == old_bytes {
            return Ok(crate::resize::unchanged(old_bytes, info.block_size));
        }
        let disk = Arc::new(
            self.disk
                .resized(req.bytes)
                .map_err(|e| anyhow::Error::new(e).context(who.clone()))?,
        );
        let notice = self.dev.resize(disk.clone()).map_err(|e| {
            anyhow::Error::new(e).context(format!(
                "{who}: the backend has the new size, the device keeps the old one"
            ))
        })?;
        self.disk = disk;
        self.cfg.disk = self.cfg.disk.resized(req.bytes);
        let (notified, notice) = match notice {
            ConfigNotice::Sent => (
                true,
                "configuration change sent to the front end (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG)"
                    .to_string(),
            ),
            ConfigNotice::NoFrontEnd => (
                false,
                "no front end is connected: the next one reads the new capacity".into(),
            ),
            ConfigNotice::NotNegotiated => (
                false,
                "the front end was not notified: it did not negotiate VHOST_USER_PROTOCOL_F_CONFIG \
                 and F_BACKEND_REQ (or gave no channel); it sees the new capacity when it reads \
                 the config space again"
                    .into(),
            ),
            ConfigNotice::Failed(e) => (
                false,
                format!("the front end was not notified: sending the configuration change failed: {e}"),
            ),
        };
        Ok(crate::resize::Resized {
            old_bytes,
            new_bytes: req.bytes,
            block_size: info.block_size,
            notified,
            notice,
        })
    }
    /// The device takes no new requests and finishes those in flight (bounded);
    /// the front end's socket is not read meanwhile (decision 0024).
    fn pause(&self, limit: std::time::Duration) -> Result<()> {
        self.dev.pause(limit).map_err(|e| {
            self.dev.resume();
            anyhow!(e).context(format!("{}: cannot pause", self.cfg.what()))
        })
    }

    fn resume(&mut self) {
        if self.dev.paused() {
            self.dev.resume();
        }
    }

    /// The device's state and its fds, one record per fd (a message carries few).
    fn save(&self) -> Result<Vec<Record>> {
        let (state, fds) = self
            .dev
            .save()
            .with_context(|| format!("{}: cannot save it", self.cfg.what()))?;
        let p = self.prefix();
        let mut out = vec![Record::new(
            format!("{p}state"),
            serde_json::to_vec(&state)?,
            Vec::new(),
        )];
        for (i, fd) in fds.into_iter().enumerate() {
            out.push(Record::new(format!("{p}fd/{i:04}"), Vec::new(), vec![fd]));
        }
        Ok(out)
    }

    fn disks(&self) -> Vec<DiskRef> {
        vec![DiskRef {
            name: self.cfg.what(),
            spec: self.cfg.disk.clone(),
            disk: self.disk.clone(),
        }]
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl crate::stats::Traced for VhostBlkDevice {
    fn socket(&self) -> &Path {
        &self.cfg.socket
    }
    fn kind(&self) -> &'static str {
        "vhost-user-blk"
    }
    fn observed(&self) -> &dyn frontend_core::Observed {
        &self.dev
    }
}

/// What only a vhost-user-blk device has (its queues' placement).
impl dyn FrontEnd {
    pub fn as_vhost(&self) -> Option<&VhostBlkDevice> {
        self.as_any().downcast_ref()
    }

    pub fn as_vhost_mut(&mut self) -> Option<&mut VhostBlkDevice> {
        self.as_any_mut().downcast_mut()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::config::disk_specs;

    #[test]
    fn toml_and_checks() {
        let c: crate::config::Config = toml::from_str(
            r#"
            [[vhost_user_blk]]
            socket = "/tmp/a.sock"
            disk = "ram:64M"
            queues = 2
            placement = "dedicated"
            poll = "adaptive"
            "#,
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.vhost_user_blk[0].queues, 2);
        let bad: Result<crate::config::Config, _> = toml::from_str(
            "[[vhost_user_blk]]\nsocket = \"/tmp/a.sock\"\ndisk = \"ram:64M\"\npoll = \"sometimes\"",
        );
        let e = bad.unwrap_err().to_string();
        assert!(e.contains("unknown poll mode `sometimes`"), "{e}");
        let mut bad = c.vhost_user_blk[0].clone();
        bad.queues = 0;
        assert!(validate(&[bad], &mut HashSet::new()).is_err());
        let twice = vec![c.vhost_user_blk[0].clone(), c.vhost_user_blk[0].clone()];
        assert!(validate(&twice, &mut HashSet::new()).is_err());
    }

    #[test]
    fn overlapping_file_slices_across_device_kinds() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("pool.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        let nvme = crate::config::ControllerConfig::new(
            dir.path().join("nvme.sock"),
            vec![format!("file:{},offset=0,size=4M", img.display())
                .parse()
                .unwrap()],
        );
        let disk = |off: &str| -> VhostBlkConfig {
            VhostBlkConfig::new(
                dir.path().join("blk.sock"),
                format!("file:{},offset={off},size=4M", img.display())
                    .parse()
                    .unwrap(),
            )
        };
        let cfg = |d: VhostBlkConfig| crate::config::Config {
            cpus: "0".into(),
            controllers: vec![crate::config::ControllerConfig::new(
                nvme.socket.clone(),
                nvme.namespaces.clone(),
            )],
            vhost_user_blk: vec![d],
            ..Default::default()
        };
        let open = |c: &crate::config::Config| {
            crate::backends::open_all_set(
                Arc::new(crate::kinds::NoEnv),
                &c.controllers,
                &disk_specs(c),
            )
            .map(|(_, n, b)| (n, b))
        };
        let err = open(&cfg(disk("2M"))).err().expect("overlap refused");
        assert!(format!("{err:#}").contains("overlap"), "{err:#}");
        let (nv, blk) = open(&cfg(disk("4M"))).unwrap();
        assert_eq!((nv.len(), blk.len()), (1, 1));
        assert_eq!(bdev::BlockDevice::info(&*blk[0]).size_bytes(), 4 << 20);
    }
}

/// `udrive serve` options for one vhost-user-blk device.
#[derive(clap::Args, Debug)]
pub struct VhostArgs {
    /// vhost-user socket of a virtio-blk device (with --disk)
    #[arg(
        long,
        value_name = "SOCKET",
        conflicts_with = "config",
        requires = "disk"
    )]
    pub vhost_user_blk: Option<PathBuf>,
    /// Backend of the vhost-user-blk device: same spec as --ns (null:, ram:, file:...)
    #[arg(long, value_name = "SPEC", requires = "vhost_user_blk")]
    pub disk: Option<String>,
    /// Virtqueues of the vhost-user-blk device
    #[arg(long, default_value_t = default_queues())]
    pub queues: u16,
}

impl VhostArgs {
    pub fn to_config(
        &self,
        placement: Placement,
        poll: PollMode,
    ) -> Result<Option<VhostBlkConfig>> {
        let (Some(socket), Some(disk)) = (&self.vhost_user_blk, &self.disk) else {
            return Ok(None);
        };
        let disk: NsSpec = disk.parse().map_err(|e| anyhow::anyhow!("--disk: {e}"))?;
        let mut c = VhostBlkConfig::new(socket.clone(), disk);
        c.queues = self.queues;
        c.placement = placement;
        c.poll = poll;
        Ok(Some(c))
    }
}

/// A running vhost-user-blk device with the configuration it was started from.
pub struct VhostBlkDevice {
    pub cfg: VhostBlkConfig,
    pub dev: VhostUserBlk,
    /// The disk as the device sees it: its QoS limits change at run time.
    pub disk: Arc<bdev::QosDisk>,
}

impl VhostBlkDevice {
    fn prefix(&self) -> String {
        keep_prefix(&self.cfg.socket)
    }
}

/// Opens the disk of one device on its own and starts it (tests, tools).
pub fn open_and_start(
    cfg: &VhostBlkConfig,
    engine: &Arc<Engine>,
    base_reactors: usize,
) -> Result<VhostUserBlk> {
    let disk = crate::backends::BackendSet::default().open_disk(&cfg.disk, &cfg.socket)?;
    start(cfg, disk, 0, engine, base_reactors, KeptRecords::new())
}

/// What a predecessor saved for the device on `socket`, if anything: its state and
/// its fds (records `state` and `fd/NNNN`).
fn saved_state(
    socket: &Path,
    mut recs: KeptRecords,
) -> Result<Option<(HandoverState, Vec<OwnedFd>)>> {
    let Some(state) = recs.remove("state") else {
        return Ok(None);
    };
    let state: HandoverState = serde_json::from_slice(&state.bytes)
        .with_context(|| format!("{}: bad handover state", socket.display()))?;
    // `fd/NNNN` in order (fixed width: the map's order is the index order).
    let mut fds = Vec::new();
    for (key, r) in recs {
        if !key.starts_with("fd/") {
            continue;
        }
        fds.push(
            r.into_fd()
                .ok_or_else(|| anyhow!("{}: handover record {key} has no fd", socket.display()))?,
        );
    }
    Ok(Some((state, fds)))
}
