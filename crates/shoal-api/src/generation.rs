//! The one internal request every API adapter produces ([`GenRequest`]) and what running it
//! yields ([`Running`] → [`Out`]): the prompt is rendered through the model's own chat
//! template (tools and tool results included), tokenized, checked against the context, and
//! queued on the model's scheduler; the scheduler's token events come back as text, tool calls
//! parsed in the model family's format, a thinking model's reasoning apart from its answer
//! ([`crate::reasoning`]), and a final reason with usage. Adapters only translate to and from
//! their wire format.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use shoal_engine::scheduler::{Event, SequenceRequest, Ticket, TokenConstraint};
use shoal_engine::stop::FinishReason;
use shoal_engine::SamplerConfig;
use tokio::sync::mpsc;

use crate::error::{ApiError, ErrorKind};
use crate::reasoning::{OutputSplitter, ReasoningFormat, Segment, Thinking};
use crate::relay::Relayed;
use crate::state::{AppState, InstanceView, ServedModel};
use crate::tools::{StreamEvent, ToolCall, ToolStream};

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// JSON schema of its arguments.
    pub parameters: Value,
}

impl Tool {
    /// A tool; no parameter schema means a function without arguments.
    pub fn new(name: String, description: Option<String>, parameters: Option<Value>) -> Self {
        Tool {
            name,
            description,
            parameters: parameters.unwrap_or_else(|| json!({"type": "object", "properties": {}})),
        }
    }
}

/// Whether and which tools the model must call.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// No tool calls (tools are still shown to the model).
    None,
    /// At least one tool call, enforced.
    Required,
    /// A call of this function, enforced.
    Named(String),
}

/// The shape the output must have.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum OutputFormat {
    /// Free text.
    #[default]
    Text,
    /// Any JSON object, enforced.
    JsonObject,
    /// JSON valid against this schema, enforced.
    JsonSchema(Value),
}

/// A chat message in the canonical form the chat templates read (OpenAI's, with tool call
/// arguments as JSON objects).
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// system, developer, user, assistant or tool.
    pub role: String,
    /// The text.
    pub content: String,
    /// Calls an assistant message made.
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: the call it answers.
    pub tool_call_id: Option<String>,
    /// For a tool message: the function's name, when known.
    pub name: Option<String>,
    /// For an assistant message: the reasoning that came before it, when the client sent it
    /// back (templates of thinking models read it as `reasoning_content`).
    pub reasoning: Option<String>,
}

impl Message {
    /// A message with only a role and text.
    pub fn text(role: &str, content: impl Into<String>) -> Self {
        Message {
            role: role.to_string(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            reasoning: None,
        }
    }

    fn to_template(&self) -> Value {
        let mut m = json!({"role": self.role, "content": self.content});
        if !self.tool_calls.is_empty() {
            m["tool_calls"] = self
                .tool_calls
                .iter()
                .map(|c| {
                    json!({"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
        }
        if let Some(id) = &self.tool_call_id {
            m["tool_call_id"] = json!(id);
        }
        if let Some(n) = &self.name {
            m["name"] = json!(n);
        }
        if let Some(r) = &self.reasoning {
            // Qwen3, DeepSeek, GLM and Kimi read the one, gpt-oss the other
            m["reasoning_content"] = json!(r);
            m["thinking"] = json!(r);
        }
        m
    }
}

/// What to run the model on.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A conversation, rendered by the model's chat template.
    Chat {
        /// The messages, oldest first.
        messages: Vec<Message>,
        /// Tools offered.
        tools: Vec<Tool>,
    },
    /// Text to continue as it is.
    Text(String),
}

/// One generation request, whatever API it came from.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The model id asked for.
    pub model: String,
    /// What to run.
    pub input: Input,
    /// Most tokens to generate (`None`: up to the end of the context).
    pub max_tokens: Option<usize>,
    /// Sampling settings (the seed is random when `seed` is `None`).
    pub sampling: SamplerConfig,
    /// The client's seed, if it gave one.
    pub seed: Option<u64>,
    /// OpenAI's presence penalty.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty.
    pub frequency_penalty: f32,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
    /// Tool policy.
    pub tool_choice: ToolChoice,
    /// Output shape.
    pub format: OutputFormat,
    /// Generate through end-of-generation tokens (benchmarks; vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Whether and how a thinking model reasons.
    pub thinking: Thinking,
}

impl GenRequest {
    /// A request for `model` on `input` with greedy sampling and no limits.
    pub fn new(model: impl Into<String>, input: Input) -> Self {
        GenRequest {
            model: model.into(),
            input,
            max_tokens: None,
            sampling: SamplerConfig::default(),
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            stop: Vec::new(),
            logprobs: None,
            tool_choice: ToolChoice::Auto,
            format: OutputFormat::Text,
            ignore_eos: false,
            thinking: Thinking::default(),
        }
    }

    fn tools(&self) -> &[Tool] {
        match &self.input {
            Input::Chat { tools, .. } => tools,
            Input::Text(_) => &[],
        }
    }

    /// Whether the output is held to a shape (a forced tool call or a JSON format).
    fn constrained(&self) -> bool {
        self.format != OutputFormat::Text
            || match &self.tool_choice {
                ToolChoice::Required => !self.tools().is_empty(),
                ToolChoice::Named(_) => true,
                ToolChoice::Auto | ToolChoice::None => false,
            }
    }

    /// The thinking settings the prompt is rendered with: the client's, except that output
    /// held to a shape starts with that shape, so a thinking model does not reason first.
    fn thinking_for_prompt(&self) -> Thinking {
        let mut t = self.thinking.clone();
        if self.constrained() {
            t.enabled = Some(false);
            for k in ["enable_thinking", "thinking"] {
                if t.template_args.contains_key(k) {
                    t.template_args.insert(k.into(), Value::Bool(false));
                }
            }
        }
        t
    }
}

/// Why a generation ended, as the APIs see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End of generation or a stop string.
    Stop,
    /// The token limit or the end of the context.
    Length,
    /// The model called tools.
    ToolCalls,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Of the prompt tokens, those taken from the KV cache of an earlier or running
    /// request instead of run.
    pub cached_tokens: usize,
    /// Of the generated tokens, those of the reasoning.
    pub reasoning_tokens: usize,
    /// From arrival to the first generated token.
    pub time_to_first_token: Duration,
    /// From arrival to the end.
    pub total: Duration,
}

/// One generated token's log-probability, with its text.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's id in the model's vocabulary.
    pub id: u32,
    /// The token's text.
    pub token: String,
    /// Its bytes (the text may be a partial character).
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely alternatives (id, text, bytes, log-probability), best first.
    pub top: Vec<(u32, String, Vec<u8>, f32)>,
}

/// What a running request yields, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// Text to show, with the log-probabilities of the tokens that produced it (when asked).
    Text {
        /// The text.
        text: String,
        /// Per token, when asked for.
        logprobs: Vec<TokenLogprob>,
    },
    /// Reasoning text of a thinking model, before its answer.
    Reasoning(String),
    /// A complete tool call.
    Call {
        /// Its position among this response's calls.
        index: usize,
        /// The call.
        call: ToolCall,
    },
    /// The end.
    Finished {
        /// Why.
        reason: Finish,
        /// The stop string that ended it, if one did.
        stop: Option<String>,
        /// Token counts.
        usage: Usage,
    },
    /// The request failed after it started; the message says why.
    Failed(String),
}

