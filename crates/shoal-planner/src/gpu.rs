//! How a node that computes on a GPU holds its share: the first layers the GPU takes (and
//! the embedding, on the first stage) run there at the GPU's bandwidth, the rest (and the
//! head, on the last stage) on the node's CPU at its own, in host memory. How many layers
//! the GPU takes is the rule the engine loads by (`--gpu-layers`), written once here so the
//! planner predicts what the node will do: a count the user gave, or those whose weights
//! and a cache of [`FIT_KV_POSITIONS`] positions fit its memory after the embedding, a
//! tenth of the memory and [`FIT_SPARE_BYTES`]; every layer where its memory is the host's
//! or unknown.

use serde::{Deserialize, Serialize};

/// Positions of KV cache per layer the fit leaves room for on the GPU.
pub const FIT_KV_POSITIONS: u64 = 8192;

/// Bytes the fit leaves free on the GPU for a step's activations and logits.
pub const FIT_SPARE_BYTES: u64 = 512 << 20;

/// A node's GPU, where the node computes on one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// Its own memory, bytes (`None`: it shares the host's, as a Mac's does, or its size is
    /// unknown; it then takes every layer, counted in the host's memory).
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    /// Its measured read bandwidth, GB/s.
    pub mem_bandwidth_gbs: f64,
    /// Its measured matrix-product throughput, GFLOP/s (`None`: not measured; prefill is
    /// then set against the node's CPU figure).
    #[serde(default)]
    pub compute_gflops: Option<f64>,
    /// Layers of a share it takes at most, as the node was told (`--gpu-layers N`; `None`:
    /// what fits).
    #[serde(default)]
    pub max_layers: Option<u32>,
}

/// How many of a share's `layers` (each needing its weight bytes and `kv_per_position`
/// bytes per cached position) a GPU of `memory` bytes takes after `embedding` bytes.
pub fn layers_that_fit(
    memory: u64,
    embedding: u64,
    layers: impl IntoIterator<Item = u64>,
    kv_per_position: u64,
) -> usize {
    let mut budget = memory.saturating_sub(memory / 10 + FIT_SPARE_BYTES + embedding);
    let mut fit = 0;
    for weights in layers {
        let need = weights + kv_per_position * FIT_KV_POSITIONS;
        if need > budget {
            break;
        }
        budget -= need;
        fit += 1;
    }
    fit
}

impl GpuSpec {
    /// How many of a share's layers (weight bytes of each, in order) this GPU takes.
    pub fn layers(&self, embedding: u64, layers: &[u64], kv_per_position: u64) -> usize {
        let all = layers.len();
        match (self.max_layers, self.memory_bytes) {
            (Some(n), _) => (n as usize).min(all),
            (None, None) => all,
            (None, Some(m)) => {
                layers_that_fit(m, embedding, layers.iter().copied(), kv_per_position)
            }
        }
    }

    /// Whether what it holds is counted in the host's memory (it shares it).
    pub fn shares_host_memory(&self) -> bool {
        self.memory_bytes.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layers_that_fit_are_counted_in_order_after_the_set_asides() {
        let gib = 1u64 << 30;
        // 10 GiB: 1 GiB a tenth, 0.5 GiB spare, 0.5 GiB embedding: 8 GiB for layers
        let layers = [
            2 * gib - 1024,
            2 * gib - 1024,
            2 * gib - 1024,
            2 * gib - 1024,
            gib,
        ];
        assert_eq!(layers_that_fit(10 * gib, gib / 2, layers, 0), 4);
        // the cache of FIT_KV_POSITIONS positions counts too
        assert_eq!(layers_that_fit(10 * gib, gib / 2, layers, 1), 3);
        // a layer that does not fit stops the count, even if a later one would
        assert_eq!(layers_that_fit(10 * gib, gib / 2, [9 * gib, 1], 0), 0);
        assert_eq!(layers_that_fit(0, 0, layers, 0), 0);
    }

    #[test]
    fn a_count_wins_and_shared_memory_takes_every_layer() {
        let g = |memory_bytes, max_layers| GpuSpec {
            memory_bytes,
            mem_bandwidth_gbs: 100.0,
            compute_gflops: None,
            max_layers,
        };
        let layers = [1u64 << 30; 6];
        assert_eq!(g(None, None).layers(0, &layers, 0), 6);
        assert_eq!(g(Some(1 << 30), Some(4)).layers(0, &layers, 0), 4);
        assert_eq!(g(None, Some(99)).layers(0, &layers, 0), 6);
        assert_eq!(g(Some(4 << 30), None).layers(0, &layers, 0), 3);
        assert!(g(None, None).shares_host_memory());
    }
}
