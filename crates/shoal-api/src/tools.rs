//! Tool calls out of model output. Models write calls as text in their family's format:
//! Qwen 2.5 / Hermes wrap each in `<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
//! Llama 3 writes a bare JSON object (`{"name": .., "parameters": {..}}`, sometimes after
//! `<|python_tag|>`), Mistral writes `[TOOL_CALLS][{..}, ..]`, GLM 4.5+ writes
//! `<tool_call>NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs, and Kimi K2
//! writes `<|tool_calls_section_begin|>` then `<|tool_call_begin|>functions.NAME:N
//! <|tool_call_argument_begin|>{..}<|tool_call_end|>` per call. Small models also often answer
//! with a bare (or fenced) JSON call whatever their template says, so every format also
//! accepts a message that *is* a JSON call. [`ToolStream`] finds calls incrementally while
//! text streams: text that could still become a call is held back until it cannot, complete
//! calls come out as soon as their JSON closes, and anything that turns out not to be a
//! valid call of a known tool is released as ordinary text, never lost.
//! [`parse_tool_calls`] is the same parser run over a whole completion.

use serde_json::Value;

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{json}</tool_call>` blocks (Qwen 2.5, Hermes and their fine-tunes).
    Hermes,
    /// A bare JSON object, optionally after `<|python_tag|>` (Llama 3.x).
    Llama3,
    /// `[TOOL_CALLS]` then a JSON array of calls (Mistral).
    Mistral,
    /// `<tool_call>NAME` and `<arg_key>`/`<arg_value>` pairs, then `</tool_call>` (GLM 4.5+).
    Glm,
    /// A `<|tool_calls_section_begin|>` of `<|tool_call_begin|>` calls (Kimi K2).
    Kimi,
    /// Only a message that is a JSON call (or a list of them).
    Generic,
}

impl ToolFormat {
    /// The format a chat template writes tool calls in (from the markers it contains).
    pub fn detect(chat_template: &str, _arch: &str) -> ToolFormat {
        if chat_template.contains(KIMI_SECTION) {
            ToolFormat::Kimi
        } else if chat_template.contains("<arg_key>") {
            ToolFormat::Glm
        } else if chat_template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if chat_template.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if chat_template.contains("<|python_tag|>")
            || (chat_template.contains("ipython") && chat_template.contains("parameters"))
        {
            ToolFormat::Llama3
        } else {
            ToolFormat::Generic
        }
    }

    /// The text that opens a call block in this format, if it has one.
    fn opener(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::Glm => Some("<tool_call>"),
            ToolFormat::Kimi => Some(KIMI_SECTION),
            ToolFormat::Llama3 => Some("<|python_tag|>"),
            ToolFormat::Mistral => Some("[TOOL_CALLS]"),
            ToolFormat::Generic => None,
        }
    }
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// A unique id (`call_...`) the tool result refers to.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments (a JSON object).
    pub arguments: Value,
}

/// What the stream parser releases.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// Text to show now.
    Content(String),
    /// A complete call.
    ToolCall {
        /// Its position among this message's calls.
        index: usize,
        /// The call.
        call: ToolCall,
    },
}

const HERMES_CLOSE: &str = "</tool_call>";
const KIMI_SECTION: &str = "<|tool_calls_section_begin|>";
const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
const KIMI_CALL: &str = "<|tool_call_begin|>";
const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
const FENCE: &str = "```";

/// A new, unique call id (`call_` and 24 letters and digits), for calls found outside a
/// [`ToolStream`].
pub fn new_call_id() -> String {
    call_id(rand::random(), 0)
}

/// The id of call `index` of a message whose calls are numbered from `seed`: splitmix64 over
/// the seed and the index, unique within a message.
fn call_id(seed: u64, index: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut x = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut id = String::from("call_");
    for _ in 0..24 {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        id.push(ALPHABET[(z % ALPHABET.len() as u64) as usize] as char);
    }
    id
}

