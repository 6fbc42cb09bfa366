//! Fields of command dwords. NVMe packs several fields into one 32-bit dword, and
//! taking the low bits is what the specification asks for: these are the only
//! narrowing conversions of guest numbers in the modules that parse them (which deny
//! silent casts).

#![allow(clippy::cast_possible_truncation)]

/// Bits 7:0.
pub(crate) fn lo8(v: u32) -> u8 {
    (v & 0xff) as u8
}

/// Bits 15:0.
pub(crate) fn lo16(v: u32) -> u16 {
    (v & 0xffff) as u16
}
