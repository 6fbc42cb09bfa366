//! Process-wide steps of the sandbox: running as an unprivileged user, no core
//! dumps, no inherited descriptors.

use std::ffi::CString;
use std::io;

use nix::unistd::{Gid, Group, Uid, User};

/// Who the server became.
#[derive(Debug, Clone, Copy)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
}

/// Switches the process to `user` (its primary group or `group`, and the user's
/// supplementary groups, e.g. `kvm`) for good: real, effective and saved ids,
/// so no capability is left. Must run before the process starts threads.
pub fn become_user(user: &str, group: Option<&str>) -> io::Result<Identity> {
    let not_found = |what: &str, name: &str| {
        io::Error::new(io::ErrorKind::NotFound, format!("no {what} named {name:?}"))
    };
    let u = User::from_name(user)
        .map_err(io::Error::from)?
        .ok_or_else(|| not_found("user", user))?;
    let gid = match group {
        Some(g) => {
            Group::from_name(g)
                .map_err(io::Error::from)?
                .ok_or_else(|| not_found("group", g))?
                .gid
        }
        None => u.gid,
    };
    let name = CString::new(user).map_err(|_| not_found("user", user))?;
    nix::unistd::initgroups(&name, gid).map_err(io::Error::from)?;
    nix::unistd::setresgid(gid, gid, gid).map_err(io::Error::from)?;
    nix::unistd::setresuid(u.uid, u.uid, u.uid).map_err(io::Error::from)?;
    if nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)).is_ok()
        && !u.uid.is_root()
    {
        return Err(io::Error::other("could regain root after dropping it"));
    }
    Ok(Identity {
        uid: u.uid.as_raw(),
        gid: Gid::as_raw(gid),
    })
}

/// No core dumps and no ptrace by the same user: a dump would hold guests'
/// memory (memfd mappings are dumped by default) and keys.
pub fn no_core_dumps() -> io::Result<()> {
    // SAFETY: prctl(PR_SET_DUMPABLE, 0) takes no pointers.
    let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Closes every descriptor from 3 up that the process inherited, as a jailer
/// does: what a parent left open (by accident or not) is not the server's to use.
/// Call it first thing, before the process opens anything of its own.
pub fn close_inherited_fds() -> io::Result<()> {
    // SAFETY: close_range takes no pointers; descriptors from 3 up are not yet
    // owned by anything in this process (the caller's contract).
    let rc = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