/// Byte length of the JSON value at the start of `s` (which starts with `{` or `[`), once
/// its brackets balance outside strings; `None` while incomplete.
fn json_end(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// `(name, arguments)` of one call object, if `v` is one naming a known tool.
fn one_call(v: &Value, known: &[String]) -> Option<(String, Value)> {
    let obj = v.as_object()?;
    let (name, args) = match obj.get("function") {
        Some(f) if f.is_object() => (f.get("name")?, f.get("arguments")),
        _ => (
            obj.get("name")?,
            obj.get("arguments").or_else(|| obj.get("parameters")),
        ),
    };
    let name = name.as_str()?.to_string();
    if name.is_empty() || (!known.is_empty() && !known.contains(&name)) {
        return None;
    }
    let args = match args {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok()?,
        Some(v) => v.clone(),
    };
    args.is_object().then_some((name, args))
}

/// The calls in JSON text `json` (one call object or an array of them), if it is only calls.
fn calls_in(json: &str, known: &[String]) -> Option<Vec<(String, Value)>> {
    let v: Value = serde_json::from_str(json).ok()?;
    match &v {
        Value::Array(items) if !items.is_empty() => {
            items.iter().map(|i| one_call(i, known)).collect()
        }
        Value::Object(_) => one_call(&v, known).map(|c| vec![c]),
        _ => None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// At the start of the message or after a call: nothing decided.
    Start,
    /// Ordinary text; watching for the format's opener.
    Text,
    /// A message that may be bare JSON call(s), optionally fenced.
    Bare,
    /// Inside a block after the format's opener.
    Block,
    /// Something that looked like a call was not one: the rest of the message is text.
    Plain,
}

/// Finds tool calls in text as it streams.
#[derive(Debug, Clone)]
pub struct ToolStream {
    format: ToolFormat,
    known: Vec<String>,
    /// `(tool, argument)` pairs whose schema types the argument a string (GLM writes string
    /// values bare, others as JSON).
    string_args: Vec<(String, String)>,
    /// Calls found in the open Kimi section.
    section_calls: usize,
    /// Text received and not yet released.
    buf: String,
    mode: Mode,
    calls: usize,
    id_seed: u64,
}

impl ToolStream {
    /// A parser for `format` that accepts calls of `known_tools` (any name when empty).
    pub fn new(format: ToolFormat, known_tools: &[&str]) -> Self {
        ToolStream {
            format,
            known: known_tools.iter().map(|s| s.to_string()).collect(),
            string_args: Vec::new(),
            section_calls: 0,
            buf: String::new(),
            mode: Mode::Start,
            calls: 0,
            id_seed: rand::random(),
        }
    }

    /// The tools' argument schemas (`(name, parameters)`): an argument a schema types as a
    /// string stays text in formats that write values bare (GLM), even when it reads as JSON.
    pub fn with_schemas<'a>(
        mut self,
        tools: impl IntoIterator<Item = (&'a str, &'a Value)>,
    ) -> Self {
        for (name, params) in tools {
            let Some(props) = params.get("properties").and_then(Value::as_object) else {
                continue;
            };
            for (arg, schema) in props {
                if schema.get("type").and_then(Value::as_str) == Some("string") {
                    self.string_args.push((name.to_string(), arg.clone()));
                }
            }
        }
        self
    }

    /// Feeds the next piece of generated text; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<StreamEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(false, &mut out);
        out
    }

    /// Ends the message: anything held back is released, as calls when it is complete calls,
    /// else as text.
    pub fn finish(mut self) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        self.drain(true, &mut out);
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            content(&mut out, rest);
        }
        out
    }

    fn new_id(&self) -> String {
        call_id(self.id_seed, self.calls)
    }

    fn emit_calls(&mut self, calls: Vec<(String, Value)>, out: &mut Vec<StreamEvent>) {
        for (name, arguments) in calls {
            let id = self.new_id();
            out.push(StreamEvent::ToolCall {
                index: self.calls,
                call: ToolCall {
                    id,
                    name,
                    arguments,
                },
            });
            self.calls += 1;
        }
    }

    fn drain(&mut self, last: bool, out: &mut Vec<StreamEvent>) {
        loop {
            let progressed = match self.mode {
                Mode::Start => self.start(last, out),
                Mode::Text => self.text(last, out),
                Mode::Bare => self.bare(last, out),
                Mode::Block => self.block(last, out),
                Mode::Plain => {
                    let rest = std::mem::take(&mut self.buf);
                    content(out, rest);
                    false
                }
            };
            if !progressed {
                return;
            }
        }
    }

    /// Decides what the message (or what follows a call) is. Returns whether the mode changed.
    fn start(&mut self, last: bool, out: &mut Vec<StreamEvent>) -> bool {
        let after_call = self.calls > 0;
        // between calls, separators are not text
        let t = if after_call {
            self.buf
                .trim_start_matches(|c: char| c.is_whitespace() || c == ';' || c == ',')
        } else {
            self.buf.trim_start()
        };
        if t.is_empty() {
            if last && !after_call {
                let rest = std::mem::take(&mut self.buf);
                content(out, rest);
            } else if after_call {
                self.buf.clear();
            }
            return false;
        }
        if let Some(opener) = self.format.opener() {
            if t.starts_with(opener) {
                self.mode = Mode::Text;
                return true;
            }
            if !last && opener.starts_with(t) {
                return false;
            }
        }
        if t.starts_with('{') || t.starts_with('[') || t.starts_with(FENCE) {
            if after_call {
                let skip = self.buf.len() - t.len();
                self.buf.drain(..skip);
            }
            self.mode = Mode::Bare;
            return true;
        }
        if !last && FENCE.starts_with(t) {
            return false;
        }
        self.mode = Mode::Text;
        true
    }

    /// Ordinary text: release it, holding back a possible start of the opener.
    fn text(&mut self, last: bool, out: &mut Vec<StreamEvent>) -> bool {
        let Some(opener) = self.format.opener() else {
            let rest = std::mem::take(&mut self.buf);
            content(out, rest);
            return false;
        };
        if let Some(at) = self.buf.find(opener) {
            let before = self.buf[..at].to_string();
            content(out, before);
            self.buf.drain(..at + opener.len());
            self.mode = if self.format == ToolFormat::Llama3 {
                Mode::Bare
            } else {
                Mode::Block
            };
            return true;
        }
        let keep = if last {
            0
        } else {
            longest_prefix_suffix(&self.buf, opener)
        };
        let cut = self.buf.len() - keep;
        let released: String = self.buf.drain(..cut).collect();
        content(out, released);
        false
    }

    /// A message that may be JSON call(s), possibly in a code fence.
    fn bare(&mut self, last: bool, out: &mut Vec<StreamEvent>) -> bool {
        let lead = self.buf.len() - self.buf.trim_start().len();
        let mut body_at = lead;
        let mut fenced = false;
        if self.buf[lead..].starts_with(FENCE) {
            let Some(nl) = self.buf[lead..].find('\n') else {
                return self.give_up_if(last);
            };
            let info = self.buf[lead + FENCE.len()..lead + nl].trim();
            if !(info.is_empty() || info.eq_ignore_ascii_case("json")) {
                return self.not_a_call();
            }
            fenced = true;
            body_at = lead + nl + 1;
            body_at += self.buf[body_at..].len() - self.buf[body_at..].trim_start().len();
        }
        let body = &self.buf[body_at..];
        if body.is_empty() {
            return self.give_up_if(last);
        }
        if !(body.starts_with('{') || body.starts_with('[')) {
            return self.not_a_call();
        }
        let Some(end) = json_end(body) else {
            return self.give_up_if(last);
        };
        let Some(calls) = calls_in(&body[..end], &self.known) else {
            return self.not_a_call();
        };
        let mut consumed = body_at + end;
        if fenced {
            let rest = &self.buf[consumed..];
            let trimmed = rest.trim_start();
            if trimmed.starts_with(FENCE) {
                consumed += rest.len() - trimmed.len() + FENCE.len();
            } else if !last && FENCE.starts_with(trimmed) {
                return false; // the closing fence may still come
            }
        }
        self.buf.drain(..consumed);
        self.emit_calls(calls, out);
        self.mode = Mode::Start;
        true
    }

    /// Inside a call block after the opener (Hermes, Mistral, GLM or Kimi).
    fn block(&mut self, last: bool, out: &mut Vec<StreamEvent>) -> bool {
        let opener = self.format.opener().unwrap_or("");
        let lead = self.buf.len() - self.buf.trim_start().len();
        let body = &self.buf[lead..];
        if self.format == ToolFormat::Kimi {
            return self.kimi_block(last, out);
        }
        if body.is_empty() {
            return self.block_failed(last, out, opener);
        }
        if self.format == ToolFormat::Glm && !body.starts_with('{') {
            return self.glm_block(last, out);
        }
        if self.format == ToolFormat::Mistral && !body.starts_with('[') && !body.starts_with('{') {
            // newer Mistral templates: NAME[ARGS]{json}
            let Some(args_at) = body.find("[ARGS]") else {
                let name_so_far = body.split('[').next().unwrap_or("");
                let plausible = body.len() < 256
                    && name_so_far
                        .chars()
                        .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.'));
                return if plausible && !last {
                    false
                } else if last {
                    self.block_failed(last, out, opener)
                } else {
                    self.block_not_a_call(opener)
                };
            };
            let name = body[..args_at].trim().to_string();
            let json = &body[args_at + "[ARGS]".len()..];
            let jlead = json.len() - json.trim_start().len();
            let Some(end) = json_end(&json[jlead..]) else {
                return self.block_failed(last, out, opener);
            };
            let obj = serde_json::json!({"name": name, "arguments": serde_json::from_str::<Value>(&json[jlead..jlead + end]).unwrap_or(Value::Null)});
            let Some(call) = one_call(&obj, &self.known) else {
                return self.block_not_a_call(opener);
            };
            let consumed = lead + args_at + "[ARGS]".len() + jlead + end;
            self.buf.drain(..consumed);
            self.emit_calls(vec![call], out);
            self.mode = Mode::Start;
            return true;
        }
        if !(body.starts_with('{') || body.starts_with('[')) {
            return self.block_not_a_call(opener);
        }
        let Some(end) = json_end(body) else {
            return self.block_failed(last, out, opener);
        };
        let Some(calls) = calls_in(&body[..end], &self.known) else {
            return self.block_not_a_call(opener);
        };
        let mut consumed = lead + end;
        if self.format == ToolFormat::Hermes {
            let rest = &self.buf[consumed..];
            let trimmed = rest.trim_start();
            if trimmed.starts_with(HERMES_CLOSE) {
                consumed += rest.len() - trimmed.len() + HERMES_CLOSE.len();
            } else if !last && HERMES_CLOSE.starts_with(trimmed) {
                return false; // the closing tag may still come
            }
        }
        self.buf.drain(..consumed);
        self.emit_calls(calls, out);
        self.mode = Mode::Start;
        true
    }

    /// A GLM block, `NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs, up to
    /// `</tool_call>`. A value is JSON unless the tool's schema types it a string or it does
    /// not parse (GLM's template writes strings bare and other values as JSON).
    fn glm_block(&mut self, last: bool, out: &mut Vec<StreamEvent>) -> bool {
        let Some(end) = self.buf.find(HERMES_CLOSE) else {
            let name_so_far = self
                .buf
                .trim_start()
                .split(['\n', '<'])
                .next()
                .unwrap_or("");
            let plausible = name_so_far.len() < 256
                && name_so_far
                    .chars()
                    .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.'));
            return if last {
                self.block_failed(last, out, "<tool_call>")
            } else if plausible {
                false
            } else {
                self.block_not_a_call("<tool_call>")
            };
        };
        let inner = &self.buf[..end];
        let name_end = inner.find("<arg_key>").unwrap_or(inner.len());
        let name = inner[..name_end].trim().to_string();
        let mut args = serde_json::Map::new();
        let mut rest = &inner[name_end..];
        let mut well_formed = true;
        while let Some(k) = rest.find("<arg_key>") {
            let tag = |s: &str, open: &str, close: &str| -> Option<(String, usize)> {
                let a = s.find(open)? + open.len();
                let b = a + s[a..].find(close)?;
                Some((s[a..b].to_string(), b + close.len()))
            };
            let Some((key, after_key)) = tag(&rest[k..], "<arg_key>", "</arg_key>") else {
                well_formed = false;
                break;
            };
            let after_key = &rest[k + after_key..];
            let Some((raw, after_value)) = tag(after_key, "<arg_value>", "</arg_value>") else {
                well_formed = false;
                break;
            };
            let key = key.trim().to_string();
            let is_string = self
                .string_args
                .iter()
                .any(|(t, a)| *t == name && *a == key);
            let value = if is_string {
                Value::String(raw)
            } else {
                serde_json::from_str::<Value>(&raw).unwrap_or(Value::String(raw))
            };
            args.insert(key, value);
            rest = &after_key[after_value..];
        }
        let call = well_formed
            .then(|| {
                one_call(
                    &serde_json::json!({"name": name, "arguments": args}),
                    &self.known,
                )
            })
            .flatten();
        let Some(call) = call else {
            return self.block_not_a_call("<tool_call>");
        };
        self.buf.drain(..end + HERMES_CLOSE.len());
        self.emit_calls(vec![call], out);
        self.mode = Mode::Start;
        true
    }

    /// Inside a Kimi K2 section: each `<|tool_call_begin|>functions.NAME:N
    /// <|tool_call_argument_begin|>{json}<|tool_call_end|>` is a call, out as soon as it is
    /// complete; `<|tool_calls_section_end|>` ends the section.
    fn kimi_block(&mut self, last: bool, out: &mut Vec<StreamEvent>) -> bool {
        let lead = self.buf.len() - self.buf.trim_start().len();
        let body = &self.buf[lead..];
        if let Some(rest) = body.strip_prefix(KIMI_SECTION_END) {
            let consumed = self.buf.len() - rest.len();
            self.buf.drain(..consumed);
            self.section_calls = 0;
            self.mode = Mode::Start;
            return true;
        }
        if body.starts_with(KIMI_CALL) {
            let Some(end) = body.find(KIMI_CALL_END) else {
                return if last { self.kimi_not_a_call() } else { false };
            };
            let call = body[KIMI_CALL.len()..end]
                .split_once(KIMI_ARGS)
                .and_then(|(id, json)| {
                    // `functions.NAME:N`
                    let id = id.trim();
                    let id = id.strip_prefix("functions.").unwrap_or(id);
                    let name = match id.rsplit_once(':') {
                        Some((n, i)) if i.chars().all(|c| c.is_ascii_digit()) => n,
                        _ => id,
                    };
                    let args = serde_json::from_str::<Value>(json.trim()).ok()?;
                    one_call(
                        &serde_json::json!({"name": name, "arguments": args}),
                        &self.known,
                    )
                });
            let Some(call) = call else {
                return self.kimi_not_a_call();
            };
            self.buf.drain(..lead + end + KIMI_CALL_END.len());
            self.emit_calls(vec![call], out);
            self.section_calls += 1;
            return true;
        }
        if body.is_empty()
            || (!last && (KIMI_CALL.starts_with(body) || KIMI_SECTION_END.starts_with(body)))
        {
            if last && self.section_calls == 0 {
                return self.kimi_not_a_call();
            }
            return false;
        }
        self.kimi_not_a_call()
    }

    /// What follows in a Kimi section is not a call: text, with the section's opener when
    /// no call of it came out.
    fn kimi_not_a_call(&mut self) -> bool {
        if self.section_calls == 0 {
            return self.block_not_a_call(KIMI_SECTION);
        }
        self.section_calls = 0;
        self.mode = Mode::Plain;
        true
    }

    /// An incomplete block: wait, or at the end release it (opener included) as text.
    fn block_failed(&mut self, last: bool, out: &mut Vec<StreamEvent>, opener: &str) -> bool {
        if !last {
            return false;
        }
        let rest = format!("{opener}{}", std::mem::take(&mut self.buf));
        content(out, rest);
        false
    }

    /// A block that is not a call: it is text, its opener included.
    fn block_not_a_call(&mut self, opener: &str) -> bool {
        self.buf.insert_str(0, opener);
        self.mode = Mode::Plain;
        true
    }

    /// Incomplete bare JSON: wait, or at the end release it as text.
    fn give_up_if(&mut self, last: bool) -> bool {
        if last {
            self.mode = Mode::Plain;
            return true;
        }
        false
    }

    /// What looked like a JSON call is not one: it is text.
    fn not_a_call(&mut self) -> bool {
        self.mode = Mode::Plain;
        true
    }
}

