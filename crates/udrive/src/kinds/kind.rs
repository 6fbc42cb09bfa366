//! What a backend kind is: its parser ([`BackendKind`]), a parsed spec
//! ([`KindSpec`]) and what opening one needs from the running process
//! ([`OpenEnv`]). The kinds themselves are the sibling modules.

use std::fmt::Debug;
use std::sync::Arc;

use anyhow::Result;
use bdev::BlockDevice;

use crate::size::parse_size;

pub trait BackendKind: Sync {
    /// The word before the colon.
    fn name(&self) -> &'static str;
    /// A spec to show in error messages, e.g. `file:/var/lib/vm1.img`.
    fn example(&self) -> &'static str;
    /// Options of this kind only (`key` of `key=value`, or a bare `key`).
    fn options(&self) -> &'static [&'static str] {
        &[]
    }
    /// Whether `ro` applies (a kind whose data is gone on exit has no use for it).
    fn read_only_ok(&self) -> bool {
        false
    }
    /// Parses the argument after the colon and this kind's options (`block_size`:
    /// the namespace's `bs=`, if given).
    fn parse(
        &self,
        arg: &str,
        opts: &[(&str, &str)],
        block_size: Option<u32>,
    ) -> Result<Arc<dyn KindSpec>, String>;
}

/// What an opened namespace keeps its data in, when other namespaces may use it
/// too.
pub struct Backing {
    /// The resource: namespaces on the same one are checked for overlapping slices
    /// (a canonical file path).
    pub resource: String,
    /// Namespaces with the same key share one opened device (the resource plus the
    /// options the device is opened with).
    pub open_key: String,
}

/// A parsed backend of one kind.
pub trait KindSpec: Debug + Send + Sync {
    /// The spec written back in its shortest form (`ram:1G`), or None to keep the
    /// text the user gave.
    fn canonical(&self) -> Option<String>;
    /// What the data is kept in, if namespaces may share it; resolving it can fail
    /// (a file that does not exist).
    fn backing(&self) -> Result<Option<Backing>>;
    /// What `udrive check` can find wrong without opening the device (a file
    /// that is missing or not writable, a Ceph configuration that cannot be read),
    /// pushed onto `problems`; the backend's size when it is known without opening
    /// it, so that slices can be checked against it.
    fn check(&self, read_only: bool, problems: &mut Vec<String>) -> Option<u64> {
        let _ = (read_only, problems);
        None
    }
    /// The files and directories this backend opens while the server runs, each
    /// with whether it writes there (the sandbox's file rules, docs/security.md).
    fn fs_paths(&self) -> Vec<(std::path::PathBuf, bool)> {
        Vec::new()
    }
    /// What `udrive check` finds by contacting what the spec names (a Ceph cluster:
    /// reachable, the image there), unless told to stay offline: the backend's
    /// size, or why it cannot be reached. Kinds with nothing remote: `Ok(None)`.
    fn reach(&self) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Opens the device with the namespace's block size (None: the kind's default),
    /// in the environment `env` of the running process.
    fn open(
        &self,
        env: &dyn OpenEnv,
        block_size: Option<u32>,
        read_only: bool,
    ) -> Result<Arc<dyn BlockDevice>>;
    /// The spec after an online resize to `bytes`, when the size is part of it
    /// (`ram:SIZE`); `None`: the spec stays (the size is the backend's own, e.g. a
    /// file's length).
    fn resized(&self, bytes: u64) -> Option<Arc<dyn KindSpec>> {
        let _ = bytes;
        None
    }
    /// Why another process cannot take a device of this kind over (a handover),
    /// or `None` when it can reopen it by its spec and find the same data.
    fn handover_refusal(&self) -> Option<&'static str> {
        None
    }
    /// Why a disk of this kind cannot follow its VM in a live migration (its data
    /// would not be there), or `None` when a device elsewhere can open the same data.
    fn migration_refusal(&self) -> Option<&'static str> {
        self.handover_refusal()
    }
    /// Why two processes may not both write a disk of this kind (`shared`), or
    /// `None` when they may.
    fn shared_refusal(&self) -> Option<&'static str> {
        None
    }
    /// Opens the device for a destination of a live migration (`incoming`): as
    /// [`KindSpec::open`] (writable), but without taking what a writer holds
    /// (an RBD image's exclusive lock): the source still writes; the device takes
    /// it with its [`KindSpec::writer_claim`] when the VM starts here.
    fn open_incoming(
        &self,
        env: &dyn OpenEnv,
        block_size: Option<u32>,
    ) -> Result<Arc<dyn BlockDevice>> {
        self.open(env, block_size, false)
    }
    /// What keeps a second writer off bytes `range` (offset, length) of the
    /// backend `disk` (opened from this spec) while a device writes them: `None`
    /// when the kind has nothing another device could write (data in this
    /// process, or no data).
    fn writer_claim(
        &self,
        disk: &Arc<dyn BlockDevice>,
        range: (u64, u64),
    ) -> Result<Option<Arc<dyn bdev::WriterClaim>>> {
        let _ = (disk, range);
        Ok(None)
    }
}

