//! `shoal chat MODEL`: an interactive multi-turn conversation in the terminal. Each turn
//! re-renders the whole conversation through the chat template and generates through the
//! scheduler `shoal serve` uses (one slot), which keeps the last turn's KV cache and runs
//! only the tokens after the part it already holds. A thinking model's reasoning goes to
//! stderr apart from its answer, and back to the template with its turn as the template
//! expects it (`reasoning_content`).

use std::io::{BufRead, Write};
use std::sync::Arc;

use clap::Args;
use shoal_engine::scheduler::{Scheduler, SchedulerConfig};

use crate::run::SamplingArgs;
use crate::ComputeArgs;

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// A GGUF file, a Hugging Face folder or cache id, or a fetched catalog key.
    pub model: String,
    /// A system message for the conversation.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub compute: ComputeArgs,
    /// Chat with a running node (`shoal serve`) at this URL instead of loading the model here.
    #[arg(long)]
    pub url: Option<String>,
    /// API key for --url (when the node has keys).
    #[arg(long, env = "SHOAL_API_KEY", hide_env_values = true)]
    pub key: Option<String>,
    /// A thinking model answers at once, without reasoning first.
    #[arg(long)]
    pub no_think: bool,
}

pub fn main(args: ChatArgs) -> anyhow::Result<()> {
    if let Some(url) = &args.url {
        let client = crate::client::ClientArgs {
            url: url.clone(),
            key: args.key.clone(),
        };
        return crate::remote::chat(
            &client,
            &args.model,
            args.system.as_deref(),
            !args.no_think,
            &args.sampling,
        );
    }
    args.compute.apply()?;
    crate::rank_device(0, 1)?;
    let model = Arc::new(crate::models::open(&args.model)?);
    if model.chat_template.is_none() {
        anyhow::bail!(
            "{} has no chat template (a base model?); use `shoal run --raw` to continue text",
            model.name
        );
    }
    let ctx = args
        .sampling
        .ctx()
        .min(model.transformer.config().context_len);
    let scheduler = Scheduler::start(
        model.clone(),
        SchedulerConfig {
            max_batch: 1,
            // the last turn's slot is given back just after its end is reported: the next
            // turn waits for it instead of finding the model busy
            max_queue: 1,
            ctx,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )?;
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    eprintln!(
        "chatting with {} — /reset clears the conversation, /exit or Ctrl-D quits",
        model.name
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let Some(line) = lines.next() else { break };
        let line = line?;
        let text = line.trim();
        match text {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|m| m["role"] == "system");
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        messages.push(serde_json::json!({"role": "user", "content": text}));
        let (prompt, splitter) = crate::run::chat_prompt(&model, &messages, !args.no_think)?;
        if prompt.is_empty() {
            anyhow::bail!("the chat template rendered an empty prompt");
        }
        if prompt.len() + args.sampling.max_tokens > ctx {
            eprintln!("(the conversation no longer fits the context of {ctx} tokens; use /reset)");
            messages.pop();
            continue;
        }
        let mut request = args.sampling.request(&model, prompt, 0.7)?;
        request.special_text = splitter.is_some();
        let mut stdout = std::io::stdout().lock();
        let mut output = crate::run::Output::new(splitter);
        scheduler.generate(request, &mut |t| output.push(&mut stdout, t).is_ok())?;
        output.finish(&mut stdout)?;
        writeln!(stdout)?;
        let mut turn = serde_json::json!({"role": "assistant", "content": output.answer});
        if !output.reasoning.is_empty() {
            turn["reasoning_content"] = serde_json::json!(output.reasoning);
        }
        messages.push(turn);
    }
    Ok(())
}
