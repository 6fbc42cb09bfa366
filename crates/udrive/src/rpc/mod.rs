//! JSON-RPC 2.0 control socket (docs/rpc.md).
//!
//! Framing: a stream of JSON values, each a request object or a batch array, sent
//! back to back with optional whitespace (newline-delimited works, so does SPDK
//! rpc.py's "one object after another"). Each reply is one JSON value followed by
//! `\n`. A message larger than [`MAX_MESSAGE`] gets -32600 and the connection is
//! closed; bytes that cannot start or continue a JSON value get -32700 and close
//! (the stream cannot be resynchronized); a complete but invalid value gets -32700
//! and the connection stays.
//!
//! Threads: one accept thread, one thread per connection (at most
//! [`MAX_CONNECTIONS`]; when all are taken a new connection closes the longest
//! idle one, so idle or slow clients cannot lock the operator out); handlers run on
//! the connection's thread and serialize on the server's control-plane lock. A
//! connection may idle [`IDLE_TIMEOUT`] between messages, but a message must arrive
//! whole within `sockfile::message_deadline()` once it has started.

pub mod methods;
#[cfg(feature = "rbd")]
mod rbd_methods;
pub mod trace_methods;
mod vhost_methods;

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};

use crate::server::Server;
use crate::framing::{Framer, Push};

/// Largest request message (one object or one batch).
pub const MAX_MESSAGE: usize = 1 << 20;
/// Connections served at once; more are answered with an error and closed.
pub const MAX_CONNECTIONS: usize = 64;
/// A connection with no complete message for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// The request was valid but the operation failed (device busy, no such device...).
pub const SERVER_ERROR: i64 = -32000;

#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }
    pub fn params(message: impl Into<String>) -> RpcError {
        RpcError::new(INVALID_PARAMS, message)
    }
}

impl From<anyhow::Error> for RpcError {
    fn from(e: anyhow::Error) -> RpcError {
        RpcError::new(SERVER_ERROR, format!("{e:#}"))
    }
}

/// Typed parameters: absent params read as `{}`; unknown or mistyped fields are
/// -32602 with serde's description of what was wrong.
pub fn parse_params<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, RpcError> {
    let v = if v.is_null() { json!({}) } else { v };
    serde_json::from_value(v).map_err(|e| RpcError::params(format!("invalid params: {e}")))
}

pub type Handler = Box<dyn Fn(&Rpc, Value) -> Result<Value, RpcError> + Send + Sync>;

/// Method name -> handler. The default set is [`methods::register_all`]; other
/// subsystems (tracing, vhost-user devices) register theirs next to it.
#[derive(Default)]
pub struct Registry {
    methods: BTreeMap<&'static str, (&'static str, Handler)>,
}

impl Registry {
    pub fn register(
        &mut self,
        name: &'static str,
        help: &'static str,
        f: impl Fn(&Rpc, Value) -> Result<Value, RpcError> + Send + Sync + 'static,
    ) {
        self.methods.insert(name, (help, Box::new(f)));
    }

    pub fn names(&self) -> impl Iterator<Item = (&'static str, &'static str)> + '_ {
        self.methods.iter().map(|(n, (h, _))| (*n, *h))
    }
}

/// What handlers see: the server and the method table.
pub struct Rpc {
    pub server: Arc<Server>,
    pub registry: Registry,
}

impl Rpc {
    pub fn new(server: Arc<Server>) -> Rpc {
        let mut registry = Registry::default();
        methods::register_all(&mut registry);
        Rpc { server, registry }
    }

    /// Handles one framed message; `None` when nothing is to be sent back
    /// (notifications only).
    pub fn handle_message(&self, msg: &[u8]) -> Option<Value> {
        let v: Value = match serde_json::from_slice(msg) {
            Ok(v) => v,
            Err(e) => {
                return Some(error_reply(
                    Value::Null,
                    PARSE_ERROR,
                    &format!("malformed JSON: {e}"),
                ))
            }
        };
        match v {
            Value::Array(reqs) if reqs.is_empty() => Some(error_reply(
                Value::Null,
                INVALID_REQUEST,
                "empty batch: send a request object or a non-empty array of them",
            )),
            Value::Array(reqs) => {
                let out: Vec<Value> = reqs
                    .into_iter()
                    .filter_map(|r| self.handle_one(r))
                    .collect();
                (!out.is_empty()).then_some(Value::Array(out))
            }
            v => self.handle_one(v),
        }
    }

