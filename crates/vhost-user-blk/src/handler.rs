//! The per-connection vhost-user handler: udrive's implementation of vhost's
//! public `VhostUserBackendReqHandlerMut`, served by vhost's `BackendReqHandler`
//! (which parses each message, checks sizes, fds and negotiated features, and
//! answers REPLY_ACK). Each connection gets a fresh one, so nothing a front end
//! set up (ownership, features, memory) leaks into the next.
//!
//! It owns the connection's state: what it keeps here and in the [`Conn`] it shares
//! with the pollers is all a handover carries (`state.rs`), without re-reading any
//! message.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{Backend, Error as VuError, GpuBackend, VhostUserBackendReqHandlerMut};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestAddressSpace};

use crate::conn::{lock, Conn, Shared, VringAddr, VringState};
use crate::memory::{self, Mapping};
use crate::migration::{LogError, LogRec};

type VuResult<T> = Result<T, VuError>;

/// How long GET_VRING_BASE waits for in-flight requests before answering anyway.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// Distinct config-space writes a handover carries (the writable config space is
/// one byte: more means a front end that writes what it should not).
pub(crate) const MAX_CONFIG_WRITES: usize = 16;

/// A request refused without ending the connection, if the front end asked for
/// an answer (it then knows); marks the handler's errors for the connection loop.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Refused(pub String);

fn refused(e: impl std::fmt::Display) -> VuError {
    VuError::ReqHandlerError(io::Error::other(Refused(e.to_string())))
}

/// Whether `e` is a [`Refused`] request.
pub(crate) fn is_refusal(e: &VuError) -> bool {
    matches!(e, VuError::ReqHandlerError(io) if io.get_ref().is_some_and(|i| i.is::<Refused>()))
}

/// The protocol features a device offers (`migrates`: it offers dirty-page
/// logging, `migration.rs`).
pub(crate) fn offered_protocol(migrates: bool) -> VhostUserProtocolFeatures {
    let f = VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        // SET_BACKEND_REQ_FD is taken off the socket before the library sees it
        // (channel.rs).
        | VhostUserProtocolFeatures::BACKEND_REQ;
    if migrates {
        f | VhostUserProtocolFeatures::LOG_SHMFD
    } else {
        f
    }
}

/// One SET_CONFIG, as a handover carries it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ConfigWrite {
    pub offset: u32,
    pub flags: u32,
    pub data: Vec<u8>,
}

/// The inflight area the front end handed us, as a handover carries it.
pub(crate) struct InflightRec {
    pub req: VhostUserInflight,
    pub file: File,
}

pub(crate) struct Handler {
    pub shared: Arc<Shared>,
    pub conn: Arc<Conn>,
    pub owned: bool,
    /// SET_FEATURES.
    pub features: Option<u64>,
    /// SET_PROTOCOL_FEATURES.
    pub protocol: Option<u64>,
    /// The memory table as the front end described it (for user addresses).
    pub table: Vec<Mapping>,
    /// SET_CONFIG writes, the latest per offset and size, in order.
    pub config: Vec<ConfigWrite>,
    /// More distinct config writes than a handover carries.
    pub config_overflow: bool,
    pub inflight: Option<InflightRec>,
    /// SET_LOG_BASE: the dirty-page log.
    pub log: Option<LogRec>,
}

impl Handler {
    pub fn new(shared: Arc<Shared>, conn: Arc<Conn>) -> Handler {
        Handler {
            shared,
            conn,
            owned: false,
            features: None,
            protocol: None,
            table: Vec::new(),
            config: Vec::new(),
            config_overflow: false,
            inflight: None,
            log: None,
        }
    }

    pub fn offered_features(&self) -> u64 {
        let f = self.shared.cfg.features | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.shared.migration.offers_logging() {
            f | VhostUserVirtioFeatures::LOG_ALL.bits()
        } else {
            f
        }
    }

