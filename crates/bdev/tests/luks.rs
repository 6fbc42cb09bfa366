//! LUKS volumes against the reference implementation: volumes `cryptsetup
//! luksFormat` made are served by `bdev::open_luks`, and what udrive writes
//! decrypts with the volume key `cryptsetup luksDump` gives and an independent
//! AES-XTS (OpenSSL's, through Python's `cryptography`); a volume
//! `bdev::format_luks` made is accepted by `cryptsetup`. Hostile headers and
//! keys end in typed errors that carry no key bytes.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use bdev::{
    format_luks, open_luks, BlockDevice, CryptDisk, FileDisk, FileOptions, IoOp, IoStatus,
    LuksError,
};
use guest_mem::MappedRegion;
use test_support::channel::one as io;
use test_support::luks::{luks_format, openssl_xts, run, volume, volume_key, PASS};

const MIB: u64 = 1 << 20;

fn file(img: &Path) -> Arc<dyn BlockDevice> {
    let opts = FileOptions {
        direct: false,
        ..Default::default()
    };
    Arc::new(FileDisk::open(img, opts).unwrap())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect()
}

fn read_at(img: &Path, off: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut v = vec![0; len];
    std::fs::File::open(img)
        .unwrap()
        .read_exact_at(&mut v, off)
        .unwrap();
    v
}

fn write_at(img: &Path, off: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
    f.write_all_at(data, off).unwrap();
}

/// udrive's writes decrypt independently; independent writes read back through
/// udrive.
fn interop_both_ways(img: &Path, key: &Path, disk: &CryptDisk) {
    let vk = volume_key(img, key);
    let unit = disk.info().block_size as usize;
    assert_eq!(vk.len(), 64);
    let data = disk.data_offset();
    assert_eq!(
        disk.info().size_bytes(),
        std::fs::metadata(img).unwrap().len() - data
    );
    let mut ch = disk.channel().unwrap();
    let buf = MappedRegion::anonymous(0, MIB).unwrap();
    let plain = pattern(64 << 10, 0x5a);
    buf.slice(0, plain.len())
        .unwrap()
        .write_from(0, &plain)
        .unwrap();
    assert_eq!(
        io(&mut *ch, IoOp::Write, MIB, &buf, plain.len()),
        IoStatus::Ok
    );
    let raw = read_at(img, data + MIB, plain.len());
    assert_ne!(raw, plain);
    assert_eq!(openssl_xts(false, &vk, unit, MIB / 512, &raw), plain);

    let other = pattern(8192, 0xc3);
    write_at(
        img,
        data + 3 * MIB,
        &openssl_xts(true, &vk, unit, 3 * MIB / 512, &other),
    );
    assert_eq!(io(&mut *ch, IoOp::Read, 3 * MIB, &buf, 8192), IoStatus::Ok);
    let mut seen = vec![0; 8192];
    buf.slice(0, 8192).unwrap().read_into(0, &mut seen).unwrap();
    assert_eq!(seen, other);
}

#[test]
fn cryptsetup_volumes_are_served_and_read_back_independently() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = volume(dir.path(), 24 * MIB);
    luks_format(&img, &key, false);
    let disk = open_luks(file(&img), &key).unwrap();
    assert_eq!(disk.info().block_size, 512);
    interop_both_ways(&img, &key, &disk);
}

#[test]
fn default_volumes_open_with_4096_byte_sectors() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = volume(dir.path(), 24 * MIB);
    luks_format(&img, &key, true);
    let disk = open_luks(file(&img), &key).unwrap();
    assert_eq!(disk.data_offset(), 16 * MIB);
    assert_eq!(disk.info().block_size, 4096);
    interop_both_ways(&img, &key, &disk);
}

#[test]
fn formatted_volumes_open_in_cryptsetup() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = volume(dir.path(), 24 * MIB);
    let disk = format_luks(file(&img), &key).unwrap();
    let dump =
        String::from_utf8(run(Command::new("cryptsetup").arg("luksDump").arg(&img))).unwrap();
    assert!(dump.contains("Version:       \t2"), "{dump}");
    assert!(dump.contains("aes-xts-plain64"), "{dump}");
    assert!(dump.contains("argon2id"), "{dump}");
    run(Command::new("cryptsetup")
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(&key)
        .arg(&img));
    interop_both_ways(&img, &key, &disk);
    drop(disk);
    // And udrive opens what it made.
    open_luks(file(&img), &key).unwrap();
}

/// The error and its sources, as an operator would read them.
fn text(e: &LuksError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s += &format!(": {c}");
        src = c.source();
    }
    s
}

#[test]
fn hostile_headers_and_keys_are_refused_without_key_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = volume(dir.path(), 24 * MIB);
    luks_format(&img, &key, false);
    let vk = volume_key(&img, &key);
    let vk_hex: String = vk.iter().map(|b| format!("{b:02x}")).collect();
    let secret = String::from_utf8_lossy(PASS).trim().to_string();
    let clean = |e: LuksError| {
        let t = text(&e);
        assert!(!t.contains(&secret) && !t.contains(&vk_hex[..16]), "{t}");
        e
    };

    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, b"not the passphrase").unwrap();
    let e = clean(open_luks(file(&img), &wrong).unwrap_err());
    assert!(matches!(e, LuksError::WrongKey { .. }), "{e:?}");

    let e = clean(open_luks(file(&img), &dir.path().join("missing")).unwrap_err());
    assert!(matches!(e, LuksError::KeyFile { .. }), "{e:?}");
    std::fs::write(&wrong, b"").unwrap();
    let e = clean(open_luks(file(&img), &wrong).unwrap_err());
    assert!(matches!(e, LuksError::KeyFileSize { .. }), "{e:?}");

    // Both header copies (at 0 and 16 KiB) overwritten.
    let broken = dir.path().join("broken.img");
    std::fs::copy(&img, &broken).unwrap();
    write_at(&broken, 0, &vec![0x41; 64 << 10]);
    let e = clean(open_luks(file(&broken), &key).unwrap_err());
    assert!(matches!(e, LuksError::Header { .. }), "{e:?}");

    // Keyslot area cut off.
    let short = dir.path().join("short.img");
    std::fs::write(&short, read_at(&img, 0, MIB as usize)).unwrap();
    let e = clean(open_luks(file(&short), &key).unwrap_err());
    assert!(
        matches!(e, LuksError::Header { .. } | LuksError::WrongKey { .. }),
        "{e:?}"
    );

    // A plain, never formatted file.
    let plain = dir.path().join("plain.img");
    std::fs::File::create(&plain)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let e = clean(open_luks(file(&plain), &key).unwrap_err());
    assert!(matches!(e, LuksError::Header { .. }), "{e:?}");
}
