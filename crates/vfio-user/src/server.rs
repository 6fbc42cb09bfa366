//! Device servers: one listening socket per device, one client at a time (the
//! protocol is 1:1). While a client is connected the listener is not watched, so a
//! second client waits in the backlog (its VERSION unanswered) and is served once
//! the first leaves; refusing it would also refuse a client that reconnects while we
//! still drain its old connection's queued messages.
//!
//! Threads: one `vfu-hub` thread per process watches every listener and every
//! *idle* connection. A connection that has a message gets a thread of its own
//! (`vfu-<name>`) that serves it as long as messages keep coming, and hands it back
//! to the hub after `HANDBACK` without one. So an idle VM costs no thread, while an
//! active one never waits behind another tenant's slow message or slow device
//! operation: in `adaptive`/`event` poll modes doorbell messages are on the data
//! path (docs/decisions/0014-nvme-poll-modes.md).

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use guest_mem::DmaSpace;

use crate::conn::{Conn, DmaPolicy, Flow};
use crate::device::{self, Device, PciBackend, PciDeviceSpec};
use crate::irqs::Irqs;
use crate::keep::{KeepHandle, KeptRecords};
use crate::pci::ConfigSpace;
use crate::remote::{DmaMessageCounts, DmaMessageStats};

/// How long a DMA_READ/DMA_WRITE request to the client may wait for its reply
/// (QEMU waits as long for ours).
pub const DEFAULT_DMA_REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// A client that stops mid-message or stops reading replies is disconnected after
/// these, so it cannot wedge the device's thread.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection's thread hands it back to the hub after this long without a
/// message; the next message then costs a thread start (~50 µs).
const HANDBACK: Duration = Duration::from_secs(2);

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub socket: PathBuf,
    /// Mode and group of the socket file (default: owner only).
    pub access: sockfile::SocketAccess,
    /// For logs and the thread name.
    pub name: String,
    /// Bound on each wait for a client's reply to our DMA_READ/DMA_WRITE
    /// ([`DEFAULT_DMA_REPLY_TIMEOUT`]).
    pub dma_reply_timeout: Duration,
    /// Where connections keep their state for a process that may take them over.
    pub keep: Option<KeepHandle>,
    /// A listening socket handed over by an earlier process (bound to `socket`):
    /// used as is instead of binding.
    pub listener: Option<Arc<OwnedFd>>,
    /// Start paused ([`VfioUserServer::resume`] starts serving): a process taking
    /// devices over must not serve before the old one has let go.
    pub start_paused: bool,
}

pub struct VfioUserServer {
    path: PathBuf,
    id: u64,
    active: Arc<Mutex<Option<UnixStream>>>,
    dma_stats: Arc<DmaMessageStats>,
    /// A copy of the listening socket, to hand over.
    listener: UnixListener,
}

impl std::fmt::Debug for VfioUserServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioUserServer")
            .field("path", &self.path)
            .finish()
    }
}

impl VfioUserServer {
    /// The interrupt state for `spec`, to share between the device model and
    /// [`VfioUserServer::start`].
    pub fn irqs_for(spec: &PciDeviceSpec) -> Arc<Irqs> {
        Irqs::new(spec.msix.vectors)
    }

    /// Binds the socket (refusing a path served by a live process, replacing a stale
    /// socket) and hands it to the hub.
    pub fn start(
        cfg: ServerConfig,
        spec: PciDeviceSpec,
        backend: Arc<dyn PciBackend>,
        mem: Arc<DmaSpace>,
        irqs: Arc<Irqs>,
    ) -> io::Result<VfioUserServer> {
        Self::restore(cfg, spec, backend, mem, irqs, KeptRecords::new())
    }

