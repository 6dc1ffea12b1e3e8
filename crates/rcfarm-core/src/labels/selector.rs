//! Kubernetes label selectors in their string syntax: parse, match, print.
//!
//! Grammar (k8s.io/apimachinery `labels.Parse`): requirements separated by commas, all of which
//! must hold; each is `key`, `!key`, `key=value`, `key==value`, `key!=value`,
//! `key in (v1,v2)`, `key notin (v1,v2)`, `key>N` or `key<N`. The empty selector matches
//! everything. Keys and values are validated as Kubernetes validates label keys and values, so
//! a selector P2 accepted parses here and one it refused is refused.
//!
//! Printing is canonical (requirements sorted by key, then operator; set values sorted), so
//! `parse(print(s)) == s` for every selector.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// One condition on one label.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Requirement {
    /// `key` present.
    Exists(String),
    /// `!key`: key absent.
    DoesNotExist(String),
    /// `key=value` (also written `key==value`).
    Equals(String, String),
    /// `key!=value`: absent, or present with another value.
    NotEquals(String, String),
    /// `key in (a,b)`: present with one of the values.
    In(String, BTreeSet<String>),
    /// `key notin (a,b)`: absent, or present with none of the values.
    NotIn(String, BTreeSet<String>),
    /// `key>N`: present with an integer value greater than N.
    GreaterThan(String, i64),
    /// `key<N`: present with an integer value less than N.
    LessThan(String, i64),
}

impl Requirement {
    pub fn key(&self) -> &str {
        match self {
            Requirement::Exists(k)
            | Requirement::DoesNotExist(k)
            | Requirement::Equals(k, _)
            | Requirement::NotEquals(k, _)
            | Requirement::In(k, _)
            | Requirement::NotIn(k, _)
            | Requirement::GreaterThan(k, _)
            | Requirement::LessThan(k, _) => k,
        }
    }

    /// Whether a label set satisfies this requirement.
    pub fn matches<L: LabelLookup + ?Sized>(&self, labels: &L) -> bool {
        let value = labels.label(self.key());
        match self {
            Requirement::Exists(_) => value.is_some(),
            Requirement::DoesNotExist(_) => value.is_none(),
            Requirement::Equals(_, v) => value == Some(v.as_str()),
            Requirement::NotEquals(_, v) => value != Some(v.as_str()),
            Requirement::In(_, vs) => value.is_some_and(|x| vs.contains(x)),
            Requirement::NotIn(_, vs) => value.is_none_or(|x| !vs.contains(x)),
            Requirement::GreaterThan(_, n) => value
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            Requirement::LessThan(_, n) => value
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x < *n),
        }
    }

    /// The values this requirement pins the key to, if it can only match those (for indexes).
    pub fn required_values(&self) -> Option<Vec<&str>> {
        match self {
            Requirement::Equals(_, v) => Some(vec![v.as_str()]),
            Requirement::In(_, vs) => Some(vs.iter().map(String::as_str).collect()),
            _ => None,
        }
    }
}

/// Anything labels can be looked up in.
pub trait LabelLookup {
    fn label(&self, key: &str) -> Option<&str>;
}

impl LabelLookup for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl LabelLookup for std::collections::HashMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// A parsed selector: all requirements must hold.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    /// The selector that matches everything.
    pub fn everything() -> Self {
        Self::default()
    }

    pub fn from_requirements(mut requirements: Vec<Requirement>) -> Self {
        // Canonical order: by key, then by operator and values.
        requirements.sort_by(|a, b| a.key().cmp(b.key()).then_with(|| a.cmp(b)));
        requirements.dedup();
        Self { requirements }
    }

    /// A selector of `key=value` pairs.
    pub fn from_equalities<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self::from_requirements(
            pairs
                .into_iter()
                .map(|(k, v)| Requirement::Equals(k.to_string(), v.to_string()))
                .collect(),
        )
    }

    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        Parser::new(s).parse()
    }

    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches<L: LabelLookup + ?Sized>(&self, labels: &L) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// Adds a requirement (keeping the canonical order).
    pub fn and(mut self, r: Requirement) -> Self {
        self.requirements.push(r);
        Self::from_requirements(self.requirements)
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set = |vs: &BTreeSet<String>| vs.iter().cloned().collect::<Vec<_>>().join(",");
        match self {
            Requirement::Exists(k) => write!(f, "{k}"),
            Requirement::DoesNotExist(k) => write!(f, "!{k}"),
            Requirement::Equals(k, v) => write!(f, "{k}={v}"),
            Requirement::NotEquals(k, v) => write!(f, "{k}!={v}"),
            Requirement::In(k, vs) => write!(f, "{k} in ({})", set(vs)),
            Requirement::NotIn(k, vs) => write!(f, "{k} notin ({})", set(vs)),
            Requirement::GreaterThan(k, n) => write!(f, "{k}>{n}"),
            Requirement::LessThan(k, n) => write!(f, "{k}<{n}"),
        }
    }
}

