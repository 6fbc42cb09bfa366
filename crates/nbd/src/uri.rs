//! NBD URIs (the NBD project's `doc/uri.md`), limited to what this crate can
//! connect to: plain TCP and Unix sockets, no TLS.

use std::ffi::OsString;
use std::fmt;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use crate::DEFAULT_PORT;

const FORMS: &str = "expected nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH";

/// Where the NBD server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// `"host:port"`, IPv6 hosts in brackets, ready for `TcpStream::connect`.
    Tcp(String),
    /// A Unix socket path.
    Unix(PathBuf),
}

/// An export on an NBD server: `nbd://HOST[:PORT]/EXPORT` (port 10809 by
/// default) or `nbd+unix:///EXPORT?socket=PATH`; the export name may be empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uri {
    /// The server.
    pub address: Address,
    /// The export name, percent-decoded.
    pub export: String,
}

impl Uri {
    /// Parses an NBD URI; the error says what is wrong and which form is expected.
    pub fn parse(s: &str) -> Result<Uri, String> {
        let err = |what: &str| format!("bad NBD URI {s:?}: {what}; {FORMS}");
        if s.contains('#') {
            return Err(err("a fragment (#) has no meaning in an NBD URI"));
        }
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| err("no scheme (nbd:// or nbd+unix://)"))?;
        let (authority_path, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match authority_path.find('/') {
            Some(i) => authority_path.split_at(i),
            None => (authority_path, ""),
        };
        let export = decode(path.strip_prefix('/').unwrap_or(path)).map_err(|e| err(&e))?;
        let export = String::from_utf8(export).map_err(|_| err("the export name is not UTF-8"))?;
        if export.contains('\0') || export.len() > crate::wire::MAX_STRING {
            return Err(err("the export name has a NUL byte or is over 4096 bytes"));
        }
        let address = match scheme.to_ascii_lowercase().as_str() {
            "nbd" | "nbd+tcp" => {
                if query.is_some() {
                    return Err(err(
                        "nbd:// takes no query parameters (TLS is not supported)",
                    ));
                }
                Address::Tcp(tcp_address(authority).map_err(|e| err(&e))?)
            }
            "nbd+unix" => {
                if !authority.is_empty() {
                    return Err(err("nbd+unix:// takes no host: write nbd+unix:///EXPORT"));
                }
                Address::Unix(socket_path(query).map_err(|e| err(&e))?)
            }
            "nbds" | "nbds+unix" => return Err(err("TLS (nbds) is not supported")),
            other => return Err(err(&format!("unknown scheme {other:?}"))),
        };
        Ok(Uri { address, export })
    }
}

fn tcp_address(authority: &str) -> Result<String, String> {
    if authority.contains('@') {
        return Err("user info (USER@) is only for TLS, which is not supported".into());
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or("an IPv6 address lacks its closing ]")?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or("junk after the IPv6 address")?),
        };
        (format!("[{host}]"), port)
    } else {
        match authority.split_once(':') {
            Some((_, p)) if p.contains(':') => {
                return Err("an IPv6 address must be in brackets, as in nbd://[::1]/".into())
            }
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (authority.to_string(), None),
        }
    };
    if host.is_empty() || host == "[]" {
        return Err("no host".into());
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n != 0 => n,
            _ => return Err(format!("port {p:?} is not a number from 1 to 65535")),
        },
    };
    Ok(format!("{host}:{port}"))
}

fn socket_path(query: Option<&str>) -> Result<PathBuf, String> {
    let mut socket = None;
    for param in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match param.split_once('=') {
            Some(("socket", v)) if socket.is_none() => socket = Some(decode(v)?),
            Some(("socket", _)) => return Err("socket= given twice".into()),
            _ => return Err(format!("unsupported query parameter {param:?}")),
        }
    }
    let socket = socket.ok_or("nbd+unix:// needs ?socket=PATH")?;
    if socket.is_empty() || socket.contains(&0) {
        return Err(
            "the socket path is empty or has a NUL byte (abstract sockets are not supported)"
                .into(),
        );
    }
    Ok(PathBuf::from(OsString::from_vec(socket)))
}

/// Percent-decodes one URI component.
fn decode(s: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b != b'%' {
            out.push(b);
            continue;
        }
        let hex = [bytes.next(), bytes.next()];
        let digit = |c: Option<u8>| (c? as char).to_digit(16);
        match (digit(hex[0]), digit(hex[1])) {
            (Some(h), Some(l)) => out.push(u8::try_from(h * 16 + l).map_err(|e| e.to_string())?),
            _ => {
                return Err(format!(
                    "bad percent escape in {s:?} (% must be followed by two hex digits)"
                ))
            }
        }
    }
    Ok(out)
}

