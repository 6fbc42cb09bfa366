//! Opening and formatting LUKS volumes: the header (crate::crypt::header)
//! unlocked or made by libcryptsetup, the payload served by [`CryptDisk`].

use std::io;
use std::sync::Arc;

use zeroize::Zeroizing;

use super::header::{
    check, copy_header, crypt_format, crypt_keyslot_add_by_volume_key, Context, HeaderCopy, Key,
    LoadedHeader, LuksError, UnlockedKey, CRYPT_ANY_SLOT,
};
use super::CryptDisk;
use crate::{BlockDevice, IoOp};

/// The payload of `inner`, with the key a header gave.
fn open_unlocked(key: &UnlockedKey, inner: Arc<dyn BlockDevice>) -> Result<CryptDisk, LuksError> {
    CryptDisk::with_key(inner, &key.key[..key.len], key.unit, key.data_offset)
}

/// What opening and formatting start from.
struct Start {
    pass: Zeroizing<Vec<u8>>,
    device: String,
    size: u64,
}

impl Start {
    fn new(inner: &dyn BlockDevice, key: Key<'_>) -> Result<Start, LuksError> {
        Ok(Start {
            pass: key.read()?,
            device: inner.describe(),
            size: inner.info().size_bytes(),
        })
    }

    /// Copying the header area failed at `op`.
    fn header_io(&self, op: &'static str, source: io::Error) -> LuksError {
        LuksError::HeaderIo {
            device: self.device.clone(),
            op,
            source,
        }
    }
}

/// Opens the LUKS volume on `inner` with the passphrase `key`: the volume's
/// payload, encrypted and decrypted on the fly.
pub fn open_luks<'a>(
    inner: Arc<dyn BlockDevice>,
    key: impl Into<Key<'a>>,
) -> Result<CryptDisk, LuksError> {
    let pass = key.into().read()?;
    let header = LoadedHeader::read(&*inner)?;
    open_unlocked(&header.ctx.volume_key(&pass)?, inner)
}

/// Formats `inner` as a new LUKS2 volume (aes-xts-plain64, a 512-bit random
/// volume key, libcryptsetup's default argon2id keyslot for the passphrase in
/// `key`) and opens it. Whatever `inner` held is lost.
pub fn format_luks<'a>(
    inner: Arc<dyn BlockDevice>,
    key: impl Into<Key<'a>>,
) -> Result<CryptDisk, LuksError> {
    let start = Start::new(&*inner, key.into())?;
    let hio = |op, source| start.header_io(op, source);
    let (pass, device, size) = (&start.pass, &start.device, start.size);
    // Sparse: only what libcryptsetup writes takes memory.
    let copy = HeaderCopy::new(size).map_err(|e| hio("copy", e))?;
    let ctx = Context::init(&copy.path, device)?;
    // SAFETY: a live context; NUL-terminated strings; a null key asks
    // libcryptsetup to generate one of 64 bytes; null params are its defaults.
    let rc = unsafe {
        crypt_format(
            ctx.cd,
            c"LUKS2".as_ptr(),
            c"aes".as_ptr(),
            c"xts-plain64".as_ptr(),
            std::ptr::null(),
            std::ptr::null(),
            64,
            std::ptr::null_mut(),
        )
    };
    check(rc, device, "crypt_format")?;
    // SAFETY: a formatted context holding its volume key (null: use it); the
    // passphrase is read for its length.
    let rc = unsafe {
        crypt_keyslot_add_by_volume_key(
            ctx.cd,
            CRYPT_ANY_SLOT,
            std::ptr::null(),
            0,
            pass.as_ptr().cast(),
            pass.len(),
        )
    };
    check(rc, device, "crypt_keyslot_add_by_volume_key")?;
    let data_offset = ctx.data_offset();
    if data_offset == 0 || data_offset >= size {
        return Err(LuksError::Layout {
            data_offset,
            device_size: size,
            block_size: u64::from(inner.info().block_size),
        });
    }
    let key = ctx.volume_key(pass)?;
    let file = copy.file().map_err(|e| hio("copy", e))?;
    copy_header(&*inner, &file, data_offset, IoOp::Write).map_err(|e| hio("write", e))?;
    open_unlocked(&key, inner)
}

/// Opens the LUKS volume on `inner`; a blank `inner` (its first 4 KiB all zero,
/// as a new file, RAM disk or image) is formatted first ([`format_luks`]). A
/// backend that holds anything else is refused: this never formats over data, so
/// the same spec opens the same volume on every start and after a handover.
pub fn open_or_format_luks<'a>(
    inner: Arc<dyn BlockDevice>,
    key: impl Into<Key<'a>>,
) -> Result<CryptDisk, LuksError> {
    let key = key.into();
    const PROBE: u64 = 4096;
    let device = inner.describe();
    let hio = |source| LuksError::HeaderIo {
        device: device.clone(),
        op: "read",
        source,
    };
    let copy = HeaderCopy::new(PROBE).map_err(hio)?;
    let file = copy.file().map_err(hio)?;
    copy_header(
        &*inner,
        &file,
        PROBE.min(inner.info().size_bytes()),
        IoOp::Read,
    )
    .map_err(hio)?;
    let mut head = [0u8; PROBE as usize];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0).map_err(hio)?;
    if head.starts_with(b"LUKS\xba\xbe") {
        open_luks(inner, key)
    } else if head.iter().all(|b| *b == 0) {
        format_luks(inner, key)
    } else {
        Err(LuksError::NotBlank { device })
    }
}
