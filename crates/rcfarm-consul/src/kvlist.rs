//! A prefix listing (`GET /v1/kv/<prefix>?recurse`) kept as Consul sent it: the body, and
//! where each entry's key, value and session sit in it.
//!
//! A watch answer is the whole tree again every time (20,000 RCs: ~9 MiB of JSON; 100,000
//! pods' labels: ~25 MiB), and most of its entries are unchanged since the last answer. Decoded
//! into [`KvPair`]s it was held twice over while folded: the body, and every key and value
//! copied out of it with its base64 decoded (≈ 1.1× the body again), and that transient copy
//! was most of the gap between a farm's steady and peak memory. Here an entry costs a few
//! offsets; a fold reads `ModifyIndex` first and decodes a value only for an entry it parses.
//!
//! Every value is checked to be valid base64 when the answer is decoded, so a malformed answer
//! fails as a whole, as a [`KvPair`] listing does, and [`KvRef::value`] cannot fail later.

use std::borrow::Cow;
use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, SeqAccess, Visitor};

use super::types::KvPair;

/// One KV entry, owned ([`KvPair`]) or a view into a listing ([`KvRef`]): what the parsers
/// of RCs, locks, labels and rolls read, whichever way the entries came.
pub trait KvEntry {
    fn key(&self) -> &str;
    /// The session holding the key's lock.
    fn session(&self) -> Option<&str>;
    fn modify_index(&self) -> u64;
    fn create_index(&self) -> u64;
    fn lock_index(&self) -> u64;
    /// The value's bytes; an absent value reads as empty.
    fn value(&self) -> Cow<'_, [u8]>;
}

impl KvEntry for KvPair {
    fn key(&self) -> &str {
        &self.key
    }
    fn session(&self) -> Option<&str> {
        self.session.as_deref()
    }
    fn modify_index(&self) -> u64 {
        self.modify_index
    }
    fn create_index(&self) -> u64 {
        self.create_index
    }
    fn lock_index(&self) -> u64 {
        self.lock_index
    }
    fn value(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.value_bytes())
    }
}

impl<T: KvEntry + ?Sized> KvEntry for &T {
    fn key(&self) -> &str {
        (**self).key()
    }
    fn session(&self) -> Option<&str> {
        (**self).session()
    }
    fn modify_index(&self) -> u64 {
        (**self).modify_index()
    }
    fn create_index(&self) -> u64 {
        (**self).create_index()
    }
    fn lock_index(&self) -> u64 {
        (**self).lock_index()
    }
    fn value(&self) -> Cow<'_, [u8]> {
        (**self).value()
    }
}

/// Text of the body: where it sits, or (escaped in the JSON, so not as it sits) which of the
/// list's owned strings it is, or absent. Eight bytes: a listing of 100,000 entries holds
/// 300,000 of these.
#[derive(Debug, Clone, Copy)]
struct Text {
    start: u32,
    len: u32,
}

impl Text {
    const ABSENT: u32 = u32::MAX;
    const OWNED: u32 = u32::MAX - 1;
    const NONE: Text = Text {
        start: 0,
        len: Text::ABSENT,
    };
}

#[derive(Debug, Clone)]
struct Span {
    key: Text,
    /// The value's base64 text.
    value: Text,
    session: Text,
    lock_index: u64,
    create_index: u64,
    modify_index: u64,
}

/// A listing as Consul sent it (see the module doc).
#[derive(Debug, Clone, Default)]
pub struct KvList {
    body: Bytes,
    entries: Vec<Span>,
    /// Strings the JSON had escaped (rare: Go escapes `<`, `>` and `&`).
    owned: Vec<Box<str>>,
}

/// One entry of a [`KvList`].
#[derive(Debug, Clone, Copy)]
pub struct KvRef<'a> {
    list: &'a KvList,
    span: &'a Span,
}

impl KvList {
    /// Decodes a listing's body (a JSON array of Consul's `KVPair`s).
    pub fn decode(body: Bytes) -> Result<KvList, String> {
        if body.len() >= Text::OWNED as usize {
            return Err(format!("a listing of {} bytes is too big", body.len()));
        }
        let mut de = serde_json::Deserializer::from_slice(&body);
        let mut owned = Vec::new();
        let mut entries = Entries {
            expected: count_keys(&body),
            base: &body,
            scratch: Vec::new(),
            owned: &mut owned,
        }
        .deserialize(&mut de)
        .and_then(|e| de.end().map(|()| e))
        .map_err(|e| e.to_string())?;
        entries.shrink_to_fit();
        Ok(KvList {
            body,
            entries,
            owned,
        })
    }

