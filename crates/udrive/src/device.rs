//! Wiring one NVMe controller model to one vfio-user socket.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use guest_mem::DmaSpace;
use lifecycle::{KeepHandle, Kept, Record};
use vfio_user::proto::SparseArea;
use vfio_user::{BarSpec, Irqs, MsixSpec, PciBackend, PciDeviceSpec, PciIds, VfioUserServer};

use bdev::{BlockDevice, QosDisk};

use crate::config::ControllerConfig;
use crate::frontend::{DiskRef, FrontEnd};
use crate::nsspec::NsSpec;
use crate::process::DeviceLife;
use crate::resize::{ResizeError, ResizeRequest, Resized};

/// PCI identity of udrive's NVMe function; the vendor ID is the one Identify
/// Controller reports (a placeholder until the project registers IDs).
pub const PCI_VENDOR: u16 = nvme::VENDOR_ID;
pub const PCI_DEVICE_NVME: u16 = 0x0dd1;
const NVME_CLASS: u32 = 0x01_08_02;

/// The NVMe model as seen by the vfio-user transport.
struct NvmeFunction {
    ctrl: nvme::Controller,
    /// A handover brings the controller's state (restored once the old process
    /// let go): a resumed client then needs no reset. What `resumed` saw of the
    /// client's doorbell mapping is kept for the fallback.
    state_follows: bool,
    bar_mmap: std::sync::atomic::AtomicBool,
}

impl PciBackend for NvmeFunction {
    fn bar_read(&self, bar: u32, offset: u64, data: &mut [u8]) {
        if bar == 0 {
            self.ctrl.bar0_read(offset, data);
        } else {
            data.fill(0);
        }
    }
    fn bar_write(&self, bar: u32, offset: u64, data: &[u8]) {
        if bar == 0 {
            self.ctrl.bar0_write(offset, data);
        }
    }
    fn reset(&self) {
        self.ctrl.reset();
    }
    fn client_gone(&self) {
        self.ctrl.client_gone();
    }
    fn offer_mmap(&self, bar: u32) -> bool {
        bar == 0 && self.ctrl.offer_doorbell_mmap()
    }
    fn dma_messages(&self, writable: bool) -> Result<(), i32> {
        self.ctrl.use_dma_messages(writable)
    }
    fn restored(&self, bar_mmap: bool) {
        self.bar_mmap
            .store(bar_mmap, std::sync::atomic::Ordering::Release);
        if !self.state_follows {
            self.ctrl.restore_lost(bar_mmap);
        }
    }
}

/// The transport's interrupt table as the NVMe model's interrupt sink.
struct IrqSink(Arc<Irqs>);

impl nvme::InterruptSink for IrqSink {
    fn signal(&self, vector: u16) {
        self.0.signal(vector);
    }
}

/// One namespace of a running controller: how it was specified and its QoS handle.
pub struct Namespace {
    pub spec: NsSpec,
    pub qos: Arc<QosDisk>,
}

/// A running NVMe controller behind a vfio-user socket.
pub struct NvmeDevice {
    pub socket: std::path::PathBuf,
    pub ctrl: nvme::Controller,
    server: Option<VfioUserServer>,
    /// The configuration it was started with; `placement` follows `set_placement`.
    pub cfg: ControllerConfig,
    pub cntlid: u16,
    /// Active namespaces by NSID (kept in step with the controller by the control
    /// plane, which owns the device).
    pub namespaces: BTreeMap<u32, Namespace>,
    /// Where the controller keeps records for a successor (under its prefix).
    keep: KeepHandle,
    /// A predecessor's controller state (JSON), restored on [`FrontEnd::resume`].
    pending_state: Option<(Vec<u8>, Arc<NvmeFunction>)>,
}

impl NvmeDevice {
    /// Where a controller on `socket` keeps its records.
    pub fn keep_prefix(socket: &Path) -> String {
        format!("vfu:{}#", socket.display())
    }

