//! Disk images and loop devices for tests of file and block-device backends.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A sparse file `dir/name` of `len` bytes.
pub fn sized_file(dir: &Path, name: &str, len: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .and_then(|f| f.set_len(len))
        .expect("create image file");
    p
}

/// A loop device over a file, attached for one test and detached on drop. Needs
/// root (or the rights to /dev/loop-control): tests skip without it.
pub struct LoopDev {
    pub path: PathBuf,
}

impl LoopDev {
    /// Attaches `file` with `sector`-byte logical sectors; why it could not.
    pub fn attach(file: &Path, sector: u32) -> Result<LoopDev, String> {
        let out = Command::new("losetup")
            .args(["--find", "--show", "--sector-size", &sector.to_string()])
            .arg(file)
            .output()
            .map_err(|e| format!("cannot run losetup: {e}"))?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || path.is_empty() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(format!("losetup failed: {}", err.trim()));
        }
        Ok(LoopDev { path: path.into() })
    }

    /// `losetup --set-capacity`: the device takes its file's new size.
    pub fn set_capacity(&self) -> bool {
        Command::new("losetup")
            .arg("--set-capacity")
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.path).status();
    }
}
