//! `shoal chat MODEL`: an interactive multi-turn conversation in the terminal. Each turn
//! re-renders the whole conversation through the chat template, but only the tokens after
//! the part the KV cache already holds are run again.

use std::io::{BufRead, Write};

use clap::Args;

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
}

/// Length of the common prefix of two token sequences.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

pub fn main(args: ChatArgs) -> anyhow::Result<()> {
    if let Some(url) = &args.url {
        let client = crate::client::ClientArgs {
            url: url.clone(),
            key: args.key.clone(),
        };
        return crate::remote::chat(&client, &args.model, args.system.as_deref(), &args.sampling);
    }
    args.compute.apply()?;
    let model = crate::models::open(&args.model)?;
    if model.chat_template.is_none() {
        anyhow::bail!(
            "{} has no chat template (a base model?); use `shoal run --raw` to continue text",
            model.name
        );
    }
    let mut cache = model.new_cache(args.sampling.ctx());
    let mut sampler = args.sampling.sampler(0.7)?;
    let params = args.sampling.params();
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    // Tokens the cache holds, in order.
    let mut cached: Vec<u32> = Vec::new();
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
                cache.clear();
                cached.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        messages.push(serde_json::json!({"role": "user", "content": text}));
        let prompt = model.chat_prompt(&messages, None)?;
        if prompt.is_empty() {
            anyhow::bail!("the chat template rendered an empty prompt");
        }
        if prompt.len() + params.max_tokens > cache.capacity() {
            eprintln!(
                "(the conversation no longer fits the context of {} tokens; use /reset)",
                cache.capacity()
            );
            messages.pop();
            continue;
        }
        // Reuse the cached prefix; keep at least one token to run so there are logits.
        let keep = common_prefix(&cached, &prompt).min(prompt.len() - 1);
        cache.truncate(keep);
        let mut stdout = std::io::stdout().lock();
        let gen = model.generate_continuing(
            &prompt[..keep],
            &prompt[keep..],
            &mut cache,
            &mut sampler,
            &params,
            &mut |t| {
                stdout
                    .write_all(t.as_bytes())
                    .and_then(|_| stdout.flush())
                    .is_ok()
            },
        )?;
        writeln!(stdout)?;
        cached = prompt;
        cached.extend_from_slice(&gen.tokens);
        // The cache holds every generated token but the last one sampled.
        cached.truncate(cache.len());
        messages.push(serde_json::json!({"role": "assistant", "content": gen.text}));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::common_prefix;

    #[test]
    fn prefix() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
    }
}
