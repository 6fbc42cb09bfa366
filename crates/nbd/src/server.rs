//! One server connection: handshake, then requests until the client leaves.
//!
//! The client is untrusted network input. Every length it sends is checked
//! before anything is allocated or read: option data is bounded by
//! [`MAX_OPTION_DATA`], request payloads by [`MAX_PAYLOAD`], and the one payload
//! buffer of a connection grows to the largest request seen, never per request.
//! Deciding what a request means ([`parse`]) is apart from doing it, so the
//! checks are table-tested without a socket.

use std::io::{self, ErrorKind, Read, Write};

use crate::wire::{self, OptionHeader, OptionReply, Request, SimpleReply};
use crate::MAX_PAYLOAD;

/// One export as the server sees it; the caller implements it over its disk.
///
/// Errors are sent to the client as NBD error values: the `io::Error`'s errno
/// when the protocol has it (EPERM, EIO, ENOMEM, EINVAL, ENOSPC, EOVERFLOW,
/// ESHUTDOWN; EDQUOT and EFBIG count as ENOSPC), else EIO.
pub trait Export {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Whether writes, zeroes and trims are refused (EPERM, without calling the export).
    fn read_only(&self) -> bool;
    /// Fills `buf` from `offset`; the range is within `size()`.
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes `data` at `offset`, durably before returning when `fua`.
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> io::Result<()>;
    /// Zeroes `len` bytes; `may_trim` allows punching a hole instead of writing.
    fn write_zeroes(&mut self, offset: u64, len: u64, may_trim: bool) -> io::Result<()>;
    /// Discards `len` bytes; their contents are unspecified afterwards.
    fn trim(&mut self, offset: u64, len: u64) -> io::Result<()>;
    /// Makes completed writes durable.
    fn flush(&mut self) -> io::Result<()>;
    /// The smallest block a request should be aligned to, a power of two
    /// (a disk's logical block): advertised in NBD_INFO_BLOCK_SIZE, so
    /// clients read-modify-write around it themselves.
    fn min_block(&self) -> u32 {
        MIN_BLOCK
    }
}

/// How `serve` finds an export by name.
type Open<'a> = dyn FnMut(&str) -> Result<Box<dyn Export>, String> + 'a;

/// Longest option data read. The longest option served is NBD_OPT_GO/INFO: a
/// name of at most 4096 bytes plus a few info requests; 64 KiB leaves room for
/// clients that ask for many.
const MAX_OPTION_DATA: u32 = 64 << 10;
/// Longest option data skipped (and answered NBD_REP_ERR_TOO_BIG); past this no
/// client is probing in good faith, so the connection is closed unread.
const MAX_OPTION_SKIP: u32 = 1 << 20;
/// Options per connection; a legitimate client needs a handful.
const MAX_OPTIONS: usize = 4096;
/// Block sizes advertised: byte-granular unless the export says otherwise,
/// 4 KiB preferred, 32 MiB payloads.
const MIN_BLOCK: u32 = 1;
const PREFERRED_BLOCK: u32 = 4096;

/// Serves one connection to its end: handshake (fixed newstyle; NBD_OPT_GO,
/// NBD_OPT_INFO, NBD_OPT_EXPORT_NAME, NBD_OPT_LIST, NBD_OPT_ABORT; others
/// answered NBD_REP_ERR_UNSUP), then requests until NBD_CMD_DISC or EOF.
///
/// `open` maps an export name to an export (Err: a message, sent as
/// NBD_REP_ERR_UNKNOWN); it is also called for NBD_OPT_INFO, whose export is
/// dropped at once. `names` lists the exports for NBD_OPT_LIST.
///
/// Returns Ok when the client disconnects or aborts, Err when the connection
/// fails or the client breaks the protocol (the connection is then closed, as
/// the protocol allows).
#[allow(clippy::type_complexity)] // spelled out: this is the signature callers read
pub fn serve<S: Read + Write>(
    mut stream: S,
    names: &dyn Fn() -> Vec<String>,
    open: &mut dyn FnMut(&str) -> Result<Box<dyn Export>, String>,
) -> io::Result<()> {
    let Some(export) = handshake(&mut stream, names, open)? else {
        return Ok(());
    };
    Connection {
        stream,
        export,
        buf: Vec::new(),
    }
    .run()
}