/// Percent-encodes one URI component, keeping what RFC 3986 leaves readable.
fn encode(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~/:@!$'()*+,;".contains(&b) {
            write!(f, "{}", b as char)?;
        } else {
            write!(f, "%{b:02X}")?;
        }
    }
    Ok(())
}

impl fmt::Display for Uri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.address {
            Address::Tcp(hostport) => {
                write!(f, "nbd://{hostport}/")?;
                encode(f, self.export.as_bytes())
            }
            Address::Unix(path) => {
                f.write_str("nbd+unix:///")?;
                encode(f, self.export.as_bytes())?;
                f.write_str("?socket=")?;
                encode(f, path.as_os_str().as_bytes())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(a: &str, e: &str) -> Uri {
        Uri {
            address: Address::Tcp(a.into()),
            export: e.into(),
        }
    }

    fn unix(p: &str, e: &str) -> Uri {
        Uri {
            address: Address::Unix(p.into()),
            export: e.into(),
        }
    }

    #[test]
    fn good_forms_parse_and_print_back() {
        let cases = [
            ("nbd://example.com/disk", tcp("example.com:10809", "disk")),
            ("nbd://example.com", tcp("example.com:10809", "")),
            ("nbd://example.com/", tcp("example.com:10809", "")),
            ("nbd://10.0.0.1:1234/d0", tcp("10.0.0.1:1234", "d0")),
            ("nbd://[::1]/x", tcp("[::1]:10809", "x")),
            ("nbd://[fe80::1]:99/x", tcp("[fe80::1]:99", "x")),
            ("nbd://h//disk", tcp("h:10809", "/disk")),
            ("nbd://h/hello%20world", tcp("h:10809", "hello world")),
            ("NBD://h/a", tcp("h:10809", "a")),
            (
                "nbd+unix:///disk?socket=/run/nbd.sock",
                unix("/run/nbd.sock", "disk"),
            ),
            ("nbd+unix:///?socket=nbd.sock", unix("nbd.sock", "")),
            ("nbd+unix://?socket=%2Ftmp%2Fa%20b", unix("/tmp/a b", "")),
        ];
        for (s, want) in cases {
            let got = Uri::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(got, want, "{s}");
            let printed = got.to_string();
            assert_eq!(Uri::parse(&printed), Ok(got), "{s} printed as {printed}");
        }
        assert_eq!(
            unix("/a b", "x y").to_string(),
            "nbd+unix:///x%20y?socket=/a%20b"
        );
        assert_eq!(tcp("h:1", "d").to_string(), "nbd://h:1/d");
    }

    #[test]
    fn bad_forms_say_what_is_wrong() {
        let cases = [
            ("example.com/disk", "no scheme"),
            ("http://h/x", "unknown scheme"),
            ("nbds://h/x", "TLS"),
            ("nbd://h/x?tls-type=anon", "no query"),
            ("nbd:///x", "no host"),
            ("nbd://h:0/x", "port"),
            ("nbd://h:99999/x", "port"),
            ("nbd://h:abc/x", "port"),
            ("nbd://::1/x", "brackets"),
            ("nbd://[::1/x", "closing"),
            ("nbd://[::1]x/y", "junk"),
            ("nbd://u@h/x", "user info"),
            ("nbd://h/x%zz", "percent"),
            ("nbd://h/x%4", "percent"),
            ("nbd://h/%ff", "UTF-8"),
            ("nbd://h/a%00b", "NUL"),
            ("nbd://h/x#frag", "fragment"),
            ("nbd+unix:///x", "socket=PATH"),
            ("nbd+unix://host/x?socket=/s", "no host"),
            ("nbd+unix:///x?socket=", "empty"),
            ("nbd+unix:///x?socket=%00abs", "NUL"),
            ("nbd+unix:///x?socket=/a&socket=/b", "twice"),
            ("nbd+unix:///x?socket=/a&tls=1", "unsupported query"),
        ];
        for (s, needle) in cases {
            let e = Uri::parse(s).expect_err(s);
            assert!(e.contains(needle), "{s}: {e:?} lacks {needle:?}");
            assert!(e.contains("nbd+unix:///EXPORT?socket=PATH"), "{s}: {e:?}");
        }
    }
}
