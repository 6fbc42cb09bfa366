//! Confines SIGBUS from client memory to the client that caused it.
//!
//! A client (VMM) shares its guest RAM as a file and may shrink that file while we
//! have it mapped; the next access to a page past the new end raises SIGBUS, which by
//! default kills the whole process and every tenant's disks with it. Files that
//! cannot be sealed (QEMU's `memory-backend-file` on hugetlbfs or /dev/shm) must keep
//! working, so instead of refusing them every mapping of client memory is registered
//! here, and a SIGBUS inside a registered range is repaired on the spot: the range is
//! replaced by anonymous zero pages (the faulting access is then retried and
//! succeeds), and the range's [`FaultSignal`] tells its owner, which fails that
//! client's device. A SIGBUS anywhere else goes to the previous handler (Rust's
//! stack-overflow handler, or the default action). See
//! `docs/decisions/0010-hostile-clients.md`.
//!
//! The registry is a fixed table so the handler needs no allocation and no lock:
//! slots are claimed with a compare-and-swap, and removing a range waits until no
//! handler is running, so the handler never replaces memory that was already
//! unmapped and reused.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

/// Ranges registered at once, over all clients (each vfio-user client may hold at
/// most `max_dma_maps` of them; QEMU uses a few dozen).
pub const MAX_GUARDED_RANGES: usize = 16384;

const FREE: u8 = 0;
const CLAIMED: u8 = 1;
const ACTIVE: u8 = 2;
const RETIRING: u8 = 3;

struct Slot {
    state: AtomicU8,
    start: AtomicUsize,
    len: AtomicUsize,
    signal: AtomicPtr<FaultSignal>,
}

#[allow(clippy::declare_interior_mutable_const)] // only used to build the table
const EMPTY: Slot = Slot {
    state: AtomicU8::new(FREE),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    signal: AtomicPtr::new(std::ptr::null_mut()),
};

static SLOTS: [Slot; MAX_GUARDED_RANGES] = [EMPTY; MAX_GUARDED_RANGES];
/// One past the highest slot ever claimed: the handler scans no further.
static HIGH: AtomicUsize = AtomicUsize::new(0);
/// Handlers running now; a removal waits for zero.
static IN_HANDLER: AtomicUsize = AtomicUsize::new(0);
/// Faults repaired since start, for logs and tests.
static REPAIRED: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();
static mut PREVIOUS: Option<libc::sigaction> = None;

/// Tells the owner of one or more guarded ranges that one of them faulted: a flag,
/// and an eventfd a control thread can poll.
#[derive(Debug)]
pub struct FaultSignal {
    faulted: AtomicBool,
    wake: OwnedFd,
}

