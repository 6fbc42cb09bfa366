//! The report of a forbidden call. With `Mode::On` a filter answers a call its
//! role does not allow with `SIGSYS`; this handler writes which role made which
//! call and stops the process. It runs on the offending thread, under that
//! thread's filter, so it makes only calls every role allows (`write`,
//! `exit_group`) and formats into a buffer on its stack.

use std::cell::Cell;
use std::io;

use crate::policy::Role;
use crate::syscall_names::NAMES;

/// No role: a thread a library started, under its creator's filter.
const NO_ROLE: usize = usize::MAX;

/// The exit status of a process stopped for a forbidden call (128 + SIGSYS, as a
/// shell shows a death by that signal).
const EXIT_STATUS: i32 = 128 + libc::SIGSYS;

thread_local! {
    static ROLE: Cell<usize> = const { Cell::new(NO_ROLE) };
}

pub(crate) fn set_role(role: Role) {
    ROLE.with(|r| r.set(role.index()));
}

pub(crate) fn current_role() -> Option<Role> {
    ROLE.try_with(Cell::get).ok().and_then(Role::from_index)
}

pub(crate) fn install() -> io::Result<()> {
    // SAFETY: a zeroed sigaction is a valid value for every field; the handler
    // is an `extern "C"` function of the signature SA_SIGINFO asks for, and it
    // only reads the siginfo the kernel passes and calls async-signal-safe
    // functions.
    let rc = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            on_sigsys;
        action.sa_sigaction = handler as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut())
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The system call a `SIGSYS` from seccomp reports (`si_syscall`).
fn syscall_of(info: &libc::siginfo_t) -> i32 {
    #[repr(C)]
    struct SigsysFields {
        _signo: i32,
        _errno: i32,
        _code: i32,
        _pad: i32,
        _call_addr: usize,
        syscall: i32,
        _arch: u32,
    }
    // SAFETY: siginfo_t is 128 bytes and, for SIGSYS, starts with exactly these
    // fields (the kernel's `_sigsys` member of its union).
    unsafe { (*(info as *const libc::siginfo_t).cast::<SigsysFields>()).syscall }
}

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let nr = unsafe { info.as_ref() }.map_or(-1, syscall_of);
    let mut line = Line::default();
    line.push(b"udrive: seccomp: the ");
    match current_role() {
        Some(role) => line.push(role.name().as_bytes()),
        None => line.push(b"unnamed (library)"),
    }
    line.push(b" thread made the system call ");
    let name = NAMES.iter().find(|(n, _)| i32::from(*n) == nr);
    line.push(name.map_or(&b"unknown"[..], |(_, s)| s.as_bytes()));
    line.push(b" (");
    line.number(nr);
    line.push(b"), which its role does not allow; stopping\n");
    // SAFETY: writes a buffer this frame owns to stderr, then ends the process:
    // both are async-signal-safe.
    unsafe {
        libc::write(2, line.buf.as_ptr().cast(), line.len);
        libc::_exit(EXIT_STATUS);
    }
}

/// A fixed buffer: the handler must not allocate.
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Self {
            buf: [0; 256],
            len: 0,
        }
    }
}

impl Line {
    fn push(&mut self, bytes: &[u8]) {
        let room = self.buf.len() - self.len;
        let n = bytes.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    fn number(&mut self, n: i32) {
        let mut digits = [0u8; 11];
        let mut i = digits.len();
        let mut v = n.unsigned_abs();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        if n < 0 {
            self.push(b"-");
        }
        self.push(&digits[i..]);
    }
}
