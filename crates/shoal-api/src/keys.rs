//! API keys: created with a random secret that is shown once, stored only as its SHA-256
//! hash (in `keys.json` in the node's data directory, written atomically, mode 0600), checked
//! on every model route once any key exists, with a per-key limit of requests per minute
//! (over a sliding minute; a refused client is told when to retry). A request is counted
//! once, by the node that runs it (a node that forwards one leaves it to the lead).
//!
//! The first key created is an administrator key, and only administrator keys may manage
//! keys. While no key exists, the server is open, and keys may be managed from the loopback
//! interface only.
//!
//! **In a cluster** the keys are replicated state ([`replicate`]): every node publishes its
//! key set (records with their hashes and limits, and the ids of revoked keys) in gossip,
//! which is sealed with the cluster key, and merges every other node's: the union of the
//! keys, less every key any node revoked (a revocation is kept for good, so a node that was
//! away cannot bring a revoked key back). Any node then authorises any request, and a
//! revocation reaches every node within a few gossip rounds. Rate limits travel with their
//! keys and hold cluster-wide: each node publishes its own count of each key's requests
//! over the last minute (every 250 ms, [`USAGE_KEY`]) and admits a request only while its
//! count plus the others' stays under the limit. The slack is what the other nodes admit
//! before their counts arrive: (nodes - 1) x (requests per second each admits) x 2 s at
//! most (the publishing interval, a gossip round or two, and a loaded machine's delays;
//! 17-23 requests over a limit of 60 measured at 10 a second on each of three nodes). A burst faster than that can pass the limit by more before the
//! counts meet. A node joining the cluster answers 503 to model routes until it has merged
//! its peers' keys.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use rand::Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{ApiError, ErrorKind};

/// Prefix of every secret, so leaked keys are recognisable.
const SECRET_PREFIX: &str = "sk-shoal-";

/// A stored key (never the secret itself).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KeyRecord {
    /// Public identifier, used to revoke.
    pub id: String,
    /// A label given at creation.
    pub name: String,
    /// SHA-256 of the secret, hex.
    #[serde(skip_serializing_if = "String::is_empty", default)]
    pub hash: String,
    /// May manage keys.
    pub admin: bool,
    /// Requests per minute allowed (none = the server's default).
    pub rpm: Option<u32>,
    /// Unix seconds of creation.
    pub created: u64,
}

impl KeyRecord {
    /// The record without its hash, for listings.
    pub fn public(&self) -> KeyRecord {
        KeyRecord {
            hash: String::new(),
            ..self.clone()
        }
    }
}

/// A revoked key: it stays revoked on every node that hears of it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Revoked {
    /// The key's id.
    pub id: String,
    /// Unix seconds of the revocation.
    pub at: u64,
}

/// A node's keys as stored and as replicated: the keys, and the revoked ids.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct KeySet {
    /// The keys (with their hashes).
    pub keys: Vec<KeyRecord>,
    /// Keys revoked, never valid again.
    #[serde(default)]
    pub revoked: Vec<Revoked>,
}

/// The window a key's requests-per-minute limit counts over.
const RATE_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a peer's published counts are believed without a fresher copy.
const USAGE_FRESH: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Debug, Default)]
struct Inner {
    set: KeySet,
    /// When this node admitted each key's requests, over the last [`RATE_WINDOW`].
    uses: HashMap<String, std::collections::VecDeque<Instant>>,
    /// What each peer last published of its own counts (key id to requests in its window),
    /// and when that arrived.
    peer_uses: HashMap<String, (HashMap<String, u32>, Instant)>,
    /// Most bytes the replicated set may take (`None`: not replicated).
    limit: Option<usize>,
}

/// The key store of one node.
#[derive(Debug)]
pub struct KeyStore {
    path: Option<PathBuf>,
    default_rpm: Option<u32>,
    inner: Mutex<Inner>,
    /// Whether the store holds the cluster's keys: false from a node's joining a cluster
    /// until [`replicate`] has merged every live peer's keys (model routes answer 503 until
    /// then: a node that has not heard of the cluster's keys would otherwise serve without).
    merged: std::sync::atomic::AtomicBool,
}

/// What can go wrong loading or saving keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file cannot be read or written.
    #[error("key file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The key file is not what shoal writes.
    #[error(
        "key file {path} is damaged ({why}); fix or remove it (removing it deletes every key)"
    )]
    Damaged {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The cluster's keys would not fit in one replicated value.
    #[error(
        "the cluster's keys would take {bytes} bytes, more than the {limit} that replicate; revoke keys that are no longer used"
    )]
    TooMany {
        /// Bytes the key set would take.
        bytes: usize,
        /// Bytes it may take.
        limit: usize,
    },
}

