//! Interrupt delivery shared between the protocol thread (which installs eventfds and
//! emulates the MSI-X table) and the device model (which calls [`Irqs::signal`] from
//! reactors). `signal` takes no lock on the MSI-X path: the fd set is an `ArcSwap`
//! snapshot and masks/pending bits are atomics.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;

use arc_swap::ArcSwap;

/// A client's interrupt eventfd. Plain `File` writes keep this module free of
/// `unsafe`; [`Evt::new`] refuses anything that is not an eventfd, because a pipe
/// the client never drains would block the reactor that signals it.
#[derive(Debug)]
pub(crate) struct Evt(File);

impl Evt {
    pub(crate) fn new(fd: OwnedFd) -> Option<Evt> {
        use std::os::fd::AsRawFd;
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        match link {
            Ok(l) if l.to_string_lossy() != "anon_inode:[eventfd]" => None,
            // Without /proc we cannot tell; accept rather than break interrupts.
            _ => Some(Evt(File::from(fd))),
        }
    }
    fn write(&self, v: u64) -> std::io::Result<()> {
        (&self.0).write_all(&v.to_ne_bytes())
    }
}

/// Bytes per MSI-X table entry (address lo/hi, data, vector control).
pub(crate) const MSIX_ENTRY: usize = 16;

#[derive(Default)]
struct Fds {
    intx: Option<Arc<Evt>>,
    msix: Vec<Option<Arc<Evt>>>,
    msix_any: bool,
}

#[derive(Default)]
struct Intx {
    masked: bool,
    pending: bool,
}

pub struct Irqs {
    vectors: u16,
    fds: ArcSwap<Fds>,
    /// Serialises copy-on-write updates of `fds` (control path only).
    update: Mutex<()>,
    table: Mutex<Vec<u8>>,
    table_mask: Vec<AtomicBool>,
    client_mask: Vec<AtomicBool>,
    pending: Vec<AtomicBool>,
    func_mask: AtomicBool,
    /// Table mask bits gate delivery only once the client wrote the table. QEMU
    /// emulates the MSI-X table itself and never writes ours, so our power-on state
    /// (all masked) must not hold its interrupts back.
    table_armed: AtomicBool,
    intx: Mutex<Intx>,
}

impl std::fmt::Debug for Irqs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Irqs")
            .field("vectors", &self.vectors)
            .finish()
    }
}

fn fire(fd: &Evt) {
    // Only fails if the counter would overflow, i.e. the reader is gone for ages.
    let _ = fd.write(1);
}

impl Irqs {
    pub fn new(msix_vectors: u16) -> Arc<Irqs> {
        let n = usize::from(msix_vectors);
        let atomics = |v: bool| (0..n).map(|_| AtomicBool::new(v)).collect::<Vec<_>>();
        let irqs = Irqs {
            vectors: msix_vectors,
            fds: ArcSwap::from_pointee(Fds {
                msix: vec![None; n],
                ..Fds::default()
            }),
            update: Mutex::new(()),
            table: Mutex::new(vec![0; n * MSIX_ENTRY]),
            table_mask: atomics(true),
            client_mask: atomics(false),
            pending: atomics(false),
            func_mask: AtomicBool::new(false),
            table_armed: AtomicBool::new(false),
            intx: Mutex::new(Intx::default()),
        };
        irqs.reset_table();
        Arc::new(irqs)
    }

    pub fn msix_vectors(&self) -> u16 {
        self.vectors
    }

    /// Raises interrupt `vector`: its MSI-X eventfd when the client installed MSI-X
    /// eventfds (held pending while masked, sent on unmask), otherwise INTx (vector
    /// ignored; automasked until the client unmasks). Without any fd it is dropped.
    pub fn signal(&self, vector: u16) {
        let fds = self.fds.load();
        if fds.msix_any {
            let v = usize::from(vector);
            let Some(Some(fd)) = fds.msix.get(v) else {
                return;
            };
            if !self.masked(v) {
                fire(fd);
                return;
            }
            self.pending[v].store(true, SeqCst);
            // An unmask may have run between the check and the store.
            self.flush(v, fd);
        } else if let Some(fd) = &fds.intx {
            let mut st = self.intx.lock().unwrap_or_else(|e| e.into_inner());
            if st.masked {
                st.pending = true;
            } else {
                st.masked = true;
                fire(fd);
            }
        }
    }

    fn masked(&self, v: usize) -> bool {
        self.func_mask.load(SeqCst)
            || self.client_mask[v].load(SeqCst)
            || (self.table_armed.load(SeqCst) && self.table_mask[v].load(SeqCst))
    }

    fn flush(&self, v: usize, fd: &Evt) {
        if !self.masked(v) && self.pending[v].swap(false, SeqCst) {
            fire(fd);
        }
    }

    fn flush_vector(&self, v: usize) {
        let fds = self.fds.load();
        if let Some(Some(fd)) = fds.msix.get(v) {
            self.flush(v, fd);
        }
    }

    fn flush_all(&self) {
        for v in 0..usize::from(self.vectors) {
            self.flush_vector(v);
        }
    }

    // ---- control path (protocol thread) ----

    fn edit(&self, f: impl FnOnce(&mut Fds)) {
        let _g = self.update.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.fds.load();
        let mut next = Fds {
            intx: cur.intx.clone(),
            msix: cur.msix.clone(),
            msix_any: false,
        };
        f(&mut next);
        next.msix_any = next.msix.iter().any(Option::is_some);
        self.fds.store(Arc::new(next));
    }

