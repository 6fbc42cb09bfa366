//! Which system calls each thread role may make, and with which arguments.
//! docs/security.md's table is generated from here ([`markdown_table`]; a test
//! keeps the two equal).

use libc::c_long;

/// What a thread does, and so which system calls it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Start-up, configuration, the control socket, the handover and the
    /// spawner: opens files and sockets, starts threads and the successor. Every
    /// other role's calls are a subset (threads inherit the spawner's filter).
    Control,
    /// The Prometheus endpoint: accepts TCP connections, answers GETs.
    Metrics,
    /// Accepts vfio-user connections and hands each to a connection thread.
    VfuHub,
    /// One vfio-user client's messages: maps the guest memory it sends, rings
    /// interrupts, stops its controller.
    VfuConn,
    /// An NVMe controller's admin queue and its background commands (format).
    NvmeAdmin,
    /// A polling reactor: queues, io_uring submissions and completions.
    Reactor,
    /// A vhost-user-blk device's protocol thread: messages, guest memory maps,
    /// the migration dirty log.
    VhostDevice,
    /// A vhost-user-blk device's kick thread: waits on queue eventfds.
    VhostKick,
}

impl Role {
    pub const ALL: [Role; 8] = [
        Role::Control,
        Role::Metrics,
        Role::VfuHub,
        Role::VfuConn,
        Role::NvmeAdmin,
        Role::Reactor,
        Role::VhostDevice,
        Role::VhostKick,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Role::Control => "control",
            Role::Metrics => "metrics",
            Role::VfuHub => "vfio-user hub",
            Role::VfuConn => "vfio-user connection",
            Role::NvmeAdmin => "nvme admin",
            Role::Reactor => "reactor",
            Role::VhostDevice => "vhost-user device",
            Role::VhostKick => "vhost-user kick",
        }
    }

    /// The threads of this role, by the names `ps -L` and the kernel's log show.
    pub fn threads(self) -> &'static str {
        match self {
            Role::Control => "main, `spawner`, `rpc-*`, `takeover-rpc`, `successor-wait`, `job-*`, `nbd-accept`, `nbd-conn-*`, librados/librbd threads",
            Role::Metrics => "`metrics-http`",
            Role::VfuHub => "`vfu-hub`",
            Role::VfuConn => "`vfu-<socket>`, `vfu-stop`",
            Role::NvmeAdmin => "`nvme-admin`, `nvme-admin-dma`, `nvme-format`",
            Role::Reactor => "`reactor<N>`",
            Role::VhostDevice => "`vhost-blk`",
            Role::VhostKick => "`vhost-blk-kick`",
        }
    }

    pub(crate) fn index(self) -> usize {
        Self::ALL.iter().position(|&r| r == self).unwrap_or(0)
    }

    pub(crate) fn from_index(i: usize) -> Option<Role> {
        Self::ALL.get(i).copied()
    }
}

/// A system call allowed when its arguments pass a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Any arguments.
    Any,
    /// `mmap`/`mprotect` without `PROT_EXEC`: no new code.
    NoExec,
    /// `openat` read-only and without creating: glibc's allocator reads
    /// `/sys/devices/system/cpu/online` when a thread first allocates.
    ReadOnlyOpen,
    /// `ioctl` with one of the few requests a socket thread asks.
    SocketIoctl,
    /// `prctl` naming the thread, nothing else.
    ThreadName,
    /// `socketpair` of the Unix family.
    UnixOnly,
    /// `socket` of a Unix, IP or netlink family (Ceph and the metrics endpoint
    /// need IP; glibc's interface listing needs netlink).
    KnownFamily,
}

