//! The routes file parser and validator: any bytes give a config or errors
//! that name the file, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use usher_core::config::routes::RoutesConfig;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Err(e) = RoutesConfig::parse("fuzz.yaml", &text) {
        assert!(!e.diagnostics.is_empty());
        assert!(e.to_string().starts_with("fuzz.yaml:"));
    }
});
