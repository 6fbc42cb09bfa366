//! The protocol's numbers and fixed-size headers, shared by the client and the
//! server. Encoding and decoding here are pure: no I/O, no allocation, so both
//! sides and the tests can check a header without a socket.
//!
//! Public so that tests and tools can speak raw NBD (for instance to send a
//! request the [`Client`](crate::Client) would never send); udrive itself needs
//! only the client and [`serve`](crate::serve).

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle handshake's second magic, and the magic of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of the oldstyle handshake's second word; we only detect it, to refuse it clearly.
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Magic of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk (never negotiated here; recognised to refuse it clearly).
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can leave out the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: leave out the 124 zero bytes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// `NBD_OPT_EXPORT_NAME`.
pub const OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`.
pub const OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`.
pub const OPT_LIST: u32 = 3;
/// `NBD_OPT_STARTTLS`.
pub const OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`.
pub const OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`.
pub const OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`.
pub const OPT_STRUCTURED_REPLY: u32 = 8;

/// `NBD_REP_ACK`.
pub const REP_ACK: u32 = 1;
/// `NBD_REP_SERVER`.
pub const REP_SERVER: u32 = 2;
/// `NBD_REP_INFO`.
pub const REP_INFO: u32 = 3;
/// Error replies have bit 31 set.
pub const REP_ERR: u32 = 1 << 31;
/// `NBD_REP_ERR_UNSUP`.
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
/// `NBD_REP_ERR_POLICY`.
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
/// `NBD_REP_ERR_INVALID`.
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
/// `NBD_REP_ERR_PLATFORM`.
pub const REP_ERR_PLATFORM: u32 = REP_ERR | 4;
/// `NBD_REP_ERR_TLS_REQD`.
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
/// `NBD_REP_ERR_UNKNOWN`.
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
/// `NBD_REP_ERR_SHUTDOWN`.
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
/// `NBD_REP_ERR_BLOCK_SIZE_REQD`.
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR | 8;
/// `NBD_REP_ERR_TOO_BIG`.
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

/// `NBD_INFO_EXPORT`: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred and maximum block sizes.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flag `NBD_FLAG_HAS_FLAGS`.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag `NBD_FLAG_READ_ONLY`.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag `NBD_FLAG_SEND_FLUSH`.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag `NBD_FLAG_SEND_FUA`.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag `NBD_FLAG_SEND_TRIM`.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag `NBD_FLAG_SEND_WRITE_ZEROES`.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag `NBD_FLAG_CAN_MULTI_CONN`.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// `NBD_CMD_READ`.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_WRITE_ZEROES`.
pub const CMD_WRITE_ZEROES: u16 = 6;

/// Command flag `NBD_CMD_FLAG_FUA`.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag `NBD_CMD_FLAG_NO_HOLE`.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag `NBD_CMD_FLAG_FAST_ZERO` (never advertised here).
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// `NBD_EPERM`.
pub const EPERM: u32 = 1;
/// `NBD_EIO`.
pub const EIO: u32 = 5;
/// `NBD_ENOMEM`.
pub const ENOMEM: u32 = 12;
/// `NBD_EINVAL`.
pub const EINVAL: u32 = 22;
/// `NBD_ENOSPC`.
pub const ENOSPC: u32 = 28;
/// `NBD_EOVERFLOW`.
pub const EOVERFLOW: u32 = 75;
/// `NBD_ENOTSUP`.
pub const ENOTSUP: u32 = 95;
/// `NBD_ESHUTDOWN`.
pub const ESHUTDOWN: u32 = 108;

/// The protocol's bound on strings such as export names.
pub const MAX_STRING: usize = 4096;

/// Name of a command, for error messages.
pub fn command_name(kind: u16) -> &'static str {
    match kind {
        CMD_READ => "NBD_CMD_READ",
        CMD_WRITE => "NBD_CMD_WRITE",
        CMD_DISC => "NBD_CMD_DISC",
        CMD_FLUSH => "NBD_CMD_FLUSH",
        CMD_TRIM => "NBD_CMD_TRIM",
        CMD_WRITE_ZEROES => "NBD_CMD_WRITE_ZEROES",
        _ => "unknown NBD command",
    }
}

