//! Our client against an independent server: qemu-nbd serving a raw file.

mod common;

use common::{pattern, QemuNbd};
use nbd::{Client, Uri};

const SIZE: usize = 48 << 20;
const MIB: u64 = 1 << 20;

fn setup(extra: &[&str]) -> (tempfile::TempDir, std::path::PathBuf, QemuNbd, Uri) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk.raw");
    std::fs::write(&file, vec![0x11u8; SIZE]).unwrap();
    let socket = dir.path().join("nbd.sock");
    let q = QemuNbd::start(&file, &socket, "disk0", extra);
    let uri = Uri::parse(&format!("nbd+unix:///disk0?socket={}", socket.display())).unwrap();
    (dir, file, q, uri)
}

#[test]
fn client_writes_zeroes_trims_and_reads_back_from_qemu_nbd() {
    let (_dir, file, q, uri) = setup(&["--discard=unmap"]);
    let mut c = Client::connect(&uri).unwrap();
    assert_eq!(c.size(), SIZE as u64);
    assert!(!c.read_only());

    let a = pattern(1, 64 << 10);
    c.write(0, &a, false).unwrap();
    // Over qemu-nbd's 32 MiB maximum: qemu-nbd drops a client that sends a
    // longer request, so this passes only if the client splits it.
    let b = pattern(2, 40 << 20);
    c.write(MIB, &b, true).unwrap();
    c.write_zeroes(2 * MIB, MIB).unwrap();
    c.trim(46 * MIB, MIB).unwrap();
    c.flush().unwrap();

    let mut back = vec![0u8; 64 << 10];
    c.read(0, &mut back).unwrap();
    assert_eq!(back, a);
    let mut back = vec![0u8; SIZE];
    c.read(0, &mut back).unwrap();
    c.disconnect().unwrap();
    drop(q);

    let disk = std::fs::read(&file).unwrap();
    assert_eq!(disk, back, "what the client read is what qemu-nbd wrote");
    assert_eq!(&disk[..64 << 10], &a[..]);
    assert!(disk[(64 << 10)..MIB as usize].iter().all(|&x| x == 0x11));
    assert_eq!(&disk[MIB as usize..2 * MIB as usize], &b[..MIB as usize]);
    assert!(
        disk[2 * MIB as usize..3 * MIB as usize]
            .iter()
            .all(|&x| x == 0),
        "write_zeroes"
    );
    assert_eq!(
        &disk[3 * MIB as usize..41 * MIB as usize],
        &b[2 * MIB as usize..]
    );
    assert!(disk[41 * MIB as usize..46 * MIB as usize]
        .iter()
        .all(|&x| x == 0x11));
    // qemu-nbd with --discard=unmap punches a hole in the raw file.
    assert!(
        disk[46 * MIB as usize..47 * MIB as usize]
            .iter()
            .all(|&x| x == 0),
        "trim"
    );
    assert!(disk[47 * MIB as usize..].iter().all(|&x| x == 0x11));
}

#[test]
fn client_refuses_past_the_end_and_reports_read_only_errors() {
    let (_dir, _file, _q, uri) = setup(&["--read-only"]);
    let mut c = Client::connect(&uri).unwrap();
    assert!(c.read_only());
    let mut buf = [0u8; 512];
    let e = c.read(SIZE as u64, &mut buf).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
    let e = c.read(u64::MAX - 10, &mut buf).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");

    let e = c.write(0, &buf, false).unwrap_err();
    // qemu-nbd 10.0 answers EINVAL here (its EROFS has no NBD value); our
    // server answers EPERM, as the protocol suggests.
    let errno = nbd::errno(&e);
    assert!(
        errno == Some(libc::EINVAL) || errno == Some(libc::EPERM),
        "{e}"
    );
    assert!(e.to_string().contains("NBD_CMD_WRITE"), "{e}");
    // The connection survives an error reply.
    c.read(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 0x11));
    c.disconnect().unwrap();
}

#[test]
fn unknown_export_is_not_found() {
    let (_dir, _file, _q, mut uri) = setup(&[]);
    uri.export = "nope".into();
    let e = Client::connect(&uri)
        .err()
        .expect("qemu-nbd has no export 'nope'");
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
    assert!(e.to_string().contains("nope"), "{e}");
}
