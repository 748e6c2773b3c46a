//! A model ready to talk to: the transformer, its tokenizer and its chat template, loaded
//! from a GGUF file or a Hugging Face folder. This is what the CLI and the API server hold;
//! it turns chat messages or raw text into prompt tokens and generated tokens into text.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shoal_comm::Communicator;
use shoal_model::chat_template::{ChatTemplate, RenderInput};
use shoal_model::gguf::GgufFile;
use shoal_model::source::ModelSource;
use shoal_model::tokenizer::Tokenizer;

use crate::arch::{ArchSpec, Role};
use crate::profile::Op;
use crate::shard::{self, ExpertSplit, Layout, ShardPlan};
use crate::transformer::{Reuse, Transformer};
use crate::weights::{GgufWeights, HfNaming, SafetensorsWeights, WeightSource};
use crate::{arch, EngineError, KvCache, ModelConfig};

/// A loaded model with everything needed to chat with it.
pub struct LoadedModel {
    /// A short name (the file or folder name).
    pub name: String,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// The network.
    pub transformer: Transformer,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, when the model has one.
    pub chat_template: Option<ChatTemplate>,
    /// Bytes of weights read per generated token (every layer plus the output head), for the
    /// bandwidth ceiling in benchmarks.
    pub weight_bytes_per_token: u64,
    /// Of those, the bytes each matrix product of the decode profile reads (GGUF models;
    /// empty for safetensors folders), for its bandwidth in `shoal bench --profile`.
    pub weight_bytes_by_op: Vec<(Op, u64)>,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("name", &self.name)
            .field("path", &self.path)
            .finish()
    }
}

/// Builds the transformer once the weights and config are open.
type Builder<'a> =
    dyn FnMut(&dyn WeightSource, ModelConfig) -> Result<Transformer, EngineError> + 'a;

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

impl LoadedModel {
    /// Loads whatever `source` points at, on one rank.
    ///
    /// # Errors
    /// When the files are missing, malformed or of an unsupported architecture.
    pub fn load(source: &ModelSource) -> Result<Self, EngineError> {
        Self::load_with(source, Arc::new(shoal_comm::Solo))
    }

    /// Loads whatever `source` points at, on one rank, with its first multi-token-prediction
    /// layer where it has one (GLM-4.5+), to draft with it
    /// ([`crate::scheduler::Scheduler::start_with_mtp`]).
    ///
    /// # Errors
    /// As [`LoadedModel::load`].
    pub fn load_with_mtp(source: &ModelSource) -> Result<Self, EngineError> {
        Self::load_built(source, &mut |src, cfg| {
            let cfg = ModelConfig {
                load_mtp: true,
                ..cfg
            };
            Transformer::load(src, cfg, Arc::new(shoal_comm::Solo))
        })
    }

