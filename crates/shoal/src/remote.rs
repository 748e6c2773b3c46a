//! `shoal run --url` and `shoal chat --url`: the same commands answered by a running node
//! (`shoal serve`) through its OpenAI-compatible API instead of a model loaded here. The
//! sampling options travel as request fields (vLLM's `top_k`, `min_p`,
//! `repetition_penalty` and `ignore_eos` beside OpenAI's own), text streams to stdout as it
//! arrives, a thinking model's reasoning (`reasoning_content`) to stderr, statistics go to
//! stderr.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

use serde_json::{json, Value};

use crate::client::{for_each_event, Client, ClientArgs};
use crate::run::SamplingArgs;

/// What one streamed answer cost.
struct Answer {
    text: String,
    reasoning: String,
    prompt_tokens: u64,
    completion_tokens: u64,
    first: Option<f64>,
    total: f64,
}

fn sampling_fields(s: &SamplingArgs, body: &mut Value) -> anyhow::Result<()> {
    body["max_tokens"] = json!(s.max_tokens);
    body["temperature"] = json!(s.temp.unwrap_or(0.7));
    body["top_k"] = json!(s.top_k);
    body["top_p"] = json!(s.top_p);
    body["min_p"] = json!(s.min_p);
    body["repetition_penalty"] = json!(s.repeat_penalty);
    if let Some(seed) = s.seed {
        body["seed"] = json!(seed);
    }
    if !s.stop.is_empty() {
        body["stop"] = json!(s.stop);
    }
    if s.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    if let Some(schema) = s.schema()? {
        body["response_format"] = json!({
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        });
    }
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    Ok(())
}

/// Streams one request's text to stdout.
fn stream(client: &Client, path: &str, body: &Value, chat: bool) -> anyhow::Result<Answer> {
    let t0 = Instant::now();
    let reader = client.post_stream(path, body)?.into_reader();
    let mut out = Answer {
        text: String::new(),
        reasoning: String::new(),
        prompt_tokens: 0,
        completion_tokens: 0,
        first: None,
        total: 0.0,
    };
    let mut stdout = std::io::stdout().lock();
    let dim = std::io::stderr().is_terminal();
    for_each_event(reader, |v| {
        let reasoning = v["choices"][0]["delta"]["reasoning_content"].as_str();
        if let Some(r) = reasoning.filter(|r| chat && !r.is_empty()) {
            out.first.get_or_insert(t0.elapsed().as_secs_f64());
            let mut err = std::io::stderr().lock();
            if dim {
                write!(err, "\x1b[2m{r}\x1b[0m")?;
            } else {
                err.write_all(r.as_bytes())?;
            }
            out.reasoning.push_str(r);
        }
        let piece = if chat {
            v["choices"][0]["delta"]["content"].as_str()
        } else {
            v["choices"][0]["text"].as_str()
        };
        if let Some(p) = piece.filter(|p| !p.is_empty()) {
            if out.text.is_empty() && !out.reasoning.is_empty() {
                eprintln!();
            }
            out.first.get_or_insert(t0.elapsed().as_secs_f64());
            stdout.write_all(p.as_bytes())?;
            stdout.flush()?;
            out.text.push_str(p);
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
            out.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
        }
        Ok(())
    })?;
    out.total = t0.elapsed().as_secs_f64();
    Ok(out)
}

fn report(a: &Answer, url: &str) {
    // the rate runs from the first text to the end; when the text came all at once (or
    // there was none: tokens without text), from the request
    let (first, rate) = match a.first {
        Some(f) if a.total - f > 1e-3 => (
            format!("first text after {:.0} ms", f * 1e3),
            a.completion_tokens.saturating_sub(1) as f64 / (a.total - f),
        ),
        Some(f) => (
            format!("first text after {:.0} ms", f * 1e3),
            a.completion_tokens as f64 / a.total.max(1e-3),
        ),
        None => (
            "no text".to_string(),
            a.completion_tokens as f64 / a.total.max(1e-3),
        ),
    };
    eprintln!(
        "prompt: {} tokens, {first} | generation: {} tokens, {rate:.1} tok/s | on {url}",
        a.prompt_tokens, a.completion_tokens,
    );
}

/// The model id to ask the node at `c` for, given MODEL as the user typed it: MODEL itself,
/// unless it is a path (here, or a `.gguf` name) or a store name (`ollama:`, `lmstudio:`,
/// `hf:`), as `shoal load` takes them; then the id of the node's one instance of that model
/// (so an instance loaded with `--id` is found), else the name a node serves it by
/// ([`shoal_driver::model_id`]).
fn model_on_node(c: &Client, model: &str) -> String {
    let path_like =
        std::path::Path::new(model).exists() || model.to_ascii_lowercase().ends_with(".gguf");
    if !path_like && !shoal_model::stores::has_store_prefix(model) {
        return model.to_string();
    }
    let name = shoal_driver::model_id(model);
    if let Ok(table) = c.get("/cluster/instances") {
        let ids: Vec<&str> = table["instances"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|i| i["model"] == name.as_str())
                    .filter_map(|i| i["id"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        if let [one] = ids[..] {
            return one.to_string();
        }
    }
    name
}

/// `shoal run MODEL PROMPT --url URL`.
pub fn run(
    client: &ClientArgs,
    model: &str,
    prompt: &str,
    system: Option<&str>,
    raw: bool,
    think: bool,
    sampling: &SamplingArgs,
) -> anyhow::Result<()> {
    let c = Client::new(client);
    let model = &model_on_node(&c, model);
    let (path, mut body) = if raw {
        ("/v1/completions", json!({"model": model, "prompt": prompt}))
    } else {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.push(json!({"role": "user", "content": prompt}));
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": messages}),
        )
    };
    sampling_fields(sampling, &mut body)?;
    if !think && !raw {
        body["reasoning_effort"] = json!("none");
    }
    let a = stream(&c, path, &body, !raw)?;
    if !raw {
        println!();
    }
    report(&a, &client.url);
    Ok(())
}

/// `shoal chat MODEL --url URL`: the conversation is kept here and sent whole each turn.
pub fn chat(
    client: &ClientArgs,
    model: &str,
    system: Option<&str>,
    think: bool,
    sampling: &SamplingArgs,
) -> anyhow::Result<()> {
    let c = Client::new(client);
    let model = &model_on_node(&c, model);
    let mut messages: Vec<Value> = Vec::new();
    if let Some(s) = system {
        messages.push(json!({"role": "system", "content": s}));
    }
    eprintln!(
        "chatting with {model} on {} — /reset clears the conversation, /exit or Ctrl-D quits",
        client.url
    );
    let mut lines = std::io::stdin().lock().lines();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let Some(line) = lines.next() else { break };
        let line = line?;
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|m| m["role"] == "system");
                eprintln!("(conversation cleared)");
                continue;
            }
            text => messages.push(json!({"role": "user", "content": text})),
        }
        let mut body = json!({"model": model, "messages": messages});
        sampling_fields(sampling, &mut body)?;
        if !think {
            body["reasoning_effort"] = json!("none");
        }
        match stream(&c, "/v1/chat/completions", &body, true) {
            Ok(a) => {
                println!();
                let mut turn = json!({"role": "assistant", "content": a.text});
                if !a.reasoning.is_empty() {
                    turn["reasoning_content"] = json!(a.reasoning);
                }
                messages.push(turn);
            }
            Err(e) => {
                messages.pop();
                eprintln!("error: {e:#}");
            }
        }
    }
    Ok(())
}
