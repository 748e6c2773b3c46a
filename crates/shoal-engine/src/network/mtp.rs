//! A multi-token-prediction layer (GLM-4.5+'s `nextn` layer, DeepSeek V3's MTP module): one
//! more transformer block that predicts the token after next. At position `i` it reads the
//! model's output hidden state there (after the final norm) and the embedding of the token
//! at `i + 1`, each RMS-normed by its own weights (`enorm`, `hnorm`), the embedding zeroed at
//! position 0; `eh_proj` maps the two, concatenated embedding first, to one hidden state,
//! which runs through the block (with a KV cache of its own) and then through
//! `shared_head_norm` and the output head, giving logits for the token at `i + 2`. A further
//! draft token feeds the block's output back in place of the model's hidden state. This is
//! the layout vLLM and SGLang run these layers with; the tensors are those of llama.cpp's
//! GGUF (`blk.N.nextn.*` beside block `N`'s own, `N` the first layer after the model's).

use std::sync::Arc;

use shoal_comm::Communicator;

use super::block::Block;
use super::linear::{Linear, Norm, Tensors};
use super::Workspace;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::shard::LayerShard;
use crate::weights::Slice;
use crate::EngineError;

/// One multi-token-prediction layer on a rank that holds the whole model.
pub(crate) struct Mtp<B: Backend> {
    enorm: Norm<B>,
    hnorm: Norm<B>,
    eh_proj: Linear<B>,
    block: Block<B>,
    /// `shared_head_norm`, or the model's output norm where the file has none.
    head_norm: Option<Norm<B>>,
    /// `shared_head_head`, where the file has one (else the model's output head).
    head: Option<Linear<B>>,
    /// `embed_tokens`, where the file has one (else the model's embedding).
    embed: Option<B::Matrix>,
}

impl<B: Backend> Mtp<B> {
    /// The first prediction layer of the file (`blk.{n_layer}`), when `cfg` says it has
    /// one and asks for it (`load_mtp`).
    ///
    /// # Errors
    /// When one of its tensors is missing or misshapen.
    pub fn load(
        t: &Tensors<'_, B>,
        cfg: &ModelConfig,
        shard: &LayerShard,
        freq_factors: Option<&Arc<[f32]>>,
    ) -> Result<Option<Self>, EngineError> {
        if cfg.mtp_layers == 0 || !cfg.load_mtp {
            return Ok(None);
        }
        let layer = cfg.n_layer;
        let (d, eps) = (cfg.hidden, cfg.rms_eps);
        let name = |part: &str| format!("blk.{layer}.nextn.{part}.weight");
        let present = |part: &str| t.src.contains(&name(part)).then(|| name(part));
        let norm = |part: &str| Norm::load(t, &name(part), d, eps);
        let head_norm = present("shared_head_norm")
            .map(|n| Norm::load(t, &n, d, eps))
            .transpose()?;
        let head = present("shared_head_head")
            .map(|n| Linear::rows(t, &n, None, [cfg.vocab, d], 0..cfg.vocab))
            .transpose()?;
        let embed = match present("embed_tokens") {
            Some(n) => {
                t.check_shape(&n, &[cfg.vocab, d])?;
                Some(t.be.matrix(t.src, &n, &Slice::Full)?)
            }
            None => None,
        };
        Ok(Some(Mtp {
            enorm: norm("enorm")?,
            hnorm: norm("hnorm")?,
            eh_proj: Linear::rows(t, &name("eh_proj"), None, [d, 2 * d], 0..d)?,
            block: Block::load(t, cfg, layer, shard, freq_factors)?,
            head_norm,
            head,
            embed,
        }))
    }

    /// The layer over the step's rows into `ws.x`: row `r` joins `hidden[r]` with the
    /// embedding of `tokens[r]` (`table` is the model's embedding); `kv` are the layer's
    /// caches and `ws.rows` the step's rows. Returns nothing; `ws.x` holds the block's
    /// output.
    ///
    /// # Errors
    /// When a cache has no room or a product fails.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        cfg: &ModelConfig,
        table: &B::Matrix,
        tokens: &[u32],
        hidden: Vec<f32>,
        ws: &mut Workspace<B>,
        kv: &mut [&mut B::Kv],
        tp: &dyn Communicator,
    ) -> Result<(), EngineError> {
        let d = cfg.hidden;
        let table = self.embed.as_ref().unwrap_or(table);
        be.embed(
            table,
            0..cfg.vocab,
            tokens,
            cfg.embed_scale as f32,
            &mut ws.x,
        )?;
        let mut e = be.download(std::mem::take(&mut ws.x))?;
        // the embedding at position 0 is zeroed (that position has no token before it)
        for s in &ws.rows.seqs {
            if s.start == 0 {
                e[s.rows.start * d..(s.rows.start + 1) * d].fill(0.0);
            }
        }
        be.rms_norm(&be.upload(e), &self.enorm.w, self.enorm.eps, &mut ws.xn);
        let e = be.download(std::mem::take(&mut ws.xn))?;
        be.rms_norm(
            &be.upload(hidden),
            &self.hnorm.w,
            self.hnorm.eps,
            &mut ws.out,
        );
        let h = be.download(std::mem::take(&mut ws.out))?;
        let mut joined = Vec::with_capacity(2 * e.len());
        for (e, h) in e.chunks_exact(d).zip(h.chunks_exact(d)) {
            joined.extend_from_slice(e);
            joined.extend_from_slice(h);
        }
        be.matmul(&[&*self.eh_proj.w], &be.upload(joined), &mut [&mut ws.x])?;
        be.begin_step(&ws.rows, &mut ws.tables);
        self.block.forward(be, ws, kv, 0, tp)
    }

    /// Its own head norm, if the file has one.
    pub fn head_norm(&self) -> Option<&Norm<B>> {
        self.head_norm.as_ref()
    }

    /// Its own output head, if the file has one.
    pub fn head(&self) -> Option<&Linear<B>> {
        self.head.as_ref()
    }
}
