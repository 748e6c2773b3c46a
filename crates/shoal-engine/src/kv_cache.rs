//! The key/value cache of one sequence: per layer, keys and values of every position seen so
//! far, in buffers allocated once for the sequence's capacity and written in place, so a
//! decode step appends without copying the past. Keys and values are stored as f16, as
//! llama.cpp does by default: at 16 concurrent SmolLM2 sequences a few hundred positions
//! long, reading an f32 cache took as long as reading the weights (attention 18% of a
//! batched step at 64 positions); f16 halves that traffic and the memory a slot holds.

use half::f16;

use crate::kernels::to_f16;
use crate::EngineError;

/// Keys and values of one sequence, all layers, as f16 buffers laid out
/// `(n_kv_head, capacity, head_dim)`.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<(Vec<f16>, Vec<f16>)>>,
    n_kv_head: usize,
    head_dim: usize,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// An empty cache; buffers are allocated on first use of each layer.
    pub fn new(n_layer: usize, n_kv_head: usize, head_dim: usize, capacity: usize) -> Self {
        KvCache {
            layers: (0..n_layer).map(|_| None).collect(),
            n_kv_head,
            head_dim,
            len: 0,
            capacity,
        }
    }

    /// Bytes one position takes in one layer: keys and values of every KV head, f16 each
    /// (what the planner counts for a sequence's cache).
    pub fn bytes_per_token_per_layer(n_kv_head: usize, head_dim: usize) -> u64 {
        (2 * n_kv_head * head_dim * std::mem::size_of::<f16>()) as u64
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

    /// Forgets positions from `len` on (to re-run from a common prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Writes keys `k` and values `v` of `t` new positions of `layer`, each laid out
    /// `(n_kv_head, t, head_dim)`, at the current end, rounded to f16. [`KvCache::advance`]
    /// moves the end once all layers have been written.
    ///
    /// # Errors
    /// When the new positions do not fit or the lengths are wrong.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), EngineError> {
        let (nkv, hd) = (self.n_kv_head, self.head_dim);
        let per_pos = nkv * hd;
        if per_pos == 0 || k.len() != v.len() || !k.len().is_multiple_of(per_pos) {
            return Err(EngineError::Unsupported {
                what: format!(
                    "kv append of {} keys and {} values ({nkv} kv heads of {hd})",
                    k.len(),
                    v.len()
                ),
            });
        }
        let t = k.len() / per_pos;
        if self.len + t > self.capacity {
            return Err(EngineError::ContextFull {
                prompt: self.len + t,
                ctx: self.capacity,
            });
        }
        let size = nkv * self.capacity * hd;
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| EngineError::Unsupported {
                what: format!("kv cache has no layer {layer}"),
            })?;
        let (kc, vc) = slot.get_or_insert_with(|| (vec![f16::ZERO; size], vec![f16::ZERO; size]));
        for h in 0..nkv {
            let dst = (h * self.capacity + self.len) * hd..(h * self.capacity + self.len + t) * hd;
            let src = h * t * hd..(h + 1) * t * hd;
            to_f16(&k[src.clone()], &mut kc[dst.clone()]);
            to_f16(&v[src], &mut vc[dst]);
        }
        Ok(())
    }

    /// The whole key and value buffers of `layer`, `(n_kv_head, capacity, head_dim)`, once
    /// it has been appended to.
    pub fn buffers(&self, layer: usize) -> Option<(&[f16], &[f16])> {
        self.layers
            .get(layer)?
            .as_ref()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
    }

    /// Marks `t` more positions as stored (after every layer appended them).
    pub fn advance(&mut self, t: usize) {
        self.len += t;
    }
}
