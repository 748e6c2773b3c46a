//! Helpers the integration tests share: finding the cached demo models, a weight source
//! that plants a wrong head mapping into a real file (for tests that show a check can fail)
//! without touching the engine, and llama.cpp's run of a prompt with shoal compared to it.

#![allow(dead_code)]

use std::borrow::Cow;

use candle_core::quantized::QTensor;
use shoal_engine::weights::{GgufWeights, RawMatrix, Slice, WeightSource};
use shoal_engine::{EngineError, Transformer};
use shoal_testkit::{
    compare_teacher_forced, run_llama_oracle_with, Comparison, OracleCache, OracleInput, OracleRun,
    Tolerance,
};

/// llama.cpp's run of `prompt` on `path` (through the test kit's oracle binary `bin`):
/// `generate` greedy tokens, every logit, an F16 KV cache as shoal keeps.
pub fn llama_run(
    bin: &std::path::Path,
    path: &std::path::Path,
    prompt: &[u32],
    generate: usize,
) -> OracleRun {
    run_llama_oracle_with(
        bin,
        path,
        OracleInput::Tokens(prompt.to_vec()),
        generate,
        8,
        true,
        OracleCache::F16,
    )
    .unwrap_or_else(|e| panic!("llama.cpp cannot run {}: {e}", path.display()))
}

/// `t` fed `run`'s tokens (`prompt`, then llama.cpp's), compared with it: the generated
/// steps on every logit, the prompt positions on llama.cpp's top 8.
pub fn compare_with_run(
    t: &Transformer,
    run: &OracleRun,
    prompt: &[u32],
    tol: Tolerance,
) -> (Comparison, Comparison) {
    let vocab = t.config().vocab;
    let mut cache = t.new_cache(run.sequence().len() + 1);
    let n = prompt.len();
    let prompt_rows: Vec<Vec<f32>> = t
        .forward(prompt, &mut cache, n)
        .unwrap()
        .chunks_exact(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    let mut rows = vec![prompt_rows[n - 1].clone()];
    for &id in &run.generated {
        rows.push(t.forward_last(&[id], &mut cache).unwrap());
    }
    (
        compare_teacher_forced(&run.full_steps().unwrap(), &rows, tol),
        compare_teacher_forced(&run.prompt_steps, &prompt_rows, tol),
    )
}

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

/// The ranks of `layout` over in-process channels, each loading its shard of `source`:
/// rank 0's context and model for a scheduler to lead, and the other ranks serving (each
/// thread ends with its `serve`'s result once the lead stops), each holding caches of
/// `capacity` positions.
pub fn split_ranks(
    source: &shoal_model::source::ModelSource,
    layout: shoal_engine::shard::Layout,
    capacity: usize,
) -> (
    shoal_engine::parallel::RankContext,
    shoal_engine::model::LoadedModel,
    Vec<std::thread::JoinHandle<Result<(), shoal_engine::EngineError>>>,
) {
    use shoal_comm::{mem_mesh, Transport};
    use shoal_engine::model::LoadedModel;
    use shoal_engine::parallel::{serve, RankContext};
    use std::sync::Arc;
    use std::time::Duration;

    let mut lead = None;
    let mut workers = Vec::new();
    for (r, t) in mem_mesh(layout.world()).into_iter().enumerate() {
        let t: Arc<dyn Transport> = Arc::new(t);
        let mut ctx = RankContext::over(t, layout, Duration::from_secs(60)).unwrap();
        let source = source.clone();
        let h = std::thread::spawn(move || {
            let (m, plans) = LoadedModel::load_split(
                &source,
                layout,
                None,
                Default::default(),
                r,
                ctx.tp.clone(),
            )
            .unwrap();
            ctx.plans = plans;
            (ctx, m)
        });
        if r == 0 {
            lead = Some(h);
        } else {
            workers.push(std::thread::spawn(move || {
                let (ctx, m) = h.join().unwrap();
                serve(&ctx, &m.transformer, capacity)
            }));
        }
    }
    let (ctx, m) = lead.unwrap().join().unwrap();
    (ctx, m, workers)
}
