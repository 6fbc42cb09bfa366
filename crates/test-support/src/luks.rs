//! LUKS volumes made and read by the reference tools, for tests of udrive's
//! encryption: `cryptsetup` (luksFormat, luksDump) and an AES-XTS that is not
//! udrive's (OpenSSL's, through Python's `cryptography`; the `openssl enc` command
//! has no XTS).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The passphrase of the volumes made here (the whole key file).
pub const PASS: &[u8] = b"correct horse battery staple\n";

/// Runs `cmd`; its stdout. Fails the test with its stderr if it fails.
pub fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A `size`-byte volume file and its key file in `dir`.
pub fn volume(dir: &Path, size: u64) -> (PathBuf, PathBuf) {
    let img = dir.join("vol.img");
    std::fs::File::create(&img).unwrap().set_len(size).unwrap();
    let key = dir.join("key");
    std::fs::write(&key, PASS).unwrap();
    (img, key)
}

/// `cryptsetup luksFormat --type luks2` on `img`, with its defaults (argon2id
/// measured for this machine, 4096-byte sectors on a file) if `defaults`, else
/// with a cheap argon2id keyslot and 512-byte sectors.
pub fn luks_format(img: &Path, key: &Path, defaults: bool) {
    let mut c = Command::new("cryptsetup");
    c.args([
        "luksFormat",
        "--type",
        "luks2",
        "--batch-mode",
        "--key-file",
    ])
    .arg(key);
    if !defaults {
        c.args([
            "--sector-size",
            "512",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32768",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-parallel",
            "1",
        ]);
    }
    run(c.arg(img));
}

/// The volume key, from `cryptsetup luksDump --dump-volume-key`.
pub fn volume_key(img: &Path, key: &Path) -> Vec<u8> {
    let vk = img.with_extension("vk");
    run(Command::new("cryptsetup")
        .args([
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file",
        ])
        .arg(key)
        .arg("--volume-key-file")
        .arg(&vk)
        .arg(img));
    std::fs::read(vk).unwrap()
}

/// AES-XTS of `data` with the plain64 IV of `first_sector`, by OpenSSL (through
/// Python's `cryptography`), not by udrive's code.
pub fn openssl_xts(
    encrypt: bool,
    key: &[u8],
    unit: usize,
    first_sector: u64,
    data: &[u8],
) -> Vec<u8> {
    let script = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
enc, key, unit = sys.argv[1] == "enc", bytes.fromhex(sys.argv[2]), int(sys.argv[3])
sector = int(sys.argv[4])
data = sys.stdin.buffer.read()
out = b""
for i in range(0, len(data), unit):
    c = Cipher(algorithms.AES(key), modes.XTS((sector + i // 512).to_bytes(16, "little")))
    op = c.encryptor() if enc else c.decryptor()
    out += op.update(data[i:i + unit]) + op.finalize()
sys.stdout.buffer.write(out)
"#;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut child = Command::new("python3")
        .args(["-c", script, if encrypt { "enc" } else { "dec" }, &hex])
        .arg(unit.to_string())
        .arg(first_sector.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    out.stdout
}

/// Rewrites keyslot 0's key derivation in both LUKS2 header copies of `img`
/// (`field` = `value` in its `kdf` object: `time` for argon2's passes,
/// `iterations` for PBKDF2) and their checksums, as a hostile volume's writer
/// could: libcryptsetup then loads the header as valid.
pub fn set_keyslot_kdf(img: &Path, field: &str, value: u64) {
    const FIX: &str = r#"
import hashlib, json, struct, sys
path, field, value = sys.argv[1], sys.argv[2], int(sys.argv[3])
CSUM = 448  # magic, version, hdr_size, seqid, label, csum_alg, salt, uuid, subsystem, hdr_offset, padding
with open(path, "r+b") as f:
    off = 0
    for _ in range(2):
        f.seek(off)
        size = struct.unpack(">Q", f.read(16)[8:16])[0]
        f.seek(off)
        area = bytearray(f.read(size))
        meta = json.loads(area[4096:].split(b"\0", 1)[0])
        meta["keyslots"]["0"]["kdf"][field] = value
        raw = json.dumps(meta).encode()
        area[4096:] = raw + b"\0" * (size - 4096 - len(raw))
        area[CSUM:CSUM + 64] = b"\0" * 64
        area[CSUM:CSUM + 32] = hashlib.sha256(area).digest()
        f.seek(off)
        f.write(area)
        off = size
"#;
    run(Command::new("python3")
        .args(["-c", FIX])
        .arg(img)
        .arg(field)
        .arg(value.to_string()));
}
