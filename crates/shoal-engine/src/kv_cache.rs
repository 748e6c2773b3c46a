//! The key/value cache of one sequence as the rest of the engine sees it: how many
//! positions it holds and has room for. The keys and values themselves are the backend's
//! (for the CPU, f16 buffers per layer: `backend::cpu::kv`), made by the model that fills
//! them ([`crate::Transformer::new_cache`]) and read only by it.

use std::any::Any;

/// One sequence's cache: its length, its capacity and the backend's storage.
pub struct KvCache {
    store: Box<dyn Any + Send>,
    backend: &'static str,
    len: usize,
    capacity: usize,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("backend", &self.backend)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl KvCache {
    /// An empty cache over a backend's `store` with room for `capacity` positions.
    pub(crate) fn new(store: Box<dyn Any + Send>, capacity: usize, backend: &'static str) -> Self {
        KvCache {
            store,
            backend,
            len: 0,
            capacity,
        }
    }

    /// Bytes one position takes in one layer: keys and values of every KV head, f16 each
    /// (what the planner counts for a sequence's cache).
    pub fn bytes_per_token_per_layer(n_kv_head: usize, head_dim: usize) -> u64 {
        (2 * n_kv_head * head_dim * std::mem::size_of::<half::f16>()) as u64
    }

    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets everything (the buffers are kept for reuse).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Forgets positions from `len` on (to run again from a common prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The backend that made it.
    pub(crate) fn backend(&self) -> &'static str {
        self.backend
    }

    /// The backend's storage, when it is of type `T`.
    pub(crate) fn store<T: 'static>(&self) -> Option<&T> {
        self.store.downcast_ref::<T>()
    }

    /// The backend's storage, when it is of type `T`, to write.
    pub(crate) fn store_mut<T: 'static>(&mut self) -> Option<&mut T> {
        self.store.downcast_mut::<T>()
    }

    /// Marks `t` more positions as stored (after every layer wrote them).
    pub(crate) fn advance(&mut self, t: usize) {
        self.len += t;
    }
}