/// Every Rust thread's runtime: stacks, locks, signals' masks, the allocator,
/// logging to stderr or the journal, the clock.
const RUNTIME: &[(c_long, Check)] = &[
    (libc::SYS_futex, Check::Any),
    (libc::SYS_mmap, Check::NoExec),
    (libc::SYS_mprotect, Check::NoExec),
    (libc::SYS_munmap, Check::Any),
    (libc::SYS_madvise, Check::Any),
    (libc::SYS_mremap, Check::Any),
    (libc::SYS_brk, Check::Any),
    (libc::SYS_rseq, Check::Any),
    (libc::SYS_rt_sigprocmask, Check::Any),
    (libc::SYS_rt_sigreturn, Check::Any),
    (libc::SYS_sigaltstack, Check::Any),
    (libc::SYS_sched_getaffinity, Check::Any),
    (libc::SYS_sched_yield, Check::Any),
    (libc::SYS_set_robust_list, Check::Any),
    (libc::SYS_gettid, Check::Any),
    (libc::SYS_getpid, Check::Any),
    (libc::SYS_exit, Check::Any),
    (libc::SYS_exit_group, Check::Any),
    (libc::SYS_restart_syscall, Check::Any),
    (libc::SYS_clock_gettime, Check::Any),
    (libc::SYS_clock_nanosleep, Check::Any),
    (libc::SYS_nanosleep, Check::Any),
    (libc::SYS_getrandom, Check::Any),
    (libc::SYS_write, Check::Any),
    (libc::SYS_writev, Check::Any),
    (libc::SYS_sendmsg, Check::Any),
    (libc::SYS_sendto, Check::Any),
    (libc::SYS_close, Check::Any),
    (libc::SYS_fcntl, Check::Any),
    (libc::SYS_openat, Check::ReadOnlyOpen),
    (libc::SYS_read, Check::Any),
    (libc::SYS_prctl, Check::ThreadName),
    (libc::SYS_newfstatat, Check::Any),
    (libc::SYS_statx, Check::Any),
    (libc::SYS_fstatfs, Check::Any),
    // std's `set_nonblocking` is ioctl(FIONBIO).
    (libc::SYS_ioctl, Check::SocketIoctl),
];

const METRICS: &[(c_long, Check)] = &[
    (libc::SYS_accept4, Check::Any),
    (libc::SYS_poll, Check::Any),
    (libc::SYS_recvfrom, Check::Any),
    (libc::SYS_setsockopt, Check::Any),
    (libc::SYS_shutdown, Check::Any),
];

const VFU_HUB: &[(c_long, Check)] = &[
    (libc::SYS_accept4, Check::Any),
    (libc::SYS_poll, Check::Any),
    (libc::SYS_recvfrom, Check::Any),
    (libc::SYS_setsockopt, Check::Any),
];

/// The vfio-user connection also brings up its controller's queues, whose
/// backends may set up their io_uring rings there.
const VFU_CONN: &[(c_long, Check)] = &[
    (libc::SYS_poll, Check::Any),
    (libc::SYS_recvmsg, Check::Any),
    (libc::SYS_recvfrom, Check::Any),
    (libc::SYS_shutdown, Check::Any),
    (libc::SYS_dup, Check::Any),
    (libc::SYS_io_uring_setup, Check::Any),
    (libc::SYS_io_uring_register, Check::Any),
    (libc::SYS_io_uring_enter, Check::Any),
    (libc::SYS_eventfd2, Check::Any),
    (libc::SYS_ftruncate, Check::Any),
    // The channel of a client whose memory is not shared (DMA by messages).
    (libc::SYS_socketpair, Check::UnixOnly),
    // What an interrupt eventfd is (/proc/self/fd/N).
    (libc::SYS_readlink, Check::Any),
];

/// `recvmsg`: replies of a client whose memory is not shared (DMA by messages).
const NVME_ADMIN: &[(c_long, Check)] = &[
    (libc::SYS_recvmsg, Check::Any),
    (libc::SYS_poll, Check::Any),
    (libc::SYS_io_uring_setup, Check::Any),
    (libc::SYS_io_uring_register, Check::Any),
    (libc::SYS_io_uring_enter, Check::Any),
    (libc::SYS_eventfd2, Check::Any),
    (libc::SYS_fsync, Check::Any),
    (libc::SYS_fdatasync, Check::Any),
    (libc::SYS_fallocate, Check::Any),
    (libc::SYS_pread64, Check::Any),
    (libc::SYS_pwrite64, Check::Any),
    (libc::SYS_preadv2, Check::Any),
    (libc::SYS_pwritev2, Check::Any),
];