    /// Installs (Some) or removes (None) MSI-X eventfds from `start`; range pre-checked.
    pub(crate) fn set_msix_fds(&self, start: usize, fds: Vec<Option<Evt>>) {
        self.edit(|s| {
            for (i, fd) in fds.into_iter().enumerate() {
                if let Some(slot) = s.msix.get_mut(start + i) {
                    *slot = fd.map(Arc::new);
                }
            }
        });
        self.flush_all();
    }

    pub(crate) fn set_intx_fd(&self, fd: Option<Evt>) {
        self.edit(|s| s.intx = fd.map(Arc::new));
    }

    /// Drops every eventfd (client gone or teardown of all indices).
    pub(crate) fn clear_fds(&self) {
        self.edit(|s| {
            s.intx = None;
            s.msix.iter_mut().for_each(|f| *f = None);
        });
        for p in &self.pending {
            p.store(false, SeqCst);
        }
        *self.intx.lock().unwrap_or_else(|e| e.into_inner()) = Intx::default();
    }

    pub(crate) fn clear_msix_fds(&self) {
        self.edit(|s| s.msix.iter_mut().for_each(|f| *f = None));
    }

    /// SET_IRQS ACTION_MASK/UNMASK on MSI-X vectors.
    pub(crate) fn client_mask_msix(&self, v: usize, mask: bool) {
        if let Some(m) = self.client_mask.get(v) {
            m.store(mask, SeqCst);
            if !mask {
                self.flush_vector(v);
            }
        }
    }

    pub(crate) fn mask_intx(&self, mask: bool) {
        let fds = self.fds.load();
        let mut st = self.intx.lock().unwrap_or_else(|e| e.into_inner());
        st.masked = mask;
        if !mask && st.pending {
            if let Some(fd) = &fds.intx {
                st.pending = false;
                st.masked = true;
                fire(fd);
            }
        }
    }

    /// Loopback trigger requested by the client (DATA_NONE/DATA_BOOL + TRIGGER).
    pub(crate) fn trigger_msix(&self, v: u16) {
        if self.fds.load().msix_any {
            self.signal(v);
        }
    }
    pub(crate) fn trigger_intx(&self) {
        if let Some(fd) = &self.fds.load().intx {
            fire(fd);
        }
    }

    /// MSI-X Message Control changed in config space.
    pub(crate) fn set_function_mask(&self, mask: bool) {
        self.func_mask.store(mask, SeqCst);
        if !mask {
            self.flush_all();
        }
    }

    /// Power-on state of table and PBA: all vectors masked, nothing pending.
    pub(crate) fn reset_table(&self) {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.iter_mut().for_each(|b| *b = 0);
        for (v, e) in t.chunks_mut(MSIX_ENTRY).enumerate() {
            e[12] = 1;
            self.table_mask[v].store(true, SeqCst);
            self.pending[v].store(false, SeqCst);
        }
        self.func_mask.store(false, SeqCst);
        self.table_armed.store(false, SeqCst);
    }

    pub(crate) fn table_len(&self) -> u64 {
        (usize::from(self.vectors) * MSIX_ENTRY) as u64
    }
    pub(crate) fn pba_len(&self) -> u64 {
        usize::from(self.vectors).div_ceil(64) as u64 * 8
    }

    /// Reads table bytes at `off` (range pre-checked against `table_len`).
    pub(crate) fn table_read(&self, off: usize, data: &mut [u8]) {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(src) = t.get(off..off + data.len()) {
            data.copy_from_slice(src);
        }
    }

    /// Writes table bytes; a vector whose mask bit clears gets its pending message.
    pub(crate) fn table_write(&self, off: usize, data: &[u8]) {
        let mut unmasked = vec![];
        {
            let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
            let Some(dst) = t.get_mut(off..off + data.len()) else {
                return;
            };
            dst.copy_from_slice(data);
            self.table_armed.store(true, SeqCst);
            let first = off / MSIX_ENTRY;
            let last = (off + data.len().max(1) - 1) / MSIX_ENTRY;
            for v in first..=last {
                let Some(e) = t.get_mut(v * MSIX_ENTRY..(v + 1) * MSIX_ENTRY) else {
                    continue;
                };
                // Reserved vector-control bits are read-only zero.
                e[12] &= 1;
                e[13..16].fill(0);
                let masked = e[12] & 1 != 0;
                if !self.table_mask[v].swap(masked, SeqCst) || masked {
                    continue;
                }
                unmasked.push(v);
            }
        }
        for v in unmasked {
            self.flush_vector(v);
        }
    }

    /// PBA bytes at `off`, built from the pending bits.
    pub(crate) fn pba_read(&self, off: usize, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let base = (off + i) * 8;
            let mut v = 0u8;
            for bit in 0..8 {
                if self.pending.get(base + bit).is_some_and(|p| p.load(SeqCst)) {
                    v |= 1 << bit;
                }
            }
            *b = v;
        }
    }

    /// Whether vector `v` is pending (for tests and the device model's debugging).
    pub fn is_pending(&self, v: u16) -> bool {
        self.pending
            .get(usize::from(v))
            .is_some_and(|p| p.load(SeqCst))
    }
}