/// What opening a backend needs from the running process rather than from its
/// spec: where a library's own threads may run, and who held the backend's
/// exclusive claims before this process (decision 0025). `serve` gives the
/// process's ([`crate::process::Process`]); tests and tools give [`NoEnv`].
pub trait OpenEnv: Send + Sync {
    /// CPUs for a backend library's own threads (librbd); empty: no restriction.
    fn library_cpus(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Whether the address of a cluster client must be recorded (with
    /// [`OpenEnv::record_owner`]) before a claim is taken with it: a successor or
    /// a supervisor outlives this process and must know whose claims it may break.
    fn records_owners(&self) -> bool {
        false
    }
    /// Records a cluster client's address before a claim is taken with it.
    fn record_owner(&self, addr: &str) {
        let _ = addr;
    }
    /// Clients known dead (earlier processes of this service) whose claims may be
    /// broken.
    fn dead_owners(&self) -> Vec<String> {
        Vec::new()
    }
    /// The secret `name` given over the control socket (`key-secret=NAME`).
    fn secret(&self, name: &str) -> Option<zeroize::Zeroizing<Vec<u8>>> {
        let _ = name;
        None
    }
    /// The image a predecessor served for the one at `spec` (a qcow2 disk whose
    /// chain a live snapshot, commit or mirror changed), while taking over.
    fn served_instead(&self, spec: &std::path::Path) -> Option<std::path::PathBuf> {
        let _ = spec;
        None
    }
}

/// An environment without a supervisor or a predecessor, with no CPU restriction.
pub struct NoEnv;

impl OpenEnv for NoEnv {}

/// A parsed kind in a namespace spec; two are equal when they write back the same.
#[derive(Clone, Debug)]
pub struct NsKind(pub Arc<dyn KindSpec>);

impl PartialEq for NsKind {
    fn eq(&self, other: &NsKind) -> bool {
        format!("{:?}", self.0) == format!("{:?}", other.0)
    }
}
impl Eq for NsKind {}

/// A size argument (`ram:SIZE`, `null:SIZE`): a non-zero multiple of the block size.
pub(super) fn parse_sized(arg: &str, block_size: Option<u32>) -> Result<u64, String> {
    let size = parse_size(arg)?;
    let bs = u64::from(block_size.unwrap_or(512));
    if size == 0 || !size.is_multiple_of(bs) {
        return Err(format!(
            "size must be a non-zero multiple of the block size {bs}"
        ));
    }
    Ok(size)
}

/// Where a file backend at `path` writes: the file itself when it is a block
/// device, else its directory (an image created there, a qcow2 overlay next to
/// its base).
pub(super) fn file_paths(path: &std::path::Path) -> Vec<(std::path::PathBuf, bool)> {
    use std::os::unix::fs::FileTypeExt;
    let device = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
    if device {
        let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        return vec![(canonical, true)];
    }
    vec![(dir_of(path), true)]
}

/// The directory `path` is in, absolute and without links where it exists.
pub fn dir_of(path: &std::path::Path) -> std::path::PathBuf {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}
