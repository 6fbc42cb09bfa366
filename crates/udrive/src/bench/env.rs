//! What every target of one bench run shares: the binaries, the work directory,
//! the backends' files and the matrix.

use std::path::PathBuf;

use super::matrix::{Backend, Matrix};

/// What every target of one bench run shares.
pub struct Env {
    /// The udrive binary that serves and runs `perf`.
    pub udrive: PathBuf,
    /// The udrive binary that serves the `~b` datapaths (`--udrive-b`).
    pub udrive_b: Option<PathBuf>,
    pub qsd: Option<PathBuf>,
    /// Sockets and server logs.
    pub work: PathBuf,
    /// The data file of the `file` backend (made once, before the first run).
    pub data_file: PathBuf,
    /// The Ceph daemons of the `rbd` backend's cluster on this host.
    pub ceph_daemons: Vec<u32>,
    pub matrix: Matrix,
}

impl Env {
    /// The `qcow2` backend's image: the data file converted.
    pub fn qcow2_file(&self) -> PathBuf {
        self.data_file.with_extension("qcow2")
    }

    /// The `file` backend's data of client `i` of `n`: the data file itself for one
    /// client, else one file of 1/n of its size per client.
    pub fn data_file_of(&self, n: u32, i: u32) -> PathBuf {
        if n == 1 {
            return self.data_file.clone();
        }
        let stem = self
            .data_file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.data_file
            .with_file_name(format!("{stem}-c{n}-{i}.img"))
    }

    /// The LUKS2 volume of the `file-luks` backend.
    pub fn luks_file(&self) -> PathBuf {
        self.data_file.with_extension("luks.img")
    }

    /// The passphrase of the encrypted backends: a key file in the work directory.
    pub fn luks_key(&self) -> PathBuf {
        self.work.join("luks.key")
    }

    /// The image a qcow2 backend's server opens (the top of a chain).
    pub fn image_of(&self, b: Backend) -> PathBuf {
        match b {
            Backend::Qcow2Chain => self.data_file.with_extension("top.qcow2"),
            Backend::Qcow2New => self.data_file.with_extension("new.qcow2"),
            _ => self.qcow2_file(),
        }
    }

    /// The middle image of the `qcow2-chain` backend, over the data file.
    pub(super) fn chain_middle(&self) -> PathBuf {
        self.data_file.with_extension("mid.qcow2")
    }

    /// Every image file the qcow2 backends make, for the clean-up.
    pub fn qcow2_files(&self) -> [PathBuf; 4] {
        [
            self.qcow2_file(),
            self.image_of(Backend::Qcow2Chain),
            self.chain_middle(),
            self.image_of(Backend::Qcow2New),
        ]
    }
}
