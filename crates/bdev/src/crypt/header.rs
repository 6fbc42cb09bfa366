//! LUKS headers through libcryptsetup (Debian's `libcryptsetup12`, linked as
//! `-lcryptsetup`), by a small hand-written FFI of the calls udrive needs
//! (docs/decisions/0037-luks-encryption.md says why not `libcryptsetup-rs`).
//!
//! libcryptsetup works on a path, and the volume may be anything a backend
//! serves (a file, an RBD image, memory), so the header area is copied through
//! the backend's own channel into a sealed-off memfd, and libcryptsetup reads
//! (or, to format, writes) that copy. The volume key comes from
//! `crypt_volume_key_get`, which needs no device-mapper.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use guest_mem::MappedRegion;
use zeroize::Zeroizing;

use crate::{BlockDevice, IoChannel, IoOp, IoRequest, IoStatus};

/// How much of a volume is copied for libcryptsetup at first: LUKS2's default
/// header with its keyslot area (the data offset of `cryptsetup luksFormat`).
pub(super) const HEADER_COPY: u64 = 16 << 20;
/// The largest header area udrive copies (a header announcing more is refused).
const MAX_HEADER: u64 = 256 << 20;
/// The longest key file read (cryptsetup's default limit too).
const MAX_KEY_FILE: u64 = 8 << 20;
/// How long one header read or write through the backend may take.
const IO_DEADLINE: Duration = Duration::from_secs(60);

/// Why a LUKS volume cannot be opened or formatted. No variant carries key
/// material.
#[derive(Debug, thiserror::Error)]
pub enum LuksError {
    #[error("key file {path}")]
    KeyFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("key file {path} is empty or longer than {MAX_KEY_FILE} bytes")]
    KeyFileSize { path: PathBuf },
    #[error("secret {name} is empty or longer than {MAX_KEY_FILE} bytes")]
    SecretSize { name: String },
    #[error("{device}: {op} of the LUKS header area failed")]
    HeaderIo {
        device: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{device}: no valid LUKS header (libcryptsetup {call}: {source})")]
    Header {
        device: String,
        call: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{device}: the key file opens no keyslot of the LUKS header")]
    WrongKey { device: String },
    #[error("{device}: keyslot {slot} asks for a key derivation no open should wait for ({what}); refused so that opening cannot hang")]
    KeyDerivation {
        device: String,
        slot: i32,
        what: String,
    },
    #[error("{device}: that key is the volume's last one; add another key before removing it")]
    LastKey { device: String },
    #[error("{device}: cipher {cipher}-{mode} with {key_bytes}-byte keys and {sector}-byte sectors is not supported (aes-xts-plain64, 512- or 4096-byte sectors)")]
    Cipher {
        device: String,
        cipher: String,
        mode: String,
        key_bytes: usize,
        sector: i32,
    },
    #[error("LUKS data offset {data_offset} does not fit a {device_size}-byte device of {block_size}-byte blocks")]
    Layout {
        data_offset: u64,
        device_size: u64,
        block_size: u64,
    },
    #[error("a volume key of {bytes} bytes (aes-xts takes 32 or 64)")]
    KeySize { bytes: usize },
    #[error("the volume key's two aes-xts halves are equal (IEEE 1619 forbids it; OpenSSL refuses the key)")]
    KeyRefused,
    #[error("{device} holds data but no LUKS header: not formatted (create=on formats only a blank volume)")]
    NotBlank { device: String },
}

#[repr(C)]
pub(super) struct CryptDevice {
    _opaque: [u8; 0],
}

#[link(name = "cryptsetup")]
extern "C" {
    fn crypt_init(cd: *mut *mut CryptDevice, device: *const c_char) -> c_int;
    fn crypt_load(
        cd: *mut CryptDevice,
        requested_type: *const c_char,
        params: *mut c_void,
    ) -> c_int;
    pub(super) fn crypt_format(
        cd: *mut CryptDevice,
        type_: *const c_char,
        cipher: *const c_char,
        cipher_mode: *const c_char,
        uuid: *const c_char,
        volume_key: *const c_char,
        volume_key_size: usize,
        params: *mut c_void,
    ) -> c_int;
    pub(super) fn crypt_keyslot_add_by_volume_key(
        cd: *mut CryptDevice,
        keyslot: c_int,
        volume_key: *const c_char,
        volume_key_size: usize,
        passphrase: *const c_char,
        passphrase_size: usize,
    ) -> c_int;
    fn crypt_volume_key_get(
        cd: *mut CryptDevice,
        keyslot: c_int,
        volume_key: *mut c_char,
        volume_key_size: *mut usize,
        passphrase: *const c_char,
        passphrase_size: usize,
    ) -> c_int;
    fn crypt_get_cipher(cd: *mut CryptDevice) -> *const c_char;
    fn crypt_get_cipher_mode(cd: *mut CryptDevice) -> *const c_char;
    fn crypt_get_sector_size(cd: *mut CryptDevice) -> c_int;
    fn crypt_get_data_offset(cd: *mut CryptDevice) -> u64;
    fn crypt_free(cd: *mut CryptDevice);
    fn crypt_set_log_callback(
        cd: *mut CryptDevice,
        log: Option<extern "C" fn(c_int, *const c_char, *mut c_void)>,
        usrptr: *mut c_void,
    );
}

/// libcryptsetup's messages, into the log at debug level instead of onto
/// stderr: what matters of them reaches the caller as a [`LuksError`].
extern "C" fn log_line(level: c_int, msg: *const c_char, _usrptr: *mut c_void) {
    // SAFETY: libcryptsetup passes a NUL-terminated message alive for the call.
    let msg = unsafe { cstr(msg) };
    tracing::debug!(level, "libcryptsetup: {}", msg.trim_end());
}

/// Routes libcryptsetup's messages (process-wide, once) through [`log_line`].
fn quiet_library() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: a null context sets the default callback, a `extern "C"` function
    // that lives for the whole process; no user pointer.
    ONCE.call_once(|| unsafe {
        crypt_set_log_callback(std::ptr::null_mut(), Some(log_line), std::ptr::null_mut())
    });
}

