#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nvme::fuzzing::data_pointer(data));
