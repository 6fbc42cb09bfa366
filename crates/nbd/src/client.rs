//! A synchronous NBD client: one request in flight, simple replies only.
//!
//! After `connect`, the only system calls are the socket's reads and writes
//! (and `shutdown` in `disconnect`), because the client runs on a thread whose
//! seccomp filter allows little else.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;

use crate::uri::{Address, Uri};
use crate::wire::{self, OptionHeader, OptionReply, Request, SimpleReply};
use crate::{CommandError, MAX_PAYLOAD};

/// Longest option reply accepted from the server; real ones are a few bytes.
const MAX_REPLY_DATA: u32 = 64 << 10;
/// Replies to one NBD_OPT_GO before giving up on a server that never concludes.
const MAX_REPLIES: usize = 256;
/// Effect length of one WRITE_ZEROES or TRIM: well inside u32 and a multiple
/// of every legal minimum block size.
const MAX_EFFECT: u64 = 1 << 30;
/// Zero buffer for servers without WRITE_ZEROES.
const ZERO_CHUNK: usize = 1 << 20;

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn connect(address: &Address) -> io::Result<Stream> {
        match address {
            Address::Tcp(hostport) => {
                let s = TcpStream::connect(hostport.as_str())?;
                // Requests are small and synchronous: Nagle would delay each.
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
            Address::Unix(path) => UnixStream::connect(path).map(Stream::Unix),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn bad_server(msg: String) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, msg)
}

/// What the handshake learned about the export.
#[derive(Default)]
struct ExportInfo {
    size: Option<u64>,
    flags: u16,
    min_block: u32,
    max_payload: u32,
}

/// A connection to one NBD export.
pub struct Client {
    stream: Stream,
    size: u64,
    flags: u16,
    min_block: u32,
    /// Longest READ/WRITE sent: the server's maximum, capped at MAX_PAYLOAD.
    max_payload: u32,
    cookie: u64,
    /// Allocated on first use, for servers without WRITE_ZEROES.
    zeroes: Option<Box<[u8]>>,
    /// Set when a request failed mid-way: the stream is out of step.
    broken: bool,
}

impl Client {
    /// Fixed newstyle handshake, NBD_OPT_GO for `uri.export` (NBD_INFO_EXPORT
    /// and NBD_INFO_BLOCK_SIZE asked), no TLS, simple replies only. Falls back
    /// to NBD_OPT_EXPORT_NAME for servers that predate NBD_OPT_GO.
    pub fn connect(uri: &Uri) -> io::Result<Client> {
        let mut stream = Stream::connect(&uri.address)?;
        let info = handshake(&mut stream, &uri.export).map_err(|e| {
            io::Error::new(e.kind(), format!("NBD handshake with {uri} failed: {e}"))
        })?;
        Ok(Client {
            stream,
            size: info.size.unwrap_or(0),
            flags: info.flags,
            min_block: info.min_block,
            max_payload: info.max_payload,
            cookie: 0,
            zeroes: None,
            broken: false,
        })
    }

    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the server refuses writes.
    pub fn read_only(&self) -> bool {
        self.flags & wire::TFLAG_READ_ONLY != 0
    }

    fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    /// Reads `buf.len()` bytes at `offset`, in requests of at most the server's
    /// maximum payload.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check("NBD_CMD_READ", offset, buf.len() as u64)?;
        let mut done = 0;
        for chunk in buf.chunks_mut(self.chunk()) {
            self.request(wire::CMD_READ, 0, offset + done, Payload::Read(chunk))?;
            done += chunk.len() as u64;
        }
        Ok(())
    }

    /// Writes `data` at `offset`; `fua` makes it durable before returning
    /// (emulated with a flush when the server lacks FUA).
    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.check("NBD_CMD_WRITE", offset, data.len() as u64)?;
        let flags = if fua && self.has(wire::TFLAG_SEND_FUA) {
            wire::CMD_FLAG_FUA
        } else {
            0
        };
        let mut done = 0;
        for chunk in data.chunks(self.chunk()) {
            self.request(wire::CMD_WRITE, flags, offset + done, Payload::Write(chunk))?;
            done += chunk.len() as u64;
        }
        if fua && flags == 0 {
            self.flush()?;
        }
        Ok(())
    }

    /// Zeroes `len` bytes: NBD_CMD_WRITE_ZEROES when the server offers it (the
    /// server may punch a hole), else writes of a zero buffer of at most 1 MiB,
    /// allocated once.
    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.check("NBD_CMD_WRITE_ZEROES", offset, len)?;
        if self.has(wire::TFLAG_SEND_WRITE_ZEROES) {
            return self.effect(wire::CMD_WRITE_ZEROES, offset, len);
        }
        let chunk = ZERO_CHUNK.min(self.chunk());
        let zeroes = self
            .zeroes
            .take()
            .unwrap_or_else(|| vec![0; chunk].into_boxed_slice());
        let mut result = Ok(());
        let mut done = 0;
        while done < len && result.is_ok() {
            let n = usize::try_from(len - done).map_or(zeroes.len(), |l| l.min(zeroes.len()));
            result = self.request(
                wire::CMD_WRITE,
                0,
                offset + done,
                Payload::Write(&zeroes[..n]),
            );
            done += n as u64;
        }
        self.zeroes = Some(zeroes);
        result
    }

    /// Discards `len` bytes; Ok without a request when the server lacks TRIM.
    pub fn trim(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.check("NBD_CMD_TRIM", offset, len)?;
        if !self.has(wire::TFLAG_SEND_TRIM) {
            return Ok(());
        }
        self.effect(wire::CMD_TRIM, offset, len)
    }

    /// Makes completed writes durable; Ok without a request when the server
    /// lacks FLUSH (it then has no volatile cache to flush).
    pub fn flush(&mut self) -> io::Result<()> {
        if !self.has(wire::TFLAG_SEND_FLUSH) {
            return Ok(());
        }
        self.request(wire::CMD_FLUSH, 0, 0, Payload::None(0))
    }

    /// Sends NBD_CMD_DISC, then shuts the socket down.
    pub fn disconnect(mut self) -> io::Result<()> {
        let req = Request {
            flags: 0,
            kind: wire::CMD_DISC,
            cookie: self.cookie,
            offset: 0,
            length: 0,
        };
        self.stream.write_all(&req.encode())?;
        match &self.stream {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        }
    }

    /// Request length for READ/WRITE: the maximum payload rounded down to the
    /// minimum block size.
    fn chunk(&self) -> usize {
        (self.max_payload - self.max_payload % self.min_block) as usize
    }

    /// Refuses, before sending, what the server would have to refuse.
    fn check(&self, command: &str, offset: u64, len: u64) -> io::Result<()> {
        if self.broken {
            return Err(io::Error::new(
                ErrorKind::BrokenPipe,
                "NBD connection out of step after an earlier failure; reconnect",
            ));
        }
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(io::Error::new(
                ErrorKind::InvalidInput,
                format!("{command} of {len} bytes at offset {offset} is past the export's end ({} bytes)", self.size),
            ));
        }
        let min = u64::from(self.min_block);
        if !offset.is_multiple_of(min) || !len.is_multiple_of(min) {
            return Err(io::Error::new(
                ErrorKind::InvalidInput,
                format!("{command} of {len} bytes at offset {offset} is not aligned to the server's {min}-byte minimum block"),
            ));
        }
        Ok(())
    }

    /// Sends a payload-free command in pieces of at most MAX_EFFECT.
    fn effect(&mut self, kind: u16, offset: u64, len: u64) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_EFFECT);
            let n32 = u32::try_from(n).map_err(|_| io::Error::other("effect chunk over u32"))?;
            self.request(kind, 0, offset + done, Payload::None(n32))?;
            done += n;
        }
        Ok(())
    }

    fn request(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        payload: Payload<'_>,
    ) -> io::Result<()> {
        self.cookie = self.cookie.wrapping_add(1);
        let cookie = self.cookie;
        let length = payload.len()?;
        let req = Request {
            flags,
            kind,
            cookie,
            offset,
            length,
        };
        match self.exchange(&req, payload) {
            Ok(0) => Ok(()),
            Ok(error) => Err(CommandError {
                command: wire::command_name(kind),
                offset,
                length: u64::from(length),
                errno: crate::errno_from_nbd(error),
            }
            .into()),
            Err(e) => {
                self.broken = true;
                Err(e)
            }
        }
    }

    /// Sends one request and reads its reply; the server's error value, or Err
    /// when the connection failed or the server broke the protocol.
    fn exchange(&mut self, req: &Request, payload: Payload<'_>) -> io::Result<u32> {
        self.stream.write_all(&req.encode())?;
        if let Payload::Write(data) = payload {
            self.stream.write_all(data)?;
        }
        let mut h = [0; SimpleReply::LEN];
        self.stream.read_exact(&mut h)?;
        let reply = SimpleReply::decode(&h).map_err(|magic| {
            bad_server(format!(
                "NBD server sent a reply with magic {magic:#x}, not a simple reply"
            ))
        })?;
        if reply.cookie != req.cookie {
            return Err(bad_server(format!(
                "NBD server answered request {} with cookie {}",
                req.cookie, reply.cookie
            )));
        }
        if let (Payload::Read(buf), 0) = (payload, reply.error) {
            self.stream.read_exact(buf)?;
        }
        Ok(reply.error)
    }
}