/// A request queued or running on a model.
pub struct Running {
    /// The model serving it.
    pub model: Arc<ServedModel>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Unix seconds at creation.
    pub created: u64,
    state: Arc<AppState>,
    rx: mpsc::UnboundedReceiver<Event>,
    _ticket: Ticket,
    /// Cuts the output into reasoning and answer, for a model that reasons.
    splitter: Option<OutputSplitter>,
    /// Finds tool calls in the reasoning (a model may call a tool without closing it).
    reasoning_parser: Option<ToolStream>,
    /// Tokens generated inside the reasoning.
    reasoning_tokens: usize,
    /// Finds tool calls in the answer.
    parser: Option<ToolStream>,
    calls: usize,
    logprobs: bool,
    pending: std::collections::VecDeque<Out>,
    /// When the request arrived, and when its last token came.
    arrived: Instant,
    last_token: Instant,
    /// From arrival to the first token, once it came.
    first_token: Option<Duration>,
    done: bool,
    /// What it was queued with.
    submitted: Submitted,
    /// The tokens generated so far (what a resumed request goes on after).
    generated: Vec<u32>,
    /// How many times it went on after its instance lost a node.
    resumed: usize,
    /// The text and calls shown to the client so far (kept with the generated text when a
    /// chat turn ends, see [`crate::turns`]).
    shown: String,
    shown_calls: Vec<ToolCall>,
    /// Whether an entry node relays the stream: each token's output is followed by its mark
    /// ([`crate::relay`]).
    marks: bool,
    /// Tokens still to come that another lead already sent (a request taken over): their
    /// output updates every state but is not shown again.
    replaying: usize,
    /// How many of the first `pending` outputs are such replayed output.
    replayed_pending: usize,
    /// The token whose mark follows once `pending` is empty.
    mark_after: Option<u32>,
}

/// What [`Running::next_item`] yields: an output, one already shown by a lead that died, or
/// a token's mark.
enum Item {
    Out(Out),
    Replayed(Out),
    Mark(u32),
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("model", &self.model.id)
            .field("prompt_tokens", &self.prompt_tokens)
            .finish()
    }
}