fn protocol_error(msg: String) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, msg)
}

fn transmission_flags(read_only: bool) -> u16 {
    let flags = wire::TFLAG_HAS_FLAGS
        | wire::TFLAG_SEND_FLUSH
        | wire::TFLAG_SEND_FUA
        | wire::TFLAG_SEND_TRIM
        | wire::TFLAG_SEND_WRITE_ZEROES;
    if read_only {
        flags | wire::TFLAG_READ_ONLY
    } else {
        flags
    }
}

/// Runs option haggling; `None` when the client aborted.
fn handshake<S: Read + Write>(
    s: &mut S,
    names: &dyn Fn() -> Vec<String>,
    open: &mut Open<'_>,
) -> io::Result<Option<Box<dyn Export>>> {
    let mut hello = [0; 18];
    hello[..8].copy_from_slice(&wire::NBDMAGIC.to_be_bytes());
    hello[8..16].copy_from_slice(&wire::IHAVEOPT.to_be_bytes());
    hello[16..].copy_from_slice(&(wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&hello)?;
    s.flush()?;
    let mut cflags = [0; 4];
    s.read_exact(&mut cflags)?;
    let cflags = u32::from_be_bytes(cflags);
    if cflags & !(wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES) != 0 {
        // The protocol requires dropping a client with flags we did not offer.
        return Err(protocol_error(format!(
            "NBD client sent unknown client flags {cflags:#x}"
        )));
    }
    let no_zeroes = cflags & wire::FLAG_C_NO_ZEROES != 0;
    let mut data = Vec::new();
    for _ in 0..MAX_OPTIONS {
        let mut h = [0; OptionHeader::LEN];
        s.read_exact(&mut h)?;
        let h = OptionHeader::decode(&h).ok_or_else(|| {
            protocol_error("NBD client sent an option without IHAVEOPT magic".into())
        })?;
        if h.length > MAX_OPTION_DATA {
            skip_option(s, &h)?;
            continue;
        }
        data.resize(h.length as usize, 0);
        s.read_exact(&mut data)?;
        match h.option {
            wire::OPT_EXPORT_NAME => return export_name(s, &data, no_zeroes, open).map(Some),
            wire::OPT_ABORT => {
                // The client may already have closed; it owes us nothing more.
                let _ = reply(s, h.option, wire::REP_ACK, &[]);
                return Ok(None);
            }
            wire::OPT_LIST if !data.is_empty() => {
                reply(
                    s,
                    h.option,
                    wire::REP_ERR_INVALID,
                    b"NBD_OPT_LIST takes no data",
                )?;
            }
            wire::OPT_LIST => list(s, names)?,
            wire::OPT_INFO | wire::OPT_GO => {
                if let Some(export) = info_or_go(s, h.option, &data, open)? {
                    return Ok(Some(export));
                }
            }
            other => reply(
                s,
                other,
                wire::REP_ERR_UNSUP,
                b"option not supported by udrive",
            )?,
        }
    }
    Err(protocol_error(format!(
        "NBD client sent over {MAX_OPTIONS} options without choosing an export"
    )))
}

fn reply<S: Write>(s: &mut S, option: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let length =
        u32::try_from(data.len()).map_err(|_| protocol_error("option reply over 4 GiB".into()))?;
    s.write_all(
        &OptionReply {
            option,
            kind,
            length,
        }
        .encode(),
    )?;
    s.write_all(data)?;
    s.flush()
}

/// Skips oversized option data in bounded chunks and answers TOO_BIG, so that a
/// client probing with a large option can go on; beyond MAX_OPTION_SKIP closes.
fn skip_option<S: Read + Write>(s: &mut S, h: &OptionHeader) -> io::Result<()> {
    if h.length > MAX_OPTION_SKIP || h.option == wire::OPT_EXPORT_NAME {
        // NBD_OPT_EXPORT_NAME has no error reply: the protocol says to close.
        return Err(protocol_error(format!(
            "NBD client sent option {} with {} bytes of data (limit {MAX_OPTION_DATA}); closing",
            h.option, h.length
        )));
    }
    let mut chunk = [0; 4096];
    let mut left = h.length as usize;
    while left > 0 {
        let n = left.min(chunk.len());
        s.read_exact(&mut chunk[..n])?;
        left -= n;
    }
    reply(
        s,
        h.option,
        wire::REP_ERR_TOO_BIG,
        b"option data over 64 KiB",
    )
}

fn list<S: Write>(s: &mut S, names: &dyn Fn() -> Vec<String>) -> io::Result<()> {
    for name in names() {
        let Ok(len) = u32::try_from(name.len()) else {
            continue;
        };
        let mut data = Vec::with_capacity(4 + name.len());
        data.extend_from_slice(&len.to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        reply(s, wire::OPT_LIST, wire::REP_SERVER, &data)?;
    }
    reply(s, wire::OPT_LIST, wire::REP_ACK, &[])
}

fn export_name<S: Write>(
    s: &mut S,
    data: &[u8],
    no_zeroes: bool,
    open: &mut Open<'_>,
) -> io::Result<Box<dyn Export>> {
    let name = std::str::from_utf8(data).map_err(|_| {
        protocol_error("NBD client asked for an export name that is not UTF-8".into())
    })?;
    let export = open(name).map_err(|e| {
        io::Error::new(
            ErrorKind::NotFound,
            format!("NBD client asked for export {name:?}: {e}"),
        )
    })?;
    let mut answer = [0; 8 + 2 + 124];
    answer[..8].copy_from_slice(&export.size().to_be_bytes());
    answer[8..10].copy_from_slice(&transmission_flags(export.read_only()).to_be_bytes());
    let len = if no_zeroes { 10 } else { answer.len() };
    s.write_all(&answer[..len])?;
    s.flush()?;
    Ok(export)
}

/// The export name of an NBD_OPT_INFO/GO payload: name length, name, number of
/// info requests, the requests. We always send what we have, so the requests
/// are only checked for framing.
fn parse_info_request(data: &[u8]) -> Option<&str> {
    let len = usize::try_from(wire::get32(data, 0)?).ok()?;
    let name = data.get(4..4usize.checked_add(len)?)?;
    let count = usize::from(wire::get16(data, 4 + len)?);
    if data.len() != 4 + len + 2 + 2 * count {
        return None;
    }
    std::str::from_utf8(name).ok()
}

fn info_or_go<S: Write>(
    s: &mut S,
    option: u32,
    data: &[u8],
    open: &mut Open<'_>,
) -> io::Result<Option<Box<dyn Export>>> {
    let Some(name) = parse_info_request(data) else {
        reply(
            s,
            option,
            wire::REP_ERR_INVALID,
            b"malformed NBD_OPT_INFO/NBD_OPT_GO data",
        )?;
        return Ok(None);
    };
    let export = match open(name) {
        Ok(e) => e,
        Err(msg) => {
            reply(s, option, wire::REP_ERR_UNKNOWN, msg.as_bytes())?;
            return Ok(None);
        }
    };
    let mut info = [0; 12];
    info[..2].copy_from_slice(&wire::INFO_EXPORT.to_be_bytes());
    info[2..10].copy_from_slice(&export.size().to_be_bytes());
    info[10..].copy_from_slice(&transmission_flags(export.read_only()).to_be_bytes());
    reply(s, option, wire::REP_INFO, &info)?;
    // Sent whether asked or not: the values are the protocol's defaults, so a
    // client that ignores them breaks nothing.
    let mut sizes = [0; 14];
    sizes[..2].copy_from_slice(&wire::INFO_BLOCK_SIZE.to_be_bytes());
    let min = export.min_block().clamp(MIN_BLOCK, PREFERRED_BLOCK);
    sizes[2..6].copy_from_slice(&min.to_be_bytes());
    sizes[6..10].copy_from_slice(&PREFERRED_BLOCK.to_be_bytes());
    sizes[10..].copy_from_slice(&MAX_PAYLOAD.to_be_bytes());
    reply(s, option, wire::REP_INFO, &sizes)?;
    reply(s, option, wire::REP_ACK, &[])?;
    Ok((option == wire::OPT_GO).then_some(export))
}

/// A request that passed every check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Command {
    Read {
        offset: u64,
        len: u32,
    },
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Disconnect,
    Flush,
    Trim {
        offset: u64,
        len: u32,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        may_trim: bool,
        fua: bool,
    },
}

/// A refused request: the error to reply and whether the connection must close.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Refusal {
    error: u32,
    /// A WRITE whose payload cannot be consumed: over MAX_PAYLOAD, skipping it
    /// would only serve a client that broke the protocol's MUST, so we reply
    /// and close instead.
    close: bool,
}

