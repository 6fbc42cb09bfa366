//! The few librados/librbd calls udrive needs (Ceph 16.2, librbd C API 1.16), with
//! safe wrappers. Hand-written rather than generated: bindgen would pull libclang
//! into every build for about thirty functions, and crates.io has no maintained
//! binding (`librbd-sys` 0.1 predates readv/writev/write_zeroes). Every `unsafe`
//! of the RBD backend is in this file and in `aio.rs` (the I/O path's calls).
//!
//! Thread safety: librados cluster handles, I/O contexts and librbd image handles
//! are internally locked and documented as usable from several threads at once
//! (QEMU and SPDK share one image handle between their I/O threads); the wrappers
//! are therefore `Send + Sync`.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io;
use std::ptr;

use super::error::RbdError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

type rados_t = *mut c_void;
type rados_ioctx_t = *mut c_void;
pub(super) type rbd_image_t = *mut c_void;
type rbd_image_options_t = *mut c_void;
type librbd_progress_fn_t = extern "C" fn(u64, u64, *mut c_void) -> c_int;

/// librbd calls a resize's progress function unconditionally (a null one crashes
/// it); we have no progress to show.
extern "C" fn no_progress(_offset: u64, _total: u64, _arg: *mut c_void) -> c_int {
    0
}

#[repr(C)]
struct rbd_snap_info_t {
    id: u64,
    size: u64,
    name: *const c_char,
}

const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;
const RBD_IMAGE_OPTION_FORMAT: c_int = 0;
const RBD_IMAGE_OPTION_FEATURES: c_int = 1;
/// layering, exclusive-lock, object-map, fast-diff, deep-flatten: `rbd create`'s
/// defaults in 16.2 (features.h RBD_FEATURES_DEFAULT).
const RBD_FEATURES_DEFAULT: u64 = 1 | 4 | 8 | 16 | 32;

#[link(name = "rados")]
extern "C" {
    fn rados_create(cluster: *mut rados_t, id: *const c_char) -> c_int;
    fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    fn rados_conf_get(
        cluster: rados_t,
        option: *const c_char,
        buf: *mut c_char,
        len: usize,
    ) -> c_int;
    fn rados_connect(cluster: rados_t) -> c_int;
    fn rados_shutdown(cluster: rados_t);
    fn rados_ioctx_create(cluster: rados_t, pool: *const c_char, io: *mut rados_ioctx_t) -> c_int;
    fn rados_ioctx_set_namespace(io: rados_ioctx_t, nspace: *const c_char);
    fn rados_ioctx_destroy(io: rados_ioctx_t);
    fn rados_getaddrs(cluster: rados_t, addrs: *mut *mut c_char) -> c_int;
    fn rados_buffer_free(buf: *mut c_char);
}

