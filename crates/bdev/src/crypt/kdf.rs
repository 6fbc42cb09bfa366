//! Bounds on what a LUKS header may ask a key derivation to cost. A header is
//! data from whoever wrote the volume: one whose keyslot asks for a billion
//! PBKDF2 rounds or argon2 passes over gigabytes would hold an open (and the
//! control thread doing it) for hours, since every active keyslot is tried.
//! Refused at load instead, naming the keyslot. The bounds sit far above what
//! `cryptsetup` picks when it measures a machine (2 s: about 1–4 M PBKDF2 rounds,
//! argon2 at most 1 GiB and a few passes) and what its options allow.

use std::ffi::{c_char, c_int};

use super::header::{cstr, CryptDevice, LuksError};

/// `crypt_keyslot_status`: a slot holding a key (the last one, or one of several).
pub(super) const SLOT_ACTIVE: c_int = 2;
pub(super) const SLOT_ACTIVE_LAST: c_int = 3;

#[repr(C)]
struct PbkdfType {
    type_: *const c_char,
    hash: *const c_char,
    time_ms: u32,
    iterations: u32,
    max_memory_kb: u32,
    parallel_threads: u32,
    flags: u32,
}

#[link(name = "cryptsetup")]
extern "C" {
    pub(super) fn crypt_get_type(cd: *mut CryptDevice) -> *const c_char;
    pub(super) fn crypt_keyslot_max(type_: *const c_char) -> c_int;
    pub(super) fn crypt_keyslot_status(cd: *mut CryptDevice, keyslot: c_int) -> c_int;
    fn crypt_keyslot_get_pbkdf(
        cd: *mut CryptDevice,
        keyslot: c_int,
        pbkdf: *mut PbkdfType,
    ) -> c_int;
}

/// PBKDF2 rounds (cryptsetup measures 1–4 M for 2 s).
const MAX_PBKDF2_ROUNDS: u32 = 64 << 20;
/// argon2 memory: cryptsetup's own maximum, 4 GiB.
const MAX_ARGON2_KB: u32 = 4 << 20;
/// argon2 passes × memory, in KiB: 64 passes over 1 GiB.
const MAX_ARGON2_WORK_KB: u64 = 64 << 20;
const MAX_ARGON2_THREADS: u32 = 64;

/// The keyslots of a loaded header that hold a key.
pub(super) fn active_slots(cd: *mut CryptDevice) -> impl Iterator<Item = c_int> {
    // SAFETY: a live, loaded context; the type string lives as long as it.
    let max = unsafe { crypt_keyslot_max(crypt_get_type(cd)) };
    (0..max.max(0)).filter(move |&slot| {
        // SAFETY: a live context and a slot below the type's maximum.
        let status = unsafe { crypt_keyslot_status(cd, slot) };
        status == SLOT_ACTIVE || status == SLOT_ACTIVE_LAST
    })
}

/// Checks every active keyslot of a loaded header.
pub(super) fn check_costs(cd: *mut CryptDevice, device: &str) -> Result<(), LuksError> {
    for slot in active_slots(cd) {
        let mut p = PbkdfType {
            type_: std::ptr::null(),
            hash: std::ptr::null(),
            time_ms: 0,
            iterations: 0,
            max_memory_kb: 0,
            parallel_threads: 0,
            flags: 0,
        };
        // SAFETY: `p` is a valid out struct of the layout libcryptsetup 2.x
        // declares; the strings it sets live as long as the context.
        if unsafe { crypt_keyslot_get_pbkdf(cd, slot, &mut p) } < 0 {
            continue; // a slot kind without a PBKDF: nothing to derive
        }
        // SAFETY: null or a NUL-terminated string owned by the context.
        let kind = unsafe { cstr(p.type_) };
        if let Some(what) = too_costly(&kind, &p) {
            return Err(LuksError::KeyDerivation {
                device: device.to_string(),
                slot,
                what,
            });
        }
    }
    Ok(())
}

fn too_costly(kind: &str, p: &PbkdfType) -> Option<String> {
    if kind == "pbkdf2" {
        return (p.iterations > MAX_PBKDF2_ROUNDS).then(|| {
            format!(
                "pbkdf2 with {} rounds, at most {MAX_PBKDF2_ROUNDS}",
                p.iterations
            )
        });
    }
    let work = u64::from(p.iterations) * u64::from(p.max_memory_kb);
    (p.max_memory_kb > MAX_ARGON2_KB
        || work > MAX_ARGON2_WORK_KB
        || p.parallel_threads > MAX_ARGON2_THREADS)
        .then(|| {
            format!(
                "{kind} with {} passes over {} KiB in {} threads, at most {MAX_ARGON2_KB} KiB, \
                 {MAX_ARGON2_WORK_KB} KiB-passes and {MAX_ARGON2_THREADS} threads",
                p.iterations, p.max_memory_kb, p.parallel_threads
            )
        })
}
