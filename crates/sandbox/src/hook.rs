//! A way for tests to make one of the server's own threads break its role's
//! filter, so a test can show that the thread really runs under it and that the
//! report names its role. Built only with the `forbidden-call-hook` feature:
//! servers built without it have no such entry.

/// The variable naming the thread (a prefix of its name) that makes the call.
pub const VAR: &str = "UDRIVE_FORBIDDEN_CALL";

/// Makes a call no role allows (`ptrace`) when [`VAR`] is a prefix of the
/// calling thread's name; called by each sandboxed thread as it starts.
pub(crate) fn forbidden_call_if_asked() {
    let Some(want) = std::env::var_os(VAR) else {
        return;
    };
    let me = std::thread::current();
    let asked = me
        .name()
        .is_some_and(|name| name.starts_with(&*want.to_string_lossy()));
    if asked {
        // SAFETY: ptrace(PTRACE_PEEKUSER) of pid 0 touches no memory of ours; the
        // filter stops the process before the kernel looks at it.
        unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_PEEKUSER, 0, 0, 0) };
    }
}
