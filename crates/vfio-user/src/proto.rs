//! The vfio-user wire format (QEMU `docs/interop/vfio-user.rst`), shared by the
//! server and by udrive's initiator. All structures are little-endian `repr(C)` plain
//! data read with `zerocopy`, so parsing untrusted bytes never needs `unsafe`.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Protocol version we speak. QEMU 10.1's client rejects any other major and any
/// minor above 0, so the server answers 0.0 whatever the client offers.
pub const VERSION_MAJOR: u16 = 0;
pub const VERSION_MINOR: u16 = 0;

/// Largest message we accept: header + region data of `MAX_DATA_XFER` + slack.
pub const MAX_DATA_XFER: u32 = 1 << 20;
pub const MAX_MSG_SIZE: u32 = MAX_DATA_XFER + 4096;
/// Most file descriptors one message may carry.
pub const MAX_MSG_FDS: u32 = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Command {
    Version = 1,
    DmaMap = 2,
    DmaUnmap = 3,
    DeviceGetInfo = 4,
    DeviceGetRegionInfo = 5,
    DeviceGetRegionIoFds = 6,
    DeviceGetIrqInfo = 7,
    DeviceSetIrqs = 8,
    RegionRead = 9,
    RegionWrite = 10,
    DmaRead = 11,
    DmaWrite = 12,
    DeviceReset = 13,
    DirtyPages = 14,
}

impl Command {
    pub fn from_u16(v: u16) -> Option<Command> {
        use Command::*;
        Some(match v {
            1 => Version,
            2 => DmaMap,
            3 => DmaUnmap,
            4 => DeviceGetInfo,
            5 => DeviceGetRegionInfo,
            6 => DeviceGetRegionIoFds,
            7 => DeviceGetIrqInfo,
            8 => DeviceSetIrqs,
            9 => RegionRead,
            10 => RegionWrite,
            11 => DmaRead,
            12 => DmaWrite,
            13 => DeviceReset,
            14 => DirtyPages,
            _ => return None,
        })
    }
}

/// Header flags.
pub const FLAG_TYPE_MASK: u32 = 0xf;
pub const FLAG_TYPE_COMMAND: u32 = 0;
pub const FLAG_TYPE_REPLY: u32 = 1;
pub const FLAG_NO_REPLY: u32 = 1 << 4;
pub const FLAG_ERROR: u32 = 1 << 5;

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
#[repr(C)]
pub struct Header {
    pub msg_id: u16,
    pub cmd: u16,
    /// Whole message size, header included.
    pub msg_size: u32,
    pub flags: u32,
    pub error: u32,
}
pub const HEADER_SIZE: usize = std::mem::size_of::<Header>();

impl Header {
    pub fn command(msg_id: u16, cmd: Command, payload: usize) -> Header {
        Header {
            msg_id,
            cmd: cmd as u16,
            msg_size: u32::try_from(HEADER_SIZE + payload).unwrap_or(u32::MAX),
            flags: FLAG_TYPE_COMMAND,
            error: 0,
        }
    }
    pub fn reply_to(req: &Header, payload: usize) -> Header {
        Header {
            msg_id: req.msg_id,
            cmd: req.cmd,
            msg_size: u32::try_from(HEADER_SIZE + payload).unwrap_or(u32::MAX),
            flags: FLAG_TYPE_REPLY,
            error: 0,
        }
    }
    pub fn error_reply(req: &Header, errno: i32) -> Header {
        Header {
            msg_id: req.msg_id,
            cmd: req.cmd,
            msg_size: u32::try_from(HEADER_SIZE).unwrap_or(u32::MAX),
            flags: FLAG_TYPE_REPLY | FLAG_ERROR,
            error: errno.unsigned_abs(),
        }
    }
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_TYPE_MASK == FLAG_TYPE_REPLY
    }
    pub fn no_reply(&self) -> bool {
        self.flags & FLAG_NO_REPLY != 0
    }
    pub fn is_error(&self) -> bool {
        self.flags & FLAG_ERROR != 0
    }
}

/// VERSION payload; a NUL-terminated JSON capabilities string follows.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Version {
    pub major: u16,
    pub minor: u16,
}

/// DMA_MAP flags.
pub const DMA_READ: u32 = 1;
pub const DMA_WRITE: u32 = 2;

#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct DmaMap {
    pub argsz: u32,
    pub flags: u32,
    /// Offset into the passed fd.
    pub offset: u64,
    pub addr: u64,
    pub size: u64,
}

