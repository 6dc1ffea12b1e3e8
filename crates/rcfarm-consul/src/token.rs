//! The ACL token a client sends: none, a fixed one, or the contents of a file that is re-read when
//! it changes, so that a token can be rotated without restarting a farm. The token itself is never
//! logged or put in an error message; the file's path is.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use reqwest::header::HeaderValue;

use super::error::{ConsulError, Result};

/// How often, at most, the token file is looked at (one `stat`; read only when it changed).
const RECHECK: Duration = Duration::from_secs(1);

const FLAG: &str = "--consul-token-file / CONSUL_HTTP_TOKEN_FILE";

pub(super) enum TokenSource {
    None,
    Fixed(HeaderValue),
    File(TokenFile),
}

pub(super) struct TokenFile {
    path: PathBuf,
    state: Mutex<FileState>,
}

struct FileState {
    value: HeaderValue,
    /// What the file looked like when `value` was read: a change re-reads it.
    stamp: Option<Stamp>,
    checked: Instant,
    /// The last stamp whose read failed, so that a bad file is warned about once.
    failed: Option<Stamp>,
}

/// Modification time, length and inode: a token replaced by a rename (as rotation tools do)
/// changes the inode even within one tick of a coarse clock and at the same length.
type Stamp = (SystemTime, u64, u64);

fn header_value(token: &str) -> std::result::Result<HeaderValue, &'static str> {
    let mut v = HeaderValue::from_str(token)
        .map_err(|_| "the token contains characters not allowed in an HTTP header")?;
    v.set_sensitive(true);
    Ok(v)
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let ino = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let ino = 0;
    Some((m.modified().ok()?, m.len(), ino))
}

/// Reads a token file as Consul does: its contents, trimmed; empty is an error.
fn read_token(path: &Path) -> std::result::Result<HeaderValue, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read it: {e}"))?;
    let token = text.trim();
    if token.is_empty() {
        return Err("it is empty; write the ACL token into it".into());
    }
    header_value(token).map_err(str::to_string)
}

impl TokenSource {
    /// A fixed token, or one read from `file` (the file wins when both are given, as in Consul's
    /// own client; the command line decides which are given). A file that cannot be read, or is
    /// empty, is an error naming it.
    pub(super) fn new(token: Option<&str>, file: Option<&Path>) -> Result<TokenSource> {
        if let Some(path) = file {
            let value = read_token(path).map_err(|why| {
                ConsulError::Config(format!(
                    "the ACL token file {} ({FLAG}): {why}",
                    path.display()
                ))
            })?;
            return Ok(TokenSource::File(TokenFile {
                path: path.to_path_buf(),
                state: Mutex::new(FileState {
                    value,
                    stamp: stamp(path),
                    checked: Instant::now(),
                    failed: None,
                }),
            }));
        }
        match token {
            None => Ok(TokenSource::None),
            Some(t) => header_value(t)
                .map(TokenSource::Fixed)
                .map_err(|why| ConsulError::Config(format!("the ACL token: {why}"))),
        }
    }

    /// The token to send now.
    pub(super) fn current(&self) -> Option<HeaderValue> {
        match self {
            TokenSource::None => None,
            TokenSource::Fixed(v) => Some(v.clone()),
            TokenSource::File(f) => Some(f.current()),
        }
    }

    /// Look at the file again on the next request (Consul refused the token: it may have been
    /// rotated a moment ago).
    pub(super) fn recheck_soon(&self) {
        if let TokenSource::File(f) = self {
            let mut s = f.state.lock();
            s.checked = Instant::now() - RECHECK;
        }
    }

    pub(super) fn is_set(&self) -> bool {
        !matches!(self, TokenSource::None)
    }
}

impl TokenFile {
    fn current(&self) -> HeaderValue {
        let mut s = self.state.lock();
        if s.checked.elapsed() < RECHECK {
            return s.value.clone();
        }
        s.checked = Instant::now();
        let now = stamp(&self.path);
        if now == s.stamp || (now.is_some() && now == s.failed) {
            return s.value.clone();
        }
        match read_token(&self.path) {
            Ok(v) => {
                if v != s.value {
                    tracing::info!(file = %self.path.display(), "ACL token file changed: using the new token");
                }
                s.value = v;
                s.stamp = now;
                s.failed = None;
            }
            Err(why) => {
                // Keep the last good token: a rotation tool may be half-way through writing.
                tracing::warn!(file = %self.path.display(), "ACL token file: {why}; still using the token read before");
                s.failed = now;
            }
        }
        s.value.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_file_is_reread_when_it_changes_and_a_bad_rewrite_keeps_the_old_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first-token\n").unwrap();
        let src = TokenSource::new(Some("ignored"), Some(&path)).unwrap();
        assert_eq!(src.current().unwrap(), "first-token");

        std::fs::write(&path, "second-token-longer\n").unwrap();
        src.recheck_soon();
        assert_eq!(src.current().unwrap(), "second-token-longer");

        std::fs::write(&path, "   \n").unwrap();
        src.recheck_soon();
        assert_eq!(src.current().unwrap(), "second-token-longer");

        std::fs::remove_file(&path).unwrap();
        src.recheck_soon();
        assert_eq!(src.current().unwrap(), "second-token-longer");
    }

    #[test]
    fn a_missing_or_empty_token_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let Err(ConsulError::Config(msg)) = TokenSource::new(None, Some(&missing)) else {
            panic!("a missing token file is refused");
        };
        assert!(msg.contains(&missing.display().to_string()), "{msg}");
        assert!(msg.contains("cannot read it"), "{msg}");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let Err(ConsulError::Config(msg)) = TokenSource::new(None, Some(&empty)) else {
            panic!("an empty token file is refused");
        };
        assert!(msg.contains("it is empty"), "{msg}");
        assert!(msg.contains("CONSUL_HTTP_TOKEN_FILE"), "{msg}");
    }
}
