//! Identify data structures (NVMe 1.4 §5.15).

use crate::log::ERROR_LOG_ENTRIES;
use crate::ns::Ns;
use crate::ControllerConfig;

/// PCI vendor id reported in Identify Controller. Placeholder: udrive has no
/// assigned vendor id yet ("NV"); replace before shipping.
pub const VENDOR_ID: u16 = 0x4e56;

/// Warning/critical composite temperature thresholds and the reported temperature (K).
pub(crate) const WCTEMP: u16 = 343;
pub(crate) const CCTEMP: u16 = 373;
pub(crate) const TEMPERATURE: u16 = 300;

pub(crate) const AERL: u8 = 3;

fn put(b: &mut [u8], off: usize, v: &[u8]) {
    if let Some(d) = b.get_mut(off..off + v.len()) {
        d.copy_from_slice(v);
    }
}

/// ASCII, space padded, truncated to `len`.
fn padded(s: &str, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = s
        .bytes()
        .map(|c| {
            if c.is_ascii_graphic() || c == b' ' {
                c
            } else {
                b'_'
            }
        })
        .take(len)
        .collect();
    v.resize(len, b' ');
    v
}

fn fnv(seed: u64, data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A stable 16-byte id for namespace `nsid` of controller serial `serial`.
pub(crate) fn ns_id128(serial: &str, nsid: u32, salt: u64) -> [u8; 16] {
    let mut d = serial.as_bytes().to_vec();
    d.extend_from_slice(&nsid.to_le_bytes());
    let a = fnv(salt, &d);
    let b = fnv(salt ^ 0x9e37_79b9_7f4a_7c15, &d);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_be_bytes());
    out[8..].copy_from_slice(&b.to_be_bytes());
    out
}

pub(crate) fn nguid(serial: &str, nsid: u32) -> [u8; 16] {
    ns_id128(serial, nsid, 1)
}

pub(crate) fn uuid(serial: &str, nsid: u32) -> [u8; 16] {
    let mut u = ns_id128(serial, nsid, 2);
    u[6] = (u[6] & 0x0f) | 0x80; // version 8 (custom)
    u[8] = (u[8] & 0x3f) | 0x80; // RFC 4122 variant
    u
}

/// LBA data sizes every namespace lists (Identify Namespace LBAF0, LBAF1), without
/// metadata; Format NVM's LBAF field indexes this.
pub(crate) const LBA_FORMATS: [u32; 2] = [512, 4096];

/// The LBA formats a namespace whose current block size is `current` lists, and
/// the index of `current` among them (FLBAS): [`LBA_FORMATS`], or only its own size
/// for a backend with another one (check_block_size allows any power of two; none
/// of udrive's configurations makes one).
pub(crate) fn lba_formats(current: &u32) -> (&[u32], usize) {
    match LBA_FORMATS.iter().position(|f| f == current) {
        Some(k) => (&LBA_FORMATS, k),
        None => (std::slice::from_ref(current), 0),
    }
}

