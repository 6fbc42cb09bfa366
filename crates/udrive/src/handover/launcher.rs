//! The launcher: a small process a sandboxed server starts before it installs
//! its seccomp filters, to start the successor for `start_successor`.
//!
//! A seccomp filter stays with a process across `exec`: a successor the
//! sandboxed server started itself would run the new binary under the old
//! binary's filters (and add its own on top, one more layer each upgrade). The
//! launcher never installs a filter, so what it starts begins clean. It reads
//! only requests from its server over a socket pair (the control socket the
//! successor takes over from; the binary is always the server's own path) and
//! exits when the server closes its end.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

use anyhow::{bail, Context, Result};

use super::successor;

static LAUNCHER: OnceLock<Mutex<BufReader<UnixStream>>> = OnceLock::new();

/// Starts the launcher.
pub fn start() -> Result<()> {
    let (ours, theirs) = UnixStream::pair().context("cannot create the launcher's socket")?;
    let binary = successor::own_binary()?;
    Command::new(&binary)
        .arg("launcher")
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start the launcher ({})", binary.display()))?;
    let _ = LAUNCHER.set(Mutex::new(BufReader::new(ours)));
    Ok(())
}

/// Asks the launcher for a successor; `None` when this server has none.
pub fn start_successor(rpc: &Path) -> Option<Result<u32>> {
    let launcher = LAUNCHER.get()?;
    let mut conn = launcher.lock().unwrap_or_else(|e| e.into_inner());
    let ask = |conn: &mut BufReader<UnixStream>| -> Result<u32> {
        let path = rpc.to_str().filter(|p| !p.contains('\n'));
        let path = path.context("the control socket's path is not one line of UTF-8")?;
        conn.get_mut()
            .write_all(format!("successor {path}\n").as_bytes())?;
        let mut line = String::new();
        conn.read_line(&mut line)?;
        match line.trim_end().split_once(' ') {
            Some(("ok", pid)) => Ok(pid.parse()?),
            Some(("err", why)) => bail!("{why}"),
            _ => bail!("the launcher ended ({line:?})"),
        }
    };
    Some(ask(&mut conn).context("the launcher could not start a successor"))
}

/// The launcher's own loop (`udrive launcher`, hidden): one successor per
/// request, until the server closes the socket on stdin.
pub fn run() -> Result<()> {
    let stdin = std::io::stdin().as_fd().try_clone_to_owned()?;
    let mut conn = BufReader::new(UnixStream::from(stdin));
    let mut line = String::new();
    loop {
        line.clear();
        if conn.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let reply = match line.trim_end().split_once(' ') {
            Some(("successor", rpc)) => match successor::start(Path::new(rpc)) {
                Ok(pid) => format!("ok {pid}\n"),
                Err(e) => format!("err {}\n", format!("{e:#}").replace('\n', " ")),
            },
            _ => format!("err unknown request {:?}\n", line.trim_end()),
        };
        conn.get_mut().write_all(reply.as_bytes())?;
    }
}
