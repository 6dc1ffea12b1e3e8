//! Pod manifests: YAML (JSON is YAML too) whose top-level `id` is the pod id.
//!
//! The intent the farm writes is the manifest's original text, byte for byte (as P2 does, PGP
//! clearsign armor included). Consistency checks compare digests of the parsed document, so a
//! rewrite that only changes formatting, key order or comments is not a difference.

use std::fmt;
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// A parsed, valid manifest.
#[derive(Clone, PartialEq, Eq)]
pub struct Manifest {
    /// Shared with the record it came from ([`RawRc::manifest`](super::RawRc)): every farm
    /// keeps every RC, and the text is most of a record.
    raw: Arc<str>,
    pod_id: String,
    digest: String,
    /// Whether the manifest has a `status_port`: only then does P2's preparer check the pod's
    /// health; without one it writes "passing" once, whatever runs.
    health_checked: bool,
}

impl fmt::Debug for Manifest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Manifest")
            .field("pod_id", &self.pod_id)
            .field("digest", &&self.digest[..12])
            .finish()
    }
}

/// Why a manifest is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("the manifest is empty")]
    Empty,
    #[error("the manifest is not valid YAML: {0}")]
    Yaml(String),
    #[error("the manifest must be a YAML mapping with an `id`, found {0}")]
    NotAMapping(&'static str),
    #[error("the manifest has no `id` (the pod id)")]
    MissingId,
    #[error("the manifest's `id` {0:?} is not a usable pod id: {1}")]
    BadId(String, &'static str),
}

impl Manifest {
    pub fn parse(raw: &str) -> Result<Manifest, ManifestError> {
        Self::parse_shared(Arc::from(raw))
    }

    /// Parses `raw`, keeping that very text (not a copy) as the manifest's.
    pub fn parse_shared(shared: Arc<str>) -> Result<Manifest, ManifestError> {
        let raw = &*shared;
        if raw.trim().is_empty() {
            return Err(ManifestError::Empty);
        }
        let body = clearsigned_body(raw);
        let body = body.as_deref().unwrap_or(raw);
        let yaml: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(body).map_err(|e| ManifestError::Yaml(e.to_string()))?;
        let canonical = yaml_to_json(&yaml)?;
        let Value::Object(map) = &canonical else {
            return Err(ManifestError::NotAMapping(kind(&canonical)));
        };
        let pod_id = match map.get("id") {
            None | Some(Value::Null) => return Err(ManifestError::MissingId),
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
        };
        validate_pod_id(&pod_id).map_err(|why| ManifestError::BadId(pod_id.clone(), why))?;
        let digest = hex::encode(Sha256::digest(canonical_bytes(&canonical)));
        let health_checked = map
            .get("status_port")
            .and_then(Value::as_u64)
            .is_some_and(|p| p > 0);
        Ok(Manifest {
            raw: shared.clone(),
            pod_id,
            digest,
            health_checked,
        })
    }

    /// The pod id (`id`).
    pub fn pod_id(&self) -> &str {
        &self.pod_id
    }

    /// The text as given; what the farm writes as the intent.
    pub fn raw(&self) -> &str {
        &self.raw
    }

    /// SHA-256 (hex) of the parsed document in canonical form: equal for documents that differ
    /// only in formatting, key order or comments.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Whether P2's preparer checks this pod's health (it has a `status_port`).
    pub fn health_checked(&self) -> bool {
        self.health_checked
    }
}

/// The key of the pod's `config` that `rcctl rc restart` sets. P2's preparer relaunches a
/// pod when the SHA-256 of its intent's manifest differs from reality's, and P2 computes that
/// SHA over the manifest re-marshalled from its struct: unknown top-level fields are dropped
/// and change nothing, but `config` is a free-form map kept whole. A key there changes the SHA
/// (a relaunch) and nothing else P2 reads; the pod sees it in its config file.
pub const RESTART_CONFIG_KEY: &str = "rcfarm_restarted_at";

/// Why a manifest cannot be restarted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestartError {
    #[error(
        "the manifest is PGP-signed: changing its config would break the signature; sign a new manifest (a changed config) and roll to it (rcctl roll start)"
    )]
    Signed,
    #[error("the manifest's `config` is {0}, not a mapping: rcfarm cannot add its restart key")]
    ConfigNotAMapping(&'static str),
    #[error(transparent)]
    Manifest(#[from] ManifestError),
}

impl Manifest {
    /// This manifest with `config.rcfarm_restarted_at` set to `at`: the same pod, to P2's
    /// preparer a different one (see [`RESTART_CONFIG_KEY`]). Comments and key order of the
    /// original text are not kept (the YAML is written again).
    pub fn restarted(&self, at: &str) -> Result<String, RestartError> {
        use serde_yaml_ng::Value as Y;
        if clearsigned_body(&self.raw).is_some() {
            return Err(RestartError::Signed);
        }
        let mut doc: Y =
            serde_yaml_ng::from_str(&self.raw).map_err(|e| ManifestError::Yaml(e.to_string()))?;
        let Y::Mapping(top) = &mut doc else {
            return Err(ManifestError::NotAMapping("something else").into());
        };
        let config = top
            .entry(Y::String("config".into()))
            .or_insert_with(|| Y::Mapping(Default::default()));
        if config.is_null() {
            *config = Y::Mapping(Default::default());
        }
        let Y::Mapping(config) = config else {
            let json = yaml_to_json(config)?;
            return Err(RestartError::ConfigNotAMapping(kind(&json)));
        };
        config.insert(
            Y::String(RESTART_CONFIG_KEY.into()),
            Y::String(at.to_string()),
        );
        let text =
            serde_yaml_ng::to_string(&doc).map_err(|e| ManifestError::Yaml(e.to_string()))?;
        // What the farm will parse must be a manifest of the same pod.
        Manifest::parse(&text)?;
        Ok(text)
    }
}

/// A pod id becomes part of keys (`intent/<node>/<pod-id>`): no `/`, no whitespace.
pub fn validate_pod_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() {
        return Err("it is empty");
    }
    if id.contains('/') {
        return Err("it contains '/'");
    }
    if id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("it contains whitespace or control characters");
    }
    if id.len() > 253 {
        return Err("it is longer than 253 characters");
    }
    Ok(())
}