pub(crate) fn controller(cfg: &ControllerConfig, mdts: u8, ns: &[Option<Ns>]) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    let any = |f: fn(&bdev::BlockInfo) -> bool| ns.iter().flatten().any(|n| f(&n.info));
    put(&mut b, 0, &VENDOR_ID.to_le_bytes());
    put(&mut b, 2, &VENDOR_ID.to_le_bytes());
    put(&mut b, 4, &padded(&cfg.serial, 20));
    put(&mut b, 24, &padded(&cfg.model, 40));
    put(&mut b, 64, &padded(&cfg.firmware, 8));
    b[72] = 6; // RAB
    b[77] = mdts;
    put(&mut b, 78, &cfg.cntlid.to_le_bytes());
    put(&mut b, 80, &crate::regs::VERSION.to_le_bytes());
    // OAES: Namespace Attribute Notices.
    put(&mut b, 92, &crate::ns::AEC_NS_ATTR.to_le_bytes());
    b[111] = 1; // CNTRLTYPE: I/O controller
                // OACS: Format NVM, Doorbell Buffer Config.
    put(&mut b, 256, &(1u16 << 1 | 1u16 << 8).to_le_bytes());
    b[258] = 3; // ACL
    b[259] = AERL;
    b[260] = 0x03; // FRMW: one slot, slot 1 read-only
    b[261] = 0x04; // LPA: extended Get Log Page data
    b[262] = (ERROR_LOG_ENTRIES - 1) as u8; // ELPE
    b[263] = 0; // NPSS: one power state
    put(&mut b, 266, &WCTEMP.to_le_bytes());
    put(&mut b, 268, &CCTEMP.to_le_bytes());
    put(&mut b, 320, &1u16.to_le_bytes()); // KAS: 100 ms granularity
    b[512] = 0x66; // SQES
    b[513] = 0x44; // CQES
                   // NN: the highest NSID there can be, so namespaces can come and go.
    put(&mut b, 516, &cfg.max_namespaces.to_le_bytes());
    let mut oncs = 0u16;
    if any(|i| i.discard) {
        oncs |= 1 << 2;
    }
    if any(|i| i.write_zeroes) {
        oncs |= 1 << 3;
    }
    put(&mut b, 520, &oncs.to_le_bytes());
    // FNA: formats and secure erases apply to the namespace given (bits 0 and 1
    // clear, so NSID FFFFFFFFh formats every active one), no cryptographic erase.
    b[524] = 0;
    // VWC: present iff some backend caches writes; Flush to the broadcast NSID is
    // not supported (bits 2:1 = 10b).
    b[525] = if any(|i| i.write_cache) { 0x05 } else { 0 };
    put(&mut b, 536, &1u32.to_le_bytes()); // SGLS: supported, no alignment needs
    let nqn = format!("nqn.2024-01.io.udrive:ctrl:{}", cfg.serial);
    put(&mut b, 768, &nqn.as_bytes()[..nqn.len().min(255)]);
    // Power state 0: 10 W, operational.
    put(&mut b, 2048, &1000u16.to_le_bytes());
    b
}

pub(crate) fn namespace(cfg: &ControllerConfig, nsid: u32, ns: &Ns) -> Vec<u8> {
    let i = &ns.info;
    let mut b = vec![0u8; 4096];
    // NSZE, NCAP, NUSE: in blocks of the current format.
    put(&mut b, 0, &i.num_blocks.to_le_bytes());
    put(&mut b, 8, &i.num_blocks.to_le_bytes());
    put(&mut b, 16, &i.num_blocks.to_le_bytes());
    b[24] = 0; // NSFEAT
               // LBA formats (LBADS in bits 23:16, no metadata) and FLBAS, the current one.
    let (formats, current) = lba_formats(&i.block_size);
    b[25] = (formats.len() - 1) as u8; // NLBAF, 0's based
    b[26] = current as u8; // FLBAS
    for (k, f) in formats.iter().enumerate() {
        put(
            &mut b,
            128 + 4 * k,
            &(f.trailing_zeros() << 16).to_le_bytes(),
        );
    }
    // DLFEAT: deallocated blocks read as zeroes; Write Zeroes may deallocate.
    b[33] = if i.discard_zeroes { 0x09 } else { 0 };
    b[99] = u8::from(i.read_only); // NSATTR: write protected
    put(&mut b, 104, &nguid(&cfg.serial, nsid));
    b
}

/// Active namespace ids greater than `after`.
pub(crate) fn ns_list(after: u32, ns: &[Option<Ns>]) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    let ids = ns
        .iter()
        .enumerate()
        .filter(|(_, d)| d.is_some())
        .map(|(i, _)| i as u32 + 1)
        .filter(|n| *n > after)
        .take(1024);
    for (k, id) in ids.enumerate() {
        put(&mut b, k * 4, &id.to_le_bytes());
    }
    b
}

pub(crate) fn ns_descriptors(cfg: &ControllerConfig, nsid: u32) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    put(&mut b, 0, &[2, 16, 0, 0]);
    put(&mut b, 4, &nguid(&cfg.serial, nsid));
    put(&mut b, 20, &[3, 16, 0, 0]);
    put(&mut b, 24, &uuid(&cfg.serial, nsid));
    b
}
