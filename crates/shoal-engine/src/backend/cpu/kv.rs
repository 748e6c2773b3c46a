//! The CPU backend's KV cache layout: per layer, keys and values of every position of one
//! sequence in two f16 buffers laid out `(n_kv_head, capacity, head_dim)` — or, for latent
//! attention, one buffer `(capacity, dims)` of latents that keys and values are both read
//! from — allocated on the layer's first write for the sequence's whole capacity and
//! written in place, so a decode step appends without copying the past. f16, as llama.cpp
//! keeps by default, halves what attention reads against f32; attention widens the values
//! and computes in f32.

use half::f16;

use crate::backend::cpu::kernels::to_f16;
use crate::backend::KvLayout;
use crate::EngineError;

/// One sequence's keys and values for the layers a rank holds.
#[derive(Debug)]
pub struct CpuKv {
    /// Per layer: keys (or latents) and values (empty for latents).
    layers: Vec<Option<(Vec<f16>, Vec<f16>)>>,
    layout: KvLayout,
    /// Heads per layer (1 for latents).
    n_kv_head: usize,
    /// Values per head (per latent).
    head_dim: usize,
    capacity: usize,
}

impl CpuKv {
    /// Empty storage; buffers are allocated on each layer's first write.
    pub fn new(layers: usize, layout: KvLayout, capacity: usize) -> Self {
        let (n_kv_head, head_dim) = match layout {
            KvLayout::Heads { kv_heads, head_dim } => (kv_heads, head_dim),
            KvLayout::Latent { dims } => (1, dims),
        };
        CpuKv {
            layers: (0..layers).map(|_| None).collect(),
            layout,
            n_kv_head,
            head_dim,
            capacity,
        }
    }

    /// Whether the cache holds values beside its keys (not latents).
    fn has_values(&self) -> bool {
        matches!(self.layout, KvLayout::Heads { .. })
    }

    /// The buffers of `layer`, allocated on first use.
    fn slot(&mut self, layer: usize) -> Result<(&mut Vec<f16>, &mut Vec<f16>), EngineError> {
        let size = self.n_kv_head * self.capacity * self.head_dim;
        let values = if self.has_values() { size } else { 0 };
        let n_layers = self.layers.len();
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| EngineError::Internal {
                what: format!("a KV cache of {n_layers} layers has no layer {layer}"),
            })?;
        let (k, v) = slot.get_or_insert_with(|| (vec![f16::ZERO; size], vec![f16::ZERO; values]));
        Ok((k, v))
    }

    /// Writes the latents `rows` (`t` positions of `dims` values) of `layer` from position
    /// `at` on, rounded to f16.
    ///
    /// # Errors
    /// When the positions do not fit, or the cache is not laid out in latents of that size.
    pub fn write_latent(
        &mut self,
        layer: usize,
        at: usize,
        rows: &[f32],
    ) -> Result<(), EngineError> {
        let KvLayout::Latent { dims } = self.layout else {
            return Err(EngineError::Internal {
                what: format!("a latent written to a cache of {:?}", self.layout),
            });
        };
        if dims == 0 || !rows.len().is_multiple_of(dims) {
            return Err(EngineError::Internal {
                what: format!(
                    "a latent write of {} values ({dims} a position)",
                    rows.len()
                ),
            });
        }
        let t = rows.len() / dims;
        if at + t > self.capacity {
            return Err(EngineError::ContextFull {
                prompt: at + t,
                ctx: self.capacity,
            });
        }
        let (k, _) = self.slot(layer)?;
        to_f16(rows, &mut k[at * dims..(at + t) * dims]);
        Ok(())
    }

    /// The latents of `layer`, `(capacity, dims)`, once it has been written to.
    pub fn latents(&self, layer: usize) -> Option<&[f16]> {
        self.layers.get(layer)?.as_ref().map(|(k, _)| k.as_slice())
    }

    /// Positions the buffers hold room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Writes keys `k` and values `v` of `t` positions of `layer` from position `at` on,
    /// each laid out `(t, n_kv_head, head_dim)` (rows of a step), rounded to f16.
    ///
    /// # Errors
    /// When the positions do not fit, or the lengths do not fit the layout.
    pub fn write(
        &mut self,
        layer: usize,
        at: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError> {
        let (nkv, hd, cap) = (self.n_kv_head, self.head_dim, self.capacity);
        let per_pos = nkv * hd;
        if !self.has_values()
            || per_pos == 0
            || k.len() != v.len()
            || !k.len().is_multiple_of(per_pos)
        {
            return Err(EngineError::Internal {
                what: format!(
                    "a KV write of {} keys and {} values ({nkv} KV heads of {hd})",
                    k.len(),
                    v.len()
                ),
            });
        }
        let t = k.len() / per_pos;
        if at + t > cap {
            return Err(EngineError::ContextFull {
                prompt: at + t,
                ctx: cap,
            });
        }
        let (kc, vc) = self.slot(layer)?;
        for i in 0..t {
            for h in 0..nkv {
                let dst = (h * cap + at + i) * hd..(h * cap + at + i + 1) * hd;
                let src = (i * nkv + h) * hd..(i * nkv + h + 1) * hd;
                to_f16(&k[src.clone()], &mut kc[dst.clone()]);
                to_f16(&v[src], &mut vc[dst]);
            }
        }
        Ok(())
    }

    /// Copies the first `positions` positions of every layer `from` holds.
    ///
    /// # Errors
    /// When the layouts differ or this cache has no room for them.
    pub fn copy_prefix(&mut self, from: &CpuKv, positions: usize) -> Result<(), EngineError> {
        let same = (self.layers.len(), self.layout) == (from.layers.len(), from.layout);
        if !same || positions > self.capacity || positions > from.capacity {
            return Err(EngineError::Internal {
                what: format!(
                    "copying {positions} positions from a cache of {} layers of {:?} (room for \
                     {}) into one of {} layers of {:?} (room for {})",
                    from.layers.len(),
                    from.layout,
                    from.capacity,
                    self.layers.len(),
                    self.layout,
                    self.capacity
                ),
            });
        }
        let (nkv, hd) = (self.n_kv_head, self.head_dim);
        let cap = self.capacity;
        for layer in 0..self.layers.len() {
            let Some((sk, sv)) = &from.layers[layer] else {
                continue;
            };
            let (dk, dv) = self.slot(layer)?;
            for h in 0..nkv {
                let s = h * from.capacity * hd;
                let d = h * cap * hd;
                let n = positions * hd;
                dk[d..d + n].copy_from_slice(&sk[s..s + n]);
                if !sv.is_empty() {
                    dv[d..d + n].copy_from_slice(&sv[s..s + n]);
                }
            }
        }
        Ok(())
    }

    /// The whole key and value buffers of `layer`, `(n_kv_head, capacity, head_dim)`, once
    /// it has been written to (a cache of heads).
    pub fn buffers(&self, layer: usize) -> Option<(&[f16], &[f16])> {
        if !self.has_values() {
            return None;
        }
        self.layers
            .get(layer)?
            .as_ref()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
    }
}
