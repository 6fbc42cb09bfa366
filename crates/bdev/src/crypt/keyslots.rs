//! Keyslots of an open LUKS volume, changed while its disk serves I/O: a key
//! added, changed or removed (`luks_add_key` and friends over RPC), and the
//! header's description (`luksDump`'s first lines and its active keyslots).
//!
//! Through the same header copy as opening: the header area is read into a
//! memfd, libcryptsetup changes the copy, and the area is written back through a
//! channel of the volume. The payload starts after the header area, so the
//! guest's I/O, which the data path keeps inside the payload, never meets the
//! write. One change at a time per process (a lock), so two changes never write
//! back copies of each other's old header.

use std::ffi::{c_char, c_int};
use std::sync::Mutex;

use super::header::{copy_header, cstr, CryptDevice, Key, LoadedHeader, LuksError, CRYPT_ANY_SLOT};
use super::kdf::{active_slots, crypt_get_type, crypt_keyslot_status, SLOT_ACTIVE_LAST};
use crate::{BlockDevice, IoOp};

#[link(name = "cryptsetup")]
extern "C" {
    fn crypt_get_uuid(cd: *mut CryptDevice) -> *const c_char;
    fn crypt_get_cipher(cd: *mut CryptDevice) -> *const c_char;
    fn crypt_get_cipher_mode(cd: *mut CryptDevice) -> *const c_char;
    fn crypt_get_sector_size(cd: *mut CryptDevice) -> c_int;
    fn crypt_get_volume_key_size(cd: *mut CryptDevice) -> c_int;
    fn crypt_keyslot_add_by_passphrase(
        cd: *mut CryptDevice,
        keyslot: c_int,
        passphrase: *const c_char,
        passphrase_size: usize,
        new_passphrase: *const c_char,
        new_passphrase_size: usize,
    ) -> c_int;
    fn crypt_keyslot_change_by_passphrase(
        cd: *mut CryptDevice,
        keyslot_old: c_int,
        keyslot_new: c_int,
        passphrase: *const c_char,
        passphrase_size: usize,
        new_passphrase: *const c_char,
        new_passphrase_size: usize,
    ) -> c_int;
    fn crypt_activate_by_passphrase(
        cd: *mut CryptDevice,
        name: *const c_char,
        keyslot: c_int,
        passphrase: *const c_char,
        passphrase_size: usize,
        flags: u32,
    ) -> c_int;
    fn crypt_keyslot_destroy(cd: *mut CryptDevice, keyslot: c_int) -> c_int;
    fn crypt_set_iteration_time(cd: *mut CryptDevice, iteration_time_ms: u64);
}

/// A LUKS header as `cryptsetup luksDump` begins to show it. No key material.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuksStatus {
    /// `LUKS1` or `LUKS2`.
    pub version: String,
    pub uuid: String,
    pub cipher: String,
    pub cipher_mode: String,
    pub key_bits: u32,
    pub sector_size: u32,
    /// Where the payload starts on the backend, in bytes.
    pub data_offset: u64,
    /// Keyslots that hold a key.
    pub keyslots: Vec<u32>,
}