impl std::str::FromStr for Selector {
    type Err = SelectorError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Selector::parse(s)
    }
}

impl serde::Serialize for Selector {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Selector {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Selector::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Why a selector did not parse, and where (a character offset into the input).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid label selector {input:?}: {message} at position {position}\n  {input}\n  {caret}^", caret = " ".repeat(self.caret_offset()))]
pub struct SelectorError {
    pub input: String,
    /// Offset in characters (not bytes) of the offending token.
    pub position: usize,
    pub message: String,
}

impl SelectorError {
    fn caret_offset(&self) -> usize {
        // Debug-escaped input is printed without quotes on the second line: count chars.
        self.input.chars().take(self.position).count()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Comma,
    Eq,
    DoubleEq,
    NotEq,
    In,
    NotIn,
    Open,
    Close,
    Bang,
    Gt,
    Lt,
    End,
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Ident(s) => format!("{s:?}"),
            Tok::Comma => "','".into(),
            Tok::Eq => "'='".into(),
            Tok::DoubleEq => "'=='".into(),
            Tok::NotEq => "'!='".into(),
            Tok::In => "'in'".into(),
            Tok::NotIn => "'notin'".into(),
            Tok::Open => "'('".into(),
            Tok::Close => "')'".into(),
            Tok::Bang => "'!'".into(),
            Tok::Gt => "'>'".into(),
            Tok::Lt => "'<'".into(),
            Tok::End => "the end".into(),
        }
    }
}

struct Parser<'a> {
    input: &'a str,
    chars: Vec<char>,
    pos: usize,
    /// Position of the last token returned, for errors.
    tok_pos: usize,
    peeked: Option<(Tok, usize, usize)>,
}

fn is_ident_char(c: char) -> bool {
    !(c.is_whitespace() || matches!(c, ',' | '=' | '!' | '(' | ')' | '<' | '>'))
}

impl<'a> Parser<'a> {
    fn new(input: &'a str) -> Self {
        Parser {
            input,
            chars: input.chars().collect(),
            pos: 0,
            tok_pos: 0,
            peeked: None,
        }
    }

    fn error(&self, position: usize, message: impl Into<String>) -> SelectorError {
        SelectorError {
            input: self.input.to_string(),
            position,
            message: message.into(),
        }
    }

    /// Lexes the next token without consuming it: (token, start, end).
    fn lex(&self) -> (Tok, usize, usize) {
        let mut i = self.pos;
        while i < self.chars.len() && self.chars[i].is_whitespace() {
            i += 1;
        }
        let start = i;
        let Some(&c) = self.chars.get(i) else {
            return (Tok::End, start, start);
        };
        let next = self.chars.get(i + 1).copied();
        let one = |t: Tok| (t, start, start + 1);
        match c {
            ',' => one(Tok::Comma),
            '(' => one(Tok::Open),
            ')' => one(Tok::Close),
            '>' => one(Tok::Gt),
            '<' => one(Tok::Lt),
            '=' if next == Some('=') => (Tok::DoubleEq, start, start + 2),
            '=' => one(Tok::Eq),
            '!' if next == Some('=') => (Tok::NotEq, start, start + 2),
            '!' => one(Tok::Bang),
            _ => {
                let mut j = i;
                while j < self.chars.len() && is_ident_char(self.chars[j]) {
                    j += 1;
                }
                let word: String = self.chars[i..j].iter().collect();
                let tok = match word.as_str() {
                    "in" => Tok::In,
                    "notin" => Tok::NotIn,
                    _ => Tok::Ident(word),
                };
                (tok, start, j)
            }
        }
    }

