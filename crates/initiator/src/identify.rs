//! Identify data structures, parsed from the 4 KiB pages the controller returns.

/// Identify Controller, the fields the initiator uses.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ControllerInfo {
    pub vid: u16,
    pub ssvid: u16,
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// Max data transfer as a power of two of the minimum page size (0: no limit).
    pub mdts: u8,
    pub cntlid: u16,
    pub version: u32,
    pub oacs: u16,
    pub sqes: u8,
    pub cqes: u8,
    pub nn: u32,
    pub oncs: u16,
    pub vwc: u8,
    pub sgls: u32,
    pub subnqn: String,
}

impl ControllerInfo {
    pub fn parse(d: &[u8; 4096]) -> ControllerInfo {
        ControllerInfo {
            vid: u16le(d, 0),
            ssvid: u16le(d, 2),
            serial: text(&d[4..24]),
            model: text(&d[24..64]),
            firmware: text(&d[64..72]),
            mdts: d[77],
            cntlid: u16le(d, 78),
            version: u32le(d, 80),
            oacs: u16le(d, 256),
            sqes: d[512],
            cqes: d[513],
            nn: u32le(d, 516),
            oncs: u16le(d, 520),
            vwc: d[525],
            sgls: u32le(d, 536),
            subnqn: text(&d[768..1024]),
        }
    }

    /// Largest transfer in bytes, given the controller's minimum page size.
    pub fn max_xfer(&self, mpsmin: u64) -> Option<u64> {
        (self.mdts != 0 && self.mdts < 32).then(|| mpsmin << self.mdts)
    }

    pub fn supports_sgl(&self) -> bool {
        self.sgls & 3 != 0
    }
    pub fn volatile_write_cache(&self) -> bool {
        self.vwc & 1 != 0
    }
}

/// Identify Namespace, the fields the initiator uses.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Namespace {
    pub nsid: u32,
    /// Size in logical blocks.
    pub nsze: u64,
    pub ncap: u64,
    pub nuse: u64,
    pub flbas: u8,
    pub lba_size: u32,
    pub metadata_size: u16,
}

impl Namespace {
    /// `None` for an inactive namespace (all zero) or a nonsensical LBA format.
    pub fn parse(nsid: u32, d: &[u8; 4096]) -> Option<Namespace> {
        let nsze = u64le(d, 0);
        if nsze == 0 {
            return None;
        }
        let flbas = d[26];
        let fmt = 128 + 4 * (flbas & 0xf) as usize;
        let lbads = d[fmt + 2];
        if !(9..=16).contains(&lbads) {
            return None;
        }
        Some(Namespace {
            nsid,
            nsze,
            ncap: u64le(d, 8),
            nuse: u64le(d, 16),
            flbas,
            lba_size: 1 << lbads,
            metadata_size: u16le(d, fmt),
        })
    }

    pub fn size_bytes(&self) -> u64 {
        self.nsze.saturating_mul(self.lba_size as u64)
    }
}

/// Active namespace IDs from a CNS 02h page (zero-terminated list).
pub fn parse_ns_list(d: &[u8; 4096]) -> Vec<u32> {
    d.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .take_while(|n| *n != 0)
        .collect()
}

fn u16le(d: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([d[o], d[o + 1]])
}
fn u32le(d: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([d[o], d[o + 1], d[o + 2], d[o + 3]])
}
fn u64le(d: &[u8], o: usize) -> u64 {
    u64::from(u32le(d, o)) | u64::from(u32le(d, o + 4)) << 32
}
fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .trim_end_matches(['\0', ' '])
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_controller_and_namespace() {
        let mut d = [0u8; 4096];
        d[4..9].copy_from_slice(b"SN123");
        d[9..24].fill(b' ');
        d[24..30].copy_from_slice(b"udrive");
        d[77] = 5;
        d[516..520].copy_from_slice(&4u32.to_le_bytes());
        d[536] = 1;
        let c = ControllerInfo::parse(&d);
        assert_eq!(c.serial, "SN123");
        assert_eq!(c.model, "udrive");
        assert_eq!(c.nn, 4);
        assert_eq!(c.max_xfer(4096), Some(128 << 10));
        assert!(c.supports_sgl());

        let mut n = [0u8; 4096];
        assert!(Namespace::parse(1, &n).is_none());
        n[0..8].copy_from_slice(&1000u64.to_le_bytes());
        n[26] = 1;
        n[128 + 4 + 2] = 12;
        let ns = Namespace::parse(1, &n).unwrap();
        assert_eq!((ns.lba_size, ns.size_bytes()), (4096, 4096 * 1000));
        n[128 + 4 + 2] = 40;
        assert!(
            Namespace::parse(1, &n).is_none(),
            "absurd LBA size is rejected"
        );

        let mut l = [0u8; 4096];
        l[0] = 1;
        l[4] = 3;
        assert_eq!(parse_ns_list(&l), vec![1, 3]);
    }
}
