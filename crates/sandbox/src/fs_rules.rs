//! Landlock: after start-up the server opens files only beneath the paths its
//! configuration names (disks, socket directories, Ceph's files) and the
//! directories the operator allows for devices added later (`--allow-dir`),
//! plus read-only system directories. Applied to the main thread before any
//! other starts, so every thread inherits it. Best effort: a kernel with an
//! older Landlock ABI enforces what it knows, one without Landlock nothing; the
//! server logs which.

use std::path::PathBuf;

use landlock::{
    path_beneath_rules, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetError,
    RulesetStatus, ABI,
};

/// Read-only for every server: libraries and their plug-ins (Ceph loads some at
/// run time), `/etc` (Ceph's configuration, users and groups), `/proc` and
/// `/sys` (the process's own state, CPUs, block devices' limits), device nodes.
pub const SYSTEM_READ_ONLY: &[&str] = &["/usr", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev"];

/// Where the server may open files after start-up.
#[derive(Debug, Default, Clone)]
pub struct FsRules {
    /// Read, write, create and remove beneath these (directories or files).
    pub read_write: Vec<PathBuf>,
    /// Read beneath these.
    pub read_only: Vec<PathBuf>,
}

/// How much of the rules the kernel enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforced {
    Fully,
    /// An older Landlock ABI: some kinds of access stay unrestricted.
    Partially,
    /// No Landlock in this kernel.
    Not,
}

/// The newest ABI whose rights udrive asks for: V3 adds truncation.
const WANTED: ABI = ABI::V3;

/// Restricts the calling thread and the threads it starts to `rules`.
pub fn restrict_files(rules: &FsRules) -> Result<Enforced, RulesetError> {
    let all = AccessFs::from_all(WANTED);
    let read = AccessFs::from_read(WANTED);
    let status = Ruleset::default()
        .handle_access(all)?
        .create()?
        .add_rules(path_beneath_rules(SYSTEM_READ_ONLY, read))?
        .add_rules(path_beneath_rules(&rules.read_only, read))?
        .add_rules(path_beneath_rules(&rules.read_write, all))?
        .restrict_self()?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => Enforced::Fully,
        RulesetStatus::PartiallyEnforced => Enforced::Partially,
        RulesetStatus::NotEnforced => Enforced::Not,
    })
}
