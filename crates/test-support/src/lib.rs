//! What the workspace's tests share: fakes of the parties udrive talks to, and the
//! helpers every test needs once.
//!
//! | module | what it is |
//! |---|---|
//! | [`nvme_host`] | a fake NVMe host driving `nvme::Controller` with fake guest memory, no socket |
//! | [`nvme_cmd`] | NVMe command builders (SQE, PRP, SGL) and completion checks |
//! | [`driver`] | helpers over udrive's initiator: one command, verified I/O, a well-behaved client |
//! | [`gens`] | generation-stamped verified I/O that survives a server's handover or restart |
//! | [`reactor`] | a reactor's sleep and poll counters |
//! | [`vfio_server`] | a vfio-user server on a temp socket in front of a fake PCI device |
//! | [`vfio_client`] | a raw vfio-user client that sends anything |
//! | [`fake_nvme`] | a fake vfio-user NVMe controller, for udrive's initiator |
//! | [`vhost_fe`] | a fake vhost-user front end (VMM + guest driver) that builds its own rings |
//! | [`blkio`], [`blkio_load`] | libblkio sessions: an independent vhost-user-blk client, and a QD32 verifier |
//! | [`held`] | a backend whose completions wait for the test (a network backend's stand-in) |
//! | [`ceph`] | a throwaway Ceph cluster (one mon, one OSD) for the rbd backend |
//! | [`files`] | sparse disk images and loop devices |
//! | [`luks`] | LUKS volumes by `cryptsetup`, volume keys, an independent AES-XTS |
//! | [`qemu`] | QEMU's image tools (`qemu-img`, `qemu-io`) for qcow2 interop |
//! | [`channel`] | one request on a `bdev` channel, to its completion |
//! | [`layers`] | checks on a trace layer breakdown that hold on a busy machine |
//! | [`pattern`] | data patterns a verifier writes and checks |
//! | [`wait`] | waiting for a condition, with a bound for broken builds |
//! | [`rng`] | the seeded random number generator |
//!
//! Each module's documentation says what its fake models and what it leaves out.
//! This crate never depends on `udrive`: udrive's own tests build on it, and
//! what needs udrive's API (in-process servers, `udrive serve` children) lives in
//! crates/udrive/tests/common.

pub mod blkio;
pub mod blkio_load;
pub mod ceph;
pub mod channel;
pub mod driver;
pub mod fake_nvme;
pub mod files;
pub mod gens;
pub mod held;
pub mod layers;
pub mod luks;
pub mod nvme_cmd;
pub mod nvme_host;
pub mod pattern;
pub mod qemu;
pub mod reactor;
pub mod rng;
pub mod vfio_client;
pub mod vfio_server;
pub mod vhost_fe;
pub mod wait;

pub use rng::Rng;
pub use wait::{poll_until, wait_until, T};