pub(super) const CRYPT_ANY_SLOT: c_int = -1;

/// What an unlocked header gives the data path.
pub(super) struct UnlockedKey {
    pub(super) key: Zeroizing<[u8; 64]>,
    pub(super) len: usize,
    /// The encryption sector.
    pub(super) unit: usize,
    pub(super) data_offset: u64,
}

/// A libcryptsetup context on a header copy, freed on drop.
pub(super) struct Context {
    pub(super) cd: *mut CryptDevice,
    pub(super) device: String,
}

impl Context {
    pub(super) fn init(path: &CStr, device: &str) -> Result<Context, LuksError> {
        quiet_library();
        let mut cd = std::ptr::null_mut();
        // SAFETY: `cd` is an out pointer; `path` is a NUL-terminated string that
        // outlives the call.
        let rc = unsafe { crypt_init(&mut cd, path.as_ptr()) };
        check(rc, device, "crypt_init")?;
        Ok(Context {
            cd,
            device: device.to_string(),
        })
    }

    pub(super) fn err(&self, rc: c_int, call: &'static str) -> LuksError {
        LuksError::Header {
            device: self.device.clone(),
            call,
            source: io::Error::from_raw_os_error(-rc),
        }
    }

    /// Loads a LUKS1 or LUKS2 header.
    fn load(&self) -> Result<(), LuksError> {
        // SAFETY: a live context; a null type means any LUKS version, null params
        // are allowed for LUKS.
        let rc = unsafe { crypt_load(self.cd, std::ptr::null(), std::ptr::null_mut()) };
        if rc < 0 {
            return Err(self.err(rc, "crypt_load"));
        }
        Ok(())
    }

    /// Bytes of header before the payload.
    pub(super) fn data_offset(&self) -> u64 {
        // SAFETY: a live, loaded context.
        unsafe { crypt_get_data_offset(self.cd) }.saturating_mul(512)
    }

