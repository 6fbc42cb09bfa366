use std::process::Command;

use super::*;
use crate::policy::Check;

#[test]
fn control_allows_every_call_of_every_other_role() {
    let control = allowed_syscalls(Role::Control);
    for role in Role::ALL {
        for (nr, check) in allowed_syscalls(role) {
            let c = control.iter().find(|(n, _)| *n == nr);
            assert!(
                matches!(c, Some((_, k)) if *k == Check::Any || *k == check),
                "{} allows {nr} ({check:?}) but control allows {c:?}",
                role.name()
            );
        }
    }
}

#[test]
fn no_data_plane_role_starts_threads_processes_or_code() {
    for role in Role::ALL.into_iter().filter(|&r| r != Role::Control) {
        let allowed = allowed_syscalls(role);
        for nr in [
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_execve,
            libc::SYS_socket,
        ] {
            assert!(
                !allowed.iter().any(|(n, _)| *n == nr),
                "{} allows {nr}",
                role.name()
            );
        }
        let mmap = allowed.iter().find(|(n, _)| *n == libc::SYS_mmap);
        assert_eq!(
            mmap,
            Some(&(libc::SYS_mmap, Check::NoExec)),
            "{}",
            role.name()
        );
    }
}

#[test]
fn every_program_compiles_in_both_modes() {
    for mode in [Mode::On, Mode::Log] {
        let programs = filter::Programs::build(mode).unwrap();
        for role in Role::ALL {
            let len = programs.len(role);
            assert!(
                len > 10 && len < 4096,
                "{}: {len} instructions",
                role.name()
            );
        }
    }
}

/// What a child process does, by `SANDBOX_TEST_CHILD`: configures the sandbox,
/// starts a thread of a role and makes a call in it.
#[test]
fn child() {
    let Ok(what) = std::env::var("SANDBOX_TEST_CHILD") else {
        return;
    };
    let (mode, role, call) = {
        let mut p = what.split(':');
        let mode: Mode = p.next().unwrap().parse().unwrap();
        let role = Role::ALL[p.next().unwrap().parse::<usize>().unwrap()];
        (mode, role, p.next().unwrap().to_owned())
    };
    configure(mode).unwrap();
    let t = spawn(role, "under-test".into(), move || forbidden_call(&call)).unwrap();
    let rc = t.join().unwrap();
    println!("CALL RETURNED {rc}");
}

fn forbidden_call(call: &str) -> i64 {
    match call {
        // SAFETY: ptrace(PTRACE_PEEKUSER) of pid 0 fails harmlessly when allowed.
        "ptrace" => unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_PEEKUSER, 0, 0, 0) },
        "thread" => std::thread::spawn(|| ()).join().map_or(-1, |_| 0),
        // SAFETY: an anonymous mapping the kernel places; unmapped at once.
        "exec-map" => unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p != libc::MAP_FAILED {
                libc::munmap(p, 4096);
            }
            0
        },
        _ => -1,
    }
}

fn run_child(mode: Mode, role: Role, call: &str) -> (Option<i32>, String, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "tests::child", "--nocapture", "--test-threads=1"])
        .env(
            "SANDBOX_TEST_CHILD",
            format!("{mode}:{}:{call}", role.index()),
        )
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

#[test]
fn a_forbidden_call_stops_the_process_and_names_role_and_call() {
    for role in Role::ALL {
        let (code, _, stderr) = run_child(Mode::On, role, "ptrace");
        assert_eq!(code, Some(128 + libc::SIGSYS), "{}: {stderr}", role.name());
        let want = format!(
            "the {} thread made the system call ptrace (101)",
            role.name()
        );
        assert!(stderr.contains(&want), "{}: {stderr}", role.name());
    }
}

#[test]
fn data_plane_threads_cannot_start_threads_or_map_code() {
    let (code, _, stderr) = run_child(Mode::On, Role::Reactor, "exec-map");
    assert_eq!(code, Some(128 + libc::SIGSYS), "{stderr}");
    assert!(
        stderr.contains("the reactor thread made the system call mmap (9)"),
        "{stderr}"
    );
    // glibc blocks every signal while it creates a thread, so the kernel, finding
    // SIGSYS blocked, ends the process with the signal itself and no line.
    let (code, stdout, stderr) = run_child(Mode::On, Role::Reactor, "thread");
    assert!(!stdout.contains("CALL RETURNED"), "{stdout}");
    assert!(
        code == Some(128 + libc::SIGSYS) || code.is_none(),
        "{code:?}: {stderr}"
    );
    let (code, stdout, stderr) = run_child(Mode::On, Role::Control, "thread");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("CALL RETURNED 0"), "{stdout}");
}

#[test]
fn log_mode_lets_the_call_through() {
    let (code, stdout, stderr) = run_child(Mode::Log, Role::Reactor, "thread");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("CALL RETURNED 0"), "{stdout}");
}

/// docs/security.md holds the table the code generates; `UPDATE_DOCS=1` rewrites
/// it there.
#[test]
fn docs_hold_the_generated_table() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/security.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let (begin, end) = ("<!-- seccomp-table -->\n", "<!-- /seccomp-table -->");
    let start = doc
        .find(begin)
        .expect("docs/security.md has no table marker")
        + begin.len();
    let stop = doc[start..].find(end).expect("no end marker") + start;
    let table = markdown_table();
    if std::env::var_os("UPDATE_DOCS").is_some() {
        let new = format!("{}{table}{}", &doc[..start], &doc[stop..]);
        std::fs::write(path, new).unwrap();
        return;
    }
    assert_eq!(
        doc[start..stop],
        table,
        "run UPDATE_DOCS=1 cargo test -p sandbox"
    );
}

/// Landlock (where the kernel has it): after `restrict_files`, a file beneath an
/// allowed directory opens and one elsewhere does not.
#[test]
fn files_outside_the_rules_cannot_be_opened() {
    let allowed = std::env::temp_dir().join(format!("sandbox-test-in-{}", std::process::id()));
    let outside = std::env::temp_dir().join(format!("sandbox-test-out-{}", std::process::id()));
    for d in [&allowed, &outside] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("f"), b"x").unwrap();
    }
    let child = std::thread::spawn({
        let (allowed, outside) = (allowed.clone(), outside.clone());
        move || {
            let rules = FsRules {
                read_write: vec![allowed.clone()],
                read_only: Vec::new(),
            };
            let enforced = restrict_files(&rules).unwrap();
            let inside = std::fs::OpenOptions::new()
                .write(true)
                .open(allowed.join("f"));
            let elsewhere = std::fs::File::open(outside.join("f"));
            (enforced, inside.is_ok(), elsewhere.map_err(|e| e.kind()))
        }
    });
    let (enforced, inside, elsewhere) = child.join().unwrap();
    for d in [&allowed, &outside] {
        let _ = std::fs::remove_dir_all(d);
    }
    assert!(inside);
    if enforced == Enforced::Not {
        eprintln!("this kernel has no Landlock: nothing to check");
        return;
    }
    assert_eq!(elsewhere.err(), Some(std::io::ErrorKind::PermissionDenied));
}