const fn refuse(error: u32) -> Refusal {
    Refusal {
        error,
        close: false,
    }
}

/// Decides what a request means for an export of `size` bytes.
fn parse(r: &Request, size: u64, read_only: bool) -> Result<Command, Refusal> {
    if r.kind == wire::CMD_WRITE && r.length > MAX_PAYLOAD {
        return Err(Refusal {
            error: wire::EINVAL,
            close: true,
        });
    }
    let allowed = match r.kind {
        wire::CMD_READ | wire::CMD_WRITE | wire::CMD_FLUSH | wire::CMD_TRIM | wire::CMD_DISC => {
            wire::CMD_FLAG_FUA
        }
        wire::CMD_WRITE_ZEROES => wire::CMD_FLAG_FUA | wire::CMD_FLAG_NO_HOLE,
        _ => return Err(refuse(wire::EINVAL)),
    };
    if r.flags & !allowed != 0 {
        return Err(refuse(wire::EINVAL));
    }
    let (offset, len, fua) = (r.offset, r.length, r.flags & wire::CMD_FLAG_FUA != 0);
    let writes = matches!(
        r.kind,
        wire::CMD_WRITE | wire::CMD_WRITE_ZEROES | wire::CMD_TRIM
    );
    if writes && read_only {
        return Err(refuse(wire::EPERM));
    }
    if r.kind == wire::CMD_READ && len > MAX_PAYLOAD {
        return Err(refuse(wire::EINVAL));
    }
    let in_bounds = offset
        .checked_add(u64::from(len))
        .is_some_and(|end| end <= size);
    if !in_bounds && matches!(r.kind, wire::CMD_READ | wire::CMD_TRIM) {
        return Err(refuse(wire::EINVAL));
    }
    if !in_bounds && matches!(r.kind, wire::CMD_WRITE | wire::CMD_WRITE_ZEROES) {
        // The protocol's choice (and qemu-nbd's) for writes past the end.
        return Err(refuse(wire::ENOSPC));
    }
    Ok(match r.kind {
        wire::CMD_READ => Command::Read { offset, len },
        wire::CMD_WRITE => Command::Write { offset, len, fua },
        wire::CMD_DISC => Command::Disconnect,
        wire::CMD_FLUSH => Command::Flush,
        wire::CMD_TRIM => Command::Trim { offset, len, fua },
        _ => Command::WriteZeroes {
            offset,
            len,
            may_trim: r.flags & wire::CMD_FLAG_NO_HOLE == 0,
            fua,
        },
    })
}

