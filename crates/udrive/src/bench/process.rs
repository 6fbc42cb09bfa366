//! The processes of `udrive bench`'s real datapaths: a server started and stopped
//! (TERM, then KILL), a client run to its end or several at once, and the errors
//! they give, with the tail of their logs.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error("starting {what} ({cmd}): {source}")]
    Spawn {
        what: String,
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} did not open {sock} within {secs} s; its log ({log}) ends: {tail}")]
    NotReady {
        what: String,
        sock: PathBuf,
        secs: u64,
        log: PathBuf,
        tail: String,
    },
    #[error("{what} failed ({status}): {tail}")]
    Failed {
        what: String,
        status: String,
        tail: String,
    },
    #[error("{what} printed no JSON: {source}")]
    BadJson {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// A variant's knob did not take (`expect_log`).
    #[error("{what}: its log ({log}) does not say `{text}`: is the knob in this build (a test knob needs a binary built with its feature)?")]
    MissingLog {
        what: String,
        text: String,
        log: PathBuf,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// `PATH`'s first executable of this name.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A server process, stopped (TERM, then KILL) when dropped; after a live handover,
/// its successor is the server (`adopt`), stopped the same way.
pub(super) struct Server {
    child: Child,
    log: PathBuf,
    successor: Option<u32>,
}

impl Server {
    /// Starts `cmd` and waits until it has opened every socket of `socks`; its log
    /// is the first socket's path with `.log`.
    pub(super) fn start(
        cmd: Command,
        what: &str,
        socks: &[PathBuf],
    ) -> Result<Server, DatapathError> {
        Server::start_within(cmd, what, socks, 20)
    }

    /// [`Server::start`], waiting up to `secs` for the sockets.
    pub(super) fn start_within(
        cmd: Command,
        what: &str,
        socks: &[PathBuf],
        secs: u64,
    ) -> Result<Server, DatapathError> {
        for s in socks {
            let _ = std::fs::remove_file(s);
        }
        let log = socks
            .first()
            .map_or_else(|| PathBuf::from("server.log"), |s| s.with_extension("log"));
        let mut s = Server::spawn(cmd, what, log.clone())?;
        let deadline = Instant::now() + Duration::from_secs(secs);
        while let Some(sock) = socks.iter().find(|p| !p.exists()) {
            let exited = matches!(s.child.try_wait(), Ok(Some(_)));
            if exited || Instant::now() > deadline {
                return Err(DatapathError::NotReady {
                    what: what.into(),
                    sock: sock.clone(),
                    secs,
                    tail: tail(&std::fs::read_to_string(&log).unwrap_or_default()),
                    log,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(s)
    }
}

impl Server {
    /// Starts `cmd` with its output in `log`, stopped like a server when dropped.
    pub(super) fn spawn(
        mut cmd: Command,
        what: &str,
        log: PathBuf,
    ) -> Result<Server, DatapathError> {
        let io = |source| DatapathError::Io {
            what: format!("log {}", log.display()),
            source,
        };
        let f = File::create(&log).map_err(io)?;
        let f2 = f.try_clone().map_err(io)?;
        cmd.stdin(Stdio::null()).stdout(f).stderr(f2);
        let child = cmd.spawn().map_err(|source| DatapathError::Spawn {
            what: what.into(),
            cmd: format!("{cmd:?}"),
            source,
        })?;
        Ok(Server {
            child,
            log,
            successor: None,
        })
    }

    /// The serving process: the successor after a handover.
    pub(super) fn pid(&self) -> u32 {
        self.successor.unwrap_or_else(|| self.child.id())
    }

    /// `pid` took over from this server (`udrive upgrade`); stopping the server now
    /// stops it, and a successor it replaced in turn.
    pub(super) fn adopt(&mut self, pid: u32) {
        if let Some(old) = self.successor.replace(pid) {
            if old != pid {
                stop_pid(old);
            }
        }
    }

    /// Fails with its log's tail if it has exited.
    pub(super) fn still_running(&mut self, what: &str) -> Result<(), DatapathError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            status => Err(DatapathError::Failed {
                what: what.into(),
                status: status.map_or_else(|e| e.to_string(), |s| format!("{s:?}")),
                tail: tail(&std::fs::read_to_string(&self.log).unwrap_or_default()),
            }),
        }
    }

    /// Fails unless the server's log so far holds `text`.
    pub(super) fn expect_log(&self, what: &str, text: &str) -> Result<(), DatapathError> {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        if log.contains(text) {
            return Ok(());
        }
        Err(DatapathError::MissingLog {
            what: what.into(),
            text: text.into(),
            log: self.log.clone(),
        })
    }
}

/// TERM, then KILL after 5 s, for a process that is not our child (a successor,
/// started by `udrive upgrade`): gone when /proc no longer has it.
fn stop_pid(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    let p = nix::unistd::Pid::from_raw(pid as i32);
    let gone = || !std::path::Path::new(&format!("/proc/{pid}")).exists();
    if kill(p, Signal::SIGTERM).is_err() {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !gone() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = kill(p, Signal::SIGKILL);
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.successor.take() {
            stop_pid(s);
        }
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `c` with its output captured.
fn spawn(c: &mut Command, what: &str) -> Result<Child, DatapathError> {
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| DatapathError::Spawn {
            what: what.into(),
            cmd: format!("{c:?}"),
            source,
        })
}

/// Waits for `child`; its output if it succeeded, else its stderr's tail.
fn finish(child: Child, what: &str) -> Result<Output, DatapathError> {
    let out = child
        .wait_with_output()
        .map_err(|source| DatapathError::Io {
            what: format!("waiting for {what}"),
            source,
        })?;
    if !out.status.success() {
        return Err(DatapathError::Failed {
            what: what.into(),
            status: out.status.to_string(),
            tail: tail(&String::from_utf8_lossy(&out.stderr)),
        });
    }
    Ok(out)
}

/// Runs `c` to its end; its output if it succeeded, else its stderr's tail.
pub(super) fn output(mut c: Command, what: &str) -> Result<Output, DatapathError> {
    let child = spawn(&mut c, what)?;
    finish(child, what)
}

/// Runs every command at once and waits for all of them (a thread each, so that
/// none blocks on a full pipe while another is waited for); the first failure, if
/// any, else the outputs in order. `started` learns the processes' pids once they
/// run (a CPU clock's clients).
pub(super) fn outputs(
    cmds: Vec<(Command, String)>,
    started: impl FnOnce(&[u32]),
) -> Result<Vec<Output>, DatapathError> {
    let started_cmds: Vec<(Result<Child, DatapathError>, String)> = cmds
        .into_iter()
        .map(|(mut c, what)| (spawn(&mut c, &what), what))
        .collect();
    let pids: Vec<u32> = started_cmds
        .iter()
        .filter_map(|(c, _)| Some(c.as_ref().ok()?.id()))
        .collect();
    started(&pids);
    let started = started_cmds;
    std::thread::scope(|s| {
        let waits: Vec<_> = started
            .into_iter()
            .map(|(child, what)| s.spawn(move || finish(child?, &what)))
            .collect();
        waits
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(DatapathError::Io {
                        what: "waiting for a client".into(),
                        source: std::io::Error::other("its waiting thread panicked"),
                    })
                })
            })
            .collect()
    })
}

/// The last lines of a log, on one line.
pub(super) fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..].join(" / ")
}