    /// Whether the front end asked for every write to be logged (it migrates).
    pub fn front_end_logs(&self) -> bool {
        self.features
            .is_some_and(|f| f & VhostUserVirtioFeatures::LOG_ALL.bits() != 0)
    }

    /// Whether the pollers mark what they write: the front end migrates, or the
    /// device logs on its own (`Migration::force_log`).
    pub fn logging(&self) -> bool {
        self.front_end_logs() || self.shared.migration.force_log
    }

    /// With `Migration::force_log`, a log of the device's own for the memory table
    /// just installed (a front end's log takes precedence).
    fn own_log(&mut self) {
        if !self.shared.migration.force_log || self.front_end_logs() {
            return;
        }
        match crate::migration::own_log(&self.conn.guarded.signal, &self.table) {
            Ok(rec) => {
                self.log = Some(rec);
                self.apply_log();
            }
            Err(e) => tracing::warn!(error = %e, "cannot make the device's own dirty log"),
        }
    }

    /// Sets what vring `st`'s poller marks in the dirty log (`conn.rs`).
    fn vring_log(&self, st: &mut VringState) {
        let logging = self.logging();
        let on = self.log.as_ref().filter(|_| logging).map(|l| l.map.clone());
        st.hold = self.front_end_logs() && self.log.is_none();
        let logs_used = st
            .addrs
            .is_some_and(|a| a.flags & VhostUserVringAddrFlags::VHOST_VRING_F_LOG.bits() != 0);
        st.used_log = on.clone().filter(|_| logs_used);
        st.data_log = on.filter(|_| self.shared.migration.log_data);
    }

    /// Applies the logging state to every vring (features, log or addresses
    /// changed); wakes the pollers so that a held ring goes on at once.
    pub fn apply_log(&self) {
        for (i, v) in self.conn.vrings.iter().enumerate() {
            self.vring_log(&mut lock(v));
            if let Some(q) = self.shared.queues.get(i) {
                q.waker.load().wake();
            }
        }
    }

    /// A ring is about to start (`kick_now`: its kick eventfd arrives now):
    /// unless the device is its disk's writer already, it becomes it, or the
    /// start is refused (another device writes the disk).
    fn claim_if_starting(&self, index: u8, kick_now: bool) -> VuResult<()> {
        let starts = {
            let st = self.vring(u32::from(index))?;
            !st.queue.ready() && (kick_now || st.kick.is_some())
        };
        if !starts {
            return Ok(());
        }
        self.shared.migration.front_end_starts().map_err(|e| {
            trace::limited!(self.conn.log, error, error = %e, "vhost-user front end started a ring, but the disk has another writer; ring not started");
            VuError::ReqHandlerError(io::Error::other(e))
        })
    }

    /// GET_VRING_BASE stopped a ring: if the front end logs and no ring runs any
    /// more, the VM is moving to another device.
    fn after_stop(&self) {
        if self.front_end_logs() && self.conn.vrings.iter().all(|v| !lock(v).queue.ready()) {
            self.shared.migration.migrated_away();
        }
    }