/// Room before the data in `buf` for the reply header, so a read's reply goes
/// out in one write.
const HDR: usize = SimpleReply::LEN;

/// The `len` bytes after the reply header in `buf`, growing it if needed.
fn payload(buf: &mut Vec<u8>, len: u32) -> &mut [u8] {
    let end = HDR + len as usize;
    if buf.len() < end {
        buf.resize(end, 0);
    }
    &mut buf[HDR..end]
}

struct Connection<S> {
    stream: S,
    export: Box<dyn Export>,
    /// Reply header then payload; grown to the largest request, at most
    /// HDR + MAX_PAYLOAD.
    buf: Vec<u8>,
}

impl<S: Read + Write> Connection<S> {
    fn run(mut self) -> io::Result<()> {
        loop {
            let mut h = [0; Request::LEN];
            match self.stream.read_exact(&mut h) {
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
                r => r?,
            }
            let req = Request::decode(&h).ok_or_else(|| {
                // The protocol leaves no way to answer a request we cannot frame.
                protocol_error("NBD client sent a request with bad magic; closing".into())
            })?;
            match parse(&req, self.export.size(), self.export.read_only()) {
                Ok(Command::Disconnect) => return Ok(()),
                Ok(cmd) => self.execute(req.cookie, cmd)?,
                Err(refusal) => self.refuse(&req, refusal)?,
            }
        }
    }