/// Kills processes that outlive their run: SPDK's clients spin on when their
/// connection fails while they set up, and would hold the bench forever.
pub(super) struct Deadline {
    /// Set when the deadline is dropped (the processes ended in time).
    ended: Arc<(Mutex<bool>, Condvar)>,
    /// Set by the thread when it killed them.
    fired: Arc<AtomicBool>,
    after: Duration,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Deadline {
    /// SIGKILL for `pids` once `after` has passed, unless dropped first.
    pub(super) fn start(pids: &[u32], after: Duration) -> Deadline {
        let ended = Arc::new((Mutex::new(false), Condvar::new()));
        let fired = Arc::new(AtomicBool::new(false));
        let (e, f, pids) = (ended.clone(), fired.clone(), pids.to_vec());
        let thread = std::thread::spawn(move || {
            let (lock, cv) = &*e;
            let Ok(done) = lock.lock() else { return };
            let Ok((done, _)) = cv.wait_timeout_while(done, after, |d| !*d) else {
                return;
            };
            if !*done {
                f.store(true, Ordering::Relaxed);
                for p in pids {
                    let pid = nix::unistd::Pid::from_raw(p as i32);
                    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                }
            }
        });
        Deadline {
            ended,
            fired,
            after,
            thread: Some(thread),
        }
    }

    /// `r`, with a failure of a process it killed told as what it was; ends the
    /// deadline.
    pub(super) fn explain<T>(self, r: Result<T, DatapathError>) -> Result<T, DatapathError> {
        match r {
            Err(DatapathError::Failed { what, tail, .. }) if self.fired.load(Ordering::Relaxed) => {
                Err(DatapathError::Failed {
                    what,
                    status: format!("killed: still running after {} s", self.after.as_secs()),
                    tail,
                })
            }
            r => r,
        }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        let (lock, cv) = &*self.ended;
        if let Ok(mut d) = lock.lock() {
            *d = true;
        }
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// [`output`], killing `c` if it runs longer than `after`.
pub(super) fn output_within(
    mut c: Command,
    what: &str,
    after: Duration,
) -> Result<Output, DatapathError> {
    let child = spawn(&mut c, what)?;
    let deadline = Deadline::start(&[child.id()], after);
    deadline.explain(finish(child, what))
}