    /// Starts the controller with `devs` as namespaces 1.. (in `cfg.namespaces`
    /// order); `life` says where it keeps records and what a predecessor left it.
    pub fn start(
        cfg: &ControllerConfig,
        devs: Vec<Arc<QosDisk>>,
        cntlid: u16,
        engine: &Arc<engine::Engine>,
        base_reactors: usize,
        life: DeviceLife,
    ) -> Result<NvmeDevice> {
        let what = format!("controller {}", cfg.socket.display());
        let placer = placer(cfg.placement, cntlid, base_reactors);
        let namespaces: BTreeMap<u32, Namespace> = cfg
            .namespaces
            .iter()
            .zip(&devs)
            .enumerate()
            .map(|(i, (spec, qos))| {
                let ns = Namespace {
                    spec: spec.clone(),
                    qos: qos.clone(),
                };
                (cfg.nsid(i), ns)
            })
            .collect();
        // By NSID, inactive ones None.
        let top = namespaces.keys().next_back().copied().unwrap_or(0) as usize;
        let mut devs: Vec<Option<Arc<dyn BlockDevice>>> = vec![None; top];
        for (id, ns) in &namespaces {
            devs[*id as usize - 1] = Some(ns.qos.clone() as Arc<dyn BlockDevice>);
        }
        let mem = DmaSpace::try_new()?;
        let nvme_cfg = nvme::ControllerConfig {
            serial: cfg.serial(),
            model: "udrive NVMe".into(),
            firmware: env!("CARGO_PKG_VERSION").into(),
            max_io_queues: cfg.io_queues,
            msix_vectors: cfg.io_queues + 1,
            cntlid,
            max_namespaces: cfg.max_namespaces,
            poll: cfg.poll,
            adaptive_idle: std::time::Duration::from_micros(cfg.poll_idle_us),
            ..Default::default()
        };
        let bar0 = nvme::bar0_layout(nvme_cfg.msix_vectors);
        let msix = MsixSpec {
            vectors: nvme_cfg.msix_vectors,
            table_bar: 0,
            table_offset: bar0.msix_table as u32,
            pba_bar: 0,
            pba_offset: bar0.msix_pba as u32,
        };
        let irqs = Irqs::new(msix.vectors);
        let DeviceLife {
            keep,
            restore: mut kept,
            paused,
        } = life;
        let doorbells = kept
            .remove("bar")
            .and_then(Kept::into_fd)
            .map(|fd| guest_mem::SharedMem::adopt(fd, nvme::DOORBELL_PAGE_LEN))
            .transpose()
            .with_context(|| format!("{what}: cannot map the kept doorbell page"))?;
        let ctrl = nvme::Controller::with_doorbells(
            nvme_cfg,
            devs,
            engine.clone(),
            placer,
            mem.clone(),
            Arc::new(IrqSink(irqs.clone())),
            doorbells,
        )
        .with_context(|| format!("{what}: cannot create the NVMe controller"))?;
        keep.put("bar", &[], &[ctrl.doorbells().fd()]);
        // A listening socket handed over: it stays bound where clients find it.
        let listener = kept.remove("listen").and_then(Kept::into_fd).map(Arc::new);
        // A handover's controller state, restored when the old process let go.
        let state = kept.remove("state");
        let conn_records = lifecycle::keep::take_prefix(&mut kept, "c/");
        let doorbell_fd = ctrl
            .doorbells()
            .fd()
            .try_clone_to_owned()
            .context("cannot duplicate the doorbell memfd")?;
        let spec = PciDeviceSpec {
            ids: PciIds {
                vendor: PCI_VENDOR,
                device: PCI_DEVICE_NVME,
                subsystem_vendor: PCI_VENDOR,
                subsystem: PCI_DEVICE_NVME,
                class_code: NVME_CLASS,
                revision: 1,
            },
            bar0: BarSpec {
                size: bar0.size,
                mmap_fd: Some(doorbell_fd),
                fd_offset: 0,
                sparse: vec![SparseArea {
                    offset: nvme::DOORBELL_OFFSET,
                    size: 0x1000,
                }],
            },
            msix,
        };
        let backend = Arc::new(NvmeFunction {
            ctrl: ctrl.clone(),
            state_follows: state.is_some(),
            bar_mmap: Default::default(),
        });
        let server = VfioUserServer::restore(
            vfio_user::ServerConfig {
                socket: cfg.socket.clone(),
                access: cfg.socket_perms().access()?,
                name: cfg.serial(),
                dma_reply_timeout: vfio_user::DEFAULT_DMA_REPLY_TIMEOUT,
                keep: Some(keep.child("c/")),
                listener,
                start_paused: paused,
            },
            spec,
            backend.clone(),
            mem,
            irqs,
            conn_records,
        )
        .with_context(|| format!("{what}: cannot listen on {}", cfg.socket.display()));
        let server = match server {
            Ok(s) => s,
            Err(e) => {
                ctrl.shutdown();
                return Err(e);
            }
        };
        Ok(NvmeDevice {
            socket: cfg.socket.clone(),
            ctrl,
            server: Some(server),
            cfg: cfg.clone(),
            cntlid,
            namespaces,
            keep,
            pending_state: state.map(|s| (s.bytes, backend)),
        })
    }

