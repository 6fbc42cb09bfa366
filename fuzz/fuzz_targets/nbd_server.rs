#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| udrive::fuzzing::nbd_server(data));
