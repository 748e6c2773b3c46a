//! What nodes say to each other inside an authenticated session.
//!
//! A session opens with each side's [`Hello`]; then the dialing side sends [`Request`]s and
//! the other answers each with one [`Response`], both as JSON messages. A request that
//! carries bulk bytes (a bandwidth probe) sends them as the next message, raw. Anything a
//! peer sends is untrusted: a message that does not parse ends the session with an error
//! naming the peer, and sizes are checked before anything is allocated for them.

use serde::{Deserialize, Serialize};

/// The version of this protocol; a peer with another one is refused with both named.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest bandwidth probe a node accepts.
pub const MAX_PROBE_BYTES: u64 = 64 << 20;

/// The first message each side sends in a session.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    /// The sender's node id.
    pub node: String,
    /// The cluster name's tag (see `secret::cluster_tag`).
    pub cluster: String,
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: u32,
    /// The sender's wall clock when it sent this, milliseconds since the Unix epoch (0:
    /// not told), for estimating clock skew between nodes.
    #[serde(default)]
    pub clock_ms: u64,
}

/// A request from the dialing node.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Answer at once (round-trip time).
    Ping,
    /// The next message holds `bytes` bytes; answer when all arrived (bandwidth).
    Probe { bytes: u64 },
    /// Make this session the link from rank `from` to rank `to` of generation `generation`
    /// of instance `instance` (a world of `world` ranks); after the answer the session
    /// carries only that link's bytes.
    Mesh {
        instance: String,
        generation: u64,
        from: u32,
        to: u32,
        world: u32,
    },
    /// A request for the node's application (the instance driver): its JSON body is
    /// passed on and its answer returned.
    App { body: serde_json::Value },
    /// `len` bytes at `offset` of the file whose SHA-256 is `sha256` (hex); answered by
    /// [`Response::Bytes`] and the bytes as the next message.
    Fetch {
        sha256: String,
        offset: u64,
        len: u64,
    },
}

/// The answer to one [`Request`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Response {
    Pong,
    ProbeReceived {
        bytes: u64,
    },
    /// The session is now the requested mesh link.
    MeshAccepted,
    /// The application's answer.
    App {
        body: serde_json::Value,
    },
    /// The next message holds the `len` bytes asked for.
    Bytes {
        len: u64,
    },
    /// The request was refused; the text says why.
    Error {
        message: String,
    },
}

/// Why a peer's message could not be used.
#[derive(Debug, thiserror::Error)]
#[error("node {peer} sent a message shoal cannot read ({what}): {reason}")]
pub struct ProtocolError {
    pub peer: String,
    pub what: &'static str,
    pub reason: String,
}

/// `bytes` parsed as a `T`, or an error naming the peer and what was expected.
///
/// # Errors
/// The bytes are not a JSON `T`.
pub fn decode<T: serde::de::DeserializeOwned>(
    peer: &str,
    what: &'static str,
    bytes: &[u8],
) -> Result<T, ProtocolError> {
    serde_json::from_slice(bytes).map_err(|e| ProtocolError {
        peer: peer.to_string(),
        what,
        reason: e.to_string(),
    })
}

/// `value` as a JSON message.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("protocol types serialize")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn requests_round_trip() {
        for r in [Request::Ping, Request::Probe { bytes: 7 }] {
            assert_eq!(decode::<Request>("p", "request", &encode(&r)).unwrap(), r);
        }
        let e = decode::<Request>("n1", "request", b"{\"op\":\"format_disk\"}").unwrap_err();
        assert!(e.to_string().contains("n1"), "{e}");
    }

    proptest! {
        #[test]
        fn garbage_is_an_error_not_a_panic(b in prop::collection::vec(any::<u8>(), 0..100)) {
            let _ = decode::<Request>("p", "request", &b);
            let _ = decode::<Hello>("p", "hello", &b);
        }
    }
}
