//! File namespaces keep their data: across a stop/start of an in-process controller,
//! and across `kill -9` of the `udrive` binary once a FLUSH completed. Also: unaligned
//! guest buffers under O_DIRECT (bounce path) and a loop block device.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use initiator::{DataMode, IoOp, QpairOpts};
use test_support::files::LoopDev;

fn flush(qp: &mut initiator::QueuePair) {
    assert_ok(&io(qp, IoOp::Flush, 1, 0, 0, None, DataMode::Prp), "flush");
}

fn read_back(qp: &mut initiator::QueuePair, slba: u64, len: usize) -> Vec<u8> {
    let buf = qp.alloc_buf(len).expect("buffer");
    let c = io(
        qp,
        IoOp::Read,
        1,
        slba,
        (len / 512) as u32,
        Some(&buf),
        DataMode::Prp,
    );
    assert_ok(&c, "read back");
    let mut b = vec![0u8; len];
    buf.read(0, &mut b).expect("copy out");
    b
}

#[test]
fn data_survives_stop_and_restart() {
    let (_dir, img) = disk_file("persist.img", 32 << 20);
    let ns = format!("file:{}", img.display());
    let mut rng = Rng::new(7);
    let writes: Vec<(u64, Vec<u8>)> = (0..6)
        .map(|i| {
            (
                i * 9000 + rng.below(1000),
                rng.bytes(((i + 1) * 8192) as usize),
            )
        })
        .collect();
    {
        let dev = TestDev::start("persist1", &[&ns]);
        let d = dev.connect();
        let mut qp = d.create_qpair(8, false).unwrap();
        let buf = qp.alloc_buf(64 << 10).unwrap();
        for (i, (slba, data)) in writes.iter().enumerate() {
            let mode = if i % 2 == 0 {
                DataMode::Prp
            } else {
                DataMode::Sgl
            };
            write_read(&mut qp, &buf, *slba, data, mode);
        }
        flush(&mut qp);
    }
    // The bytes are in the file itself, where udrive put them ...
    for (slba, data) in &writes {
        assert!(
            file_bytes(&img, slba * 512, data.len()) == *data,
            "file content at LBA {slba}"
        );
    }
    // ... and a new controller on the same file serves them.
    let dev = TestDev::start("persist2", &[&ns]);
    let d = dev.connect();
    let mut qp = d.create_qpair(8, false).unwrap();
    for (slba, data) in &writes {
        assert!(
            read_back(&mut qp, *slba, data.len()) == *data,
            "after restart, LBA {slba}"
        );
    }
}

/// Kills (SIGKILL) and reaps the server on drop, whatever the test did.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(sock: &Path, ns: &str) -> Server {
    let child = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(["serve", "--vfio-user"])
        .arg(sock)
        .args(["--ns", ns])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn udrive serve");
    let mut s = Server(child);
    wait_until("the server's socket", Duration::from_secs(30), || {
        if let Ok(Some(st)) = s.0.try_wait() {
            panic!("udrive serve exited: {st}");
        }
        // A socket left by a killed server is replaced by the new one: connect to tell.
        std::os::unix::net::UnixStream::connect(sock).is_ok()
    });
    s
}

#[test]
fn flushed_data_survives_kill_9() {
    let (dir, img) = disk_file("killed.img", 16 << 20);
    let sock = dir.path().join("k.sock");
    let ns = format!("file:{}", img.display());
    let data = Rng::new(99).bytes(64 << 10);
    {
        let mut srv = serve(&sock, &ns);
        let d = connect_sock(&sock);
        let mut qp = d.create_qpair(8, false).unwrap();
        let buf = qp.alloc_buf(64 << 10).unwrap();
        write_read(&mut qp, &buf, 1000, &data, DataMode::Sgl);
        flush(&mut qp);
        srv.0.kill().expect("SIGKILL the server");
        srv.0.wait().expect("reap the server");
    }
    let _srv = serve(&sock, &ns);
    let d = connect_sock(&sock);
    let mut qp = d.create_qpair(8, false).unwrap();
    assert!(
        read_back(&mut qp, 1000, data.len()) == data,
        "flushed data lost across kill -9"
    );
    assert!(file_bytes(&img, 1000 * 512, data.len()) == data);
}

fn connect_sock(sock: &Path) -> initiator::NvmeDriver {
    initiator::NvmeDriver::connect(sock, opts()).expect("connect to udrive serve")
}

