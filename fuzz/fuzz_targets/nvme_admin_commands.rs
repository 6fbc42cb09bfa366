#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nvme::fuzzing::admin_commands(data));