/// Appends `text` as content (nothing when empty).
fn content(out: &mut Vec<StreamEvent>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(StreamEvent::Content(prev)) = out.last_mut() {
        prev.push_str(&text);
    } else {
        out.push(StreamEvent::Content(text));
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker`: text that could
/// still become the marker, held back by the streaming parsers.
pub(crate) fn longest_prefix_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| {
            marker.is_char_boundary(n)
                && s.is_char_boundary(s.len() - n)
                && s.ends_with(&marker[..n])
        })
        .unwrap_or(0)
}

/// Splits a finished completion into its text (trimmed when there are calls) and its calls.
pub fn parse_tool_calls(
    format: ToolFormat,
    text: &str,
    known_tools: &[&str],
) -> (String, Vec<ToolCall>) {
    let mut s = ToolStream::new(format, known_tools);
    let mut events = s.push(text);
    events.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for e in events {
        match e {
            StreamEvent::Content(t) => content.push_str(&t),
            StreamEvent::ToolCall { call, .. } => calls.push(call),
        }
    }
    if !calls.is_empty() {
        content = content.trim().to_string();
    }
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    const KNOWN: &[&str] = &["get_weather", "get_time"];

    fn names(calls: &[ToolCall]) -> Vec<&str> {
        calls.iter().map(|c| c.name.as_str()).collect()
    }

    #[test]
    fn hermes_single_parallel_and_text_before() {
        let t = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (c, calls) = parse_tool_calls(ToolFormat::Hermes, t, KNOWN);
        assert_eq!(c, "");
        assert_eq!(calls[0].arguments, json!({"city": "Paris"}));
        let two = format!("Let me check.\n{t}\n<tool_call>{{\"name\": \"get_time\", \"arguments\": {{\"timezone\": \"CET\"}}}}</tool_call>");
        let (c, calls) = parse_tool_calls(ToolFormat::Hermes, &two, KNOWN);
        assert_eq!(c, "Let me check.");
        assert_eq!(names(&calls), ["get_weather", "get_time"]);
        assert_ne!(calls[0].id, calls[1].id);
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 29);
    }

    #[test]
    fn braces_and_closing_tags_inside_strings() {
        let t = r#"<tool_call>{"name": "get_weather", "arguments": {"city": "a}b</tool_call>{[", "n": [1, {"x": "]"}]}}</tool_call>"#;
        let (c, calls) = parse_tool_calls(ToolFormat::Hermes, t, KNOWN);
        assert_eq!(c, "");
        assert_eq!(calls[0].arguments["city"], "a}b</tool_call>{[");
    }

    #[test]
    fn bare_and_fenced_json_calls_in_any_format() {
        for f in [
            ToolFormat::Hermes,
            ToolFormat::Llama3,
            ToolFormat::Mistral,
            ToolFormat::Generic,
        ] {
            let bare = r#"{"name": "get_weather", "parameters": {"city": "Oslo"}}"#;
            let (_, calls) = parse_tool_calls(f, bare, KNOWN);
            assert_eq!(calls.len(), 1, "{f:?}");
            let fenced = "```json\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n```";
            let (c, calls) = parse_tool_calls(f, fenced, KNOWN);
            assert_eq!(
                (c.as_str(), calls[0].arguments.clone()),
                ("", json!({"city": "Rome"})),
                "{f:?}"
            );
        }
        let (_, calls) = parse_tool_calls(
            ToolFormat::Llama3,
            r#"<|python_tag|>{"name": "get_time", "parameters": {"timezone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Nice"}}"#,
            KNOWN,
        );
        assert_eq!(names(&calls), ["get_time", "get_weather"]);
    }

    #[test]
    fn mistral_both_syntaxes() {
        let (_, calls) = parse_tool_calls(
            ToolFormat::Mistral,
            r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "get_time", "arguments": {}}]"#,
            KNOWN,
        );
        assert_eq!(names(&calls), ["get_weather", "get_time"]);
        let (_, calls) = parse_tool_calls(
            ToolFormat::Mistral,
            r#"[TOOL_CALLS]get_time[ARGS]{"timezone": "PST"}"#,
            KNOWN,
        );
        assert_eq!(calls[0].arguments, json!({"timezone": "PST"}));
    }

    #[test]
    fn not_calls_stay_text() {
        for t in [
            "The weather is nice.",
            r#"{"name": "launch_rockets", "arguments": {}}"#,
            r#"{"answer": 42}"#,
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {bad json}}</tool_call>",
            "<tool_call>{\"name\": \"get_weather\"",
            "```python\nprint(1)\n```",
            "[1, 2, 3]",
        ] {
            let (c, calls) = parse_tool_calls(ToolFormat::Hermes, t, KNOWN);
            assert!(calls.is_empty(), "{t}");
            assert_eq!(c, t, "text must come back unchanged");
        }
    }

    #[test]
    fn plain_text_streams_promptly() {
        let mut s = ToolStream::new(ToolFormat::Hermes, KNOWN);
        let ev = s.push("Hello wor");
        assert_eq!(ev, vec![StreamEvent::Content("Hello wor".into())]);
        assert_eq!(s.push(" <tool"), vec![StreamEvent::Content(" ".into())]);
        assert_eq!(s.push("th"), vec![StreamEvent::Content("<toolth".into())]);
        assert!(s.finish().is_empty());
    }

    #[test]
    fn call_is_released_when_its_json_closes() {
        let mut s = ToolStream::new(ToolFormat::Hermes, KNOWN);
        assert!(s
            .push("<tool_call>{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"X\"}")
            .is_empty());
        let ev = s.push("}</tool_call>");
        assert!(
            matches!(&ev[..], [StreamEvent::ToolCall { index: 0, .. }]),
            "{ev:?}"
        );
    }

    const ALL: [ToolFormat; 6] = [
        ToolFormat::Hermes,
        ToolFormat::Llama3,
        ToolFormat::Mistral,
        ToolFormat::Glm,
        ToolFormat::Kimi,
        ToolFormat::Generic,
    ];

    /// GLM 4.6's calls, as its template writes them: string values bare, others as JSON.
    const GLM_CALLS: &str = "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris é</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>timezone</arg_key>\n<arg_value>123</arg_value>\n</tool_call>";
    /// Kimi K2's calls, as its template writes them.
    const KIMI_CALLS: &str = "I'll look.<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"timezone\": \"CET\"}<|tool_call_end|><|tool_calls_section_end|>";

    fn texts() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris é}\"}}\n</tool_call>".to_string()),
            Just("I'll call it.\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"B\"}}</tool_call>".to_string()),
            Just("```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"日本\"}}\n```".to_string()),
            Just("{\"name\": \"nope\", \"arguments\": {}}".to_string()),
            Just("Just text with a < and <tool and émojis 🎉".to_string()),
            Just("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\"".to_string()),
            Just(GLM_CALLS.to_string()),
            Just(KIMI_CALLS.to_string()),
            Just("<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0<|tool_call_argument_begin|>{}<|tool_call_end|>".to_string()),
            ".{0,60}",
        ]
    }

    proptest! {
        /// However the text is cut into deltas, streaming gives what parsing it whole gives.
        #[test]
        fn streaming_equals_whole(text in texts(), cuts in prop::collection::vec(0usize..200, 0..12)) {
            for format in ALL {
                let (whole_text, whole_calls) = parse_tool_calls(format, &text, KNOWN);
                let mut points: Vec<usize> = cuts.iter().map(|&c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
                points.sort_unstable();
                let mut s = ToolStream::new(format, KNOWN);
                let mut events = Vec::new();
                let mut prev = 0;
                for p in points.into_iter().chain([text.len()]) {
                    events.extend(s.push(&text[prev..p]));
                    prev = p;
                }
                events.extend(s.finish());
                let mut streamed = String::new();
                let mut calls = Vec::new();
                for e in events {
                    match e {
                        StreamEvent::Content(t) => streamed.push_str(&t),
                        StreamEvent::ToolCall { call, .. } => calls.push((call.name, call.arguments)),
                    }
                }
                if !calls.is_empty() {
                    streamed = streamed.trim().to_string();
                }
                prop_assert_eq!(&streamed, &whole_text, "{:?}", format);
                let whole: Vec<_> = whole_calls.into_iter().map(|c| (c.name, c.arguments)).collect();
                prop_assert_eq!(calls, whole);
            }
        }

        /// Random input never panics, and text without calls comes back unchanged.
        #[test]
        fn never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let text = String::from_utf8_lossy(&bytes).into_owned();
            for format in ALL {
                let (c, calls) = parse_tool_calls(format, &text, &[]);
                if calls.is_empty() {
                    prop_assert_eq!(c, text.clone());
                }
            }
        }
    }

    /// Every cut of `text` into pieces of `n` bytes, streamed: the text and calls.
    fn streamed(
        format: ToolFormat,
        text: &str,
        n: usize,
        schemas: &[(&str, Value)],
    ) -> (String, Vec<(String, Value)>) {
        let mut s =
            ToolStream::new(format, KNOWN).with_schemas(schemas.iter().map(|(n, v)| (*n, v)));
        let mut events = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut k = n.min(rest.len());
            while !rest.is_char_boundary(k) {
                k += 1;
            }
            events.extend(s.push(&rest[..k]));
            rest = &rest[k..];
        }
        events.extend(s.finish());
        let (mut content, mut calls) = (String::new(), Vec::new());
        for e in events {
            match e {
                StreamEvent::Content(t) => content.push_str(&t),
                StreamEvent::ToolCall { call, .. } => calls.push((call.name, call.arguments)),
            }
        }
        (content, calls)
    }

    #[test]
    fn glm_calls_take_string_values_bare_and_others_as_json() {
        let schemas = [(
            "get_time",
            json!({"type": "object", "properties": {"timezone": {"type": "string"}}}),
        )];
        for n in 1..=GLM_CALLS.len() {
            let (content, calls) = streamed(ToolFormat::Glm, GLM_CALLS, n, &schemas);
            assert_eq!(content.trim(), "Let me check.", "{n}");
            assert_eq!(
                calls,
                [
                    (
                        "get_weather".to_string(),
                        json!({"city": "Paris é", "days": 3})
                    ),
                    ("get_time".to_string(), json!({"timezone": "123"})),
                ],
                "{n}"
            );
        }
        // without a schema a value that reads as JSON is JSON
        let (_, calls) = streamed(ToolFormat::Glm, GLM_CALLS, 7, &[]);
        assert_eq!(calls[1].1, json!({"timezone": 123}));
        // a Hermes block of JSON (what a forced call's grammar writes) is a call too
        let (_, calls) = parse_tool_calls(
            ToolFormat::Glm,
            "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
            KNOWN,
        );
        assert_eq!(names(&calls), ["get_time"]);
        // an unknown tool, a broken pair, an unclosed block: text, never lost
        for text in [
            "<tool_call>nope\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call>get_time\n<arg_key>a</arg_key>1</tool_call>",
            "<tool_call>get_time\n<arg_key>timezone</arg_key><arg_value>CET",
            "<tool_call>what is this? a question</tool_call>",
        ] {
            let (c, calls) = parse_tool_calls(ToolFormat::Glm, text, KNOWN);
            assert!(calls.is_empty(), "{text}");
            assert_eq!(c, text);
        }
    }

    #[test]
    fn kimi_sections_give_each_call_as_it_completes() {
        for n in 1..=KIMI_CALLS.len() {
            let (content, calls) = streamed(ToolFormat::Kimi, KIMI_CALLS, n, &[]);
            assert_eq!(content.trim(), "I'll look.", "{n}");
            assert_eq!(
                calls,
                [
                    ("get_weather".to_string(), json!({"city": "Paris"})),
                    ("get_time".to_string(), json!({"timezone": "CET"})),
                ],
                "{n}"
            );
        }
        let mut s = ToolStream::new(ToolFormat::Kimi, KNOWN);
        let first = KIMI_CALLS.find("<|tool_call_end|>").unwrap() + "<|tool_call_end|>".len();
        let events = s.push(&KIMI_CALLS[..first]);
        assert!(
            matches!(events.last(), Some(StreamEvent::ToolCall { .. })),
            "{events:?}"
        );
        for text in [
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{broken<|tool_call_end|>",
            "<|tool_calls_section_begin|> and then prose",
        ] {
            let (c, calls) = parse_tool_calls(ToolFormat::Kimi, text, KNOWN);
            assert!(calls.is_empty(), "{text}");
            assert_eq!(c, text);
        }
    }

    #[test]
    fn detects_formats_from_templates() {
        assert_eq!(
            ToolFormat::detect("...<tool_call>...", "qwen2"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::detect("[TOOL_CALLS]", "llama"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::detect("<|python_tag|>", "llama"),
            ToolFormat::Llama3
        );
        assert_eq!(
            ToolFormat::detect("{{ messages }}", "llama"),
            ToolFormat::Generic
        );
        for (template, format) in [
            ("GLM-4.6.jinja", ToolFormat::Glm),
            ("Kimi-K2-Thinking.jinja", ToolFormat::Kimi),
            ("Qwen-Qwen3-0.6B.jinja", ToolFormat::Hermes),
        ] {
            let path = format!(
                "{}/../shoal-model/tests/data/templates/{template}",
                env!("CARGO_MANIFEST_DIR")
            );
            let src = std::fs::read_to_string(&path).unwrap();
            assert_eq!(ToolFormat::detect(&src, ""), format, "{template}");
        }
    }
}
