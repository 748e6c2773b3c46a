//! `shoal run MODEL PROMPT`: one answer, streamed to stdout as it is generated; prompt and
//! generation speed on stderr. With `--raw` the prompt is text to continue and stdout
//! carries only the continuation.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use shoal_engine::generate::{GenerateParams, Generation};
use shoal_engine::model::LoadedModel;
use shoal_engine::parallel::Lead;
use shoal_engine::{Sampler, SamplerConfig};

use crate::ranks::{LeadRank, SplitArgs};
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
    /// Keep generating past end-of-generation tokens, to exactly --max-tokens.
    #[arg(long)]
    pub ignore_eos: bool,
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
            ignore_eos: self.ignore_eos,
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
    #[command(flatten)]
    pub split: SplitArgs,
    /// Ask a running node (`shoal serve`) at this URL instead of loading the model here.
    #[arg(long)]
    pub url: Option<String>,
    /// API key for --url (when the node has keys).
    #[arg(long, env = "SHOAL_API_KEY", hide_env_values = true)]
    pub key: Option<String>,
}

impl RunArgs {
    fn prompt(&self, model: &LoadedModel) -> anyhow::Result<Vec<u32>> {
        Ok(if self.raw {
            model.raw_prompt(&self.prompt)?
        } else {
            let mut messages = Vec::new();
            if let Some(s) = &self.system {
                messages.push(serde_json::json!({"role": "system", "content": s}));
            }
            messages.push(serde_json::json!({"role": "user", "content": self.prompt}));
            model.chat_prompt(&messages, None)?
        })
    }
}

/// Streams generated text to stdout; a write error stops generation and is kept.
fn stdout_sink<'a>(
    stdout: &'a mut std::io::StdoutLock<'static>,
    err: &'a mut Option<std::io::Error>,
) -> impl FnMut(&str) -> bool + 'a {
    move |text| match stdout
        .write_all(text.as_bytes())
        .and_then(|_| stdout.flush())
    {
        Ok(()) => true,
        Err(e) => {
            *err = Some(e);
            false
        }
    }
}

fn report(gen: &Generation, threads: usize, ranks: usize) {
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | {} thread(s){}",
        gen.prompt_tokens,
        gen.prefill_tok_s(),
        gen.tokens.len(),
        gen.decode_tok_s(),
        threads,
        if ranks > 1 {
            format!(" x {ranks} ranks")
        } else {
            String::new()
        }
    );
}

/// `run` split over ranks: rank 0 here, the others started locally or waited for.
fn main_split(args: RunArgs) -> anyhow::Result<()> {
    let threads = args.compute.apply()?;
    let ctx_len = args.sampling.ctx() + args.sampling.max_tokens;
    let mut lead_rank = LeadRank::start(&args.split, &args.model, ctx_len, threads, None)?;
    let capacity = lead_rank.capacity();
    let world = lead_rank.job.tp * lead_rank.job.pp;
    let model = &lead_rank.model;
    let prompt = args.prompt(model)?;
    let mut sampler = args.sampling.sampler(0.7)?;
    let mut lead = Lead::new(lead_rank.ctx.clone(), &model.transformer, capacity)?;
    lead.set_sampler(sampler.config());
    let mut stdout = std::io::stdout().lock();
    let mut write_err = None;
    let gen = model.generate_on(
        &mut lead,
        &prompt,
        &mut sampler,
        &args.sampling.params(),
        &mut stdout_sink(&mut stdout, &mut write_err),
    )?;
    lead.stop()?;
    drop(lead);
    if let Some(mb) = crate::ranks::peak_rss_mb() {
        tracing::info!(rank = 0, peak_rss_mb = mb as u64, "done");
    }
    lead_rank.launched.finish(Duration::from_secs(10));
    if let Some(e) = write_err {
        return Err(e.into());
    }
    if !args.raw {
        writeln!(stdout)?;
    }
    report(&gen, threads, world);
    Ok(())
}

pub fn main(args: RunArgs) -> anyhow::Result<()> {
    if let Some(url) = &args.url {
        if args.split.is_split() {
            anyhow::bail!("--url runs on a node, which places the model itself; drop --tp/--pp");
        }
        let client = crate::client::ClientArgs {
            url: url.clone(),
            key: args.key.clone(),
        };
        return crate::remote::run(
            &client,
            &args.model,
            &args.prompt,
            args.system.as_deref(),
            args.raw,
            &args.sampling,
        );
    }
    if args.split.is_split() {
        return main_split(args);
    }
    let threads = args.compute.apply()?;
    let model = crate::models::open(&args.model)?;
    let prompt = args.prompt(&model)?;
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
        &mut stdout_sink(&mut stdout, &mut write_err),
    )?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    if !args.raw {
        writeln!(stdout)?;
    }
    report(&gen, threads, 1);
    Ok(())
}
