//! Wiring one NVMe controller model to one vfio-user socket.

mod front_end;
mod namespaces;

pub use namespaces::Namespace;

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use guest_mem::DmaSpace;
use lifecycle::{KeepHandle, Kept};
use vfio_user::proto::SparseArea;
use vfio_user::{BarSpec, Irqs, MsixSpec, PciBackend, PciDeviceSpec, PciIds, VfioUserServer};

use bdev::QosDisk;

use crate::config::ControllerConfig;
use crate::process::DeviceLife;

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

/// A running NVMe controller behind a vfio-user socket.
pub struct NvmeDevice {
    pub socket: std::path::PathBuf,
    pub ctrl: nvme::Controller,
    server: Option<VfioUserServer>,
    /// The configuration it was started with; `placement` follows `set_placement`.
    pub cfg: ControllerConfig,
    pub cntlid: u16,
    /// Where the controller keeps records for a successor (under its prefix).
    keep: KeepHandle,
    /// A predecessor's controller state (JSON), restored on [`crate::frontend::FrontEnd::resume`].
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
        let devs = namespaces::by_nsid(cfg, devs);
        let mem = DmaSpace::try_new()?;
        let nvme_cfg = nvme_config(cfg, cntlid);
        let bar0 = nvme::bar0_layout(nvme_cfg.msix_vectors);
        let msix = msix_spec(&bar0, nvme_cfg.msix_vectors);
        let irqs = Irqs::new(msix.vectors);
        let DeviceLife {
            keep,
            restore: mut kept,
            paused,
        } = life;
        // A handover's doorbell page: the client may have it mapped.
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
        let spec = pci_spec(bar0.size, doorbell_fd, msix);
        let backend = Arc::new(NvmeFunction {
            ctrl: ctrl.clone(),
            state_follows: state.is_some(),
            bar_mmap: Default::default(),
        });
        let server = VfioUserServer::restore(
            server_config(cfg, &keep, listener, paused)?,
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
            keep,
            pending_state: state.map(|s| (s.bytes, backend)),
        })
    }

    /// Whether a vfio-user client (a VM, an initiator) is attached.
    pub fn connected(&self) -> bool {
        self.server.as_ref().is_some_and(|s| s.client_connected())
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
            // Not `doorbell_buffer_configured`: the controller reset that the
            // client's disconnect or the server's stop causes has cleared it by
            // now, whatever the guest used before.
            doorbell_buffer_configs = st.doorbell_buffer_configs,
            shadow_doorbell_reads = st.shadow_doorbell_reads,
            dma_read_messages = dma.reads,
            dma_write_messages = dma.writes,
            dma_message_timeouts = dma.timeouts,
            "controller statistics"
        );
        self.ctrl.shutdown();
    }
}

/// The NVMe model's configuration for udrive's controller `cfg`: one MSI-X vector
/// per I/O queue plus the admin queue's.
fn nvme_config(cfg: &ControllerConfig, cntlid: u16) -> nvme::ControllerConfig {
    nvme::ControllerConfig {
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
    }
}

/// MSI-X table and PBA where the NVMe model lays them out in BAR0.
fn msix_spec(bar0: &nvme::Bar0Layout, vectors: u16) -> MsixSpec {
    MsixSpec {
        vectors,
        table_bar: 0,
        table_offset: bar0.msix_table as u32,
        pba_bar: 0,
        pba_offset: bar0.msix_pba as u32,
    }
}

/// The PCI function: udrive's NVMe identity, and BAR0 whose doorbell page is a
/// sparse-mmap area backed by `doorbell_fd`, so that the client's doorbell writes
/// cost no message.
fn pci_spec(bar0_size: u64, doorbell_fd: std::os::fd::OwnedFd, msix: MsixSpec) -> PciDeviceSpec {
    PciDeviceSpec {
        ids: PciIds {
            vendor: PCI_VENDOR,
            device: PCI_DEVICE_NVME,
            subsystem_vendor: PCI_VENDOR,
            subsystem: PCI_DEVICE_NVME,
            class_code: NVME_CLASS,
            revision: 1,
        },
        bar0: BarSpec {
            size: bar0_size,
            mmap_fd: Some(doorbell_fd),
            fd_offset: 0,
            sparse: vec![SparseArea {
                offset: nvme::DOORBELL_OFFSET,
                size: 0x1000,
            }],
        },
        msix,
    }
}

/// The vfio-user server's configuration: connections keep their records under
/// `c/`; `listener` is a predecessor's listening socket; `paused`: a process
/// taking devices over must not serve before the old one has let go.
fn server_config(
    cfg: &ControllerConfig,
    keep: &KeepHandle,
    listener: Option<Arc<std::os::fd::OwnedFd>>,
    paused: bool,
) -> Result<vfio_user::ServerConfig> {
    Ok(vfio_user::ServerConfig {
        socket: cfg.socket.clone(),
        access: cfg.socket_perms().access()?,
        name: cfg.serial(),
        dma_reply_timeout: vfio_user::DEFAULT_DMA_REPLY_TIMEOUT,
        keep: Some(keep.child("c/")),
        listener,
        start_paused: paused,
    })
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
