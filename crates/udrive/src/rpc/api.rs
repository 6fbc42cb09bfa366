//! JSON-RPC 2.0 requests and replies: error codes, typed parameters, the method
//! table and the dispatch of one message to its handlers.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::server::Server;

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

/// Method name -> handler. The default set is `super::register_all`'s; each
/// subsystem (tracing, vhost-user devices, RBD) registers its own.
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
    /// Handlers of `registry` on `server`.
    pub fn with_registry(server: Arc<Server>, registry: Registry) -> Rpc {
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
