//! NVMe commands as tests write them, and checks on their completions: one set of
//! builders for the fake host ([`crate::nvme_host`]) and for raw commands sent
//! through udrive's initiator.
//!
//! Commands are the initiator's 64-byte [`Sqe`] (the spec's layout, nothing
//! checked): a test sets any field, legal or not. Data pointers are PRP entries or
//! an SGL descriptor; the `put`/`bytes` helpers lay PRP lists and SGL segments out
//! in guest memory.

use initiator::cmd::PSDT_SGL;
pub use initiator::{Completion, Sqe};

/// A command with `opcode` for namespace `nsid`, every other field zero.
pub fn sqe(opcode: u8, nsid: u32) -> Sqe {
    Sqe {
        nsid,
        ..Sqe::new(opcode)
    }
}

/// Points `s`'s data at PRP1/PRP2.
pub fn set_prp(s: &mut Sqe, prp1: u64, prp2: u64) {
    s.dptr = [prp1, prp2];
}

/// Points `s`'s data at the SGL descriptor `desc` (and sets PSDT to SGL).
pub fn set_sgl(s: &mut Sqe, desc: [u8; 16]) {
    s.flags |= PSDT_SGL;
    s.dptr = [
        u64::from_le_bytes(desc[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(desc[8..].try_into().expect("8 bytes")),
    ];
}

/// Read/Write-shaped command (`op` 1 write, 2 read, 8 write zeroes) of `nlb`
/// blocks (0 wraps to NLB 0xffff, 65536 blocks) with PRP1/PRP2.
pub fn rw(op: u8, nsid: u32, slba: u64, nlb: u32, prp1: u64, prp2: u64) -> Sqe {
    let mut s = sqe(op, nsid);
    set_prp(&mut s, prp1, prp2);
    s.cdw10 = slba as u32;
    s.cdw11 = (slba >> 32) as u32;
    s.cdw12 = nlb.wrapping_sub(1) & 0xffff;
    s
}

/// As [`rw`], with the SGL descriptor `desc` as its data pointer.
pub fn rw_sgl(op: u8, nsid: u32, slba: u64, nlb: u32, desc: [u8; 16]) -> Sqe {
    let mut s = rw(op, nsid, slba, nlb, 0, 0);
    set_sgl(&mut s, desc);
    s
}

/// An SGL descriptor of type `kind` (0 data block, 1 bit bucket, 2 segment, 3 last
/// segment, anything else for hostile tests) at `addr`, `len` bytes.
pub fn sgl_desc(addr: u64, len: u32, kind: u8) -> [u8; 16] {
    initiator::dptr::sgl_desc(addr, len, kind << 4)
}

/// A data block descriptor.
pub fn sgl_data(addr: u64, len: u32) -> [u8; 16] {
    sgl_desc(addr, len, 0)
}

/// A segment descriptor for `count` descriptors at `addr`.
pub fn sgl_segment(addr: u64, count: u32) -> [u8; 16] {
    sgl_desc(addr, count * 16, 2)
}

/// A last segment descriptor for `count` descriptors at `addr`.
pub fn sgl_last(addr: u64, count: u32) -> [u8; 16] {
    sgl_desc(addr, count * 16, 3)
}

/// PRP list entries (or any u64s) as the bytes to store in guest memory.
pub fn u64_bytes(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// SGL descriptors as the bytes of a segment in guest memory.
pub fn desc_bytes(d: &[[u8; 16]]) -> Vec<u8> {
    d.iter().flatten().copied().collect()
}

/// Writes u64 little-endian entries (a PRP list) at `off` of `buf`.
pub fn put_u64s(buf: &initiator::DmaBuf, off: usize, v: &[u64]) {
    buf.write(off, &u64_bytes(v)).expect("list fits");
}

/// Writes SGL descriptors at `off` of `buf`.
pub fn put_descs(buf: &initiator::DmaBuf, off: usize, d: &[[u8; 16]]) {
    buf.write(off, &desc_bytes(d)).expect("descriptors fit");
}

/// What tests ask of a completion.
pub trait Outcome {
    /// Successful completion (SCT 0, SC 0).
    fn ok(&self) -> bool;
    /// (SCT, SC).
    fn code(&self) -> (u8, u8);
}

impl Outcome for Completion {
    fn ok(&self) -> bool {
        self.status.is_ok()
    }
    fn code(&self) -> (u8, u8) {
        (self.status.sct, self.status.sc)
    }
}

#[track_caller]
pub fn assert_ok(c: &Completion, what: &str) {
    assert!(c.ok(), "{what}: status {}", c.status);
}

/// Checks SCT/SC of a completion.
#[track_caller]
pub fn assert_status(c: &Completion, sct: u8, sc: u8, what: &str) {
    assert_eq!(
        c.code(),
        (sct, sc),
        "{what}: got {}, want sct={sct:#x} sc={sc:#04x}",
        c.status
    );
}
