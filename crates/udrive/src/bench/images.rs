//! The backends' images: made once per bench run, before the first run (the
//! `qcow2` backend's conversion of the data file, the `rbd` backend's image), or
//! afresh for every server (the chain's overlays, the empty image).

use std::path::Path;
use std::process::Command;

use super::env::Env;
use super::matrix::Backend;
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

/// Makes afresh the images of the backends whose runs must not see what an
/// earlier run wrote: the chain's two overlays, the empty image.
pub fn make_fresh(b: Backend, env: &Env) -> Result<(), DatapathError> {
    let create = |image: &Path, size: Option<&str>, backing: Option<(&Path, &str)>| {
        let _ = std::fs::remove_file(image);
        let mut c = Command::new("qemu-img");
        c.args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=65536"]);
        if let Some((file, format)) = backing {
            c.arg("-b").arg(file).args(["-F", format]);
        }
        c.arg(image).args(size);
        output(c, "qemu-img create (a fresh qcow2 image)").map(drop)
    };
    match b {
        Backend::Qcow2Chain => {
            let mid = env.chain_middle();
            create(&mid, None, Some((&env.data_file, "raw")))?;
            create(&env.image_of(b), None, Some((&mid, "qcow2")))
        }
        Backend::Qcow2New => create(&env.image_of(b), Some("64G"), None),
        _ => Ok(()),
    }
}
