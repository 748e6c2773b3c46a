//! Authenticated, encrypted node-to-node sessions over TCP.
//!
//! A session is `Noise_XXpsk3_25519_AESGCM_SHA256` (snow) keyed by two things: the cluster's
//! pre-shared key ([`ClusterSecret::noise_psk`](crate::secret::ClusterSecret::noise_psk)),
//! which admits a node, and each node's static X25519 key ([`NodeKey`]), which is its identity.
//! On the wire, after TCP connects:
//!
//! 1. Both sides send a 4-byte preamble, `b"SHO"` and [`PROTOCOL_VERSION`]; a different magic
//!    is "not a shoal node", a different version an error naming both versions. The preambles
//!    are the Noise prologue, so they are authenticated too.
//! 2. The three handshake messages (`-> e`, `<- e ee s es`, `-> s se psk`), each as a 4-byte
//!    big-endian length and the message (at most 65,535 bytes). The PSK is mixed in only at
//!    message 3, so message 2 is not protected by the cluster secret and carries no
//!    application data: a stranger learns the responder's static public key and nothing else.
//!    Message 3's payload is the initiator's mode byte (encryption on or off) and hello; a
//!    responder with another secret fails to decrypt it and refuses ([`SessionError::Refused`],
//!    logged once with the peer's address, never the secret).
//! 3. The responder's mode byte and hello go in the first transport message, always
//!    encrypted. Both sides check the modes agree ([`SessionError::ModeMismatch`] otherwise).
//!
//! Every wait in steps 1–3 ends at `handshake_timeout` after the start. After that, each
//! message is a 4-byte big-endian length `L` in clear, then (encryption on) Noise records of at
//! most 65,535 bytes carrying `L` again and the `L` message bytes, cut in plaintext chunks of
//! 65,519 bytes; the receiver checks the authenticated copy of `L` against the clear one, so a
//! message cannot be cut or joined in transit. With [`Encryption::Off`] (for a physically
//! isolated fabric) the length is followed by the plain bytes. A length above `max_message` is
//! refused before anything is allocated.
//!
//! A session splits into a [`SessionReader`] and a [`SessionWriter`] for two tasks. They share
//! one snow `StatelessTransportState` (in an `Arc`; its ciphers take `&self`) and each keeps
//! its own nonce counter, so there is no lock and no raw key export. Noise nonces are message
//! counters: a lost, repeated or reordered record fails authentication and breaks the session
//! (TCP never does that by itself), after which the caller drops it and reconnects. For the
//! same reason `send` and `recv` are not cancel-safe: one dropped midway (say by a timeout)
//! leaves the session broken.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rand::RngCore;
use snow::params::DHChoice;
use snow::resolvers::{CryptoResolver, DefaultResolver};
use snow::{HandshakeState, StatelessTransportState};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The Noise protocol every session speaks.
pub const NOISE_PATTERN: &str = "Noise_XXpsk3_25519_AESGCM_SHA256";

/// The session protocol version sent in the preamble; nodes with different versions refuse
/// each other.
pub const PROTOCOL_VERSION: u8 = 1;

/// The largest application hello, in bytes (it must fit in one Noise handshake message).
pub const MAX_HELLO: usize = NOISE_MAX - MSG3_OVERHEAD - 1;

/// The default largest message a session sends or accepts: 64 MiB.
pub const DEFAULT_MAX_MESSAGE: usize = 64 << 20;

/// The default bound on the whole handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

const MAGIC: [u8; 3] = *b"SHO";
const PROLOGUE: &[u8] = b"shoal session";
/// Noise's largest message (a record), in bytes.
const NOISE_MAX: usize = 65_535;
const TAG: usize = 16;
/// Plaintext bytes per full record.
const CHUNK: usize = NOISE_MAX - TAG;
/// Message 3 around its payload: the encrypted static key (32 + 16) and the payload's tag.
const MSG3_OVERHEAD: usize = 32 + TAG + TAG;
/// Encrypted bytes gathered before a write to the socket.
const FLUSH_AT: usize = 256 << 10;
/// Plain messages up to this size are copied behind their length and written at once.
const COALESCE_MAX: usize = 16 << 10;

const MODE_OFF: u8 = 0;
const MODE_ON: u8 = 1;

/// Whether messages after the handshake are encrypted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encryption {
    /// Every message is encrypted and authenticated (the default).
    #[default]
    On,
    /// Messages go in clear, for a physically isolated fabric; the handshake still
    /// authenticates both nodes.
    Off,
}

impl fmt::Display for Encryption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

impl Encryption {
    fn byte(self) -> u8 {
        match self {
            Self::On => MODE_ON,
            Self::Off => MODE_OFF,
        }
    }
}

/// A node's static X25519 key pair: its identity in sessions (peers see [`NodeKey::public`]).
/// `Debug` shows only the public half.
#[derive(Clone)]
pub struct NodeKey {
    private: [u8; 32],
    public: [u8; 32],
}

impl fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeKey(public {})", hex(&self.public))
    }
}

impl NodeKey {
    /// A new random key pair.
    pub fn generate() -> Self {
        let mut private = [0u8; 32];
        rand::rng().fill_bytes(&mut private);
        Self::from_private(&private)
    }

    /// The key pair with this private key (as stored by [`NodeKey::private_bytes`]).
    pub fn from_private(private: &[u8; 32]) -> Self {
        // snow's default resolver is built with Curve25519 (its `default-resolver-crypto`
        // feature, which shoal-cluster uses), so this lookup always succeeds.
        let mut dh = DefaultResolver
            .resolve_dh(&DHChoice::Curve25519)
            .expect("snow's default resolver provides Curve25519");
        dh.set(private);
        let mut public = [0u8; 32];
        public.copy_from_slice(dh.pubkey());
        Self {
            private: *private,
            public,
        }
    }

    /// The private key, to store as the node's identity (keep it out of logs).
    pub fn private_bytes(&self) -> [u8; 32] {
        self.private
    }

    /// The public key: what peers see as this node's identity.
    pub fn public(&self) -> [u8; 32] {
        self.public
    }
}

