//! QEMU's image locking, so that udrive and QEMU's tools keep off each other's
//! images as two QEMU processes do: `qemu-img info` or `qemu-img commit` on an
//! image udrive writes fails with QEMU's own "Failed to get ... lock", and udrive
//! refuses an image a running QEMU writes (docs/decisions/0044-image-locking.md).
//!
//! QEMU (`block/file-posix.c`) expresses what a user of a file does as
//! permissions it holds and permissions it does not share with others, and
//! takes a shared open-file-description lock on byte `100 + p` for each
//! permission `p` it holds and on byte `200 + p` for each it does not share.
//! Before it uses the file it checks that no other description locks `200 + p`
//! for a permission it holds, nor `100 + p` for one it does not share.
//!
//! Every lock on an inode goes through one description per process, whose
//! bytes are the union of what this process's users hold: two users in one
//! process (an image and the same file reopened as a snapshot's backing file)
//! never conflict with each other, only with other processes.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// QEMU's permission bits (`BLK_PERM_*`), by their lock byte offset.
const PERMS: [(u8, &str); 4] = [
    (0, "consistent read"),
    (1, "write"),
    (2, "write unchanged"),
    (3, "resize"),
];
const HELD_BASE: i64 = 100;
const UNSHARED_BASE: i64 = 200;

pub const READ: u8 = 1 << 0;
pub const WRITE: u8 = 1 << 1;
pub const RESIZE: u8 = 1 << 3;

/// What a user of an image does with it, in QEMU's terms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Perms {
    /// Permissions it holds.
    pub held: u8,
    /// Permissions it does not let others hold.
    pub unshared: u8,
}

impl Perms {
    /// Nothing: an image another process writes now (a migration's
    /// destination before it takes over).
    pub const NONE: Perms = Perms {
        held: 0,
        unshared: 0,
    };
    /// A qcow2 image the disk writes (QEMU's qcow2 driver: nobody else may
    /// write or resize it).
    pub const QCOW2_WRITER: Perms = Perms {
        held: READ | WRITE | RESIZE,
        unshared: WRITE | RESIZE,
    };
    /// A backing file or a read-only image: its data must not change under
    /// the images above it.
    pub const READER: Perms = Perms {
        held: READ,
        unshared: WRITE | RESIZE,
    };

    fn union(self, o: Perms) -> Perms {
        Perms {
            held: self.held | o.held,
            unshared: self.unshared | o.unshared,
        }
    }
}

/// One inode's description and its users in this process.
struct Entry {
    /// A duplicate of the first user's descriptor, kept while the inode has
    /// users: its description holds the locks whatever the users close.
    fd: File,
    users: HashMap<u64, Perms>,
    applied: Perms,
}

type Key = (u64, u64);

static LOCKS: Mutex<Option<HashMap<Key, Entry>>> = Mutex::new(None);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Set while this process takes over from a running udrive: its predecessor
/// holds the same locks until it exits, and no third process could have taken
/// a conflicting one since (it would have found the predecessor's).
static SUCCESSOR: AtomicBool = AtomicBool::new(false);

/// How long a conflicting lock may take to go away before it is a refusal.
pub const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn registry() -> MutexGuard<'static, Option<HashMap<Key, Entry>>> {
    LOCKS.lock().unwrap_or_else(|p| p.into_inner())
}

/// While `on`, locks are taken without checking for other processes' (a
/// successor of a live handover, whose predecessor still holds them).
pub fn set_taking_over(on: bool) {
    SUCCESSOR.store(on, Ordering::Release);
}

/// One user's locks on an image file, released when dropped.
#[derive(Debug)]
pub struct ImageLock {
    key: Key,
    id: u64,
    path: std::path::PathBuf,
}

