//! udrive's NBD server (docs/rpc.md `nbd_server_*`,
//! docs/decisions/0045-mirror-to-another-host.md): exports the disks of
//! running devices over NBD, as QEMU's `nbd-server-start`/`nbd-server-add`
//! do. Its use: the destination of a live migration without shared storage
//! receives the disk the source's `blockdev_mirror` writes into it, while its
//! own device waits for the VM; backup and inspection tools (`qemu-img`,
//! `nbdcopy`) read a running disk.
//!
//! Who owns what: one listening thread accepts connections (at most
//! [`MAX_CONNECTIONS`] at once); each connection runs on a thread of its own
//! with its own channel on the disk (its own ring), one request at a time,
//! off the reactors. The export list is shared with the connections, which
//! look their export up by name at the handshake. Removing an export or
//! stopping the server shuts the sockets of the connections it ends down.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bdev::{Armed, BlockDevice, IoChannel, IoOp, IoRequest, IoStatus, QosDisk};
use guest_mem::MappedRegion;

/// Connections served at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 16;

/// One exported disk.
#[derive(Clone)]
struct Entry {
    name: String,
    socket: PathBuf,
    nsid: Option<u32>,
    writable: bool,
    disk: Arc<QosDisk>,
}

/// A live connection: its export and a handle to shut its socket down.
struct Conn {
    export: Option<String>,
    stream: Stream,
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

#[derive(Default)]
struct Shared {
    exports: Vec<Entry>,
    conns: Vec<(u64, Conn)>,
    next_conn: u64,
}

/// The running server.
pub struct NbdServer {
    /// Where it listens, as `nbd_server_start` reports it.
    pub listen: String,
    unix_path: Option<PathBuf>,
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    wake: Listener,
    thread: Option<JoinHandle<()>>,
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

fn lock(s: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

impl NbdServer {
    /// Listens on `listen`: `unix:PATH` or `HOST:PORT` (port 0: any free one).
    pub fn start(listen: &str) -> Result<NbdServer> {
        let (listener, shown, unix_path) = match listen.strip_prefix("unix:") {
            Some(path) => {
                // Owner only, like the device and control sockets: whoever
                // connects may write the exported disks.
                let path = PathBuf::from(path);
                crate::fs_access::check_socket(&path)?;
                let l = sockfile::bind(&path, sockfile::SocketAccess::default())
                    .with_context(|| format!("cannot listen on {}", path.display()))?;
                (Listener::Unix(l), listen.to_string(), Some(path))
            }
            None => {
                let l = TcpListener::bind(listen).with_context(|| {
                    format!("cannot listen on {listen:?} (`HOST:PORT`, or `unix:PATH`)")
                })?;
                let shown = l.local_addr()?.to_string();
                (Listener::Tcp(l), shown, None)
            }
        };
        let wake = match &listener {
            Listener::Unix(l) => Listener::Unix(l.try_clone()?),
            Listener::Tcp(l) => Listener::Tcp(l.try_clone()?),
        };
        let shared = Arc::new(Mutex::new(Shared::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s2, stop2) = (shared.clone(), stop.clone());
        let thread = sandbox::spawn(sandbox::Role::Control, "nbd-accept".into(), move || {
            accept_loop(listener, &s2, &stop2)
        })?;
        tracing::info!(listen = %shown, "NBD server started");
        Ok(NbdServer {
            listen: shown,
            unix_path,
            shared,
            stop,
            wake,
            thread: Some(thread),
        })
    }

    /// Exports the disk `nsid` of the device on `socket` as `name`.
    pub fn add(
        &self,
        name: &str,
        socket: &Path,
        nsid: Option<u32>,
        writable: bool,
        disk: Arc<QosDisk>,
    ) -> Result<()> {
        if name.len() > 4096 {
            bail!("an NBD export name is at most 4096 bytes");
        }
        let mut s = lock(&self.shared);
        if s.exports.iter().any(|e| e.name == name) {
            bail!("an export named {name:?} exists already (nbd_server_remove it first)");
        }
        if writable && disk.info().read_only {
            bail!(
                "{} is read-only: export it without `writable`",
                disk.describe()
            );
        }
        s.exports.push(Entry {
            name: name.to_string(),
            socket: socket.to_path_buf(),
            nsid,
            writable,
            disk,
        });
        tracing::info!(name, socket = %socket.display(), writable, "NBD export added");
        Ok(())
    }

    /// Removes export `name` and ends the connections that use it.
    pub fn remove(&self, name: &str) -> Result<()> {
        if self.drop_exports(|e| e.name == name) == 0 {
            bail!("no NBD export named {name:?}");
        }
        Ok(())
    }

    /// Removes the exports `gone` picks and ends the connections that use
    /// them; how many it removed.
    fn drop_exports(&self, gone: impl Fn(&Entry) -> bool) -> usize {
        let mut s = lock(&self.shared);
        let (dropped, kept): (Vec<Entry>, Vec<Entry>) = s.exports.drain(..).partition(|e| gone(e));
        s.exports = kept;
        for (_, c) in &s.conns {
            if dropped.iter().any(|e| c.export.as_deref() == Some(&e.name)) {
                c.stream.shutdown();
            }
        }
        dropped.len()
    }

    /// The exports, as `nbd_server_start` and `get_nbd_exports` show them.
    pub fn json(&self) -> serde_json::Value {
        let s = lock(&self.shared);
        let exports: Vec<_> = s
            .exports
            .iter()
            .map(|e| {
                serde_json::json!({
                    "name": e.name,
                    "socket": e.socket,
                    "nsid": e.nsid,
                    "writable": e.writable,
                    "connections": s.conns.iter().filter(|(_, c)| c.export.as_deref() == Some(&e.name)).count(),
                })
            })
            .collect();
        serde_json::json!({"listen": self.listen, "exports": exports})
    }

    /// Stops exporting the disks of the device whose socket `is_device`
    /// names (it goes away).
    pub fn forget_device(&self, is_device: &dyn Fn(&Path) -> bool) {
        self.drop_exports(|e| is_device(&e.socket));
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accepting thread: a listening socket shut down fails
        // its `accept`.
        let fd = match &self.wake {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        };
        let _ = nix::sys::socket::shutdown(fd, nix::sys::socket::Shutdown::Both);
        for (_, c) in &lock(&self.shared).conns {
            c.stream.shutdown();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = &self.unix_path {
            let _ = std::fs::remove_file(p);
        }
        tracing::info!(listen = %self.listen, "NBD server stopped");
    }
}

fn accept_loop(listener: Listener, shared: &Arc<Mutex<Shared>>, stop: &AtomicBool) {
    loop {
        let accepted = match &listener {
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| Stream::Tcp(s)),
        };
        if stop.load(Ordering::Acquire) {
            return;
        }
        let stream = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("NBD server: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if let Err(e) = start_conn(stream, shared) {
            tracing::warn!("NBD server: connection not served: {e:#}");
        }
    }
}

fn start_conn(stream: Stream, shared: &Arc<Mutex<Shared>>) -> Result<()> {
    let mut s = lock(shared);
    if s.conns.len() >= MAX_CONNECTIONS {
        stream.shutdown();
        bail!("{MAX_CONNECTIONS} connections already");
    }
    let handle = match &stream {
        Stream::Unix(u) => Stream::Unix(u.try_clone()?),
        Stream::Tcp(t) => {
            t.set_nodelay(true)?;
            Stream::Tcp(t.try_clone()?)
        }
    };
    s.next_conn += 1;
    let id = s.next_conn;
    s.conns.push((
        id,
        Conn {
            export: None,
            stream: handle,
        },
    ));
    drop(s);
    let theirs = shared.clone();
    let spawned = sandbox::spawn(
        sandbox::Role::Control,
        format!("nbd-conn-{id}"),
        move || {
            let r = match stream {
                Stream::Unix(u) => serve_conn(u, id, &theirs),
                Stream::Tcp(t) => serve_conn(t, id, &theirs),
            };
            if let Err(e) = r {
                tracing::info!(conn = id, "NBD connection ended: {e}");
            }
            lock(&theirs).conns.retain(|(c, _)| *c != id);
        },
    );
    if let Err(e) = spawned {
        lock(shared).conns.retain(|(c, _)| *c != id);
        return Err(e.into());
    }
    Ok(())
}

fn serve_conn<S: io::Read + io::Write>(
    stream: S,
    id: u64,
    shared: &Arc<Mutex<Shared>>,
) -> io::Result<()> {
    let names = || {
        lock(shared)
            .exports
            .iter()
            .map(|e| e.name.clone())
            .collect()
    };
    let mut open = |name: &str| -> Result<Box<dyn nbd::Export>, String> {
        let mut s = lock(shared);
        let Some(e) = s.exports.iter().find(|e| e.name == name).cloned() else {
            return Err(format!("no export named {name:?}"));
        };
        if let Some((_, c)) = s.conns.iter_mut().find(|(c, _)| *c == id) {
            c.export = Some(e.name.clone());
        }
        drop(s);
        DiskExport::new(e.disk, e.writable)
            .map(|d| Box::new(d) as Box<dyn nbd::Export>)
            .map_err(|e| format!("cannot open the disk: {e}"))
    };
    nbd::serve(stream, &names, &mut open)
}

/// An exported disk as one connection drives it: its own channel, one
/// request at a time, through a buffer of at most [`nbd::MAX_PAYLOAD`]
/// bytes mapped once (pages are touched only as requests need them).
struct DiskExport {
    // Dropped before `buf`: the channel may still point into it.
    chan: Box<dyn IoChannel>,
    buf: MappedRegion,
    disk: Arc<QosDisk>,
    writable: bool,
}

impl DiskExport {
    fn new(disk: Arc<QosDisk>, writable: bool) -> io::Result<DiskExport> {
        Ok(DiskExport {
            chan: disk.channel()?,
            buf: MappedRegion::anonymous(0, u64::from(nbd::MAX_PAYLOAD))?,
            disk,
            writable,
        })
    }

    /// Runs one request to its end (`fua`: durable when it completes).
    fn run(&mut self, op: IoOp, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let bs = u64::from(self.disk.info().block_size);
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let data = matches!(op, IoOp::Read | IoOp::Write);
        let slice = if data {
            Some(
                self.buf
                    .slice(0, len as usize)
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?,
            )
        } else {
            None
        };
        let req = IoRequest {
            op,
            offset,
            len,
            iov: slice.as_slice(),
            fua,
        };
        let status = match self.chan.submit(0, &req) {
            Some(st) => st,
            None => {
                self.chan.flush();
                wait(&mut *self.chan)
            }
        };
        let errno = match status {
            IoStatus::Ok => return Ok(()),
            IoStatus::OutOfRange | IoStatus::Invalid => libc::EINVAL,
            IoStatus::ReadOnly => libc::EPERM,
            IoStatus::NoSpace => libc::ENOSPC,
            IoStatus::Unsupported => libc::EOPNOTSUPP,
            IoStatus::IoError | IoStatus::ReadError => libc::EIO,
        };
        Err(io::Error::from_raw_os_error(errno))
    }

    /// Zeroes or trims in pieces the backends take at once.
    fn ranges(&mut self, op: IoOp, mut offset: u64, len: u64) -> io::Result<()> {
        const PIECE: u64 = 1 << 30;
        let end = offset + len;
        while offset < end {
            let n = (end - offset).min(PIECE);
            self.run(op, offset, n, false)?;
            offset += n;
        }
        Ok(())
    }
}

/// Waits for the one request in flight on `chan`.
fn wait(chan: &mut dyn IoChannel) -> IoStatus {
    let mut got = None;
    loop {
        chan.poll(&mut |_, st| got = Some(st));
        if let Some(st) = got {
            return st;
        }
        match chan.arm_notifier() {
            Armed::Ready => {}
            Armed::Fd => {
                if let Some(fd) = chan.notifier() {
                    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
                    let _ = poll(
                        &mut [PollFd::new(fd, PollFlags::POLLIN)],
                        PollTimeout::from(100u16),
                    );
                }
            }
            // Held back by the disk's QoS limits: until they let it go.
            _ => {
                let now = std::time::Instant::now();
                let until = chan.wake_by().unwrap_or(now + Duration::from_micros(50));
                std::thread::sleep(
                    until
                        .saturating_duration_since(now)
                        .min(Duration::from_millis(100)),
                );
            }
        }
    }
}

impl nbd::Export for DiskExport {
    fn size(&self) -> u64 {
        self.disk.info().size_bytes()
    }
    fn read_only(&self) -> bool {
        !self.writable
    }
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.run(IoOp::Read, offset, buf.len() as u64, false)?;
        self.buf
            .slice(0, buf.len())
            .and_then(|s| s.read_into(0, buf).ok())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.buf
            .slice(0, data.len())
            .and_then(|s| s.write_from(0, data).ok())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        self.run(IoOp::Write, offset, data.len() as u64, fua)
    }
    fn write_zeroes(&mut self, offset: u64, len: u64, _may_trim: bool) -> io::Result<()> {
        self.ranges(IoOp::WriteZeroes, offset, len)
    }
    fn trim(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.ranges(IoOp::Discard, offset, len)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.run(IoOp::Flush, 0, 0, false)
    }
    fn min_block(&self) -> u32 {
        self.disk.info().block_size
    }
}