#[link(name = "rbd")]
extern "C" {
    fn rbd_open(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap: *const c_char,
    ) -> c_int;
    fn rbd_open_read_only(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap: *const c_char,
    ) -> c_int;
    fn rbd_close(image: rbd_image_t) -> c_int;
    fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    fn rbd_resize2(
        image: rbd_image_t,
        size: u64,
        allow_shrink: bool,
        cb: librbd_progress_fn_t,
        cbdata: *mut c_void,
    ) -> c_int;
    fn rbd_lock_acquire(image: rbd_image_t, mode: c_int) -> c_int;
    fn rbd_lock_release(image: rbd_image_t) -> c_int;
    fn rbd_lock_get_owners(
        image: rbd_image_t,
        mode: *mut c_int,
        owners: *mut *mut c_char,
        max: *mut usize,
    ) -> c_int;
    fn rbd_lock_get_owners_cleanup(owners: *mut *mut c_char, count: usize);
    fn rbd_lock_break(image: rbd_image_t, mode: c_int, owner: *const c_char) -> c_int;
    fn rbd_image_options_create(opts: *mut rbd_image_options_t);
    fn rbd_image_options_destroy(opts: rbd_image_options_t);
    fn rbd_image_options_set_uint64(opts: rbd_image_options_t, optname: c_int, val: u64) -> c_int;
    fn rbd_create4(
        io: rados_ioctx_t,
        name: *const c_char,
        size: u64,
        opts: rbd_image_options_t,
    ) -> c_int;
    fn rbd_remove(io: rados_ioctx_t, name: *const c_char) -> c_int;
    fn rbd_clone3(
        p_io: rados_ioctx_t,
        p_name: *const c_char,
        p_snap: *const c_char,
        c_io: rados_ioctx_t,
        c_name: *const c_char,
        opts: rbd_image_options_t,
    ) -> c_int;
    fn rbd_snap_create(image: rbd_image_t, name: *const c_char) -> c_int;
    fn rbd_snap_remove(image: rbd_image_t, name: *const c_char) -> c_int;
    fn rbd_snap_rollback(image: rbd_image_t, name: *const c_char) -> c_int;
    fn rbd_snap_protect(image: rbd_image_t, name: *const c_char) -> c_int;
    fn rbd_snap_unprotect(image: rbd_image_t, name: *const c_char) -> c_int;
    fn rbd_snap_is_protected(image: rbd_image_t, name: *const c_char, prot: *mut c_int) -> c_int;
    fn rbd_snap_list(image: rbd_image_t, snaps: *mut rbd_snap_info_t, max: *mut c_int) -> c_int;
    fn rbd_snap_list_end(snaps: *mut rbd_snap_info_t);
    fn rbd_flush(image: rbd_image_t) -> c_int;
}

type Result<T> = std::result::Result<T, RbdError>;

/// `Ok` for a librados/librbd return value that is not a negative errno; else the
/// error, with `what` was being done.
pub(super) fn check(ret: c_int, what: impl FnOnce() -> String) -> Result<()> {
    if ret < 0 {
        Err(RbdError::call(i64::from(ret), what()))
    } else {
        Ok(())
    }
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| RbdError::Nul {
        value: s.to_string(),
    })
}

fn opt_ptr(s: &Option<CString>) -> *const c_char {
    s.as_ref().map_or(ptr::null(), |c| c.as_ptr())
}

/// A connected librados cluster handle (`rados_t`).
pub struct Rados {
    raw: rados_t,
}

// SAFETY: librados cluster handles are thread-safe (internally locked; the C API
// documents concurrent use from several threads).
unsafe impl Send for Rados {}
// SAFETY: as above.
unsafe impl Sync for Rados {}

impl Rados {
    /// Creates a handle for client `id` (None: `admin`), reads `conf` (None: the
    /// default search path, /etc/ceph/ceph.conf), applies `settings` and connects.
    pub fn connect(
        id: Option<&str>,
        conf: Option<&str>,
        settings: &[(&str, String)],
    ) -> Result<Rados> {
        let id = id.map(cstr).transpose()?;
        let mut raw: rados_t = ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer; `id` is NUL-terminated or null.
        check(unsafe { rados_create(&mut raw, opt_ptr(&id)) }, || {
            "cannot create a Ceph client handle".into()
        })?;
        // From here on `Drop` shuts the handle down, connected or not.
        let r = Rados { raw };
        let conf_c = conf.map(cstr).transpose()?;
        // SAFETY: `r.raw` is a live handle, the path NUL-terminated or null.
        let ret = unsafe { rados_conf_read_file(r.raw, opt_ptr(&conf_c)) };
        check(ret, || {
            format!(
                "cannot read the Ceph configuration {}",
                conf.unwrap_or("(default: /etc/ceph/ceph.conf)")
            )
        })?;
        for (k, v) in settings {
            let (kc, vc) = (cstr(k)?, cstr(v)?);
            // SAFETY: live handle, NUL-terminated strings.
            let ret = unsafe { rados_conf_set(r.raw, kc.as_ptr(), vc.as_ptr()) };
            check(ret, || format!("cannot set Ceph option {k}={v}"))?;
        }
        // SAFETY: live, configured handle.
        check(unsafe { rados_connect(r.raw) }, || {
            "cannot connect to the Ceph cluster".into()
        })?;
        Ok(r)
    }