/// Name of an option reply type, for error messages.
pub fn reply_name(kind: u32) -> &'static str {
    match kind {
        REP_ACK => "NBD_REP_ACK",
        REP_SERVER => "NBD_REP_SERVER",
        REP_INFO => "NBD_REP_INFO",
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP (option not supported)",
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY (refused by server policy)",
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID (invalid option)",
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM (not supported on the server's platform)",
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD (server requires TLS, which this client lacks)",
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN (no such export)",
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN (server shutting down)",
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG (option too large)",
        _ => "unknown option reply",
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    let mut a = [0; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_be_bytes(a)
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut a = [0; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Reads a big-endian u16 at `at`, if the slice is long enough.
pub fn get16(b: &[u8], at: usize) -> Option<u16> {
    (b.len() >= at.checked_add(2)?).then(|| be16(b, at))
}

/// Reads a big-endian u32 at `at`, if the slice is long enough.
pub fn get32(b: &[u8], at: usize) -> Option<u32> {
    (b.len() >= at.checked_add(4)?).then(|| be32(b, at))
}

/// Reads a big-endian u64 at `at`, if the slice is long enough.
pub fn get64(b: &[u8], at: usize) -> Option<u64> {
    (b.len() >= at.checked_add(8)?).then(|| be64(b, at))
}

/// An option header (`IHAVEOPT`, option, length), as the client sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionHeader {
    /// `NBD_OPT_*`.
    pub option: u32,
    /// Length of the data that follows.
    pub length: u32,
}

impl OptionHeader {
    /// Encoded size.
    pub const LEN: usize = 16;

    /// The header on the wire.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// The header, or `None` when the magic is wrong.
    pub fn decode(b: &[u8; Self::LEN]) -> Option<Self> {
        (be64(b, 0) == IHAVEOPT).then(|| Self {
            option: be32(b, 8),
            length: be32(b, 12),
        })
    }
}

/// An option reply header, as the server sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionReply {
    /// The option answered.
    pub option: u32,
    /// `NBD_REP_*`.
    pub kind: u32,
    /// Length of the data that follows.
    pub length: u32,
}

impl OptionReply {
    /// Encoded size.
    pub const LEN: usize = 20;

    /// The header on the wire.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.kind.to_be_bytes());
        b[16..].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// The header, or `None` when the magic is wrong.
    pub fn decode(b: &[u8; Self::LEN]) -> Option<Self> {
        (be64(b, 0) == OPTION_REPLY_MAGIC).then(|| Self {
            option: be32(b, 8),
            kind: be32(b, 12),
            length: be32(b, 16),
        })
    }
}

/// A transmission request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// `NBD_CMD_FLAG_*`.
    pub flags: u16,
    /// `NBD_CMD_*`.
    pub kind: u16,
    /// Echoed in the reply.
    pub cookie: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Byte length.
    pub length: u32,
}

impl Request {
    /// Encoded size.
    pub const LEN: usize = 28;

    /// The header on the wire.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// The header, or `None` when the magic is wrong.
    pub fn decode(b: &[u8; Self::LEN]) -> Option<Self> {
        (be32(b, 0) == REQUEST_MAGIC).then(|| Self {
            flags: be16(b, 4),
            kind: be16(b, 6),
            cookie: be64(b, 8),
            offset: be64(b, 16),
            length: be32(b, 24),
        })
    }
}

/// A simple reply header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimpleReply {
    /// `NBD_E*`, 0 for success.
    pub error: u32,
    /// The request's cookie.
    pub cookie: u64,
}

impl SimpleReply {
    /// Encoded size.
    pub const LEN: usize = 16;

    /// The header on the wire.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&self.error.to_be_bytes());
        b[8..].copy_from_slice(&self.cookie.to_be_bytes());
        b
    }

    /// The header, or `Err(magic)` when the magic is not the simple reply's.
    pub fn decode(b: &[u8; Self::LEN]) -> Result<Self, u32> {
        match be32(b, 0) {
            SIMPLE_REPLY_MAGIC => Ok(Self {
                error: be32(b, 4),
                cookie: be64(b, 8),
            }),
            magic => Err(magic),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_bad_magic() {
        let req = Request {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: u64::MAX - 1,
            length: 0xdead_beef,
        };
        let mut b = req.encode();
        assert_eq!(&b[..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(Request::decode(&b), Some(req));
        b[0] ^= 1;
        assert_eq!(Request::decode(&b), None);

        let rep = SimpleReply {
            error: EINVAL,
            cookie: 7,
        };
        let mut b = rep.encode();
        assert_eq!(SimpleReply::decode(&b), Ok(rep));
        b[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(SimpleReply::decode(&b), Err(STRUCTURED_REPLY_MAGIC));

        let opt = OptionHeader {
            option: OPT_GO,
            length: 0xffff_ffff,
        };
        let mut b = opt.encode();
        assert_eq!(&b[..8], b"IHAVEOPT");
        assert_eq!(OptionHeader::decode(&b), Some(opt));
        b[7] = 0;
        assert_eq!(OptionHeader::decode(&b), None);

        let orep = OptionReply {
            option: OPT_LIST,
            kind: REP_ERR_TOO_BIG,
            length: 3,
        };
        let mut b = orep.encode();
        assert_eq!(OptionReply::decode(&b), Some(orep));
        b[3] = 0;
        assert_eq!(OptionReply::decode(&b), None);
    }

    #[test]
    fn getters_refuse_short_slices_and_overflowing_offsets() {
        let b = [0, 1, 2, 3, 4, 5, 6, 7];
        assert_eq!(get16(&b, 6), Some(0x0607));
        assert_eq!(get16(&b, 7), None);
        assert_eq!(get32(&b, 4), Some(0x0405_0607));
        assert_eq!(get32(&b, 5), None);
        assert_eq!(get64(&b, 0), Some(0x0001_0203_0405_0607));
        assert_eq!(get64(&b, 1), None);
        assert_eq!(get32(&b, usize::MAX), None);
    }
}
