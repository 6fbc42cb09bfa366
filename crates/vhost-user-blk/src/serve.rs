//! The serve thread of a device: accepts one front end at a time and runs its
//! connection loop — wait for a whole message (bounded), let vhost's
//! `BackendReqHandler` parse it and call our [`Handler`], repeat.
//!
//! Between two messages the loop looks at the device's commands ([`ServeCtl`]):
//! stop, hold (a pause: park at the message boundary, reading nothing, so the
//! handler's state can be saved), or release (the front end now belongs to another
//! device: end without touching its socket).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{FrontendReq, VhostUserProtocolFeatures, MAX_MSG_SIZE};
use vhost::vhost_user::BackendReqHandler;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::conn::{lock, Conn, Shared};
use crate::error::{Error, Result};
use crate::handler::{is_refusal, Handler};

/// How long a disconnect waits for in-flight requests before letting a new front
/// end in.
const DISCONNECT_DRAIN: Duration = Duration::from_secs(30);

pub(crate) type ReqHandler = BackendReqHandler<Mutex<Handler>>;

/// A front end's connection, set up: our handler and the library's around it.
pub(crate) struct Established {
    pub conn: Arc<Conn>,
    pub handler: Arc<Mutex<Handler>>,
    pub req: ReqHandler,
}

impl Established {
    pub fn new(shared: &Arc<Shared>, front: UnixStream) -> io::Result<Established> {
        let conn = Arc::new(Conn::new(
            shared.log.clone(),
            front.try_clone()?,
            shared.queues.len(),
            shared.cfg.opts.queue_size,
        )?);
        // A front end that does not read our replies must not hold the thread.
        front.set_write_timeout(Some(sockfile::message_deadline()))?;
        let handler = Arc::new(Mutex::new(Handler::new(shared.clone(), conn.clone())));
        let req = BackendReqHandler::from_stream(front, handler.clone());
        Ok(Established { conn, handler, req })
    }
}

/// Connections accepted and connections ended (after their requests finished).
#[derive(Default)]
pub(crate) struct ConnCounts {
    pub started: AtomicU64,
    pub ended: AtomicU64,
}

/// What the serve thread is doing.
#[derive(Clone)]
pub(crate) enum Phase {
    /// Waiting for a front end.
    Accepting,
    /// Held (paused) with no front end: accepting nobody.
    Held,
    /// Serving this front end.
    Serving,
    /// Held between two messages of this front end: reading nothing.
    Parked(Arc<Conn>, Arc<Mutex<Handler>>),
    /// Stopped.
    Done,
}

pub(crate) struct ServeSt {
    pub stop: bool,
    pub hold: bool,
    /// Leave the connected front end alone (it is another device's now).
    pub release: bool,
    pub phase: Phase,
}

/// The device's handle on its serve thread.
pub(crate) struct ServeCtl {
    /// Wakes the serve thread out of a wait for a front end or a message.
    pub evt: EventFd,
    st: Mutex<ServeSt>,
    cv: Condvar,
}

impl ServeCtl {
    pub fn new(hold: bool) -> io::Result<ServeCtl> {
        Ok(ServeCtl {
            evt: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?,
            st: Mutex::new(ServeSt {
                stop: false,
                hold,
                release: false,
                phase: Phase::Accepting,
            }),
            cv: Condvar::new(),
        })
    }

    fn update(&self, f: impl FnOnce(&mut ServeSt)) {
        f(&mut lock(&self.st));
        self.cv.notify_all();
        let _ = self.evt.write(1);
    }

    pub fn hold(&self, on: bool) {
        self.update(|st| st.hold = on);
    }

    pub fn stop(&self, release: bool) {
        self.update(|st| {
            st.stop = true;
            st.release |= release;
        });
    }

    fn set_phase(&self, p: Phase) {
        lock(&self.st).phase = p;
        self.cv.notify_all();
    }

    pub fn phase(&self) -> Phase {
        lock(&self.st).phase.clone()
    }

