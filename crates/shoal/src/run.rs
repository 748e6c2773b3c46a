//! `shoal run MODEL PROMPT`: one answer, streamed to stdout as it is generated; prompt and
//! generation speed on stderr. With `--raw` the prompt is text to continue and stdout
//! carries only the continuation.

use std::io::Write;

use clap::Args;
use shoal_engine::generate::GenerateParams;
use shoal_engine::{Sampler, SamplerConfig};

use crate::ComputeArgs;

/// Sampling and length options shared by `run` and `chat`.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    pub max_tokens: usize,
    /// Temperature (default 0.7); 0 is greedy (deterministic).
    #[arg(long)]
    pub temp: Option<f32>,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens below this fraction of the best one's probability (0 = off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalty for repeating recent tokens (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Context size in tokens (default: the model's, at most 4096).
    #[arg(long)]
    pub ctx: Option<usize>,
}

impl SamplingArgs {
    pub fn sampler(&self, default_temp: f32) -> anyhow::Result<Sampler> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let cfg = SamplerConfig {
            temperature: self.temp.unwrap_or(default_temp),
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: 64,
            seed,
        };
        cfg.validate().map_err(anyhow::Error::msg)?;
        Ok(Sampler::new(cfg))
    }

    pub fn params(&self) -> GenerateParams {
        GenerateParams {
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
        }
    }

    pub fn ctx(&self) -> usize {
        self.ctx.unwrap_or(4096)
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A GGUF file, a Hugging Face folder or cache id, or a fetched catalog key.
    pub model: String,
    /// The prompt (a user message, or with --raw the text to continue).
    pub prompt: String,
    /// No chat template: the prompt is text to continue.
    #[arg(long)]
    pub raw: bool,
    /// A system message to put before the prompt.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

pub fn main(args: RunArgs) -> anyhow::Result<()> {
    let threads = args.compute.apply()?;
    let model = crate::models::open(&args.model)?;
    let prompt = if args.raw {
        model.raw_prompt(&args.prompt)?
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": args.prompt}));
        model.chat_prompt(&messages, None)?
    };
    let ctx = args
        .sampling
        .ctx()
        .max(prompt.len() + args.sampling.max_tokens);
    let mut cache = model.new_cache(ctx);
    let mut sampler = args.sampling.sampler(0.7)?;
    let mut stdout = std::io::stdout().lock();
    let mut write_err = None;
    let gen = model.generate(
        &prompt,
        &mut cache,
        &mut sampler,
        &args.sampling.params(),
        &mut |text| match stdout
            .write_all(text.as_bytes())
            .and_then(|_| stdout.flush())
        {
            Ok(()) => true,
            Err(e) => {
                write_err = Some(e);
                false
            }
        },
    )?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    if !args.raw {
        writeln!(stdout)?;
    }
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | {} thread(s)",
        gen.prompt_tokens,
        gen.prefill_tok_s(),
        gen.tokens.len(),
        gen.decode_tok_s(),
        threads
    );
    Ok(())
}