/// How a node runs its sessions. Both ends must agree on `encryption` (checked in the
/// handshake) and should agree on `max_message` (a message above the receiver's limit breaks
/// the session).
#[derive(Clone)]
pub struct SessionConfig {
    /// The cluster's Noise pre-shared key (`ClusterSecret::noise_psk`).
    pub psk: [u8; 32],
    /// This node's static key.
    pub key: NodeKey,
    /// The bound on the whole handshake, from TCP connect to both hellos.
    pub handshake_timeout: Duration,
    /// Whether messages after the handshake are encrypted.
    pub encryption: Encryption,
    /// The largest message sent or accepted, in bytes (at most 4 GiB - 1; more acts as that).
    pub max_message: usize,
}

impl fmt::Debug for SessionConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionConfig")
            .field("psk", &"..")
            .field("key", &self.key)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("encryption", &self.encryption)
            .field("max_message", &self.max_message)
            .finish()
    }
}

impl SessionConfig {
    /// A configuration with the defaults: encryption on, 10 s handshake, 64 MiB messages.
    pub fn new(psk: [u8; 32], key: NodeKey) -> Self {
        Self {
            psk,
            key,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            encryption: Encryption::On,
            max_message: DEFAULT_MAX_MESSAGE,
        }
    }

    fn limit(&self) -> usize {
        self.max_message.min(u32::MAX as usize)
    }
}

/// Why a session could not be set up, or broke.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The stream given is not connected.
    #[error(
        "cannot start a session: the TCP stream has no peer address ({0}); pass a connected stream"
    )]
    NotConnected(io::Error),
    /// The network failed (reset, unreachable, ...).
    #[error("network error with {peer} while {during}: {source}")]
    Io {
        peer: SocketAddr,
        during: &'static str,
        source: io::Error,
    },
    /// The peer closed the connection in the middle of the handshake.
    #[error("{peer} closed the connection while {during}; it is not a shoal node, or it refused this node")]
    HungUp {
        peer: SocketAddr,
        during: &'static str,
    },
    /// The handshake did not finish within `handshake_timeout`.
    #[error("{peer} did not answer within {after:?} while {during}; it is not a shoal node, or it is overloaded, or the link is slow (raise the handshake timeout)")]
    Timeout {
        peer: SocketAddr,
        during: &'static str,
        after: Duration,
    },
    /// The peer speaks another protocol.
    #[error("{peer} is not a shoal node: its first bytes were {got:02x?}, not the shoal session preamble; check the address and port")]
    NotShoal { peer: SocketAddr, got: [u8; 4] },
    /// The peer speaks another version of this protocol.
    #[error("{peer} speaks shoal session protocol version {theirs}, this node speaks version {ours}; run the same shoal release on both")]
    VersionMismatch {
        peer: SocketAddr,
        ours: u8,
        theirs: u8,
    },
    /// This node refused the peer: it does not hold the cluster secret (logged as a warning).
    #[error("refused the session with {peer}: {reason}; give both nodes the same cluster secret (--secret-file or SHOAL_SECRET)")]
    Refused {
        peer: SocketAddr,
        reason: &'static str,
    },
    /// The peer refused this node (closed the connection after handshake message 3): another
    /// cluster secret, or not a shoal node.
    #[error("{peer}: the peer refused the session: wrong cluster secret or not a shoal node; give both nodes the same cluster secret (--secret-file or SHOAL_SECRET)")]
    RefusedByPeer { peer: SocketAddr },
    /// The two nodes have different [`Encryption`] modes.
    #[error("encryption mode mismatch with {peer}: this node has encryption {ours}, the peer has encryption {theirs}; set the same mode on every node")]
    ModeMismatch {
        peer: SocketAddr,
        ours: Encryption,
        theirs: Encryption,
    },
    /// The peer announced a message or handshake message above the limit (nothing was
    /// allocated for it; the session is broken).
    #[error("{peer} announced a {what} of {len} bytes, above the limit of {limit} bytes; give every node the same max_message")]
    TooLarge {
        peer: SocketAddr,
        what: &'static str,
        len: u64,
        limit: usize,
    },
    /// A message to send is above `max_message` (nothing was sent).
    #[error("cannot send a message of {len} bytes: the session limit (max_message) is {limit} bytes; split it or raise the limit on every node")]
    MessageTooLarge { len: usize, limit: usize },
    /// The hello given is above [`MAX_HELLO`].
    #[error("the hello is {len} bytes, above the limit of {limit} bytes; send less in it and the rest as messages")]
    HelloTooLarge { len: usize, limit: usize },
    /// The peer sent a malformed handshake.
    #[error("the handshake with {peer} failed: {what}")]
    BadHandshake { peer: SocketAddr, what: String },
    /// A message failed authentication or was cut short; the session is broken.
    #[error("the session with {peer} is broken: {what}; drop it and reconnect")]
    Invalid { peer: SocketAddr, what: String },
    /// snow refused the configuration (a bug, not an input problem).
    #[error("cannot set up Noise ({NOISE_PATTERN}): {0}")]
    Noise(snow::Error),
    /// The peer closed the session cleanly, between messages.
    #[error("the peer closed the session")]
    Closed,
}

/// An established session: the peer's identity and hello, and a channel for messages.
pub struct Session {
    reader: SessionReader,
    writer: SessionWriter,
    peer_hello: Vec<u8>,
    peer_public: [u8; 32],
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("peer_addr", &self.reader.peer)
            .field("peer_public", &hex(&self.peer_public))
            .field("encryption", &self.writer.encryption())
            .finish()
    }
}

impl Session {
    /// The hello the peer sent in the handshake.
    pub fn peer_hello(&self) -> &[u8] {
        &self.peer_hello
    }

    /// The peer's static public key (its node identity), proven in the handshake.
    pub fn peer_public(&self) -> [u8; 32] {
        self.peer_public
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.reader.peer
    }

    /// Whether messages are encrypted (both ends agreed on it).
    pub fn encryption(&self) -> Encryption {
        self.writer.encryption()
    }

    /// Sends one message.
    ///
    /// # Errors
    /// [`SessionError::MessageTooLarge`] (nothing sent; the session stays usable), or a
    /// network error (the session is broken).
    pub async fn send(&mut self, msg: &[u8]) -> Result<(), SessionError> {
        self.writer.send(msg).await
    }

