//! The capacity server's resources file (Doorman's YAML): any bytes give a
//! config or errors that name the file, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use usher_core::config::resources::ResourcesConfig;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Err(e) = ResourcesConfig::parse("fuzz.yaml", &text) {
        assert!(e.to_string().starts_with("fuzz.yaml:"));
    }
});