    fn handle_one(&self, v: Value) -> Option<Value> {
        let Value::Object(mut o) = v else {
            return Some(error_reply(
                Value::Null,
                INVALID_REQUEST,
                "a request must be a JSON object with jsonrpc, method, params and id",
            ));
        };
        let notification = !o.contains_key("id");
        let id = o.remove("id").unwrap_or(Value::Null);
        if !matches!(id, Value::Null | Value::String(_) | Value::Number(_)) {
            return Some(error_reply(
                Value::Null,
                INVALID_REQUEST,
                "\"id\" must be a string, a number or null",
            ));
        }
        let r = self.dispatch(o);
        if notification {
            return None;
        }
        Some(match r {
            Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
            Err(e) => error_reply(id, e.code, &e.message),
        })
    }

    fn dispatch(&self, mut o: serde_json::Map<String, Value>) -> Result<Value, RpcError> {
        if o.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return Err(RpcError::new(
                INVALID_REQUEST,
                "\"jsonrpc\" must be \"2.0\"",
            ));
        }
        let method = match o.remove("method") {
            Some(Value::String(m)) => m,
            Some(_) => {
                return Err(RpcError::new(
                    INVALID_REQUEST,
                    "\"method\" must be a string",
                ))
            }
            None => return Err(RpcError::new(INVALID_REQUEST, "\"method\" is missing")),
        };
        let params = o.remove("params").unwrap_or(Value::Null);
        if !matches!(params, Value::Null | Value::Object(_)) {
            return Err(RpcError::params(
                "params must be an object of named parameters",
            ));
        }
        let Some((_, f)) = self.registry.methods.get(method.as_str()) else {
            return Err(RpcError::new(
                METHOD_NOT_FOUND,
                format!("unknown method `{method}` (rpc_get_methods lists the methods)"),
            ));
        };
        // A handler bug must not take the connection thread (or the process) down.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self, params)))
            .unwrap_or_else(|_| Err(RpcError::new(INTERNAL_ERROR, format!("{method} panicked"))))
    }
}

