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

mod api;
mod job_methods;
mod luks_methods;
pub mod methods;
mod nbd_methods;
mod params;
#[cfg(feature = "rbd")]
mod rbd_methods;
mod secret_methods;
mod server;
mod service_methods;
pub mod trace_methods;
mod vhost_methods;

use std::sync::Arc;

pub use api::{
    error_reply, parse_params, Handler, Registry, Rpc, RpcError, INTERNAL_ERROR, INVALID_PARAMS,
    INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR, SERVER_ERROR,
};
pub use server::{RpcServer, IDLE_TIMEOUT, MAX_CONNECTIONS, MAX_MESSAGE};

use crate::server::Server;

impl Rpc {
    /// Every method of udrive's control socket on `server`.
    pub fn new(server: Arc<Server>) -> Rpc {
        let mut registry = Registry::default();
        register_all(&mut registry);
        Rpc::with_registry(server, registry)
    }
}

/// Registers every method: the general ones, then each subsystem's.
pub fn register_all(r: &mut Registry) {
    methods::register(r);
    trace_methods::register(r);
    vhost_methods::register(r);
    service_methods::register(r);
    luks_methods::register(r);
    secret_methods::register(r);
    job_methods::register(r);
    nbd_methods::register(r);
    #[cfg(feature = "rbd")]
    rbd_methods::register(r);
}
