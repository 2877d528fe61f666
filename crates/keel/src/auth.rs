//! The API's bearer token: generated once into its token file (default
//! `DATA_DIR/token`, mode 0600), checked in constant time on every request
//! except `/healthz`. A token file elsewhere (`--token-file`, as the package
//! sets up in `/etc/keel/token`, mode 0640 group keel) may be readable by its
//! group, so the group's members use the CLI without root; never by others.

use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use axum::http::{header, HeaderMap};
use rand::RngCore;
use subtle::ConstantTimeEq;

pub const TOKEN_FILE: &str = "token";
/// 32 random bytes, hex-encoded.
const TOKEN_BYTES: usize = 32;

/// The secret every API request must present.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    pub fn new(secret: impl Into<Arc<str>>) -> Self {
        Self(secret.into())
    }

    pub fn secret(&self) -> &str {
        &self.0
    }

    /// Constant-time in the token's content (its length is not secret).
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.0.as_bytes().ct_eq(presented).into()
    }

    /// Whether `Authorization: Bearer <token>` carries this token.
    pub fn authorizes(&self, headers: &HeaderMap) -> bool {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return false;
        };
        let bytes = value.as_bytes();
        let scheme = b"bearer ";
        if bytes.len() <= scheme.len() || !bytes[..scheme.len()].eq_ignore_ascii_case(scheme) {
            return false;
        }
        self.matches(bytes[scheme.len()..].trim_ascii())
    }
}

pub fn token_path(data_dir: &Path) -> PathBuf {
    data_dir.join(TOKEN_FILE)
}

/// Reads the token in `data_dir/token`, generating it on first start.
pub fn load_or_create(data_dir: &Path) -> anyhow::Result<Token> {
    load_or_create_at(&token_path(data_dir))
}

/// Reads the token file, generating it on first start. The file is written
/// under a temporary name created with mode 0600 and hard-linked into
/// place, so it is never readable by others nor seen half-written, and two
/// servers starting at once agree on one token.
pub fn load_or_create_at(path: &Path) -> anyhow::Result<Token> {
    let path = path.to_path_buf();
    if let Some(token) = read_existing(&path)? {
        return Ok(token);
    }
    let hex = generate_secret();
    let tmp = sibling_tmp(&path);
    let _ = fs::remove_file(&tmp);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    let written = file
        .write_all(format!("{hex}\n").as_bytes())
        .and_then(|()| file.sync_all());
    drop(file);
    let linked = written.and_then(|()| fs::hard_link(&tmp, &path));
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            tracing::info!(path = %path.display(), "generated API token");
            Ok(Token::new(hex))
        }
        // Another server won the race: use its token.
        Err(e) if e.kind() == ErrorKind::AlreadyExists => read_existing(&path)?
            .with_context(|| format!("{} vanished while starting", path.display())),
        Err(e) => Err(e).with_context(|| format!("writing {}", path.display())),
    }
}

/// A new random token: 32 bytes from the OS, hex-encoded.
pub fn generate_secret() -> String {
    let mut secret = [0u8; TOKEN_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut secret);
    secret.iter().map(|b| format!("{b:02x}")).collect()
}

/// The token in `path`, if there is one (refused if others can read it).
pub fn read_local(path: &Path) -> anyhow::Result<Option<Token>> {
    read_existing(path)
}

/// A temporary name beside `path`, in the same directory so that a rename
/// or link into place is atomic.
fn sibling_tmp(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| TOKEN_FILE.to_string());
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Writes `token` to `path` (mode 0600 from creation, or `mode` if given:
/// 0640 for a token file shared with a group), replacing whatever is there
/// atomically: for control planes whose token comes from the cluster
/// store, so the CLI on this host finds it, and for `keel token create`.
pub fn write_local(path: &Path, token: &Token) -> anyhow::Result<()> {
    write_token_file(path, token, 0o600)
}

pub fn write_token_file(path: &Path, token: &Token, mode: u32) -> anyhow::Result<()> {
    if fs::read_to_string(path).is_ok_and(|t| t.trim() == token.secret()) {
        let have = fs::metadata(path)?.permissions().mode() & 0o777;
        if have & !mode & 0o777 == 0 {
            return Ok(());
        }
    }
    let tmp = sibling_tmp(path);
    let _ = fs::remove_file(&tmp);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    let written = file
        .write_all(format!("{}\n", token.secret()).as_bytes())
        // The creation mode is filtered by the umask; the file must have
        // exactly the mode asked for.
        .and_then(|()| file.set_permissions(fs::Permissions::from_mode(mode)))
        .and_then(|()| file.sync_all());
    drop(file);
    let renamed = written.and_then(|()| fs::rename(&tmp, path));
    if renamed.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    renamed.with_context(|| format!("writing {}", path.display()))
}

fn read_existing(path: &Path) -> anyhow::Result<Option<Token>> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    // A token another user wrote would be theirs to know.
    keel_hv::ownership::ensure_owned("token file", path)?;
    let mode = meta.permissions().mode() & 0o777;
    // Group read is allowed (a token file shared with the keel group);
    // group write and any access by others are not.
    if mode & 0o037 != 0 {
        bail!(
            "token file {} has mode {mode:04o}, open to others; run `chmod 600 {}` (or 640 to share it with its group; or delete it to generate a new token)",
            path.display(),
            path.display()
        );
    }
    Ok(Some(Token::new(read_token_file(path)?)))
}

/// The token in a token file, trimmed; an error if it is empty.
pub fn read_token_file(path: &Path) -> anyhow::Result<String> {
    let text = fs::read_to_string(path)
        .with_context(|| format!("reading API token from {}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        bail!("token file {} is empty", path.display());
    }
    Ok(token.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing() {
        let t = Token::new("abc");
        let mut h = HeaderMap::new();
        assert!(!t.authorizes(&h));
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert!(t.authorizes(&h));
        h.insert(header::AUTHORIZATION, "bearer  abc ".parse().unwrap());
        assert!(t.authorizes(&h));
        for bad in [
            "Bearer abd",
            "Bearer ab",
            "Bearer abcd",
            "Basic abc",
            "Bearer ",
            "abc",
        ] {
            h.insert(header::AUTHORIZATION, bad.parse().unwrap());
            assert!(!t.authorizes(&h), "{bad}");
        }
    }

    #[test]
    fn created_once_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let a = load_or_create(dir.path()).unwrap();
        let b = load_or_create(dir.path()).unwrap();
        assert_eq!(a.secret(), b.secret());
        assert_eq!(a.secret().len(), 64);
        let mode = fs::metadata(token_path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        fs::set_permissions(token_path(dir.path()), fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_or_create(dir.path()).unwrap_err().to_string();
        assert!(err.contains("chmod 600"), "{err}");
        // Shared with its group is allowed; group write is not.
        fs::set_permissions(token_path(dir.path()), fs::Permissions::from_mode(0o640)).unwrap();
        assert_eq!(load_or_create(dir.path()).unwrap().secret(), a.secret());
        fs::set_permissions(token_path(dir.path()), fs::Permissions::from_mode(0o660)).unwrap();
        assert!(load_or_create(dir.path()).is_err());
    }

    #[test]
    fn a_shared_token_file_gets_exactly_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("etc-keel-token");
        let token = Token::new(generate_secret());
        write_token_file(&path, &token, 0o640).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o640);
        assert_eq!(load_or_create_at(&path).unwrap().secret(), token.secret());
    }
}
