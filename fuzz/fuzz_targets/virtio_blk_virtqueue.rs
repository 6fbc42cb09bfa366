#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| virtio_blk::fuzzing::virtqueue(data));
