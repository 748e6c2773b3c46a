//! Chat templates: renders a conversation into the prompt text a model was trained on, the way
//! Hugging Face transformers' `apply_chat_template` does. The template (Jinja, taken from the
//! model's `tokenizer_config.json` or GGUF metadata) runs in minijinja configured like HF's
//! sandboxed Jinja2 environment: `trim_blocks` and `lstrip_blocks` on, the trailing newline of
//! the source dropped, the variables `messages`, `tools` (none when absent), `documents` (none),
//! `add_generation_prompt`, `bos_token`, `eos_token` plus any extra keyword arguments, the
//! globals `raise_exception` and `strftime_now`, an HF-style `tojson` filter (Python's
//! `json.dumps` with `ensure_ascii=False`, keys kept in the order given), Python string and dict
//! methods (`.strip()`, `.split()`, `.items()`, ...), and Python's way of printing `None`,
//! `True`, floats, lists and dicts. Templates come from model files and are untrusted: compiling
//! never panics, and rendering is bounded by a fuel budget (instructions), a recursion limit and
//! an output-size cap, so a hostile template gets a [`TemplateError`] instead of a hang.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{from_args, Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Environment, Error, ErrorKind, Output, State, UndefinedBehavior};

/// Name the template is registered under inside its environment (appears in error locations).
const TEMPLATE_NAME: &str = "chat_template";

/// Deepest nesting `tojson` and Python-style printing follow before giving up (guards against
/// self-referencing namespaces and stack exhaustion).
const MAX_VALUE_DEPTH: usize = 256;

/// What can go wrong compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template source does not parse.
    #[error("chat template syntax error{}: {message}", line_suffix(*.line))]
    Syntax {
        /// What the parser objected to.
        message: String,
        /// 1-based line in the template source, when known.
        line: Option<usize>,
    },
    /// Rendering failed (bad operation, unknown filter, type error, ...).
    #[error("chat template render error{}: {message}", line_suffix(*.line))]
    Render {
        /// What went wrong.
        message: String,
        /// 1-based line in the template source, when known.
        line: Option<usize>,
    },
    /// The template called `raise_exception(msg)`; usually it rejects the conversation (for
    /// example roles that do not alternate).
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    /// The template ran past a resource limit (fuel, recursion depth or output size).
    #[error("chat template exceeded a limit: {0}")]
    Limit(String),
    /// The render input itself is unusable (for example `extra` is not a JSON object).
    #[error("invalid chat template input: {0}")]
    Input(String),
}

fn line_suffix(line: Option<usize>) -> String {
    match line {
        Some(line) => format!(" at line {line}"),
        None => String::new(),
    }
}

/// Resource limits applied to every render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Instruction budget of one render (minijinja fuel). The templates under test spend about
    /// 35k-75k on a 1000-message conversation with 50 tools; the default 3M stops a runaway
    /// template in well under a second.
    pub fuel: u64,
    /// Maximum nesting of loops, macros and calls (minijinja caps this at 500).
    pub recursion: usize,
    /// Maximum size of the rendered prompt in bytes.
    pub max_output_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            fuel: 3_000_000,
            recursion: 250,
            max_output_bytes: 64 << 20,
        }
    }
}

/// Everything a chat template is rendered with.
#[derive(Debug, Clone, Copy)]
pub struct RenderInput<'a> {
    /// OpenAI-style messages: `role`, `content` (a string or a list of `{type: text, text}`
    /// parts, passed through as given), `tool_calls`, `tool_call_id`, `name`, ...
    pub messages: &'a [serde_json::Value],
    /// OpenAI-style tools (`[{type: function, function: {name, description, parameters}}]`);
    /// `None` renders as Jinja `none`, as HF passes `tools=None`.
    pub tools: Option<&'a [serde_json::Value]>,
    /// Whether to open an assistant turn at the end.
    pub add_generation_prompt: bool,
    /// Extra template keyword arguments (a JSON object), e.g. `{"enable_thinking": false}`.
    /// They may override `bos_token`/`eos_token` but not `messages`, `tools`, `documents` or
    /// `add_generation_prompt` (HF rejects those duplicates too).
    pub extra: Option<&'a serde_json::Value>,
}

/// A compiled chat template together with the special tokens it is rendered with.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    limits: Limits,
    source: String,
}