impl FaultSignal {
    pub fn new() -> io::Result<Arc<FaultSignal>> {
        // SAFETY: eventfd has no memory-safety preconditions; result checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(FaultSignal {
            faulted: AtomicBool::new(false),
            // SAFETY: a fresh descriptor that nothing else owns.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
        }))
    }

    /// Whether a guarded range faulted since the last [`FaultSignal::take`].
    pub fn faulted(&self) -> bool {
        self.faulted.load(Ordering::Acquire)
    }

    /// Clears the flag (and the eventfd's count); returns whether it was set.
    pub fn take(&self) -> bool {
        let mut buf = 0u64;
        // SAFETY: reading 8 bytes into a u64 from our nonblocking eventfd.
        unsafe {
            libc::read(
                self.wake.as_raw_fd(),
                (&mut buf as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        self.faulted.swap(false, Ordering::AcqRel)
    }

    /// Readable after a fault, until [`FaultSignal::take`].
    pub fn wake_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.wake.as_fd()
    }

    fn raise(&self) {
        self.faulted.store(true, Ordering::Release);
        let one = 1u64;
        // SAFETY: write(2) is async-signal-safe; 8 bytes from a live u64.
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// Faults repaired in this process so far.
pub fn repaired_faults() -> u64 {
    REPAIRED.load(Ordering::Relaxed)
}

/// Keeps a range registered; removing it (on drop) waits for running handlers, so
/// drop it *before* unmapping the range.
#[derive(Debug)]
pub struct FaultGuard {
    slot: usize,
    _signal: Arc<FaultSignal>,
}

/// Registers `[start, start+len)`: a SIGBUS inside it replaces the whole range with
/// zero pages and raises `signal`.
///
/// # Safety
/// The range must be a mapping the caller owns, kept mapped (and not handed to
/// anything that relies on its contents staying file-backed) until the guard drops.
pub unsafe fn guard_range(
    start: *const u8,
    len: usize,
    signal: &Arc<FaultSignal>,
) -> io::Result<FaultGuard> {
    install();
    for (i, s) in SLOTS.iter().enumerate() {
        if s.state
            .compare_exchange(FREE, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            continue;
        }
        s.start.store(start as usize, Ordering::Relaxed);
        s.len.store(len, Ordering::Relaxed);
        s.signal
            .store(Arc::as_ptr(signal).cast_mut(), Ordering::Relaxed);
        HIGH.fetch_max(i + 1, Ordering::SeqCst);
        s.state.store(ACTIVE, Ordering::SeqCst);
        return Ok(FaultGuard {
            slot: i,
            _signal: signal.clone(),
        });
    }
    Err(io::Error::new(
        io::ErrorKind::OutOfMemory,
        format!("{MAX_GUARDED_RANGES} client memory regions are mapped already"),
    ))
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        let s = &SLOTS[self.slot];
        s.state.store(RETIRING, Ordering::SeqCst);
        // A handler that saw the slot active may still be replacing the range; the
        // range (and the signal we hold) must outlive it.
        while IN_HANDLER.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        s.signal.store(std::ptr::null_mut(), Ordering::Relaxed);
        s.state.store(FREE, Ordering::Release);
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: sigaction with a zeroed struct, our handler and an empty mask; the
        // previous action is stored once, before any SIGBUS can reach our handler
        // (it is installed by this same call).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) == 0 {
                PREVIOUS = Some(old);
            }
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        }
    });
}