    /// Waits (until `deadline`) for the serve thread to settle in a hold: no
    /// front end, or parked between two of its messages.
    pub fn wait_held(&self, deadline: Instant) -> Result<Phase> {
        let mut st = lock(&self.st);
        loop {
            match &st.phase {
                Phase::Held | Phase::Parked(..) => return Ok(st.phase.clone()),
                Phase::Done => return Err(Error::Stopped),
                _ => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::ParkTimeout);
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Before accepting: waits while held; `false` once stopping.
    fn may_accept(&self) -> bool {
        let mut st = lock(&self.st);
        loop {
            if st.stop {
                return false;
            }
            if !st.hold {
                st.phase = Phase::Accepting;
                self.cv.notify_all();
                return true;
            }
            if !matches!(st.phase, Phase::Held) {
                st.phase = Phase::Held;
                self.cv.notify_all();
            }
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn may_accept_now(&self) -> bool {
        let st = lock(&self.st);
        !st.stop && !st.hold
    }

    /// At a message boundary: parks while held; returns whether to go on
    /// reading (`Some(false)`: stop, `None`: released).
    fn at_boundary(&self, est: &Established) -> Option<bool> {
        let mut st: MutexGuard<'_, ServeSt> = lock(&self.st);
        if st.hold && !st.stop {
            st.phase = Phase::Parked(est.conn.clone(), est.handler.clone());
            self.cv.notify_all();
            while st.hold && !st.stop {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.phase = Phase::Serving;
            self.cv.notify_all();
        }
        if st.release {
            return None;
        }
        Some(!st.stop)
    }
}

/// How a connection ended.
enum End {
    /// The front end went, or was sent away: shut its socket down.
    Closed,
    /// Released to another device: its socket stays as it is.
    Released,
}

/// Waits for the next front-end message (or a command) and has it handled.
fn connection_loop(est: &mut Established, ctl: &ServeCtl) -> End {
    const FRONT: u64 = 0;
    const CTL: u64 = 1;
    let ep = match Epoll::new().and_then(|ep| {
        ep.ctl(
            ControlOperation::Add,
            est.conn.front.as_raw_fd(),
            EpollEvent::new(EventSet::IN | EventSet::READ_HANG_UP, FRONT),
        )?;
        ep.ctl(
            ControlOperation::Add,
            ctl.evt.as_raw_fd(),
            EpollEvent::new(EventSet::IN, CTL),
        )?;
        Ok(ep)
    }) {
        Ok(ep) => ep,
        Err(e) => {
            crate::fd_limit::report("an epoll set for a vhost-user connection", &e);
            return End::Closed;
        }
    };
    let mut events = [EpollEvent::default(); 2];
    loop {
        match ctl.at_boundary(est) {
            None => return End::Released,
            Some(false) => return End::Closed,
            Some(true) => {}
        }
        let n = match ep.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return End::Closed,
        };
        let mut front_ready = false;
        for ev in &events[..n] {
            if ev.data() == CTL {
                let _ = ctl.evt.read();
            } else {
                front_ready = true;
            }
        }
        if front_ready && !one_message(est) {
            return End::Closed;
        }
    }
}

/// Handles the message waiting on the socket; `false` ends the connection.
fn one_message(est: &mut Established) -> bool {
    let log = &est.conn.log;
    let hdr = match crate::channel::wait_whole(&est.conn.front, sockfile::message_deadline()) {
        Ok(h) => h,
        Err(e) => {
            trace::limited!(log, info, error = %e, "vhost-user front end connection ended");
            return false;
        }
    };
    if let Some(h) = &hdr {
        // (One announcing more than a message carries is left to the library,
        // which refuses it: its body is not queued whole.)
        if h.code() == Some(FrontendReq::SET_BACKEND_REQ_FD) && h.size() <= MAX_MSG_SIZE {
            return crate::channel::take_backend_req(&est.conn.front, h, &est.conn)
                .inspect_err(|e| trace::limited!(log, info, error = %e, "vhost-user front end connection ended"))
                .is_ok();
        }
    }
    // The library answers a refusal when the front end asked and REPLY_ACK was
    // negotiated.
    let acks =
        VhostUserProtocolFeatures::from_bits_truncate(est.conn.protocol.load(Ordering::Acquire))
            .contains(VhostUserProtocolFeatures::REPLY_ACK);
    match est.req.handle_request() {
        Ok(()) => true,
        // Refused, and the front end was told: it may go on.
        Err(e) if is_refusal(&e) && acks && hdr.is_some_and(|h| h.need_reply()) => true,
        Err(vhost::vhost_user::Error::Disconnected) => false,
        Err(e) => {
            trace::limited!(log, info, error = %e, "vhost-user front end connection ended");
            false
        }
    }
}

/// Waits for a front end on `listener` (while the device is neither held nor
/// stopping) and sets up its connection.
fn accept(
    listener: &UnixListener,
    ep: &Epoll,
    shared: &Arc<Shared>,
    ctl: &ServeCtl,
    socket: &Path,
) -> Option<Established> {
    if !ctl.may_accept() {
        return None;
    }
    let mut events = [EpollEvent::default(); 2];
    match ep.wait(-1, &mut events) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return None,
        Err(e) => {
            tracing::error!(socket = %socket.display(), error = %e, "cannot wait for vhost-user connections");
            std::thread::sleep(Duration::from_millis(100));
            return None;
        }
    }
    let _ = ctl.evt.read();
    // Held or stopped meanwhile: leave the front end waiting in the backlog (for
    // the device a handover hands the socket to).
    if !ctl.may_accept_now() {
        return None;
    }
    let front = match listener.accept() {
        Ok((s, _)) => s,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::Interrupted
            ) =>
        {
            return None
        }
        Err(e) => {
            crate::fd_limit::report(&format!("a connection on {}", socket.display()), &e);
            std::thread::sleep(Duration::from_millis(100));
            return None;
        }
    };
    match Established::new(shared, front) {
        Ok(e) => Some(e),
        Err(e) => {
            crate::fd_limit::report("a vhost-user connection", &e);
            None
        }
    }
}

fn listen_set(listener: &UnixListener, ctl: &ServeCtl) -> io::Result<Epoll> {
    let ep = Epoll::new()?;
    ep.ctl(
        ControlOperation::Add,
        listener.as_raw_fd(),
        EpollEvent::new(EventSet::IN, 0),
    )?;
    ep.ctl(
        ControlOperation::Add,
        ctl.evt.as_raw_fd(),
        EpollEvent::new(EventSet::IN, 1),
    )?;
    Ok(ep)
}

/// What the serve thread needs.
pub(crate) struct ServeArgs {
    pub listener: UnixListener,
    pub shared: Arc<Shared>,
    pub ctl: Arc<ServeCtl>,
    pub count: Arc<ConnCounts>,
    pub socket: std::path::PathBuf,
    /// A connection handed over from another device.
    pub first: Option<Established>,
}

/// Serves one front end at a time, each with a fresh handler.
pub(crate) fn serve(a: ServeArgs) {
    let ServeArgs {
        listener,
        shared,
        ctl,
        count,
        socket,
        mut first,
    } = a;
    let ep = match listen_set(&listener, &ctl) {
        Ok(ep) => ep,
        Err(e) => {
            tracing::error!(socket = %socket.display(), error = %e, "cannot wait for vhost-user connections");
            ctl.set_phase(Phase::Done);
            return;
        }
    };
    loop {
        let taken_over = first.is_some();
        let est = match first.take() {
            Some(e) => e,
            None => {
                if lock(&ctl.st).stop {
                    break;
                }
                match accept(&listener, &ep, &shared, &ctl, &socket) {
                    Some(e) => e,
                    None => continue,
                }
            }
        };
        run_connection(est, &shared, &ctl, &count, &socket, taken_over);
    }
    ctl.set_phase(Phase::Done);
}

fn run_connection(
    mut est: Established,
    shared: &Arc<Shared>,
    ctl: &ServeCtl,
    count: &ConnCounts,
    socket: &Path,
    taken_over: bool,
) {
    let kicks = match est.conn.spawn_kicks(shared.clone()) {
        Ok(t) => t,
        Err(e) => {
            crate::fd_limit::report("a vhost-user kick thread", &e);
            if !taken_over {
                est.conn.disconnect();
            }
            return;
        }
    };
    *lock(&shared.front) = Some(est.conn.clone());
    for q in &shared.queues {
        q.attach(Some(est.conn.clone()));
    }
    ctl.set_phase(Phase::Serving);
    count.started.fetch_add(1, Ordering::Relaxed);
    if taken_over {
        trace::limited!(shared.log, info, socket = %socket.display(), "vhost-user front end taken over (still connected)");
    } else {
        trace::limited!(shared.log, info, socket = %socket.display(), "vhost-user front end connected");
    }
    let end = connection_loop(&mut est, ctl);
    if matches!(end, End::Released) {
        est.conn.frozen.store(true, Ordering::Release);
    }
    est.conn.disconnect();
    est.conn.kicks.stop();
    let _ = kicks.join();
    *lock(&shared.front) = None;
    // Requests taken from this connection's rings finish (their memory stays
    // mapped while they do) before the pollers let go of the vrings.
    for q in &shared.queues {
        q.attach(None);
    }
    // A poll that began before the detach may be taking chains right now, its
    // count of requests in flight not yet stored. It holds its vring's lock
    // throughout: once each lock has been taken here, that count is current, and
    // every later poll sees the detach and takes nothing new.
    for vring in &est.conn.vrings {
        drop(lock(vring));
    }
    for q in &shared.queues {
        q.drain(DISCONNECT_DRAIN);
    }
    count.ended.fetch_add(1, Ordering::Relaxed);
    if matches!(end, End::Closed) {
        trace::limited!(shared.log, info, socket = %socket.display(), "vhost-user front end disconnected");
    }
    ctl.set_phase(Phase::Accepting);
}