    fn refuse(&mut self, req: &Request, refusal: Refusal) -> io::Result<()> {
        if req.kind == wire::CMD_WRITE && !refusal.close {
            // Bounded: parse closes on writes over MAX_PAYLOAD.
            self.stream.read_exact(payload(&mut self.buf, req.length))?;
        }
        self.send(req.cookie, refusal.error, 0)?;
        if refusal.close {
            return Err(protocol_error(format!(
                "NBD client sent a {} of {} bytes, over the {MAX_PAYLOAD}-byte maximum; closing",
                wire::command_name(req.kind),
                req.length
            )));
        }
        Ok(())
    }

    fn execute(&mut self, cookie: u64, cmd: Command) -> io::Result<()> {
        let mut data_len = 0;
        let result = match cmd {
            Command::Read { offset, len } => {
                data_len = len;
                self.export.read(offset, payload(&mut self.buf, len))
            }
            Command::Write { offset, len, fua } => {
                let data = payload(&mut self.buf, len);
                self.stream.read_exact(data)?;
                self.export.write(offset, data, fua)
            }
            Command::Flush => self.export.flush(),
            Command::Trim { offset, len, fua } => self
                .export
                .trim(offset, u64::from(len))
                .and_then(|()| if fua { self.export.flush() } else { Ok(()) }),
            Command::WriteZeroes {
                offset,
                len,
                may_trim,
                fua,
            } => self
                .export
                .write_zeroes(offset, u64::from(len), may_trim)
                .and_then(|()| if fua { self.export.flush() } else { Ok(()) }),
            Command::Disconnect => Ok(()),
        };
        match result {
            Ok(()) => self.send(cookie, 0, data_len),
            Err(e) => self.send(cookie, crate::nbd_from_io(&e), 0),
        }
    }

    /// Sends a simple reply, followed by `data_len` bytes of `buf` on success.
    fn send(&mut self, cookie: u64, error: u32, data_len: u32) -> io::Result<()> {
        let end = HDR + data_len as usize;
        payload(&mut self.buf, data_len);
        self.buf[..HDR].copy_from_slice(&SimpleReply { error, cookie }.encode());
        self.stream.write_all(&self.buf[..end])?;
        self.stream.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(kind: u16, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags,
            kind,
            cookie: 1,
            offset,
            length,
        }
    }

