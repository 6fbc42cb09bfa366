//! A raw vfio-user client that sends whatever a test writes: any header, any
//! payload, any fds, partial messages. It checks nothing it sends; replies are read
//! whole, with the fd that came with them.
//!
//! udrive's own well-behaved client is `initiator::VfioUserClient`; this one is for
//! hostile and protocol-level tests of a server (and of its DMA messages, which the
//! test answers by hand).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use guest_mem::SharedMem;
use vfio_user::proto::{
    self, Command, Header, RegionAccess, Version, HEADER_SIZE, PCI_CONFIG_REGION,
};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use zerocopy::IntoBytes;

/// The 16-byte header of a message (or reply) with these fields.
pub fn header(msg_id: u16, cmd: u16, msg_size: u32, flags: u32) -> Vec<u8> {
    Header {
        msg_id,
        cmd,
        msg_size,
        flags,
        error: 0,
    }
    .as_bytes()
    .to_vec()
}

pub struct RawClient {
    pub s: UnixStream,
    /// The last message id used.
    pub id: u16,
}

/// One message read back.
pub struct RawReply {
    pub hdr: Header,
    pub payload: Vec<u8>,
    pub fd: Option<std::fs::File>,
}

impl RawClient {
    /// Connects; reads time out after 5 s.
    pub fn connect(path: &Path) -> RawClient {
        let s = UnixStream::connect(path).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        RawClient { s, id: 0 }
    }

    /// Sends `bytes` as they are, with `fds` on the first byte.
    pub fn send_raw(&mut self, bytes: &[u8], fds: &[RawFd]) {
        if fds.is_empty() {
            self.s.write_all(bytes).expect("send");
        } else {
            let n = self.s.send_with_fds(&[bytes], fds).expect("send with fds");
            self.s.write_all(&bytes[n..]).expect("send");
        }
    }

    /// Sends a message with the next id; that id.
    pub fn send(&mut self, cmd: u16, flags: u32, payload: &[u8], fds: &[RawFd]) -> u16 {
        self.id = self.id.wrapping_add(1);
        let size = u32::try_from(HEADER_SIZE + payload.len()).expect("message size");
        let mut b = header(self.id, cmd, size, flags);
        b.extend_from_slice(payload);
        self.send_raw(&b, fds);
        self.id
    }

    /// Reads one message; None on EOF, reset or timeout.
    pub fn recv(&mut self) -> Option<RawReply> {
        let (hdr, payload, fds) = recv_message(&mut self.s)?;
        let fd = fds.into_iter().next();
        Some(RawReply { hdr, payload, fd })
    }

    /// Sends `cmd` and reads its reply (which must be one, to this message).
    #[track_caller]
    pub fn call(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> RawReply {
        let id = self.send(cmd as u16, 0, payload, fds);
        let r = self.recv().expect("reply");
        assert_eq!(r.hdr.msg_id, id);
        assert_eq!(r.hdr.cmd, cmd as u16);
        assert!(r.hdr.is_reply());
        r
    }

    /// VERSION with `max_data_xfer_size` of `max_xfer`.
    #[track_caller]
    pub fn negotiate_with(&mut self, max_xfer: u32) {
        let mut p = Version { major: 0, minor: 0 }.as_bytes().to_vec();
        let caps = format!(
            r#"{{"capabilities":{{"max_msg_fds":8,"max_data_xfer_size":{max_xfer},"pgsizes":4096}}}}"#
        );
        p.extend_from_slice(caps.as_bytes());
        p.push(0);
        let r = self.call(Command::Version, &p, &[]);
        assert!(!r.hdr.is_error(), "version error {}", r.hdr.error);
    }

    /// VERSION with a 1 MiB transfer limit.
    #[track_caller]
    pub fn negotiate(&mut self) {
        self.negotiate_with(1 << 20);
    }

    /// Sends `cmd` and expects an error reply with `errno`.
    #[track_caller]
    pub fn expect_err(&mut self, cmd: u16, payload: &[u8], fds: &[RawFd], errno: i32) {
        let id = self.send(cmd, 0, payload, fds);
        let r = self.recv().expect("error reply");
        assert_eq!(r.hdr.msg_id, id);
        assert!(r.hdr.is_error(), "cmd {cmd}: expected error, got success");
        assert_eq!(r.hdr.error, errno as u32, "cmd {cmd}");
        assert_eq!(r.hdr.msg_size as usize, HEADER_SIZE);
    }

    /// Replies to the server's message `to` with `payload`.
    pub fn reply(&mut self, to: &RawReply, payload: &[u8]) {
        let h = Header::reply_to(&to.hdr, payload.len());
        let mut b = h.as_bytes().to_vec();
        b.extend_from_slice(payload);
        self.send_raw(&b, &[]);
    }

    #[track_caller]
    pub fn cfg_read32(&mut self, off: u64) -> u32 {
        let a = RegionAccess {
            offset: off,
            region: PCI_CONFIG_REGION,
            count: 4,
        };
        let r = self.call(Command::RegionRead, a.as_bytes(), &[]);
        assert!(!r.hdr.is_error());
        u32::from_le_bytes(r.payload[16..20].try_into().expect("4 bytes"))
    }

    #[track_caller]
    pub fn region_write(&mut self, region: u32, off: u64, data: &[u8]) {
        let a = RegionAccess {
            offset: off,
            region,
            count: u32::try_from(data.len()).expect("count"),
        };
        let mut p = a.as_bytes().to_vec();
        p.extend_from_slice(data);
        let r = self.call(Command::RegionWrite, &p, &[]);
        assert!(!r.hdr.is_error(), "write error {}", r.hdr.error);
        assert_eq!(r.payload, a.as_bytes());
    }

    /// Whether the server closed the connection (EOF within the read timeout).
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        match self.s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    }
}

/// Reads one whole message from `s` (either side of a connection) with the fds
/// that came with its first bytes (at most 16); None on EOF, reset, timeout or a
/// header that does not parse.
pub fn recv_message(s: &mut UnixStream) -> Option<(Header, Vec<u8>, Vec<File>)> {
    let mut hb = [0u8; HEADER_SIZE];
    let mut raw = [-1 as RawFd; 16];
    let mut iov = [libc::iovec {
        iov_base: hb.as_mut_ptr().cast(),
        iov_len: HEADER_SIZE,
    }];
    // SAFETY: the iovec points at `hb`, which outlives the call and is not used
    // otherwise meanwhile.
    let (n, nfds) = unsafe { s.recv_with_fds(&mut iov, &mut raw) }.ok()?;
    let files: Vec<File> = raw[..nfds]
        .iter()
        // SAFETY: the kernel installed these descriptors for us; nothing else owns
        // them.
        .map(|fd| unsafe { File::from_raw_fd(*fd) })
        .collect();
    if n == 0 {
        return None;
    }
    s.read_exact(&mut hb[n..]).ok()?;
    let hdr: Header = proto::parse(&hb)?;
    let mut payload = vec![0u8; (hdr.msg_size as usize).checked_sub(HEADER_SIZE)?];
    s.read_exact(&mut payload).ok()?;
    Some((hdr, payload, files))
}

/// The raw fd of `s`, to pass in a message.
pub fn fd_of(s: &SharedMem) -> RawFd {
    s.fd().as_fd().as_raw_fd()
}