/// A finished request collected whole.
#[derive(Debug, Clone, PartialEq)]
pub struct Completed {
    /// The reasoning, for a thinking model (empty when it gave none).
    pub reasoning: String,
    /// The text (outside tool calls).
    pub text: String,
    /// The tool calls.
    pub calls: Vec<ToolCall>,
    /// Why it ended.
    pub reason: Finish,
    /// The stop string that ended it, if one did.
    pub stop: Option<String>,
    /// Token counts.
    pub usage: Usage,
    /// Per-token log-probabilities, when asked for.
    pub logprobs: Vec<TokenLogprob>,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Stop strings one request may give at most (every generated token is matched against
/// each).
pub const MAX_STOPS: usize = 16;
/// The longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// Renders, tokenizes and queues `req`, on the bounded pool of prompt workers
/// ([`PromptPool`]), never on the async workers.
///
/// # Errors
/// 404 for an unknown model, 400 for a request the model cannot take (no chat template, a
/// prompt longer than the context, by its bytes or its tokens, bad sampling values, a bad
/// schema), 503 when the queue or the prompt workers' queue is full.
pub async fn start(state: &Arc<AppState>, req: GenRequest) -> Result<Running, ApiError> {
    let arrived = Instant::now();
    // the slot goes with the work: a client that leaves does not free it while its prompt is
    // still being prepared
    let slot = state.prompts.enter().await?;
    let st = state.clone();
    let relayed = crate::relay::Relayed::current();
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        prepare(&st, req, arrived, relayed)
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the prompt stopped: {e}")))?
}

/// Prompts prepared at once, off the async workers (rendering, tokenizing and compiling a
/// constraint can take seconds on a hostile input, and the async workers also answer
/// `/health` and carry the cluster's routes).
pub const PROMPT_WORKERS: usize = 2;
/// Requests that may wait for a prompt worker; beyond that a 503.
pub const PROMPT_QUEUE: usize = 64;

/// The bounded pool that prepares prompts: [`PROMPT_WORKERS`] at once, [`PROMPT_QUEUE`]
/// waiting.
#[derive(Debug)]
pub struct PromptPool {
    workers: Arc<tokio::sync::Semaphore>,
    waiting: std::sync::atomic::AtomicUsize,
}

impl Default for PromptPool {
    fn default() -> Self {
        PromptPool {
            workers: Arc::new(tokio::sync::Semaphore::new(PROMPT_WORKERS)),
            waiting: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

impl PromptPool {
    /// A worker's slot, once one is free.
    ///
    /// # Errors
    /// 503 when [`PROMPT_QUEUE`] requests are already waiting.
    async fn enter(&self) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
        use std::sync::atomic::Ordering::SeqCst;
        if let Ok(p) = self.workers.clone().try_acquire_owned() {
            return Ok(p);
        }
        if self.waiting.fetch_add(1, SeqCst) >= PROMPT_QUEUE {
            self.waiting.fetch_sub(1, SeqCst);
            return Err(ApiError::new(
                ErrorKind::Overloaded,
                format!("{PROMPT_QUEUE} prompts are waiting to be prepared; retry shortly"),
            ));
        }
        let p = self.workers.clone().acquire_owned().await;
        self.waiting.fetch_sub(1, SeqCst);
        p.map_err(|_| ApiError::internal("the prompt workers stopped"))
    }
}

/// The bytes of text `input` carries that every chat template writes into the prompt: the
/// raw prompt, or the users' messages and the tools' results (a template may leave out a
/// system message, earlier reasoning or the tool list, never these).
fn input_bytes(input: &Input) -> usize {
    match input {
        Input::Text(t) => t.len(),
        Input::Chat { messages, .. } => messages
            .iter()
            .filter(|m| m.role == "user" || m.role == "tool")
            .map(|m| m.content.len())
            .sum(),
    }
}

/// [`start`]'s work on a prompt worker: checks, renders, tokenizes and queues `req`.
fn prepare(
    state: &Arc<AppState>,
    mut req: GenRequest,
    arrived: Instant,
    relayed: Option<Relayed>,
) -> Result<Running, ApiError> {
    let served = state.model(&req.model)?;
    let resume = relayed
        .as_ref()
        .map(|r| r.resume.clone())
        .unwrap_or_default();
    let vocab = served.scheduler.model().tokenizer.vocab_size();
    if let Some(bad) = resume.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid(format!(
            "the {} header names token {bad}, outside {}'s vocabulary of {vocab} tokens",
            crate::relay::RESUME,
            served.id
        )));
    }
    fits_by_length(&served, &req.input).inspect_err(|_| state.metrics.too_long(&served.id))?;
    if req.stop.len() > MAX_STOPS || req.stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid_param(
            "stop",
            format!("give at most {MAX_STOPS} stop strings of at most {MAX_STOP_BYTES} bytes each"),
        ));
    }
    let splices = match &mut req.input {
        Input::Chat { messages, .. } => state.turns.restore(&served.id, messages),
        Input::Text(_) => Vec::new(),
    };
    let model = served.scheduler.model().clone();
    let tools = req.tools();
    if let ToolChoice::Named(name) = &req.tool_choice {
        if !tools.iter().any(|t| &t.name == name) {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!("tool_choice names function '{name}', which is not among the tools"),
            ));
        }
    }
    if matches!(req.tool_choice, ToolChoice::Required) && tools.is_empty() {
        return Err(ApiError::invalid_param(
            "tool_choice",
            "tool_choice is 'required' but no tools were given",
        ));
    }
    let thinking = req.thinking_for_prompt();
    let (prompt, in_reasoning) =
        prompt_of(&model, served.reasoning, &req.input, &splices, &thinking)?;
    if tracing::enabled!(tracing::Level::TRACE) {
        let text = model.tokenizer.decode(&prompt, false);
        tracing::trace!(model = %served.id, tokens = prompt.len(), %text, "prompt");
    }
    let ctx = served.ctx;
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty"));
    }
    if prompt.len() >= ctx {
        let field = match req.input {
            Input::Chat { .. } => "messages",
            Input::Text(_) => "prompt",
        };
        // Anthropic's wording, which clients parse to know by how much to shorten
        let mut e = ApiError::new(
            crate::error::ErrorKind::ContextLength,
            format!(
                "prompt is too long: {} tokens > {} maximum ({} is served with a context of \
                 {ctx} tokens, prompt plus output; shorten the prompt)",
                prompt.len(),
                ctx - 1,
                served.id
            ),
        );
        e.param = Some(field.to_string());
        state.metrics.too_long(&served.id);
        return Err(e);
    }
    let room = ctx - prompt.len();
    let max_tokens = match req.max_tokens {
        Some(0) => {
            return Err(ApiError::invalid_param(
                "max_tokens",
                "max_tokens must be at least 1",
            ))
        }
        Some(n) => n.min(room),
        None => room,
    };
    let mut sampling = req.sampling.clone();
    sampling.seed = req.seed.unwrap_or_else(rand::random);
    sampling
        .validate()
        .map_err(|e| ApiError::invalid(format!("bad sampling setting: {e}")))?;
    let tools_active = !tools.is_empty() && req.tool_choice != ToolChoice::None;
    let prompt_tokens = prompt.len();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    let tool_parser = || {
        ToolStream::new(served.tool_format, &names)
            .with_schemas(tools.iter().map(|t| (t.name.as_str(), &t.parameters)))
    };
    let parser = tools_active.then(tool_parser);
    let reasons =
        served.reasoning != ReasoningFormat::None && matches!(req.input, Input::Chat { .. });
    let splitter = reasons
        .then(|| OutputSplitter::for_format(served.reasoning, in_reasoning, &names))
        .flatten();
    let reasoning_parser = (reasons && tools_active).then(tool_parser);
    let submitted = Submitted {
        req,
        prompt,
        max_tokens,
        sampling,
        in_reasoning,
        // reasoning and tool-call markers are control tokens in some families (gpt-oss's
        // channels, Kimi K2's call sections): their parsers must see them
        special_text: splitter.is_some() || parser.is_some(),
    };
    // a request another lead was serving goes on after the tokens its client was sent, their
    // text reported again so that the parsers and the API's stream state catch up
    let replaying = resume.len();
    let (rx, ticket) = submitted.submit(&served, resume, true)?;
    state.metrics.prompt(&served.id, prompt_tokens);
    Ok(Running {
        splitter,
        reasoning_parser,
        reasoning_tokens: 0,
        parser,
        logprobs: submitted.req.logprobs.is_some(),
        model: served,
        prompt_tokens,
        created: unix_now(),
        state: state.clone(),
        rx,
        _ticket: ticket,
        calls: 0,
        pending: Default::default(),
        arrived,
        last_token: arrived,
        first_token: None,
        done: false,
        submitted,
        generated: Vec::new(),
        resumed: usize::from(replaying > 0),
        shown: String::new(),
        shown_calls: Vec::new(),
        marks: relayed.is_some(),
        replaying,
        replayed_pending: 0,
        mark_after: None,
    })
}