enum Payload<'a> {
    None(u32),
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl Payload<'_> {
    fn len(&self) -> io::Result<u32> {
        let n = match self {
            Payload::None(n) => return Ok(*n),
            Payload::Read(b) => b.len(),
            Payload::Write(b) => b.len(),
        };
        u32::try_from(n).map_err(|_| io::Error::other("NBD payload over 4 GiB"))
    }
}

fn handshake(s: &mut Stream, export: &str) -> io::Result<ExportInfo> {
    let mut hello = [0; 18];
    s.read_exact(&mut hello[..16])?;
    if wire::get64(&hello, 0) != Some(wire::NBDMAGIC) {
        return Err(bad_server(
            "the peer is not an NBD server (no NBDMAGIC)".into(),
        ));
    }
    if wire::get64(&hello, 8) != Some(wire::IHAVEOPT) {
        return Err(bad_server(
            "the NBD server speaks only the oldstyle handshake; use a newstyle server".into(),
        ));
    }
    s.read_exact(&mut hello[16..])?;
    let sflags = wire::get16(&hello, 16).unwrap_or(0);
    if sflags & wire::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(bad_server(
            "the NBD server lacks fixed newstyle negotiation".into(),
        ));
    }
    let no_zeroes = sflags & wire::FLAG_NO_ZEROES != 0;
    let cflags = wire::FLAG_C_FIXED_NEWSTYLE | if no_zeroes { wire::FLAG_C_NO_ZEROES } else { 0 };
    s.write_all(&cflags.to_be_bytes())?;
    if export.len() > wire::MAX_STRING {
        return Err(io::Error::new(
            ErrorKind::InvalidInput,
            "NBD export name over 4096 bytes",
        ));
    }
    let name_len = u32::try_from(export.len()).unwrap_or(u32::MAX);
    let mut data = name_len.to_be_bytes().to_vec();
    data.extend_from_slice(export.as_bytes());
    for v in [2, wire::INFO_EXPORT, wire::INFO_BLOCK_SIZE] {
        data.extend_from_slice(&v.to_be_bytes());
    }
    send_option(s, wire::OPT_GO, &data)?;
    match go_replies(s, export)? {
        Some(info) => Ok(info),
        None => export_name(s, export, no_zeroes),
    }
}

