//! A measurement, not a test (ignored; run with `--ignored --nocapture`): the
//! round-trip time of control messages through the device, with vhost's
//! `Frontend` as the client. Uses only the device's public API so that the same
//! file measures another version of the crate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;
use vhost_user_blk::{BlkDeviceOptions, VhostUserBlk};

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p) as usize]
}

#[test]
#[ignore]
fn control_message_round_trips() {
    let engine = engine::Engine::start(&[None]).unwrap();
    let dir = std::env::temp_dir().join(format!("vublk-lat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("lat.sock");
    let disk: Arc<dyn bdev::BlockDevice> = Arc::new(bdev::RamDisk::new(16 << 20, 512).unwrap());
    let dev = VhostUserBlk::start(&path, disk, BlkDeviceOptions::default(), &engine, &[0]).unwrap();
    let mut fe = Frontend::connect(&path, 1).unwrap();
    fe.set_owner().unwrap();
    let f = fe.get_features().unwrap();
    fe.set_features(f).unwrap();
    fe.set_protocol_features(VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK)
        .unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    const N: usize = 5000;
    for (what, run) in [
        ("GET_QUEUE_NUM (reply)", 0),
        ("SET_VRING_NUM (REPLY_ACK)", 1),
    ] {
        let mut t = Vec::with_capacity(N);
        for _ in 0..N {
            let s = Instant::now();
            if run == 0 {
                fe.get_queue_num().unwrap();
            } else {
                fe.set_vring_num(0, 128).unwrap();
            }
            t.push(s.elapsed());
        }
        println!(
            "{what}: median {:?}, p99 {:?} over {N}",
            pct(&mut t, 0.5),
            pct(&mut t, 0.99)
        );
    }
    drop(fe);
    dev.stop();
}