    #[test]
    fn parse_checks_requests() {
        const SIZE: u64 = 1 << 20;
        let max = MAX_PAYLOAD;
        let einval = Err(refuse(wire::EINVAL));
        let cases: &[(Request, bool, Result<Command, Refusal>)] = &[
            (
                req(wire::CMD_READ, 0, 0, 512),
                false,
                Ok(Command::Read {
                    offset: 0,
                    len: 512,
                }),
            ),
            (
                req(wire::CMD_READ, 0, SIZE - 1, 1),
                true,
                Ok(Command::Read {
                    offset: SIZE - 1,
                    len: 1,
                }),
            ),
            (req(wire::CMD_READ, 0, SIZE, 1), false, einval),
            (req(wire::CMD_READ, 0, u64::MAX, 2), false, einval),
            (req(wire::CMD_READ, 0, 0, u32::MAX), false, einval),
            (req(wire::CMD_READ, 1 << 7, 0, 1), false, einval),
            (
                req(wire::CMD_READ, wire::CMD_FLAG_NO_HOLE, 0, 1),
                false,
                einval,
            ),
            (
                req(wire::CMD_WRITE, wire::CMD_FLAG_FUA, 8, 8),
                false,
                Ok(Command::Write {
                    offset: 8,
                    len: 8,
                    fua: true,
                }),
            ),
            (
                req(wire::CMD_WRITE, 0, 0, 8),
                true,
                Err(refuse(wire::EPERM)),
            ),
            (
                req(wire::CMD_WRITE, 0, u64::MAX, 8),
                false,
                Err(refuse(wire::ENOSPC)),
            ),
            (
                req(wire::CMD_WRITE, 0, 0, max + 1),
                false,
                Err(Refusal {
                    error: wire::EINVAL,
                    close: true,
                }),
            ),
            (
                req(wire::CMD_WRITE, 0, 0, max + 1),
                true,
                Err(Refusal {
                    error: wire::EINVAL,
                    close: true,
                }),
            ),
            (req(wire::CMD_TRIM, 0, 0, u32::MAX), false, einval),
            (
                req(wire::CMD_TRIM, 0, 0, 4096),
                true,
                Err(refuse(wire::EPERM)),
            ),
            (
                req(wire::CMD_WRITE_ZEROES, 0, 0, 4096),
                true,
                Err(refuse(wire::EPERM)),
            ),
            (
                req(wire::CMD_WRITE_ZEROES, wire::CMD_FLAG_FAST_ZERO, 0, 4096),
                false,
                einval,
            ),
            (
                req(wire::CMD_WRITE_ZEROES, wire::CMD_FLAG_NO_HOLE, 0, 4096),
                false,
                Ok(Command::WriteZeroes {
                    offset: 0,
                    len: 4096,
                    may_trim: false,
                    fua: false,
                }),
            ),
            (req(wire::CMD_FLUSH, 0, 0, 0), true, Ok(Command::Flush)),
            (req(wire::CMD_DISC, 0, 0, 0), true, Ok(Command::Disconnect)),
            (req(5, 0, 0, 0), false, einval),
            (req(0xffff, 0, 0, 0), false, einval),
        ];
        for (r, ro, want) in cases {
            assert_eq!(parse(r, SIZE, *ro), *want, "{r:?} read_only={ro}");
        }
    }

    #[test]
    fn write_zeroes_and_trim_may_exceed_max_payload() {
        let big = MAX_PAYLOAD * 4;
        let r = req(wire::CMD_WRITE_ZEROES, 0, 0, big);
        assert!(parse(&r, u64::MAX, false).is_ok());
        let r = req(wire::CMD_TRIM, wire::CMD_FLAG_FUA, 0, big);
        assert_eq!(
            parse(&r, u64::MAX, false),
            Ok(Command::Trim {
                offset: 0,
                len: big,
                fua: true
            })
        );
    }

    #[test]
    fn info_request_framing() {
        let mut ok = 3u32.to_be_bytes().to_vec();
        ok.extend_from_slice(b"abc");
        ok.extend_from_slice(&2u16.to_be_bytes());
        ok.extend_from_slice(&[0, 0, 0, 3]);
        assert_eq!(parse_info_request(&ok), Some("abc"));
        assert_eq!(parse_info_request(&ok[..ok.len() - 1]), None);
        let mut long = ok.clone();
        long.push(0);
        assert_eq!(parse_info_request(&long), None);
        assert_eq!(parse_info_request(&[0xff, 0xff, 0xff, 0xff, 0, 0]), None);
        assert_eq!(parse_info_request(&[0, 0, 0, 0, 0, 0]), Some(""));
        assert_eq!(parse_info_request(&[0, 0, 0, 1, 0xff, 0, 0]), None);
    }
}