    /// Receives the next message.
    ///
    /// # Errors
    /// [`SessionError::Closed`] when the peer closed the session between messages; otherwise
    /// the session is broken: a network error, a message above `max_message`, or one that
    /// fails authentication.
    pub async fn recv(&mut self) -> Result<Vec<u8>, SessionError> {
        self.reader.recv().await
    }

    /// The receiving and sending halves, for use from two tasks.
    pub fn into_split(self) -> (SessionReader, SessionWriter) {
        (self.reader, self.writer)
    }
}

/// The receiving half of a [`Session`].
pub struct SessionReader {
    rd: BufReader<OwnedReadHalf>,
    noise: Arc<StatelessTransportState>,
    encrypted: bool,
    nonce: u64,
    limit: usize,
    peer: SocketAddr,
    record: Vec<u8>,
    head: Vec<u8>,
}

impl fmt::Debug for SessionReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionReader({})", self.peer)
    }
}

/// The sending half of a [`Session`].
pub struct SessionWriter {
    wr: OwnedWriteHalf,
    noise: Arc<StatelessTransportState>,
    encrypted: bool,
    nonce: u64,
    limit: usize,
    peer: SocketAddr,
    out: Vec<u8>,
    head: Vec<u8>,
}

impl fmt::Debug for SessionWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionWriter({})", self.peer)
    }
}

impl SessionReader {
    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// Receives the next message.
    ///
    /// # Errors
    /// [`SessionError::Closed`] when the peer closed the session between messages; otherwise
    /// the session is broken: a network error, a message above `max_message`, or one that
    /// fails authentication.
    pub async fn recv(&mut self) -> Result<Vec<u8>, SessionError> {
        self.recv_limited(self.limit, "message").await
    }

    async fn recv_limited(
        &mut self,
        limit: usize,
        what: &'static str,
    ) -> Result<Vec<u8>, SessionError> {
        const DURING: &str = "receiving a message";
        let peer = self.peer;
        let io_err = |source: io::Error| {
            if source.kind() == io::ErrorKind::UnexpectedEof {
                invalid(
                    peer,
                    "the peer closed the connection in the middle of a message",
                )
            } else {
                io_error(peer, DURING, source)
            }
        };
        let mut len_be = [0u8; 4];
        let n = self.rd.read(&mut len_be).await.map_err(io_err)?;
        if n == 0 {
            return Err(SessionError::Closed);
        }
        self.rd.read_exact(&mut len_be[n..]).await.map_err(io_err)?;
        let len = u32::from_be_bytes(len_be);
        if len as usize > limit {
            return Err(SessionError::TooLarge {
                peer,
                what,
                len: u64::from(len),
                limit,
            });
        }
        let len = len as usize;
        if !self.encrypted {
            let mut msg = vec![0u8; len];
            self.rd.read_exact(&mut msg).await.map_err(io_err)?;
            return Ok(msg);
        }
        // Plaintext stream: the length again (authenticated), then the message.
        let total = len + 4;
        let mut msg = Vec::with_capacity(len);
        let mut done = 0;
        while done < total {
            let plain = CHUNK.min(total - done);
            let rec = &mut self.record[..plain + TAG];
            self.rd.read_exact(rec).await.map_err(io_err)?;
            let nonce = next_nonce(&mut self.nonce, peer)?;
            let broken = |e: snow::Error| SessionError::Invalid {
                peer,
                what: format!(
                    "a message record failed authentication ({e}): corrupted or tampered in transit"
                ),
            };
            if done == 0 {
                self.noise
                    .read_message(nonce, rec, &mut self.head)
                    .map_err(broken)?;
                if self.head[..4] != len_be {
                    return Err(SessionError::Invalid {
                        peer,
                        what: "a message's length was altered in transit".into(),
                    });
                }
                msg.extend_from_slice(&self.head[4..plain]);
            } else {
                let start = msg.len();
                msg.resize(start + plain, 0);
                self.noise
                    .read_message(nonce, rec, &mut msg[start..])
                    .map_err(broken)?;
            }
            done += plain;
        }
        Ok(msg)
    }
}

impl SessionWriter {
    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn encryption(&self) -> Encryption {
        if self.encrypted {
            Encryption::On
        } else {
            Encryption::Off
        }
    }

    /// Sends one message.
    ///
    /// # Errors
    /// [`SessionError::MessageTooLarge`] (nothing sent; the session stays usable), or a
    /// network error (the session is broken).
    pub async fn send(&mut self, msg: &[u8]) -> Result<(), SessionError> {
        self.send_limited(msg, self.limit).await
    }

    async fn send_limited(&mut self, msg: &[u8], limit: usize) -> Result<(), SessionError> {
        const DURING: &str = "sending a message";
        if msg.len() > limit {
            return Err(SessionError::MessageTooLarge {
                len: msg.len(),
                limit,
            });
        }
        let peer = self.peer;
        let io_err = |source: io::Error| io_error(peer, DURING, source);
        // `limit` is at most u32::MAX, so the length fits.
        let len_be = (msg.len() as u32).to_be_bytes();
        self.out.clear();
        self.out.extend_from_slice(&len_be);
        if !self.encrypted {
            if msg.len() <= COALESCE_MAX {
                self.out.extend_from_slice(msg);
                self.wr.write_all(&self.out).await.map_err(io_err)?;
            } else {
                self.wr.write_all(&self.out).await.map_err(io_err)?;
                self.wr.write_all(msg).await.map_err(io_err)?;
            }
            return Ok(());
        }
        let first = msg.len().min(CHUNK - 4);
        self.head.clear();
        self.head.extend_from_slice(&len_be);
        self.head.extend_from_slice(&msg[..first]);
        let head = std::mem::take(&mut self.head);
        let sealed = self.seal(&head);
        self.head = head;
        sealed?;
        for chunk in msg[first..].chunks(CHUNK) {
            if self.out.len() >= FLUSH_AT {
                self.wr.write_all(&self.out).await.map_err(io_err)?;
                self.out.clear();
            }
            self.seal(chunk)?;
        }
        self.wr.write_all(&self.out).await.map_err(io_err)?;
        Ok(())
    }

