//! The key/value cache of one sequence: per layer, keys and values of every position seen so
//! far, in buffers allocated once for the sequence's capacity and written in place, so a
//! decode step appends without copying the past.

use candle_core::{DType, Device, Tensor};

use crate::error::CandleContext;
use crate::EngineError;

/// Keys and values of one sequence, all layers. Shapes `(1, n_kv_head, capacity, head_dim)`.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
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

    /// Writes `k`, `v` `(1, nkv, t, hd)` of `layer` at the current end and returns views of
    /// every stored position `(1, nkv, len + t, hd)`. [`KvCache::advance`] moves the end once
    /// all layers have been written.
    ///
    /// # Errors
    /// When the new positions do not fit or the shapes are wrong.
    pub fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor), EngineError> {
        let t = k.dim(2).ctx("kv append")?;
        if self.len + t > self.capacity {
            return Err(EngineError::ContextFull {
                prompt: self.len + t,
                ctx: self.capacity,
            });
        }
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| EngineError::Unsupported {
                what: format!("kv cache has no layer {layer}"),
            })?;
        if slot.is_none() {
            let shape = (1, self.n_kv_head, self.capacity, self.head_dim);
            let z = || Tensor::zeros(shape, DType::F32, &Device::Cpu).ctx("kv cache allocation");
            *slot = Some((z()?, z()?));
        }
        let (kc, vc) = slot.as_ref().expect("allocated above");
        kc.slice_set(k, 2, self.len).ctx("kv cache write k")?;
        vc.slice_set(v, 2, self.len).ctx("kv cache write v")?;
        let total = self.len + t;
        Ok((
            kc.narrow(2, 0, total).ctx("kv view")?,
            vc.narrow(2, 0, total).ctx("kv view")?,
        ))
    }

    /// The whole key and value buffers of `layer`, `(1, nkv, capacity, hd)`, once it has
    /// been appended to.
    pub fn buffers(&self, layer: usize) -> Option<(&Tensor, &Tensor)> {
        self.layers.get(layer)?.as_ref().map(|(k, v)| (k, v))
    }

    /// Marks `t` more positions as stored (after every layer appended them).
    pub fn advance(&mut self, t: usize) {
        self.len += t;
    }
}