fn sha256_hex(s: &str) -> String {
    let digest = Sha256::digest(s.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn random_hex(bytes: usize) -> String {
    let mut rng = rand::rng();
    (0..bytes)
        .map(|_| format!("{:02x}", rng.random::<u8>()))
        .collect()
}

impl KeyStore {
    /// A store kept in `path` (loaded now when it exists), or in memory only when `None`;
    /// `default_rpm` limits keys created without their own limit.
    ///
    /// # Errors
    /// When the file exists but cannot be read or parsed.
    pub fn open(path: Option<&Path>, default_rpm: Option<u32>) -> Result<Self, KeyError> {
        let mut set = KeySet::default();
        if let Some(p) = path {
            match std::fs::read(p) {
                Ok(bytes) => {
                    set = serde_json::from_slice(&bytes).map_err(|e| KeyError::Damaged {
                        path: p.to_path_buf(),
                        why: e.to_string(),
                    })?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(KeyError::Io {
                        path: p.to_path_buf(),
                        source,
                    })
                }
            }
        }
        Ok(KeyStore {
            path: path.map(Path::to_path_buf),
            default_rpm,
            inner: Mutex::new(Inner {
                set,
                uses: HashMap::new(),
                peer_uses: HashMap::new(),
                limit: None,
            }),
            merged: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// This node's requests per key over the last minute (keys with any), as it publishes
    /// them for the cluster-wide limit.
    pub fn usage(&self) -> HashMap<String, u32> {
        let mut inner = self.lock();
        let now = Instant::now();
        let mut out = HashMap::new();
        inner.uses.retain(|id, uses| {
            while uses
                .front()
                .is_some_and(|&t| now.duration_since(t) >= RATE_WINDOW)
            {
                uses.pop_front();
            }
            if !uses.is_empty() {
                out.insert(id.clone(), uses.len().min(u32::MAX as usize) as u32);
            }
            !uses.is_empty()
        });
        out
    }

    /// Takes what node `node` published of its own requests per key (see
    /// [`KeyStore::usage`]) into this node's limits.
    pub fn merge_usage(&self, node: &str, counts: HashMap<String, u32>) {
        self.lock()
            .peer_uses
            .insert(node.to_string(), (counts, Instant::now()));
    }

    /// Whether the store holds the cluster's keys (always, outside a cluster).
    pub fn merged(&self) -> bool {
        self.merged.load(std::sync::atomic::Ordering::Acquire)
    }

    fn set_merged(&self, merged: bool) {
        self.merged
            .store(merged, std::sync::atomic::Ordering::Release);
    }

    /// The answer to a model request while the cluster's keys are not merged yet.
    pub fn not_merged_error() -> ApiError {
        ApiError::new(
            ErrorKind::Overloaded,
            "this node is joining its cluster and has not received the cluster's API keys yet; \
             retry in a few seconds",
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether no key exists (the server is open).
    pub fn is_empty(&self) -> bool {
        self.lock().set.keys.is_empty()
    }

    /// Every key, without hashes.
    pub fn list(&self) -> Vec<KeyRecord> {
        self.lock().set.keys.iter().map(KeyRecord::public).collect()
    }

    /// The keys and revocations, as replicated.
    pub fn snapshot(&self) -> KeySet {
        self.lock().set.clone()
    }

    /// Takes in another node's key set: its keys this store lacks, less every revoked key,
    /// and its revocations; saved when anything changed. Returns whether anything did.
    ///
    /// # Errors
    /// When the key file cannot be written (the store is left as it was).
    pub fn merge(&self, other: &KeySet) -> Result<bool, KeyError> {
        let mut inner = self.lock();
        let mut next = inner.set.clone();
        for r in &other.revoked {
            if !next.revoked.iter().any(|x| x.id == r.id) {
                next.revoked.push(r.clone());
            }
        }
        for k in &other.keys {
            if !next.keys.iter().any(|x| x.id == k.id) {
                next.keys.push(k.clone());
            }
        }
        let revoked = |id: &str| next.revoked.iter().any(|r| r.id == id);
        let keys: Vec<KeyRecord> = next
            .keys
            .iter()
            .filter(|k| !revoked(&k.id))
            .cloned()
            .collect();
        next.keys = keys;
        if next == inner.set {
            return Ok(false);
        }
        self.save(&next)?;
        let Inner { set, uses, .. } = &mut *inner;
        uses.retain(|id, _| next.keys.iter().any(|k| &k.id == id));
        *set = next;
        Ok(true)
    }

    /// Holds the key set to `bytes` serialized (what one replicated value may take): a key
    /// that would pass it is refused.
    pub fn limit_replicated(&self, bytes: usize) {
        self.lock().limit = Some(bytes);
    }

    fn check_limit(inner: &Inner, set: &KeySet) -> Result<(), KeyError> {
        let Some(limit) = inner.limit else {
            return Ok(());
        };
        let bytes = serde_json::to_vec(set)
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        if bytes > limit {
            return Err(KeyError::TooMany { bytes, limit });
        }
        Ok(())
    }

    /// Creates a key; returns its record and its secret (shown once). The first key is
    /// always an administrator key.
    ///
    /// # Errors
    /// When the key file cannot be written.
    pub fn create(
        &self,
        name: &str,
        admin: bool,
        rpm: Option<u32>,
    ) -> Result<(KeyRecord, String), KeyError> {
        let secret = format!("{SECRET_PREFIX}{}", random_hex(24));
        let mut inner = self.lock();
        let record = KeyRecord {
            id: format!("key_{}", random_hex(6)),
            name: name.to_string(),
            hash: sha256_hex(&secret),
            admin: admin || inner.set.keys.is_empty(),
            rpm,
            created: now_s(),
        };
        let mut next = inner.set.clone();
        next.keys.push(record.clone());
        Self::check_limit(&inner, &next)?;
        self.save(&next)?;
        inner.set = next;
        Ok((record.public(), secret))
    }

    /// Revokes key `id`; returns whether it existed.
    ///
    /// # Errors
    /// When the key file cannot be written.
    pub fn revoke(&self, id: &str) -> Result<bool, KeyError> {
        let mut inner = self.lock();
        let Some(at) = inner.set.keys.iter().position(|k| k.id == id) else {
            return Ok(false);
        };
        let mut next = inner.set.clone();
        next.keys.remove(at);
        next.revoked.push(Revoked {
            id: id.to_string(),
            at: now_s(),
        });
        self.save(&next)?;
        inner.set = next;
        inner.uses.remove(id);
        Ok(true)
    }

    fn save(&self, set: &KeySet) -> Result<(), KeyError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let io = |source| KeyError::Io {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let text = serde_json::to_vec_pretty(set).map_err(|e| io(std::io::Error::other(e)))?;
        let tmp = path.with_extension("json.tmp");
        {
            use std::io::Write;
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create(true).truncate(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                opts.mode(0o600);
            }
            let mut f = opts.open(&tmp).map_err(io)?;
            f.write_all(&text).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// The key whose secret is `secret`.
    pub fn verify(&self, secret: &str) -> Option<KeyRecord> {
        let hash = sha256_hex(secret);
        self.lock()
            .set
            .keys
            .iter()
            .find(|k| same(&k.hash, &hash))
            .cloned()
    }

    /// Takes one request from `key`'s budget.
    ///
    /// # Errors
    /// A 429 with the seconds until the next request is allowed.
    pub fn take(&self, key: &KeyRecord) -> Result<(), ApiError> {
        let Some(rpm) = key.rpm.or(self.default_rpm).filter(|&r| r > 0) else {
            return Ok(());
        };
        let mut inner = self.lock();
        let now = Instant::now();
        let elsewhere: u64 = inner
            .peer_uses
            .values()
            .filter(|(_, at)| now.duration_since(*at) < USAGE_FRESH)
            .filter_map(|(counts, _)| counts.get(&key.id))
            .map(|&n| u64::from(n))
            .sum();
        let uses = inner.uses.entry(key.id.clone()).or_default();
        while uses
            .front()
            .is_some_and(|&t| now.duration_since(t) >= RATE_WINDOW)
        {
            uses.pop_front();
        }
        if (uses.len() as u64) + elsewhere < u64::from(rpm) {
            uses.push_back(now);
            return Ok(());
        }
        // the oldest of this node's requests leaves the window first; where the others'
        // fill it, a few seconds is as good a guess as any
        let wait = uses.front().map_or(5, |&t| {
            (RATE_WINDOW - now.duration_since(t)).as_secs().max(1)
        });
        Err(ApiError::new(
            ErrorKind::RateLimited { retry_after: wait },
            format!(
                "rate limit of {rpm} requests per minute reached for key {}; retry in {wait} s",
                key.id
            ),
        ))
    }

    /// Checks a model route's credentials: open while no key exists, else a known key
    /// (bearer token or `x-api-key`) within its rate limit.
    ///
    /// # Errors
    /// 401 without a valid key, 429 over the rate limit.
    pub fn authorize(&self, headers: &HeaderMap) -> Result<Option<KeyRecord>, ApiError> {
        let key = self.authenticate(headers)?;
        if let Some(k) = &key {
            self.take(k)?;
        }
        Ok(key)
    }

    /// The key `headers` present, checked but not counted against its rate limit (what is
    /// checked before a request's body is read).
    ///
    /// # Errors
    /// 401 without a valid key.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Option<KeyRecord>, ApiError> {
        if self.is_empty() {
            return Ok(None);
        }
        let Some(secret) = presented_secret(headers) else {
            return Err(ApiError::new(
                ErrorKind::Authentication,
                "this server requires an API key: send it as `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
            ));
        };
        let Some(key) = self.verify(secret) else {
            return Err(ApiError::new(
                ErrorKind::Authentication,
                "the API key is not valid (unknown or revoked); ask the server's operator for a key (`shoal keys create`)",
            ));
        };
        Ok(Some(key))
    }

    /// Checks credentials for the cluster's views (nodes, links, addresses, the doctor's
    /// findings): open while no key exists, else an administrator key; other keys reach the
    /// model routes only.
    ///
    /// # Errors
    /// 401 without a valid key, 403 for a key that is not an administrator key.
    pub fn authorize_view(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        match self.authorize(headers)? {
            Some(key) if !key.admin => Err(ApiError::new(
                ErrorKind::Permission,
                format!(
                    "key {} is not an administrator key; the cluster's views need one (other keys reach the model routes only)",
                    key.id
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Checks credentials for managing keys: from loopback while no key exists, else an
    /// administrator key.
    ///
    /// # Errors
    /// 401 without a valid key, 403 for a non-administrator key or a remote client of an
    /// open server.
    pub fn authorize_admin(&self, headers: &HeaderMap, loopback: bool) -> Result<(), ApiError> {
        if self.is_empty() {
            if loopback {
                return Ok(());
            }
            return Err(ApiError::new(
                ErrorKind::Permission,
                "administration (API keys, cluster instances) is open only to clients on the server's own machine until the first key exists: run the command there, or create an administrator key there with `shoal keys create --name NAME --admin` and pass it with --key",
            ));
        }
        let key = self.authorize(headers)?.ok_or_else(|| {
            ApiError::new(
                ErrorKind::Authentication,
                "an administrator key is required",
            )
        })?;
        if !key.admin {
            return Err(ApiError::new(
                ErrorKind::Permission,
                format!(
                    "key {} is not an administrator key; managing keys needs one",
                    key.id
                ),
            ));
        }
        Ok(())
    }
}

/// Gossip key of a node's replicated key set.
pub const GOSSIP_KEY: &str = "keys";

/// The gossip key under which a node publishes its requests per API key over the last
/// minute, which every node adds to its own when it checks a key's limit.
pub const USAGE_KEY: &str = "key-use";
/// How often a node merges the key sets the others publish.
const REPLICATE_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// How long a node that was given no peer waits to discover some before it takes its own
/// keys for the cluster's.
const DISCOVERY_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// How long a node waits for its live peers' keys before it serves with what it has (and
/// says which peers never published theirs).
const MERGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Keeps the keys of `state` replicated through its cluster node until the state is gone:
/// merges every node's published key set ([`KeyStore::merge`]) and publishes this node's
/// whenever it changed (created, revoked or merged here). Until every live peer's set is
/// merged the store says it is not merged ([`KeyStore::merged`]): a node given peers
/// (`expect_peers`) waits to see one, a node given none waits [`DISCOVERY_GRACE`] where it
/// `discovers` peers on the network (mDNS) and not at all where it does not, and none waits
/// longer than [`MERGE_TIMEOUT`].
pub async fn replicate(
    state: std::sync::Weak<crate::state::AppState>,
    node: std::sync::Arc<shoal_cluster::node::Node>,
    expect_peers: bool,
    discovers: bool,
) {
    // the key's own name and some room for the encoding count against the bound too
    let limit = shoal_cluster::membership::MAX_KEY_VALUE_LEN - 64;
    if let Some(s) = state.upgrade() {
        s.keys.limit_replicated(limit);
        s.keys.set_merged(false);
    }
    let started = std::time::Instant::now();
    let mut published = String::new();
    let mut published_usage = String::new();
    let mut warned: std::collections::HashSet<String> = Default::default();
    // what each node published when it was last merged: unchanged sets are not read again
    let mut merged: std::collections::HashMap<String, String> = Default::default();
    loop {
        let Some(state) = state.upgrade() else { return };
        for (from, value) in node.published(GOSSIP_KEY) {
            if from == node.id() || merged.get(&from) == Some(&value) {
                continue;
            }
            merged.insert(from.clone(), value.clone());
            match serde_json::from_str::<KeySet>(&value) {
                Ok(set) => {
                    if let Err(e) = state.keys.merge(&set) {
                        tracing::warn!(%from, "merging the cluster's API keys failed: {e}");
                        // tried again next round
                        merged.remove(&from);
                    }
                }
                Err(e) => {
                    if warned.insert(from.clone()) {
                        tracing::warn!(%from, "a node publishes API keys this node cannot read: {e}");
                    }
                }
            }
        }
        if !state.keys.merged() {
            let peers: Vec<String> = node
                .nodes()
                .await
                .into_iter()
                .filter(|n| n.alive && !n.is_self)
                .map(|n| n.id)
                .collect();
            let waiting: Vec<&String> = peers.iter().filter(|p| !merged.contains_key(*p)).collect();
            let waited = started.elapsed();
            let done = if peers.is_empty() {
                !expect_peers && (!discovers || waited >= DISCOVERY_GRACE)
            } else {
                waiting.is_empty()
            };
            if done {
                state.keys.set_merged(true);
            } else if waited >= MERGE_TIMEOUT {
                tracing::warn!(
                    ?waiting,
                    "serving without these peers' API keys: they have not published them in {} s",
                    MERGE_TIMEOUT.as_secs()
                );
                state.keys.set_merged(true);
            }
        }
        // the cluster-wide rate limits: every peer's counts in, this node's out
        for (from, value) in node.published(USAGE_KEY) {
            if from == node.id() {
                continue;
            }
            if let Ok(counts) = serde_json::from_str::<HashMap<String, u32>>(&value) {
                state.keys.merge_usage(&from, counts);
            }
        }
        let usage = serde_json::to_string(&state.keys.usage()).unwrap_or_default();
        let mine = serde_json::to_string(&state.keys.snapshot()).unwrap_or_default();
        drop(state);
        if usage != published_usage {
            match node.publish(USAGE_KEY, &usage).await {
                Ok(()) => published_usage = usage,
                Err(e) => tracing::debug!("publishing this node's key usage failed: {e}"),
            }
        }
        if mine != published {
            match node.publish(GOSSIP_KEY, &mine).await {
                Ok(()) => published = mine,
                Err(e) => tracing::warn!("publishing this node's API keys failed: {e}"),
            }
        }
        tokio::time::sleep(REPLICATE_EVERY).await;
    }
}

/// The secret a request presents: `Authorization: Bearer X` or `x-api-key: X`.
fn presented_secret(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let v = v.trim();
        if let Some(rest) = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
        {
            return Some(rest.trim());
        }
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(s: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            axum::http::header::AUTHORIZATION,
            format!("Bearer {s}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn keys_are_hashed_persisted_and_revocable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let store = KeyStore::open(Some(&path), None).unwrap();
        assert!(store.authorize(&HeaderMap::new()).unwrap().is_none());
        let (first, secret) = store.create("ops", false, None).unwrap();
        assert!(first.admin, "the first key is an administrator key");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&secret), "the secret itself is never stored");
        let reopened = KeyStore::open(Some(&path), None).unwrap();
        assert_eq!(reopened.verify(&secret).unwrap().id, first.id);
        assert!(reopened.authorize(&HeaderMap::new()).is_err());
        assert!(reopened.authorize(&bearer("sk-shoal-wrong")).is_err());
        assert!(reopened.authorize(&bearer(&secret)).is_ok());
        let (user, user_secret) = reopened.create("app", false, None).unwrap();
        assert!(!user.admin);
        let e = reopened
            .authorize_admin(&bearer(&user_secret), true)
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Permission);
        assert!(reopened.authorize_admin(&bearer(&secret), false).is_ok());
        assert!(reopened.revoke(&user.id).unwrap());
        assert!(!reopened.revoke(&user.id).unwrap());
        assert!(reopened.authorize(&bearer(&user_secret)).is_err());
    }

    #[test]
    fn open_server_admin_only_from_loopback() {
        let store = KeyStore::open(None, None).unwrap();
        assert!(store.authorize_admin(&HeaderMap::new(), true).is_ok());
        assert!(store.authorize_admin(&HeaderMap::new(), false).is_err());
    }

    #[test]
    fn rate_limit_refuses_with_retry_after() {
        let store = KeyStore::open(None, None).unwrap();
        let (_, secret) = store.create("x", false, Some(2)).unwrap();
        assert!(store.authorize(&bearer(&secret)).is_ok());
        assert!(store.authorize(&bearer(&secret)).is_ok());
        let e = store.authorize(&bearer(&secret)).unwrap_err();
        match e.kind {
            ErrorKind::RateLimited { retry_after } => assert!((1..=60).contains(&retry_after)),
            k => panic!("{k:?}"),
        }
    }

    #[test]
    fn other_nodes_counts_take_from_a_keys_limit_while_fresh() {
        let store = KeyStore::open(None, None).unwrap();
        let (rec, secret) = store.create("x", false, Some(10)).unwrap();
        store.merge_usage("b", HashMap::from([(rec.id.clone(), 6)]));
        store.merge_usage("c", HashMap::from([("another".to_string(), 9)]));
        for i in 0..4 {
            assert!(store.authorize(&bearer(&secret)).is_ok(), "request {i}");
        }
        assert!(
            store.authorize(&bearer(&secret)).is_err(),
            "6 elsewhere and 4 here"
        );
        assert_eq!(store.usage(), HashMap::from([(rec.id.clone(), 4)]));
        // counts that are no longer fresh stop counting
        store.lock().peer_uses.get_mut("b").unwrap().1 -= USAGE_FRESH;
        assert!(store.authorize(&bearer(&secret)).is_ok());
    }

    #[test]
    fn key_sets_merge_to_the_union_less_every_revoked_key() {
        let dir = tempfile::tempdir().unwrap();
        let path_a = dir.path().join("a.json");
        let a = KeyStore::open(Some(&path_a), None).unwrap();
        let b = KeyStore::open(None, None).unwrap();
        let (ka, sa) = a.create("on a", false, Some(5)).unwrap();
        let (kb, sb) = b.create("on b", false, None).unwrap();
        // each takes the other's key, with its limit; merging again changes nothing
        assert!(a.merge(&b.snapshot()).unwrap());
        assert!(b.merge(&a.snapshot()).unwrap());
        assert!(!a.merge(&b.snapshot()).unwrap());
        assert_eq!(b.verify(&sa).unwrap().rpm, Some(5));
        assert_eq!(a.verify(&sb).unwrap().id, kb.id);
        let ids = |s: &KeyStore| {
            let mut v: Vec<String> = s.list().into_iter().map(|k| k.id).collect();
            v.sort();
            v
        };
        assert_eq!(ids(&a), ids(&b));
        // the merged set is saved
        let reopened = KeyStore::open(Some(&path_a), None).unwrap();
        assert!(reopened.verify(&sb).is_some());
        // a revocation on b reaches a, and a's stale copy cannot bring the key back
        let stale = a.snapshot();
        assert!(b.revoke(&ka.id).unwrap());
        assert!(b.verify(&sa).is_none());
        assert!(!b.merge(&stale).unwrap(), "the revoked key stays revoked");
        assert!(b.verify(&sa).is_none());
        assert!(a.merge(&b.snapshot()).unwrap());
        assert!(a.verify(&sa).is_none());
        assert!(a.verify(&sb).is_some());
        assert_eq!(a.snapshot().revoked.len(), 1);
    }

    #[test]
    fn a_replicated_key_set_is_held_to_what_replicates() {
        let store = KeyStore::open(None, None).unwrap();
        store.limit_replicated(1000);
        let mut made = 0;
        let err = loop {
            match store.create("a key with a name", false, None) {
                Ok(_) => made += 1,
                Err(e) => break e,
            }
            assert!(made < 100, "never refused");
        };
        assert!(
            matches!(err, KeyError::TooMany { limit: 1000, .. }),
            "{err}"
        );
        assert_eq!(store.list().len(), made, "the refused key is not kept");
        assert!(serde_json::to_vec(&store.snapshot()).unwrap().len() <= 1000);
    }

    #[test]
    fn damaged_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        std::fs::write(&path, "{not json").unwrap();
        let e = KeyStore::open(Some(&path), None).unwrap_err();
        assert!(e.to_string().contains("damaged"), "{e}");
    }
}