    /// Loads only what drafting with `source`'s multi-token-prediction layer needs, beside
    /// a split of the model that runs its layers elsewhere: the layer, the embedding, the
    /// final norm and the whole output head ([`ShardPlan::prediction_only`]). The lead of
    /// the split drafts with it from the hidden states the split returns.
    ///
    /// # Errors
    /// As [`LoadedModel::load`], and when the model has no such layer.
    pub fn load_prediction_layer(source: &ModelSource) -> Result<Self, EngineError> {
        let model = Self::load_built(source, &mut |src, cfg| {
            let cfg = ModelConfig {
                load_mtp: true,
                ..cfg
            };
            let plan = ShardPlan::prediction_only(&cfg);
            Transformer::load_shard(src, cfg, plan, Arc::new(shoal_comm::Solo))
        })?;
        if !model.transformer.has_mtp() {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "{} has no multi-token-prediction layer to draft with (GLM-4.5 and later ship one as `nextn` tensors; DeepSeek GGUF files leave theirs out); draft by prompt lookup or with a draft model instead",
                    model.name
                ),
            });
        }
        Ok(model)
    }

    /// Loads `source` as one rank of `comm`.
    ///
    /// # Errors
    /// As [`LoadedModel::load`].
    pub fn load_with(
        source: &ModelSource,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        Self::load_built(source, &mut |src, cfg| {
            Transformer::load(src, cfg, comm.clone())
        })
    }

    /// Loads rank `rank`'s share of `source` split as `layout` (stage `i` holding
    /// `stage_sizes[i]` layers, or an even split, and a mixture of experts' routed experts
    /// cut as `experts` says); `tp` is the communicator of the rank's pipeline stage.
    /// Returns the model and what every rank holds.
    ///
    /// # Errors
    /// As [`LoadedModel::load`], or when the model cannot be split that way.
    pub fn load_split(
        source: &ModelSource,
        layout: Layout,
        stage_sizes: Option<&[usize]>,
        experts: ExpertSplit,
        rank: usize,
        tp: Arc<dyn Communicator>,
    ) -> Result<(Self, Vec<ShardPlan>), EngineError> {
        let (model, plans, _) =
            Self::split_from(None, source, layout, stage_sizes, experts, rank, tp)?;
        Ok((model, plans))
    }

    /// [`LoadedModel::load_split`] of the same file as `old`, sharing the loaded weights of
    /// `old`'s share that rank `rank`'s new share holds too and reading only what it adds
    /// ([`Transformer::regrow`]); the rest of `old` goes when `old` is dropped.
    ///
    /// # Errors
    /// As [`LoadedModel::load_split`].
    #[allow(clippy::too_many_arguments)]
    pub fn regrow_split(
        old: &LoadedModel,
        source: &ModelSource,
        layout: Layout,
        stage_sizes: Option<&[usize]>,
        experts: ExpertSplit,
        rank: usize,
        tp: Arc<dyn Communicator>,
    ) -> Result<(Self, Vec<ShardPlan>, Reuse), EngineError> {
        Self::split_from(Some(old), source, layout, stage_sizes, experts, rank, tp)
    }

    /// Rank `rank`'s share of `source` split as `layout`, regrown from `old`'s share when
    /// given, else read whole; the model, every rank's plan and what was kept.
    #[allow(clippy::too_many_arguments)]
    fn split_from(
        old: Option<&LoadedModel>,
        source: &ModelSource,
        layout: Layout,
        stage_sizes: Option<&[usize]>,
        experts: ExpertSplit,
        rank: usize,
        tp: Arc<dyn Communicator>,
    ) -> Result<(Self, Vec<ShardPlan>, Reuse), EngineError> {
        let mut plans = Vec::new();
        let mut reuse = Reuse::default();
        let model = Self::load_built(source, &mut |src, cfg| {
            plans = shard::plan(&cfg, src, layout, stage_sizes, experts)?;
            let plan = plans
                .get(rank)
                .cloned()
                .ok_or_else(|| EngineError::InvalidInput {
                    what: format!("rank {rank} in a split of {} ranks", layout.world()),
                })?;
            match old {
                Some(old) => {
                    let (t, r) = old.transformer.regrow(src, cfg, plan, tp.clone())?;
                    reuse = r;
                    Ok(t)
                }
                None => {
                    reuse.layers_loaded = plan.layers.len();
                    Transformer::load_shard(src, cfg, plan, tp.clone())
                }
            }
        })?;
        Ok((model, plans, reuse))
    }

    fn load_built(source: &ModelSource, build: &mut Builder<'_>) -> Result<Self, EngineError> {
        match source {
            ModelSource::Gguf(p) => Self::load_gguf(p, build),
            ModelSource::HfFolder(p) => Self::load_hf(source, p, build),
        }
    }

    fn load_gguf(path: &Path, build: &mut Builder<'_>) -> Result<Self, EngineError> {
        let file = GgufFile::open(path)?;
        let label = path.display().to_string();
        let md = file.metadata();
        let tokenizer = Tokenizer::from_gguf(md)
            .map_err(|e| EngineError::Tokenizer(format!("{label}: {e}")))?;
        let cfg = arch::config_of_file(&file, &label)?;
        let template = match md.opt_str("tokenizer.chat_template")? {
            Some(src) => Some(
                Self::template(src, &tokenizer)
                    .map_err(|e| EngineError::Tokenizer(format!("{label}: chat template: {e}")))?,
            ),
            None => None,
        };
        let spec = crate::arch::spec(cfg.arch);
        let weight_bytes_per_token = per_token_bytes(&file, spec, &cfg);
        let weight_bytes_by_op = per_op_bytes(&file, spec, &cfg);
        let src = GgufWeights::new(file);
        let transformer = build(&src, cfg)?;
        Ok(LoadedModel {
            name: file_name(path),
            path: path.to_path_buf(),
            transformer,
            tokenizer,
            chat_template: template,
            weight_bytes_per_token,
            weight_bytes_by_op,
        })
    }

    fn load_hf(
        source: &ModelSource,
        dir: &Path,
        build: &mut Builder<'_>,
    ) -> Result<Self, EngineError> {
        let label = dir.display().to_string();
        let config_path = source.config_json().ok_or_else(|| EngineError::Load {
            what: format!("{label}: no config.json"),
        })?;
        let text = std::fs::read_to_string(&config_path).map_err(|e| EngineError::Load {
            what: format!("{}: {e}", config_path.display()),
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| EngineError::Load {
                what: format!("{}: not valid JSON: {e}", config_path.display()),
            })?;
        let cfg = arch::config_from_hf(&json, &label)?;
        let tok_path = source.tokenizer_json().ok_or_else(|| {
            EngineError::Tokenizer(format!("{label}: no tokenizer.json beside config.json"))
        })?;
        let tokenizer = Tokenizer::from_tokenizer_json(&tok_path).map_err(tok_err)?;
        let template = read_hf_template(dir)
            .map(|src| {
                Self::template(&src, &tokenizer)
                    .map_err(|e| EngineError::Tokenizer(format!("{label}: chat template: {e}")))
            })
            .transpose()?;
        let files = source.safetensors_files().map_err(|e| EngineError::Load {
            what: e.to_string(),
        })?;
        let naming = HfNaming::for_config(&cfg);
        let src = SafetensorsWeights::open(&files, naming)?;
        let weight_bytes_per_token = files
            .iter()
            .filter_map(|f| std::fs::metadata(f).ok())
            .map(|m| m.len())
            .sum();
        let transformer = build(&src as &dyn WeightSource, cfg)?;
        Ok(LoadedModel {
            name: file_name(dir),
            path: dir.to_path_buf(),
            transformer,
            tokenizer,
            chat_template: template,
            weight_bytes_per_token,
            weight_bytes_by_op: Vec::new(),
        })
    }

    fn template(
        src: &str,
        tok: &Tokenizer,
    ) -> Result<ChatTemplate, shoal_model::chat_template::TemplateError> {
        let piece = |id: Option<u32>| id.and_then(|i| tok.token_str(i)).unwrap_or("").to_string();
        ChatTemplate::new(src, &piece(tok.bos_id()), &piece(tok.eos_id()))
    }

    /// Uses the chat template `source` (Jinja) instead of the one the model's files carry.
    ///
    /// # Errors
    /// When the template does not parse.
    pub fn set_chat_template(&mut self, source: &str) -> Result<(), EngineError> {
        let t = Self::template(source, &self.tokenizer)
            .map_err(|e| EngineError::Tokenizer(format!("chat template: {e}")))?;
        self.chat_template = Some(t);
        Ok(())
    }

    /// Prompt tokens for raw text to continue: BOS when the model asks for it, special-token
    /// text taken literally (as llama.cpp's completion does).
    ///
    /// # Errors
    /// When tokenization fails.
    pub fn raw_prompt(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.tokenizer.encode(text, true, false).map_err(tok_err)
    }

    /// Renders `messages` (OpenAI-style JSON) through the chat template with the generation
    /// prompt, and tokenizes the result with special tokens parsed.
    ///
    /// # Errors
    /// When the model has no chat template, the template fails, or tokenization fails.
    pub fn chat_prompt(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<Vec<u32>, EngineError> {
        let text = self.render_chat(messages, tools, None)?;
        self.tokenize_chat(&text, &[])
            .map(|p| p.unwrap_or_default())
    }

    /// The text of `messages` (OpenAI-style JSON) rendered through the chat template with the
    /// generation prompt; `extra` is the template's keyword arguments (a JSON object, such as
    /// `{"enable_thinking": false}`).
    ///
    /// # Errors
    /// When the model has no chat template or the template fails.
    pub fn render_chat(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        extra: Option<&serde_json::Value>,
    ) -> Result<String, EngineError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| EngineError::Unsupported {
                what: format!(
                    "{} has no chat template; use --raw to give it text to continue",
                    self.name
                ),
            })?;
        template
            .render(&RenderInput {
                messages,
                tools,
                add_generation_prompt: true,
                extra,
            })
            .map_err(|e| EngineError::Tokenizer(format!("chat template: {e}")))
    }

    /// The tokens of a rendered chat prompt ([`LoadedModel::render_chat`]), special tokens
    /// parsed, with known token runs spliced in: each `(marker, ids)` marker text, written
    /// into a message's content, is replaced by `ids` as they are, and the text between
    /// markers is tokenized piece by piece. This is how a turn the model generated is given
    /// back to it token for token (a tokenizer may well merge generated text differently).
    /// `Ok(None)` when a marker does not appear exactly once in `text`, in order (a template
    /// that rewrites content).
    ///
    /// # Errors
    /// When tokenization fails.
    pub fn tokenize_chat(
        &self,
        text: &str,
        splices: &[(String, Vec<u32>)],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        // A template that writes the BOS text itself must not get a second BOS.
        let bos_text = self
            .tokenizer
            .bos_id()
            .and_then(|b| self.tokenizer.token_str(b));
        let add_bos = !bos_text.is_some_and(|b| !b.is_empty() && text.starts_with(b));
        let mut rest = text;
        let mut out = Vec::new();
        for (i, (marker, ids)) in splices.iter().enumerate() {
            let Some(at) = rest.find(marker.as_str()) else {
                return Ok(None);
            };
            let before = &rest[..at];
            out.extend(
                self.tokenizer
                    .encode(before, add_bos && i == 0, true)
                    .map_err(tok_err)?,
            );
            out.extend_from_slice(ids);
            rest = &rest[at + marker.len()..];
        }
        if splices.iter().any(|(m, _)| rest.contains(m.as_str())) {
            return Ok(None);
        }
        out.extend(
            self.tokenizer
                .encode(rest, add_bos && splices.is_empty(), true)
                .map_err(tok_err)?,
        );
        Ok(Some(out))
    }

    /// A KV cache for up to `ctx` tokens (at most the model's trained context).
    pub fn new_cache(&self, ctx: usize) -> KvCache {
        self.transformer
            .new_cache(ctx.min(self.transformer.config().context_len).max(1))
    }
}