    fn vring(&self, index: u32) -> VuResult<MutexGuard<'_, VringState>> {
        let v = usize::try_from(index)
            .ok()
            .and_then(|i| self.conn.vrings.get(i))
            .ok_or(VuError::InvalidParam)?;
        Ok(lock(v))
    }

    /// Watches queue `index`'s kick eventfd while the vring runs, not otherwise.
    pub fn update_kick(&self, index: usize, st: &VringState) -> VuResult<()> {
        if let Some(k) = &st.kick {
            self.conn
                .kicks
                .set(k.as_raw_fd(), index, st.running())
                .map_err(VuError::ReqHandlerError)?;
        }
        Ok(())
    }

    /// A vring starts once it has a kick eventfd (vhost-user spec: "ring starts
    /// upon receiving a kick").
    fn start_if_kicked(&self, index: usize, st: &mut VringState) -> VuResult<()> {
        if !st.queue.ready() && st.kick.is_some() {
            st.queue.set_ready(true);
        }
        self.update_kick(index, st)
    }

    fn protocol_features_acked(&self) -> bool {
        self.features
            .is_some_and(|f| f & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0)
    }

    /// Applies acknowledged `features` to the vrings (also on a restore).
    pub fn apply_features(&mut self, features: u64) -> VuResult<()> {
        self.features = Some(features);
        let event_idx = features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let enable_all = !self.protocol_features_acked();
        for (i, v) in self.conn.vrings.iter().enumerate() {
            let mut st = lock(v);
            // Without PROTOCOL_FEATURES the rings are enabled from the start
            // (vhost-user spec, "Ring states").
            if enable_all {
                st.enabled = true;
            }
            st.queue.set_event_idx(event_idx);
            self.update_kick(i, &st)?;
        }
        // LOG_ALL comes and goes with SET_FEATURES while the rings run.
        self.apply_log();
        Ok(())
    }

    /// Maps and installs a dirty-page log (SET_LOG_BASE, or a restore). The log
    /// it replaces is never marked again once this returns (`conn.rs`).
    pub fn install_log(&mut self, req: &VhostUserLog, file: File) -> Result<(), LogError> {
        if let Some(why) = &self.shared.migration.refusal {
            return Err(LogError::NotOffered(why.clone()));
        }
        let rec = crate::migration::map_log(&self.conn.guarded.signal, &self.table, req, file)?;
        self.log = Some(rec);
        self.apply_log();
        Ok(())
    }

    /// Refuses a memory table the dirty log in use does not cover (the device's
    /// own log follows the table instead).
    fn check_log_covers(&self, table: &[Mapping]) -> VuResult<()> {
        if self.shared.migration.force_log && !self.front_end_logs() {
            return Ok(());
        }
        match &self.log {
            Some(l) => crate::migration::check_covers(&l.map, table).map_err(|e| {
                trace::limited!(self.conn.log, warn, error = %e, "vhost-user memory table refused");
                refused(e)
            }),
            None => Ok(()),
        }
    }

    fn note_config(&mut self, offset: u32, flags: u32, data: &[u8]) {
        self.config
            .retain(|c| !(c.offset == offset && c.data.len() == data.len()));
        if self.config.len() >= MAX_CONFIG_WRITES {
            self.config_overflow = true;
            return;
        }
        self.config.push(ConfigWrite {
            offset,
            flags,
            data: data.to_vec(),
        });
    }

    /// Maps and installs the inflight area (SET_INFLIGHT_FD, or a restore).
    pub fn install_inflight(
        &mut self,
        req: &VhostUserInflight,
        file: File,
    ) -> Result<(), crate::inflight::InflightError> {
        let region = crate::inflight::Region::map(
            &file,
            (req.mmap_size, req.mmap_offset),
            req.num_queues,
            req.queue_size,
            &self.conn.guarded.signal,
        )?;
        *lock(&self.conn.inflight) = Some(region);
        self.inflight = Some(InflightRec { req: *req, file });
        Ok(())
    }

    /// Sets vring `index`'s addresses from the front end's user addresses.
    pub fn set_addrs(&self, index: u32, a: VringAddr) -> VuResult<()> {
        if self.table.is_empty() {
            return Err(VuError::InvalidParam);
        }
        let gpa = |va| memory::va_to_gpa(&self.table, va).ok_or(VuError::InvalidParam);
        let (desc, avail, used) = (gpa(a.desc)?, gpa(a.avail)?, gpa(a.used)?);
        let mut st = self.vring(index)?;
        let q = &mut st.queue;
        q.try_set_desc_table_address(GuestAddress(desc))
            .and_then(|()| q.try_set_avail_ring_address(GuestAddress(avail)))
            .and_then(|()| q.try_set_used_ring_address(GuestAddress(used)))
            .map_err(|_| VuError::InvalidParam)?;
        // The used index continues from what the guest's ring says (after a
        // reboot it is 0 again); SET_VRING_BASE only gives the avail index.
        let mem = self.conn.mem.memory();
        let idx = q
            .used_idx(&*mem, Ordering::Acquire)
            .map_err(|_| VuError::BackendInternalError)?;
        q.set_next_used(idx.0);
        st.addrs = Some(a);
        // VHOST_VRING_F_LOG comes with SET_VRING_ADDR.
        self.vring_log(&mut st);
        Ok(())
    }
}