pub fn error_reply(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

/// The listening control socket.
pub struct RpcServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RpcServer {
    /// Binds `path` with file mode `mode` (refusing a path a live process serves,
    /// replacing a stale socket) and starts accepting.
    pub fn start(path: &Path, mode: u32, rpc: Arc<Rpc>) -> io::Result<RpcServer> {
        let listener = sockfile::bind(path, sockfile::SocketAccess { mode, gid: None })?;
        Self::start_on(path, listener, rpc)
    }

    /// Accepts on `listener`, bound to `path` (by this process or one it took over from).
    pub fn start_on(path: &Path, listener: UnixListener, rpc: Arc<Rpc>) -> io::Result<RpcServer> {
        // Kept with the process's records: a handover passes it on.
        rpc.server.process().keep_listener(
            crate::process::RPC_LISTENER_KEY,
            path.as_os_str().as_encoded_bytes(),
            &listener,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("rpc-accept".into())
            .spawn(move || accept_loop(listener, rpc, stop2));
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        Ok(RpcServer {
            path: path.to_path_buf(),
            stop,
            thread: Some(thread),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn accept_loop(listener: UnixListener, rpc: Arc<Rpc>, stop: Arc<AtomicBool>) {
    let table = Arc::new(ConnTable::default());
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let mut s = match conn {
            Ok(s) => s,
            Err(e) => {
                // EMFILE repeats every 10 ms until a descriptor frees up.
                static LOG: trace::LogLimiter = trace::LogLimiter::new();
                trace::limited!(
                    LOG,
                    warn,
                    "rpc: accept failed: {e} (out of file descriptors? raise `ulimit -n`)"
                );
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Some(slot) = table.admit(&s) else {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let e = error_reply(
                Value::Null,
                SERVER_ERROR,
                &format!(
                    "too many control connections busy with requests (limit {MAX_CONNECTIONS}); try again"
                ),
            );
            let _ = s.write_all(format!("{e}\n").as_bytes());
            continue;
        };
        let (rpc, table2) = (rpc.clone(), table.clone());
        let spawned = std::thread::Builder::new()
            .name("rpc-conn".into())
            .spawn(move || {
                serve_connection(s, &rpc, &slot);
                table2.leave(&slot);
            });
        if let Err(e) = spawned {
            tracing::warn!("rpc: cannot start a connection thread: {e}");
        }
    }
}

/// What a control connection is doing, for choosing one to close when all slots
/// are taken.
#[derive(Debug)]
struct ConnSlot {
    id: u64,
    stream: Option<UnixStream>,
    /// A handler is running for it: never evicted.
    busy: AtomicBool,
    /// When it last completed a message or connected (ms since the table began).
    last: AtomicU64,
}

/// Milliseconds on a process-wide monotonic clock.
fn now_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// The open control connections. A flood of idle or slow connections must not lock
/// the operator out: when all `MAX_CONNECTIONS` slots are taken, a new connection
/// closes the one that has been waiting longest without a request running (a slow
/// sender mid-message counts as waiting), and is refused only if every slot is
/// busy running a request. The per-message deadline and the idle timeout bound how
/// long any connection holds a slot anyway.
#[derive(Default)]
struct ConnTable {
    conns: std::sync::Mutex<Vec<Arc<ConnSlot>>>,
    next: AtomicU64,
}

impl ConnTable {
    fn admit(&self, s: &UnixStream) -> Option<Arc<ConnSlot>> {
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if conns.len() >= MAX_CONNECTIONS {
            let victim = conns
                .iter()
                .filter(|c| !c.busy.load(Ordering::Acquire))
                .min_by_key(|c| c.last.load(Ordering::Relaxed))?
                .clone();
            tracing::info!(
                "rpc: {MAX_CONNECTIONS} control connections open; closing the longest idle one"
            );
            if let Some(v) = &victim.stream {
                let _ = v.shutdown(std::net::Shutdown::Both);
            }
            conns.retain(|c| c.id != victim.id);
        }
        let slot = Arc::new(ConnSlot {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            stream: s.try_clone().ok(),
            busy: AtomicBool::new(false),
            last: AtomicU64::new(now_ms()),
        });
        conns.push(slot.clone());
        Some(slot)
    }

    fn leave(&self, slot: &ConnSlot) {
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|c| c.id != slot.id);
    }
}

fn send(s: &mut UnixStream, v: &Value) -> io::Result<()> {
    let mut out = serde_json::to_vec(v).map_err(io::Error::other)?;
    out.push(b'\n');
    s.write_all(&out)
}

fn serve_connection(mut s: UnixStream, rpc: &Rpc, slot: &ConnSlot) {
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    let mut framer = Framer::new(MAX_MESSAGE);
    let mut buf = vec![0u8; 64 << 10];
    // Between messages a connection may idle for IDLE_TIMEOUT; once a message has
    // started it must be complete within the message deadline.
    let mut deadline: Option<std::time::Instant> = None;
    loop {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(std::time::Instant::now()),
            None => IDLE_TIMEOUT,
        };
        if wait.is_zero() || s.set_read_timeout(Some(wait)).is_err() {
            return;
        }
        let n = match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut at = 0;
        while at < n {
            let (used, push) = framer.push(&buf[at..n]);
            at += used;
            if framer.in_message() && deadline.is_none() {
                deadline = Some(std::time::Instant::now() + sockfile::message_deadline());
            }
            let reply = match push {
                Push::More => continue,
                Push::Message(msg) => {
                    deadline = None;
                    slot.busy.store(true, Ordering::Release);
                    let r = rpc.handle_message(&msg);
                    slot.last.store(now_ms(), Ordering::Relaxed);
                    slot.busy.store(false, Ordering::Release);
                    r
                }
                Push::TooLarge => {
                    let e = error_reply(
                        Value::Null,
                        INVALID_REQUEST,
                        &format!("message larger than {MAX_MESSAGE} bytes; connection closed"),
                    );
                    let _ = send(&mut s, &e);
                    return;
                }
                Push::Junk(b) => {
                    let e = error_reply(
                        Value::Null,
                        PARSE_ERROR,
                        &format!(
                            "malformed JSON: byte {:?} cannot start a request (expected {{ or [); connection closed",
                            char::from(b)
                        ),
                    );
                    let _ = send(&mut s, &e);
                    return;
                }
            };
            if let Some(r) = reply {
                if send(&mut s, &r).is_err() {
                    return;
                }
            }
            // A handover just completed: the new process serves everything.
            rpc.server.process().exit_if_handed_over();
        }
    }
}
