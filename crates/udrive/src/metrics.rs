//! Prometheus text format: [`render`] for `get_metrics`/`udrive metrics`, and a tiny
//! HTTP/1.1 endpoint (`--metrics-listen`) that serves `GET /metrics`.
//!
//! The endpoint is std::net only (a scrape endpoint needs one route; an HTTP crate
//! would be most of udrive's dependency tree). Requests are read with a timeout and
//! a size bound, handled one at a time on one control thread, and answered with
//! `Connection: close`.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::server::Server;

/// Largest request head accepted.
pub const MAX_REQUEST: usize = 8192;
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Every device's and reactor's counters and histograms (`get_stats`), and the
/// block jobs' progress, in Prometheus text format.
pub fn render(server: &Server) -> String {
    let mut text = trace::render_prometheus(&server.stats());
    text.push_str(&server.lock().jobs.prometheus());
    text
}

/// The `--metrics-listen` endpoint.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    pub fn start(addr: SocketAddr, server: Arc<Server>) -> io::Result<MetricsServer> {
        Self::start_on(TcpListener::bind(addr)?, server)
    }

    /// Serves on `listener` (bound by this process or one it took over from).
    pub fn start_on(listener: TcpListener, server: Arc<Server>) -> io::Result<MetricsServer> {
        let addr = listener.local_addr()?;
        // Kept with the process's records: a handover passes it on.
        server.process().keep_listener(
            crate::process::METRICS_LISTENER_KEY,
            addr.to_string().as_bytes(),
            &listener,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = sandbox::spawn(sandbox::Role::Metrics, "metrics-http".into(), move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::Acquire) {
                    return;
                }
                if let Ok(s) = conn {
                    if let Err(e) = serve_one(s, &server) {
                        tracing::debug!("metrics: request failed: {e}");
                    }
                }
            }
        })?;
        Ok(MetricsServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The bound address (with the real port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    Metrics,
    NotFound,
    MethodNotAllowed,
    Bad(&'static str),
}

/// Parses the request line of `head` (everything up to the blank line).
pub fn route(head: &[u8]) -> Route {
    let Ok(text) = std::str::from_utf8(head) else {
        return Route::Bad("request is not UTF-8");
    };
    let line = text.split("\r\n").next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::Bad("request line is not `METHOD TARGET HTTP/1.x`");
    };
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return Route::Bad("only HTTP/1.0 and HTTP/1.1 are served");
    }
    if !target.starts_with('/') {
        return Route::Bad("target must be a path");
    }
    if method != "GET" && method != "HEAD" {
        return Route::MethodNotAllowed;
    }
    match target.split('?').next() {
        Some("/metrics") => Route::Metrics,
        _ => Route::NotFound,
    }
}

fn serve_one(mut s: TcpStream, server: &Server) -> io::Result<()> {
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let complete = loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            break true;
        }
        if head.len() >= MAX_REQUEST {
            break false;
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            break false;
        }
        let room = MAX_REQUEST - head.len();
        head.extend_from_slice(&buf[..n.min(room)]);
    };
    let (status, body) = if !complete {
        (
            "400 Bad Request",
            format!("request head incomplete or larger than {MAX_REQUEST} bytes\n"),
        )
    } else {
        match route(&head) {
            Route::Metrics => ("200 OK", render(server)),
            Route::NotFound => ("404 Not Found", "only /metrics is served\n".to_string()),
            Route::MethodNotAllowed => ("405 Method Not Allowed", "use GET\n".to_string()),
            Route::Bad(why) => ("400 Bad Request", format!("{why}\n")),
        }
    };
    let is_head = head.starts_with(b"HEAD ");
    let ctype = if status.starts_with("200") {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let mut resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !is_head {
        resp.push_str(&body);
    }
    s.write_all(resp.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Route::Metrics
        );
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Route::Metrics);
        assert_eq!(route(b"GET / HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(
            route(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Route::MethodNotAllowed
        );
        assert!(matches!(route(b"GET /metrics\r\n\r\n"), Route::Bad(_)));
        assert!(matches!(
            route(b"GET /metrics HTTP/2\r\n\r\n"),
            Route::Bad(_)
        ));
        assert!(matches!(route(b"\xff\xfe\r\n\r\n"), Route::Bad(_)));
        assert!(matches!(
            route(b"GET metrics HTTP/1.1\r\n\r\n"),
            Route::Bad(_)
        ));
    }
}