/// What to do to the keyslots; every change needs a key that opens the volume.
#[derive(Debug, Clone, Copy)]
pub enum KeyChange<'a> {
    /// Add the passphrase `new` in a free keyslot.
    Add { new: Key<'a> },
    /// Replace the passphrase in the keyslot the key opens with `new`.
    Change { new: Key<'a> },
    /// Remove the keyslot the key opens (never the last one).
    Remove,
}

/// The header of the LUKS volume `volume` (the backend under the payload).
pub fn luks_status(volume: &dyn BlockDevice) -> Result<LuksStatus, LuksError> {
    let h = LoadedHeader::read(volume)?;
    Ok(status(&h))
}

fn status(h: &LoadedHeader) -> LuksStatus {
    let cd = h.ctx.cd;
    // SAFETY: a live, loaded context; the strings it returns live as long as it
    // and are copied at once.
    unsafe {
        LuksStatus {
            version: cstr(crypt_get_type(cd)),
            uuid: cstr(crypt_get_uuid(cd)),
            cipher: cstr(crypt_get_cipher(cd)),
            cipher_mode: cstr(crypt_get_cipher_mode(cd)),
            key_bits: u32::try_from(crypt_get_volume_key_size(cd)).unwrap_or(0) * 8,
            sector_size: u32::try_from(crypt_get_sector_size(cd)).unwrap_or(0),
            data_offset: h.ctx.data_offset(),
            keyslots: active_slots(cd)
                .filter_map(|s| u32::try_from(s).ok())
                .collect(),
        }
    }
}

/// Changes the keyslots of `volume` with the passphrase `key`, writes
/// the header back and returns it as it is now, with the keyslot changed. A new
/// keyslot's key derivation is measured to take `iter_time_ms` (None:
/// libcryptsetup's default, 2 s, as `cryptsetup --iter-time`).
pub fn change_key(
    volume: &dyn BlockDevice,
    key: Key<'_>,
    change: KeyChange<'_>,
    iter_time_ms: Option<u64>,
) -> Result<(LuksStatus, u32), LuksError> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let pass = key.read()?;
    let h = LoadedHeader::read(volume)?;
    let (cd, device) = (h.ctx.cd, h.ctx.device.clone());
    if let Some(ms) = iter_time_ms {
        // SAFETY: a live, loaded context.
        unsafe { crypt_set_iteration_time(cd, ms) };
    }
    let new = match change {
        KeyChange::Add { new } | KeyChange::Change { new } => Some(new.read()?),
        KeyChange::Remove => None,
    };
    let new_ref: &[u8] = new.as_deref().map_or(&[], |n| n);
    let rc = match change {
        KeyChange::Add { .. } => add(cd, &pass, new_ref),
        KeyChange::Change { .. } => replace(cd, &pass, new_ref),
        KeyChange::Remove => remove(cd, &pass, &device)?,
    };
    if rc == -libc::EPERM || rc == -libc::ENOENT {
        return Err(LuksError::WrongKey { device });
    }
    if rc < 0 {
        return Err(h.ctx.err(rc, "keyslot change"));
    }
    let file = h.copy.file().map_err(|e| LuksError::HeaderIo {
        device: device.clone(),
        op: "copy",
        source: e,
    })?;
    copy_header(volume, &file, h.len, IoOp::Write).map_err(|e| LuksError::HeaderIo {
        device,
        op: "write",
        source: e,
    })?;
    let slot = u32::try_from(rc).unwrap_or(0);
    Ok((status(&h), slot))
}

fn add(cd: *mut CryptDevice, pass: &[u8], new: &[u8]) -> c_int {
    // SAFETY: a live, loaded context; both passphrases are read for their lengths.
    unsafe {
        crypt_keyslot_add_by_passphrase(
            cd,
            CRYPT_ANY_SLOT,
            pass.as_ptr().cast(),
            pass.len(),
            new.as_ptr().cast(),
            new.len(),
        )
    }
}

fn replace(cd: *mut CryptDevice, pass: &[u8], new: &[u8]) -> c_int {
    // SAFETY: a live, loaded context; both passphrases are read for their lengths.
    unsafe {
        crypt_keyslot_change_by_passphrase(
            cd,
            CRYPT_ANY_SLOT,
            CRYPT_ANY_SLOT,
            pass.as_ptr().cast(),
            pass.len(),
            new.as_ptr().cast(),
            new.len(),
        )
    }
}

/// Destroys the keyslot `pass` opens; its number, or libcryptsetup's error.
fn remove(cd: *mut CryptDevice, pass: &[u8], device: &str) -> Result<c_int, LuksError> {
    // SAFETY: a live, loaded context; a null name only checks the passphrase
    // (nothing is activated), which is read for its length.
    let slot = unsafe {
        crypt_activate_by_passphrase(
            cd,
            std::ptr::null(),
            CRYPT_ANY_SLOT,
            pass.as_ptr().cast(),
            pass.len(),
            0,
        )
    };
    if slot < 0 {
        return Ok(slot);
    }
    // SAFETY: a live, loaded context and a slot number it returned.
    if unsafe { crypt_keyslot_status(cd, slot) } == SLOT_ACTIVE_LAST {
        return Err(LuksError::LastKey {
            device: device.to_string(),
        });
    }
    // SAFETY: as above.
    let rc = unsafe { crypt_keyslot_destroy(cd, slot) };
    Ok(if rc < 0 { rc } else { slot })
}