    /// The value of a configuration option (after the conf file and overrides).
    pub fn conf_get(&self, option: &str) -> Result<String> {
        let opt = cstr(option)?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: live handle; `buf` is writable for its length and NUL-terminated
        // by librados on success.
        let ret = unsafe { rados_conf_get(self.raw, opt.as_ptr(), buf.as_mut_ptr(), buf.len()) };
        check(ret, || format!("cannot read Ceph option {option}"))?;
        // SAFETY: NUL-terminated within `buf` on success (above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// This client's addresses as the cluster sees them (`rados_getaddrs`), e.g.
    /// `127.0.0.1:0/3417622045`: what an exclusive lock's owner is named by.
    pub fn addrs(&self) -> Result<String> {
        let mut out: *mut c_char = ptr::null_mut();
        // SAFETY: live, connected handle; valid out pointer.
        let ret = unsafe { rados_getaddrs(self.raw, &mut out) };
        check(ret, || "cannot read the Ceph client's address".into())?;
        if out.is_null() {
            return Ok(String::new());
        }
        // SAFETY: librados returned a NUL-terminated string it allocated.
        let s = unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: allocated by librados for us, freed once.
        unsafe { rados_buffer_free(out) };
        Ok(s)
    }

    /// An I/O context on `pool` (and RADOS namespace `ns`, if given).
    pub fn ioctx(self: &Arc<Self>, pool: &str, ns: Option<&str>) -> Result<IoCtx> {
        let p = cstr(pool)?;
        let mut raw: rados_ioctx_t = ptr::null_mut();
        // SAFETY: live handle, valid out pointer, NUL-terminated pool name.
        let ret = unsafe { rados_ioctx_create(self.raw, p.as_ptr(), &mut raw) };
        check(ret, || format!("cannot open pool {pool:?}"))?;
        let io = IoCtx {
            raw,
            _rados: self.clone(),
        };
        if let Some(ns) = ns {
            let n = cstr(ns)?;
            // SAFETY: live ioctx; librados copies the name.
            unsafe { rados_ioctx_set_namespace(io.raw, n.as_ptr()) };
        }
        Ok(io)
    }
}

impl Drop for Rados {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; every IoCtx holds an Arc to it, so none is left.
        unsafe { rados_shutdown(self.raw) };
    }
}

/// An I/O context (pool + namespace), keeping its cluster handle alive.
pub struct IoCtx {
    raw: rados_ioctx_t,
    _rados: Arc<Rados>,
}

// SAFETY: librados I/O contexts are thread-safe for the calls used here (image
// open/create/remove/clone, which librbd serialises internally).
unsafe impl Send for IoCtx {}
// SAFETY: as above.
unsafe impl Sync for IoCtx {}

impl Drop for IoCtx {
    fn drop(&mut self) {
        // SAFETY: ours; every Image holds an Arc to its IoCtx.
        unsafe { rados_ioctx_destroy(self.raw) };
    }
}

/// Image creation options (`rbd_image_options_t`) with format 2 and the default
/// features, freed on drop.
struct ImageOptions(rbd_image_options_t);

impl ImageOptions {
    fn new() -> ImageOptions {
        let mut raw: rbd_image_options_t = ptr::null_mut();
        // SAFETY: valid out pointer.
        unsafe { rbd_image_options_create(&mut raw) };
        // SAFETY: `raw` was just created; option ids and values are valid.
        unsafe {
            rbd_image_options_set_uint64(raw, RBD_IMAGE_OPTION_FORMAT, 2);
            rbd_image_options_set_uint64(raw, RBD_IMAGE_OPTION_FEATURES, RBD_FEATURES_DEFAULT);
        }
        ImageOptions(raw)
    }
}

