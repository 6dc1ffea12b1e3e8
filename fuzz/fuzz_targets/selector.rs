//! The label selector parser must never panic, and whatever it accepts must print to text that
//! parses back to the same selector and matches the same labels.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use rcfarm::labels::Selector;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(sel) = Selector::parse(text) {
        let printed = sel.to_string();
        let again = Selector::parse(&printed).expect("a printed selector parses");
        assert_eq!(again, sel, "round trip of {text:?} via {printed:?}");
        // Matching never panics either, whatever the labels.
        let labels: BTreeMap<String, String> =
            text.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(sel.matches(&labels), again.matches(&labels));
    }
});
