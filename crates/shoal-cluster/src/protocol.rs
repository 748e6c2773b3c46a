//! What nodes say to each other inside an authenticated session.
//!
//! A session opens with each side's [`Hello`]; then the dialing side sends [`Request`]s and
//! the other answers each with one [`Response`], both as JSON messages. A request that
//! carries bulk bytes (a bandwidth probe) sends them as the next message, raw. Anything a
//! peer sends is untrusted: a message that does not parse ends the session with an error
//! naming the peer, and sizes are checked before anything is allocated for them.
//!
//! **Versions.** Each node speaks one version of the cluster protocol and works with peers
//! back to an oldest one ([`Versions`]); two nodes work together when each is at least the
//! other's oldest, so a release that keeps its predecessor's oldest can join a cluster of
//! the predecessor one node at a time (a rolling upgrade). A peer outside that range is
//! refused in the hello, with both versions named, and the refusal is kept for `shoal
//! status`, `shoal doctor` and the dashboard; its facts keep it out of every placement.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// The version of this protocol that this build speaks. Version 2 added split steps of
/// several tokens per sequence (drafted tokens checked on a split instance), which a
/// version-1 rank cannot run: a lead speculates on a split only when every node of its
/// placement speaks [`SPLIT_SPECULATION`] or later. Version 3 added steps that return their
/// rows' hidden states (the lead drafting with the model's prediction layer), which a
/// version-2 rank refuses: a lead drafts so only when every node speaks [`SPLIT_HIDDEN`].
pub const PROTOCOL_VERSION: u32 = 3;

/// The first version whose ranks run a split step of several tokens per sequence.
pub const SPLIT_SPECULATION: u32 = 2;

/// The first version whose ranks return a split step's rows' hidden states when asked.
pub const SPLIT_HIDDEN: u32 = 3;

/// The oldest version of this protocol that this build works with.
pub const OLDEST_COMPATIBLE: u32 = 1;

/// The environment variable that makes this process speak another protocol version,
/// `VERSION` or `VERSION:OLDEST`: how the tests play another build of shoal (a newer one
/// that works with this one, or one that does not) without building it.
pub const VERSION_ENV: &str = "SHOAL_PROTOCOL_VERSION";

/// A protocol version and the oldest one it works with.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Versions {
    /// The version spoken.
    pub version: u32,
    /// The oldest version worked with.
    pub oldest: u32,
}

impl Versions {
    /// Whether a node of `self` and one of `peer` work together.
    pub fn works_with(self, peer: Versions) -> bool {
        peer.version >= self.oldest && self.version >= peer.oldest
    }

    /// `VERSION` or `VERSION:OLDEST`.
    fn parse(text: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{VERSION_ENV}={text:?} is not VERSION or VERSION:OLDEST (two numbers, OLDEST at                  most VERSION)"
            )
        };
        let (v, o) = text.split_once(':').unwrap_or((text, text));
        let version: u32 = v.trim().parse().map_err(|_| bad())?;
        let oldest: u32 = o.trim().parse().map_err(|_| bad())?;
        if oldest > version || version == 0 {
            return Err(bad());
        }
        Ok(Versions { version, oldest })
    }
}

impl std::fmt::Display for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.oldest == self.version {
            write!(
                f,
                "version {} (works with {} only)",
                self.version, self.version
            )
        } else {
            write!(
                f,
                "version {} (works with {} to {})",
                self.version, self.oldest, self.version
            )
        }
    }
}

/// The versions this process speaks: [`PROTOCOL_VERSION`] and [`OLDEST_COMPATIBLE`], or
/// what [`VERSION_ENV`] says.
///
/// # Errors
/// [`VERSION_ENV`] is set to something that is not a version.
pub fn ours() -> Result<Versions, String> {
    static OURS: OnceLock<Result<Versions, String>> = OnceLock::new();
    OURS.get_or_init(|| match std::env::var(VERSION_ENV) {
        Ok(text) => Versions::parse(&text),
        Err(_) => Ok(Versions {
            version: PROTOCOL_VERSION,
            oldest: OLDEST_COMPATIBLE,
        }),
    })
    .clone()
}

/// [`ours`], for code that runs after the node started (which checked it).
pub(crate) fn ours_checked() -> Versions {
    ours().unwrap_or(Versions {
        version: PROTOCOL_VERSION,
        oldest: OLDEST_COMPATIBLE,
    })
}

/// The largest bandwidth probe a node accepts.
pub const MAX_PROBE_BYTES: u64 = 64 << 20;

/// The first message each side sends in a session.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    /// The sender's node id.
    pub node: String,
    /// The cluster name's tag (see `secret::cluster_tag`).
    pub cluster: String,
    /// The protocol version of the sender.
    pub version: u32,
    /// The oldest protocol version the sender works with (0, from a node older than this
    /// field: its own version only).
    #[serde(default)]
    pub oldest: u32,
    /// The sender's wall clock when it sent this, milliseconds since the Unix epoch (0:
    /// not told), for estimating clock skew between nodes.
    #[serde(default)]
    pub clock_ms: u64,
}

impl Hello {
    /// The sender's versions.
    pub fn versions(&self) -> Versions {
        Versions {
            version: self.version,
            oldest: if self.oldest == 0 {
                self.version
            } else {
                self.oldest
            },
        }
    }
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

    #[test]
    fn versions_work_together_within_each_others_range() {
        let v = |version, oldest| Versions { version, oldest };
        // the same release; a newer one that keeps the older's oldest; one that does not
        assert!(v(1, 1).works_with(v(1, 1)));
        assert!(v(1, 1).works_with(v(2, 1)) && v(2, 1).works_with(v(1, 1)));
        assert!(!v(1, 1).works_with(v(2, 2)) && !v(2, 2).works_with(v(1, 1)));
        assert!(v(3, 2).works_with(v(2, 1)) && !v(3, 2).works_with(v(1, 1)));
        assert_eq!(Versions::parse("2").unwrap(), v(2, 2));
        assert_eq!(Versions::parse("3:1").unwrap(), v(3, 1));
        for bad in ["", "x", "1:2", "0", "2:x"] {
            let e = Versions::parse(bad).unwrap_err();
            assert!(e.contains(VERSION_ENV), "{e}");
        }
        // a hello from a node older than the `oldest` field: its own version only
        let old: Hello = serde_json::from_str(r#"{"node":"n","cluster":"c","version":1}"#).unwrap();
        assert_eq!(old.versions(), v(1, 1));
        assert!(v(2, 1).to_string().contains("1 to 2"), "{}", v(2, 1));
    }

    proptest! {
        #[test]
        fn garbage_is_an_error_not_a_panic(b in prop::collection::vec(any::<u8>(), 0..100)) {
            let _ = decode::<Request>("p", "request", &b);
            let _ = decode::<Hello>("p", "hello", &b);
        }
    }
}