    /// The same listing from owned entries (for tests, and for callers that built them).
    pub fn from_pairs(pairs: &[KvPair]) -> KvList {
        // Through the wire form, so that these lists are read exactly as answers are.
        let body = serde_json::to_vec(pairs).unwrap_or_default();
        // A KvPair always encodes to a valid listing: an invariant of its Serialize.
        KvList::decode(Bytes::from(body)).unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, in Consul's (key) order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = KvRef<'_>> + '_ {
        self.entries
            .iter()
            .map(move |span| KvRef { list: self, span })
    }

    /// A fingerprint of the keys and their `ModifyIndex`es.
    pub fn digest(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.len().hash(&mut h);
        for e in self.iter() {
            e.key().hash(&mut h);
            e.modify_index().hash(&mut h);
        }
        h.finish()
    }

    fn text(&self, t: Text) -> Option<&str> {
        match t.len {
            Text::ABSENT => None,
            Text::OWNED => self.owned.get(t.start as usize).map(|s| &**s),
            len => {
                let bytes = self
                    .body
                    .get(t.start as usize..t.start as usize + len as usize)?;
                // Spans are taken from `&str`s the JSON decoder borrowed out of this body, so
                // they are valid UTF-8 on character boundaries.
                std::str::from_utf8(bytes).ok()
            }
        }
    }
}

impl<'a> KvRef<'a> {
    pub fn key(&self) -> &'a str {
        // Every entry has a key (decoding refuses one without).
        self.list.text(self.span.key).unwrap_or_default()
    }

    /// The session holding the key's lock (Consul omits it, or sends it empty, when unlocked).
    pub fn session(&self) -> Option<&'a str> {
        self.list.text(self.span.session).filter(|s| !s.is_empty())
    }

    pub fn modify_index(&self) -> u64 {
        self.span.modify_index
    }

    pub fn create_index(&self) -> u64 {
        self.span.create_index
    }

    pub fn lock_index(&self) -> u64 {
        self.span.lock_index
    }

    /// The value, decoded (`None`: Consul's `null`).
    pub fn value(&self) -> Option<Vec<u8>> {
        let text = self.list.text(self.span.value)?;
        // Checked when the listing was decoded, so this cannot fail.
        Some(B64.decode(text).unwrap_or_default())
    }
}

impl KvEntry for KvRef<'_> {
    fn key(&self) -> &str {
        KvRef::key(self)
    }
    fn session(&self) -> Option<&str> {
        KvRef::session(self)
    }
    fn modify_index(&self) -> u64 {
        self.span.modify_index
    }
    fn create_index(&self) -> u64 {
        self.span.create_index
    }
    fn lock_index(&self) -> u64 {
        self.span.lock_index
    }
    fn value(&self) -> Cow<'_, [u8]> {
        Cow::Owned(KvRef::value(self).unwrap_or_default())
    }
}

/// Counts `"Key":` in a body: one per entry (a key or value holding those bytes would have its
/// quote escaped; an estimate in any case, only used to size a list).
fn count_keys(body: &[u8]) -> usize {
    const PAT: &[u8] = b"\"Key\":";
    let mut n = 0;
    let mut rest = body;
    while let Some(at) = rest.iter().position(|&b| b == b'"') {
        rest = &rest[at..];
        if rest.starts_with(PAT) {
            n += 1;
            rest = &rest[PAT.len()..];
        } else {
            rest = &rest[1..];
        }
    }
    n
}

/// A string of the body, borrowed where the JSON has it unescaped.
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v))
            }
        }
        d.deserialize_str(V).map(Str)
    }
}

/// One entry as Consul sends it (`Flags` too, which rcfarm never reads: not kept).
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Wire<'a> {
    #[serde(default)]
    lock_index: u64,
    #[serde(borrow)]
    key: Str<'a>,
    #[serde(default, borrow)]
    value: Option<Str<'a>>,
    #[serde(default, borrow)]
    session: Option<Str<'a>>,
    #[serde(default)]
    create_index: u64,
    #[serde(default)]
    modify_index: u64,
}

/// Decodes the array entry by entry into spans, with no intermediate list of entries.
struct Entries<'b> {
    /// How many entries the body seems to hold, to size the list once: grown by doubling,
    /// a 100,000-entry list was held up to twice over while it was decoded.
    expected: usize,
    base: &'b [u8],
    /// Where values are decoded to be checked (one buffer, reused).
    scratch: Vec<u8>,
    owned: &'b mut Vec<Box<str>>,
}

