//! The cluster secret and the keys derived from it.
//!
//! Every node of a cluster holds the same secret; it never travels and never appears in a
//! log line. From it, HKDF-SHA256 derives one key per purpose (the Noise pre-shared key that
//! admits a node, the key that seals gossip datagrams), so no key serves two protocols. The
//! secret comes from a file or the `SHOAL_SECRET` environment variable, never from a flag
//! (flags show in `ps`). `ClusterSecret::generate` makes a new one for `shoal secret`.

use std::fmt;
use std::path::Path;

use hkdf::Hkdf;
use rand::RngCore;
use sha2::{Digest, Sha256};

/// The environment variable a node reads its secret from when no file is given.
pub const SECRET_ENV: &str = "SHOAL_SECRET";

/// The shortest secret accepted, in bytes: shorter ones are guessable offline from a
/// recorded handshake.
pub const MIN_SECRET_LEN: usize = 16;

/// Why a secret could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the cluster secret from {path}: {source}; create one with `shoal secret > FILE`")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the cluster secret from {origin} is {len} bytes; it must be at least {MIN_SECRET_LEN} (create one with `shoal secret`)")]
    TooShort { origin: String, len: usize },
    #[error("no cluster secret: give --secret-file FILE or set {SECRET_ENV} (create one with `shoal secret`)")]
    Missing,
}

/// A cluster's shared secret. `Debug` and `Display` never show it.
#[derive(Clone)]
pub struct ClusterSecret {
    bytes: Vec<u8>,
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl ClusterSecret {
    /// A secret from its text (surrounding whitespace, such as a file's final newline, is
    /// not part of it).
    ///
    /// # Errors
    /// [`SecretError::TooShort`] when it is shorter than [`MIN_SECRET_LEN`] bytes.
    pub fn from_text(text: &str, origin: &str) -> Result<Self, SecretError> {
        let t = text.trim();
        if t.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort {
                origin: origin.to_string(),
                len: t.len(),
            });
        }
        Ok(Self {
            bytes: t.as_bytes().to_vec(),
        })
    }

    /// The secret from `file` when given, else from [`SECRET_ENV`].
    ///
    /// # Errors
    /// The file cannot be read, the secret is too short, or there is none at all.
    pub fn load(file: Option<&Path>) -> Result<Self, SecretError> {
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
                path: path.display().to_string(),
                source,
            })?;
            return Self::from_text(&text, &path.display().to_string());
        }
        match std::env::var(SECRET_ENV) {
            Ok(text) => Self::from_text(&text, SECRET_ENV),
            Err(_) => Err(SecretError::Missing),
        }
    }

    /// A new random secret: 32 random bytes as 64 hex digits.
    pub fn generate() -> String {
        let mut b = [0u8; 32];
        rand::rng().fill_bytes(&mut b);
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// A 32-byte key for one purpose (`info` names it; different purposes get unrelated keys).
    pub fn derive(&self, info: &str) -> [u8; 32] {
        let hk = Hkdf::<Sha256>::new(Some(b"shoal cluster secret v1"), &self.bytes);
        let mut out = [0u8; 32];
        // 32 bytes is far below HKDF-SHA256's 255 * 32 limit, so expand cannot fail.
        hk.expand(info.as_bytes(), &mut out)
            .expect("32 bytes is a valid HKDF output length");
        out
    }

    /// The Noise pre-shared key that admits a node to sessions.
    pub fn noise_psk(&self) -> [u8; 32] {
        self.derive("shoal noise psk v1")
    }

    /// The key that seals membership (gossip) datagrams.
    pub fn gossip_key(&self) -> [u8; 32] {
        self.derive("shoal gossip seal v1")
    }
}

/// What a node advertises on mDNS about its cluster: a short hash of the cluster's name, so
/// that nodes dial only members of their own cluster (it says nothing about the secret).
pub fn cluster_tag(cluster_name: &str) -> String {
    let d = Sha256::digest(format!("shoal cluster name v1\0{cluster_name}").as_bytes());
    d[..8].iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_secrets_are_refused_with_the_length() {
        let e = ClusterSecret::from_text(" short \n", "test").unwrap_err();
        assert!(e.to_string().contains("5 bytes"), "{e}");
        assert!(ClusterSecret::from_text(&ClusterSecret::generate(), "gen").is_ok());
    }

    #[test]
    fn keys_differ_by_purpose_and_by_secret() {
        let a = ClusterSecret::from_text("a secret that is long enough", "t").unwrap();
        let b = ClusterSecret::from_text("b secret that is long enough", "t").unwrap();
        assert_ne!(a.noise_psk(), a.gossip_key());
        assert_ne!(a.noise_psk(), b.noise_psk());
        // trailing newline from a file is not part of the secret
        let a2 = ClusterSecret::from_text("a secret that is long enough\n", "t").unwrap();
        assert_eq!(a.noise_psk(), a2.noise_psk());
    }

    #[test]
    fn debug_does_not_show_the_secret() {
        let a = ClusterSecret::from_text("do-not-print-this-secret", "t").unwrap();
        assert!(!format!("{a:?}").contains("print"));
    }

    #[test]
    fn generated_secrets_are_64_hex_digits_and_differ() {
        let (a, b) = (ClusterSecret::generate(), ClusterSecret::generate());
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn missing_file_names_the_path() {
        let e = ClusterSecret::load(Some(Path::new("/nonexistent/secret"))).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/secret"), "{e}");
    }
}