impl Drop for ImageOptions {
    fn drop(&mut self) {
        // SAFETY: created in `new`, freed once.
        unsafe { rbd_image_options_destroy(self.0) };
    }
}

impl IoCtx {
    pub fn create_image(&self, name: &str, size: u64) -> Result<()> {
        let n = cstr(name)?;
        let opts = ImageOptions::new();
        // SAFETY: live ioctx, NUL-terminated name, live options.
        let ret = unsafe { rbd_create4(self.raw, n.as_ptr(), size, opts.0) };
        check(ret, || format!("cannot create image {name:?}"))
    }

    pub fn remove_image(&self, name: &str) -> Result<()> {
        let n = cstr(name)?;
        // SAFETY: live ioctx, NUL-terminated name.
        check(unsafe { rbd_remove(self.raw, n.as_ptr()) }, || {
            format!("cannot remove image {name:?}")
        })
    }

    /// Clones protected snapshot `snap` of `parent` (in this context) into `child`
    /// in context `dest`.
    pub fn clone_image(&self, parent: &str, snap: &str, dest: &IoCtx, child: &str) -> Result<()> {
        let (p, s, c) = (cstr(parent)?, cstr(snap)?, cstr(child)?);
        let opts = ImageOptions::new();
        // SAFETY: live ioctxs, NUL-terminated names, live options.
        let ret = unsafe {
            rbd_clone3(
                self.raw,
                p.as_ptr(),
                s.as_ptr(),
                dest.raw,
                c.as_ptr(),
                opts.0,
            )
        };
        check(ret, || {
            format!("cannot clone {parent}@{snap} into {child:?}")
        })
    }
}

/// An open image (`rbd_image_t`), shared by every channel of one device.
pub struct Image {
    pub(super) raw: rbd_image_t,
    locked: AtomicBool,
    /// The lock was released by [`Image::unlock`] and is to be taken back.
    released: AtomicBool,
    _io: Arc<IoCtx>,
}

// SAFETY: librbd image handles are thread-safe: aio calls and control operations
// take the image's internal locks (QEMU and SPDK issue I/O on one handle from
// several threads).
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

/// A snapshot of an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapInfo {
    pub name: String,
    pub id: u64,
    pub size: u64,
    pub protected: bool,
}

impl Image {
    /// Opens `name` (at snapshot `snap`, read-only, if given).
    pub fn open(io: &Arc<IoCtx>, name: &str, snap: Option<&str>, read_only: bool) -> Result<Image> {
        let n = cstr(name)?;
        let s = snap.map(cstr).transpose()?;
        let mut raw: rbd_image_t = ptr::null_mut();
        // SAFETY: live ioctx, valid out pointer, NUL-terminated names (or null).
        let ret = unsafe {
            if read_only {
                rbd_open_read_only(io.raw, n.as_ptr(), &mut raw, opt_ptr(&s))
            } else {
                rbd_open(io.raw, n.as_ptr(), &mut raw, opt_ptr(&s))
            }
        };
        check(ret, || match snap {
            Some(snap) => format!("cannot open image {name:?} at snapshot {snap:?}"),
            None => format!("cannot open image {name:?}"),
        })?;
        Ok(Image {
            raw,
            locked: AtomicBool::new(false),
            released: AtomicBool::new(false),
            _io: io.clone(),
        })
    }

    pub fn size(&self) -> Result<u64> {
        let mut size = 0u64;
        // SAFETY: live image, valid out pointer.
        check(unsafe { rbd_get_size(self.raw, &mut size) }, || {
            "cannot read the image size".into()
        })?;
        Ok(size)
    }

    pub fn features(&self) -> Result<u64> {
        let mut f = 0u64;
        // SAFETY: live image, valid out pointer.
        check(unsafe { rbd_get_features(self.raw, &mut f) }, || {
            "cannot read the image features".into()
        })?;
        Ok(f)
    }

