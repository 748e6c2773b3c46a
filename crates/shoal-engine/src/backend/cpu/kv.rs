//! The CPU backend's KV cache layout: per layer, keys and values of every position of one
//! sequence in two f16 buffers laid out `(n_kv_head, capacity, head_dim)`, allocated on the
//! layer's first write for the sequence's whole capacity and written in place, so a decode
//! step appends without copying the past. f16, as llama.cpp keeps by default, halves what
//! attention reads against f32; attention widens the values and computes in f32.

use half::f16;

use crate::kernels::to_f16;
use crate::EngineError;

/// One sequence's keys and values for the layers a rank holds.
#[derive(Debug)]
pub struct CpuKv {
    layers: Vec<Option<(Vec<f16>, Vec<f16>)>>,
    n_kv_head: usize,
    head_dim: usize,
    capacity: usize,
}

impl CpuKv {
    /// Empty storage; buffers are allocated on each layer's first write.
    pub fn new(layers: usize, n_kv_head: usize, head_dim: usize, capacity: usize) -> Self {
        CpuKv {
            layers: (0..layers).map(|_| None).collect(),
            n_kv_head,
            head_dim,
            capacity,
        }
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
        if per_pos == 0 || k.len() != v.len() || !k.len().is_multiple_of(per_pos) {
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
        let n_layers = self.layers.len();
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| EngineError::Internal {
                what: format!("a KV cache of {n_layers} layers has no layer {layer}"),
            })?;
        let size = nkv * cap * hd;
        let (kc, vc) = slot.get_or_insert_with(|| (vec![f16::ZERO; size], vec![f16::ZERO; size]));
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
        let same = (self.layers.len(), self.n_kv_head, self.head_dim)
            == (from.layers.len(), from.n_kv_head, from.head_dim);
        if !same || positions > self.capacity || positions > from.capacity {
            return Err(EngineError::Internal {
                what: format!(
                    "copying {positions} positions from a cache of {} layers x {} heads x {} \
                     (room for {}) into one of {} x {} x {} (room for {})",
                    from.layers.len(),
                    from.n_kv_head,
                    from.head_dim,
                    from.capacity,
                    self.layers.len(),
                    self.n_kv_head,
                    self.head_dim,
                    self.capacity
                ),
            });
        }
        let (nkv, hd, cap) = (self.n_kv_head, self.head_dim, self.capacity);
        for (dst, src) in self.layers.iter_mut().zip(&from.layers) {
            let Some((sk, sv)) = src else { continue };
            let size = nkv * cap * hd;
            let (dk, dv) =
                dst.get_or_insert_with(|| (vec![f16::ZERO; size], vec![f16::ZERO; size]));
            for h in 0..nkv {
                let s = h * from.capacity * hd;
                let d = h * cap * hd;
                let n = positions * hd;
                dk[d..d + n].copy_from_slice(&sk[s..s + n]);
                dv[d..d + n].copy_from_slice(&sv[s..s + n]);
            }
        }
        Ok(())
    }

    /// The whole key and value buffers of `layer`, `(n_kv_head, capacity, head_dim)`, once
    /// it has been written to.
    pub fn buffers(&self, layer: usize) -> Option<(&[f16], &[f16])> {
        self.layers
            .get(layer)?
            .as_ref()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
    }
}