fn send_option(s: &mut Stream, option: u32, data: &[u8]) -> io::Result<()> {
    let length = u32::try_from(data.len()).unwrap_or(u32::MAX);
    s.write_all(&OptionHeader { option, length }.encode())?;
    s.write_all(data)
}

/// Reads the replies to NBD_OPT_GO; `None` when the server does not know the
/// option and NBD_OPT_EXPORT_NAME must be used.
fn go_replies(s: &mut Stream, export: &str) -> io::Result<Option<ExportInfo>> {
    let mut info = ExportInfo {
        min_block: 1,
        max_payload: MAX_PAYLOAD,
        ..ExportInfo::default()
    };
    let mut data = Vec::new();
    for _ in 0..MAX_REPLIES {
        let mut h = [0; OptionReply::LEN];
        s.read_exact(&mut h)?;
        let r =
            OptionReply::decode(&h).ok_or_else(|| bad_server("bad option reply magic".into()))?;
        if r.option != wire::OPT_GO || r.length > MAX_REPLY_DATA {
            return Err(bad_server(format!(
                "unexpected option reply {r:?} to NBD_OPT_GO"
            )));
        }
        data.resize(r.length as usize, 0);
        s.read_exact(&mut data)?;
        match r.kind {
            wire::REP_INFO => read_info(&data, &mut info)?,
            wire::REP_ACK if info.size.is_some() => return Ok(Some(info)),
            wire::REP_ACK => {
                return Err(bad_server(
                    "NBD server accepted NBD_OPT_GO without NBD_INFO_EXPORT".into(),
                ))
            }
            wire::REP_ERR_UNSUP => return Ok(None),
            kind => {
                let text = String::from_utf8_lossy(&data);
                let errkind = if kind == wire::REP_ERR_UNKNOWN {
                    ErrorKind::NotFound
                } else {
                    ErrorKind::Other
                };
                return Err(io::Error::new(
                    errkind,
                    format!(
                        "NBD server refused export {export:?}: {} {text}",
                        wire::reply_name(kind)
                    ),
                ));
            }
        }
    }
    Err(bad_server(format!(
        "NBD server sent over {MAX_REPLIES} replies to NBD_OPT_GO"
    )))
}