    /// [`VfioUserServer::start`], and takes over the client an earlier process
    /// served, from the records it kept (`cfg.keep`'s prefix removed from their
    /// keys): the client stays connected and the device model is told
    /// ([`PciBackend::restored`]). Without a connection record this is `start`.
    pub fn restore(
        cfg: ServerConfig,
        spec: PciDeviceSpec,
        backend: Arc<dyn PciBackend>,
        mem: Arc<DmaSpace>,
        irqs: Arc<Irqs>,
        mut kept: KeptRecords,
    ) -> io::Result<VfioUserServer> {
        device::validate(&spec, &irqs)?;
        let hub = match hub() {
            Ok(h) => h,
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("vfio-user hub thread: {e}"),
                ))
            }
        };
        let listener = match cfg.listener {
            Some(fd) => UnixListener::from(fd.try_clone()?),
            None => sockfile::bind(&cfg.socket, cfg.access)?,
        };
        listener.set_nonblocking(true)?;
        let listener_copy = listener.try_clone()?;
        let mut dev = Device {
            config: ConfigSpace::new(&spec.ids, spec.bar0.size, &spec.msix),
            spec,
            backend,
            irqs,
            mem,
            log: trace::LogLimiter::new(),
        };
        let active = Arc::new(Mutex::new(None));
        let id = hub.next_id.fetch_add(1, Ordering::Relaxed);
        let dma_stats = Arc::new(DmaMessageStats::default());
        let policy = DmaPolicy {
            reply_timeout: cfg.dma_reply_timeout,
            stats: dma_stats.clone(),
        };
        let keep = cfg.keep.clone();
        let mut state = if cfg.start_paused {
            State::Paused(None)
        } else {
            State::Listening
        };
        if let Some(rec) = kept.get_mut(crate::keep::CONN) {
            let stream = rec.fds.pop().map(UnixStream::from);
            let restored = stream.and_then(|s| {
                let _ = s.set_read_timeout(Some(READ_TIMEOUT));
                let _ = s.set_write_timeout(Some(WRITE_TIMEOUT));
                *lock(&active) = s.try_clone().ok();
                Conn::restore(s, policy.clone(), keep.clone(), &mut dev, kept)
            });
            match restored {
                Some(c) => {
                    tracing::info!("vfio-user {}: took over the connected client", cfg.name);
                    state = if cfg.start_paused {
                        State::Paused(Some(c))
                    } else {
                        State::Idle(c)
                    };
                }
                None => {
                    *lock(&active) = None;
                    if let Some(k) = &keep {
                        k.remove_all();
                    }
                }
            }
        }
        let wake = Arc::new(Wake::new()?);
        let ep = Endpoint {
            pausing: None,
            handback: Arc::new(AtomicBool::new(false)),
            wake,
            keep,
            policy,
            name: cfg.name.clone(),
            listener,
            fault: dev.mem.fault_signal().clone(),
            dev: Arc::new(Mutex::new(dev)),
            active: active.clone(),
            state,
        };
        hub.send(Cmd::Add(id, Box::new(ep)));
        Ok(VfioUserServer {
            path: cfg.socket,
            id,
            active,
            dma_stats,
            listener: listener_copy,
        })
    }

    /// Closes the listener and the connection (the device sees `client_gone`), and
    /// removes the socket file.
    pub fn stop(self) {
        drop(self);
    }

    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// Stops serving the endpoint at a message boundary, keeping the connection:
    /// the client's messages wait in the socket (for a process that takes it over,
    /// or for [`VfioUserServer::resume`]). Waits for a message being handled to
    /// finish. (Whether the device model can move a client whose memory moves by
    /// DMA messages is its own business: QEMU maps its ROMs that way, read-only,
    /// and nobody waits on them.)
    pub fn pause(&self) -> io::Result<()> {
        let hub = hub()?;
        let (tx, rx) = channel();
        hub.send(Cmd::Pause(self.id, tx));
        rx.recv()
            .map_err(|_| io::Error::other("vfio-user hub gone"))?
            .map_err(io::Error::from_raw_os_error)
    }

    /// Serves the endpoint again after [`VfioUserServer::pause`].
    pub fn resume(&self) {
        if let Ok(hub) = hub() {
            hub.send(Cmd::Resume(self.id));
        }
    }

    /// The listening socket (for a process that takes the device over).
    pub fn listener(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }

    /// Lets go of the endpoint without touching the client or the socket file:
    /// another process took them over.
    pub fn abandon(self) {
        if let Ok(hub) = hub() {
            hub.send(Cmd::Abandon(self.id));
        }
        std::mem::forget(self);
    }

    /// Whether a client is connected right now.
    pub fn client_connected(&self) -> bool {
        lock(&self.active).is_some()
    }

    /// DMA_READ/DMA_WRITE traffic to clients that mapped memory without a file
    /// descriptor (all connections so far).
    pub fn dma_messages(&self) -> DmaMessageCounts {
        self.dma_stats.snapshot()
    }
}

