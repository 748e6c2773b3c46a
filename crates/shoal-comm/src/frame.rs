//! The frame header that opens every message on a byte-stream transport (TCP, shared-memory
//! rings). A header is [`HEADER_LEN`] bytes, little-endian: a magic number (so a stream that
//! lost its place, or a stranger's connection, is caught at once), the protocol version, a
//! reserved field and the payload length. Receivers always know how many bytes they expect,
//! so a header is checked against that expectation and the payload is read straight into the
//! caller's buffer: a length from the wire never drives an allocation.

use crate::CommError;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 16;

/// The first four bytes of every frame: "SHOL" read as a little-endian `u32`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"SHOL");

/// The wire protocol version this build speaks. Ranks of one world must all speak the same.
pub const PROTOCOL_VERSION: u16 = 1;

/// The largest payload a frame may announce (1 TiB). A receiver rejects anything larger
/// before comparing with what it expected, so a corrupt length is reported as such.
pub const MAX_PAYLOAD: u64 = 1 << 40;

/// Writes the header of a frame carrying `len` payload bytes.
#[must_use]
pub fn encode(len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    // h[6..8]: reserved, zero.
    h[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// Checks a received header against the payload length this rank expects from `peer`.
///
/// # Errors
/// [`CommError::Protocol`] naming what differs (magic, version or length) and both values.
pub fn check(
    header: &[u8; HEADER_LEN],
    expected: usize,
    rank: usize,
    peer: usize,
) -> Result<(), CommError> {
    let protocol = |reason: String| CommError::Protocol { rank, peer, reason };
    let magic = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    if magic != MAGIC {
        return Err(protocol(format!(
            "frame starts with {magic:#010x}, not the shoal magic {MAGIC:#010x}: the peer is not \
             a shoal rank or the stream lost its place after an earlier error; restart every rank"
        )));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != PROTOCOL_VERSION {
        return Err(protocol(format!(
            "peer speaks protocol version {version}, this rank speaks version {PROTOCOL_VERSION}; \
             run the same shoal build on every rank"
        )));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&header[8..16]);
    let len = u64::from_le_bytes(len);
    if len > MAX_PAYLOAD {
        return Err(protocol(format!(
            "frame announces {len} bytes, more than the limit of {MAX_PAYLOAD} (this rank expected \
             {expected}): the stream is corrupt; restart every rank"
        )));
    }
    if len != expected as u64 {
        return Err(length_mismatch(rank, peer, len, expected));
    }
    Ok(())
}

/// The error for a message of `got` bytes where `expected` were expected.
#[must_use]
pub fn length_mismatch(rank: usize, peer: usize, got: u64, expected: usize) -> CommError {
    CommError::Protocol {
        rank,
        peer,
        reason: format!(
            "peer sent a message of {got} bytes where this rank expected {expected} bytes: the \
             ranks are running different steps (check that every rank runs the same model, \
             command and shoal build)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        let h = encode(12345);
        check(&h, 12345, 0, 1).unwrap();
        assert_eq!(&h[0..4], b"SHOL");
    }

    #[test]
    fn wrong_length_names_both() {
        let h = encode(10);
        let e = check(&h, 12, 0, 1).unwrap_err().to_string();
        assert!(e.contains("10 bytes") && e.contains("expected 12"), "{e}");
    }

    #[test]
    fn wrong_version_names_both() {
        let mut h = encode(10);
        h[4..6].copy_from_slice(&7u16.to_le_bytes());
        let e = check(&h, 10, 3, 2).unwrap_err();
        assert!(matches!(
            e,
            CommError::Protocol {
                rank: 3,
                peer: 2,
                ..
            }
        ));
        let e = e.to_string();
        assert!(
            e.contains("version 7") && e.contains(&format!("version {PROTOCOL_VERSION}")),
            "{e}"
        );
    }

    #[test]
    fn bad_magic_and_huge_length() {
        let mut h = encode(10);
        h[0] ^= 0xff;
        assert!(check(&h, 10, 0, 1)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut h = encode(0);
        h[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(check(&h, 10, 0, 1)
            .unwrap_err()
            .to_string()
            .contains("limit"));
    }
}
