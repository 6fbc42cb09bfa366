//! The NVMe driver: controller bring-up, admin commands, I/O queue pairs.

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use guest_mem::{MappedRegion, Prot, SharedMem};
use vfio_user::proto::{self, PCI_BAR0_REGION};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::client::VfioUserClient;
use crate::cmd::{opc, Completion, Sqe, FEAT_ASYNC_EVENT_CONFIG, FEAT_NUM_QUEUES, LOG_CHANGED_NS};
use crate::dma_service::DmaServeCtl;
use crate::doorbell::{Doorbells, ShadowPages};
use crate::error::{Error, Result};
use crate::identify::{parse_ns_list, ControllerInfo, Namespace};
use crate::pool::{DmaBuf, Pool};
use crate::qpair::{QpCtx, QpairOpts, QueuePair};
use crate::regs::{self, Cap};

#[derive(Clone, Debug)]
pub struct DriverOpts {
    /// Size of the DMA pool (queues, lists, data buffers of every queue pair).
    pub pool_bytes: u64,
    /// IOVA at which the pool is mapped.
    pub pool_iova: u64,
    /// Ring doorbells with REGION_WRITE messages even if BAR0 has an mmap area.
    pub doorbells_via_messages: bool,
    /// Use shadow doorbells (Doorbell Buffer Config) for I/O queues: ring only when
    /// the controller's EventIdx asks for it. `None`: when doorbells go by message
    /// (each ring costs a round trip there), as a guest's driver would.
    pub shadow_doorbells: Option<bool>,
    pub admin_depth: u16,
    /// I/O queues to ask for with Set Features (Number of Queues).
    pub io_queues: u16,
    pub admin_timeout: Duration,
    /// Overrides CAP.TO for CSTS.RDY transitions.
    pub ready_timeout: Option<Duration>,
    /// Map the DMA pool *without* its file descriptor, as QEMU maps guest RAM that
    /// is not fd-backed: the controller then reaches it only with DMA_READ and
    /// DMA_WRITE messages, which a thread of ours answers (the slow path).
    pub dma_messages: bool,
    /// The layout those messages use (what the server must detect).
    pub dma_wire: proto::DmaWire,
    /// Data bytes per message we tell the server we take (VERSION
    /// `max_data_xfer_size`); it splits its DMA messages to fit.
    pub max_data_xfer: u32,
}

impl Default for DriverOpts {
    fn default() -> Self {
        DriverOpts {
            pool_bytes: 64 << 20,
            pool_iova: 0x1_0000_0000,
            doorbells_via_messages: false,
            shadow_doorbells: None,
            admin_depth: 32,
            io_queues: 64,
            admin_timeout: Duration::from_secs(10),
            ready_timeout: None,
            dma_messages: false,
            dma_wire: proto::DmaWire::Spec,
            max_data_xfer: proto::MAX_DATA_XFER,
        }
    }
}

/// State shared by the driver handle and its queue pairs.
pub(crate) struct Shared {
    client: Arc<Mutex<VfioUserClient>>,
    ctx: Arc<QpCtx>,
    admin: Mutex<QueuePair>,
    /// 4 KiB for Identify and friends; only used with `admin` locked.
    scratch: DmaBuf,
    qids: Mutex<Vec<bool>>,
    opts: DriverOpts,
    /// CID of the outstanding Asynchronous Event Request, if one is posted.
    aer: Mutex<Option<u16>>,
}

/// An asynchronous event the controller reported (AER completion dword 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncEvent {
    /// 0 error, 1 SMART/health, 2 notice, 6 vendor specific.
    pub kind: u8,
    /// For notices: 0 = Namespace Attribute Changed.
    pub info: u8,
    /// The log page to read to clear the event.
    pub log_page: u8,
}

impl AsyncEvent {
    pub fn from_dw0(dw0: u32) -> AsyncEvent {
        AsyncEvent {
            kind: (dw0 & 7) as u8,
            info: (dw0 >> 8) as u8,
            log_page: (dw0 >> 16) as u8,
        }
    }
    pub fn is_namespace_change(&self) -> bool {
        self.kind == 2 && self.info == 0
    }
}