impl VhostUserBackendReqHandlerMut for Handler {
    fn set_owner(&mut self) -> VuResult<()> {
        if self.owned {
            return Err(VuError::InvalidOperation("already claimed"));
        }
        self.owned = true;
        Ok(())
    }

    fn reset_owner(&mut self) -> VuResult<()> {
        self.owned = false;
        self.features = None;
        self.protocol = None;
        self.conn.protocol.store(0, Ordering::Release);
        self.log = None;
        self.apply_log();
        Ok(())
    }

    fn reset_device(&mut self) -> VuResult<()> {
        Err(VuError::InvalidOperation("RESET_DEVICE is not offered"))
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(self.offered_features())
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !self.offered_features() != 0 {
            return Err(VuError::InvalidParam);
        }
        self.apply_features(features)
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        let table: Vec<Mapping> = ctx.iter().map(Mapping::of).collect();
        self.check_log_covers(&table)?;
        memory::set_table(&self.conn.mem, &self.conn.guarded, &table, files).map_err(|e| {
            trace::limited!(self.conn.log, warn, error = %e, "vhost-user memory table refused");
            refused(e)
        })?;
        self.table = table;
        self.own_log();
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        let max = self.shared.cfg.opts.queue_size;
        let mut st = self.vring(index)?;
        match u16::try_from(num) {
            Ok(n) if n != 0 && n <= max => {
                st.queue.set_size(n);
                Ok(())
            }
            _ => Err(VuError::InvalidParam),
        }
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> VuResult<()> {
        let a = VringAddr {
            flags: flags.bits(),
            desc: descriptor,
            used,
            avail: available,
            log,
        };
        self.set_addrs(index, a)
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        let base = u16::try_from(base).map_err(|_| VuError::InvalidParam)?;
        self.vring(index)?.queue.set_next_avail(base);
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        let i = index as usize;
        {
            let mut st = self.vring(index)?;
            // The poller takes no new chains from a ring that is not ready.
            st.queue.set_ready(false);
            self.update_kick(i, &st)?;
        }
        // Answer only once the chains it took are on the used ring.
        if let Some(q) = self.shared.queues.get(i) {
            q.stops.fetch_add(1, Ordering::AcqRel);
            if !q.drain(DRAIN_LIMIT) {
                trace::limited!(
                    self.shared.log,
                    warn,
                    queue_index = i,
                    "requests still in flight after {DRAIN_LIMIT:?}; stopping the vring anyway"
                );
            }
        }
        let mut st = self.vring(index)?;
        st.kick = None;
        st.call = None;
        let base = VhostUserVringState::new(index, u32::from(st.queue.next_avail()));
        drop(st);
        self.after_stop();
        Ok(base)
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let i = usize::from(index);
        if fd.is_some() {
            self.claim_if_starting(index, true)?;
        }
        let mut st = self.vring(u32::from(index))?;
        if let Some(old) = &st.kick {
            let _ = self.conn.kicks.set(old.as_raw_fd(), i, false);
        }
        st.kick = fd;
        self.start_if_kicked(i, &mut st)
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        self.claim_if_starting(index, false)?;
        let mut st = self.vring(u32::from(index))?;
        st.call = fd;
        // A reconnecting front end may start the ring before it sends its call
        // fd: requests the ring had in flight complete meanwhile with nobody to
        // tell, and a guest with EVENT_IDX then waits for that interrupt
        // forever. One spurious interrupt costs a driver a look at its used ring.
        if st.call.is_some() {
            st.signal_used();
        }
        self.start_if_kicked(usize::from(index), &mut st)
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        self.vring(u32::from(index))?.err = fd;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(offered_protocol(self.shared.migration.offers_logging()))
    }

    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        // Allowed before SET_FEATURES (the spec says so for a back end that
        // offered PROTOCOL_FEATURES).
        self.protocol = Some(features);
        self.conn.protocol.store(features, Ordering::Release);
        Ok(())
    }

    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(self.shared.queues.len() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        if !self.protocol_features_acked() {
            return Err(VuError::InactiveFeature(
                VhostUserVirtioFeatures::PROTOCOL_FEATURES,
            ));
        }
        let mut st = self.vring(index)?;
        st.enabled = enable;
        self.update_kick(index as usize, &st)
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VuResult<Vec<u8>> {
        Ok(self.shared.cfg.read(offset, size))
    }

    fn set_config(&mut self, offset: u32, buf: &[u8], flags: VhostUserConfigFlags) -> VuResult<()> {
        self.shared.cfg.write(offset, buf).map_err(|e| {
            VuError::ReqHandlerError(io::Error::new(io::ErrorKind::InvalidInput, e))
        })?;
        self.note_config(offset, flags.bits(), buf);
        Ok(())
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {
        // Never reached: the connection loop takes SET_BACKEND_REQ_FD (channel.rs).
    }

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VuResult<()> {
        Err(VuError::InvalidOperation("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        Err(VuError::InvalidOperation("SHARED_OBJECT is not offered"))
    }

    fn get_inflight_fd(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> VuResult<(VhostUserInflight, File)> {
        let (mem, size) =
            crate::inflight::Region::allocate(inflight.num_queues, inflight.queue_size).map_err(
                |e| {
                    trace::limited!(self.conn.log, warn, error = %e, "GET_INFLIGHT_FD refused");
                    VuError::ReqHandlerError(io::Error::other(e))
                },
            )?;
        let file = File::from(
            mem.fd()
                .try_clone_to_owned()
                .map_err(VuError::ReqHandlerError)?,
        );
        let mut out = *inflight;
        out.mmap_size = size;
        out.mmap_offset = 0;
        Ok((out, file))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VuResult<()> {
        self.install_inflight(inflight, file).map_err(|e| {
            trace::limited!(self.conn.log, warn, error = %e, "SET_INFLIGHT_FD refused; requests in flight at a crash will not be recovered");
            *lock(&self.conn.inflight) = None;
            self.inflight = None;
            refused(e)
        })
    }

    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        Ok(memory::MAX_MEM_SLOTS as u64)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<VhostUserMemoryRegionBase>> {
        let m = Mapping::of(region);
        let mut table = self.table.clone();
        table.push(m);
        self.check_log_covers(&table)?;
        memory::add(&self.conn.mem, &self.conn.guarded, self.table.len(), &m, fd).map_err(|e| {
            trace::limited!(self.conn.log, warn, error = %e, "vhost-user memory region refused");
            refused(e)
        })?;
        self.table.push(m);
        self.own_log();
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        let m = Mapping::of(region);
        memory::remove(&self.conn.mem, &self.conn.guarded, &m)
            .map_err(|e| VuError::ReqHandlerError(io::Error::other(e)))?;
        self.table.retain(|t| t.gpa != m.gpa);
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        Err(VuError::InvalidOperation("DEVICE_STATE is not offered"))
    }

    fn check_device_state(&mut self) -> VuResult<()> {
        Err(VuError::InvalidOperation("DEVICE_STATE is not offered"))
    }

    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        Err(VuError::InvalidOperation("SHMEM is not offered"))
    }

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> VuResult<()> {
        // Not a refusal the front end could go on after: the library answers
        // SET_LOG_BASE only on success, so an error ends the connection.
        self.install_log(log, file).map_err(|e| {
            trace::limited!(self.conn.log, warn, error = %e, "vhost-user dirty log refused; disconnecting");
            VuError::ReqHandlerError(io::Error::other(e))
        })
    }
}