    /// Takes the image's exclusive lock and keeps it (librbd then does not hand
    /// it to another client that asks): a second writer is refused instead of
    /// trading the lock back and forth with this one.
    pub fn lock_exclusive(&self) -> Result<()> {
        // SAFETY: live image.
        let ret = unsafe { rbd_lock_acquire(self.raw, RBD_LOCK_MODE_EXCLUSIVE) };
        check(ret, || "cannot take the image's exclusive lock".into())?;
        self.locked.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Releases the exclusive lock taken by [`Image::lock_exclusive`] (nothing if
    /// not held). Writes fail (EROFS) until it is taken again: librbd does not
    /// take it back by itself once `rbd_lock_acquire` chose the standard policy.
    pub fn unlock(&self) -> Result<()> {
        if !self.locked.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        // SAFETY: live image.
        let ret = unsafe { rbd_lock_release(self.raw) };
        if let Err(e) = check(ret, || "cannot release the image's exclusive lock".into()) {
            self.locked.store(true, Ordering::Relaxed);
            return Err(e);
        }
        self.released.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Whether [`Image::unlock`] let the lock go (a successor may write now).
    pub fn was_released(&self) -> bool {
        self.released.load(Ordering::Relaxed)
    }

    /// Marks the lock as let go (a successor may hold it) or taken back.
    pub fn set_released(&self, v: bool) {
        self.released.store(v, Ordering::Relaxed);
    }

    /// The exclusive lock's owners (client addresses, as `rados_getaddrs` gives
    /// them); empty when it is free.
    pub fn lock_owners(&self) -> Result<Vec<String>> {
        let mut max: usize = 4;
        loop {
            let mut owners: Vec<*mut c_char> = vec![ptr::null_mut(); max];
            let mut mode: c_int = 0;
            let mut n = max;
            // SAFETY: live image; `owners` has room for `n` pointers.
            let ret =
                unsafe { rbd_lock_get_owners(self.raw, &mut mode, owners.as_mut_ptr(), &mut n) };
            if ret == -libc::ENOENT {
                return Ok(Vec::new());
            }
            if ret == -libc::ERANGE && n > max {
                max = n;
                continue;
            }
            check(ret, || "cannot read the image's lock owners".into())?;
            let n = n.min(max);
            let out = owners[..n]
                .iter()
                .filter(|p| !p.is_null())
                // SAFETY: librbd filled the first `n` entries with NUL-terminated
                // strings it owns until the cleanup call below.
                .map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
                .collect();
            // SAFETY: frees the `n` strings librbd allocated, once.
            unsafe { rbd_lock_get_owners_cleanup(owners.as_mut_ptr(), n) };
            return Ok(out);
        }
    }

    /// Breaks the exclusive lock held by `owner` (an address from
    /// [`Image::lock_owners`]); librbd blocklists that client first
    /// (`rbd_blocklist_on_break_lock`, default on), so it can never write again.
    pub fn break_lock(&self, owner: &str) -> Result<()> {
        let o = cstr(owner)?;
        // SAFETY: live image, NUL-terminated owner.
        let ret = unsafe { rbd_lock_break(self.raw, RBD_LOCK_MODE_EXCLUSIVE, o.as_ptr()) };
        check(ret, || format!("cannot break the lock held by {owner}"))
    }

    pub fn resize(&self, size: u64, allow_shrink: bool) -> Result<()> {
        // SAFETY: live image; `no_progress` matches librbd_progress_fn_t.
        let ret =
            unsafe { rbd_resize2(self.raw, size, allow_shrink, no_progress, ptr::null_mut()) };
        check(ret, || format!("cannot resize the image to {size} bytes"))
    }

    pub fn flush(&self) -> Result<()> {
        // SAFETY: live image.
        check(unsafe { rbd_flush(self.raw) }, || {
            "cannot flush the image".into()
        })
    }

    fn snap_call(
        &self,
        name: &str,
        what: &str,
        f: unsafe extern "C" fn(rbd_image_t, *const c_char) -> c_int,
    ) -> Result<()> {
        let n = cstr(name)?;
        // SAFETY: live image, NUL-terminated snapshot name; `f` is one of the
        // librbd snapshot calls taking exactly these arguments.
        check(unsafe { f(self.raw, n.as_ptr()) }, || {
            format!("cannot {what} snapshot {name:?}")
        })
    }

    pub fn snap_create(&self, name: &str) -> Result<()> {
        self.snap_call(name, "create", rbd_snap_create)
    }
    pub fn snap_remove(&self, name: &str) -> Result<()> {
        self.snap_call(name, "remove", rbd_snap_remove)
    }
    pub fn snap_rollback(&self, name: &str) -> Result<()> {
        self.snap_call(name, "roll back to", rbd_snap_rollback)
    }
    pub fn snap_protect(&self, name: &str) -> Result<()> {
        self.snap_call(name, "protect", rbd_snap_protect)
    }
    pub fn snap_unprotect(&self, name: &str) -> Result<()> {
        self.snap_call(name, "unprotect", rbd_snap_unprotect)
    }

    pub fn snap_list(&self) -> Result<Vec<SnapInfo>> {
        let mut max: c_int = 16;
        loop {
            let cap = usize::try_from(max).unwrap_or(16);
            let mut buf: Vec<rbd_snap_info_t> = Vec::with_capacity(cap);
            // SAFETY: `buf` has room for `max` entries; librbd writes at most that
            // many (or returns -ERANGE with the number needed in `max`).
            let ret = unsafe { rbd_snap_list(self.raw, buf.as_mut_ptr(), &mut max) };
            if ret == -libc::ERANGE {
                continue;
            }
            check(ret, || "cannot list snapshots".into())?;
            let n = usize::try_from(ret).unwrap_or(0).min(cap);
            // SAFETY: librbd initialised the first `ret` entries.
            unsafe { buf.set_len(n) };
            let mut out = Vec::with_capacity(n);
            for s in &buf {
                // SAFETY: names are NUL-terminated strings owned by the list until
                // `rbd_snap_list_end` below.
                let name = unsafe { CStr::from_ptr(s.name) }
                    .to_string_lossy()
                    .into_owned();
                out.push(SnapInfo {
                    name,
                    id: s.id,
                    size: s.size,
                    protected: false,
                });
            }
            // SAFETY: frees the names of the entries librbd filled in, up to the
            // terminating entry with a null name it wrote after them.
            unsafe { rbd_snap_list_end(buf.as_mut_ptr()) };
            for s in &mut out {
                let c = cstr(&s.name)?;
                let mut p: c_int = 0;
                // SAFETY: live image, NUL-terminated name, valid out pointer.
                let ret = unsafe { rbd_snap_is_protected(self.raw, c.as_ptr(), &mut p) };
                check(ret, || format!("cannot read snapshot {:?}", s.name))?;
                s.protected = p != 0;
            }
            return Ok(out);
        }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: the handle is ours, and every channel (which holds an Arc to the
        // device, hence to this image) waited for its requests before dropping.
        unsafe {
            if self.locked.load(Ordering::Relaxed) {
                rbd_lock_release(self.raw);
            }
            rbd_close(self.raw);
        }
    }
}

/// Runs `f` with the calling thread's CPU affinity set to `cpus` (threads `f`
/// starts inherit it), then restores the previous mask. Errors setting the mask
/// are returned without running `f`.
pub fn with_affinity<T>(cpus: &[usize], f: impl FnOnce() -> T) -> Result<T> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut old: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer and size; pid 0 = this thread.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut old) } != 0
    {
        return Err(RbdError::Affinity(io::Error::last_os_error()));
    }
    // SAFETY: as above.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c < libc::CPU_SETSIZE as usize {
            // SAFETY: `c` is below CPU_SETSIZE.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
    }
    // SAFETY: valid pointer and size.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(RbdError::Affinity(io::Error::last_os_error()));
    }
    let out = f();
    // SAFETY: restores the mask read above.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &old) };
    Ok(out)
}