fn read_info(data: &[u8], info: &mut ExportInfo) -> io::Result<()> {
    match (wire::get16(data, 0), data.len()) {
        (Some(wire::INFO_EXPORT), 12) => {
            info.size = wire::get64(data, 2);
            info.flags = wire::get16(data, 10).unwrap_or(0);
        }
        (Some(wire::INFO_BLOCK_SIZE), 14) => {
            let min = wire::get32(data, 2).unwrap_or(0);
            let max = wire::get32(data, 10).unwrap_or(0);
            if !min.is_power_of_two() || min > 1 << 16 || max < min {
                return Err(bad_server(format!(
                    "NBD server advertised invalid block sizes: minimum {min}, maximum {max}"
                )));
            }
            info.min_block = min;
            info.max_payload = max.min(MAX_PAYLOAD).max(min);
        }
        (Some(wire::INFO_EXPORT | wire::INFO_BLOCK_SIZE), n) => {
            return Err(bad_server(format!("NBD_REP_INFO of wrong length {n}")));
        }
        _ => {} // The protocol asks clients to ignore info they do not know.
    }
    Ok(())
}

fn export_name(s: &mut Stream, export: &str, no_zeroes: bool) -> io::Result<ExportInfo> {
    send_option(s, wire::OPT_EXPORT_NAME, export.as_bytes())?;
    let mut answer = [0; 8 + 2 + 124];
    let len = if no_zeroes { 10 } else { answer.len() };
    s.read_exact(&mut answer[..len]).map_err(|e| match e.kind() {
        // Without NBD_OPT_GO a server can only refuse an export by hanging up.
        ErrorKind::UnexpectedEof => io::Error::new(
            ErrorKind::NotFound,
            format!("NBD server closed the connection on NBD_OPT_EXPORT_NAME {export:?}: no such export?"),
        ),
        _ => e,
    })?;
    Ok(ExportInfo {
        size: wire::get64(&answer, 0),
        flags: wire::get16(&answer, 8).unwrap_or(0),
        min_block: 1,
        max_payload: MAX_PAYLOAD,
    })
}