/// The chat template of a Hugging Face folder: `chat_template.jinja`, or the
/// `chat_template` field of `tokenizer_config.json` (a string, or the `default` entry of a
/// list of named templates).
fn read_hf_template(dir: &Path) -> Option<String> {
    if let Ok(s) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
        return Some(s);
    }
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    match json.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    }
}

/// The profile's matrix-product op that reads a block tensor of `role`.
fn op_of_role(role: Role) -> Option<Op> {
    Some(match role {
        Role::AttnQ
        | Role::AttnK
        | Role::AttnV
        | Role::AttnQA
        | Role::AttnQB
        | Role::AttnKvAMqa => Op::Qkv,
        Role::AttnKB | Role::AttnVB | Role::AttnKvB => Op::Attention,
        Role::AttnOut => Op::AttnOut,
        Role::FfnGate
        | Role::FfnUp
        | Role::FfnGateExps
        | Role::FfnUpExps
        | Role::FfnGateShexp
        | Role::FfnUpShexp => Op::GateUp,
        Role::FfnDown | Role::FfnDownExps | Role::FfnDownShexp => Op::Down,
        Role::FfnGateInp => Op::Router,
        _ => return None,
    })
}

/// Bytes per token each matrix-product op reads: the block tensors by role (the
/// architecture's table; routed experts at the share a token reads, see
/// [`read_per_token`]), and the output head as [`per_token_bytes`] counts it.
fn per_op_bytes(file: &GgufFile, spec: &ArchSpec, cfg: &ModelConfig) -> Vec<(Op, u64)> {
    let mut by_op: Vec<(Op, u64)> = Vec::new();
    let mut add = |op: Op, n: u64| match by_op.iter_mut().find(|(o, _)| *o == op) {
        Some((_, total)) => *total += n,
        None => by_op.push((op, n)),
    };
    for t in file.tensors() {
        let Some((entry, Some(_))) = spec.entry(&t.name) else {
            continue;
        };
        if let Some(op) = op_of_role(entry.role) {
            add(op, read_per_token(cfg, entry.role, t.size));
        }
    }
    if let Some(head) = head_bytes(file) {
        add(Op::Head, head);
    }
    by_op
}