/// DMA_UNMAP flags (values of Linux's vfio.h, which QEMU sends).
pub const UNMAP_GET_DIRTY_BITMAP: u32 = 1;
pub const UNMAP_ALL: u32 = 2;

#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct DmaUnmap {
    pub argsz: u32,
    pub flags: u32,
    pub addr: u64,
    pub size: u64,
}

/// DEVICE_GET_INFO flags.
pub const DEVICE_FLAGS_RESET: u32 = 1;
pub const DEVICE_FLAGS_PCI: u32 = 2;

#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct DeviceInfo {
    pub argsz: u32,
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
}

/// Region flags.
pub const REGION_READ: u32 = 1;
pub const REGION_WRITE: u32 = 2;
pub const REGION_MMAP: u32 = 4;
pub const REGION_CAPS: u32 = 8;
/// Capability id of the sparse-mmap list.
pub const REGION_CAP_SPARSE_MMAP: u16 = 1;

/// PCI region indices.
pub const PCI_BAR0_REGION: u32 = 0;
pub const PCI_ROM_REGION: u32 = 6;
pub const PCI_CONFIG_REGION: u32 = 7;
pub const PCI_VGA_REGION: u32 = 8;
pub const PCI_NUM_REGIONS: u32 = 9;

#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct RegionInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    /// Offset of the first capability from the start of this struct (0: none).
    pub cap_offset: u32,
    pub size: u64,
    /// Offset into the passed fd at which the region starts (for mmap).
    pub offset: u64,
}

#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct CapHeader {
    pub id: u16,
    pub version: u16,
    pub next: u32,
}

#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct SparseMmapHeader {
    pub nr_areas: u32,
    pub reserved: u32,
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
#[repr(C)]
pub struct SparseArea {
    pub offset: u64,
    pub size: u64,
}

/// IRQ indices of a PCI device.
pub const PCI_INTX_IRQ: u32 = 0;
pub const PCI_MSI_IRQ: u32 = 1;
pub const PCI_MSIX_IRQ: u32 = 2;
pub const PCI_ERR_IRQ: u32 = 3;
pub const PCI_REQ_IRQ: u32 = 4;
pub const PCI_NUM_IRQS: u32 = 5;

/// IRQ info flags.
pub const IRQ_INFO_EVENTFD: u32 = 1;
pub const IRQ_INFO_MASKABLE: u32 = 2;
pub const IRQ_INFO_AUTOMASKED: u32 = 4;
pub const IRQ_INFO_NORESIZE: u32 = 8;

#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct IrqInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub count: u32,
}

/// SET_IRQS flags: one data type and one action.
pub const IRQ_SET_DATA_NONE: u32 = 1;
pub const IRQ_SET_DATA_BOOL: u32 = 2;
pub const IRQ_SET_DATA_EVENTFD: u32 = 4;
pub const IRQ_SET_DATA_MASK: u32 = 7;
pub const IRQ_SET_ACTION_MASK: u32 = 8;
pub const IRQ_SET_ACTION_UNMASK: u32 = 16;
pub const IRQ_SET_ACTION_TRIGGER: u32 = 32;
pub const IRQ_SET_ACTION_MASK_ALL: u32 = 56;

#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct SetIrqs {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub start: u32,
    pub count: u32,
}

/// REGION_READ/REGION_WRITE payload; data follows (write request, read reply).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct RegionAccess {
    pub offset: u64,
    pub region: u32,
    pub count: u32,
}

/// DMA_READ/DMA_WRITE payload (server → client) as the protocol document has it;
/// data follows. QEMU's client lays the data out differently: see [`DmaWire`].
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct DmaAccess {
    pub addr: u64,
    pub count: u64,
}

/// Where DMA_READ/DMA_WRITE data sits in a message. The protocol document (and
/// libvfio-user) puts an 8-byte `count` after the address and the data at payload
/// offset 16. QEMU's client (hw/vfio-user, 10.1 and later) declares `count` as 4
/// bytes and its data at offset 12, and sizes its messages as if the header were
/// 16 bytes (4 bytes of padding after the data); it answers DMA_WRITE with a bare
/// header. A server tells the two apart with a zero-length DMA_WRITE
/// ([`DmaWire::from_probe_reply`]): QEMU answers it with no payload, a client of
/// the document with the address and count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmaWire {
    /// `addr: u64, count: u64, data` (payload offsets 0, 8, 16).
    Spec,
    /// `addr: u64, count: u32, data` (offsets 0, 8, 12) plus 4 bytes of padding.
    Qemu,
}

