//! Who this node is: a stable id and a static X25519 key, kept in the data directory.
//!
//! The id (16 hex digits, random, made once) names the node everywhere: in membership, in
//! placements, in logs; the lowest live id acts as coordinator. The static key is the node's
//! Noise identity in every session. Both survive restarts; a node whose files are removed
//! comes back as a new node. The key file is written with mode 0600.

use std::path::{Path, PathBuf};

/// Why the identity could not be read or made.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("{path} does not hold a {what}; remove it to make a new one (the node then joins as a new node)")]
    Corrupt { path: PathBuf, what: &'static str },
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// This node's id and static key.
#[derive(Clone)]
pub struct Identity {
    /// 16 hex digits.
    pub id: String,
    /// The X25519 private key of the node's Noise identity.
    pub key: [u8; 32],
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").field("id", &self.id).finish()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.trim();
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn io<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> IdentityError + 'a {
    move |source| IdentityError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

fn read_or_make<const N: usize>(
    path: &Path,
    what: &'static str,
    make: impl FnOnce() -> [u8; N],
    private: bool,
) -> Result<[u8; N], IdentityError> {
    match std::fs::read_to_string(path) {
        Ok(s) => unhex::<N>(&s).ok_or_else(|| IdentityError::Corrupt {
            path: path.to_path_buf(),
            what,
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let v = make();
            write_new(path, &hex(&v), private)?;
            Ok(v)
        }
        Err(e) => Err(io("read", path)(e)),
    }
}

fn write_new(path: &Path, text: &str, private: bool) -> Result<(), IdentityError> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = private;
    let mut f = opts.open(path).map_err(io("create", path))?;
    f.write_all(text.as_bytes()).map_err(io("write", path))?;
    Ok(())
}

impl Identity {
    /// The identity kept in `dir` (`node_id`, `node_key`), made there on first use.
    ///
    /// # Errors
    /// The directory cannot be created, a file cannot be read or written, or a file holds
    /// something else than an id or a key.
    pub fn load_or_create(dir: &Path) -> Result<Self, IdentityError> {
        std::fs::create_dir_all(dir).map_err(io("create", dir))?;
        let id = read_or_make::<8>(
            &dir.join("node_id"),
            "node id (16 hex digits)",
            rand::random::<[u8; 8]>,
            false,
        )?;
        let key = read_or_make::<32>(
            &dir.join("node_key"),
            "node key (64 hex digits)",
            rand::random::<[u8; 32]>,
            true,
        )?;
        Ok(Self { id: hex(&id), key })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_survives_a_restart_and_corruption_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let a = Identity::load_or_create(dir.path()).unwrap();
        let b = Identity::load_or_create(dir.path()).unwrap();
        assert_eq!(a.id, b.id);
        assert_eq!(a.key, b.key);
        assert_eq!(a.id.len(), 16);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("node_key"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::write(dir.path().join("node_id"), "not hex").unwrap();
        let e = Identity::load_or_create(dir.path()).unwrap_err();
        assert!(e.to_string().contains("node_id"), "{e}");
        assert!(!format!("{a:?}").contains(&hex(&a.key)));
    }
}
