#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| udrive::fuzzing::ns_spec(data));
