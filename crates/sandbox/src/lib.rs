//! Least privilege for udrive's threads: each thread runs under a seccomp filter
//! for its role ([`Role`]), installed before it reads a byte a guest or client
//! sent, so a code-execution bug in a parser can make only the system calls that
//! role needs.
//!
//! A filter is inherited by every thread (and process) its thread starts, and the
//! kernel applies the intersection of all filters a thread carries. So udrive's
//! threads are not started by whichever thread wants them: [`spawn`] hands the
//! start to one spawner thread of the control role, and the new thread adds the
//! filter of its own role on top. A data-plane thread therefore needs no `clone`
//! at all, and its list is only its own.
//!
//! Without [`configure`] (tests that run servers inside the test process, tools
//! that are not servers) [`spawn`] is `std::thread::Builder::spawn` and [`enter`]
//! does nothing.

mod filter;
mod fs_rules;
#[cfg(feature = "forbidden-call-hook")]
pub mod hook;
mod policy;
mod process;
mod sigsys;
mod spawner;
mod syscall_names;

use std::sync::OnceLock;

pub use fs_rules::{restrict_files, Enforced, FsRules, SYSTEM_READ_ONLY};
pub use landlock::RulesetError as FsRulesError;
pub use policy::{allowed_syscalls, markdown_table, Role};
pub use process::{become_user, close_inherited_fds, no_core_dumps, Identity};
pub use spawner::spawn;

/// What happens when a thread makes a system call its role does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The process stops, after a line on stderr naming the role and the call.
    On,
    /// The call goes through and the kernel logs it (`dmesg`, the audit log, with
    /// the thread's name): for learning what a new setup needs.
    Log,
    /// No filters.
    Off,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "on" => Ok(Self::On),
            "log" => Ok(Self::Log),
            "off" => Ok(Self::Off),
            other => Err(format!("seccomp mode {other:?}: expected on, log or off")),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::On => "on",
            Self::Log => "log",
            Self::Off => "off",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot build the seccomp filter of the {role} role: {source}")]
    Build {
        role: &'static str,
        #[source]
        source: seccompiler::Error,
    },
    #[error("cannot install the seccomp filter of the {role} role: {source}")]
    Install {
        role: &'static str,
        #[source]
        source: seccompiler::Error,
    },
    #[error("cannot install the SIGSYS handler that reports forbidden calls: {0}")]
    Handler(#[source] std::io::Error),
    #[error("cannot start the thread that starts sandboxed threads: {0}")]
    Spawner(#[source] std::io::Error),
    #[error("the sandbox is configured already")]
    Configured,
}

/// The process's compiled filters, once [`configure`] ran.
static SANDBOX: OnceLock<filter::Programs> = OnceLock::new();

/// Compiles every role's filter, installs the handler that reports a forbidden
/// call and starts the spawner; then the calling thread enters the control role.
/// Call it once, early, before the process starts threads of its own: threads
/// started before keep no filter.
pub fn configure(mode: Mode) -> Result<(), Error> {
    if mode == Mode::Off {
        return Ok(());
    }
    let programs = filter::Programs::build(mode)?;
    if mode == Mode::On {
        sigsys::install().map_err(Error::Handler)?;
    }
    SANDBOX.set(programs).map_err(|_| Error::Configured)?;
    spawner::start()?;
    enter(Role::Control)
}

/// Installs `role`'s filter on the calling thread. Without [`configure`], or when
/// the thread carries that role's filter already (inherited from the spawner),
/// it does nothing.
pub fn enter(role: Role) -> Result<(), Error> {
    let Some(programs) = SANDBOX.get() else {
        return Ok(());
    };
    if sigsys::current_role() == Some(role) {
        return Ok(());
    }
    programs.install(role)?;
    sigsys::set_role(role);
    Ok(())
}

/// [`enter`] for a thread that must not run unfiltered: on failure the process
/// stops (a thread of a sandboxed server without its filter is the hole the
/// sandbox exists to close).
pub fn enter_or_exit(role: Role) {
    if let Err(e) = enter(role) {
        eprintln!("udrive: {e}; stopping");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests;