/// `shutdown`: a reactor that finds a client's memory gone disconnects it;
/// `recvmsg`: DMA replies of a client whose memory is not shared;
/// `recvfrom`: the replies of the NBD export a mirror to another host
/// writes guest writes through to.
const REACTOR: &[(c_long, Check)] = &[
    (libc::SYS_recvmsg, Check::Any),
    (libc::SYS_recvfrom, Check::Any),
    (libc::SYS_shutdown, Check::Any),
    (libc::SYS_epoll_ctl, Check::Any),
    (libc::SYS_epoll_wait, Check::Any),
    (libc::SYS_io_uring_enter, Check::Any),
    (libc::SYS_io_uring_register, Check::Any),
    (libc::SYS_ppoll, Check::Any),
    (libc::SYS_poll, Check::Any),
    (libc::SYS_sched_setaffinity, Check::Any),
    (libc::SYS_fsync, Check::Any),
    (libc::SYS_fdatasync, Check::Any),
    (libc::SYS_fallocate, Check::Any),
    (libc::SYS_pread64, Check::Any),
    (libc::SYS_pwrite64, Check::Any),
    (libc::SYS_preadv, Check::Any),
    (libc::SYS_pwritev, Check::Any),
    // The file backend's inline engine (page cache, tmpfs).
    (libc::SYS_preadv2, Check::Any),
    (libc::SYS_pwritev2, Check::Any),
    (libc::SYS_eventfd2, Check::Any),
];

const VHOST_DEVICE: &[(c_long, Check)] = &[
    (libc::SYS_accept4, Check::Any),
    (libc::SYS_poll, Check::Any),
    (libc::SYS_epoll_create1, Check::Any),
    (libc::SYS_epoll_ctl, Check::Any),
    (libc::SYS_epoll_wait, Check::Any),
    (libc::SYS_eventfd2, Check::Any),
    (libc::SYS_recvmsg, Check::Any),
    (libc::SYS_recvfrom, Check::Any),
    (libc::SYS_getsockopt, Check::Any),
    (libc::SYS_setsockopt, Check::Any),
    (libc::SYS_shutdown, Check::Any),
    (libc::SYS_ioctl, Check::SocketIoctl),
    (libc::SYS_memfd_create, Check::Any),
    (libc::SYS_ftruncate, Check::Any),
    (libc::SYS_rt_sigaction, Check::Any),
    (libc::SYS_io_uring_setup, Check::Any),
    (libc::SYS_io_uring_register, Check::Any),
    (libc::SYS_io_uring_enter, Check::Any),
    // A qcow2 disk's writer claim, taken and given up on this thread when a
    // migrating VM starts or leaves: its metadata read again or written back
    // through descriptors opened on the control path (io_uring reaches the
    // same files from here already).
    (libc::SYS_pread64, Check::Any),
    (libc::SYS_pwrite64, Check::Any),
    (libc::SYS_fdatasync, Check::Any),
];

const VHOST_KICK: &[(c_long, Check)] = &[
    (libc::SYS_epoll_wait, Check::Any),
    (libc::SYS_epoll_ctl, Check::Any),
    (libc::SYS_poll, Check::Any),
];