    /// The volume key (its bytes and length), unlocked by `passphrase` from any
    /// keyslot, for a cipher the data path implements.
    pub(super) fn volume_key(&self, passphrase: &[u8]) -> Result<UnlockedKey, LuksError> {
        let mut key = Zeroizing::new([0u8; 64]);
        let mut len = key.len();
        // SAFETY: `key` has room for `len` bytes and libcryptsetup writes at most
        // that many (it updates `len`); the passphrase is read for its length.
        let rc = unsafe {
            crypt_volume_key_get(
                self.cd,
                CRYPT_ANY_SLOT,
                key.as_mut_ptr().cast(),
                &mut len,
                passphrase.as_ptr().cast(),
                passphrase.len(),
            )
        };
        if rc == -libc::EPERM || rc == -libc::ENOENT {
            return Err(LuksError::WrongKey {
                device: self.device.clone(),
            });
        }
        if rc < 0 {
            return Err(self.err(rc, "crypt_volume_key_get"));
        }
        // SAFETY: a live, loaded context; the strings live as long as it.
        let (cipher, mode, sector) = unsafe {
            (
                cstr(crypt_get_cipher(self.cd)),
                cstr(crypt_get_cipher_mode(self.cd)),
                crypt_get_sector_size(self.cd),
            )
        };
        let sector_ok = sector == 512 || sector == 4096;
        if cipher != "aes" || mode != "xts-plain64" || !sector_ok || !(len == 32 || len == 64) {
            return Err(LuksError::Cipher {
                device: self.device.clone(),
                cipher,
                mode,
                key_bytes: len,
                sector,
            });
        }
        Ok(UnlockedKey {
            key,
            len,
            unit: sector as usize,
            data_offset: self.data_offset(),
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: made by crypt_init, freed once.
        unsafe { crypt_free(self.cd) }
    }
}

/// A C string libcryptsetup owns, copied (`""` for null).
///
/// # Safety
/// `p` is null or a NUL-terminated string alive for the call.
pub(super) unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: per the caller, NUL-terminated and alive.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

pub(super) fn check(rc: c_int, device: &str, call: &'static str) -> Result<(), LuksError> {
    if rc < 0 {
        return Err(LuksError::Header {
            device: device.to_string(),
            call,
            source: io::Error::from_raw_os_error(-rc),
        });
    }
    Ok(())
}

/// Where a passphrase comes from.
#[derive(Clone, Copy)]
pub enum Key<'a> {
    /// A file, read whole, as `cryptsetup --key-file` does.
    File(&'a Path),
    /// Bytes the caller holds (a secret given over the control socket), with
    /// the name errors give.
    Secret { name: &'a str, bytes: &'a [u8] },
}

impl std::fmt::Debug for Key<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::File(p) => write!(f, "Key::File({})", p.display()),
            Key::Secret { name, .. } => write!(f, "Key::Secret({name})"),
        }
    }
}

impl<'a> From<&'a Path> for Key<'a> {
    fn from(p: &'a Path) -> Key<'a> {
        Key::File(p)
    }
}

impl<'a> From<&'a PathBuf> for Key<'a> {
    fn from(p: &'a PathBuf) -> Key<'a> {
        Key::File(p)
    }
}

impl Key<'_> {
    /// The passphrase, in memory that is zeroed when dropped.
    pub(super) fn read(self) -> Result<Zeroizing<Vec<u8>>, LuksError> {
        match self {
            Key::File(path) => read_key_file(path),
            Key::Secret { name, bytes } => {
                if bytes.is_empty() || bytes.len() as u64 > MAX_KEY_FILE {
                    return Err(LuksError::SecretSize { name: name.into() });
                }
                Ok(Zeroizing::new(bytes.to_vec()))
            }
        }
    }
}

/// Reads a key file whole, as `cryptsetup --key-file` does.
fn read_key_file(path: &Path) -> Result<Zeroizing<Vec<u8>>, LuksError> {
    use std::io::Read;
    let ctx = |source| LuksError::KeyFile {
        path: path.to_path_buf(),
        source,
    };
    let f = std::fs::File::open(path).map_err(ctx)?;
    let mut key = Zeroizing::new(Vec::new());
    f.take(MAX_KEY_FILE + 1)
        .read_to_end(&mut key)
        .map_err(ctx)?;
    if key.is_empty() || key.len() as u64 > MAX_KEY_FILE {
        return Err(LuksError::KeyFileSize {
            path: path.to_path_buf(),
        });
    }
    Ok(key)
}

/// A memory file standing in for the volume's header area, and its path for
/// libcryptsetup.
pub(super) struct HeaderCopy {
    fd: OwnedFd,
    pub(super) path: CString,
}

