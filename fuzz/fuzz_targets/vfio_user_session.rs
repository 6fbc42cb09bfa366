#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vfio_user::fuzzing::session(data));
