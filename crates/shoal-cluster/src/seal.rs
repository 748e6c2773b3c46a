//! Sealed datagrams: AES-256-GCM under a key derived from the cluster secret.
//!
//! Membership gossip travels as UDP datagrams; each one is sealed here before it leaves and
//! opened on arrival, so a node without the secret can neither read the cluster's state nor
//! inject into it. A datagram is `nonce (12 random bytes) || ciphertext || tag (16)`. Random
//! 96-bit nonces are safe for far more datagrams than gossip ever sends under one key.

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce};
use rand::RngCore;

use crate::secret::ClusterSecret;

const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;

/// Why a datagram could not be opened.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    #[error("datagram of {0} bytes is shorter than a sealed empty message ({min} bytes)", min = NONCE_LEN + TAG_LEN)]
    TooShort(usize),
    #[error(
        "datagram failed authentication (sent by a node with another cluster secret, or corrupted)"
    )]
    Forged,
}

/// Seals and opens datagrams with one cluster's gossip key.
#[derive(Clone)]
pub struct Sealer {
    cipher: Aes256Gcm,
}

impl Sealer {
    /// The sealer for `secret`'s cluster.
    pub fn new(secret: &ClusterSecret) -> Self {
        Self::from_key(&secret.gossip_key())
    }

    /// The sealer for a raw 32-byte key.
    pub fn from_key(key: &[u8; 32]) -> Self {
        Self {
            cipher: Aes256Gcm::new(key.into()),
        }
    }

    /// `plaintext` sealed: nonce, ciphertext and tag.
    pub fn seal(&self, plaintext: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        let ct = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), plaintext)
            .expect("AES-GCM encrypts any message shorter than 64 GiB");
        let mut out = Vec::with_capacity(NONCE_LEN + ct.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        out
    }

    /// The plaintext of a sealed datagram.
    ///
    /// # Errors
    /// [`SealError::TooShort`] for a datagram that cannot hold a nonce and a tag,
    /// [`SealError::Forged`] when authentication fails.
    pub fn open(&self, datagram: &[u8]) -> Result<Vec<u8>, SealError> {
        if datagram.len() < NONCE_LEN + TAG_LEN {
            return Err(SealError::TooShort(datagram.len()));
        }
        let (nonce, ct) = datagram.split_at(NONCE_LEN);
        self.cipher
            .decrypt(Nonce::from_slice(nonce), ct)
            .map_err(|_| SealError::Forged)
    }

    /// Bytes a sealed datagram adds to its plaintext.
    pub const OVERHEAD: usize = NONCE_LEN + TAG_LEN;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sealer(s: &str) -> Sealer {
        Sealer::new(&ClusterSecret::from_text(s, "test").unwrap())
    }

    #[test]
    fn another_secret_cannot_open() {
        let a = sealer("cluster a secret, long enough");
        let b = sealer("cluster b secret, long enough");
        let d = a.seal(b"members: 1, 2, 3");
        assert_eq!(a.open(&d).unwrap(), b"members: 1, 2, 3");
        assert_eq!(b.open(&d), Err(SealError::Forged));
        assert_eq!(a.open(&d[..10]), Err(SealError::TooShort(10)));
    }

    proptest! {
        #[test]
        fn round_trips_and_any_flipped_bit_is_caught(msg in prop::collection::vec(any::<u8>(), 0..2000), bit in any::<usize>()) {
            let s = sealer("property test secret, long enough");
            let mut d = s.seal(&msg);
            prop_assert_eq!(d.len(), msg.len() + Sealer::OVERHEAD);
            prop_assert_eq!(s.open(&d).unwrap(), msg);
            let i = bit % (d.len() * 8);
            d[i / 8] ^= 1 << (i % 8);
            prop_assert_eq!(s.open(&d), Err(SealError::Forged));
        }

        #[test]
        fn random_bytes_never_open(d in prop::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(sealer("property test secret, long enough").open(&d).is_err());
        }
    }
}