impl ImageLock {
    /// Locks `file` (opened from `path`) for `perms`, or says which
    /// permission another process holds or does not share.
    ///
    /// A conflict is tried again for [`RELEASE_WAIT`] before it is refused: a
    /// process killed with I/O in flight (udrive restarted by its supervisor,
    /// QEMU with `aio=io_uring`) keeps its file, and so its locks, until the
    /// kernel has finished that I/O, after the process itself is gone.
    pub fn acquire(file: &File, path: &Path, perms: Perms) -> io::Result<ImageLock> {
        let since = std::time::Instant::now();
        loop {
            match Self::try_acquire(file, path, perms) {
                Err(e) if e.kind() == io::ErrorKind::ResourceBusy => {
                    if since.elapsed() >= RELEASE_WAIT {
                        return Err(e);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                r => return r,
            }
        }
    }

    fn try_acquire(file: &File, path: &Path, perms: Perms) -> io::Result<ImageLock> {
        let m = file.metadata()?;
        let key = (m.dev(), m.ino());
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut reg = registry();
        let map = reg.get_or_insert_with(HashMap::new);
        if let std::collections::hash_map::Entry::Vacant(v) = map.entry(key) {
            // The locks belong to the description, which this duplicate keeps
            // open for as long as the inode has users here.
            v.insert(Entry {
                fd: file.try_clone()?,
                users: HashMap::new(),
                applied: Perms::NONE,
            });
        }
        // The lock exists only once it holds: dropping one here, on a
        // conflict, would take the registry's lock a second time.
        update(map, key, id, path, Some(perms))?;
        Ok(ImageLock {
            key,
            id,
            path: path.to_path_buf(),
        })
    }

    /// Changes what this user holds (a disk handing its image to another
    /// process, or taking it back).
    pub fn set(&self, perms: Perms) -> io::Result<()> {
        let mut reg = registry();
        let map = reg.get_or_insert_with(HashMap::new);
        update(map, self.key, self.id, &self.path, Some(perms))
    }
}

impl Drop for ImageLock {
    fn drop(&mut self) {
        let mut reg = registry();
        if let Some(map) = reg.as_mut() {
            if let Err(e) = update(map, self.key, self.id, &self.path, None) {
                tracing::warn!(path = %self.path.display(), "cannot release image locks: {e}");
            }
        }
    }
}

/// Sets user `id`'s permissions on inode `key` to `perms` (`None`: removes
/// the user) and applies the union of the inode's users; on a conflict,
/// leaves everything as it was.
fn update(
    map: &mut HashMap<Key, Entry>,
    key: Key,
    id: u64,
    path: &Path,
    perms: Option<Perms>,
) -> io::Result<()> {
    let Some(e) = map.get_mut(&key) else {
        return Ok(());
    };
    let before = e.users.get(&id).copied();
    match perms {
        Some(p) => e.users.insert(id, p),
        None => e.users.remove(&id),
    };
    let want = e.users.values().fold(Perms::NONE, |a, &p| a.union(p));
    let applied = apply(e, want, path);
    if applied.is_err() {
        match before {
            Some(p) => e.users.insert(id, p),
            None => e.users.remove(&id),
        };
    }
    if e.users.is_empty() {
        map.remove(&key);
    }
    applied
}

fn apply(e: &mut Entry, want: Perms, path: &Path) -> io::Result<()> {
    let was = e.applied;
    set_bytes(&e.fd, want, was)?;
    if !SUCCESSOR.load(Ordering::Acquire) {
        if let Err(err) = check(&e.fd, want, path) {
            // Back to what was applied: the bytes of `was` again, the new ones gone.
            let _ = set_bytes(&e.fd, was, want);
            return Err(err);
        }
    }
    e.applied = want;
    Ok(())
}

/// Locks the bytes of `want` that `was` had not, unlocks those it no longer has.
fn set_bytes(fd: &File, want: Perms, was: Perms) -> io::Result<()> {
    for (bit, _) in PERMS {
        let m = 1u8 << bit;
        for (base, w, h) in [
            (HELD_BASE, want.held, was.held),
            (UNSHARED_BASE, want.unshared, was.unshared),
        ] {
            match (w & m != 0, h & m != 0) {
                (true, false) => lock_byte(fd, base + i64::from(bit), libc::F_RDLCK)?,
                (false, true) => lock_byte(fd, base + i64::from(bit), libc::F_UNLCK)?,
                _ => {}
            }
        }
    }
    Ok(())
}

fn flock_at(byte: i64, kind: libc::c_int) -> libc::flock {
    libc::flock {
        l_type: kind as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: byte,
        l_len: 1,
        l_pid: 0,
    }
}

fn lock_byte(fd: &File, byte: i64, kind: libc::c_int) -> io::Result<()> {
    let fl = flock_at(byte, kind);
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_OFD_SETLK(&fl))
        .map(|_| ())
        .map_err(|e| match e {
            nix::errno::Errno::EAGAIN | nix::errno::Errno::EACCES => busy(format!(
                "byte {byte} is locked exclusively by another process"
            )),
            e => io::Error::from(e),
        })
}

/// Whether another description has a lock on `byte` (this process's own
/// description never conflicts with itself).
fn locked_elsewhere(fd: &File, byte: i64) -> io::Result<bool> {
    let mut fl = flock_at(byte, libc::F_WRLCK);
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_OFD_GETLK(&mut fl))?;
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

fn check(fd: &File, want: Perms, path: &Path) -> io::Result<()> {
    for (bit, name) in PERMS {
        let m = 1u8 << bit;
        if want.held & m != 0 && locked_elsewhere(fd, UNSHARED_BASE + i64::from(bit))? {
            return Err(busy(format!(
                "{}: another process (QEMU, qemu-img or udrive) uses the image and does not \
                 share \"{name}\"; stop it, or open the image elsewhere with QEMU's -U / \
                 locking=off if you know it is safe",
                path.display()
            )));
        }
        if want.unshared & m != 0 && locked_elsewhere(fd, HELD_BASE + i64::from(bit))? {
            return Err(busy(format!(
                "{}: another process (QEMU, qemu-img or udrive) holds \"{name}\" on the image; \
                 stop it before serving the image here",
                path.display()
            )));
        }
    }
    Ok(())
}

fn busy(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::ResourceBusy, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img");
        File::create(&p).unwrap().set_len(1 << 20).unwrap();
        (dir, p)
    }

