//! Decoding an RC record (JSON, then its YAML manifest) must never panic: a malformed record is
//! an error the farm reports, never a crash.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcfarm::rc::{Manifest, Rc};

fuzz_target!(|data: &[u8]| {
    let _ = Rc::from_kv("replication_controllers/6ba7b810-9dad-11d1-80b4-00c04fd430c8", data, 1);
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(m) = Manifest::parse(text) {
            assert!(!m.pod_id().is_empty());
        }
    }
});