/// The two payload words both layouts accept in a request without data: an
/// 8-byte count whose upper half is zero reads as QEMU's 4-byte count.
pub const DMA_REQ_LEN: usize = 16;

impl DmaWire {
    /// Payload offset of the data.
    pub fn data_offset(self) -> usize {
        match self {
            DmaWire::Spec => 16,
            DmaWire::Qemu => 12,
        }
    }

    /// Payload bytes around `count` bytes of data.
    pub fn framing(self) -> usize {
        16
    }

    /// The DMA_READ request payload for `count` bytes at `addr`.
    pub fn read_request(self, addr: u64, count: u32) -> [u8; DMA_REQ_LEN] {
        let mut p = [0u8; DMA_REQ_LEN];
        p[..8].copy_from_slice(&addr.to_le_bytes());
        p[8..16].copy_from_slice(&u64::from(count).to_le_bytes());
        p
    }

    /// The DMA_WRITE request payload before its `count` data bytes; `tail` bytes of
    /// padding go after the data.
    pub fn write_request_head(self, addr: u64, count: u32) -> (Vec<u8>, usize) {
        let mut p = addr.to_le_bytes().to_vec();
        match self {
            DmaWire::Spec => {
                p.extend_from_slice(&u64::from(count).to_le_bytes());
                (p, 0)
            }
            DmaWire::Qemu => {
                p.extend_from_slice(&count.to_le_bytes());
                (p, 4)
            }
        }
    }

    /// The data of a DMA_READ reply to a request of `count` bytes at `addr`, if the
    /// reply is exactly that.
    pub fn read_reply_data(self, payload: &[u8], addr: u64, count: u32) -> Option<&[u8]> {
        let n = count as usize;
        if payload.len() != n + self.framing() {
            return None;
        }
        let a = u64::from_le_bytes(payload.get(..8)?.try_into().ok()?);
        let c = u32::from_le_bytes(payload.get(8..12)?.try_into().ok()?);
        if a != addr || c != count {
            return None;
        }
        if self == DmaWire::Spec && payload.get(12..16)? != [0; 4] {
            return None;
        }
        let off = self.data_offset();
        payload.get(off..off + n)
    }

    /// Whether `payload` is a DMA_WRITE reply to a write of `count` bytes at `addr`.
    pub fn write_reply_ok(self, payload: &[u8], addr: u64, count: u32) -> bool {
        match self {
            DmaWire::Qemu => payload.is_empty(),
            // The document's reply echoes the address and count (an 8- or, per its
            // table, 4-byte count); a client that sends nothing is accepted too.
            DmaWire::Spec => {
                if payload.is_empty() {
                    return true;
                }
                if payload.len() != 12 && payload.len() != 16 {
                    return false;
                }
                let a = u64::from_le_bytes(payload[..8].try_into().unwrap_or([0; 8]));
                let c = u32::from_le_bytes(payload[8..12].try_into().unwrap_or([0; 4]));
                a == addr && c == count && payload.get(12..).is_none_or(|r| r == [0; 4])
            }
        }
    }

    /// The layout a reply to the zero-length DMA_WRITE probe shows: QEMU's is a
    /// bare header; anything else (an echo, or an error) is taken for the
    /// document's.
    pub fn from_probe_reply(error: bool, payload: &[u8]) -> DmaWire {
        if !error && payload.is_empty() {
            DmaWire::Qemu
        } else {
            DmaWire::Spec
        }
    }

    /// Client side: parses a DMA request payload into (addr, count, data) where
    /// data is the DMA_WRITE data (empty for DMA_READ); `None` if malformed.
    pub fn parse_request(self, payload: &[u8], write: bool) -> Option<(u64, u32, &[u8])> {
        if payload.len() < DMA_REQ_LEN {
            return None;
        }
        let addr = u64::from_le_bytes(payload[..8].try_into().ok()?);
        let count = match self {
            DmaWire::Spec => {
                u32::try_from(u64::from_le_bytes(payload[8..16].try_into().ok()?)).ok()?
            }
            DmaWire::Qemu => u32::from_le_bytes(payload[8..12].try_into().ok()?),
        };
        if !write {
            return Some((addr, count, &[]));
        }
        let off = self.data_offset();
        let data = payload.get(off..off.checked_add(count as usize)?)?;
        Some((addr, count, data))
    }