impl Drop for VfioUserServer {
    fn drop(&mut self) {
        if let Ok(hub) = hub() {
            let (tx, rx) = channel();
            hub.send(Cmd::Remove(self.id, tx));
            let _ = rx.recv();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

enum State {
    /// Not served until resumed; the connection (if any) waits with its messages.
    Paused(Option<Conn>),
    /// No client: the hub watches the listener.
    Listening,
    /// A client with nothing to say: the hub watches its socket.
    Idle(Conn),
    /// A thread of its own serves the client.
    Served {
        thread: JoinHandle<()>,
        stop: Arc<AtomicBool>,
    },
}

struct Endpoint {
    name: String,
    policy: DmaPolicy,
    keep: Option<KeepHandle>,
    listener: UnixListener,
    /// Used by whichever thread serves the endpoint: the hub, or the connection's
    /// thread while it is `Served`.
    dev: Arc<Mutex<Device>>,
    /// The device's memory fault signal (watched by the hub unless `Served`).
    fault: Arc<guest_mem::FaultSignal>,
    active: Arc<Mutex<Option<UnixStream>>>,
    state: State,
    /// Set while a pause waits for the connection's thread to hand it back.
    pausing: Option<Sender<Result<(), i32>>>,
    /// Tells the connection's thread to hand the connection back now.
    handback: Arc<AtomicBool>,
    /// Wakes the connection's thread (after setting `handback`).
    wake: Arc<Wake>,
}

/// A connection thread's wake-up: one byte on a socket pair.
struct Wake {
    tx: UnixStream,
    rx: UnixStream,
}

impl Wake {
    fn new() -> io::Result<Wake> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(Wake { tx, rx })
    }
    fn ring(&self) {
        let _ = (&self.tx).write(&[1]);
    }
    fn drain(&self) {
        let mut b = [0u8; 16];
        while matches!((&self.rx).read(&mut b), Ok(n) if n > 0) {}
    }
    fn fd(&self) -> BorrowedFd<'_> {
        self.rx.as_fd()
    }
}

enum Cmd {
    Add(u64, Box<Endpoint>),
    Remove(u64, Sender<()>),
    Pause(u64, Sender<Result<(), i32>>),
    Resume(u64),
    /// Forget the endpoint without closing anything of the client's (leaks the
    /// connection's fds on purpose: the process is about to exit).
    Abandon(u64),
    /// A connection's thread finished: the connection back (idle) or `None` (the
    /// client left or was dropped).
    Back(u64, Option<Conn>),
}

struct Hub {
    tx: Mutex<Sender<Cmd>>,
    /// Written to wake the hub's `poll`.
    bell: UnixStream,
    next_id: AtomicU64,
}

impl Hub {
    fn send(&self, cmd: Cmd) {
        let _ = lock(&self.tx).send(cmd);
        let _ = (&self.bell).write(&[1]);
    }
}

static HUB: OnceLock<Hub> = OnceLock::new();
static HUB_START: Mutex<()> = Mutex::new(());

fn hub() -> io::Result<&'static Hub> {
    if let Some(h) = HUB.get() {
        return Ok(h);
    }
    let _one = lock(&HUB_START);
    if let Some(h) = HUB.get() {
        return Ok(h);
    }
    let (bell, bell_rx) = UnixStream::pair()?;
    bell.set_nonblocking(true)?;
    bell_rx.set_nonblocking(true)?;
    let (tx, rx) = channel();
    sandbox::spawn(sandbox::Role::VfuHub, "vfu-hub".into(), move || {
        run_hub(rx, bell_rx)
    })?;
    let _ = HUB.set(Hub {
        tx: Mutex::new(tx),
        bell,
        next_id: AtomicU64::new(1),
    });
    HUB.get()
        .ok_or_else(|| io::Error::other("vfio-user hub missing"))
}