/// Bytes of a tensor of `role` (`size` bytes as stored) that one decoded token reads: all
/// of it, or for a tensor of every routed expert the share of its experts a token uses.
pub(crate) fn read_per_token(cfg: &ModelConfig, role: Role, size: u64) -> u64 {
    match &cfg.moe {
        Some(m) if role.is_routed_expert() && m.n_expert > 0 => {
            (u128::from(size) * m.n_expert_used as u128 / m.n_expert as u128) as u64
        }
        _ => size,
    }
}

/// Bytes of the output head: `output.weight`, or the token embedding it is tied to.
fn head_bytes(file: &GgufFile) -> Option<u64> {
    file.tensor("output.weight")
        .or_else(|_| file.tensor("token_embd.weight"))
        .map(|t| t.size)
        .ok()
}

/// Bytes read from weights for one decoded token: every tensor of the blocks the model
/// runs (routed experts at the share a token reads) plus the output head (the embedding
/// when tied). The embedding lookup itself reads one row and is ignored.
fn per_token_bytes(file: &GgufFile, spec: &ArchSpec, cfg: &ModelConfig) -> u64 {
    let blocks: u64 = file
        .tensors()
        .iter()
        .filter(|t| crate::arch::layer_of(&t.name).is_none_or(|l| l < cfg.n_layer))
        .filter_map(|t| match spec.entry(&t.name) {
            Some((entry, Some(_))) => Some(read_per_token(cfg, entry.role, t.size)),
            _ => crate::arch::layer_of(&t.name).map(|_| t.size),
        })
        .sum();
    blocks + head_bytes(file).unwrap_or(0)
}