impl ChatTemplate {
    /// Compiles `source` with the default [`Limits`].
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        Self::with_limits(source, bos_token, eos_token, Limits::default())
    }

    /// Compiles `source` with explicit resource limits.
    pub fn with_limits(
        source: &str,
        bos_token: &str,
        eos_token: &str,
        limits: Limits,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|err| TemplateError::Syntax {
                message: error_message(&err),
                line: None,
            })?;
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_fuel(Some(limits.fuel));
        env.set_recursion_limit(limits.recursion);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        let max_json = limits.max_output_bytes;
        env.add_filter("tojson", move |value: Value, args: Rest<ValueOrKwargs>| {
            tojson(max_json, &value, &args.into_values())
        });
        env.add_filter("string", python_string_filter);
        // Jinja2 built-ins that minijinja keeps in its contrib crate.
        env.add_filter("truncate", minijinja_contrib::filters::truncate);
        env.add_filter("striptags", minijinja_contrib::filters::striptags);
        env.add_filter("filesizeformat", minijinja_contrib::filters::filesizeformat);
        env.add_function("cycler", minijinja_contrib::globals::cycler);
        env.add_function("joiner", minijinja_contrib::globals::joiner);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_function("namespace", crate::template_list::namespace);

        let original = source.to_owned();
        let source = rewrite_generation_tags(source).into_owned();
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|err| TemplateError::Syntax {
                message: error_message(&err),
                line: err.line(),
            })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            limits,
            source: original,
        })
    }

    /// The template's source text (to recognise a model family's conventions, such as its
    /// tool-call format).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The limits every render runs under.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Renders the conversation in `input` into a prompt string.
    pub fn render(&self, input: &RenderInput<'_>) -> Result<String, TemplateError> {
        let mut ctx: Vec<(String, Value)> = vec![
            ("bos_token".into(), Value::from(self.bos_token.as_str())),
            ("eos_token".into(), Value::from(self.eos_token.as_str())),
        ];
        match input.extra {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Object(map)) => {
                for (key, value) in map {
                    if matches!(
                        key.as_str(),
                        "messages" | "tools" | "documents" | "add_generation_prompt"
                    ) {
                        return Err(TemplateError::Input(format!(
                            "extra template argument `{key}` would replace a reserved variable"
                        )));
                    }
                    ctx.push((key.clone(), Value::from(minijinja::value::Serde(value))));
                }
            }
            Some(other) => {
                return Err(TemplateError::Input(format!(
                    "extra template arguments must be a JSON object, got {}",
                    json_kind(other)
                )))
            }
        }
        ctx.push((
            "messages".into(),
            Value::from(minijinja::value::Serde(input.messages)),
        ));
        ctx.push((
            "tools".into(),
            match input.tools {
                Some(tools) => Value::from(minijinja::value::Serde(tools)),
                None => Value::from(()),
            },
        ));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(input.add_generation_prompt),
        ));
        let ctx = Value::from_pairs(ctx);

        let template =
            self.env
                .get_template(TEMPLATE_NAME)
                .map_err(|err| TemplateError::Render {
                    message: error_message(&err),
                    line: None,
                })?;
        let mut out = CappedWriter {
            buf: Vec::new(),
            cap: self.limits.max_output_bytes,
            exceeded: false,
        };
        let result = template.render_captured_to(ctx, &mut out).map(drop);
        if out.exceeded {
            return Err(TemplateError::Limit(format!(
                "rendered prompt is larger than {} bytes",
                self.limits.max_output_bytes
            )));
        }
        result.map_err(|err| classify(&err, &self.limits))?;
        String::from_utf8(out.buf).map_err(|err| TemplateError::Render {
            message: format!("rendered prompt is not valid UTF-8: {err}"),
            line: None,
        })
    }
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Collects the rendered output, refusing to grow past `cap` bytes.
struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
    exceeded: bool,
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.cap {
            self.exceeded = true;
            return Err(io::Error::other("chat template output limit reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Marks an error as coming from the template's own `raise_exception` call.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: Option<Value>) -> Result<Value, Error> {
    let message = match message {
        Some(value) => python_str(&value),
        None => String::new(),
    };
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// `strftime_now(format)`: the current local time, formatted with strftime directives.
fn strftime_now(format: &str) -> Result<String, Error> {
    let now = jiff::Zoned::now();
    jiff::fmt::strtime::format(format, &now).map_err(|err| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format with {format:?}"),
        )
        .with_source(err)
    })
}

fn error_message(err: &Error) -> String {
    let mut message = match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        let _ = write!(message, ": {cause}");
        source = cause.source();
    }
    message
}

fn classify(err: &Error, limits: &Limits) -> TemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(cause) = source {
        if let Some(raised) = cause.downcast_ref::<Raised>() {
            return TemplateError::Raised(raised.0.clone());
        }
        source = cause.source();
    }
    match err.kind() {
        ErrorKind::OutOfFuel => TemplateError::Limit(format!(
            "template used up its budget of {} instructions",
            limits.fuel
        )),
        ErrorKind::SyntaxError => TemplateError::Syntax {
            message: error_message(err),
            line: err.line(),
        },
        _ if err.detail() == Some("recursion limit exceeded") => TemplateError::Limit(format!(
            "template nests deeper than {} levels",
            limits.recursion
        )),
        _ => TemplateError::Render {
            message: error_message(err),
            line: err.line(),
        },
    }
}

/// Rewrites HF's `{% generation %}` / `{% endgeneration %}` tags (transformers' assistant-mask
/// extension, which renders its body unchanged) into an equivalent `{% if true %}` block, keeping
/// whitespace-control markers so trimming behaves the same.
fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        match parse_generation_tag(tag) {
            Some((len, open_mark, is_end, close_mark)) => {
                out.push_str("{%");
                out.push_str(open_mark);
                out.push_str(if is_end { " endif " } else { " if true " });
                out.push_str(close_mark);
                out.push_str("%}");
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// Parses `{%[-+] generation|endgeneration [-+]%}` at the start of `tag`; returns its length,
/// the whitespace markers and whether it is the end tag.
fn parse_generation_tag(tag: &str) -> Option<(usize, &str, bool, &str)> {
    let mut pos = 2;
    let open_mark = match tag[pos..].chars().next() {
        Some('-' | '+') => {
            pos += 1;
            &tag[pos - 1..pos]
        }
        _ => "",
    };
    pos += tag[pos..].len() - tag[pos..].trim_start().len();
    let is_end = if tag[pos..].starts_with("endgeneration") {
        pos += "endgeneration".len();
        true
    } else if tag[pos..].starts_with("generation") {
        pos += "generation".len();
        false
    } else {
        return None;
    };
    pos += tag[pos..].len() - tag[pos..].trim_start().len();
    let close_mark = match tag[pos..].chars().next() {
        Some('-' | '+') => {
            pos += 1;
            &tag[pos - 1..pos]
        }
        _ => "",
    };
    if tag[pos..].starts_with("%}") {
        Some((pos + 2, open_mark, is_end, close_mark))
    } else {
        None
    }
}

/// Prints values the way Jinja2 (Python's `str()`) does: `None`, `True`/`False`, `1.0`,
/// `['a', 1]`, `{'k': 'v'}`.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::String
        | ValueKind::None
        | ValueKind::Bool
        | ValueKind::Number
        | ValueKind::Seq
        | ValueKind::Map => out
            .write_str(&python_str(value))
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output")),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Jinja2's `string` filter: Python's `str()`.
fn python_string_filter(value: &Value) -> Value {
    match value.kind() {
        ValueKind::String => value.clone(),
        _ => Value::from(python_str(value)),
    }
}

/// Python's `str(value)`.
fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        ValueKind::Undefined => String::new(),
        _ => {
            let mut out = String::new();
            python_repr_into(&mut out, value, 0);
            out
        }
    }
}