/// The prompt tokens of a request, without queueing it (Anthropic's `count_tokens`),
/// counted on the prompt workers like [`start`]'s.
///
/// # Errors
/// 404 for an unknown model, 400 for input the model's template or tokenizer cannot take.
pub async fn count_prompt(state: &Arc<AppState>, req: GenRequest) -> Result<usize, ApiError> {
    let slot = state.prompts.enter().await?;
    let st = state.clone();
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let served = st.model(&req.model)?;
        fits_by_length(&served, &req.input)?;
        let thinking = req.thinking_for_prompt();
        let (prompt, _) = prompt_of(
            served.scheduler.model(),
            served.reasoning,
            &req.input,
            &[],
            &thinking,
        )?;
        Ok(prompt.len())
    })
    .await
    .map_err(|e| ApiError::internal(format!("counting the prompt stopped: {e}")))?
}

/// Refuses, by its length alone and before anything reads it, a text that cannot fit the
/// context whatever its tokens.
fn fits_by_length(served: &ServedModel, input: &Input) -> Result<(), ApiError> {
    let bytes = input_bytes(input);
    let most = served.ctx.saturating_mul(served.longest_token_bytes());
    if bytes <= most {
        return Ok(());
    }
    let mut e = ApiError::new(
        crate::error::ErrorKind::ContextLength,
        format!(
            "prompt is too long: {bytes} bytes, more than {} is served with a context of {} \
             tokens can hold ({most} bytes at most); shorten the prompt",
            served.id, served.ctx
        ),
    );
    e.param = Some(
        match input {
            Input::Chat { .. } => "messages",
            Input::Text(_) => "prompt",
        }
        .to_string(),
    );
    Err(e)
}

/// The tool list as chat templates read it (OpenAI's function shape). A tool without a
/// description gets an empty one: some templates (gpt-oss's) join it to other text, which
/// fails on an undefined value.
fn template_tools(tools: &[Tool]) -> Vec<Value> {
    tools
        .iter()
        .map(|t| {
            let f = json!({"name": t.name, "description": t.description.as_deref().unwrap_or(""),
                           "parameters": t.parameters});
            json!({"type": "function", "function": f})
        })
        .collect()
}

/// Renders and tokenizes `input`, with the turns marked by [`crate::turns`] given their
/// generated tokens (`splices`) and the template switched for `thinking` (see
/// [`crate::reasoning`]); also says whether the output starts inside a reasoning block the
/// prompt opened. A conversation with system messages after its start (Claude Code sends
/// those) keeps them in place; only when the model's template refuses them are they moved
/// into the leading system message, where every template takes one.
fn prompt_of(
    model: &shoal_engine::model::LoadedModel,
    format: ReasoningFormat,
    input: &Input,
    splices: &[(String, Vec<u32>)],
    thinking: &Thinking,
) -> Result<(Vec<u32>, bool), ApiError> {
    let (messages, tools) = match input {
        Input::Text(text) => {
            return model
                .raw_prompt(text)
                .map(|p| (p, false))
                .map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}")))
        }
        Input::Chat { messages, tools } => (messages, tools),
    };
    let tool_values = template_tools(tools);
    let tools_arg = (!tool_values.is_empty()).then_some(&tool_values[..]);
    let extra = thinking.template_args(format);
    let wanted = thinking.wanted();
    let render = |messages: &[Value],
                  splices: &[(String, Vec<u32>)]|
     -> Result<Option<(Vec<u32>, bool)>, shoal_engine::EngineError> {
        let mut text = model.render_chat(messages, tools_arg, extra.as_ref())?;
        let inside = crate::reasoning::settle_prompt(&mut text, format, wanted);
        Ok(model.tokenize_chat(&text, splices)?.map(|p| (p, inside)))
    };
    let render_all = |messages: &[Message]| -> Result<(Vec<u32>, bool), shoal_engine::EngineError> {
        let msgs: Vec<Value> = messages.iter().map(Message::to_template).collect();
        if let Some(p) = render(&msgs, splices)? {
            return Ok(p);
        }
        // the template rewrote a marked turn: render every turn from its generated text
        let unmarked: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut m = m.clone();
                if let Some((_, ids)) = splices.iter().find(|(mark, _)| *mark == m.content) {
                    m.content = model.tokenizer.decode(ids, false);
                }
                m.to_template()
            })
            .collect();
        Ok(render(&unmarked, &[])?.unwrap_or_default())
    };
    let late_system = messages
        .iter()
        .skip(1)
        .any(|m| m.role == "system" || m.role == "developer");
    match render_all(messages) {
        Err(e) if late_system => {
            tracing::info!(error = %e, "the chat template refused system messages after the start; moving them into the first");
            render_all(&system_first(messages))
                .map_err(|e| ApiError::invalid(format!("cannot build the prompt: {e}")))
        }
        r => r.map_err(|e| ApiError::invalid(format!("cannot build the prompt: {e}"))),
    }
}

/// The conversation with every system (or developer) message joined into one leading
/// system message, in order.
fn system_first(messages: &[Message]) -> Vec<Message> {
    let is_system = |m: &&Message| m.role == "system" || m.role == "developer";
    let joined: Vec<&str> = messages
        .iter()
        .filter(is_system)
        .map(|m| m.content.as_str())
        .collect();
    let mut out = vec![Message::text("system", joined.join("\n\n"))];
    out.extend(messages.iter().filter(|m| !is_system(m)).cloned());
    out
}