/// The signed text of a PGP clearsigned message (dash-escaping undone), if `raw` is one.
fn clearsigned_body(raw: &str) -> Option<String> {
    let mut lines = raw.lines();
    if lines.next()?.trim_end() != "-----BEGIN PGP SIGNED MESSAGE-----" {
        return None;
    }
    // Armor headers ("Hash: SHA256") end at the first empty line.
    for l in lines.by_ref() {
        if l.trim().is_empty() {
            break;
        }
    }
    let mut body = String::new();
    for l in lines {
        if l.trim_end() == "-----BEGIN PGP SIGNATURE-----" {
            return Some(body);
        }
        body.push_str(l.strip_prefix("- ").unwrap_or(l));
        body.push('\n');
    }
    None
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// The document as JSON. Mapping keys must be scalars: YAML's complex keys (`? [a, b]`) have no
/// JSON form, and stringifying them nests escapes exponentially (a 150-byte document needed
/// gigabytes; found by fuzzing).
fn yaml_to_json(v: &serde_yaml_ng::Value) -> Result<Value, ManifestError> {
    use serde_yaml_ng::Value as Y;
    Ok(match v {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(*b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                n.as_f64()
                    .and_then(serde_json::Number::from_f64)
                    .map(Value::Number)
                    .unwrap_or(Value::Null)
            }
        }
        Y::String(s) => Value::String(s.clone()),
        Y::Sequence(s) => Value::Array(s.iter().map(yaml_to_json).collect::<Result<_, _>>()?),
        Y::Mapping(m) => Value::Object(
            m.iter()
                .map(|(k, v)| {
                    let key = match k {
                        Y::String(s) => s.clone(),
                        Y::Null => "null".to_string(),
                        Y::Bool(b) => b.to_string(),
                        Y::Number(n) => n.to_string(),
                        Y::Tagged(t) if matches!(t.value, Y::String(_)) => {
                            t.value.as_str().unwrap_or_default().to_string()
                        }
                        _ => {
                            return Err(ManifestError::Yaml(
                                "a mapping key is a sequence or mapping; keys must be plain \
                                 scalars"
                                    .into(),
                            ));
                        }
                    };
                    Ok((key, yaml_to_json(v)?))
                })
                .collect::<Result<_, _>>()?,
        ),
        Y::Tagged(t) => yaml_to_json(&t.value)?,
    })
}

