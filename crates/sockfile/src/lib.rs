//! Unix socket files for udrive's servers (device sockets and the control socket):
//! who may connect is decided by the file's mode and group, so a socket must never
//! exist with a wider mode than the operator asked for, not even for a moment.

#![forbid(unsafe_code)]

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

/// How long a whole message (vfio-user, vhost-user, JSON-RPC) may take to arrive
/// once its first byte has: socket timeouts apply per `recv`, so without this a
/// client that trickles bytes (a 1 MiB message, one byte every few seconds) holds a
/// thread for ever. `UDRIVE_MSG_DEADLINE_MS` overrides the 5 s (read once; tests
/// use a short one).
pub fn message_deadline() -> std::time::Duration {
    static D: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *D.get_or_init(|| {
        std::env::var("UDRIVE_MSG_DEADLINE_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(
                std::time::Duration::from_secs(5),
                std::time::Duration::from_millis,
            )
    })
}

/// Who may connect to a socket: its file mode and, optionally, its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketAccess {
    pub mode: u32,
    pub gid: Option<u32>,
}

impl Default for SocketAccess {
    /// Owner only: a VMM running as another user needs an explicit mode and group.
    fn default() -> Self {
        SocketAccess {
            mode: 0o600,
            gid: None,
        }
    }
}

impl SocketAccess {
    /// From the CLI/config spellings: an octal mode (`0660`, `660`) and a group name
    /// or number.
    pub fn parse(mode: Option<&str>, group: Option<&str>) -> Result<SocketAccess, String> {
        let mut a = SocketAccess::default();
        if let Some(m) = mode {
            a.mode = parse_mode(m)?;
        }
        if let Some(g) = group {
            a.gid = Some(parse_group(g)?);
        }
        Ok(a)
    }
}

/// An octal file mode for a socket (read/write bits only matter; at most 0777).
pub fn parse_mode(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    match u32::from_str_radix(digits, 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!(
            "socket mode `{s}` is not an octal mode like 0600 or 0660"
        )),
    }
}

/// A group by number or by name (looked up in /etc/group; use the number for
/// groups that only a directory service knows).
pub fn parse_group(s: &str) -> Result<u32, String> {
    if let Ok(gid) = u32::from_str(s) {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group")
        .map_err(|e| format!("cannot read /etc/group to look up group `{s}`: {e}"))?;
    groups
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let gid = f.nth(1)?.parse::<u32>().ok()?;
            (name == s).then_some(gid)
        })
        .next()
        .ok_or_else(|| format!("no group `{s}` in /etc/group (give its number instead)"))
}

/// What is at `path`, for a new listening socket there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketPath {
    /// Nothing.
    Free,
    /// A socket nobody listens on (left by a dead process).
    Stale,
}

/// Looks at `path` without changing it: a live socket or a file that is not a
/// socket is an error naming the path.
pub fn probe(path: &Path) -> io::Result<SocketPath> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if !md.file_type().is_socket() => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is served by a live process", path.display()),
            )),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(SocketPath::Stale),
            Err(e) => Err(e),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(SocketPath::Free),
        Err(e) => Err(e),
    }
}

/// Makes `path` free for a new listening socket: a socket left by a dead process is
/// removed; a live one or a file that is not a socket is an error naming the path.
pub fn clear_stale(path: &Path) -> io::Result<()> {
    match probe(path)? {
        SocketPath::Stale => std::fs::remove_file(path),
        SocketPath::Free => Ok(()),
    }
}

/// Binds a listening socket at `path` with `access`, replacing a stale socket. The
/// socket is bound inside a private (0700) directory next to `path`, given its mode
/// and group there, and only then renamed into place: it is never reachable with the
/// umask's mode or the wrong group.
pub fn bind(path: &Path, access: SocketAccess) -> io::Result<UnixListener> {
    static N: AtomicU64 = AtomicU64::new(0);
    clear_stale(path)?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp_dir = dir.join(format!(
        ".udrive-bind-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&tmp_dir)?;
    let tmp = tmp_dir.join("s");
    let r = (|| {
        let l = UnixListener::bind(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(access.mode))?;
        if let Some(gid) = access.gid {
            std::os::unix::fs::chown(&tmp, None, Some(gid)).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot give {} to group {gid}: {e}", path.display()),
                )
            })?;
        }
        std::fs::rename(&tmp, path)?;
        Ok(l)
    })();
    let _ = std::fs::remove_file(&tmp);
    let _ = std::fs::remove_dir(&tmp_dir);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn default_is_owner_only_and_modes_apply() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.sock");
        let _l = bind(&p, SocketAccess::default()).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        let q = d.path().join("b.sock");
        let a = SocketAccess::parse(Some("0660"), Some("0")).unwrap();
        let _m = bind(&q, a).unwrap();
        let md = std::fs::metadata(&q).unwrap();
        assert_eq!(md.mode() & 0o777, 0o660);
        assert_eq!(md.gid(), 0);
        // Nothing left behind but the two sockets.
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2);
    }

    #[test]
    fn bad_modes_and_groups_are_clear_errors() {
        assert!(parse_mode("999").unwrap_err().contains("octal"));
        assert!(parse_mode("01777").is_err());
        assert_eq!(parse_mode("660"), Ok(0o660));
        assert_eq!(parse_group("root"), Ok(0));
        assert!(parse_group("no-such-group-here")
            .unwrap_err()
            .contains("no group"));
    }

    #[test]
    fn live_sockets_are_refused_and_stale_ones_replaced() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.sock");
        let l = bind(&p, SocketAccess::default()).unwrap();
        assert!(bind(&p, SocketAccess::default()).is_err(), "live");
        drop(l);
        assert!(bind(&p, SocketAccess::default()).is_ok(), "stale replaced");
    }

    /// `probe` (what `udrive check` asks) tells the cases apart and changes nothing.
    #[test]
    fn probe_looks_without_touching() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.sock");
        assert_eq!(probe(&p).unwrap(), SocketPath::Free);
        let l = bind(&p, SocketAccess::default()).unwrap();
        assert_eq!(probe(&p).unwrap_err().kind(), io::ErrorKind::AddrInUse);
        drop(l);
        assert_eq!(probe(&p).unwrap(), SocketPath::Stale);
        assert!(
            p.exists(),
            "a stale socket stays until something binds there"
        );
        let f = d.path().join("file");
        std::fs::write(&f, "").unwrap();
        assert_eq!(probe(&f).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
    }
}