    /// Appends one record carrying `plain` (at most `CHUNK` bytes) to `out`.
    fn seal(&mut self, plain: &[u8]) -> Result<(), SessionError> {
        let nonce = next_nonce(&mut self.nonce, self.peer)?;
        let start = self.out.len();
        self.out.resize(start + plain.len() + TAG, 0);
        self.noise
            .write_message(nonce, plain, &mut self.out[start..])
            .map_err(|e| SessionError::Invalid {
                peer: self.peer,
                what: format!("cannot encrypt a record: {e}"),
            })?;
        Ok(())
    }
}

/// Opens a session as the initiator over a connected `stream`, sending `hello` to the peer.
///
/// # Errors
/// The peer is not a shoal node or speaks another version, it refused this node (another
/// cluster secret: [`SessionError::RefusedByPeer`]), the encryption modes differ, it was silent
/// past `handshake_timeout`, the hello is above [`MAX_HELLO`], or the network failed.
pub async fn connect(
    stream: TcpStream,
    cfg: &SessionConfig,
    hello: &[u8],
) -> Result<Session, SessionError> {
    handshake(stream, cfg, hello, true).await
}

/// Opens a session as the responder over an accepted `stream`, sending `hello` to the peer.
///
/// # Errors
/// The peer holds another cluster secret ([`SessionError::Refused`], also logged as a
/// warning), is not a shoal node or speaks another version, the encryption modes differ, it
/// was silent past `handshake_timeout`, the hello is above [`MAX_HELLO`], or the network
/// failed.
pub async fn accept(
    stream: TcpStream,
    cfg: &SessionConfig,
    hello: &[u8],
) -> Result<Session, SessionError> {
    handshake(stream, cfg, hello, false).await
}

/// The handshake's I/O, every wait bounded by one deadline.
struct Shake {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    peer: SocketAddr,
    deadline: Instant,
    timeout: Duration,
}

impl Shake {
    async fn write(&mut self, during: &'static str, bytes: &[u8]) -> Result<(), SessionError> {
        let (peer, deadline, timeout) = (self.peer, self.deadline, self.timeout);
        match tokio::time::timeout_at(deadline, self.wr.write_all(bytes)).await {
            Ok(r) => r.map_err(|source| io_error(peer, during, source)),
            Err(_) => Err(SessionError::Timeout {
                peer,
                during,
                after: timeout,
            }),
        }
    }

    async fn write_frame(&mut self, during: &'static str, msg: &[u8]) -> Result<(), SessionError> {
        let mut frame = Vec::with_capacity(4 + msg.len());
        frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        frame.extend_from_slice(msg);
        self.write(during, &frame).await
    }

    async fn read_exact(
        &mut self,
        during: &'static str,
        buf: &mut [u8],
    ) -> Result<(), SessionError> {
        let (peer, deadline, timeout) = (self.peer, self.deadline, self.timeout);
        match tokio::time::timeout_at(deadline, self.rd.read_exact(buf)).await {
            Ok(r) => r
                .map(|_| ())
                .map_err(|source| io_error(peer, during, source)),
            Err(_) => Err(SessionError::Timeout {
                peer,
                during,
                after: timeout,
            }),
        }
    }

    async fn read_frame(&mut self, during: &'static str) -> Result<Vec<u8>, SessionError> {
        let mut len = [0u8; 4];
        self.read_exact(during, &mut len).await?;
        let len = u32::from_be_bytes(len);
        if len as usize > NOISE_MAX {
            return Err(SessionError::TooLarge {
                peer: self.peer,
                what: "handshake message",
                len: u64::from(len),
                limit: NOISE_MAX,
            });
        }
        let mut msg = vec![0u8; len as usize];
        self.read_exact(during, &mut msg).await?;
        Ok(msg)
    }
}