/// What the control role needs beyond every other role's calls: files,
/// sockets, processes (the successor, `--supervise`'s child), signals.
const CONTROL: &[(c_long, Check)] = &[
    (libc::SYS_mmap, Check::Any),
    (libc::SYS_mprotect, Check::Any),
    (libc::SYS_openat, Check::Any),
    (libc::SYS_ioctl, Check::Any),
    (libc::SYS_socket, Check::KnownFamily),
    (libc::SYS_socketpair, Check::Any),
    (libc::SYS_bind, Check::Any),
    (libc::SYS_listen, Check::Any),
    (libc::SYS_connect, Check::Any),
    (libc::SYS_getsockname, Check::Any),
    (libc::SYS_getpeername, Check::Any),
    (libc::SYS_prctl, Check::Any),
    (libc::SYS_clone, Check::Any),
    (libc::SYS_clone3, Check::Any),
    (libc::SYS_execve, Check::Any),
    (libc::SYS_wait4, Check::Any),
    (libc::SYS_waitid, Check::Any),
    (libc::SYS_kill, Check::Any),
    (libc::SYS_tgkill, Check::Any),
    (libc::SYS_setpgid, Check::Any),
    (libc::SYS_rt_sigaction, Check::Any),
    (libc::SYS_set_tid_address, Check::Any),
    (libc::SYS_arch_prctl, Check::Any),
    (libc::SYS_access, Check::Any),
    (libc::SYS_faccessat, Check::Any),
    (libc::SYS_faccessat2, Check::Any),
    (libc::SYS_readlink, Check::Any),
    (libc::SYS_readlinkat, Check::Any),
    (libc::SYS_getcwd, Check::Any),
    (libc::SYS_mkdir, Check::Any),
    (libc::SYS_mkdirat, Check::Any),
    (libc::SYS_rmdir, Check::Any),
    (libc::SYS_unlink, Check::Any),
    (libc::SYS_unlinkat, Check::Any),
    (libc::SYS_rename, Check::Any),
    (libc::SYS_renameat, Check::Any),
    (libc::SYS_renameat2, Check::Any),
    (libc::SYS_chmod, Check::Any),
    (libc::SYS_fchmod, Check::Any),
    (libc::SYS_chown, Check::Any),
    (libc::SYS_fchown, Check::Any),
    (libc::SYS_lseek, Check::Any),
    (libc::SYS_fstat, Check::Any),
    (libc::SYS_fstatfs, Check::Any),
    (libc::SYS_statfs, Check::Any),
    (libc::SYS_getdents64, Check::Any),
    (libc::SYS_flock, Check::Any),
    (libc::SYS_dup2, Check::Any),
    (libc::SYS_dup3, Check::Any),
    (libc::SYS_pipe2, Check::Any),
    (libc::SYS_prlimit64, Check::Any),
    (libc::SYS_getuid, Check::Any),
    (libc::SYS_geteuid, Check::Any),
    (libc::SYS_getgid, Check::Any),
    (libc::SYS_getegid, Check::Any),
    (libc::SYS_getppid, Check::Any),
    (libc::SYS_uname, Check::Any),
    (libc::SYS_sysinfo, Check::Any),
    (libc::SYS_getrusage, Check::Any),
    (libc::SYS_getpriority, Check::Any),
    (libc::SYS_setpriority, Check::Any),
    (libc::SYS_sched_getparam, Check::Any),
    (libc::SYS_sched_setscheduler, Check::Any),
    (libc::SYS_sched_getscheduler, Check::Any),
    (libc::SYS_membarrier, Check::Any),
    (libc::SYS_timerfd_create, Check::Any),
    (libc::SYS_timerfd_settime, Check::Any),
    (libc::SYS_epoll_pwait, Check::Any),
    (libc::SYS_select, Check::Any),
    (libc::SYS_pselect6, Check::Any),
    (libc::SYS_readv, Check::Any),
    (libc::SYS_sendmmsg, Check::Any),
    (libc::SYS_recvmmsg, Check::Any),
    (libc::SYS_sync_file_range, Check::Any),
    (libc::SYS_copy_file_range, Check::Any),
    (libc::SYS_mincore, Check::Any),
    (libc::SYS_mlock, Check::Any),
    (libc::SYS_munlock, Check::Any),
    (libc::SYS_get_mempolicy, Check::Any),
    (libc::SYS_utimensat, Check::Any),
    // A thread the spawner starts adds its role's filter: only ever more narrow.
    (libc::SYS_seccomp, Check::Any),
    // librados' messenger.
    (libc::SYS_epoll_create, Check::Any),
    // libcryptsetup keeps volume keys in the kernel keyring where it can.
    (libc::SYS_request_key, Check::Any),
    (libc::SYS_add_key, Check::Any),
    (libc::SYS_keyctl, Check::Any),
    // libcryptsetup sets the mode of the header files it makes (`create=on`).
    (libc::SYS_umask, Check::Any),
];