    fn peek(&mut self) -> Tok {
        if self.peeked.is_none() {
            self.peeked = Some(self.lex());
        }
        self.peeked
            .as_ref()
            .map(|p| p.0.clone())
            .unwrap_or(Tok::End)
    }

    fn next(&mut self) -> Tok {
        let (tok, start, end) = self.peeked.take().unwrap_or_else(|| self.lex());
        self.pos = end;
        self.tok_pos = start;
        tok
    }

    fn parse(mut self) -> Result<Selector, SelectorError> {
        let mut reqs = Vec::new();
        if self.peek() == Tok::End {
            return Ok(Selector::everything());
        }
        loop {
            reqs.push(self.requirement()?);
            match self.next() {
                Tok::End => break,
                Tok::Comma => {
                    if self.peek() == Tok::End {
                        let p = self.tok_pos;
                        return Err(self.error(p, "expected a requirement after ','"));
                    }
                }
                other => {
                    let p = self.tok_pos;
                    return Err(self.error(
                        p,
                        format!("expected ',' or the end, found {}", other.describe()),
                    ));
                }
            }
        }
        Ok(Selector::from_requirements(reqs))
    }

    fn requirement(&mut self) -> Result<Requirement, SelectorError> {
        if self.peek() == Tok::Bang {
            self.next();
            let key = self.key()?;
            return Ok(Requirement::DoesNotExist(key));
        }
        let key = self.key()?;
        match self.peek() {
            Tok::Comma | Tok::End => Ok(Requirement::Exists(key)),
            Tok::Eq | Tok::DoubleEq => {
                self.next();
                Ok(Requirement::Equals(key, self.value()?))
            }
            Tok::NotEq => {
                self.next();
                Ok(Requirement::NotEquals(key, self.value()?))
            }
            Tok::In => {
                self.next();
                Ok(Requirement::In(key, self.set()?))
            }
            Tok::NotIn => {
                self.next();
                Ok(Requirement::NotIn(key, self.set()?))
            }
            Tok::Gt | Tok::Lt => {
                let gt = self.next() == Tok::Gt;
                let op = if gt { '>' } else { '<' };
                let tok = self.next();
                let p = self.tok_pos;
                let n = match &tok {
                    Tok::Ident(v) => v.parse::<i64>().ok(),
                    _ => None,
                }
                .ok_or_else(|| {
                    self.error(
                        p,
                        format!("expected an integer after '{op}', found {}", tok.describe()),
                    )
                })?;
                Ok(if gt {
                    Requirement::GreaterThan(key, n)
                } else {
                    Requirement::LessThan(key, n)
                })
            }
            other => {
                self.next();
                let p = self.tok_pos;
                Err(self.error(
                    p,
                    format!("expected an operator (=, ==, !=, in, notin, >, <), ',' or the end after key {key:?}, found {}", other.describe()),
                ))
            }
        }
    }

    fn key(&mut self) -> Result<String, SelectorError> {
        match self.next() {
            Tok::Ident(k) => {
                let p = self.tok_pos;
                validate_key(&k).map_err(|m| self.error(p, m))?;
                Ok(k)
            }
            // `in` and `notin` are reserved words, not keys.
            other => {
                let p = self.tok_pos;
                Err(self.error(
                    p,
                    format!("expected a label key, found {}", other.describe()),
                ))
            }
        }
    }

    fn value(&mut self) -> Result<String, SelectorError> {
        match self.peek() {
            // An empty value: `a=` or `a=,b`.
            Tok::Comma | Tok::End | Tok::Close => Ok(String::new()),
            Tok::Ident(v) => {
                self.next();
                let p = self.tok_pos;
                validate_value(&v).map_err(|m| self.error(p, m))?;
                Ok(v)
            }
            // Reserved words are fine as values (`tier=in`).
            Tok::In => {
                self.next();
                Ok("in".into())
            }
            Tok::NotIn => {
                self.next();
                Ok("notin".into())
            }
            other => {
                self.next();
                let p = self.tok_pos;
                Err(self.error(
                    p,
                    format!("expected a label value, found {}", other.describe()),
                ))
            }
        }
    }