/// Guest buffers that are not 512-aligned (PRP1 with a dword offset; SGL data
/// blocks at odd byte addresses and of odd lengths) go through the bounce buffer
/// under O_DIRECT and still land at the right place.
#[test]
fn unaligned_guest_buffers_with_o_direct() {
    let (_dir, img) = disk_file("unaligned.img", 16 << 20);
    let direct = bdev::FileDisk::open(&img, bdev::FileOptions::default())
        .expect("open image")
        .direct();
    if !direct {
        eprintln!("note: O_DIRECT refused in the target dir; testing the buffered path");
    }
    let dev = TestDev::start("unaligned", &[&format!("file:{},direct=on", img.display())]);
    let d = dev.connect();
    let mut qp = d
        .create_qpair_with(QpairOpts {
            depth: 16,
            data_bytes: 4 << 20,
            // Three data blocks per transfer: lengths not multiples of 512.
            sgl_split: 3,
            ..Default::default()
        })
        .unwrap();
    let big = qp.alloc_buf(256 << 10).unwrap();
    let aligned = qp.alloc_buf(128 << 10).unwrap();
    let mut rng = Rng::new(0x0dd);
    let cases: [(usize, usize, DataMode); 6] = [
        (4, 4096, DataMode::Prp),
        (508, 8192, DataMode::Prp),
        (4092, 12288, DataMode::Prp),
        (1, 4096, DataMode::Sgl),
        (333, 65536, DataMode::Sgl),
        (4095, 512, DataMode::Sgl),
    ];
    for (i, (off, len, mode)) in cases.into_iter().enumerate() {
        let slba = 100 + i as u64 * 300;
        big.fill(0);
        let buf = big.sub(off, len).expect("sub buffer");
        let data = rng.bytes(len);
        buf.write(0, &data).unwrap();
        let nlb = (len / 512) as u32;
        let what = format!("{mode:?} buffer at offset {off}, {len} bytes");
        assert_ok(
            &io(&mut qp, IoOp::Write, 1, slba, nlb, Some(&buf), mode),
            &format!("write from {what}"),
        );
        assert!(
            file_bytes(&img, slba * 512, len) == data,
            "file content after write from {what}"
        );
        // Read back into the unaligned buffer and into an aligned one.
        buf.fill(0);
        assert_ok(
            &io(&mut qp, IoOp::Read, 1, slba, nlb, Some(&buf), mode),
            &format!("read into {what}"),
        );
        let mut back = vec![0u8; len];
        buf.read(0, &mut back).unwrap();
        assert!(back == data, "read into {what}");
        let a = aligned.sub(0, len).unwrap();
        assert_ok(
            &io(&mut qp, IoOp::Read, 1, slba, nlb, Some(&a), DataMode::Prp),
            "aligned read",
        );
        a.read(0, &mut back).unwrap();
        assert!(back == data, "aligned read after write from {what}");
        // The bytes around the unaligned buffer were not touched by the read.
        let mut edge = [0u8; 1];
        big.read(off - 1, &mut edge).unwrap();
        assert_eq!(edge[0], 0, "byte before {what} was written");
        big.read(off + len, &mut edge).unwrap();
        assert_eq!(edge[0], 0, "byte after {what} was written");
    }
}

#[test]
fn loop_block_device_512_and_4096() {
    let (_dir, img) = disk_file("loop.img", 24 << 20);
    for sector in [512u32, 4096] {
        let lo = match LoopDev::attach(&img, sector) {
            Ok(l) => l,
            Err(why) => {
                eprintln!("skipping the block-device test ({sector}-byte sectors): {why}");
                return;
            }
        };
        let dev = TestDev::start("loopdev", &[&format!("file:{}", lo.path.display())]);
        let d = dev.connect();
        let ns = d.namespace(1).expect("namespace 1").clone();
        assert_eq!(ns.lba_size, sector, "logical block size from the device");
        assert_eq!(ns.size_bytes(), 24 << 20, "size from BLKGETSIZE64");
        let mut qp = d.create_qpair(8, false).unwrap();
        let buf = qp.alloc_buf(64 << 10).unwrap();
        let mut rng = Rng::new(u64::from(sector));
        for (i, slba) in [0, 7, ns.nsze - 16].into_iter().enumerate() {
            let len = 16 * sector as usize;
            let data = rng.bytes(len);
            let b = buf.sub(0, len).unwrap();
            b.write(0, &data).unwrap();
            let mode = if i % 2 == 0 {
                DataMode::Prp
            } else {
                DataMode::Sgl
            };
            assert_ok(
                &io(&mut qp, IoOp::Write, 1, slba, 16, Some(&b), mode),
                "loop write",
            );
            b.fill(0);
            assert_ok(
                &io(&mut qp, IoOp::Read, 1, slba, 16, Some(&b), mode),
                "loop read",
            );
            let mut back = vec![0u8; len];
            b.read(0, &mut back).unwrap();
            assert!(back == data, "loop device data at LBA {slba}");
            flush(&mut qp);
            assert!(
                file_bytes(&img, slba * u64::from(sector), len) == data,
                "backing file of the loop device at LBA {slba}"
            );
        }
        let c = io(
            &mut qp,
            IoOp::Read,
            1,
            ns.nsze,
            1,
            Some(&buf.sub(0, sector as usize).unwrap()),
            DataMode::Prp,
        );
        assert_status(&c, 0, 0x80, "read past the device's end");
        drop(qp);
        drop(d);
        drop(dev);
    }
}