pub struct NvmeDriver {
    shared: Arc<Shared>,
    ctrl: ControllerInfo,
    namespaces: Vec<Namespace>,
    io_queues: u16,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn reg_read(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        lock(&self.client).region_read(PCI_BAR0_REGION, off, buf)
    }
    fn read32(&self, off: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.reg_read(off, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn read64(&self, off: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.reg_read(off, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn write32(&self, off: u64, v: u32) -> Result<()> {
        lock(&self.client).region_write(PCI_BAR0_REGION, off, &v.to_le_bytes(), false)
    }
    fn write64(&self, off: u64, v: u64) -> Result<()> {
        lock(&self.client).region_write(PCI_BAR0_REGION, off, &v.to_le_bytes(), false)
    }

    fn admin(&self, sqe: Sqe) -> Result<Completion> {
        let mut a = lock(&self.admin);
        let cid = a.submit(sqe)?;
        a.ring()?;
        a.wait(cid, self.opts.admin_timeout)
    }

    fn admin_ok(&self, sqe: Sqe) -> Result<Completion> {
        let c = self.admin(sqe)?;
        if !c.status.is_ok() {
            return Err(Error::Nvme(c.status));
        }
        Ok(c)
    }

    /// Runs an admin command that returns one 4 KiB page and copies it out.
    fn admin_page(&self, mut sqe: Sqe) -> Result<Box<[u8; 4096]>> {
        let mut a = lock(&self.admin);
        sqe.dptr = [self.scratch.iova(), 0];
        self.scratch.fill(0);
        a.execute(sqe, self.opts.admin_timeout)?;
        let mut page = Box::new([0u8; 4096]);
        self.scratch.read(0, &mut page[..])?;
        Ok(page)
    }

    pub(crate) fn delete_queues(&self, qid: u16) -> Result<()> {
        let r = self
            .admin_ok(Sqe::delete_io_sq(qid))
            .and_then(|_| self.admin_ok(Sqe::delete_io_cq(qid)));
        if let Some(b) = lock(&self.qids).get_mut(qid as usize) {
            *b = false;
        }
        r.map(|_| ())
    }

    fn wait_ready(&self, want: bool) -> Result<()> {
        let to = self.opts.ready_timeout.unwrap_or(Duration::from_millis(
            self.ctx.cap.timeout_ms.clamp(500, 60_000),
        ));
        let start = Instant::now();
        loop {
            let csts = self.read32(regs::CSTS)?;
            if csts & regs::CSTS_CFS != 0 && want {
                return Err(Error::Protocol("controller fatal status (CSTS.CFS)".into()));
            }
            if (csts & regs::CSTS_RDY != 0) == want {
                return Ok(());
            }
            if start.elapsed() > to {
                return Err(Error::Timeout(if want {
                    "waiting for CSTS.RDY=1"
                } else {
                    "waiting for CSTS.RDY=0"
                }));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// CC.EN 1→0, program the admin queue, CC.EN 0→1. Bumps the generation so every
    /// I/O queue pair created before becomes stale.
    fn enable(&self) -> Result<()> {
        let cc = self.read32(regs::CC)?;
        if cc & regs::CC_EN != 0 {
            self.write32(regs::CC, cc & !regs::CC_EN)?;
        }
        self.wait_ready(false)?;
        self.ctx.db.shadow_on.store(false, Ordering::Release);
        self.ctx.gen.fetch_add(1, Ordering::AcqRel);
        *lock(&self.aer) = None;
        let mut a = lock(&self.admin);
        a.reset_state();
        let d = a.depth() as u32 - 1;
        self.write32(regs::AQA, d << 16 | d)?;
        self.write64(regs::ASQ, a.sq_iova())?;
        self.write64(regs::ACQ, a.cq_iova())?;
        drop(a);
        self.write32(regs::CC, regs::CC_IOSQES | regs::CC_IOCQES | regs::CC_EN)?;
        self.wait_ready(true)?;
        lock(&self.qids).iter_mut().for_each(|b| *b = false);
        if self.opts.shadow_doorbells.unwrap_or(!self.ctx.db.is_mmap()) {
            self.configure_shadow()?;
        }
        Ok(())
    }

    /// Doorbell Buffer Config with our two pages (allocated on first use). A
    /// controller without it (OACS bit 8 clear, or an error) keeps plain doorbells.
    fn configure_shadow(&self) -> Result<()> {
        let db = &self.ctx.db;
        if db.shadow.get().is_none() {
            let page = |_| -> Result<DmaBuf> {
                let c = Arc::new(self.ctx.pool.alloc(4096)?);
                Ok(DmaBuf::new(
                    c.mem().clone(),
                    c.off,
                    c.iova(),
                    4096,
                    Some(c.clone()),
                ))
            };
            let _ = db.shadow.set(ShadowPages {
                db: page(0)?,
                ei: page(1)?,
            });
        }
        let Some(sh) = db.shadow.get() else {
            return Ok(());
        };
        sh.db.fill(0);
        sh.ei.fill(0);
        match self.admin_ok(Sqe::doorbell_buffer_config(sh.db.iova(), sh.ei.iova())) {
            Ok(_) => db.shadow_on.store(true, Ordering::Release),
            Err(e) => tracing::info!("Doorbell Buffer Config refused ({e}); plain doorbells"),
        }
        Ok(())
    }
}

impl NvmeDriver {
    pub fn connect(path: impl AsRef<Path>, opts: DriverOpts) -> Result<NvmeDriver> {
        let c = VfioUserClient::connect_with_xfer(path, opts.max_data_xfer)?;
        Self::with_client(c, opts)
    }

    /// Brings up the controller behind an already negotiated client.
    pub fn with_client(mut client: VfioUserClient, opts: DriverOpts) -> Result<NvmeDriver> {
        let info = client.device_info()?;
        if info.num_regions == 0 {
            return Err(Error::Protocol("device has no BAR0".into()));
        }
        // Bus master + memory space, as a PCI host would set before using the device.
        // Servers that ignore config space are fine, so errors are not fatal.
        let _ = client.region_write(proto::PCI_CONFIG_REGION, 4, &0x0006u16.to_le_bytes(), false);
        let pool_mem = Arc::new(SharedMem::new("udrive-initiator-dma", opts.pool_bytes)?);
        if opts.dma_messages {
            // As QEMU does: memory first, then the regions.
            client.start_dma_service(opts.dma_wire)?;
            client.dma_map_unshared(pool_mem.clone(), opts.pool_iova, Prot::RW)?;
        }
        let bar0 = client.region_info(PCI_BAR0_REGION)?;
        let map = if opts.doorbells_via_messages {
            None
        } else {
            map_doorbells(&bar0)
        };
        if !opts.dma_messages {
            client.dma_map(pool_mem.fd(), 0, opts.pool_iova, pool_mem.len(), Prot::RW)?;
        }
        let pool = Arc::new(Pool::new(pool_mem, opts.pool_iova));
        let client = Arc::new(Mutex::new(client));
        let mut cap_raw = [0u8; 8];
        lock(&client).region_read(PCI_BAR0_REGION, regs::CAP, &mut cap_raw)?;
        let cap = Cap::parse(u64::from_le_bytes(cap_raw));
        let ctx = Arc::new(QpCtx {
            pool: pool.clone(),
            db: Doorbells::new(map, client.clone()),
            gen: Default::default(),
            cap,
        });
        let admin_depth = opts.admin_depth.min(cap.max_queue_entries.min(4096) as u16);
        let admin = QueuePair::new(
            ctx.clone(),
            0,
            QpairOpts {
                depth: admin_depth,
                data_bytes: 4096,
                max_xfer: 4096,
                ..Default::default()
            },
            None,
        )?;
        let scratch_chunk = Arc::new(pool.alloc(4096)?);
        let scratch = DmaBuf::new(
            scratch_chunk.mem().clone(),
            scratch_chunk.off,
            scratch_chunk.iova(),
            4096,
            Some(scratch_chunk.clone()),
        );
        let shared = Arc::new(Shared {
            client,
            ctx,
            admin: Mutex::new(admin),
            scratch,
            qids: Mutex::new(Vec::new()),
            opts: opts.clone(),
            aer: Mutex::new(None),
        });
        shared.enable()?;

        let ctrl = ControllerInfo::parse(&*shared.admin_page(Sqe::identify(1, 0))?);
        let namespaces = identify_namespaces(&shared, ctrl.nn)?;
        let want = opts.io_queues.max(1) as u32 - 1;
        let io_queues = match shared.admin_ok(Sqe::set_features(FEAT_NUM_QUEUES, want << 16 | want))
        {
            Ok(c) => {
                let nsq = (c.dw0 & 0xffff) + 1;
                let ncq = (c.dw0 >> 16) + 1;
                nsq.min(ncq).min(want + 1).min(u16::MAX as u32 - 1) as u16
            }
            Err(e) => {
                tracing::warn!(
                    "Set Features (Number of Queues) failed: {e}; assuming {}",
                    want + 1
                );
                want as u16 + 1
            }
        };
        // Slot 0 is the admin queue.
        *lock(&shared.qids) = vec![false; io_queues as usize + 1];
        Ok(NvmeDriver {
            shared,
            ctrl,
            namespaces,
            io_queues,
        })
    }

    pub fn controller(&self) -> &ControllerInfo {
        &self.ctrl
    }
    pub fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }
    pub fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }
    pub fn cap(&self) -> Cap {
        self.shared.ctx.cap
    }
    /// I/O queues the controller granted.
    pub fn io_queue_count(&self) -> u16 {
        self.io_queues
    }
    /// Whether I/O queues use shadow doorbells.
    pub fn shadow_doorbells(&self) -> bool {
        self.shared.ctx.db.shadow_on.load(Ordering::Acquire)
    }

    /// I/O doorbell writes skipped because the controller's EventIdx said so.
    pub fn doorbells_skipped(&self) -> u64 {
        self.shared.ctx.db.skipped.load(Ordering::Relaxed)
    }

    /// Doorbells written by message so far.
    pub fn doorbell_messages(&self) -> u64 {
        self.shared.ctx.db.messages.load(Ordering::Relaxed)
    }

    pub fn doorbells_mapped(&self) -> bool {
        self.shared.ctx.db.is_mmap()
    }
    /// Largest transfer the controller accepts (MDTS), if it states one.
    pub fn max_xfer(&self) -> Option<u64> {
        self.ctrl.max_xfer(self.shared.ctx.cap.mpsmin_bytes)
    }

    /// The DMA service answering the controller's DMA_READ/DMA_WRITE (with
    /// [`DriverOpts::dma_messages`]): its counters, and how it behaves.
    pub fn dma_service(&self) -> Option<Arc<DmaServeCtl>> {
        lock(&self.shared.client).dma_service()
    }

    /// The vfio-user client, for raw (hostile) messages. Holding the lock stalls
    /// register access and message doorbells.
    pub fn client(&self) -> MutexGuard<'_, VfioUserClient> {
        lock(&self.shared.client)
    }

    pub fn read_reg32(&self, off: u64) -> Result<u32> {
        self.shared.read32(off)
    }
    pub fn read_reg64(&self, off: u64) -> Result<u64> {
        self.shared.read64(off)
    }
    pub fn write_reg32(&self, off: u64, v: u32) -> Result<()> {
        self.shared.write32(off, v)
    }
    pub fn write_reg64(&self, off: u64, v: u64) -> Result<()> {
        self.shared.write64(off, v)
    }

    /// Runs a raw admin command and returns its completion whatever the status.
    pub fn admin(&self, sqe: Sqe) -> Result<Completion> {
        self.shared.admin(sqe)
    }

    /// Runs an admin command that transfers one 4 KiB page from the controller
    /// (Identify, Get Log Page); PRP1 is filled in.
    pub fn admin_read_page(&self, sqe: Sqe) -> Result<Box<[u8; 4096]>> {
        self.shared.admin_page(sqe)
    }

    pub fn identify_controller(&self) -> Result<ControllerInfo> {
        Ok(ControllerInfo::parse(
            &*self.shared.admin_page(Sqe::identify(1, 0))?,
        ))
    }

    pub fn identify_namespace(&self, nsid: u32) -> Result<Option<Namespace>> {
        Ok(Namespace::parse(
            nsid,
            &*self.shared.admin_page(Sqe::identify(0, nsid))?,
        ))
    }

    /// A data buffer from the shared pool (returned when the last handle drops).
    pub fn alloc_buf(&self, len: usize) -> Result<DmaBuf> {
        let c = Arc::new(self.shared.ctx.pool.alloc(len as u64)?);
        Ok(DmaBuf::new(
            c.mem().clone(),
            c.off,
            c.iova(),
            len,
            Some(c.clone()),
        ))
    }

    pub fn create_qpair(&self, depth: u16, interrupts: bool) -> Result<QueuePair> {
        self.create_qpair_with(QpairOpts {
            depth,
            interrupts,
            ..Default::default()
        })
    }

    pub fn create_qpair_with(&self, opts: QpairOpts) -> Result<QueuePair> {
        let qid = {
            let mut q = lock(&self.shared.qids);
            let i = q
                .iter()
                .skip(1)
                .position(|b| !*b)
                .ok_or(Error::NoResources("no free I/O queue id"))?
                + 1;
            q[i] = true;
            i as u16
        };
        let r = self.setup_qpair(qid, opts);
        if r.is_err() {
            if let Some(b) = lock(&self.shared.qids).get_mut(qid as usize) {
                *b = false;
            }
        }
        r
    }

    fn setup_qpair(&self, qid: u16, opts: QpairOpts) -> Result<QueuePair> {
        let s = &self.shared;
        // Owner stays None until both queues exist, so a failed setup does not try to
        // delete queues the controller never created.
        let mut qp = QueuePair::new(s.ctx.clone(), qid, opts, None)?;
        if opts.interrupts {
            let fd = EventFd::new(EFD_NONBLOCK)?;
            lock(&s.client).set_irqs(
                proto::PCI_MSIX_IRQ,
                qid as u32,
                &[crate::scm::borrow_eventfd(&fd)],
            )?;
            qp.set_irq(fd);
        }
        s.admin_ok(Sqe::create_io_cq(
            qid,
            opts.depth,
            qp.cq_iova(),
            qid,
            opts.interrupts,
        ))?;
        if let Err(e) = s.admin_ok(Sqe::create_io_sq(qid, opts.depth, qp.sq_iova(), qid)) {
            let _ = s.admin_ok(Sqe::delete_io_cq(qid));
            return Err(e);
        }
        Ok(qp.with_owner(s.clone()))
    }

    /// Deletes the queue pair on the controller (SQ, then CQ).
    pub fn delete_qpair(&self, mut qp: QueuePair) -> Result<()> {
        if qp.owner().is_none() {
            return Err(Error::Invalid(
                "not an I/O queue pair of this driver".into(),
            ));
        }
        qp.deleted = true;
        self.shared.delete_queues(qp.qid())
    }

    /// Turns on Namespace Attribute Notices (Set Features 0Bh) and posts an
    /// Asynchronous Event Request; the controller completes it when namespaces
    /// change ([`NvmeDriver::poll_event`]).
    pub fn enable_ns_events(&self) -> Result<()> {
        self.shared
            .admin_ok(Sqe::set_features(FEAT_ASYNC_EVENT_CONFIG, 1 << 8))?;
        self.post_aer()
    }

    fn post_aer(&self) -> Result<()> {
        let mut aer = lock(&self.shared.aer);
        if aer.is_some() {
            return Ok(());
        }
        let mut a = lock(&self.shared.admin);
        let cid = a.submit(Sqe::new(opc::ASYNC_EVENT))?;
        a.ring()?;
        *aer = Some(cid);
        Ok(())
    }

    /// The event the outstanding AER reported, if it completed (no waiting). The
    /// AER is not re-posted until [`NvmeDriver::rescan_namespaces`] (or
    /// `enable_ns_events`), as the controller masks the event until its log is read.
    pub fn poll_event(&self) -> Result<Option<AsyncEvent>> {
        let mut aer = lock(&self.shared.aer);
        let Some(cid) = *aer else { return Ok(None) };
        let c = lock(&self.shared.admin).try_take(cid)?;
        let Some(c) = c else { return Ok(None) };
        *aer = None;
        if !c.status.is_ok() {
            return Err(Error::Nvme(c.status));
        }
        Ok(Some(AsyncEvent::from_dw0(c.dw0)))
    }

    /// Waits up to `timeout` for an event.
    pub fn wait_event(&self, timeout: Duration) -> Result<AsyncEvent> {
        let start = Instant::now();
        loop {
            if let Some(e) = self.poll_event()? {
                return Ok(e);
            }
            if start.elapsed() > timeout {
                return Err(Error::Timeout("waiting for an asynchronous event"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// After a Namespace Attribute Changed event: reads (and so clears) the Changed
    /// Namespace List, identifies each listed namespace again, updates
    /// [`NvmeDriver::namespaces`] (added, resized, gone), and re-posts the AER.
    /// Returns the changed NSIDs.
    pub fn rescan_namespaces(&mut self) -> Result<Vec<u32>> {
        let page = self
            .shared
            .admin_page(Sqe::get_log_page(LOG_CHANGED_NS, 0, 1024))?;
        let mut changed = parse_ns_list(&page);
        if changed.first() == Some(&u32::MAX) {
            // More than 1024 changed: scan everything.
            let now = identify_namespaces(&self.shared, self.ctrl.nn)?;
            changed = self
                .namespaces
                .iter()
                .chain(now.iter())
                .map(|n| n.nsid)
                .collect();
            changed.sort_unstable();
            changed.dedup();
            self.namespaces = now;
        } else {
            for &id in &changed {
                let ns = match self.shared.admin_page(Sqe::identify(0, id)) {
                    Ok(p) => Namespace::parse(id, &p),
                    // An NSID the controller no longer knows is gone.
                    Err(Error::Nvme(_)) => None,
                    Err(e) => return Err(e),
                };
                self.namespaces.retain(|n| n.nsid != id);
                self.namespaces.extend(ns);
            }
            self.namespaces.sort_by_key(|n| n.nsid);
        }
        self.post_aer()?;
        Ok(changed)
    }

    /// Disables and re-enables the controller. All existing queue pairs become stale.
    pub fn reset_controller(&self) -> Result<()> {
        self.shared.enable()
    }
}

impl QueuePair {
    fn with_owner(mut self, owner: Arc<Shared>) -> QueuePair {
        self.set_owner(owner);
        self
    }
}

fn identify_namespaces(s: &Shared, nn: u32) -> Result<Vec<Namespace>> {
    let ids = match s.admin_page(Sqe::identify(2, 0)) {
        Ok(p) => parse_ns_list(&p),
        // Pre-1.1 controllers have no active list: probe every ID (bounded).
        Err(Error::Nvme(_)) => (1..=nn.min(1024)).collect(),
        Err(e) => return Err(e),
    };
    let mut v = Vec::new();
    for id in ids {
        match s.admin_page(Sqe::identify(0, id)) {
            Ok(p) => v.extend(Namespace::parse(id, &p)),
            Err(Error::Nvme(st)) => tracing::warn!(nsid = id, "Identify Namespace failed: {st}"),
            Err(e) => return Err(e),
        }
    }
    Ok(v)
}

/// Maps the sparse area of BAR0 that holds the doorbells, if the server offers one.
fn map_doorbells(bar0: &crate::client::RegionInfo) -> Option<(MappedRegion, u64)> {
    let fd = bar0.fd.as_ref()?;
    if bar0.flags & proto::REGION_MMAP == 0 {
        return None;
    }
    let area = bar0.sparse_areas.iter().find(|a| {
        a.offset <= regs::DOORBELL_BASE
            && a.offset
                .checked_add(a.size)
                .is_some_and(|e| e > regs::DOORBELL_BASE && e <= bar0.size)
    })?;
    let fd_off = bar0.offset.checked_add(area.offset)?;
    match MappedRegion::map_fd(fd.as_fd(), fd_off, area.offset, area.size, Prot::RW) {
        Ok(m) => Some((m, area.offset)),
        Err(e) => {
            tracing::warn!("cannot mmap BAR0 doorbells ({e}); using REGION_WRITE");
            None
        }
    }
}
