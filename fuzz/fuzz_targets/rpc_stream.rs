#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| udrive::fuzzing::rpc_stream(data));
