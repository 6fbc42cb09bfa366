//! The per-device server: one listening socket and one thread that multiplexes the
//! listener, the active connection and a stop signal with `poll`. One client at a
//! time (the protocol is 1:1): while a client is connected the listener is not
//! polled, so a second client waits in the backlog (its VERSION unanswered) and is
//! served once the first leaves. Refusing it instead would also refuse a client that
//! reconnects while we still drain its old connection's queued messages.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use guest_mem::DmaSpace;

use crate::conn::{Conn, Flow};
use crate::device::{self, Device, PciBackend, PciDeviceSpec};
use crate::irqs::Irqs;
use crate::pci::ConfigSpace;

/// A client that stops mid-message or stops reading replies is disconnected after
/// these, so it cannot wedge the device's thread.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub socket: PathBuf,
    /// Mode and group of the socket file (default: owner only).
    pub access: sockfile::SocketAccess,
    /// For logs and the thread name.
    pub name: String,
}

pub struct VfioUserServer {
    path: PathBuf,
    stop_tx: Option<UnixStream>,
    active: Arc<Mutex<Option<UnixStream>>>,
    thread: Option<JoinHandle<()>>,
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
    /// socket) and starts the device's thread.
    pub fn start(
        cfg: ServerConfig,
        spec: PciDeviceSpec,
        backend: Arc<dyn PciBackend>,
        mem: Arc<DmaSpace>,
        irqs: Arc<Irqs>,
    ) -> io::Result<VfioUserServer> {
        device::validate(&spec, &irqs)?;
        let listener = sockfile::bind(&cfg.socket, cfg.access)?;
        listener.set_nonblocking(true)?;
        let (stop_tx, stop_rx) = UnixStream::pair()?;
        let dev = Device {
            config: ConfigSpace::new(&spec.ids, spec.bar0.size, &spec.msix),
            spec,
            backend,
            irqs,
            mem,
            log: trace::LogLimiter::new(),
        };
        let active = Arc::new(Mutex::new(None));
        let act = active.clone();
        let name = cfg.name.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vfu-{}", cfg.name))
            .spawn(move || run(name, listener, stop_rx, dev, act));
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                let _ = std::fs::remove_file(&cfg.socket);
                return Err(e);
            }
        };
        Ok(VfioUserServer {
            path: cfg.socket,
            stop_tx: Some(stop_tx),
            active,
            thread: Some(thread),
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

    /// Whether a client is connected right now.
    pub fn client_connected(&self) -> bool {
        self.active
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

impl Drop for VfioUserServer {
    fn drop(&mut self) {
        // Closing our end makes the thread's stop socket readable (EOF).
        drop(self.stop_tx.take());
        if let Some(s) = self
            .active
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            // Wakes the thread if it is blocked inside a read or write.
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn run(
    name: String,
    listener: UnixListener,
    stop_rx: UnixStream,
    mut dev: Device,
    active: Arc<Mutex<Option<UnixStream>>>,
) {
    let mut conn: Option<Conn> = None;
    let set_active = |s: Option<UnixStream>| {
        *active.lock().unwrap_or_else(|e| e.into_inner()) = s;
    };
    loop {
        let ready = {
            let second = match &conn {
                Some(c) => c.stream.as_fd(),
                None => listener.as_fd(),
            };
            let fds = [stop_rx.as_fd(), second, dev.mem.fault_signal().wake_fd()];
            match crate::sock::poll_in(&fds, -1) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("vfio-user {name}: poll failed: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
        };
        if ready[0] {
            break;
        }
        if ready[2] && dev.mem.fault_signal().take() {
            // The client shrank a file it had mapped to us; its pages now read as
            // zeroes. Its session cannot continue: drop it and reset the device for
            // the next client.
            trace::limited!(
                dev.log,
                error,
                "vfio-user {name}: the client truncated memory it shared with DMA_MAP \
                 while it was in use; disconnecting it and resetting the device"
            );
            if conn.is_some() {
                end_client(&mut dev, conn.take());
                set_active(None);
            }
            dev.reset();
            continue;
        }
        if !ready[1] {
            continue;
        }
        if let Some(c) = conn.as_mut() {
            if let Flow::Disconnect = c.handle_next(&mut dev) {
                trace::limited!(dev.log, info, "vfio-user {name}: client disconnected");
                end_client(&mut dev, conn.take());
                set_active(None);
            }
        } else {
            match listener.accept() {
                Ok((s, _)) => {
                    let _ = s.set_read_timeout(Some(READ_TIMEOUT));
                    let _ = s.set_write_timeout(Some(WRITE_TIMEOUT));
                    set_active(s.try_clone().ok());
                    trace::limited!(dev.log, info, "vfio-user {name}: client connected");
                    conn = Some(Conn::new(s));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    trace::limited!(dev.log, warn, "vfio-user {name}: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
    end_client(&mut dev, conn.take());
    set_active(None);
}

fn end_client(dev: &mut Device, conn: Option<Conn>) {
    // A client that never negotiated cannot have touched the device.
    if let Some(c) = conn {
        let negotiated = c.negotiated();
        drop(c);
        if negotiated {
            dev.client_gone();
        }
    }
}