fn lists(role: Role) -> &'static [&'static [(c_long, Check)]] {
    match role {
        Role::Control => &[
            RUNTIME,
            METRICS,
            VFU_HUB,
            VFU_CONN,
            NVME_ADMIN,
            REACTOR,
            VHOST_DEVICE,
            VHOST_KICK,
            CONTROL,
        ],
        Role::Metrics => &[RUNTIME, METRICS],
        Role::VfuHub => &[RUNTIME, VFU_HUB],
        Role::VfuConn => &[RUNTIME, VFU_CONN],
        Role::NvmeAdmin => &[RUNTIME, NVME_ADMIN],
        Role::Reactor => &[RUNTIME, REACTOR],
        Role::VhostDevice => &[RUNTIME, VHOST_DEVICE],
        Role::VhostKick => &[RUNTIME, VHOST_KICK],
    }
}

/// The calls `role` may make, each with the loosest check any of its lists
/// gives it (the control role's unrestricted `mmap` wins over the runtime's
/// no-exec one), sorted by number.
pub fn allowed_syscalls(role: Role) -> Vec<(c_long, Check)> {
    let mut all: Vec<(c_long, Check)> = Vec::new();
    for list in lists(role) {
        for &(nr, check) in *list {
            match all.iter_mut().find(|(n, _)| *n == nr) {
                Some(entry) if check == Check::Any => entry.1 = Check::Any,
                Some(_) => {}
                None => all.push((nr, check)),
            }
        }
    }
    all.sort_by_key(|&(nr, _)| nr);
    all
}

impl Check {
    fn note(self) -> &'static str {
        match self {
            Check::Any => "",
            Check::NoExec => " (no PROT_EXEC)",
            Check::ReadOnlyOpen => " (read-only)",
            Check::SocketIoctl => " (FIONREAD, FIONBIO, FIOCLEX)",
            Check::ThreadName => " (PR_SET_NAME, PR_GET_NAME)",
            Check::KnownFamily => " (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)",
            Check::UnixOnly => " (AF_UNIX)",
        }
    }
}

/// The table of docs/security.md: each role, its threads and its calls.
pub fn markdown_table() -> String {
    let mut out = String::from("| Role | Threads | System calls |\n|---|---|---|\n");
    for role in Role::ALL {
        let calls = described(role);
        let calls = if role == Role::Control {
            format!("every other role's, and: {}", control_only(&calls))
        } else {
            calls.join(", ")
        };
        out += &format!("| {} | {} | {calls} |\n", role.name(), role.threads());
    }
    out
}

/// The control role's calls (with their checks) that no other role has.
fn control_only(control: &[String]) -> String {
    let others: Vec<String> = Role::ALL
        .iter()
        .filter(|&&r| r != Role::Control)
        .flat_map(|&r| described(r))
        .collect();
    control
        .iter()
        .filter(|c| !others.contains(c))
        .cloned()
        .collect::<Vec<_>>()
        .join(", ")
}

/// `role`'s calls by name, each with its check.
fn described(role: Role) -> Vec<String> {
    let names = crate::syscall_names::NAMES;
    allowed_syscalls(role)
        .into_iter()
        .map(|(nr, check)| {
            let name = names.iter().find(|(n, _)| i64::from(*n) == nr);
            format!("{}{}", name.map_or("?", |(_, s)| s), check.note())
        })
        .collect()
}
