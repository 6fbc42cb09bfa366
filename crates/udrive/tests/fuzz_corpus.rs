//! Replays every input of the fuzzers' corpora and every crash they found
//! (`fuzz/corpus/<target>`, `fuzz/regressions/<target>`) through the same entry
//! points, so `cargo test` keeps fixed crashes fixed (docs/fuzzing.md).

use std::path::Path;

fn replay(target: &str, run: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut n = 0;
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for e in entries.flatten() {
            let data = std::fs::read(e.path()).unwrap();
            run(&data);
            n += 1;
        }
    }
    assert!(n > 0, "no corpus for {target}");
}

#[test]
fn vfio_user_session() {
    replay("vfio_user_session", vfio_user::fuzzing::session);
}

#[test]
fn nvme_data_pointer() {
    replay("nvme_data_pointer", nvme::fuzzing::data_pointer);
}

#[test]
fn nvme_admin_commands() {
    replay("nvme_admin_commands", nvme::fuzzing::admin_commands);
}

#[test]
fn virtio_blk_virtqueue() {
    replay("virtio_blk_virtqueue", virtio_blk::fuzzing::virtqueue);
}

#[test]
fn vhost_inflight_recovery() {
    replay(
        "vhost_inflight_recovery",
        virtio_blk::fuzzing::inflight_recovery,
    );
}

#[test]
fn rpc_stream() {
    replay("rpc_stream", udrive::fuzzing::rpc_stream);
}

#[test]
fn ns_spec() {
    replay("ns_spec", udrive::fuzzing::ns_spec);
}

#[test]
fn qcow2_image() {
    replay("qcow2_image", udrive::fuzzing::qcow2_image);
}

#[test]
fn nbd_server() {
    replay("nbd_server", udrive::fuzzing::nbd_server);
}