    /// Client side: the DMA_READ reply payload for `data` read at `addr`.
    pub fn read_reply(self, addr: u64, data: &[u8]) -> Vec<u8> {
        let count = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let (mut p, tail) = self.write_request_head(addr, count);
        p.extend_from_slice(data);
        p.resize(p.len() + tail, 0);
        p
    }

    /// Client side: the DMA_WRITE reply payload.
    pub fn write_reply(self, addr: u64, count: u32) -> Vec<u8> {
        match self {
            DmaWire::Qemu => Vec::new(),
            DmaWire::Spec => DmaAccess {
                addr,
                count: u64::from(count),
            }
            .as_bytes()
            .to_vec(),
        }
    }
}

/// The JSON capabilities object exchanged in VERSION.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Capabilities {
    #[serde(default = "default_max_msg_fds")]
    pub max_msg_fds: u32,
    #[serde(default = "default_max_data_xfer")]
    pub max_data_xfer_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pgsizes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_dma_maps: Option<u32>,
}

fn default_max_msg_fds() -> u32 {
    1
}
fn default_max_data_xfer() -> u32 {
    MAX_DATA_XFER
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CapabilitiesDoc {
    pub capabilities: Capabilities,
}

/// Reads a `T` from the front of `buf`; `None` if too short.
pub fn parse<T: FromBytes + KnownLayout + Immutable>(buf: &[u8]) -> Option<T> {
    T::read_from_prefix(buf).ok().map(|(v, _)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_spec() {
        assert_eq!(HEADER_SIZE, 16);
        assert_eq!(std::mem::size_of::<DmaMap>(), 32);
        assert_eq!(std::mem::size_of::<DmaUnmap>(), 24);
        assert_eq!(std::mem::size_of::<DeviceInfo>(), 16);
        assert_eq!(std::mem::size_of::<RegionInfo>(), 32);
        assert_eq!(std::mem::size_of::<IrqInfo>(), 16);
        assert_eq!(std::mem::size_of::<SetIrqs>(), 20);
        assert_eq!(std::mem::size_of::<RegionAccess>(), 16);
        assert_eq!(std::mem::size_of::<DmaAccess>(), 16);
    }

    #[test]
    fn dma_wires_round_trip_and_differ_where_they_must() {
        for w in [DmaWire::Spec, DmaWire::Qemu] {
            let data = [1u8, 2, 3, 4, 5];
            // A read request parses the same for both (upper count half is zero).
            let req = w.read_request(0x1000, 5);
            assert_eq!(w.parse_request(&req, false), Some((0x1000, 5, &[][..])));
            let reply = w.read_reply(0x1000, &data);
            assert_eq!(reply.len(), 16 + 5);
            assert_eq!(w.read_reply_data(&reply, 0x1000, 5), Some(&data[..]));
            assert_eq!(w.read_reply_data(&reply, 0x1008, 5), None, "wrong address");
            assert_eq!(w.read_reply_data(&reply[..20], 0x1000, 5), None, "short");
            let (mut wr, tail) = w.write_request_head(0x2000, 5);
            wr.extend_from_slice(&data);
            wr.resize(wr.len() + tail, 0);
            assert_eq!(wr.len(), 16 + 5, "both send 16 bytes around the data");
            assert_eq!(w.parse_request(&wr, true), Some((0x2000, 5, &data[..])));
            assert!(w.write_reply_ok(&w.write_reply(0x2000, 5), 0x2000, 5));
        }
        // QEMU's data sits 4 bytes earlier: read with the other layout it is shifted.
        let q = DmaWire::Qemu.read_reply(0, &[9, 9, 9, 9, 9, 9, 9, 9]);
        assert_eq!(DmaWire::Spec.read_reply_data(&q, 0, 8), None);
        assert_eq!(DmaWire::from_probe_reply(false, &[]), DmaWire::Qemu);
        assert_eq!(
            DmaWire::from_probe_reply(false, &DmaWire::Spec.write_reply(0, 0)),
            DmaWire::Spec
        );
        assert_eq!(DmaWire::from_probe_reply(true, &[]), DmaWire::Spec);
    }

    #[test]
    fn short_input_is_none() {
        assert!(parse::<Header>(&[0u8; 15]).is_none());
        assert!(parse::<Header>(&[0u8; 16]).is_some());
    }
}