/// What a request was queued with, kept to queue it again where its instance is placed next
/// when a node it ran on dies.
struct Submitted {
    req: GenRequest,
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: SamplerConfig,
    /// Whether the prompt opened a reasoning block.
    in_reasoning: bool,
    /// Whether control tokens' text goes into the output (the parsers read markup).
    special_text: bool,
}

impl Submitted {
    /// Queues the request on `served`, going on after the tokens `resume` (see
    /// [`SequenceRequest::resume`]).
    fn submit(
        &self,
        served: &ServedModel,
        resume: Vec<u32>,
        report_resumed: bool,
    ) -> Result<(mpsc::UnboundedReceiver<Event>, Ticket), ApiError> {
        let mut sampler = self.sampling.clone();
        if !resume.is_empty() {
            // a seeded generator cannot be wound to where the lost one was: the rest is
            // drawn from a stream of its own, the same for the same seed and position
            sampler.seed = sampler.seed.wrapping_add(resume.len() as u64);
        }
        let constraint = constraint_for(served, &self.req, self.in_reasoning)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let sink = Box::new(move |ev: Event| tx.send(ev).is_ok());
        let ticket = served
            .scheduler
            .submit(
                SequenceRequest {
                    prompt: self.prompt.clone(),
                    max_tokens: self.max_tokens,
                    sampler,
                    presence_penalty: self.req.presence_penalty,
                    frequency_penalty: self.req.frequency_penalty,
                    stop: self.req.stop.clone(),
                    logprobs: self.req.logprobs,
                    constraint,
                    ignore_eos: self.req.ignore_eos,
                    special_text: self.special_text,
                    resume,
                    report_resumed,
                },
                sink,
            )
            .map_err(|busy| {
                ApiError::new(
                    ErrorKind::Overloaded,
                    format!(
                        "{} is at capacity ({} requests queued); retry shortly",
                        served.id, busy.queued
                    ),
                )
            })?;
        Ok((rx, ticket))
    }
}

/// How long a request interrupted by a lost node waits for its instance to be placed again
/// before it fails.
const RESUME_WAIT: Duration = Duration::from_secs(120);

/// What an interrupted request does next, from where its instance stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Resume {
    /// The instance's new placement serves here: queue the request on it.
    Here,
    /// Not placed again yet (or placing, or loading): look again shortly.
    Wait,
    /// It cannot go on; the message says why and what to do.
    Fail(String),
}

/// How long an interrupted request waits while the placement it ran on is marked failed:
/// a rank that lost its peer reports the failure at once, and the failure detector declares
/// a dead node (and the coordinator places the instance again) within seconds.
const FAILED_GRACE: Duration = Duration::from_secs(15);

/// The decision for a request interrupted on instance `id`: `new_here` when this node
/// serves a newer placement of it than the one that broke, `view` the instance table's
/// entry, `broke` the generation the table held when the request was interrupted, and
/// `waited` the time since.
fn resume_decision(
    id: &str,
    new_here: bool,
    view: Option<&InstanceView>,
    broke: Option<u64>,
    waited: Duration,
) -> Resume {
    if new_here {
        return Resume::Here;
    }
    let Some(v) = view else {
        return Resume::Fail(format!("instance {id} was unloaded"));
    };
    match v.state.as_str() {
        // the placement that broke, failed by its own ranks: placed again once the node
        // is declared dead
        "failed" if broke == Some(v.generation) && waited < FAILED_GRACE => Resume::Wait,
        "failed" => Resume::Fail(format!(
            "instance {id} could not be placed again: {}",
            v.reason.as_deref().unwrap_or("no reason given")
        )),
        "unloading" => Resume::Fail(format!("instance {id} is being unloaded")),
        "ready" if !v.lead_here => Resume::Fail(format!(
            "instance {id} was placed again with its lead on another node{}; this request \
             cannot move there: send it again",
            v.lead_api
                .as_deref()
                .map(|a| format!(" (http://{a})"))
                .unwrap_or_default()
        )),
        // placing, loading, or still the broken placement until the failure detector
        // declares the node dead
        _ => Resume::Wait,
    }
}

/// The constraint enforcing `req`'s output format or forced tool call, if any.
///
/// A model serving recorded outputs ([`crate::replay`]) is held to the one recorded for the
/// request instead. Otherwise, for a thinking model asked for a reasoning budget, the budget
/// (`in_reasoning`: the prompt opened the block).
fn constraint_for(
    served: &ServedModel,
    req: &GenRequest,
    in_reasoning: bool,
) -> Result<Option<Box<dyn TokenConstraint>>, ApiError> {
    let Some(replay) = &served.replay else {
        if let Some(c) = crate::constrain::for_request(served, req)? {
            return Ok(Some(c));
        }
        return budget_for(served, req, in_reasoning);
    };
    let thinking = served.reasoning != ReasoningFormat::None && req.thinking_for_prompt().wanted();
    let text = replay
        .output_for(thinking, !req.tools().is_empty())
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "{} replays recorded outputs, and none is recorded for a request with thinking \
                 {} and {} tools",
                served.id,
                if thinking { "on" } else { "off" },
                if req.tools().is_empty() { "no" } else { "some" }
            ))
        })?;
    let tok = &served.model().tokenizer;
    let mut ids = tok
        .encode(text, false, true)
        .map_err(|e| ApiError::internal(format!("cannot tokenize the recorded output: {e}")))?;
    ids.extend(tok.eos_id());
    Ok(Some(Box::new(crate::replay::ReplayConstraint::new(ids))))
}

