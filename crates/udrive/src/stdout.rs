//! Command output on stdout, and the command line it suggests. `println!` panics when the reader has gone (`udrive
//! rpc get_stats | head`); [`outln!`](crate::outln) returns [`OutputError::Closed`]
//! instead, which `main` turns into a quiet, successful exit: the reader took what
//! it wanted.

use std::io::Write;

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// The reader closed the pipe (EPIPE).
    #[error("stdout was closed by its reader")]
    Closed,
    #[error("cannot write to stdout")]
    Io(#[source] std::io::Error),
}

/// Writes `args` to stdout and flushes, so that a closed pipe is seen here and
/// not at exit.
pub fn write(args: std::fmt::Arguments<'_>) -> Result<(), OutputError> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => OutputError::Closed,
            _ => OutputError::Io(e),
        })
}

/// Whether `e` (or one of its causes) is a closed stdout.
pub fn is_closed(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| matches!(c.downcast_ref::<OutputError>(), Some(OutputError::Closed)))
}

/// `println!` that returns a `Result<(), OutputError>` instead of panicking.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::stdout::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// How to run this binary again in a command the banner suggests: `udrive` when
/// that name on the PATH is this very file (an installed package), else its full
/// path (a source build's `target/release/udrive` is not on the PATH).
pub fn self_command() -> String {
    let Some(me) = std::env::current_exe()
        .ok()
        .and_then(|p| p.canonicalize().ok())
    else {
        return "udrive".into();
    };
    let on_path = std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths)
            .any(|d| std::fs::canonicalize(d.join("udrive")).is_ok_and(|p| p == me))
    });
    if on_path {
        "udrive".into()
    } else {
        me.display().to_string()
    }
}
