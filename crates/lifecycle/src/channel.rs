//! The channel between two udrive processes — a supervisor and its child, or the
//! old and the new process of a live handover: a SOCK_SEQPACKET socket, one
//! datagram per message, `[op][key length: u16 LE][key][bytes]`, fds as SCM_RIGHTS.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// Largest message: a record's bytes are at most a config space image (4 KiB) or a
/// small JSON document.
pub const MAX_MSG: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// child → supervisor: store a record (replacing one with the same key).
    Put = 1,
    /// child → supervisor: drop the records whose key starts with the key given.
    Remove = 2,
    /// child → supervisor: send me every record.
    Hello = 3,
    /// child → supervisor: devices are up (a child that dies before is not restarted).
    Ready = 4,
    /// supervisor → child: one record.
    Record = 5,
    /// supervisor → child: no more records.
    End = 6,
    /// handover, new → old process: serving; exit.
    Confirm = 7,
    /// handover, new → old process: cannot take over (the key says why); resume.
    Abort = 8,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Put,
            2 => Op::Remove,
            3 => Op::Hello,
            4 => Op::Ready,
            5 => Op::Record,
            6 => Op::End,
            7 => Op::Confirm,
            8 => Op::Abort,
            _ => return None,
        })
    }
}

pub struct Message {
    pub op: Op,
    pub key: String,
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

pub fn send(
    sock: BorrowedFd<'_>,
    op: Op,
    key: &str,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let klen = u16::try_from(key.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "key too long"))?;
    if 3 + key.len() + bytes.len() > MAX_MSG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "record too large",
        ));
    }
    let mut head = [0u8; 3];
    head[0] = op as u8;
    head[1..].copy_from_slice(&klen.to_le_bytes());
    crate::fdpass::send(sock, &[&head, key.as_bytes(), bytes], fds)?;
    Ok(())
}

/// Every record of `store` (as `Record`s), then `End`.
pub fn send_all(sock: BorrowedFd<'_>, store: &crate::RecordStore) -> io::Result<()> {
    let st = store.lock();
    for (k, (bytes, fds)) in st.map.iter() {
        let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        send(sock, Op::Record, k, bytes, &fds)
            .map_err(|e| io::Error::new(e.kind(), format!("record {k}: {e}")))?;
    }
    send(sock, Op::End, "", &[], &[])
}

/// The next message; `None` at end of stream (the peer exited).
pub fn recv(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Option<Message>> {
    let mut fds = Vec::new();
    let (n, truncated) = crate::fdpass::recv(sock, buf, &mut fds)?;
    if n == 0 {
        return Ok(None);
    }
    let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
    if truncated {
        return Err(bad("too many file descriptors in one message"));
    }
    let msg = &buf[..n];
    let (Some(&op), Some(klen)) = (msg.first(), msg.get(1..3)) else {
        return Err(bad("short message"));
    };
    let op = Op::from_u8(op).ok_or_else(|| bad("unknown operation"))?;
    let klen = usize::from(u16::from_le_bytes([klen[0], klen[1]]));
    let key = msg.get(3..3 + klen).ok_or_else(|| bad("short key"))?;
    let key = String::from_utf8(key.to_vec()).map_err(|_| bad("key is not UTF-8"))?;
    Ok(Some(Message {
        op,
        key,
        bytes: msg[3 + klen..].to_vec(),
        fds,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    use std::os::fd::AsFd;

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap()
    }

    #[test]
    fn a_record_and_its_fd_cross_intact() {
        let (a, b) = pair();
        let file = std::fs::File::open("/dev/null").unwrap();
        send(a.as_fd(), Op::Put, "k/1", b"abc", &[file.as_fd()]).unwrap();
        send(a.as_fd(), Op::End, "", b"", &[]).unwrap();
        let mut buf = vec![0u8; MAX_MSG];
        let m = recv(b.as_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(
            (m.op, m.key.as_str(), &m.bytes[..], m.fds.len()),
            (Op::Put, "k/1", &b"abc"[..], 1)
        );
        let m = recv(b.as_fd(), &mut buf).unwrap().unwrap();
        assert_eq!((m.op, m.key.as_str(), m.bytes.len()), (Op::End, "", 0));
        drop(a);
        assert!(recv(b.as_fd(), &mut buf).unwrap().is_none());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let (a, b) = pair();
        let mut buf = vec![0u8; MAX_MSG];
        for junk in [&[9u8][..], &[1, 200, 0, b'x'], &[1, 1, 0, 0xff]] {
            crate::fdpass::send(a.as_fd(), &[junk], &[]).unwrap();
            assert!(recv(b.as_fd(), &mut buf).is_err());
        }
    }
}
