//! Raw bytes from a client that breaks the rules: `serve` must answer with the
//! protocol's error or close, never panic, never allocate what the client asks.

mod common;

use std::io::{self, Cursor, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use common::MemExport;
use nbd::wire::{self, OptionHeader, OptionReply, Request, SimpleReply};
use nbd::{serve, Export};

const SIZE: u64 = 1 << 20;

struct Raw {
    s: UnixStream,
    server: JoinHandle<io::Result<()>>,
}

fn open_with(read_only: bool) -> impl FnMut(&str) -> Result<Box<dyn Export>, String> {
    let data = Arc::new(Mutex::new(vec![0u8; SIZE as usize]));
    move |name: &str| -> Result<Box<dyn Export>, String> {
        if name != "x" {
            return Err(format!("no export {name:?}"));
        }
        Ok(Box::new(MemExport {
            data: data.clone(),
            read_only,
            flushes: Arc::default(),
        }))
    }
}

impl Raw {
    fn start(
        mut open: impl FnMut(&str) -> Result<Box<dyn Export>, String> + Send + 'static,
    ) -> Raw {
        let (s, theirs) = UnixStream::pair().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let server =
            std::thread::spawn(move || serve(theirs, &|| vec!["x".to_string()], &mut open));
        let mut raw = Raw { s, server };
        let mut hello = [0u8; 18];
        raw.s.read_exact(&mut hello).unwrap();
        assert_eq!(&hello[..16], b"NBDMAGICIHAVEOPT");
        assert_eq!(
            u16::from_be_bytes([hello[16], hello[17]]),
            3,
            "FIXED_NEWSTYLE | NO_ZEROES"
        );
        raw
    }

    fn send(&mut self, bytes: &[u8]) {
        // The server may already have closed: that is what some tests expect.
        let _ = self.s.write_all(bytes);
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        self.send(
            &OptionHeader {
                option,
                length: data.len() as u32,
            }
            .encode(),
        );
        self.send(data);
    }

    fn option_reply(&mut self) -> (OptionReply, Vec<u8>) {
        let mut h = [0; OptionReply::LEN];
        self.s.read_exact(&mut h).unwrap();
        let r = OptionReply::decode(&h).expect("option reply magic");
        let mut data = vec![0; r.length as usize];
        self.s.read_exact(&mut data).unwrap();
        (r, data)
    }

    /// Handshake through NBD_OPT_GO "x".
    fn go(read_only: bool) -> Raw {
        let mut raw = Raw::start(open_with(read_only));
        raw.send(&3u32.to_be_bytes());
        raw.option(wire::OPT_GO, &go_data("x", &[wire::INFO_BLOCK_SIZE]));
        let mut saw_export = false;
        loop {
            let (r, data) = raw.option_reply();
            match r.kind {
                wire::REP_INFO if data[..2] == [0, 0] => {
                    saw_export = true;
                    assert_eq!(u64::from_be_bytes(data[2..10].try_into().unwrap()), SIZE);
                    let flags = u16::from_be_bytes([data[10], data[11]]);
                    assert_eq!(flags & wire::TFLAG_READ_ONLY != 0, read_only);
                    assert_eq!(flags & wire::TFLAG_CAN_MULTI_CONN, 0);
                    assert_eq!(
                        flags & 0x6d,
                        0x6d,
                        "HAS_FLAGS FLUSH FUA TRIM WRITE_ZEROES: {flags:#x}"
                    );
                }
                wire::REP_INFO => {
                    assert_eq!(
                        data,
                        [0, 3, 0, 0, 0, 1, 0, 0, 0x10, 0, 0x02, 0, 0, 0],
                        "block sizes 1/4096/32M"
                    );
                }
                wire::REP_ACK => break,
                other => panic!("unexpected reply {other:#x}"),
            }
        }
        assert!(saw_export);
        raw
    }

    fn request(&mut self, kind: u16, flags: u16, offset: u64, length: u32, cookie: u64) {
        self.send(
            &Request {
                flags,
                kind,
                cookie,
                offset,
                length,
            }
            .encode(),
        );
    }

    fn reply(&mut self) -> SimpleReply {
        let mut h = [0; SimpleReply::LEN];
        self.s.read_exact(&mut h).unwrap();
        SimpleReply::decode(&h).expect("simple reply magic")
    }

    /// True when the server has closed its end.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }

    /// Closes our end and returns what `serve` returned; a panic fails here.
    fn finish(self) -> io::Result<()> {
        drop(self.s);
        self.server.join().expect("serve panicked")
    }
}

fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

#[test]
fn unknown_client_flags_close_the_connection() {
    let mut raw = Raw::start(open_with(false));
    raw.send(&0x8000_0001u32.to_be_bytes());
    assert!(raw.closed());
    assert!(raw.finish().is_err());
}

#[test]
fn bad_option_magic_closes_the_connection() {
    let mut raw = Raw::start(open_with(false));
    raw.send(&1u32.to_be_bytes());
    let mut h = OptionHeader {
        option: wire::OPT_LIST,
        length: 0,
    }
    .encode();
    h[0] = b'X';
    raw.send(&h);
    assert!(raw.closed());
    assert!(raw.finish().is_err());
}

#[test]
fn option_length_of_4_gib_closes_without_reading() {
    let mut raw = Raw::start(open_with(false));
    raw.send(&1u32.to_be_bytes());
    raw.send(
        &OptionHeader {
            option: wire::OPT_GO,
            length: u32::MAX,
        }
        .encode(),
    );
    assert!(raw.closed());
    let e = raw.finish().unwrap_err();
    assert!(e.to_string().contains("4294967295"), "{e}");
}

#[test]
fn oversized_option_is_skipped_and_answered_too_big() {
    let mut raw = Raw::start(open_with(false));
    raw.send(&1u32.to_be_bytes());
    let w = std::thread::scope(|sc| {
        let mut s = raw.s.try_clone().unwrap();
        let w = sc.spawn(move || {
            s.write_all(
                &OptionHeader {
                    option: wire::OPT_GO,
                    length: (64 << 10) + 1,
                }
                .encode(),
            )?;
            s.write_all(&vec![0xaa; (64 << 10) + 1])
        });
        let (r, _) = raw.option_reply();
        assert_eq!((r.option, r.kind), (wire::OPT_GO, wire::REP_ERR_TOO_BIG));
        w.join().unwrap()
    });
    w.unwrap();
    // Still in step: list, then abort.
    raw.option(wire::OPT_LIST, &[]);
    let (r, data) = raw.option_reply();
    assert_eq!((r.kind, data), (wire::REP_SERVER, vec![0, 0, 0, 1, b'x']));
    assert_eq!(raw.option_reply().0.kind, wire::REP_ACK);
    raw.option(wire::OPT_ABORT, &[]);
    assert_eq!(raw.option_reply().0.kind, wire::REP_ACK);
    assert!(raw.finish().is_ok());
}

#[test]
fn bad_options_get_error_replies_then_go_works() {
    let mut raw = Raw::start(open_with(false));
    raw.send(&1u32.to_be_bytes());
    let cases: &[(u32, Vec<u8>, u32)] = &[
        (wire::OPT_STRUCTURED_REPLY, vec![], wire::REP_ERR_UNSUP),
        (wire::OPT_STARTTLS, vec![], wire::REP_ERR_UNSUP),
        (0xdead, vec![1, 2, 3], wire::REP_ERR_UNSUP),
        (wire::OPT_LIST, vec![0], wire::REP_ERR_INVALID),
        (wire::OPT_GO, vec![0, 0, 0, 9, b'x'], wire::REP_ERR_INVALID),
        (
            wire::OPT_GO,
            vec![0xff, 0xff, 0xff, 0xff, 0, 0],
            wire::REP_ERR_INVALID,
        ),
        (
            wire::OPT_INFO,
            go_data("x", &[0]).into_iter().chain([0]).collect(),
            wire::REP_ERR_INVALID,
        ),
        (wire::OPT_GO, go_data("nope", &[]), wire::REP_ERR_UNKNOWN),
        (wire::OPT_INFO, go_data("x", &[]), wire::REP_ACK),
    ];
    for (option, data, want) in cases {
        raw.option(*option, data);
        let (mut r, mut text) = raw.option_reply();
        while r.kind == wire::REP_INFO {
            (r, text) = raw.option_reply();
        }
        assert_eq!(
            (r.option, r.kind),
            (*option, *want),
            "option {option:#x}: {}",
            String::from_utf8_lossy(&text)
        );
        if *want == wire::REP_ERR_UNKNOWN {
            assert_eq!(text, b"no export \"nope\"");
        }
    }
    raw.option(wire::OPT_GO, &go_data("x", &[]));
    while raw.option_reply().0.kind != wire::REP_ACK {}
    raw.request(wire::CMD_READ, 0, 0, 8, 5);
    assert_eq!(
        raw.reply(),
        SimpleReply {
            error: 0,
            cookie: 5
        }
    );
    raw.s.read_exact(&mut [0u8; 8]).unwrap();
    raw.request(wire::CMD_DISC, 0, 0, 0, 6);
    assert!(raw.closed());
    assert!(raw.finish().is_ok());
}

#[test]
fn too_many_options_close_the_connection() {
    let mut raw = Raw::start(open_with(false));
    raw.send(&1u32.to_be_bytes());
    for _ in 0..4096 {
        raw.option(0x77, &[]);
        assert_eq!(raw.option_reply().0.kind, wire::REP_ERR_UNSUP);
    }
    raw.option(0x77, &[]);
    assert!(raw.closed());
    assert!(raw.finish().unwrap_err().to_string().contains("4096"));
}

#[test]
fn export_name_without_go_enters_transmission() {
    for (cflags, tail) in [(1u32, 124usize), (3, 0)] {
        let mut raw = Raw::start(open_with(true));
        raw.send(&cflags.to_be_bytes());
        raw.option(wire::OPT_EXPORT_NAME, b"x");
        let mut answer = vec![0u8; 10 + tail];
        raw.s.read_exact(&mut answer).unwrap();
        assert_eq!(u64::from_be_bytes(answer[..8].try_into().unwrap()), SIZE);
        assert_eq!(answer[9] & 2, 2, "read-only flag");
        raw.request(wire::CMD_FLUSH, 0, 0, 0, 1);
        assert_eq!(
            raw.reply(),
            SimpleReply {
                error: 0,
                cookie: 1
            }
        );
        assert!(raw.finish().is_ok(), "EOF ends serve cleanly");
    }
    let mut raw = Raw::start(open_with(true));
    raw.send(&1u32.to_be_bytes());
    raw.option(wire::OPT_EXPORT_NAME, b"nope");
    assert!(raw.closed(), "no error reply exists for EXPORT_NAME: close");
    assert!(raw.finish().is_err());
}

#[test]
fn bad_requests_get_the_protocol_errno_and_the_connection_goes_on() {
    let mut raw = Raw::go(false);
    let (r, w, z, t) = (
        wire::CMD_READ,
        wire::CMD_WRITE,
        wire::CMD_WRITE_ZEROES,
        wire::CMD_TRIM,
    );
    let cases: &[(u16, u16, u64, u32, u32)] = &[
        (r, 0, 0, u32::MAX, wire::EINVAL),
        (r, 0, 0, nbd::MAX_PAYLOAD + 1, wire::EINVAL),
        (r, 0, u64::MAX - 3, 8, wire::EINVAL),
        (r, 0, SIZE - 4, 8, wire::EINVAL),
        (w, 0, u64::MAX - 3, 8, wire::ENOSPC),
        (w, 0, SIZE, 8, wire::ENOSPC),
        (w, 0x80, 0, 8, wire::EINVAL),
        (z, 0, SIZE - 4096, 8192, wire::ENOSPC),
        (z, wire::CMD_FLAG_FAST_ZERO, 0, 4096, wire::EINVAL),
        (t, 0, u64::MAX, 1, wire::EINVAL),
        (t, wire::CMD_FLAG_NO_HOLE, 0, 1, wire::EINVAL),
        (42, 0, 0, 0, wire::EINVAL),
        (wire::CMD_FLUSH, 0x100, 0, 0, wire::EINVAL),
        (r, 0, 0, 0, 0),
        (z, wire::CMD_FLAG_NO_HOLE | wire::CMD_FLAG_FUA, 0, 8, 0),
        (w, wire::CMD_FLAG_FUA, SIZE - 8, 8, 0),
    ];
    for (i, &(kind, flags, offset, len, want)) in cases.iter().enumerate() {
        let cookie = 1000 + i as u64;
        raw.request(kind, flags, offset, len, cookie);
        if kind == w {
            raw.send(&[0x5a; 8]); // the payload is consumed even when refused
        }
        assert_eq!(
            raw.reply(),
            SimpleReply {
                error: want,
                cookie
            },
            "case {i}: kind {kind} flags {flags:#x} offset {offset} len {len}"
        );
    }
    raw.request(r, 0, SIZE - 16, 16, 7);
    assert_eq!(
        raw.reply(),
        SimpleReply {
            error: 0,
            cookie: 7
        }
    );
    let mut data = [0u8; 16];
    raw.s.read_exact(&mut data).unwrap();
    assert_eq!(
        data,
        [0, 0, 0, 0, 0, 0, 0, 0, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a]
    );
    raw.request(wire::CMD_DISC, 0, 0, 0, 8);
    assert!(raw.finish().is_ok());
}

#[test]
fn writes_on_a_read_only_export_get_eperm() {
    let mut raw = Raw::go(true);
    for (kind, len) in [
        (wire::CMD_WRITE, 512u32),
        (wire::CMD_WRITE_ZEROES, 4096),
        (wire::CMD_TRIM, 4096),
    ] {
        raw.request(kind, 0, 0, len, u64::from(kind));
        if kind == wire::CMD_WRITE {
            raw.send(&[1; 512]);
        }
        assert_eq!(
            raw.reply(),
            SimpleReply {
                error: wire::EPERM,
                cookie: u64::from(kind)
            }
        );
    }
    raw.request(wire::CMD_READ, 0, 0, 512, 9);
    assert_eq!(raw.reply().error, 0);
    let mut data = [1u8; 512];
    raw.s.read_exact(&mut data).unwrap();
    assert!(
        data.iter().all(|&b| b == 0),
        "the refused write did not land"
    );
    assert!(raw.finish().is_ok());
}

#[test]
fn bad_request_magic_closes_the_connection() {
    let mut raw = Raw::go(false);
    let mut h = Request {
        flags: 0,
        kind: wire::CMD_READ,
        cookie: 1,
        offset: 0,
        length: 512,
    }
    .encode();
    h[3] ^= 0xff;
    raw.send(&h);
    assert!(raw.closed());
    assert!(raw.finish().unwrap_err().to_string().contains("magic"));
}

#[test]
fn write_over_max_payload_is_refused_then_closed() {
    let mut raw = Raw::go(false);
    raw.request(wire::CMD_WRITE, 0, 0, u32::MAX, 3);
    assert_eq!(
        raw.reply(),
        SimpleReply {
            error: wire::EINVAL,
            cookie: 3
        }
    );
    assert!(raw.closed());
    assert!(raw.finish().is_err());
}

/// An export whose every operation fails with a chosen error.
struct Failing(fn() -> io::Error);

impl Export for Failing {
    fn size(&self) -> u64 {
        SIZE
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&mut self, _: u64, _: &mut [u8]) -> io::Result<()> {
        Err(self.0())
    }
    fn write(&mut self, _: u64, _: &[u8], _: bool) -> io::Result<()> {
        Err(self.0())
    }
    fn write_zeroes(&mut self, _: u64, _: u64, _: bool) -> io::Result<()> {
        Err(self.0())
    }
    fn trim(&mut self, _: u64, _: u64) -> io::Result<()> {
        Err(self.0())
    }
    fn flush(&mut self) -> io::Result<()> {
        Err(self.0())
    }
}

#[test]
fn export_errors_reach_the_client_as_nbd_errnos() {
    let cases: [(fn() -> io::Error, u32); 5] = [
        (|| io::Error::from_raw_os_error(libc::ENOSPC), wire::ENOSPC),
        (|| io::Error::from_raw_os_error(libc::EDQUOT), wire::ENOSPC),
        (|| io::Error::from_raw_os_error(libc::EACCES), wire::EIO),
        (
            || io::Error::from_raw_os_error(libc::ESHUTDOWN),
            wire::ESHUTDOWN,
        ),
        (|| io::Error::other("no errno"), wire::EIO),
    ];
    for (err, want) in cases {
        let mut raw = Raw::start(move |_: &str| -> Result<Box<dyn Export>, String> {
            Ok(Box::new(Failing(err)))
        });
        raw.send(&3u32.to_be_bytes());
        raw.option(wire::OPT_GO, &go_data("", &[]));
        while raw.option_reply().0.kind != wire::REP_ACK {}
        for kind in [
            wire::CMD_READ,
            wire::CMD_WRITE,
            wire::CMD_WRITE_ZEROES,
            wire::CMD_TRIM,
            wire::CMD_FLUSH,
        ] {
            raw.request(kind, 0, 0, 8, 1);
            if kind == wire::CMD_WRITE {
                raw.send(&[0; 8]);
            }
            assert_eq!(
                raw.reply(),
                SimpleReply {
                    error: want,
                    cookie: 1
                },
                "{}",
                wire::command_name(kind)
            );
        }
        assert!(raw.finish().is_ok());
    }
}

/// In-memory duplex: the client's bytes are a fixed script.
struct Script {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for Script {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Script {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Bounded, so a server that loops writing would show up as a failure.
        assert!(self.output.len() < 64 << 20, "server wrote over 64 MiB");
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn random_bytes_after_a_valid_prefix_never_panic() {
    let mut prefix = 1u32.to_be_bytes().to_vec();
    let go = go_data("x", &[wire::INFO_EXPORT]);
    prefix.extend_from_slice(
        &OptionHeader {
            option: wire::OPT_GO,
            length: go.len() as u32,
        }
        .encode(),
    );
    prefix.extend_from_slice(&go);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..3000 {
        let mut script = if round % 3 == 0 {
            1u32.to_be_bytes().to_vec()
        } else {
            prefix.clone()
        };
        for _ in 0..(round % 200) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Mostly small numbers and magic bytes, so headers half-parse.
            let b = match state % 4 {
                0 => 0,
                1 => (state >> 8) as u8,
                2 => [0x25, 0x60, 0x95, 0x13][(state >> 16) as usize % 4],
                _ => b"IHAVEOPT"[(state >> 16) as usize % 8],
            };
            script.push(b);
        }
        let mut open = open_with(round % 2 == 0);
        let s = Script {
            input: Cursor::new(script),
            output: Vec::new(),
        };
        let _ = serve(s, &|| vec!["x".into()], &mut open);
    }
}
