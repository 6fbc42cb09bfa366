#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| udrive::fuzzing::qcow2_image(data));
