//! A label set as the caches hold it: every key and value in one string.
//!
//! A farm holds the labels of every pod and node in the cluster. As a `BTreeMap<String,
//! String>` even a two-label set costs a 544-byte B-tree node and four strings (~670 bytes); at
//! 100,000 pods (20,000 distinct sets) and 10,000 nodes that was the largest thing a farm held.
//! Here it is two allocations the size of the text.

use super::selector::LabelLookup;
use super::store::LabelSet;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CompactLabels {
    /// Keys and values, concatenated in key order.
    text: Box<str>,
    /// Where each key and then its value ends in `text`.
    ends: Box<[usize]>,
}

impl CompactLabels {
    pub fn new(labels: &LabelSet) -> CompactLabels {
        let mut text = String::with_capacity(labels.iter().map(|(k, v)| k.len() + v.len()).sum());
        let mut ends = Vec::with_capacity(labels.len() * 2);
        for (k, v) in labels {
            text.push_str(k);
            ends.push(text.len());
            text.push_str(v);
            ends.push(text.len());
        }
        CompactLabels {
            text: text.into_boxed_str(),
            ends: ends.into_boxed_slice(),
        }
    }

    /// `(key, value)` pairs in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.ends.chunks_exact(2).scan(0, |start, pair| {
            let (k_end, v_end) = (pair[0], pair[1]);
            let kv = (&self.text[*start..k_end], &self.text[k_end..v_end]);
            *start = v_end;
            Some(kv)
        })
    }

    pub fn len(&self) -> usize {
        self.ends.len() / 2
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn to_set(&self) -> LabelSet {
        self.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

impl LabelLookup for CompactLabels {
    fn label(&self, key: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::labels::Selector;

    #[test]
    fn holds_what_it_was_given() {
        let set: LabelSet = [("b", "2"), ("a", ""), ("", "x"), ("zone", "eu-west-1a")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let c = CompactLabels::new(&set);
        assert_eq!(c.to_set(), set);
        assert_eq!(c.len(), 4);
        assert_eq!(c.label("a"), Some(""));
        assert_eq!(c.label(""), Some("x"));
        assert_eq!(c.label("zone"), Some("eu-west-1a"));
        assert_eq!(c.label("missing"), None);
        // Concatenations that read alike are still different sets.
        let ab = |k: &str, v: &str| CompactLabels::new(&[(k.to_string(), v.to_string())].into());
        assert_ne!(ab("ab", "c"), ab("a", "bc"));
        let sel = Selector::parse("zone in (eu-west-1a),b=2,!missing").unwrap();
        assert!(sel.matches(&c));
        assert!(CompactLabels::new(&LabelSet::new()).is_empty());
    }
}
