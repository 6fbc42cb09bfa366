//! A connection's memory table: the front end's regions mapped with vm-memory
//! (SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG), each checked against its file first
//! and registered with the SIGBUS guard before a poller may touch it (see
//! `guarded.rs`).

use std::fs::File;
use std::io;
use std::sync::Arc;

use vhost::vhost_user::message::VhostUserMemoryRegion;
use virtio_blk::Mem;
use vm_memory::{
    GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryRegion,
    GuestRegionMmap,
};

use crate::guarded::GuardedMem;

/// A connection's guest memory: the snapshot pollers load, replaced whole.
pub(crate) type Gm = GuestMemoryAtomic<Mem>;

/// Most regions a front end may map (rust-vmm vhost-user-backend's number; QEMU
/// asks for GET_MAX_MEM_SLOTS and stays below it).
pub(crate) const MAX_MEM_SLOTS: usize = 509;

/// A region as the front end described it: guest and user addresses, its place in
/// its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub gpa: u64,
    pub size: u64,
    pub uaddr: u64,
    pub offset: u64,
}

impl Mapping {
    pub fn of(r: &VhostUserMemoryRegion) -> Mapping {
        Mapping {
            gpa: r.guest_phys_addr,
            size: r.memory_size,
            uaddr: r.user_addr,
            offset: r.mmap_offset,
        }
    }

    fn region(&self) -> VhostUserMemoryRegion {
        VhostUserMemoryRegion::new(self.gpa, self.size, self.uaddr, self.offset)
    }
}

/// Why a memory region was refused.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("the region's file holds {len} bytes, fewer than offset {offset:#x} + size {size:#x}")]
    FileTooShort { len: u64, offset: u64, size: u64 },
    #[error("cannot inspect the region's file")]
    Stat(#[source] io::Error),
    #[error("cannot map the region")]
    Map(#[source] vhost::vhost_user::Error),
    #[error("the region overlaps another or is out of range")]
    Layout(#[source] vm_memory::GuestRegionCollectionError),
    #[error("the region is outside the address space")]
    Address,
    #[error("more than {MAX_MEM_SLOTS} regions")]
    TooMany,
    #[error("no region at {0:#x}")]
    NotMapped(u64),
    #[error("cannot guard the new memory table")]
    Guard(#[source] io::Error),
}

/// Refuses a region that lies past the end of its file: the first access there
/// would SIGBUS. (A file shrunk later is caught by the fault guard.)
fn check_file(m: &Mapping, file: &File) -> Result<(), MemError> {
    let meta = file.metadata().map_err(MemError::Stat)?;
    if meta.is_file()
        && m.offset
            .checked_add(m.size)
            .is_none_or(|end| end > meta.len())
    {
        return Err(MemError::FileTooShort {
            len: meta.len(),
            offset: m.offset,
            size: m.size,
        });
    }
    Ok(())
}

fn map(m: &Mapping, file: File) -> Result<Arc<GuestRegionMmap<()>>, MemError> {
    check_file(m, &file)?;
    let mapped = m.region().mmap_region::<()>(file).map_err(MemError::Map)?;
    GuestRegionMmap::new(mapped, GuestAddress(m.gpa))
        .map(Arc::new)
        .ok_or(MemError::Address)
}

/// Installs `new` as the connection's memory `mem` and guards it; the pollers
/// take it up once guarded (requests in flight keep the old snapshot alive).
fn install(mem: &Gm, guarded: &GuardedMem, new: Mem) -> Result<(), MemError> {
    mem.lock().unwrap_or_else(|e| e.into_inner()).replace(new);
    guarded
        .sync(mem.memory().into_inner())
        .map_err(MemError::Guard)
}

/// SET_MEM_TABLE: the whole table replaced.
pub(crate) fn set_table(
    mem: &Gm,
    guarded: &GuardedMem,
    table: &[Mapping],
    files: Vec<File>,
) -> Result<(), MemError> {
    if table.len() > MAX_MEM_SLOTS {
        return Err(MemError::TooMany);
    }
    // vm-memory wants the regions in address order; a table built with
    // ADD_MEM_REG (then saved) is in the order they came.
    let mut pairs: Vec<(&Mapping, File)> = table.iter().zip(files).collect();
    pairs.sort_by_key(|(m, _)| m.gpa);
    let mut regions = Vec::with_capacity(pairs.len());
    for (m, f) in pairs {
        regions.push(map(m, f)?);
    }
    let new = Mem::from_arc_regions(regions).map_err(MemError::Layout)?;
    install(mem, guarded, new)
}

/// ADD_MEM_REG.
pub(crate) fn add(
    mem: &Gm,
    guarded: &GuardedMem,
    count: usize,
    m: &Mapping,
    file: File,
) -> Result<(), MemError> {
    if count >= MAX_MEM_SLOTS {
        return Err(MemError::TooMany);
    }
    let region = map(m, file)?;
    let new = mem
        .memory()
        .insert_region(region)
        .map_err(MemError::Layout)?;
    install(mem, guarded, new)
}

/// REM_MEM_REG.
pub(crate) fn remove(mem: &Gm, guarded: &GuardedMem, m: &Mapping) -> Result<(), MemError> {
    let (new, _) = mem
        .memory()
        .remove_region(GuestAddress(m.gpa), m.size)
        .map_err(|_| MemError::NotMapped(m.gpa))?;
    install(mem, guarded, new)
}

/// The file behind the region at `gpa` (a handover hands a copy over).
pub(crate) fn file_of(mem: &Gm, gpa: u64) -> io::Result<File> {
    let mem = mem.memory();
    let r = mem
        .find_region(GuestAddress(gpa))
        .ok_or_else(|| io::Error::other(MemError::NotMapped(gpa)))?;
    r.file_offset()
        .ok_or_else(|| io::Error::other(MemError::NotMapped(gpa)))?
        .file()
        .try_clone()
}

/// Translates a front-end user address through `table`.
pub(crate) fn va_to_gpa(table: &[Mapping], va: u64) -> Option<u64> {
    table
        .iter()
        .find(|m| va >= m.uaddr && va - m.uaddr < m.size)
        .map(|m| va - m.uaddr + m.gpa)
}