    /// Whether a vfio-user client (a VM, an initiator) is attached.
    pub fn connected(&self) -> bool {
        self.server.as_ref().is_some_and(|s| s.client_connected())
    }

    /// Namespace specs in NSID order, for messages.
    pub fn namespace_specs(&self) -> Vec<String> {
        self.namespaces
            .iter()
            .map(|(id, n)| format!("{id}={}", n.spec))
            .collect()
    }

    /// Queue placement for queues created from now on.
    pub fn set_placement(&mut self, placement: engine::Placement, base_reactors: usize) {
        self.ctrl
            .set_placer(placer(placement, self.cntlid, base_reactors));
        self.cfg.placement = placement;
    }

    /// DMA_READ/DMA_WRITE traffic with clients that did not share their memory.
    pub fn dma_messages(&self) -> vfio_user::DmaMessageCounts {
        self.server
            .as_ref()
            .map(|s| s.dma_messages())
            .unwrap_or_default()
    }

    pub fn stop(mut self) {
        let dma = self.dma_messages();
        if let Some(s) = self.server.take() {
            s.stop();
        }
        self.keep.remove_all();
        let st = self.ctrl.stats();
        tracing::info!(
            socket = %self.socket.display(),
            reads = st.reads,
            writes = st.writes,
            flushes = st.flushes,
            other_io = st.other_io,
            io_errors = st.io_errors,
            admin_commands = st.admin_commands,
            doorbell_buffer_configured = st.doorbell_buffer_configured,
            shadow_doorbell_reads = st.shadow_doorbell_reads,
            dma_read_messages = dma.reads,
            dma_write_messages = dma.writes,
            dma_message_timeouts = dma.timeouts,
            "controller statistics"
        );
        self.ctrl.shutdown();
    }
}

/// NVMe queues use the server's shared reactors (`--cpus`) only: reactors the engine
/// grew for `dedicated` vhost-user-blk devices belong to those devices.
fn placer(placement: engine::Placement, cntlid: u16, base_reactors: usize) -> engine::Placer {
    engine::Placer::new(placement, usize::from(cntlid), base_reactors)
}

/// The QEMU command line that attaches `socket` (QEMU 10.1+ has `vfio-user-pci`).
pub fn qemu_command(socket: &Path) -> String {
    let abs = std::fs::canonicalize(socket).unwrap_or_else(|_| socket.to_path_buf());
    format!(
        "qemu-system-x86_64 -machine q35,accel=kvm -cpu host -smp 2 -m 2G \\\n  \
         -object memory-backend-memfd,id=mem0,size=2G,share=on -numa node,memdev=mem0 \\\n  \
         -device '{{\"driver\":\"vfio-user-pci\",\"socket\":{{\"path\":\"{}\",\"type\":\"unix\"}}}}' \\\n  \
         ...your kernel/disk options...",
        abs.display()
    )
}