/// Python's `repr(value)` for the value types that occur in chat templates.
fn python_repr_into(out: &mut String, value: &Value, depth: usize) {
    if depth > MAX_VALUE_DEPTH {
        out.push_str("...");
        return;
    }
    match value.kind() {
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float_repr(f, FloatStyle::Python));
            }
        }
        ValueKind::String => python_str_repr_into(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut count = 0;
            if let Ok(iter) = value.try_iter() {
                for item in iter {
                    if count > 0 {
                        out.push_str(", ");
                    }
                    python_repr_into(out, &item, depth + 1);
                    count += 1;
                }
            }
            if tuple && count == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr_into(out, &key, depth + 1);
                    out.push_str(": ");
                    let item = value.get_item(&key).unwrap_or_default();
                    python_repr_into(out, &item, depth + 1);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr()` of a string: single quotes unless the text has single but no double quotes.
fn python_str_repr_into(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || ((c as u32) >= 0x7f && (c as u32) <= 0xa0) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if matches!(c, '\u{ad}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{feff}') =>
            {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FloatStyle {
    /// `str(float)`: `nan`, `inf`.
    Python,
    /// `json.dumps(float)`: `NaN`, `Infinity`.
    Json,
}

/// Python's shortest round-trip float repr (`1.0`, `0.1`, `1e+16`, `1e-05`).
fn python_float_repr(f: f64, style: FloatStyle) -> String {
    if f.is_nan() {
        return match style {
            FloatStyle::Python => "nan".into(),
            FloatStyle::Json => "NaN".into(),
        };
    }
    if f.is_infinite() {
        let body = match style {
            FloatStyle::Python => "inf",
            FloatStyle::Json => "Infinity",
        };
        return if f < 0.0 {
            format!("-{body}")
        } else {
            body.into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits, e.g. "-1.25e-7"; Python uses the
    // same digits and switches to exponent notation outside 1e-4 <= |f| < 1e16.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let decpt = exp + 1;
    let mut out = String::from(sign);
    if decpt > -4 && decpt <= 16 {
        if decpt <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', decpt.unsigned_abs() as usize));
            out.push_str(&digits);
        } else {
            let decpt = decpt as usize;
            if decpt >= digits.len() {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', decpt - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..decpt]);
                out.push('.');
                out.push_str(&digits[decpt..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
    out
}

/// How `tojson` lays out its output (Python `json.dumps` options).
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    max_len: usize,
}

/// HF's `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, taking the same positional and keyword arguments.
fn tojson(max_len: usize, value: &Value, args: &[Value]) -> Result<Value, Error> {
    let (args, kwargs) = from_args::<(&[Value], Kwargs)>(args)?;
    if args.len() > 4 {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 positional arguments",
        ));
    }
    let mut positional = args.iter().cloned();
    let ensure_ascii = positional.next();
    let indent = positional.next();
    let separators = positional.next();
    let sort_keys = positional.next();
    let ensure_ascii = kwargs
        .get::<Option<Value>>("ensure_ascii")?
        .or(ensure_ascii);
    let indent = kwargs.get::<Option<Value>>("indent")?.or(indent);
    let separators = kwargs.get::<Option<Value>>("separators")?.or(separators);
    let sort_keys = kwargs.get::<Option<Value>>("sort_keys")?.or(sort_keys);
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.kind() {
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            ValueKind::Bool => Some(if v.is_true() {
                " ".into()
            } else {
                String::new()
            }),
            ValueKind::Number if v.is_integer() => {
                let n = v.as_i64().unwrap_or(0).clamp(0, 64) as usize;
                Some(" ".repeat(n))
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent must be an integer or a string, got {v}"),
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => (
                    item.as_str().unwrap_or_default().to_owned(),
                    key.as_str().unwrap_or_default().to_owned(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let style = JsonStyle {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        max_len,
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    if level > MAX_VALUE_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nests too deeply (or contains itself)",
        ));
    }
    if out.len() > style.max_len {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: output is larger than {} bytes", style.max_len),
        ));
    }
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&python_float_repr(f, FloatStyle::Json));
            }
        }
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                json_newline(out, style, level + 1);
                write_json(out, item, style, level + 1)?;
            }
            json_newline(out, style, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                json_newline(out, style, level + 1);
                write_json_str(out, key, style);
                out.push_str(&style.key_sep);
                write_json(out, item, style, level + 1)?;
            }
            json_newline(out, style, level);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

