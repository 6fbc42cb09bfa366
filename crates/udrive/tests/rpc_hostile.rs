//! Hostile clients of a real `udrive serve --rpc` process get clear errors and
//! the server keeps serving: malformed and oversized JSON-RPC, abandoned and
//! excess connections, and junk on the Prometheus endpoint.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::control::{connect, error_code, read_reply, round_trip, serve_opts, Serve};
use initiator::NvmeDriver;
use serde_json::{json, Value};
use test_support::T;

#[test]
fn hostile_input_gets_clear_errors_and_the_server_keeps_serving() {
    let s = Serve::start(&[]);
    let a = s.nvme.to_str().unwrap().to_string();

    let mut c = connect(&s.rpc);
    malformed_json_keeps_the_connection(&mut c);
    for (req, code, want) in bad_requests(&a) {
        c.write_all(format!("{req}\n").as_bytes()).unwrap();
        let r = read_reply(&mut c).expect("reply");
        assert_eq!(error_code(&r), code, "{req}: {r}");
        let m = r["error"]["message"].as_str().unwrap();
        assert!(m.contains(want), "{req}: `{want}` not in `{m}`");
    }
    batch_replies_in_order(&mut c);
    junk_and_huge_messages_close(&s);
    abandoned_and_excess_connections(&s);
    still_serving(&s);
}

/// Malformed JSON that can be delimited: -32700, the connection stays usable.
fn malformed_json_keeps_the_connection(c: &mut UnixStream) {
    c.write_all(b"{\"jsonrpc\":\"2.0\",,}\n").unwrap();
    let r = read_reply(c).unwrap();
    assert_eq!(error_code(&r), -32700);
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("malformed JSON"));
    // Back-to-back objects without separators, and a notification (no reply).
    c.write_all(
        br#"{"jsonrpc":"2.0","method":"get_version"}{"jsonrpc":"2.0","method":"get_version","id":"x"}"#,
    )
    .unwrap();
    let r = read_reply(c).unwrap();
    assert_eq!(r["id"], "x");
    assert_eq!(r["result"]["name"], "udrive");
}

/// Requests with bad parameters, methods, envelopes and ids, one per line on one
/// connection (`a`: the served controller's socket), with the error code and a
/// part of the message each gets.
fn bad_requests(a: &str) -> Vec<(Value, i64, &'static str)> {
    vec![
        (
            json!({"jsonrpc": "2.0", "method": "get_devices", "params": {"socket": 5}, "id": 1}),
            -32602,
            "invalid type",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "get_devices", "params": {"bogus": 1}, "id": 1}),
            -32602,
            "unknown field `bogus`",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "get_devices", "params": [1], "id": 1}),
            -32602,
            "object of named parameters",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "nvme_remove_namespace", "params": {"socket": a}, "id": 1}),
            -32602,
            "missing field `nsid`",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "nvme_remove_namespace", "params": {"socket": a, "nsid": -1}, "id": 1}),
            -32602,
            "invalid value",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "make_coffee", "id": 1}),
            -32601,
            "unknown method `make_coffee`",
        ),
        (
            json!({"method": "get_version", "id": 1}),
            -32600,
            "\"jsonrpc\" must be \"2.0\"",
        ),
        (
            json!({"jsonrpc": "2.0", "method": 3, "id": 1}),
            -32600,
            "\"method\" must be a string",
        ),
        (
            json!({"jsonrpc": "2.0", "id": 1}),
            -32600,
            "\"method\" is missing",
        ),
        (
            json!({"jsonrpc": "2.0", "method": "get_version", "id": [1]}),
            -32600,
            "\"id\"",
        ),
        (json!([]), -32600, "empty batch"),
    ]
}

/// A batch: one reply array, in order, errors per entry.
fn batch_replies_in_order(c: &mut UnixStream) {
    c.write_all(
        br#"[{"jsonrpc":"2.0","method":"get_version","id":1},7,{"jsonrpc":"2.0","method":"nope","id":2}]"#,
    )
    .unwrap();
    let r = read_reply(c).unwrap();
    let r = r.as_array().unwrap();
    assert_eq!(r.len(), 3);
    assert_eq!(r[0]["result"]["name"], "udrive");
    assert_eq!(error_code(&r[1]), -32600);
    assert_eq!(error_code(&r[2]), -32601);
}