    fn set(&mut self) -> Result<BTreeSet<String>, SelectorError> {
        match self.next() {
            Tok::Open => {}
            other => {
                let p = self.tok_pos;
                return Err(self.error(
                    p,
                    format!(
                        "expected '(' to open a value set, found {}",
                        other.describe()
                    ),
                ));
            }
        }
        let mut values = BTreeSet::new();
        loop {
            values.insert(self.value()?);
            match self.next() {
                Tok::Comma => continue,
                Tok::Close => break,
                other => {
                    let p = self.tok_pos;
                    return Err(self.error(
                        p,
                        format!(
                            "expected ',' or ')' in a value set, found {}",
                            other.describe()
                        ),
                    ));
                }
            }
        }
        Ok(values)
    }
}

/// Kubernetes label key: `[prefix/]name`, prefix a DNS subdomain (≤ 253), name ≤ 63 characters
/// of `[A-Za-z0-9._-]`, beginning and ending alphanumeric.
pub fn validate_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        if p.is_empty() || p.len() > 253 {
            return Err(format!(
                "invalid label key {key:?}: the prefix before '/' must be a DNS subdomain of 1 to 253 characters"
            ));
        }
        let ok = p.split('.').all(|part| {
            !part.is_empty()
                && part.len() <= 63
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
        if !ok {
            return Err(format!(
                "invalid label key {key:?}: the prefix {p:?} must be a lowercase DNS subdomain (a-z, 0-9, '-', '.')"
            ));
        }
    }
    validate_name(name).map_err(|why| format!("invalid label key {key:?}: the name {why}"))
}

/// Kubernetes label value: empty, or ≤ 63 characters of `[A-Za-z0-9._-]`, beginning and ending
/// alphanumeric.
pub fn validate_value(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Ok(());
    }
    validate_name(value).map_err(|why| format!("invalid label value {value:?}: it {why}"))
}