/// Finds the active slot holding `addr` and replaces its range with zero pages.
fn repair(addr: usize) -> bool {
    let high = HIGH.load(Ordering::SeqCst);
    for s in &SLOTS[..high] {
        if s.state.load(Ordering::SeqCst) != ACTIVE {
            continue;
        }
        let start = s.start.load(Ordering::Relaxed);
        let len = s.len.load(Ordering::Relaxed);
        if addr < start || addr - start >= len {
            continue;
        }
        // SAFETY: the slot is active and its owner waits for us before unmapping, so
        // [start, start+len) is still the owner's mapping: replacing it in place with
        // anonymous memory keeps every pointer into it valid. mmap is a plain system
        // call (no locks), usable from a signal handler.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return false;
        }
        let sig = s.signal.load(Ordering::Relaxed);
        // SAFETY: the guard keeps the signal alive while the slot is not free, and
        // its drop waits for us.
        if let Some(sig) = unsafe { sig.as_ref() } {
            sig.raise();
        }
        REPAIRED.fetch_add(1, Ordering::Relaxed);
        return true;
    }
    false
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    IN_HANDLER.fetch_add(1, Ordering::SeqCst);
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let repaired = repair(addr);
    IN_HANDLER.fetch_sub(1, Ordering::SeqCst);
    if repaired {
        return;
    }
    // Not client memory: a real bug or a hardware error; behave as before we came.
    // SAFETY: PREVIOUS was written once before this handler was installed.
    let prev = unsafe { *std::ptr::addr_of!(PREVIOUS) };
    match prev {
        Some(p)
            if p.sa_flags & libc::SA_SIGINFO != 0
                && p.sa_sigaction != libc::SIG_DFL
                && p.sa_sigaction != libc::SIG_IGN =>
        {
            // SAFETY: a handler installed with SA_SIGINFO has this signature.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(p.sa_sigaction) };
            f(sig, info, ctx);
        }
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            // SAFETY: a plain handler takes the signal number only.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
            f(sig);
        }
        _ => {
            // Returning re-runs the faulting access, which now gets the default
            // action (a core dump) instead of looping through us.
            // SAFETY: restoring the default disposition of SIGBUS.
            unsafe {
                libc::signal(libc::SIGBUS, libc::SIG_DFL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{MappedRegion, Prot};
    use std::os::fd::AsFd;

    fn memfd(len: i64) -> OwnedFd {
        // SAFETY: memfd_create with a static name; ftruncate on the fresh fd.
        unsafe {
            let fd = libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, len), 0);
            OwnedFd::from_raw_fd(fd)
        }
    }

    #[test]
    fn a_file_shrunk_under_a_mapping_faults_into_zero_pages_and_signals() {
        let page = crate::page_size();
        let fd = memfd(4 * page as i64);
        let sig = FaultSignal::new().unwrap();
        let r = MappedRegion::map_fd_watched(fd.as_fd(), 0, 0, 4 * page as u64, Prot::RW, &sig)
            .unwrap();
        let s = r.slice(0, 4 * page).unwrap();
        s.store_u32(3 * page, 7).unwrap();
        assert_eq!(s.load_u32(3 * page), Some(7));
        // SAFETY: shrinking our own memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), page as i64) }, 0);
        let before = repaired_faults();
        // Past the new end: SIGBUS, repaired, reads zeroes.
        assert_eq!(s.load_u32(3 * page), Some(0));
        assert!(repaired_faults() > before);
        assert!(sig.faulted());
        assert!(sig.take());
        assert!(!sig.faulted());
        // The whole range is now private memory: writes work and stay private.
        s.store_u32(0, 9).unwrap();
        assert_eq!(s.load_u32(0), Some(9));
    }

    #[test]
    fn guards_free_their_slots() {
        let sig = FaultSignal::new().unwrap();
        let r = MappedRegion::anonymous(0, 4096).unwrap();
        let p = r.slice(0, 1).unwrap().as_ptr();
        // More guards than slots, one at a time: each drop frees its slot.
        for _ in 0..MAX_GUARDED_RANGES + 10 {
            // SAFETY: `r` stays mapped for the guard's lifetime.
            let g = unsafe { guard_range(p, 4096, &sig) }.unwrap();
            drop(g);
        }
    }

    /// The child half of `a_fault_outside_client_memory_still_kills`.
    #[test]
    #[ignore = "run by a_fault_outside_client_memory_still_kills in a child process"]
    fn child_faults_outside_guarded_memory() {
        let page = crate::page_size();
        let sig = FaultSignal::new().unwrap();
        let fd = memfd(page as i64);
        // The handler is installed (one guarded mapping exists) ...
        let _guarded =
            MappedRegion::map_fd_watched(fd.as_fd(), 0, 0, page as u64, Prot::RW, &sig).unwrap();
        let other = memfd(page as i64);
        // SAFETY: a fresh shared mapping of our own memfd, not registered anywhere.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page,
                libc::PROT_READ,
                libc::MAP_SHARED,
                other.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: shrinking our own memfd.
        assert_eq!(unsafe { libc::ftruncate(other.as_raw_fd(), 0) }, 0);
        // ... but this mapping is not client memory: the read must kill us.
        // SAFETY: p is mapped (reading it faults, which is the point).
        let v = unsafe { std::ptr::read_volatile(p.cast::<u8>()) };
        println!("survived with {v}");
    }

    #[test]
    fn a_fault_outside_client_memory_still_kills() {
        use std::os::unix::process::ExitStatusExt;
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "fault::tests::child_faults_outside_guarded_memory",
                "--nocapture",
            ])
            .output()
            .unwrap();
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGBUS),
            "child: {:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
    }
}