async fn handshake(
    stream: TcpStream,
    cfg: &SessionConfig,
    hello: &[u8],
    initiator: bool,
) -> Result<Session, SessionError> {
    if hello.len() > MAX_HELLO {
        return Err(SessionError::HelloTooLarge {
            len: hello.len(),
            limit: MAX_HELLO,
        });
    }
    let peer = stream.peer_addr().map_err(SessionError::NotConnected)?;
    // Sessions write whole messages, and collectives are latency-bound.
    let _ = stream.set_nodelay(true);
    let (rd, wr) = stream.into_split();
    let mut io = Shake {
        rd: BufReader::new(rd),
        wr,
        peer,
        deadline: Instant::now() + cfg.handshake_timeout,
        timeout: cfg.handshake_timeout,
    };

    // 1. Preambles.
    let ours = [MAGIC[0], MAGIC[1], MAGIC[2], PROTOCOL_VERSION];
    io.write("sending the protocol preamble", &ours).await?;
    let mut theirs = [0u8; 4];
    io.read_exact("waiting for the peer's protocol preamble", &mut theirs)
        .await?;
    if theirs[..3] != MAGIC {
        return Err(SessionError::NotShoal { peer, got: theirs });
    }
    if theirs[3] != PROTOCOL_VERSION {
        return Err(SessionError::VersionMismatch {
            peer,
            ours: PROTOCOL_VERSION,
            theirs: theirs[3],
        });
    }
    let mut prologue = PROLOGUE.to_vec();
    prologue.extend_from_slice(&ours);

    // 2. Noise handshake.
    let params = NOISE_PATTERN
        .parse()
        .map_err(|e: snow::Error| SessionError::Noise(e))?;
    let builder = snow::Builder::new(params)
        .local_private_key(&cfg.key.private)
        .and_then(|b| b.psk(3, &cfg.psk))
        .and_then(|b| b.prologue(&prologue))
        .map_err(SessionError::Noise)?;
    let mut noise = if initiator {
        builder.build_initiator()
    } else {
        builder.build_responder()
    }
    .map_err(SessionError::Noise)?;
    let mut buf = vec![0u8; NOISE_MAX];
    let mut payload = vec![0u8; NOISE_MAX];
    let mine = [&[cfg.encryption.byte()][..], hello].concat();

    let peer_payload = if initiator {
        let n = noise
            .write_message(&[], &mut buf)
            .map_err(SessionError::Noise)?;
        io.write_frame("sending handshake message 1", &buf[..n])
            .await?;
        let msg2 = io.read_frame("waiting for handshake message 2").await?;
        let n = read_handshake(&mut noise, &msg2, &mut payload, peer, 2)?;
        if n != 0 {
            return Err(bad_handshake(
                peer,
                "handshake message 2 carries data; it must not",
            ));
        }
        let n = noise
            .write_message(&mine, &mut buf)
            .map_err(SessionError::Noise)?;
        io.write_frame("sending handshake message 3", &buf[..n])
            .await?;
        None
    } else {
        let msg1 = io.read_frame("waiting for handshake message 1").await?;
        let n = read_handshake(&mut noise, &msg1, &mut payload, peer, 1)?;
        if n != 0 {
            return Err(bad_handshake(
                peer,
                "handshake message 1 carries data; it must not",
            ));
        }
        let n = noise
            .write_message(&[], &mut buf)
            .map_err(SessionError::Noise)?;
        io.write_frame("sending handshake message 2", &buf[..n])
            .await?;
        let msg3 = io.read_frame("waiting for handshake message 3").await?;
        match noise.read_message(&msg3, &mut payload) {
            Ok(n) => Some(payload[..n].to_vec()),
            Err(snow::Error::Decrypt) => {
                tracing::warn!(
                    peer = %peer,
                    "refused a session: wrong cluster secret (or not a shoal node)"
                );
                return Err(SessionError::Refused {
                    peer,
                    reason: "wrong cluster secret",
                });
            }
            Err(e) => {
                return Err(bad_handshake(
                    peer,
                    &format!("handshake message 3 is malformed ({e})"),
                ))
            }
        }
    };

    let peer_public: [u8; 32] = noise
        .get_remote_static()
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| bad_handshake(peer, "the handshake ended without the peer's static key"))?;
    let transport = Arc::new(
        noise
            .into_stateless_transport_mode()
            .map_err(SessionError::Noise)?,
    );
    let Shake {
        rd,
        wr,
        deadline,
        timeout,
        ..
    } = io;
    let limit = cfg.limit();
    let mut reader = SessionReader {
        rd,
        noise: Arc::clone(&transport),
        encrypted: true,
        nonce: 0,
        limit,
        peer,
        record: vec![0u8; NOISE_MAX],
        head: vec![0u8; CHUNK],
    };
    let mut writer = SessionWriter {
        wr,
        noise: transport,
        encrypted: true,
        nonce: 0,
        limit,
        peer,
        out: Vec::new(),
        head: Vec::with_capacity(CHUNK),
    };

    // 3. Hellos: the responder's goes in the first transport message.
    let timed_out = || SessionError::Timeout {
        peer,
        during: "exchanging hellos",
        after: timeout,
    };
    let peer_payload = match peer_payload {
        Some(p) => {
            tokio::time::timeout_at(deadline, writer.send_limited(&mine, MAX_HELLO + 1))
                .await
                .map_err(|_| timed_out())??;
            p
        }
        None => {
            match tokio::time::timeout_at(deadline, reader.recv_limited(MAX_HELLO + 1, "hello"))
                .await
                .map_err(|_| timed_out())?
            {
                Ok(p) => p,
                Err(SessionError::Closed) => return Err(SessionError::RefusedByPeer { peer }),
                Err(SessionError::Io { source, .. })
                    if matches!(
                        source.kind(),
                        io::ErrorKind::ConnectionReset
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::BrokenPipe
                    ) =>
                {
                    return Err(SessionError::RefusedByPeer { peer })
                }
                Err(e) => return Err(e),
            }
        }
    };
    let (&mode, peer_hello) = peer_payload
        .split_first()
        .ok_or_else(|| bad_handshake(peer, "the peer's hello has no mode byte"))?;
    let theirs = match mode {
        MODE_ON => Encryption::On,
        MODE_OFF => Encryption::Off,
        other => {
            return Err(bad_handshake(
                peer,
                &format!("the peer's hello has an unknown encryption mode {other}"),
            ))
        }
    };
    if theirs != cfg.encryption {
        return Err(SessionError::ModeMismatch {
            peer,
            ours: cfg.encryption,
            theirs,
        });
    }
    let on = cfg.encryption == Encryption::On;
    reader.encrypted = on;
    writer.encrypted = on;
    Ok(Session {
        reader,
        writer,
        peer_hello: peer_hello.to_vec(),
        peer_public,
    })
}

fn read_handshake(
    noise: &mut HandshakeState,
    msg: &[u8],
    payload: &mut [u8],
    peer: SocketAddr,
    which: u8,
) -> Result<usize, SessionError> {
    noise.read_message(msg, payload).map_err(|e| {
        bad_handshake(
            peer,
            &format!("handshake message {which} is malformed ({e}); the peer is not a shoal node"),
        )
    })
}

fn bad_handshake(peer: SocketAddr, what: &str) -> SessionError {
    SessionError::BadHandshake {
        peer,
        what: what.to_string(),
    }
}

fn invalid(peer: SocketAddr, what: &str) -> SessionError {
    SessionError::Invalid {
        peer,
        what: what.to_string(),
    }
}

fn io_error(peer: SocketAddr, during: &'static str, source: io::Error) -> SessionError {
    if source.kind() == io::ErrorKind::UnexpectedEof {
        SessionError::HungUp { peer, during }
    } else {
        SessionError::Io {
            peer,
            during,
            source,
        }
    }
}