fn validate_name(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > 63 {
        return Err(format!(
            "must be at most 63 characters (it has {})",
            s.len()
        ));
    }
    let alnum = |c: char| c.is_ascii_alphanumeric();
    if !s.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.')) {
        return Err("may contain only letters, digits, '-', '_' and '.'".into());
    }
    if !s.starts_with(alnum) || !s.ends_with(alnum) {
        return Err("must begin and end with a letter or digit".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_every_operator() {
        let s = Selector::parse("a=b, c==d,e!=f,g in (x, y),h notin (z),i,!j,k>5,l<10").unwrap();
        assert_eq!(s.requirements().len(), 9);
        assert_eq!(
            s.to_string(),
            "a=b,c=d,e!=f,g in (x,y),h notin (z),i,!j,k>5,l<10"
        );
        assert!(Selector::parse("").unwrap().is_empty());
        assert!(Selector::parse("   ").unwrap().is_empty());
    }

    #[test]
    fn matches_like_kubernetes() {
        let l = labels(&[("env", "prod"), ("tier", "web"), ("cpu", "8")]);
        let m = |s: &str| Selector::parse(s).unwrap().matches(&l);
        assert!(m(""));
        assert!(m("env=prod"));
        assert!(m("env==prod,tier=web"));
        assert!(!m("env=prod,tier=db"));
        assert!(m("env!=staging"));
        assert!(m("missing!=x"), "!= matches an absent key");
        assert!(m("env in (prod,staging)"));
        assert!(!m("missing in (x)"), "in needs the key");
        assert!(m("missing notin (x)"), "notin matches an absent key");
        assert!(!m("env notin (prod)"));
        assert!(m("tier") && !m("missing"));
        assert!(m("!missing") && !m("!tier"));
        assert!(m("cpu>4") && !m("cpu>8") && m("cpu<9") && !m("env>1"));
        let with_empty = labels(&[("e", "")]);
        assert!(Selector::parse("e=").unwrap().matches(&with_empty));
        assert!(!Selector::parse("e=").unwrap().matches(&l));
    }

    #[test]
    fn errors_point_at_the_offending_token() {
        let e = |s: &str| Selector::parse(s).unwrap_err();
        assert_eq!(e("a=b,,c").position, 4);
        assert_eq!(e("a in x").position, 5);
        assert_eq!(e("a in (x").position, 7);
        assert_eq!(e("a=b c").position, 4);
        assert_eq!(e("a=b,").position, 3);
        assert_eq!(e("=b").position, 0);
        assert_eq!(e("a>x").position, 2);
        assert!(e("bad key!x").message.contains("expected"));
        let err = e("a=b,-bad=c");
        assert_eq!(err.position, 4);
        assert!(
            err.message.contains("must begin and end"),
            "{}",
            err.message
        );
        let shown = err.to_string();
        assert!(shown.contains("position 4"), "{shown}");
        assert!(shown.lines().nth(2).unwrap().ends_with("    ^"), "{shown}");
        assert!(e("Example.COM/x=y").message.contains("DNS subdomain"));
        assert!(e(&format!("a={}", "v".repeat(64))).message.contains("63"));
    }

    #[test]
    fn reserved_words_are_values_not_keys() {
        assert_eq!(Selector::parse("x=in").unwrap().to_string(), "x=in");
        assert!(Selector::parse("in=x").is_err());
    }

    #[test]
    fn prefixed_keys() {
        let s = Selector::parse("rcfarm.io/pool=spare,!example.com/drain").unwrap();
        assert_eq!(s.to_string(), "!example.com/drain,rcfarm.io/pool=spare");
        assert_eq!(Selector::parse("k<-3").unwrap().to_string(), "k<-3");
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    fn name() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9._-]{0,10}[a-z0-9])?"
            .prop_filter("not reserved", |s| s != "in" && s != "notin")
    }

    fn key() -> impl Strategy<Value = String> {
        (
            proptest::option::of("[a-z]{1,5}(\\.[a-z]{1,5}){0,2}"),
            name(),
        )
            .prop_map(|(p, n)| match p {
                Some(p) => format!("{p}/{n}"),
                None => n,
            })
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![Just(String::new()), name()]
    }

    fn requirement() -> impl Strategy<Value = Requirement> {
        prop_oneof![
            key().prop_map(Requirement::Exists),
            key().prop_map(Requirement::DoesNotExist),
            (key(), value()).prop_map(|(k, v)| Requirement::Equals(k, v)),
            (key(), value()).prop_map(|(k, v)| Requirement::NotEquals(k, v)),
            (key(), proptest::collection::btree_set(value(), 1..4))
                .prop_map(|(k, v)| Requirement::In(k, v)),
            (key(), proptest::collection::btree_set(value(), 1..4))
                .prop_map(|(k, v)| Requirement::NotIn(k, v)),
            (key(), any::<i32>()).prop_map(|(k, n)| Requirement::GreaterThan(k, n as i64)),
            (key(), any::<i32>()).prop_map(|(k, n)| Requirement::LessThan(k, n as i64)),
        ]
    }

    fn selector() -> impl Strategy<Value = Selector> {
        proptest::collection::vec(requirement(), 0..6).prop_map(Selector::from_requirements)
    }

    proptest! {
        #[test]
        fn print_then_parse_is_identity(s in selector()) {
            let printed = s.to_string();
            let parsed = Selector::parse(&printed).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&parsed, &s);
            prop_assert_eq!(parsed.to_string(), printed);
        }

        #[test]
        fn parsing_arbitrary_text_never_panics(s in "\\PC{0,40}") {
            let _ = Selector::parse(&s);
        }

        #[test]
        fn parsing_selector_like_text_never_panics(s in "[a-z!=(),<> 0-9in]{0,30}") {
            if let Ok(sel) = Selector::parse(&s) {
                // Whatever parses prints to something that parses to the same selector.
                prop_assert_eq!(Selector::parse(&sel.to_string()).unwrap(), sel);
            }
        }
    }
}