fn json_newline(out: &mut String, style: &JsonStyle, level: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

/// Python's `json.dumps` turns non-string keys into strings.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_owned(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => python_float_repr(f64::try_from(key.clone())?, FloatStyle::Json),
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

fn write_json_str(out: &mut String, s: &str, style: &JsonStyle) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (style.ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    //! Expected strings in the tests marked "generated" were produced once with Python
    //! jinja2 3.1.6 configured exactly like transformers' `_compile_jinja_template`
    //! (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`, loopcontrols,
    //! the `generation` extension, `tojson` = `json.dumps(ensure_ascii=False)`,
    //! `raise_exception`, `strftime_now`) and rendered like `apply_chat_template`
    //! (`messages`, `tools`, `documents=None`, `add_generation_prompt`, special tokens, extra
    //! kwargs), then pasted in as literals.

    use super::*;
    use std::time::{Duration, Instant};

    fn parse(json: &str) -> serde_json::Value {
        serde_json::from_str(json).expect("test JSON parses")
    }

    fn template_source(name: &str) -> String {
        let path = format!("{}/tests/data/templates/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {path}: {err}"))
    }

    fn render_source(
        source: &str,
        bos: &str,
        eos: &str,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Value>,
    ) -> Result<String, TemplateError> {
        let template = ChatTemplate::new(source, bos, eos)?;
        let messages = messages.as_array().expect("messages is an array");
        let tools = tools.map(|t| t.as_array().expect("tools is an array").as_slice());
        template.render(&RenderInput {
            messages,
            tools,
            add_generation_prompt,
            extra,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn check_source(
        source: &str,
        bos: &str,
        eos: &str,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Value>,
        expected: &str,
    ) {
        let got = render_source(
            source,
            bos,
            eos,
            messages,
            tools,
            add_generation_prompt,
            extra,
        )
        .unwrap_or_else(|err| panic!("render failed: {err}"));
        assert_eq!(got, expected);
    }

    #[allow(clippy::too_many_arguments)]
    fn check(
        name: &str,
        bos: &str,
        eos: &str,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Value>,
        expected: &str,
    ) {
        let source = template_source(name);
        check_source(
            &source,
            bos,
            eos,
            messages,
            tools,
            add_generation_prompt,
            extra,
            expected,
        );
    }

    fn render_inline(source: &str) -> Result<String, TemplateError> {
        render_source(source, "", "", &parse("[]"), None, false, None)
    }

    /// `dd Mon yyyy`, the shape `strftime_now("%d %b %Y")` must produce.
    fn is_day_month_year(s: &str) -> bool {
        let parts: Vec<&str> = s.split(' ').collect();
        parts.len() == 3
            && parts[0].len() == 2
            && parts[0].chars().all(|c| c.is_ascii_digit())
            && [
                "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
            ]
            .contains(&parts[1])
            && parts[2].len() == 4
            && parts[2].chars().all(|c| c.is_ascii_digit())
    }

    #[test]
    fn chat_template_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }

    #[test]
    fn renders_repeatedly_with_different_inputs() {
        let template = ChatTemplate::new(
            &template_source("HuggingFaceTB-SmolLM2-Instruct.jinja"),
            "",
            "",
        )
        .expect("compiles");
        for text in ["one", "two"] {
            let messages = [serde_json::json!({"role": "system", "content": text})];
            let got = template
                .render(&RenderInput {
                    messages: &messages,
                    tools: None,
                    add_generation_prompt: false,
                    extra: None,
                })
                .expect("renders");
            assert_eq!(got, format!("<|im_start|>system\n{text}<|im_end|>\n"));
        }
    }

    #[test]
    fn raise_exception_from_real_template() {
        // Mistral Nemo rejects two user turns in a row.
        let messages =
            parse(r#"[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]"#);
        let source = template_source("mistralai-Mistral-Nemo-Instruct-2407.jinja");
        let err = render_source(&source, "<s>", "</s>", &messages, None, false, None)
            .expect_err("must raise");
        match err {
            TemplateError::Raised(message) => assert_eq!(
                message,
                "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."
            ),
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    #[test]
    fn raise_exception_message_and_display() {
        let messages = parse(r#"[{"role": "tool", "content": "x"}]"#);
        let err = render_source(
            "{% if messages[0].role == 'tool' %}{{ raise_exception('bad role: ' + messages[0].role) }}{% endif %}ok",
            "",
            "",
            &messages,
            None,
            false,
            None,
        )
        .expect_err("must raise");
        assert!(
            matches!(&err, TemplateError::Raised(m) if m == "bad role: tool"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "chat template raised an exception: bad role: tool"
        );
    }

    #[test]
    fn syntax_errors_are_errors_not_panics() {
        for (source, line) in [
            ("{% if %}x{% endif %}", 1),
            ("a\n{% for x in %}{% endfor %}", 2),
            ("{{ unclosed", 1),
            ("{% for m in messages %}no end", 1),
            ("{{ 'x' | }}", 1),
            ("{% endif %}", 1),
        ] {
            match ChatTemplate::new(source, "", "") {
                Err(TemplateError::Syntax { message, line: got }) => {
                    assert!(!message.is_empty());
                    assert_eq!(got, Some(line), "{source:?}: {message}");
                }
                Err(other) => panic!("{source:?}: expected Syntax, got {other:?}"),
                Ok(_) => panic!("{source:?}: compiled"),
            }
        }
    }

    #[test]
    fn unknown_filter_is_a_render_or_syntax_error() {
        let err = render_inline("{{ 'x' | no_such_filter }}").expect_err("unknown filter");
        assert!(
            matches!(
                err,
                TemplateError::Syntax { .. } | TemplateError::Render { .. }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn huge_range_errors_quickly() {
        let start = Instant::now();
        let err =
            render_inline("{% for i in range(100000000) %}x{% endfor %}").expect_err("too big");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        assert!(
            matches!(err, TemplateError::Render { .. } | TemplateError::Limit(_)),
            "{err:?}"
        );
    }

    #[test]
    fn runaway_nested_loop_runs_out_of_fuel_within_a_second() {
        let start = Instant::now();
        let err = render_inline(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        )
        .expect_err("must stop");
        let elapsed = start.elapsed();
        assert!(matches!(err, TemplateError::Limit(_)), "{err:?}");
        assert!(elapsed < Duration::from_secs(1), "took {elapsed:?}");
    }

    #[test]
    fn runaway_recursion_is_a_limit_error() {
        let err = render_inline("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
            .expect_err("must stop");
        assert!(matches!(err, TemplateError::Limit(_)), "{err:?}");
    }

    #[test]
    fn output_size_is_capped() {
        let limits = Limits {
            max_output_bytes: 1000,
            ..Limits::default()
        };
        let template = ChatTemplate::with_limits(
            "{% for i in range(10000) %}xxxxxxxxxx{% endfor %}",
            "",
            "",
            limits,
        )
        .expect("compiles");
        let input = RenderInput {
            messages: &[],
            tools: None,
            add_generation_prompt: false,
            extra: None,
        };
        let err = template.render(&input).expect_err("too large");
        assert!(matches!(err, TemplateError::Limit(_)), "{err:?}");
        // tojson of something large is capped too.
        let template = ChatTemplate::with_limits("{{ range(10000)|list|tojson }}", "", "", limits)
            .expect("compiles");
        assert!(template.render(&input).is_err());
        // A billion-byte string is refused by the engine itself.
        assert!(render_inline("{{ 'x' * 1000000000 }}").is_err());
    }

    #[test]
    fn strftime_now_renders_the_date() {
        let got = render_inline("{{ strftime_now('%d %b %Y') }}").expect("renders");
        assert!(is_day_month_year(&got), "{got:?}");
        let iso = render_inline("{{ strftime_now('%Y-%m-%d %H:%M') }}").expect("renders");
        assert_eq!(iso.len(), 16, "{iso:?}");
        assert_eq!(&iso[..4], &got[7..], "years agree");
    }

    #[test]
    fn llama32_uses_strftime_now_when_no_date_given() {
        let messages = parse(r#"[{"role": "user", "content": "Hi"}]"#);
        let got = render_source(
            &template_source("meta-llama-Llama-3.2-3B-Instruct.jinja"),
            "<|begin_of_text|>",
            "<|eot_id|>",
            &messages,
            None,
            true,
            None,
        )
        .expect("renders");
        let date = got
            .split("Today Date: ")
            .nth(1)
            .and_then(|rest| rest.split('\n').next())
            .expect("has a date line");
        assert!(is_day_month_year(date), "{date:?}");
        let expected_tail = "\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
        assert!(got.ends_with(expected_tail), "{got:?}");
    }

    #[test]
    fn extra_must_be_an_object_without_reserved_keys() {
        let messages = parse("[]");
        for extra in [
            parse("[1]"),
            parse(r#"{"messages": []}"#),
            parse(r#"{"add_generation_prompt": true}"#),
        ] {
            let err = render_source("x", "", "", &messages, None, false, Some(&extra))
                .expect_err("rejected");
            assert!(matches!(err, TemplateError::Input(_)), "{err:?}");
        }
        // bos/eos may be overridden, like HF's special-token kwargs.
        let extra = parse(r#"{"bos_token": "<B>"}"#);
        let got = render_source(
            "{{ bos_token }}{{ eos_token }}",
            "<s>",
            "</s>",
            &messages,
            None,
            false,
            Some(&extra),
        )
        .expect("renders");
        assert_eq!(got, "<B></s>");
    }

    #[test]
    fn undefined_attribute_and_type_errors_are_render_errors() {
        // HF (jinja2) fails here too: str + list, attribute of undefined.
        let messages = parse(r#"[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]"#);
        let source = template_source("HuggingFaceTB-SmolLM2-Instruct.jinja");
        let err =
            render_source(&source, "", "", &messages, None, false, None).expect_err("str + list");
        assert!(matches!(err, TemplateError::Render { .. }), "{err:?}");
        let err = render_inline("{{ nothing.attr.deeper }}").expect_err("undefined.attr");
        assert!(matches!(err, TemplateError::Render { .. }), "{err:?}");
    }

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456.789, "123456.789"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (-2.5, "-2.5"),
        ] {
            assert_eq!(python_float_repr(f, FloatStyle::Python), want, "{f:e}");
        }
        assert_eq!(python_float_repr(f64::NAN, FloatStyle::Json), "NaN");
        assert_eq!(
            python_float_repr(f64::NEG_INFINITY, FloatStyle::Json),
            "-Infinity"
        );
        assert_eq!(python_float_repr(f64::INFINITY, FloatStyle::Python), "inf");
    }

    #[test]
    fn self_referencing_namespace_does_not_overflow() {
        let err = render_inline("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns|tojson }}");
        assert!(err.is_err(), "{err:?}");
    }

    // ---- generated (see module comment) ----

    #[test]
    fn qwen25_system_user() {
        let messages = parse(
            r#"[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}]"#,
        );
        let tools = None;
        let extra = None;
        let expected = concat!(
            "<|im_start|>system\n",
            "You are terse.<|im_end|>\n",
            "<|im_start|>user\n",
            "Hi there!<|im_end|>\n",
            "<|im_start|>assistant\n",
        );
        check(
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            "",
            "",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn qwen25_default_system_multi_turn() {
        let messages = parse(
            r#"[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]"#,
        );
        let tools = None;
        let extra = None;
        let expected = concat!(
            "<|im_start|>system\n",
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n",
            "<|im_start|>user\n",
            "What is 2+2?<|im_end|>\n",
            "<|im_start|>assistant\n",
            "4<|im_end|>\n",
            "<|im_start|>user\n",
            "And 3+3?<|im_end|>\n",
            "<|im_start|>assistant\n",
        );
        check(
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            "",
            "",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn qwen25_tools() {
        let messages = parse(r#"[{"role": "user", "content": "Weather in Paris?"}]"#);
        let tools = Some(parse(
            r#"[{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city — returns °C", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name, e.g. Zürich"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}, {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": {"b": {"type": "number"}, "a": {"type": "number", "default": 1.5}}, "required": ["a", "b"]}}}]"#,
        ));
        let extra = None;
        let expected = concat!(
        "<|im_start|>system\n",
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n",
        "\n",
        "# Tools\n",
        "\n",
        "You may call one or more functions to assist with the user query.\n",
        "\n",
        "You are provided with function signatures within <tools></tools> XML tags:\n",
        "<tools>\n",
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the current weather in a city — returns °C\", \"parameters\": {\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \"description\": \"City name, e.g. Zürich\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}}, \"required\": [\"location\"]}}}\n",
        "{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two numbers\", \"parameters\": {\"type\": \"object\", \"properties\": {\"b\": {\"type\": \"number\"}, \"a\": {\"type\": \"number\", \"default\": 1.5}}, \"required\": [\"a\", \"b\"]}}}\n",
        "</tools>\n",
        "\n",
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n",
        "<tool_call>\n",
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n",
        "</tool_call><|im_end|>\n",
        "<|im_start|>user\n",
        "Weather in Paris?<|im_end|>\n",
        "<|im_start|>assistant\n",
    );
        check(
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            "",
            "",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn qwen25_tool_calls_and_responses() {
        let messages = parse(
            r#"[{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris and 2+3?"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}}, {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"ensoleillé\"}"}, {"role": "tool", "tool_call_id": "call_2", "content": "5"}]"#,
        );
        let tools = Some(parse(
            r#"[{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city — returns °C", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name, e.g. Zürich"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}, {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": {"b": {"type": "number"}, "a": {"type": "number", "default": 1.5}}, "required": ["a", "b"]}}}]"#,
        ));
        let extra = None;
        let expected = concat!(
        "<|im_start|>system\n",
        "Use tools.\n",
        "\n",
        "# Tools\n",
        "\n",
        "You may call one or more functions to assist with the user query.\n",
        "\n",
        "You are provided with function signatures within <tools></tools> XML tags:\n",
        "<tools>\n",
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the current weather in a city — returns °C\", \"parameters\": {\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \"description\": \"City name, e.g. Zürich\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}}, \"required\": [\"location\"]}}}\n",
        "{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two numbers\", \"parameters\": {\"type\": \"object\", \"properties\": {\"b\": {\"type\": \"number\"}, \"a\": {\"type\": \"number\", \"default\": 1.5}}, \"required\": [\"a\", \"b\"]}}}\n",
        "</tools>\n",
        "\n",
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n",
        "<tool_call>\n",
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n",
        "</tool_call><|im_end|>\n",
        "<|im_start|>user\n",
        "Weather in Paris and 2+3?<|im_end|>\n",
        "<|im_start|>assistant\n",
        "<tool_call>\n",
        "{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"unit\": \"celsius\"}}\n",
        "</tool_call>\n",
        "<tool_call>\n",
        "{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n",
        "</tool_call><|im_end|>\n",
        "<|im_start|>user\n",
        "<tool_response>\n",
        "{\"temp\": 21, \"sky\": \"ensoleillé\"}\n",
        "</tool_response>\n",
        "<tool_response>\n",
        "5\n",
        "</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n",
    );
        check(
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            "",
            "",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn llama32_basic() {
        let messages = parse(
            r#"[{"role": "system", "content": "You are a pirate.  "}, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Arr!"}, {"role": "user", "content": " Where is the treasure? "}]"#,
        );
        let tools = None;
        let extra = Some(parse(r#"{"date_string": "26 Jul 2024"}"#));
        let expected = concat!(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n",
            "\n",
            "Cutting Knowledge Date: December 2023\n",
            "Today Date: 26 Jul 2024\n",
            "\n",
            "You are a pirate.<|eot_id|><|start_header_id|>user<|end_header_id|>\n",
            "\n",
            "Hello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n",
            "\n",
            "Arr!<|eot_id|><|start_header_id|>user<|end_header_id|>\n",
            "\n",
            "Where is the treasure?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n",
            "\n",
        );
        check(
            "meta-llama-Llama-3.2-3B-Instruct.jinja",
            "<|begin_of_text|>",
            "<|eot_id|>",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn llama32_tools() {
        let messages = parse(
            r#"[{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]}, {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21°C"}]"#,
        );
        let tools = Some(parse(
            r#"[{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city — returns °C", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name, e.g. Zürich"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}, {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": {"b": {"type": "number"}, "a": {"type": "number", "default": 1.5}}, "required": ["a", "b"]}}}]"#,
        ));
        let extra = Some(parse(r#"{"date_string": "26 Jul 2024"}"#));
        let expected = concat!(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n",
        "\n",
        "Environment: ipython\n",
        "Cutting Knowledge Date: December 2023\n",
        "Today Date: 26 Jul 2024\n",
        "\n",
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n",
        "\n",
        "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n",
        "\n",
        "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n",
        "\n",
        "{\n",
        "    \"type\": \"function\",\n",
        "    \"function\": {\n",
        "        \"name\": \"get_weather\",\n",
        "        \"description\": \"Get the current weather in a city — returns °C\",\n",
        "        \"parameters\": {\n",
        "            \"type\": \"object\",\n",
        "            \"properties\": {\n",
        "                \"location\": {\n",
        "                    \"type\": \"string\",\n",
        "                    \"description\": \"City name, e.g. Zürich\"\n",
        "                },\n",
        "                \"unit\": {\n",
        "                    \"type\": \"string\",\n",
        "                    \"enum\": [\n",
        "                        \"celsius\",\n",
        "                        \"fahrenheit\"\n",
        "                    ]\n",
        "                }\n",
        "            },\n",
        "            \"required\": [\n",
        "                \"location\"\n",
        "            ]\n",
        "        }\n",
        "    }\n",
        "}\n",
        "\n",
        "{\n",
        "    \"type\": \"function\",\n",
        "    \"function\": {\n",
        "        \"name\": \"add\",\n",
        "        \"description\": \"Add two numbers\",\n",
        "        \"parameters\": {\n",
        "            \"type\": \"object\",\n",
        "            \"properties\": {\n",
        "                \"b\": {\n",
        "                    \"type\": \"number\"\n",
        "                },\n",
        "                \"a\": {\n",
        "                    \"type\": \"number\",\n",
        "                    \"default\": 1.5\n",
        "                }\n",
        "            },\n",
        "            \"required\": [\n",
        "                \"a\",\n",
        "                \"b\"\n",
        "            ]\n",
        "        }\n",
        "    }\n",
        "}\n",
        "\n",
        "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n",
        "\n",
        "{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Paris\"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n",
        "\n",
        "\"sunny, 21°C\"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n",
        "\n",
    );
        check(
            "meta-llama-Llama-3.2-3B-Instruct.jinja",
            "<|begin_of_text|>",
            "<|eot_id|>",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn mistral_basic() {
        let messages = parse(
            r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]"#,
        );
        let tools = None;
        let extra = None;
        let expected = concat!(
            "<s>[INST]Hi[/INST]Hello!</s>[INST]Be brief.\n",
            "\n",
            "Bye[/INST]",
        );
        check(
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            "<s>",
            "</s>",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn mistral_tools() {
        let messages = parse(
            r#"[{"role": "user", "content": "Add 2 and 3"}, {"role": "assistant", "tool_calls": [{"id": "abcDEF123", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}, {"role": "tool", "tool_call_id": "abcDEF123", "content": "5"}, {"role": "assistant", "content": "It is 5."}, {"role": "user", "content": "Thanks"}]"#,
        );
        let tools = Some(parse(
            r#"[{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city — returns °C", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name, e.g. Zürich"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}, {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": {"b": {"type": "number"}, "a": {"type": "number", "default": 1.5}}, "required": ["a", "b"]}}}]"#,
        ));
        let extra = None;
        let expected = "<s>[INST]Add 2 and 3[/INST][TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}, \"id\": \"abcDEF123\"}]</s>[TOOL_RESULTS]{\"content\": 5, \"call_id\": \"abcDEF123\"}[/TOOL_RESULTS]It is 5.</s>[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the current weather in a city — returns °C\", \"parameters\": {\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \"description\": \"City name, e.g. Zürich\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}}, \"required\": [\"location\"]}}}, {\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two numbers\", \"parameters\": {\"type\": \"object\", \"properties\": {\"b\": {\"type\": \"number\"}, \"a\": {\"type\": \"number\", \"default\": 1.5}}, \"required\": [\"a\", \"b\"]}}}][/AVAILABLE_TOOLS][INST]Thanks[/INST]";
        check(
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            "<s>",
            "</s>",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn smollm2_default_system() {
        let messages = parse(
            r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]"#,
        );
        let tools = None;
        let extra = None;
        let expected = concat!(
            "<|im_start|>system\n",
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
            "<|im_start|>user\n",
            "Hi<|im_end|>\n",
            "<|im_start|>assistant\n",
            "Hello!<|im_end|>\n",
            "<|im_start|>user\n",
            "How are you?<|im_end|>\n",
            "<|im_start|>assistant\n",
        );
        check(
            "HuggingFaceTB-SmolLM2-Instruct.jinja",
            "",
            "",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn smollm2_own_system() {
        let messages = parse(
            r#"[{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"}]"#,
        );
        let tools = None;
        let extra = None;
        let expected = concat!(
            "<|im_start|>system\n",
            "Be nice.<|im_end|>\n",
            "<|im_start|>user\n",
            "Hi<|im_end|>\n",
        );
        check(
            "HuggingFaceTB-SmolLM2-Instruct.jinja",
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn qwen3_thinking_history_no_think() {
        let messages = parse(
            r#"[{"role": "system", "content": "Think carefully."}, {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "<think>\nTwo plus two.\n</think>\n\n4"}, {"role": "user", "content": "And 3+3?"}]"#,
        );
        let tools = None;
        let extra = Some(parse(r#"{"enable_thinking": false}"#));
        let expected = concat!(
            "<|im_start|>system\n",
            "Think carefully.<|im_end|>\n",
            "<|im_start|>user\n",
            "What is 2+2?<|im_end|>\n",
            "<|im_start|>assistant\n",
            "4<|im_end|>\n",
            "<|im_start|>user\n",
            "And 3+3?<|im_end|>\n",
            "<|im_start|>assistant\n",
            "<think>\n",
            "\n",
            "</think>\n",
            "\n",
        );
        check(
            "Qwen-Qwen3-0.6B.jinja",
            "",
            "",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn qwen3_tool_loop() {
        let messages = parse(
            r#"[{"role": "user", "content": "Add 2 and 3"}, {"role": "assistant", "content": "<think>\nI should call add.\n</think>\n\n", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "assistant", "reasoning_content": "The tool said 5.", "content": "The answer is 5."}]"#,
        );
        let tools = Some(parse(
            r#"[{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city — returns °C", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name, e.g. Zürich"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}, {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": {"b": {"type": "number"}, "a": {"type": "number", "default": 1.5}}, "required": ["a", "b"]}}}]"#,
        ));
        let extra = None;
        let expected = concat!(
        "<|im_start|>system\n",
        "# Tools\n",
        "\n",
        "You may call one or more functions to assist with the user query.\n",
        "\n",
        "You are provided with function signatures within <tools></tools> XML tags:\n",
        "<tools>\n",
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the current weather in a city — returns °C\", \"parameters\": {\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \"description\": \"City name, e.g. Zürich\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}}, \"required\": [\"location\"]}}}\n",
        "{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two numbers\", \"parameters\": {\"type\": \"object\", \"properties\": {\"b\": {\"type\": \"number\"}, \"a\": {\"type\": \"number\", \"default\": 1.5}}, \"required\": [\"a\", \"b\"]}}}\n",
        "</tools>\n",
        "\n",
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n",
        "<tool_call>\n",
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n",
        "</tool_call><|im_end|>\n",
        "<|im_start|>user\n",
        "Add 2 and 3<|im_end|>\n",
        "<|im_start|>assistant\n",
        "<think>\n",
        "I should call add.\n",
        "</think>\n",
        "\n",
        "<tool_call>\n",
        "{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n",
        "</tool_call><|im_end|>\n",
        "<|im_start|>user\n",
        "<tool_response>\n",
        "5\n",
        "</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n",
        "<think>\n",
        "The tool said 5.\n",
        "</think>\n",
        "\n",
        "The answer is 5.<|im_end|>\n",
    );
        check(
            "Qwen-Qwen3-0.6B.jinja",
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn tojson_options() {
        let source = concat!(
            "{{ x|tojson }}\n",
            "{{ x|tojson(indent=2) }}\n",
            "{{ x|tojson(separators=(',', ':'), sort_keys=true) }}\n",
            "{{ x|tojson(ensure_ascii=true) }}\n",
            "{{ x.b|tojson(indent='\t') }}\n",
            "{{ 'plain'|tojson }}{{ none|tojson }}{{ 3|tojson }}",
        );
        let messages = parse(r#"[]"#);
        let tools = None;
        let extra = Some(parse(
            r#"{"x": {"b": [1, 2.0, 1e+16, 1e-05, 0.0001, 0.1, -0.0, 123456789012345678, true, null, "é😀\n\"\u0001\\/\t"], "a": {}, "c": [], "1": "x", "ü": [[]]}}"#,
        ));
        let expected = concat!(
        "{\"b\": [1, 2.0, 1e+16, 1e-05, 0.0001, 0.1, -0.0, 123456789012345678, true, null, \"é😀\\n\\\"\\u0001\\\\/\\t\"], \"a\": {}, \"c\": [], \"1\": \"x\", \"ü\": [[]]}\n",
        "{\n",
        "  \"b\": [\n",
        "    1,\n",
        "    2.0,\n",
        "    1e+16,\n",
        "    1e-05,\n",
        "    0.0001,\n",
        "    0.1,\n",
        "    -0.0,\n",
        "    123456789012345678,\n",
        "    true,\n",
        "    null,\n",
        "    \"é😀\\n\\\"\\u0001\\\\/\\t\"\n",
        "  ],\n",
        "  \"a\": {},\n",
        "  \"c\": [],\n",
        "  \"1\": \"x\",\n",
        "  \"ü\": [\n",
        "    []\n",
        "  ]\n",
        "}\n",
        "{\"1\":\"x\",\"a\":{},\"b\":[1,2.0,1e+16,1e-05,0.0001,0.1,-0.0,123456789012345678,true,null,\"é😀\\n\\\"\\u0001\\\\/\\t\"],\"c\":[],\"ü\":[[]]}\n",
        "{\"b\": [1, 2.0, 1e+16, 1e-05, 0.0001, 0.1, -0.0, 123456789012345678, true, null, \"\\u00e9\\ud83d\\ude00\\n\\\"\\u0001\\\\/\\t\"], \"a\": {}, \"c\": [], \"1\": \"x\", \"\\u00fc\": [[]]}\n",
        "[\n",
        "\t1,\n",
        "\t2.0,\n",
        "\t1e+16,\n",
        "\t1e-05,\n",
        "\t0.0001,\n",
        "\t0.1,\n",
        "\t-0.0,\n",
        "\t123456789012345678,\n",
        "\ttrue,\n",
        "\tnull,\n",
        "\t\"é😀\\n\\\"\\u0001\\\\/\\t\"\n",
        "]\n",
        "\"plain\"null3",
    );
        check_source(
            source,
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn python_printing() {
        let source = "{{ none }}|{{ true }}|{{ [1, 'a', none, false, 2.5] }}|{{ {'k': \"it's\", 'n': {'m': []}} }}|{{ 1.0 }}|{{ 0.1 + 0.2 }}|{{ 1e16 }}|{{ x }}|{{ 3|string }}|{{ none|string }}|{{ y }}";
        let messages = parse(r#"[]"#);
        let tools = None;
        let extra = Some(parse(
            r#"{"x": {"b": [1, 2.0, null, true], "s": "q\"'\n"}, "y": 1e-07}"#,
        ));
        let expected = "None|True|[1, 'a', None, False, 2.5]|{'k': \"it's\", 'n': {'m': []}}|1.0|0.30000000000000004|1e+16|{'b': [1, 2.0, None, True], 's': 'q\"\\'\\n'}|3|None|1e-07";
        check_source(
            source,
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn namespace_lists_change_in_place_as_in_python() {
        let source = "{% set ns = namespace(ids=[], n=1, name='x') %}{% set _ = ns.ids.append('a') %}{% set _ = ns.ids.append('b') %}{% set _ = ns.ids.append('c') %}{{ ns.ids|length }} {{ ns.ids[0] }} {{ ns.ids[-1] }} {{ ns.ids.pop(0) }} {{ ns.ids.pop() }} {% for i in ns.ids %}[{{ i }}]{% endfor %} {{ ns.n }} {{ ns.name }}{% if ns.ids %} some{% endif %}";
        assert_eq!(render_inline(source).unwrap(), "3 a c a c [b] 1 x some");
        let err = render_inline("{% set ns = namespace(ids=[]) %}{{ ns.ids.pop() }}").unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
        assert_eq!(
            render_inline("{% set ns = namespace() %}{% set ns.a = 2 %}{{ ns.a }}").unwrap(),
            "2"
        );
        let err = render_inline(
            "{% set ns = namespace(a=[]) %}{% set _ = ns.a.append(ns.a) %}{{ ns.a }}",
        )
        .unwrap_err();
        assert!(err.to_string().contains("cannot hold"), "{err}");
    }

    #[test]
    fn kimi_k2_thinking_renders_tool_calls_and_their_results() {
        let messages = parse(
            r#"[{"role": "user", "content": "Weather in Paris and Oslo?"}, {"role": "assistant", "content": "", "reasoning_content": "Two cities.", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}, {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}, {"role": "tool", "tool_call_id": "a", "content": "sunny"}, {"role": "tool", "tool_call_id": "b", "content": "rain"}]"#,
        );
        let got = render_source(
            &template_source("Kimi-K2-Thinking.jinja"),
            "",
            "",
            &messages,
            None,
            true,
            None,
        )
        .unwrap();
        for want in [
            "<think>Two cities.</think>",
            "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>",
            "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|>",
            "## Return of functions.get_weather:0\nsunny",
            "## Return of functions.get_weather:1\nrain",
        ] {
            assert!(got.contains(want), "{want:?} in {got}");
        }
        assert!(
            got.ends_with("<|im_assistant|>assistant<|im_middle|>"),
            "{got}"
        );
    }

    #[test]
    fn pycompat_methods() {
        let source = "{{ '  hi  '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'x y  z'.split() }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith('x') }}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{{ d.get('missing', 'dflt') }}|{{ d.get('b') }}|{{ '\\n\\nx\\n'.lstrip('\\n') }}|{{ 'A-B'.lower().replace('-', '_') }}|{{ d.keys()|list }}|{{ 'ab'.upper() }}";
        let messages = parse(r#"[]"#);
        let tools = None;
        let extra = Some(parse(r#"{"d": {"b": 2, "a": 1}}"#));
        let expected = concat!(
            "hi|['a', 'b']|['x', 'y', 'z']|True|False|b=2;a=1;|dflt|2|x\n",
            "|a_b|['b', 'a']|AB",
        );
        check_source(
            source,
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn content_parts_handled() {
        let source = concat!(
        "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'text' %}[{{ p.text }}]{% endif %}{% endfor %}{% endif %}\n",
        "{% endfor %}",
    );
        let messages = parse(
            r#"[{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "two"}]}, {"role": "assistant", "content": "plain"}]"#,
        );
        let tools = None;
        let extra = None;
        let expected = "user:[one][two]assistant:plain";
        check_source(
            source,
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn content_parts_printed() {
        let source = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
        let messages = parse(r#"[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]"#);
        let tools = None;
        let extra = None;
        let expected = "[{'type': 'text', 'text': 'hi'}]";
        check_source(
            source,
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn generation_tags() {
        let source = concat!(
            "{% for m in messages %}\n",
            "  {%- if m.role == 'assistant' %}\n",
            "    {%- generation %}\n",
            "{{ m.content }}!\n",
            "    {%- endgeneration %}\n",
            "  {% else %}\n",
            "{{ m.content }}\n",
            "  {% endif %}\n",
            "{% endfor %}",
        );
        let messages =
            parse(r#"[{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]"#);
        let tools = None;
        let extra = None;
        let expected = concat!("u\n", "a!",);
        check_source(
            source,
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn tools_none_when_absent() {
        let source = "{{ tools is none }}|{{ tools is defined }}|{{ documents is none }}|{{ add_generation_prompt }}|{{ foo is defined }}";
        let messages = parse(r#"[]"#);
        let tools = None;
        let extra = None;
        let expected = "True|True|True|True|False";
        check_source(
            source,
            "",
            "",
            &messages,
            tools.as_ref(),
            true,
            extra.as_ref(),
            expected,
        );
    }

    #[test]
    fn trim_and_lstrip_blocks() {
        let source = concat!(
            "<a>\n",
            "  {% if true %}\n",
            "    x\n",
            "  {% endif %}\n",
            "  {#- c #}\n",
            "<b>\n",
        );
        let messages = parse(r#"[]"#);
        let tools = None;
        let extra = None;
        let expected = concat!("<a>\n", "    x\n", "<b>",);
        check_source(
            source,
            "",
            "",
            &messages,
            tools.as_ref(),
            false,
            extra.as_ref(),
            expected,
        );
    }
}
