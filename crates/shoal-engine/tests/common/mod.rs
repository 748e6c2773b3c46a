//! Helpers the integration tests share: finding the cached demo models, and a weight
//! source that plants a wrong head mapping into a real file (for tests that show a check
//! can fail) without touching the engine.

#![allow(dead_code)]

use std::borrow::Cow;

use candle_core::quantized::QTensor;
use shoal_engine::weights::{GgufWeights, RawMatrix, Slice, WeightSource};
use shoal_engine::EngineError;

/// The cached path of catalog model `key`; `None` (the test skips) when it is not fetched,
/// unless `SHOAL_REQUIRE_MODELS=1` (CI), which makes a missing model a failure.
pub fn model_path(key: &str) -> Option<std::path::PathBuf> {
    let found = shoal_model::catalog::Catalog::open_default()
        .ok()
        .and_then(|c| c.cached_path(key).ok().flatten());
    if found.is_none() {
        assert!(
            std::env::var("SHOAL_REQUIRE_MODELS").as_deref() != Ok("1"),
            "model `{key}` is not cached; run `shoal models fetch {key}`"
        );
        eprintln!("skipping: model `{key}` is not cached (shoal models fetch {key})");
    }
    found
}

/// A GGUF file whose query projections (`attn_q.weight` of every layer) have the rows of
/// heads `a` and `b` of whatever slice is loaded exchanged: a wrong head mapping.
pub struct SwappedHeads {
    /// The file.
    pub inner: GgufWeights,
    /// Rows per head (the head dimension).
    pub head_rows: usize,
    /// The two heads, counted from the first row of the slice loaded.
    pub heads: (usize, usize),
}

impl SwappedHeads {
    fn planted(name: &str) -> bool {
        name.ends_with(".attn_q.weight")
    }

    fn swap(&self, bytes: &[u8], rows: usize) -> Vec<u8> {
        let row = bytes.len() / rows;
        let mut out = bytes.to_vec();
        let (a, b) = self.heads;
        assert!(
            (a.max(b) + 1) * self.head_rows <= rows,
            "the slice holds fewer heads"
        );
        let (ra, rb) = (a * self.head_rows * row, b * self.head_rows * row);
        let n = self.head_rows * row;
        out[ra..ra + n].copy_from_slice(&bytes[rb..rb + n]);
        out[rb..rb + n].copy_from_slice(&bytes[ra..ra + n]);
        out
    }
}

impl WeightSource for SwappedHeads {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn shape(&self, name: &str) -> Result<Vec<usize>, EngineError> {
        self.inner.shape(name)
    }
    fn load(&self, name: &str, slice: &Slice) -> Result<QTensor, EngineError> {
        assert!(!Self::planted(name), "{name} loads through load_bytes");
        self.inner.load(name, slice)
    }
    fn load_bytes(&self, name: &str, slice: &Slice) -> Result<Option<RawMatrix<'_>>, EngineError> {
        let raw = self.inner.load_bytes(name, slice)?;
        if !Self::planted(name) {
            return Ok(raw);
        }
        Ok(raw.map(|(ty, [rows, cols], bytes)| {
            (ty, [rows, cols], Cow::Owned(self.swap(&bytes, rows)))
        }))
    }
    fn stored_bytes(&self, name: &str) -> Result<u64, EngineError> {
        self.inner.stored_bytes(name)
    }
    fn block_len(&self, name: &str) -> Result<usize, EngineError> {
        self.inner.block_len(name)
    }
}