/// Junk and oversized messages get an error reply, then the connection closes.
fn junk_and_huge_messages_close(s: &Serve) {
    // Bytes that cannot start JSON: -32700, then the connection closes.
    let mut j = connect(&s.rpc);
    j.write_all(b"hello\n").unwrap();
    assert_eq!(error_code(&read_reply(&mut j).unwrap()), -32700);
    assert!(read_reply(&mut j).is_none(), "closed after junk");

    // A huge message: -32600 once it passes 1 MiB, then close.
    let mut h = connect(&s.rpc);
    let huge = format!(
        "{{\"jsonrpc\":\"2.0\",\"method\":\"get_version\",\"params\":{{\"x\":\"{}\"}},\"id\":1}}",
        "a".repeat(2 << 20)
    );
    let _ = h.write_all(huge.as_bytes());
    let r = read_reply(&mut h).unwrap();
    assert_eq!(error_code(&r), -32600);
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("larger than"));
}

/// Clients that leave mid-message, and more connections than the server takes.
fn abandoned_and_excess_connections(s: &Serve) {
    // Half a message, then the client goes away.
    for _ in 0..20 {
        let mut p = connect(&s.rpc);
        p.write_all(b"{\"jsonrpc\":\"2.0\",\"method\":\"get_dev")
            .unwrap();
    }

    // Many connections at once: over the limit, a new connection closes the one
    // idle longest; every connection is either served or closed, never stuck.
    let mut many: Vec<UnixStream> = (0..80).map(|_| connect(&s.rpc)).collect();
    let mut served = 0;
    let mut closed = 0;
    for m in many.iter_mut() {
        let _ = m.write_all(b"{\"jsonrpc\":\"2.0\",\"method\":\"get_version\",\"id\":1}\n");
        match read_reply(m) {
            Some(r) if r.get("result").is_some() => served += 1,
            Some(r) => panic!("unexpected reply {r}"),
            None => closed += 1,
        }
    }
    assert_eq!(served + closed, 80);
    assert!(served >= 64, "served {served}");
    drop(many);
}

/// The server still serves: a follow-up call, and I/O on the device.
fn still_serving(s: &Serve) {
    let start = Instant::now();
    loop {
        match s.call("get_version", json!({})) {
            Ok(_) => break,
            Err(e) if start.elapsed() < T => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("server stopped serving: {e:?}"),
        }
    }
    let d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    round_trip(&d, 3);
}

#[test]
fn metrics_endpoint_answers_and_rejects_junk() {
    let s = Serve::start(&["--metrics-listen", "127.0.0.1:0"]);
    let line = s
        .banner
        .iter()
        .find(|l| l.contains("metrics on http://"))
        .expect("metrics address printed");
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .trim_end_matches("/metrics")
        .to_string();
    let http = |req: &[u8]| -> String {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(T)).unwrap();
        let _ = c.write_all(req);
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    };
    let ok = http(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
    assert!(ok.contains("text/plain; version=0.0.4"));
    assert!(ok.contains("# TYPE udrive_io_ops_total counter"));
    assert!(ok.contains("udrive_reactor_polls_total{reactor=\"0\",state=\"idle\"}"));
    let body = ok.split("\r\n\r\n").nth(1).unwrap();
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .expect("the endpoint serves Prometheus text");
    assert!(http(b"BLAH\r\n\r\n").starts_with("HTTP/1.1 400"));
    assert!(http(b"GET /metrics HTTP/9\r\n\r\n").starts_with("HTTP/1.1 400"));
    let big = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "y".repeat(20000));
    assert!(http(big.as_bytes()).starts_with("HTTP/1.1 400"));
    assert!(http(b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    assert!(http(b"GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    // A client that sends half a request and leaves does not wedge the endpoint.
    {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.write_all(b"GET /met").unwrap();
    }
    assert!(http(b"GET /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 200"));
}