impl Entries<'_> {
    fn text(&mut self, s: Option<Str<'_>>) -> Text {
        let Some(s) = s else {
            return Text::NONE;
        };
        if let Cow::Borrowed(b) = &s.0 {
            let start = (b.as_ptr() as usize).wrapping_sub(self.base.as_ptr() as usize);
            if let Some(end) = start.checked_add(b.len())
                && end <= self.base.len()
            {
                // `decode` refused bodies of `Text::OWNED` bytes or more, so these fit.
                return Text {
                    start: start as u32,
                    len: b.len() as u32,
                };
            }
        }
        self.owned.push(s.0.into_owned().into_boxed_str());
        Text {
            start: (self.owned.len() - 1) as u32,
            len: Text::OWNED,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Entries<'_> {
    type Value = Vec<Span>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<Span>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Entries<'_> {
    type Value = Vec<Span>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of KV entries")
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Vec<Span>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(self.expected));
        while let Some(w) = seq.next_element::<Wire<'de>>()? {
            if let Some(v) = &w.value {
                self.scratch.clear();
                B64.decode_vec(v.0.as_bytes(), &mut self.scratch)
                    .map_err(|e| serde::de::Error::custom(format!("{}: {e}", w.key.0)))?;
            }
            out.push(Span {
                key: self.text(Some(w.key)),
                value: self.text(w.value),
                session: self.text(w.session),
                lock_index: w.lock_index,
                create_index: w.create_index,
                modify_index: w.modify_index,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The entries copied out as [`KvPair`]s: what a `Vec<KvPair>` listing would have held,
    /// but for `Flags`.
    fn to_pairs(list: &KvList) -> Vec<KvPair> {
        list.iter()
            .map(|e| KvPair {
                lock_index: e.span.lock_index,
                key: e.key().to_string(),
                flags: 0,
                value: e.value(),
                session: e.session().map(str::to_string),
                create_index: e.span.create_index,
                modify_index: e.span.modify_index,
            })
            .collect()
    }

    fn pair(key: &str, value: Option<&[u8]>, session: Option<&str>, idx: u64) -> KvPair {
        KvPair {
            key: key.into(),
            value: value.map(<[u8]>::to_vec),
            session: session.map(str::to_string),
            lock_index: idx + 1,
            create_index: idx - 1,
            modify_index: idx,
            flags: 0,
        }
    }

    #[test]
    fn a_listing_reads_back_what_was_sent() {
        let pairs = vec![
            pair("rcs/a", Some(b"{\"x\":1}"), None, 7),
            pair("rcs/b", None, Some("sess-1"), 9),
            // Go escapes these in JSON: the key is then owned, not a span of the body.
            pair("rcs/<&>\u{e9}", Some(&[0, 255, 10]), None, 11),
        ];
        let list = KvList::from_pairs(&pairs);
        assert_eq!(list.len(), 3);
        assert_eq!(to_pairs(&list), pairs);
        let e: Vec<_> = list.iter().collect();
        assert_eq!(e[1].key(), "rcs/b");
        assert_eq!(e[1].session(), Some("sess-1"));
        assert_eq!(e[1].value(), None);
        assert_eq!(KvEntry::value(&e[1]).as_ref(), b"");
        assert_eq!(e[2].key(), "rcs/<&>\u{e9}");
        assert_eq!(e[2].value().as_deref(), Some(&[0, 255, 10][..]));
        assert_eq!((e[0].modify_index(), e[0].create_index()), (7, 6));
    }

    #[test]
    fn consul_spelling_is_read_escapes_and_empty_sessions_included() {
        let body = br#"[{"LockIndex":0,"Key":"labels\/pod\/n1\/p\u003c1","Flags":0,"Value":"e30=","Session":"","CreateIndex":4,"ModifyIndex":5},{"Key":"k","Value":null}]"#;
        let list = KvList::decode(Bytes::from_static(body)).expect("decodes");
        let e: Vec<_> = list.iter().collect();
        assert_eq!(e[0].key(), "labels/pod/n1/p<1");
        assert_eq!(e[0].session(), None);
        assert_eq!(e[0].value().as_deref(), Some(&b"{}"[..]));
        assert_eq!(e[1].value(), None);
        assert_eq!(e[1].modify_index(), 0);
    }

    #[test]
    fn a_malformed_answer_fails_whole() {
        for body in [
            &br#"[{"Key":"a","Value":"not base64!"}]"#[..],
            br#"[{"Value":"e30="}]"#,
            br#"{"Key":"a"}"#,
            br#"[{"Key":"a"}] trailing"#,
        ] {
            assert!(
                KvList::decode(Bytes::copy_from_slice(body)).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn an_entry_is_three_offsets_and_three_indexes() {
        assert_eq!(std::mem::size_of::<Span>(), 48);
    }

    #[test]
    fn digest_follows_keys_and_modify_indexes() {
        let a = KvList::from_pairs(&[pair("k", Some(b"1"), None, 3)]);
        let b = KvList::from_pairs(&[pair("k", Some(b"2"), None, 3)]);
        let c = KvList::from_pairs(&[pair("k", Some(b"1"), None, 4)]);
        assert_eq!(a.digest(), b.digest());
        assert_ne!(a.digest(), c.digest());
    }
}