/// The nonce for the next record, counting on.
fn next_nonce(counter: &mut u64, peer: SocketAddr) -> Result<u64, SessionError> {
    // Noise reserves u64::MAX; 2^64 - 1 records is never reached in practice.
    if *counter == u64::MAX {
        return Err(invalid(peer, "the session used up its nonces"));
    }
    let n = *counter;
    *counter += 1;
    Ok(n)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    use proptest::prelude::*;
    use tokio::net::TcpListener;

    use super::*;

    fn cfg(psk: u8) -> SessionConfig {
        let mut c = SessionConfig::new([psk; 32], NodeKey::generate());
        c.handshake_timeout = Duration::from_secs(5);
        c
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8)
            .collect()
    }

    /// Connects `a` (initiator) to `b` (responder) on 127.0.0.1; returns both results and
    /// the initiator's local address.
    async fn pair(
        a: &SessionConfig,
        b: &SessionConfig,
        hello_a: &[u8],
        hello_b: &[u8],
    ) -> (
        Result<Session, SessionError>,
        Result<Session, SessionError>,
        SocketAddr,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (b, hello_b) = (b.clone(), hello_b.to_vec());
        let server = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            accept(s, &b, &hello_b).await
        });
        let stream = TcpStream::connect(addr).await.unwrap();
        let local = stream.local_addr().unwrap();
        let client = connect(stream, a, hello_a).await;
        (client, server.await.unwrap(), local)
    }

    async fn exchange(a: &mut Session, b: &mut Session, msg: &[u8]) {
        let (sent, got) = tokio::join!(a.send(msg), b.recv());
        sent.unwrap();
        assert_eq!(got.unwrap(), msg, "{} bytes", msg.len());
    }

    #[tokio::test]
    async fn same_secret_exchanges_hellos_and_messages_both_ways() {
        let (ca, cb) = (cfg(7), cfg(7));
        let (a, b, a_local) = pair(&ca, &cb, b"node-a 7000", b"node-b 7001").await;
        let (mut a, mut b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.peer_hello(), b"node-b 7001");
        assert_eq!(b.peer_hello(), b"node-a 7000");
        assert_eq!(a.peer_public(), cb.key.public());
        assert_eq!(b.peer_public(), ca.key.public());
        assert_eq!(b.peer_addr(), a_local);
        assert_eq!(a.encryption(), Encryption::On);

        exchange(&mut a, &mut b, b"ping").await;
        exchange(&mut b, &mut a, b"pong").await;
        exchange(&mut a, &mut b, b"").await;
        exchange(&mut b, &mut a, b"").await;
        // Around the record boundaries, and 10 MiB both ways.
        for len in [
            CHUNK - 5,
            CHUNK - 4,
            CHUNK - 3,
            2 * CHUNK - 4,
            2 * CHUNK - 3,
        ] {
            exchange(&mut a, &mut b, &pattern(len, 1)).await;
        }
        let big = pattern(10 << 20, 3);
        exchange(&mut a, &mut b, &big).await;
        exchange(&mut b, &mut a, &big).await;
        exchange(&mut a, &mut b, b"after").await;

        drop(a);
        assert!(matches!(b.recv().await, Err(SessionError::Closed)));
    }

    #[tokio::test]
    async fn largest_hellos_fit_and_larger_ones_are_refused_before_any_io() {
        let (ca, cb) = (cfg(7), cfg(7));
        let hello = pattern(MAX_HELLO, 9);
        let (a, b, _) = pair(&ca, &cb, &hello, &hello).await;
        assert_eq!(a.unwrap().peer_hello(), hello);
        assert_eq!(b.unwrap().peer_hello(), hello);

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let e = connect(stream, &ca, &pattern(MAX_HELLO + 1, 0))
            .await
            .unwrap_err();
        assert!(matches!(e, SessionError::HelloTooLarge { .. }), "{e}");
        assert!(e.to_string().contains(&MAX_HELLO.to_string()), "{e}");
    }

    /// Records the events logged on this thread.
    struct Capture(Arc<Mutex<Vec<String>>>);

    struct Fields(String);

    impl tracing::field::Visit for Fields {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
            self.0.push_str(&format!(" {}={:?}", field.name(), value));
        }
    }

    impl tracing::Subscriber for Capture {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            let mut f = Fields(event.metadata().level().to_string());
            event.record(&mut f);
            self.0.lock().unwrap().push(f.0);
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    #[tokio::test]
    async fn wrong_secret_is_refused_on_both_sides_and_logged_once() {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let _guard = tracing::subscriber::set_default(Capture(Arc::clone(&logs)));
        let (a, b, a_local) = pair(&cfg(1), &cfg(2), b"stranger", b"member").await;

        let e = a.unwrap_err();
        assert!(matches!(e, SessionError::RefusedByPeer { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("the peer refused the session: wrong cluster secret or not a shoal node"),
            "{e}"
        );
        let e = b.unwrap_err();
        match &e {
            SessionError::Refused { peer, reason } => {
                assert_eq!(*peer, a_local);
                assert_eq!(*reason, "wrong cluster secret");
            }
            other => panic!("expected Refused, got {other}"),
        }
        assert!(e.to_string().contains(&a_local.to_string()), "{e}");

        let logs = logs.lock().unwrap();
        let warnings: Vec<_> = logs.iter().filter(|l| l.starts_with("WARN")).collect();
        assert_eq!(warnings.len(), 1, "{logs:?}");
        assert!(warnings[0].contains("wrong cluster secret"), "{logs:?}");
        assert!(warnings[0].contains(&a_local.to_string()), "{logs:?}");
        for psk in [hex(&[1; 32]), hex(&[2; 32])] {
            assert!(!logs.iter().any(|l| l.contains(&psk[..8])), "{logs:?}");
        }
    }

    #[tokio::test]
    async fn silent_or_stalling_peers_time_out_within_the_handshake_timeout() {
        let mut c = cfg(7);
        c.handshake_timeout = Duration::from_millis(300);
        let within = |t: Instant| {
            let e = t.elapsed();
            assert!(
                e >= Duration::from_millis(290) && e < Duration::from_secs(2),
                "{e:?}"
            );
        };

        // A client that connects and says nothing.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _silent = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (s, _) = listener.accept().await.unwrap();
        let t = Instant::now();
        let e = accept(s, &c, b"").await.unwrap_err();
        within(t);
        assert!(matches!(e, SessionError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("300ms"), "{e}");

        // A server that accepts and says nothing.
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (_silent, _) = listener.accept().await.unwrap();
        let t = Instant::now();
        let e = connect(stream, &c, b"").await.unwrap_err();
        within(t);
        assert!(matches!(e, SessionError::Timeout { .. }), "{e}");

        // A server that sends the preamble and then stalls.
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut stalling, _) = listener.accept().await.unwrap();
        stalling.write_all(b"SHO\x01").await.unwrap();
        let t = Instant::now();
        let e = connect(stream, &c, b"").await.unwrap_err();
        within(t);
        match e {
            SessionError::Timeout { during, .. } => {
                assert_eq!(during, "waiting for handshake message 2")
            }
            other => panic!("expected Timeout, got {other}"),
        }
    }

    #[tokio::test]
    async fn other_protocols_and_versions_are_named() {
        for (bytes, want) in [
            (&b"SHO\x02"[..], "version 2, this node speaks version 1"),
            (&b"GET / HTTP/1.1\r\n\r\n"[..], "not a shoal node"),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let mut fake = TcpStream::connect(listener.local_addr().unwrap())
                .await
                .unwrap();
            fake.write_all(bytes).await.unwrap();
            let (s, _) = listener.accept().await.unwrap();
            let e = accept(s, &cfg(7), b"").await.unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
        }
    }

    /// Feeds `garbage` to one side of a handshake (after a valid preamble and length prefix
    /// when asked), then closes; the side must return an error.
    async fn fake_peer(garbage: Vec<u8>, prefix: u8, to_responder: bool) -> SessionError {
        let mut c = cfg(7);
        c.handshake_timeout = Duration::from_secs(2);
        let mut bytes = Vec::new();
        if prefix >= 1 {
            bytes.extend_from_slice(b"SHO\x01");
        }
        if prefix >= 2 {
            bytes.extend_from_slice(&(garbage.len() as u32).to_be_bytes());
        }
        bytes.extend_from_slice(&garbage);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = |mut s: TcpStream| async move {
            let _ = s.write_all(&bytes).await;
            let _ = s.shutdown().await;
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        };
        let result = if to_responder {
            let client = tokio::spawn(fake(TcpStream::connect(addr).await.unwrap()));
            let (s, _) = listener.accept().await.unwrap();
            let r = accept(s, &c, b"hello").await;
            client.abort();
            r
        } else {
            let stream = TcpStream::connect(addr).await.unwrap();
            let (s, _) = listener.accept().await.unwrap();
            let server = tokio::spawn(fake(s));
            let r = connect(stream, &c, b"hello").await;
            server.abort();
            r
        };
        match result {
            Ok(s) => panic!("garbage made a session: {s:?}"),
            Err(e) => e,
        }
    }

    /// A well-formed handshake message 1 (it does not depend on the PSK), with `payload`.
    fn message_1(payload: &[u8]) -> Vec<u8> {
        let key = NodeKey::generate();
        let mut prologue = PROLOGUE.to_vec();
        prologue.extend_from_slice(b"SHO\x01");
        let mut hs = snow::Builder::new(NOISE_PATTERN.parse().unwrap())
            .local_private_key(&key.private)
            .unwrap()
            .psk(3, &[0; 32])
            .unwrap()
            .prologue(&prologue)
            .unwrap()
            .build_initiator()
            .unwrap();
        let mut buf = vec![0u8; NOISE_MAX];
        let n = hs.write_message(payload, &mut buf).unwrap();
        buf.truncate(n);
        buf
    }

    #[tokio::test]
    async fn malformed_handshake_messages_are_named() {
        let e = fake_peer(message_1(b""), 2, true).await;
        assert!(
            matches!(
                e,
                SessionError::HungUp {
                    during: "waiting for handshake message 3",
                    ..
                }
            ),
            "{e}"
        );
        let e = fake_peer(message_1(b"data"), 2, true).await;
        assert!(
            e.to_string().contains("handshake message 1 carries data"),
            "{e}"
        );
        let e = fake_peer(vec![5; 48], 2, true).await;
        assert!(
            e.to_string().contains("handshake message 1 is malformed"),
            "{e}"
        );
        let e = fake_peer(vec![5; 96], 2, false).await;
        assert!(
            e.to_string().contains("handshake message 2 is malformed"),
            "{e}"
        );
        let e = fake_peer(vec![0xff; 4], 1, true).await;
        assert!(
            e.to_string()
                .contains("handshake message of 4294967295 bytes, above the limit of 65535"),
            "{e}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn random_bytes_from_a_fake_peer_are_errors_not_panics(
            garbage in prop::collection::vec(any::<u8>(), 0..400),
            prefix in 0u8..3,
            to_responder in any::<bool>(),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let t = std::time::Instant::now();
            let e = rt.block_on(fake_peer(garbage, prefix, to_responder));
            prop_assert!(t.elapsed() < Duration::from_secs(3), "{e}");
            prop_assert!(!e.to_string().is_empty());
        }
    }

    #[tokio::test]
    async fn encryption_off_works_and_a_mode_mismatch_is_refused_by_both() {
        let (mut ca, mut cb) = (cfg(7), cfg(7));
        ca.encryption = Encryption::Off;
        cb.encryption = Encryption::Off;
        let (a, b, _) = pair(&ca, &cb, b"a", b"b").await;
        let (mut a, mut b) = (a.unwrap(), b.unwrap());
        assert_eq!(
            (a.encryption(), b.encryption()),
            (Encryption::Off, Encryption::Off)
        );
        assert_eq!((a.peer_hello(), b.peer_hello()), (&b"b"[..], &b"a"[..]));
        assert_eq!(a.peer_public(), cb.key.public());
        exchange(&mut a, &mut b, b"").await;
        exchange(&mut a, &mut b, b"small").await;
        exchange(&mut b, &mut a, &pattern(3 << 20, 5)).await;

        // Mismatch: each side names both modes.
        let (a, b, _) = pair(&cfg(7), &cb, b"a", b"b").await;
        let (ea, eb) = (a.unwrap_err(), b.unwrap_err());
        assert!(
            matches!(
                ea,
                SessionError::ModeMismatch {
                    ours: Encryption::On,
                    theirs: Encryption::Off,
                    ..
                }
            ),
            "{ea}"
        );
        assert!(
            matches!(
                eb,
                SessionError::ModeMismatch {
                    ours: Encryption::Off,
                    theirs: Encryption::On,
                    ..
                }
            ),
            "{eb}"
        );
        assert!(
            ea.to_string()
                .contains("this node has encryption on, the peer has encryption off"),
            "{ea}"
        );
    }

    #[tokio::test]
    async fn messages_above_max_message_are_refused_without_allocating() {
        let (mut ca, cb) = (cfg(7), cfg(7));
        ca.max_message = 1024;
        let (a, b, _) = pair(&ca, &cb, b"", b"").await;
        let (mut a, mut b) = (a.unwrap(), b.unwrap());

        // Sending: refused before anything goes out; the session stays usable.
        let e = a.send(&[0; 1025]).await.unwrap_err();
        assert!(
            matches!(
                e,
                SessionError::MessageTooLarge {
                    len: 1025,
                    limit: 1024
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("1025") && e.to_string().contains("1024"));
        exchange(&mut a, &mut b, &[9; 1024]).await;

        // Receiving: a frame claiming 4 GiB - 1 is refused at once from its length alone
        // (its body is never sent; waiting for it or allocating it would hang or fail).
        b.writer.wr.write_all(&[0xff; 4]).await.unwrap();
        let e = tokio::time::timeout(Duration::from_secs(1), a.recv())
            .await
            .expect("refused from the length alone")
            .unwrap_err();
        match &e {
            SessionError::TooLarge { len, limit, .. } => {
                assert_eq!((*len, *limit), (u64::from(u32::MAX), 1024));
            }
            other => panic!("expected TooLarge, got {other}"),
        }
        assert!(e.to_string().contains("4294967295 bytes"), "{e}");
        assert!(e.to_string().contains("limit of 1024 bytes"), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn split_reader_and_writer_work_concurrently() {
        let (a, b, _) = pair(&cfg(7), &cfg(7), b"", b"").await;
        let (mut ar, mut aw) = a.unwrap().into_split();
        let (mut br, mut bw) = b.unwrap().into_split();
        const N: usize = 40;
        let size = |i: usize| (i * 37_919) % (1 << 20);
        // Both sides send at once, far more than the socket buffers hold: this finishes only
        // if each side's reader drains while its writer sends.
        let send = |seed: u8| {
            move |mut w: SessionWriter| async move {
                for i in 0..N {
                    w.send(&pattern(size(i), seed)).await.unwrap();
                }
                w
            }
        };
        let recv = |seed: u8| {
            move |mut r: SessionReader| async move {
                for i in 0..N {
                    assert_eq!(
                        r.recv().await.unwrap(),
                        pattern(size(i), seed),
                        "message {i}"
                    );
                }
                r
            }
        };
        let tasks = (
            tokio::spawn(send(1)(aw)),
            tokio::spawn(send(2)(bw)),
            tokio::spawn(recv(2)(ar)),
            tokio::spawn(recv(1)(br)),
        );
        aw = tasks.0.await.unwrap();
        bw = tasks.1.await.unwrap();
        ar = tasks.2.await.unwrap();
        br = tasks.3.await.unwrap();
        drop((aw, ar));
        // The writer half closing is a clean end for the peer's reader.
        assert!(matches!(br.recv().await, Err(SessionError::Closed)));
        drop(bw);
    }

    #[tokio::test]
    async fn a_message_altered_in_transit_breaks_the_session() {
        // a -> proxy -> b; the proxy flips one bit once told to.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (server_addr, proxy_addr) =
            (listener.local_addr().unwrap(), proxy.local_addr().unwrap());
        let flip = Arc::new(AtomicBool::new(false));
        let flip2 = Arc::clone(&flip);
        tokio::spawn(async move {
            let (mut from_a, _) = proxy.accept().await.unwrap();
            let mut to_b = TcpStream::connect(server_addr).await.unwrap();
            let (mut ar, mut aw) = from_a.split();
            let (mut br, mut bw) = to_b.split();
            let up = async {
                let mut buf = vec![0u8; 1 << 16];
                let mut at: Option<usize> = None;
                loop {
                    let n = ar.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    if at.is_none() && flip2.load(Ordering::SeqCst) {
                        at = Some(10); // inside the first record of the next message
                    }
                    if let Some(k) = at.as_mut() {
                        if *k < n {
                            buf[*k] ^= 1;
                            *k = usize::MAX;
                        } else if *k != usize::MAX {
                            *k -= n;
                        }
                    }
                    if bw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            };
            let down = tokio::io::copy(&mut br, &mut aw);
            let _ = tokio::join!(up, down);
        });
        let cb = cfg(7);
        let server = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            accept(s, &cb, b"b").await
        });
        let mut a = connect(TcpStream::connect(proxy_addr).await.unwrap(), &cfg(7), b"a")
            .await
            .unwrap();
        let mut b = server.await.unwrap().unwrap();
        exchange(&mut a, &mut b, b"through the proxy").await;
        flip.store(true, Ordering::SeqCst);
        a.send(&pattern(100, 4)).await.unwrap();
        let e = b.recv().await.unwrap_err();
        assert!(matches!(e, SessionError::Invalid { .. }), "{e}");
        assert!(e.to_string().contains("failed authentication"), "{e}");
    }

    #[test]
    fn node_keys_round_trip_and_match_rfc_7748() {
        let unhex = |s: &str| -> [u8; 32] {
            let mut out = [0u8; 32];
            for (i, o) in out.iter_mut().enumerate() {
                *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
            }
            out
        };
        // RFC 7748 section 6.1, Alice.
        let k = NodeKey::from_private(&unhex(
            "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a",
        ));
        assert_eq!(
            k.public(),
            unhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
        );
        let g = NodeKey::generate();
        let again = NodeKey::from_private(&g.private_bytes());
        assert_eq!(again.public(), g.public());
        assert_ne!(NodeKey::generate().public(), g.public());
        let shown = format!("{g:?} {:?}", SessionConfig::new([0xab; 32], g.clone()));
        assert!(!shown.contains(&hex(&g.private_bytes())[..16]), "{shown}");
        assert!(!shown.contains("abababab"), "{shown}");
    }
}