/// The reasoning budget of `req`, when it asks for one and the model reasons in `<think>`
/// blocks with thinking on.
fn budget_for(
    served: &ServedModel,
    req: &GenRequest,
    in_reasoning: bool,
) -> Result<Option<Box<dyn TokenConstraint>>, ApiError> {
    let Some(budget) = req.thinking.budget else {
        return Ok(None);
    };
    if served.reasoning != ReasoningFormat::ThinkTags || !req.thinking_for_prompt().wanted() {
        return Ok(None);
    }
    let tok = &served.model().tokenizer;
    let ids = |text: &str| {
        tok.encode(text, false, true)
            .map_err(|e| ApiError::internal(format!("cannot tokenize {text:?}: {e}")))
    };
    let (open, close) = (crate::reasoning::OPEN, crate::reasoning::CLOSE);
    Ok(Some(Box::new(crate::reasoning::ReasoningBudget::new(
        budget,
        in_reasoning,
        ids(open)?,
        ids(close)?,
        ids(&format!("\n{close}\n\n"))?,
    ))))
}

impl Running {
    fn lp(&self, id: u32, lp: Option<shoal_engine::scheduler::TokenLogprob>) -> Vec<TokenLogprob> {
        let Some(lp) = lp else {
            return Vec::new();
        };
        let tok = &self.model.scheduler.model().tokenizer;
        let text = |id: u32| {
            let b = tok.token_bytes(id).to_vec();
            (String::from_utf8_lossy(&b).into_owned(), b)
        };
        let (token, bytes) = text(id);
        vec![TokenLogprob {
            id,
            token,
            bytes,
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(t, l)| {
                    let (s, b) = text(t);
                    (t, s, b, l)
                })
                .collect(),
        }]
    }

    /// Sorts the next piece of output into reasoning and answer. The log-probabilities of a
    /// token go with the answer; a token of the reasoning has none listed.
    fn push_text(&mut self, text: String, logprobs: Vec<TokenLogprob>) {
        let Some(splitter) = &mut self.splitter else {
            return self.push_answer(text, logprobs);
        };
        let in_reasoning = splitter.in_reasoning();
        let mut logprobs = (!in_reasoning).then_some(logprobs);
        for seg in splitter.push(&text) {
            self.push_segment(seg, &mut logprobs);
        }
        if let Some(lps) = logprobs.filter(|l| !l.is_empty()) {
            self.push_answer(String::new(), lps);
        }
    }

    fn push_segment(&mut self, seg: Segment, logprobs: &mut Option<Vec<TokenLogprob>>) {
        match seg {
            Segment::Reasoning(text) => match &mut self.reasoning_parser {
                Some(p) => {
                    let events = p.push(&text);
                    self.push_events(events, true);
                }
                None => self.pending.push_back(Out::Reasoning(text)),
            },
            Segment::Answer(text) => {
                self.end_reasoning();
                self.push_answer(text, logprobs.take().unwrap_or_default());
            }
            Segment::Call { name, arguments } => {
                self.end_reasoning();
                let call = ToolCall {
                    id: crate::tools::new_call_id(),
                    name,
                    arguments,
                };
                self.shown_calls.push(call.clone());
                self.pending.push_back(Out::Call {
                    index: self.calls,
                    call,
                });
                self.calls += 1;
            }
        }
    }

    /// The reasoning is over: what its tool parser held back comes out first.
    fn end_reasoning(&mut self) {
        if let Some(p) = self.reasoning_parser.take() {
            let events = p.finish();
            self.push_events(events, true);
        }
    }

    fn push_answer(&mut self, text: String, logprobs: Vec<TokenLogprob>) {
        match &mut self.parser {
            None => {
                if !text.is_empty() || !logprobs.is_empty() {
                    self.shown.push_str(&text);
                    self.pending.push_back(Out::Text { text, logprobs });
                }
            }
            Some(p) => {
                let events = p.push(&text);
                self.push_events(events, false);
            }
        }
    }

    /// Queues a tool parser's events; its text is reasoning when `reasoning`.
    fn push_events(&mut self, events: Vec<StreamEvent>, reasoning: bool) {
        for e in events {
            match e {
                StreamEvent::Content(text) if reasoning && !text.is_empty() => {
                    self.pending.push_back(Out::Reasoning(text))
                }
                StreamEvent::Content(text) if !text.is_empty() => {
                    self.shown.push_str(&text);
                    self.pending.push_back(Out::Text {
                        text,
                        logprobs: Vec::new(),
                    })
                }
                StreamEvent::Content(_) => {}
                StreamEvent::ToolCall { call, .. } => {
                    self.shown_calls.push(call.clone());
                    self.pending.push_back(Out::Call {
                        index: self.calls,
                        call,
                    });
                    self.calls += 1;
                }
            }
        }
    }

    /// The next piece of output; `None` after [`Out::Finished`] or [`Out::Failed`]. Output
    /// another lead already sent (a request taken over) is included: this is the whole
    /// answer.
    pub async fn next(&mut self) -> Option<Out> {
        loop {
            match self.next_item().await? {
                Item::Out(o) | Item::Replayed(o) => return Some(o),
                Item::Mark(_) => {}
            }
        }
    }

    /// The next output, replayed output or mark; `None` after [`Out::Finished`] or
    /// [`Out::Failed`].
    async fn next_item(&mut self) -> Option<Item> {
        loop {
            if let Some(o) = self.pending.pop_front() {
                if self.replayed_pending > 0 {
                    self.replayed_pending -= 1;
                    return Some(Item::Replayed(o));
                }
                return Some(Item::Out(o));
            }
            if let Some(id) = self.mark_after.take() {
                return Some(Item::Mark(id));
            }
            if self.done {
                return None;
            }
            let Some(ev) = self.rx.recv().await else {
                self.done = true;
                return Some(Item::Out(Out::Failed(
                    "the model stopped serving this request".into(),
                )));
            };
            match ev {
                Event::Token { id, text, .. } if self.replaying > 0 => {
                    self.replaying -= 1;
                    self.generated.push(id);
                    if self.splitter.as_ref().is_some_and(|s| s.in_reasoning()) {
                        self.reasoning_tokens += 1;
                    }
                    self.push_text(text, Vec::new());
                    self.replayed_pending = self.pending.len();
                }
                Event::Token { id, text, logprob } => {
                    let now = Instant::now();
                    let first = self.first_token.is_none();
                    let since = if first {
                        now - self.arrived
                    } else {
                        now - self.last_token
                    };
                    self.state.metrics.token(&self.model.id, first, since);
                    self.first_token.get_or_insert(since);
                    self.last_token = now;
                    self.generated.push(id);
                    if self.splitter.as_ref().is_some_and(|s| s.in_reasoning()) {
                        self.reasoning_tokens += 1;
                    }
                    let lps = if self.logprobs {
                        self.lp(id, logprob)
                    } else {
                        Vec::new()
                    };
                    self.push_text(text, lps);
                    if self.marks {
                        self.mark_after = Some(id);
                    }
                }
                Event::Text(text) => self.push_text(text, Vec::new()),
                Event::Done(f) => {
                    if let Some(s) = self.splitter.take() {
                        let mut none = None;
                        for seg in s.finish() {
                            self.push_segment(seg, &mut none);
                        }
                    }
                    if let Some(p) = self.reasoning_parser.take() {
                        let events = p.finish();
                        self.push_events(events, true);
                    }
                    if let Some(p) = self.parser.take() {
                        let events = p.finish();
                        self.push_events(events, false);
                    }
                    let reason = if self.calls > 0 {
                        Finish::ToolCalls
                    } else {
                        match f.reason {
                            FinishReason::Length => Finish::Length,
                            _ => Finish::Stop,
                        }
                    };
                    let (time_to_first_token, total) = if self.resumed > 0 {
                        // the timings of the whole request, not of its last placement
                        (self.first_token.unwrap_or_default(), self.arrived.elapsed())
                    } else {
                        (f.time_to_first_token, f.total)
                    };
                    if f.stop.is_none() {
                        self.remember_turn();
                    }
                    self.pending.push_back(Out::Finished {
                        reason,
                        stop: f.stop,
                        usage: Usage {
                            prompt_tokens: f.prompt_tokens,
                            completion_tokens: f.completion_tokens,
                            cached_tokens: f.cached_tokens,
                            reasoning_tokens: self.reasoning_tokens,
                            time_to_first_token,
                            total,
                        },
                    });
                    self.done = true;
                }
                Event::Failed(msg) => {
                    self.pending.push_back(Out::Failed(msg));
                    self.done = true;
                }
                Event::Interrupted(why) => {
                    if let Err(msg) = self.go_on(&why).await {
                        self.done = true;
                        if self.marks {
                            // relayed: the stream ends cut, and the entry node takes the
                            // request to the instance's next lead (or ends it with the
                            // reason it cannot go on)
                            tracing::info!(model = %self.model.id, "a relayed request is left to its entry node: {msg}");
                            return None;
                        }
                        self.pending.push_back(Out::Failed(msg));
                    }
                }
            }
        }
    }

    /// Keeps the text this chat turn generated beside what the client was shown, so the turn
    /// renders as generated when the client sends it back ([`crate::turns`]).
    ///
    /// A turn whose calls the model wrote outside its family's markup (a bare JSON call from
    /// a Hermes-format model, say) is not kept: given back as it was written, it would teach
    /// the model that form for the rest of the conversation, where the chat template writes
    /// the calls as the model was trained to read them.
    ///
    /// A turn with reasoning is not kept either: templates write earlier reasoning their own
    /// way (or leave it out), so its tokens would not stand for the turn as rendered.
    fn remember_turn(&mut self) {
        if !matches!(self.submitted.req.input, Input::Chat { .. })
            || self.resumed > 0
            || self.reasoning_tokens > 0
        {
            return;
        }
        if !self.shown_calls.is_empty() {
            let raw = self
                .model
                .scheduler
                .model()
                .tokenizer
                .decode(&self.generated, false);
            let in_markup = match self.model.tool_format {
                crate::tools::ToolFormat::Hermes | crate::tools::ToolFormat::Glm => {
                    raw.matches("<tool_call>").count() >= self.shown_calls.len()
                }
                crate::tools::ToolFormat::Mistral => raw.contains("[TOOL_CALLS]"),
                crate::tools::ToolFormat::Kimi => raw.contains("<|tool_calls_section_begin|>"),
                crate::tools::ToolFormat::Llama3 | crate::tools::ToolFormat::Generic => true,
            };
            if !in_markup {
                return;
            }
        }
        self.state.turns.remember(
            &self.model.id,
            self.generated.clone(),
            std::mem::take(&mut self.shown),
            std::mem::take(&mut self.shown_calls),
        );
    }

    /// Queues the request again on its instance's next placement once this node serves it,
    /// going on after the tokens already sent; the client sees one stream. Fails with `why`
    /// and the reason it cannot go on (no cluster, the instance failed, unloaded, or was
    /// placed with its lead on another node, or not placed again within [`RESUME_WAIT`]).
    async fn go_on(&mut self, why: &str) -> Result<(), String> {
        let Some(control) = self.state.instances.get().cloned() else {
            return Err(why.to_string());
        };
        let id = self.model.id.clone();
        let fail = |reason: String| format!("{why}; the request cannot go on: {reason}");
        let interrupted = Instant::now();
        let deadline = interrupted + RESUME_WAIT;
        let broke = control.0.instance(&id).map(|v| v.generation);
        loop {
            let now_here = self
                .state
                .served()
                .into_iter()
                .find(|m| m.id == id && !Arc::ptr_eq(m, &self.model));
            let view = control.0.instance(&id);
            let waited = interrupted.elapsed();
            match resume_decision(&id, now_here.is_some(), view.as_ref(), broke, waited) {
                Resume::Here => {
                    let served = now_here.expect("decided on a model served here");
                    let (rx, ticket) = self
                        .submitted
                        .submit(&served, self.generated.clone(), false)
                        .map_err(|e| fail(e.message))?;
                    tracing::info!(
                        model = %id,
                        generated = self.generated.len(),
                        waited_ms = interrupted.elapsed().as_millis() as u64,
                        "a request goes on after its instance lost a node"
                    );
                    self.state.metrics.resumed(&id);
                    self.model = served;
                    self.rx = rx;
                    self._ticket = ticket;
                    self.resumed += 1;
                    return Ok(());
                }
                Resume::Fail(reason) => return Err(fail(reason)),
                Resume::Wait if Instant::now() >= deadline => {
                    return Err(fail(format!(
                        "instance {id} was not placed again within {} s",
                        RESUME_WAIT.as_secs()
                    )))
                }
                Resume::Wait => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Runs to the end and returns everything at once.
    ///
    /// # Errors
    /// When the request failed after it started (500).
    pub async fn collect(mut self) -> Result<Completed, ApiError> {
        let mut out = Completed {
            reasoning: String::new(),
            text: String::new(),
            calls: Vec::new(),
            reason: Finish::Stop,
            stop: None,
            usage: Usage::default(),
            logprobs: Vec::new(),
        };
        let mut finished = false;
        while let Some(o) = self.next().await {
            match o {
                Out::Text { text, logprobs } => {
                    out.text.push_str(&text);
                    out.logprobs.extend(logprobs);
                }
                Out::Reasoning(text) => out.reasoning.push_str(&text),
                Out::Call { call, .. } => out.calls.push(call),
                Out::Finished {
                    reason,
                    stop,
                    usage,
                } => {
                    out.reason = reason;
                    out.stop = stop;
                    out.usage = usage;
                    finished = true;
                }
                Out::Failed(msg) => return Err(ApiError::internal(msg)),
            }
        }
        if !finished {
            // a relayed request its lead could not go on with (see `next_item`)
            return Err(ApiError::new(
                ErrorKind::Overloaded,
                format!(
                    "{} lost a node and was placed again with its lead elsewhere; send the \
                     request again",
                    self.model.id
                ),
            ));
        }
        if !out.calls.is_empty() {
            out.text = out.text.trim().to_string();
        }
        Ok(out)
    }
}

impl Running {
    /// The request as a stream for a streaming response: `first` items at once, then
    /// `map(out)` for each output until the final one ([`Out::Finished`] or
    /// [`Out::Failed`]) has been mapped. Each adapter supplies its wire format as `map`;
    /// dropping the stream (the client went away) cancels the request.
    ///
    /// Relayed by an entry node, each token's items are followed by its mark. Taken over
    /// from a lead that died, `first` and the items of the output that lead sent are left
    /// out: `map` still sees that output (its state goes on as if it had been sent), and
    /// the stream continues where the client's stopped.
    pub fn stream_with<T, F>(self, first: Vec<T>, map: F) -> impl futures_util::Stream<Item = T>
    where
        T: crate::relay::TokenMark + Send + 'static,
        F: FnMut(Out) -> Vec<T> + Send + 'static,
    {
        struct State<T, F> {
            running: Running,
            queue: std::collections::VecDeque<T>,
            map: F,
            ended: bool,
        }
        let first = if self.replaying > 0 {
            Vec::new()
        } else {
            first
        };
        let state = State {
            running: self,
            queue: first.into(),
            map,
            ended: false,
        };
        futures_util::stream::unfold(state, |mut st| async move {
            loop {
                if let Some(item) = st.queue.pop_front() {
                    return Some((item, st));
                }
                if st.ended {
                    return None;
                }
                let out = match st.running.next_item().await? {
                    Item::Out(out) => out,
                    Item::Replayed(out) => {
                        (st.map)(out);
                        continue;
                    }
                    Item::Mark(id) => {
                        st.queue.push_back(T::token_mark(id));
                        continue;
                    }
                };
                st.ended = matches!(out, Out::Finished { .. } | Out::Failed(_));
                let items = (st.map)(out);
                st.queue.extend(items);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(state: &str, lead_here: bool) -> InstanceView {
        InstanceView {
            state: state.into(),
            generation: 2,
            lead_here,
            lead_api: Some("10.0.0.3:8080".into()),
            placed_lead_api: None,
            reason: (state == "failed").then(|| "no node has room".into()),
        }
    }

    #[test]
    fn an_interrupted_request_waits_goes_on_here_or_fails_with_the_reason() {
        let soon = Duration::from_secs(1);
        let decide =
            |new_here, v: Option<&InstanceView>| resume_decision("m", new_here, v, Some(2), soon);
        // a newer placement serving here: go on, whatever the table says yet
        assert_eq!(decide(true, None), Resume::Here);
        assert_eq!(decide(true, Some(&view("loading", false))), Resume::Here);
        // the placement that broke, failed by its ranks: wait for the node to be declared
        // dead, for a while
        let failed = view("failed", true);
        assert_eq!(decide(false, Some(&failed)), Resume::Wait);
        let late = resume_decision("m", false, Some(&failed), Some(2), FAILED_GRACE);
        assert!(matches!(late, Resume::Fail(_)), "{late:?}");
        // a later placement that failed: fail at once
        let newer = resume_decision("m", false, Some(&failed), Some(1), soon);
        assert!(matches!(newer, Resume::Fail(_)), "{newer:?}");
        // still placing or loading, or the broken placement until the node is declared
        // dead: wait
        for v in [
            view("placing", true),
            view("loading", true),
            view("loading", false),
            view("ready", true),
        ] {
            assert_eq!(decide(false, Some(&v)), Resume::Wait, "{v:?}");
        }
        let fail = |v: Option<&InstanceView>| match resume_decision("m", false, v, None, soon) {
            Resume::Fail(why) => why,
            other => panic!("{v:?}: {other:?}"),
        };
        assert!(fail(None).contains("unloaded"));
        assert!(fail(Some(&view("failed", true))).contains("no node has room"));
        assert!(fail(Some(&view("unloading", true))).contains("unloaded"));
        let moved = fail(Some(&view("ready", false)));
        assert!(
            moved.contains("another node") && moved.contains("http://10.0.0.3:8080"),
            "{moved}"
        );
    }
}