/// JSON with object keys sorted at every level.
fn canonical_bytes(v: &Value) -> Vec<u8> {
    fn sort(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut entries: Vec<(&String, &Value)> = m.iter().collect();
                entries.sort_by(|a, b| a.0.cmp(b.0));
                Value::Object(
                    entries
                        .into_iter()
                        .map(|(k, v)| (k.clone(), sort(v)))
                        .collect(),
                )
            }
            Value::Array(a) => Value::Array(a.iter().map(sort).collect()),
            other => other.clone(),
        }
    }
    serde_json::to_vec(&sort(v)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complex_mapping_keys_are_refused_not_expanded() {
        // Nested complex keys: stringifying them used to grow exponentially (fuzzing found it).
        let bomb = format!("{}:&", "? - ".repeat(40));
        assert!(matches!(
            Manifest::parse(&bomb),
            Err(ManifestError::Yaml(_))
        ));
        let e = Manifest::parse("id: x\n? [a, b]\n: c\n").unwrap_err();
        assert!(e.to_string().contains("keys must be plain scalars"), "{e}");
        // Scalar keys of other types are fine.
        assert_eq!(
            Manifest::parse("id: x\n1: one\ntrue: yes\n")
                .unwrap()
                .pod_id(),
            "x"
        );
    }

    #[test]
    fn yaml_and_json_manifests() {
        let y =
            Manifest::parse("id: web\nlaunchables:\n  app:\n    launchable_type: hoist\n").unwrap();
        assert_eq!(y.pod_id(), "web");
        let j = Manifest::parse(
            r#"{"launchables": {"app": {"launchable_type": "hoist"}}, "id": "web"}"#,
        )
        .unwrap();
        assert_eq!(
            y.digest(),
            j.digest(),
            "key order and syntax do not change the digest"
        );
        let commented =
            Manifest::parse("# a comment\nid: web\nlaunchables: {app: {launchable_type: hoist}}\n")
                .unwrap();
        assert_eq!(commented.digest(), y.digest());
        let other = Manifest::parse("id: web\nlaunchables: {}\n").unwrap();
        assert_ne!(other.digest(), y.digest());
        assert_eq!(
            y.raw(),
            "id: web\nlaunchables:\n  app:\n    launchable_type: hoist\n"
        );
    }

    #[test]
    fn invalid_manifests_say_why() {
        assert_eq!(Manifest::parse("  \n"), Err(ManifestError::Empty));
        assert_eq!(
            Manifest::parse("launchables: {}"),
            Err(ManifestError::MissingId)
        );
        assert_eq!(Manifest::parse("id: ~"), Err(ManifestError::MissingId));
        assert!(matches!(
            Manifest::parse("- a\n- b"),
            Err(ManifestError::NotAMapping("a list"))
        ));
        assert!(matches!(
            Manifest::parse("id: [unclosed"),
            Err(ManifestError::Yaml(_))
        ));
        assert!(matches!(
            Manifest::parse("id: a/b"),
            Err(ManifestError::BadId(_, _))
        ));
        assert!(matches!(
            Manifest::parse("id: ''"),
            Err(ManifestError::BadId(_, _))
        ));
        assert_eq!(Manifest::parse("id: 42").unwrap().pod_id(), "42");
    }

    #[test]
    fn a_restarted_manifest_differs_only_in_its_config_restart_key() {
        let m = Manifest::parse(
            "id: web\nlaunchables: {app: {launchable_type: hoist}}\nconfig:\n  port: 80\n",
        )
        .unwrap();
        let once = Manifest::parse(&m.restarted("2026-11-25T12:00:00Z").unwrap()).unwrap();
        assert_eq!(once.pod_id(), "web");
        assert_ne!(once.digest(), m.digest(), "P2 relaunches for it");
        assert!(once.raw().contains("port: 80"));
        assert!(
            once.raw()
                .contains("rcfarm_restarted_at: 2026-11-25T12:00:00Z"),
            "{}",
            once.raw()
        );
        // Again: the key is replaced, not added twice; a new time is a new digest.
        let twice = Manifest::parse(&once.restarted("2026-11-25T13:00:00Z").unwrap()).unwrap();
        assert_eq!(twice.raw().matches(RESTART_CONFIG_KEY).count(), 1);
        assert_ne!(twice.digest(), once.digest());
        // No config, or an empty one: made.
        for raw in ["id: web\n", "id: web\nconfig:\n"] {
            let r = Manifest::parse(raw).unwrap().restarted("t").unwrap();
            assert!(r.contains("rcfarm_restarted_at: t"), "{r}");
        }
        assert_eq!(
            Manifest::parse("id: web\nconfig: [a]\n")
                .unwrap()
                .restarted("t"),
            Err(RestartError::ConfigNotAMapping("a list"))
        );
        let signed = "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA256\n\nid: p\n-----BEGIN PGP SIGNATURE-----\n\nabc\n-----END PGP SIGNATURE-----\n";
        assert_eq!(
            Manifest::parse(signed).unwrap().restarted("t"),
            Err(RestartError::Signed)
        );
    }

    #[test]
    fn clearsigned_manifests_parse_from_their_signed_text() {
        let signed = "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA256\n\nid: signed-pod\ntags:\n- - dash-escaped\n-----BEGIN PGP SIGNATURE-----\n\nabc\n-----END PGP SIGNATURE-----\n";
        let m = Manifest::parse(signed).unwrap();
        assert_eq!(m.pod_id(), "signed-pod");
        assert_eq!(m.raw(), signed, "the intent keeps the signature");
    }
}