    /// Another process's locks, as QEMU takes them: one description of its own.
    fn foreign(p: &Path, held: &[i64]) -> File {
        let f = File::open(p).unwrap();
        for &b in held {
            lock_byte(&f, b, libc::F_RDLCK).unwrap();
        }
        f
    }

    #[test]
    fn users_in_one_process_share_one_description() {
        let (_d, p) = image();
        let f = File::open(&p).unwrap();
        let w = ImageLock::acquire(&f, &p, Perms::QCOW2_WRITER).unwrap();
        // The same file as a backing file: it unshares write, which the
        // writer holds, but both are this process's.
        let r = ImageLock::acquire(&File::open(&p).unwrap(), &p, Perms::READER).unwrap();
        drop(f);
        // A third description (another process, as far as locks go) sees both.
        let other = File::open(&p).unwrap();
        assert!(locked_elsewhere(&other, 101).unwrap());
        assert!(locked_elsewhere(&other, 201).unwrap());
        drop(w);
        assert!(!locked_elsewhere(&other, 101).unwrap());
        assert!(locked_elsewhere(&other, 201).unwrap());
        drop(r);
        assert!(!locked_elsewhere(&other, 100).unwrap());
        assert!(!locked_elsewhere(&other, 201).unwrap());
    }

    #[test]
    fn another_writer_or_reader_is_refused_and_nothing_is_left_locked() {
        let (_d, p) = image();
        // Another process writes the image (QEMU: holds write, shares nothing).
        let q = foreign(&p, &[100, 101, 103, 201, 203]);
        let f = File::open(&p).unwrap();
        let e = ImageLock::acquire(&f, &p, Perms::READER).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ResourceBusy);
        assert!(e.to_string().contains("\"write\""), "{e}");
        let e = ImageLock::acquire(&f, &p, Perms::QCOW2_WRITER).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ResourceBusy);
        drop(q);
        // Nothing of the refused attempts stayed behind.
        let other = File::open(&p).unwrap();
        for b in [100, 101, 103, 201, 203] {
            assert!(!locked_elsewhere(&other, b).unwrap(), "byte {b}");
        }
        // A reader elsewhere (QEMU's backing file: unshares write) keeps a
        // writer off, not another reader.
        let q = foreign(&p, &[100, 201, 203]);
        let r = ImageLock::acquire(&f, &p, Perms::READER).unwrap();
        let e = ImageLock::acquire(&f, &p, Perms::QCOW2_WRITER).unwrap_err();
        assert!(e.to_string().contains("does not share \"write\""), "{e}");
        drop((q, r));
    }

    #[test]
    fn a_lock_released_soon_after_is_waited_for() {
        let (_d, p) = image();
        // A writer that has just been killed: its locks outlive it briefly.
        let q = foreign(&p, &[100, 101, 103, 201, 203]);
        let release = std::thread::spawn(move || {
            std::thread::sleep(RELEASE_WAIT / 20);
            drop(q);
        });
        let f = File::open(&p).unwrap();
        let w = ImageLock::acquire(&f, &p, Perms::QCOW2_WRITER).unwrap();
        release.join().unwrap();
        let other = File::open(&p).unwrap();
        assert!(locked_elsewhere(&other, 101).unwrap());
        drop(w);
    }

    #[test]
    fn a_user_hands_over_and_takes_back() {
        let (_d, p) = image();
        let f = File::open(&p).unwrap();
        let w = ImageLock::acquire(&f, &p, Perms::QCOW2_WRITER).unwrap();
        w.set(Perms::NONE).unwrap();
        // The other process takes the image as a writer, then gives it back.
        let q = foreign(&p, &[100, 101, 103, 201, 203]);
        assert!(w.set(Perms::QCOW2_WRITER).is_err());
        drop(q);
        w.set(Perms::QCOW2_WRITER).unwrap();
        let other = File::open(&p).unwrap();
        assert!(locked_elsewhere(&other, 203).unwrap());
    }
}
