//! The roles' lists compiled to BPF with rust-vmm's seccompiler, once, before any
//! thread needs one: a thread that starts installs a finished program.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::policy::{allowed_syscalls, Check, Role};
use crate::{Error, Mode};

/// One compiled program per role, in `Role::ALL`'s order.
pub(crate) struct Programs(Vec<BpfProgram>);

impl Programs {
    pub(crate) fn build(mode: Mode) -> Result<Self, Error> {
        let mismatch = match mode {
            Mode::Log => SeccompAction::Log,
            _ => SeccompAction::Trap,
        };
        Role::ALL
            .iter()
            .map(|&role| {
                compile(role, mismatch.clone()).map_err(|source| Error::Build {
                    role: role.name(),
                    source,
                })
            })
            .collect::<Result<_, _>>()
            .map(Programs)
    }

    pub(crate) fn install(&self, role: Role) -> Result<(), Error> {
        let program = self.0.get(role.index()).ok_or(Error::Configured)?;
        seccompiler::apply_filter(program).map_err(|source| Error::Install {
            role: role.name(),
            source,
        })
    }

    /// Instructions in `role`'s program (the kernel allows 32768 in the filters
    /// a thread carries).
    #[cfg(test)]
    pub(crate) fn len(&self, role: Role) -> usize {
        self.0.get(role.index()).map_or(0, Vec::len)
    }
}

fn compile(role: Role, mismatch: SeccompAction) -> Result<BpfProgram, seccompiler::Error> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (nr, check) in allowed_syscalls(role) {
        rules.insert(nr, rules_for(check)?);
    }
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)?;
    Ok(filter.try_into()?)
}

/// A condition on the 32-bit argument `arg`.
fn arg32(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, seccompiler::Error> {
    Ok(SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        op,
        value,
    )?)
}

/// Rules any of which lets the call through (no rules: always).
fn rules_for(check: Check) -> Result<Vec<SeccompRule>, seccompiler::Error> {
    let one_of = |arg: u8, values: &[u64]| -> Result<Vec<SeccompRule>, seccompiler::Error> {
        values
            .iter()
            .map(|&v| Ok(SeccompRule::new(vec![arg32(arg, SeccompCmpOp::Eq, v)?])?))
            .collect()
    };
    match check {
        Check::Any => Ok(Vec::new()),
        Check::NoExec => {
            let no_exec = SeccompCmpOp::MaskedEq(libc::PROT_EXEC as u64);
            Ok(vec![SeccompRule::new(vec![arg32(2, no_exec, 0)?])?])
        }
        Check::ReadOnlyOpen => {
            let writes = (libc::O_ACCMODE | libc::O_CREAT | libc::O_TRUNC) as u64;
            let read_only = SeccompCmpOp::MaskedEq(writes);
            Ok(vec![SeccompRule::new(vec![arg32(2, read_only, 0)?])?])
        }
        Check::SocketIoctl => one_of(1, &[libc::FIONREAD, libc::FIONBIO, libc::FIOCLEX]),
        Check::ThreadName => one_of(0, &[libc::PR_SET_NAME, libc::PR_GET_NAME].map(|r| r as u64)),
        Check::UnixOnly => one_of(0, &[libc::AF_UNIX as u64]),
        Check::KnownFamily => one_of(
            0,
            &[
                libc::AF_UNIX,
                libc::AF_INET,
                libc::AF_INET6,
                libc::AF_NETLINK,
            ]
            .map(|f| f as u64),
        ),
    }
}
