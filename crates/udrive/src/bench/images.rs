//! The backends' images made once per bench run, before the first run: the
//! `qcow2` backend's conversion of the data file and the `rbd` backend's image.

use std::process::Command;

use super::datapath::Env;
use super::process::{output, DatapathError};

/// Makes the `qcow2` backend's image from the data file (every cluster allocated:
/// the data has no zero runs).
pub fn make_qcow2(env: &Env) -> Result<(), DatapathError> {
    let mut c = Command::new("qemu-img");
    c.args([
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=65536",
    ])
    .arg(&env.data_file)
    .arg(env.qcow2_file());
    output(c, "qemu-img convert (the qcow2 image)").map(drop)
}

/// The `rbd` backend's image, made if it is missing and written through once
/// (sequential 4 MiB writes, as `rbd bench`), so that reads hit objects.
pub fn prepare_rbd_image(env: &Env) -> Result<(), DatapathError> {
    let o = &env.matrix.rbd;
    let conf = o.conf.clone().unwrap_or_default();
    let rbd = |args: &[&str], what: &str| {
        let mut c = Command::new("rbd");
        c.args(["--conf", &conf]).args(args);
        output(c, what).map(drop)
    };
    let size = format!("{}M", o.mib());
    if rbd(&["info", o.image()], "rbd info").is_err() {
        rbd(&["create", "--size", &size, o.image()], "rbd create")?;
    }
    rbd(
        &[
            "bench",
            "--io-type",
            "write",
            "--io-size",
            "4M",
            "--io-threads",
            "4",
            "--io-total",
            &size,
            "--io-pattern",
            "seq",
            o.image(),
        ],
        "rbd bench (writing the image once)",
    )
}