impl FrontEnd for NvmeDevice {
    fn what(&self) -> &'static str {
        "an NVMe controller"
    }
    fn remove_method(&self) -> &'static str {
        "nvme_remove_controller"
    }
    fn connected(&self) -> bool {
        NvmeDevice::connected(self)
    }
    fn stop(self: Box<Self>) {
        NvmeDevice::stop(*self)
    }
    fn json(&self) -> Value {
        let d = self;
        let st = d.ctrl.stats();
        let groups: Vec<Value> = d
            .ctrl
            .queue_reactors()
            .into_iter()
            .map(|(cqid, reactor)| json!({"cqid": cqid, "reactor": reactor}))
            .collect();
        json!({
            "kind": "nvme",
            "socket": d.socket,
            "socket_access": crate::json::socket_access_json(&d.cfg.socket_perms()),
            "serial": d.cfg.serial(),
            "cntlid": d.cntlid,
            "connected": d.connected(),
            "placement": d.cfg.placement.as_str(),
            "poll": d.cfg.poll.as_str(),
            "poll_idle_us": d.cfg.poll_idle_us,
            "io_queues": d.cfg.io_queues,
            "max_namespaces": d.ctrl.max_namespaces(),
            "state": {
                "ready": st.ready,
                "fatal": st.fatal,
                "poll_mode": d.ctrl.poll_mode().as_str(),
                // mapped: the client writes doorbells into shared memory, so queues
                // cannot sleep; messages: doorbells arrive as vfio-user messages.
                "doorbells": if d.ctrl.doorbells_mapped() { "mapped" } else { "messages" },
                "can_sleep": d.ctrl.poll_mode() != engine::PollMode::Busy && !d.ctrl.doorbells_mapped(),
                "doorbell_buffer_configured": st.doorbell_buffer_configured,
                // The client's memory (some of it) is not shared: it moves by
                // DMA_READ/DMA_WRITE messages (the slow path).
                "dma_messages": d.ctrl.dma_messages(),
                "io_submission_queues": st.io_queues,
                "io_completion_queues": st.io_completion_queues,
                "queue_groups": groups,
            },
            "dma_message_counts": d.dma_messages(),
            "namespaces": d.namespaces.iter().map(|(id, ns)| namespace_json(*id, ns, d.ctrl.namespace_info(*id))).collect::<Vec<_>>(),
        })
    }
    fn banner(&self) -> String {
        format!(
            "udrive: NVMe controller on {} with namespaces {}",
            self.socket.display(),
            self.namespaces
                .values()
                .map(|n| n.spec.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
    fn attach_hint(&self) -> String {
        format!(
            "\nAttach a VM (QEMU 10.1+; share guest RAM as a memfd, as below, for the fast \
             path: without it QEMU keeps RAM to itself and every byte of I/O travels as a \
             DMA_READ/DMA_WRITE message, several times slower):\n\n{}\n\n{}",
            qemu_command(&self.socket),
            crate::frontend::measure_hint("vfio-user", &self.socket)
        )
    }
    fn qos(&self, nsid: Option<u32>) -> anyhow::Result<&bdev::QosDisk> {
        let Some(nsid) = nsid else {
            anyhow::bail!(
                "give the nsid of the namespace of NVMe controller {}",
                self.socket.display()
            );
        };
        match self.namespaces.get(&nsid) {
            Some(ns) => Ok(&ns.qos),
            None => anyhow::bail!(
                "controller {} has no namespace {nsid} (namespaces: {})",
                self.socket.display(),
                self.namespace_specs().join(", ")
            ),
        }
    }
    fn set_poll_mode(&mut self, mode: engine::PollMode) -> anyhow::Result<()> {
        self.ctrl.set_poll_mode(mode);
        self.cfg.poll = mode;
        if mode != engine::PollMode::Busy && self.ctrl.doorbells_mapped() {
            tracing::warn!(
                socket = %self.socket.display(),
                "poll mode {mode}: the connected client has the doorbell page mapped, so its \
                 queues keep polling busily until it reconnects (doorbells then come by message)"
            );
        }
        Ok(())
    }
    fn resize(&mut self, nsid: Option<u32>, req: &ResizeRequest) -> Result<Resized, ResizeError> {
        use bdev::BlockDevice;
        let Some(nsid) = nsid else {
            return Err(anyhow::anyhow!(
                "give the nsid of the namespace of NVMe controller {} to resize",
                self.socket.display()
            )
            .into());
        };
        let Some(ns) = self.namespaces.get(&nsid) else {
            return Err(anyhow::anyhow!(
                "controller {} has no namespace {nsid} (namespaces: {})",
                self.socket.display(),
                self.namespace_specs().join(", ")
            )
            .into());
        };
        let who = format!(
            "namespace {nsid} ({}) of {}",
            ns.spec,
            self.socket.display()
        );
        // The host addresses it in its current LBA size (Format NVM may have
        // changed it); the backend's size is what grows or shrinks.
        let block_size = self
            .ctrl
            .namespace_info(nsid)
            .map_or(ns.qos.info().block_size, |i| i.block_size);
        let old_bytes = ns.qos.info().size_bytes();
        crate::resize::check(&who, &ns.spec, old_bytes, block_size, req)?;
        if req.bytes == old_bytes {
            return Ok(crate::resize::unchanged(old_bytes, block_size));
        }
        let mut made = None;
        let notice = self
            .ctrl
            .resize_namespace(nsid, req.bytes, |b| {
                let q = Arc::new(ns.qos.resized(b)?);
                made = Some(q.clone());
                Ok(q)
            })
            .map_err(|e| match e {
                nvme::NsError::Size { bytes, block_size } => ResizeError::BadSize {
                    who: who.clone(),
                    bytes,
                    block_size,
                },
                // Only the channels come after the backend's resize.
                e @ nvme::NsError::Channel(_) => anyhow::Error::new(e)
                    .context(format!(
                        "{who}: the backend has the new size, the namespace keeps the old one"
                    ))
                    .into(),
                e => anyhow::Error::new(e).context(who.clone()).into(),
            })?;
        let spec = ns.spec.resized(req.bytes);
        if let (Some(qos), Some(ns)) = (made, self.namespaces.get_mut(&nsid)) {
            ns.qos = qos;
            ns.spec = spec;
        }
        let (notified, notice) = match notice {
            nvme::NsNotice::Event => (
                true,
                "Namespace Attribute Changed event sent; the host reads the Changed Namespace List",
            ),
            nvme::NsNotice::Pending => (
                true,
                "added to the Changed Namespace List of the event the host has not acknowledged yet",
            ),
            nvme::NsNotice::Disabled => (
                false,
                "the host did not enable Namespace Attribute Notices: it sees the new size when it \
                 identifies the namespace again (e.g. nvme ns-rescan)",
            ),
            nvme::NsNotice::NotReady => (
                false,
                "the controller is not enabled: the host sees the new size when it identifies the namespace",
            ),
        };
        Ok(Resized {
            old_bytes,
            new_bytes: req.bytes,
            block_size,
            notified,
            notice: notice.into(),
        })
    }
    /// The vfio-user endpoint pauses at a message boundary, then the controller
    /// lets its queues finish what they fetched (decisions 0022, 0023).
    fn pause(&self, limit: std::time::Duration) -> Result<()> {
        let what = || format!("controller {}", self.socket.display());
        let Some(s) = &self.server else {
            bail!("{} is stopping", what());
        };
        s.pause()
            .map_err(|e| anyhow!(e).context(format!("{}: cannot pause", what())))?;
        if let Err(e) = self.ctrl.pause(limit) {
            self.ctrl.resume();
            s.resume();
            return Err(anyhow!(e).context(format!("{}: cannot pause", what())));
        }
        Ok(())
    }

    /// After a failed handover: the controller and its endpoint go on. A restored
    /// controller first takes the state its predecessor saved; one that does not
    /// restore (it was checked before, so this is not expected) is left in fatal
    /// status, which the host's driver resets: the client keeps its disk either way.
    fn resume(&mut self) {
        match self.pending_state.take() {
            Some((bytes, f)) => {
                let restored = serde_json::from_slice::<nvme::ControllerState>(&bytes)
                    .map_err(|e| e.to_string())
                    .and_then(|st| self.ctrl.restore(st).map_err(|e| e.to_string()));
                if let Err(e) = restored {
                    tracing::error!(
                        socket = %self.socket.display(),
                        "handover: controller state not restored ({e}); the host will reset the controller"
                    );
                    self.ctrl
                        .restore_lost(f.bar_mmap.load(std::sync::atomic::Ordering::Acquire));
                }
            }
            None => self.ctrl.resume(),
        }
        if let Some(s) = &self.server {
            s.resume();
        }
    }

    /// The listening socket and the controller's state; the connection's records
    /// are kept as the client changes them.
    fn save(&self) -> Result<Vec<Record>> {
        let Some(s) = &self.server else {
            bail!("controller {} is stopping", self.socket.display());
        };
        let listener = s
            .listener()
            .try_clone_to_owned()
            .context("cannot duplicate the listening socket")?;
        let state = self.ctrl.save().with_context(|| {
            format!(
                "controller {}: cannot save its state",
                self.socket.display()
            )
        })?;
        let prefix = self.keep.prefix();
        Ok(vec![
            Record::new(format!("{prefix}listen"), Vec::new(), vec![listener]),
            Record::new(
                format!("{prefix}state"),
                serde_json::to_vec(&state)?,
                Vec::new(),
            ),
        ])
    }

    fn check_restored(&self) -> Result<()> {
        if let Some((bytes, _)) = &self.pending_state {
            let st: nvme::ControllerState = serde_json::from_slice(bytes)
                .with_context(|| format!("controller {}: bad state", self.socket.display()))?;
            if st.version != nvme::STATE_VERSION {
                bail!(
                    "controller {}: state version {} (this udrive restores {})",
                    self.socket.display(),
                    st.version,
                    nvme::STATE_VERSION
                );
            }
        }
        Ok(())
    }

    fn disks(&self) -> Vec<DiskRef<'_>> {
        self.namespaces
            .iter()
            .map(|(id, ns)| DiskRef {
                name: format!("namespace {id} of {}", self.socket.display()),
                spec: &ns.spec,
                disk: &ns.qos,
            })
            .collect()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// `info`: the namespace as the host sees it (after a Format NVM its block size
/// is no longer the backend's); `None` uses the backend's.
pub(crate) fn namespace_json(nsid: u32, ns: &Namespace, info: Option<bdev::BlockInfo>) -> Value {
    use bdev::BlockDevice;
    let info = info.unwrap_or_else(|| ns.qos.info().clone());
    json!({
        "nsid": nsid,
        "spec": ns.spec.to_string(),
        "backend": ns.qos.describe(),
        "size_bytes": info.size_bytes(),
        "block_size": info.block_size,
        "read_only": info.read_only,
        "qos": crate::json::qos_json(ns.qos.limits()),
    })
}

impl crate::stats::Traced for NvmeDevice {
    fn socket(&self) -> &Path {
        &self.socket
    }
    fn kind(&self) -> &'static str {
        "nvme"
    }
    fn observed(&self) -> &dyn frontend_core::Observed {
        &self.ctrl
    }
}

/// What only an NVMe controller has (namespaces).
impl dyn FrontEnd {
    pub fn as_nvme_mut(&mut self) -> Option<&mut NvmeDevice> {
        self.as_any_mut().downcast_mut()
    }
    pub fn as_nvme(&self) -> Option<&NvmeDevice> {
        self.as_any().downcast_ref()
    }
}