impl HeaderCopy {
    pub(super) fn new(len: u64) -> io::Result<HeaderCopy> {
        // SAFETY: a NUL-terminated name; the result is checked.
        let raw = unsafe { libc::memfd_create(c"udrive-luks-header".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let file = std::fs::File::from(fd);
        file.set_len(len)?;
        let path = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(HeaderCopy {
            fd: file.into(),
            path,
        })
    }

    pub(super) fn file(&self) -> io::Result<std::fs::File> {
        Ok(std::fs::File::from(self.fd.try_clone()?))
    }
}

/// Moves `len` bytes between the start of `dev` and `file`, through one of the
/// device's channels: `op` Read copies the device into the file, Write the file
/// onto the device.
pub(super) fn copy_header(
    dev: &dyn BlockDevice,
    file: &std::fs::File,
    len: u64,
    op: IoOp,
) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    const STEP: u64 = 1 << 20;
    let buf = MappedRegion::anonymous(0, STEP)?;
    let mut ch = dev.channel()?;
    let mut tmp = vec![0u8; STEP as usize];
    let mut pos = 0;
    while pos < len {
        let n = STEP.min(len - pos);
        let tmp = &mut tmp[..n as usize];
        let b = buf
            .slice(0, n as usize)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        if op == IoOp::Write {
            file.read_exact_at(tmp, pos)?;
            b.write_from(0, tmp)
                .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        }
        let iov = [b];
        let req = IoRequest {
            op,
            offset: pos,
            len: n,
            iov: &iov,
            fua: false,
        };
        match io_wait(&mut *ch, &req)? {
            IoStatus::Ok => {}
            st => return Err(io::Error::other(format!("{op:?} at {pos}: {st:?}"))),
        }
        if op == IoOp::Read {
            b.read_into(0, tmp)
                .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            file.write_all_at(tmp, pos)?;
        }
        pos += n;
    }
    if op == IoOp::Write {
        let flush = IoRequest::without_data(IoOp::Flush, 0, 0, false);
        io_wait(&mut *ch, &flush)?;
    }
    Ok(())
}

/// Runs one request to completion on `ch` (control path: open and format).
fn io_wait(ch: &mut dyn IoChannel, req: &IoRequest<'_>) -> io::Result<IoStatus> {
    if let Some(st) = ch.submit(0, req) {
        return Ok(st);
    }
    let start = Instant::now();
    let mut out = None;
    while out.is_none() {
        ch.flush();
        ch.poll(&mut |_, st| out = Some(st));
        if start.elapsed() > IO_DEADLINE {
            return Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        if out.is_none() {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    Ok(out.unwrap_or(IoStatus::IoError))
}

/// A volume's whole header area, copied, with libcryptsetup's context on it.
pub(super) struct LoadedHeader {
    pub(super) ctx: Context,
    pub(super) copy: HeaderCopy,
    /// Bytes copied: the header and keyslot area, up to the payload.
    pub(super) len: u64,
}

impl LoadedHeader {
    /// Copies the header area of `inner` (the default size first, then all of a
    /// larger one the header announces, up to [`MAX_HEADER`]) and loads it.
    pub(super) fn read(inner: &dyn BlockDevice) -> Result<LoadedHeader, LuksError> {
        let device = inner.describe();
        let size = inner.info().size_bytes();
        let hio = |op, source| LuksError::HeaderIo {
            device: device.clone(),
            op,
            source,
        };
        let mut copied = HEADER_COPY.min(size);
        loop {
            let copy = HeaderCopy::new(copied).map_err(|e| hio("copy", e))?;
            let file = copy.file().map_err(|e| hio("copy", e))?;
            copy_header(inner, &file, copied, IoOp::Read).map_err(|e| hio("read", e))?;
            let ctx = Context::init(&copy.path, &device)?;
            ctx.load()?;
            super::kdf::check_costs(ctx.cd, &device)?;
            let data_offset = ctx.data_offset();
            if data_offset > copied && data_offset <= size.min(MAX_HEADER) {
                // A larger header area than the default: copy all of it.
                copied = data_offset;
                continue;
            }
            return Ok(LoadedHeader {
                ctx,
                copy,
                len: copied.min(data_offset),
            });
        }
    }
}