/// What the hub watches for one endpoint.
#[derive(Clone, Copy)]
enum Watch {
    Listener(u64),
    Conn(u64),
    Fault(u64),
}

fn run_hub(rx: Receiver<Cmd>, bell: UnixStream) {
    let mut eps: BTreeMap<u64, Endpoint> = BTreeMap::new();
    loop {
        let mut watch: Vec<Watch> = Vec::with_capacity(eps.len() * 2);
        let ready = {
            let mut fds: Vec<BorrowedFd<'_>> = vec![bell.as_fd()];
            for (id, ep) in &eps {
                match &ep.state {
                    State::Listening => {
                        fds.push(ep.listener.as_fd());
                        watch.push(Watch::Listener(*id));
                    }
                    State::Idle(c) => {
                        fds.push(c.stream.as_fd());
                        watch.push(Watch::Conn(*id));
                        if let Some(b) = c.bell() {
                            fds.push(b);
                            watch.push(Watch::Conn(*id));
                        }
                    }
                    State::Served { .. } | State::Paused(_) => continue,
                }
                // The fault signal belongs to whoever serves the endpoint.
                fds.push(ep.fault.wake_fd());
                watch.push(Watch::Fault(*id));
            }
            match lifecycle::fdpass::poll_in(&fds, -1) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("vfio-user hub: poll failed: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
        };
        if ready[0] {
            let mut buf = [0u8; 64];
            while matches!((&bell).read(&mut buf), Ok(n) if n > 0) {}
            for cmd in rx.try_iter() {
                hub_cmd(&mut eps, cmd);
            }
        }
        for (w, r) in watch.iter().zip(&ready[1..]) {
            if *r {
                hub_event(&mut eps, *w);
            }
        }
    }
}

fn hub_cmd(eps: &mut BTreeMap<u64, Endpoint>, cmd: Cmd) {
    match cmd {
        Cmd::Add(id, ep) => {
            eps.insert(id, *ep);
        }
        Cmd::Remove(id, ack) => {
            let Some(ep) = eps.remove(&id) else {
                let _ = ack.send(());
                return;
            };
            // Stopping a served connection waits for its thread, which may be in a
            // slow device operation: not on the hub, which serves everyone else.
            let stopper = move || {
                let mut ep = ep;
                match std::mem::replace(&mut ep.state, State::Listening) {
                    State::Served { thread, stop } => {
                        stop.store(true, Ordering::Release);
                        if let Some(s) = lock(&ep.active).as_ref() {
                            // Wakes the thread if it is blocked in a read or write.
                            let _ = s.shutdown(std::net::Shutdown::Both);
                        }
                        let _ = thread.join();
                    }
                    State::Idle(c) | State::Paused(Some(c)) => end_client(&ep, Some(c)),
                    State::Listening | State::Paused(None) => {}
                }
                *lock(&ep.active) = None;
                drop(ep);
                let _ = ack.send(());
            };
            if let Err(e) = sandbox::spawn(sandbox::Role::VfuConn, "vfu-stop".into(), stopper) {
                tracing::error!("vfio-user: cannot start a thread to stop a device ({e})");
            }
        }
        Cmd::Back(id, conn) => {
            let Some(ep) = eps.get_mut(&id) else { return };
            if let State::Served { thread, .. } = std::mem::replace(&mut ep.state, State::Listening)
            {
                let _ = thread.join();
            }
            ep.handback.store(false, Ordering::Release);
            ep.wake.drain();
            ep.state = match (conn, ep.pausing.take()) {
                (c, Some(ack)) => {
                    let _ = ack.send(Ok(()));
                    State::Paused(c)
                }
                (Some(c), None) => State::Idle(c),
                (None, None) => State::Listening,
            };
        }
        Cmd::Pause(id, ack) => {
            let Some(ep) = eps.get_mut(&id) else {
                let _ = ack.send(Err(libc::ENOENT));
                return;
            };
            match std::mem::replace(&mut ep.state, State::Listening) {
                State::Served { thread, stop } => {
                    ep.state = State::Served { thread, stop };
                    ep.pausing = Some(ack);
                    ep.handback.store(true, Ordering::Release);
                    ep.wake.ring();
                }
                State::Idle(c) => {
                    ep.state = State::Paused(Some(c));
                    let _ = ack.send(Ok(()));
                }
                State::Listening => {
                    ep.state = State::Paused(None);
                    let _ = ack.send(Ok(()));
                }
                st @ State::Paused(_) => {
                    ep.state = st;
                    let _ = ack.send(Ok(()));
                }
            }
        }
        Cmd::Resume(id) => {
            let Some(ep) = eps.get_mut(&id) else { return };
            if let State::Paused(c) = std::mem::replace(&mut ep.state, State::Listening) {
                ep.state = match c {
                    Some(c) => State::Idle(c),
                    None => State::Listening,
                };
            }
        }
        Cmd::Abandon(id) => {
            if let Some(mut ep) = eps.remove(&id) {
                if let State::Paused(Some(c)) = std::mem::replace(&mut ep.state, State::Listening) {
                    std::mem::forget(c);
                }
                std::mem::forget(ep);
            }
        }
    }
}

fn hub_event(eps: &mut BTreeMap<u64, Endpoint>, w: Watch) {
    match w {
        Watch::Fault(id) => {
            let Some(ep) = eps.get_mut(&id) else { return };
            if matches!(ep.state, State::Served { .. }) {
                return;
            }
            if !ep.fault.take() {
                return;
            }
            trace::limited!(
                lock(&ep.dev).log,
                error,
                "vfio-user {}: the client truncated memory it shared with DMA_MAP \
                 while it was in use; disconnecting it and resetting the device",
                ep.name
            );
            if let State::Idle(c) = std::mem::replace(&mut ep.state, State::Listening) {
                end_client(ep, Some(c));
            }
            lock(&ep.dev).reset();
        }
        Watch::Listener(id) => {
            let Some(ep) = eps.get_mut(&id) else { return };
            match ep.listener.accept() {
                Ok((s, _)) => {
                    let _ = s.set_read_timeout(Some(READ_TIMEOUT));
                    let _ = s.set_write_timeout(Some(WRITE_TIMEOUT));
                    *lock(&ep.active) = s.try_clone().ok();
                    trace::limited!(
                        lock(&ep.dev).log,
                        info,
                        "vfio-user {}: client connected",
                        ep.name
                    );
                    serve(id, ep, Conn::new(s, ep.policy.clone(), ep.keep.clone()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    trace::limited!(
                        lock(&ep.dev).log,
                        warn,
                        "vfio-user {}: accept failed: {e}",
                        ep.name
                    );
                }
            }
        }
        Watch::Conn(id) => {
            let Some(ep) = eps.get_mut(&id) else { return };
            if let State::Idle(c) = std::mem::replace(&mut ep.state, State::Listening) {
                serve(id, ep, c);
            }
        }
    }
}

/// Gives the connection a thread of its own until it goes idle or away.
fn serve(id: u64, ep: &mut Endpoint, conn: Conn) {
    let stop = Arc::new(AtomicBool::new(false));
    let (dev, active, name, st) = (
        ep.dev.clone(),
        ep.active.clone(),
        ep.name.clone(),
        stop.clone(),
    );
    let (handback, wake) = (ep.handback.clone(), ep.wake.clone());
    let spawned = sandbox::spawn(
        sandbox::Role::VfuConn,
        format!("vfu-{}", ep.name),
        move || {
            let back = serve_conn(&name, conn, &dev, &active, &st, &handback, &wake);
            if let Ok(h) = hub() {
                h.send(Cmd::Back(id, back));
            }
        },
    );
    ep.state = match spawned {
        Ok(thread) => State::Served { thread, stop },
        Err(e) => {
            // The connection went with the closure: the client is dropped.
            trace::limited!(
                lock(&ep.dev).log,
                error,
                "vfio-user {}: cannot start a thread for the client ({e}); disconnecting it",
                ep.name
            );
            lock(&ep.dev).client_gone();
            *lock(&ep.active) = None;
            State::Listening
        }
    };
}

/// Serves one connection: messages as they come, the client's memory faults. Returns
/// the connection when it stayed quiet for `HANDBACK`, `None` once the client is gone.
fn serve_conn(
    name: &str,
    mut conn: Conn,
    dev: &Mutex<Device>,
    active: &Mutex<Option<UnixStream>>,
    stop: &AtomicBool,
    handback: &AtomicBool,
    wake: &Wake,
) -> Option<Conn> {
    let mut dev = lock(dev);
    let wait = i32::try_from(HANDBACK.as_millis()).unwrap_or(i32::MAX);
    loop {
        if stop.load(Ordering::Acquire) {
            break;
        }
        if handback.load(Ordering::Acquire) {
            return Some(conn);
        }
        let ready = {
            let fault = dev.mem.fault_signal().wake_fd();
            // The hub's wake-up is polled but not a message: it shows as ready[1]
            // or [2] only through `handback`, checked above on the next turn.
            let mut fds = [conn.stream.as_fd(), fault, wake.fd(), wake.fd()];
            // Requests a DMA transfer read for us while it waited for its reply.
            let n = match conn.bell() {
                Some(b) => {
                    fds[3] = b;
                    4
                }
                None => 3,
            };
            match lifecycle::fdpass::poll_in(&fds[..n], wait) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("vfio-user {name}: poll failed: {e}");
                    break;
                }
            }
        };
        if ready[1] && dev.mem.fault_signal().take() {
            trace::limited!(
                dev.log,
                error,
                "vfio-user {name}: the client truncated memory it shared with DMA_MAP \
                 while it was in use; disconnecting it and resetting the device"
            );
            finish(&mut dev, conn, active);
            dev.reset();
            return None;
        }
        if ready[2] {
            continue;
        }
        let bell = ready.get(3).copied().unwrap_or(false);
        if !ready[0] && !bell {
            if ready.iter().all(|r| !r) {
                return Some(conn);
            }
            continue;
        }
        if let Flow::Disconnect = conn.handle_next(&mut dev) {
            trace::limited!(dev.log, info, "vfio-user {name}: client disconnected");
            break;
        }
    }
    finish(&mut dev, conn, active);
    None
}

fn finish(dev: &mut Device, conn: Conn, active: &Mutex<Option<UnixStream>>) {
    let negotiated = conn.negotiated();
    // Transfers waiting for the client give up before the device is reset.
    conn.close();
    conn.forget_kept();
    drop(conn);
    *lock(active) = None;
    if negotiated {
        dev.client_gone();
    }
}

fn end_client(ep: &Endpoint, conn: Option<Conn>) {
    if let Some(c) = conn {
        finish(&mut lock(&ep.dev), c, &ep.active);
    }
}
