//! Constrained decoding: at each step, only the tokens that keep the output inside a grammar
//! may be sampled, so a JSON schema, "any JSON object" or a forced tool call is enforced, not
//! hoped for. The grammar engine is llguidance (the one llama.cpp and mistral.rs use): its
//! token trie is built once per model from the tokenizer's bytes ([`ConstraintVocab`]), and
//! each request gets a [`Constraint`] that masks the logits before sampling and advances with
//! every chosen token. JSON is generated compactly (no free whitespace), so a model cannot
//! spin in whitespace; once the grammar is complete only end-of-generation tokens remain.
//! [`tool_call_grammar`] writes the grammar of a model family's own tool-call format with
//! each tool's argument schema inside.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use shoal_model::tokenizer::Tokenizer;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::EngineError;

/// A grammar the output must follow.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// JSON valid against this schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// A Lark grammar (llguidance's dialect: `%json { schema }` embeds a schema).
    Lark(String),
}

/// The model's vocabulary as the grammar engine sees it; built once per model (it walks
/// every token), shared by all requests.
pub struct ConstraintVocab {
    factory: ParserFactory,
    n_logits: usize,
}

impl std::fmt::Debug for ConstraintVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintVocab")
            .field("n_logits", &self.n_logits)
            .finish()
    }
}

/// The grammar engine's message, its first line only: the rest is the engine's internal
/// state, which tells a client nothing.
fn err(what: impl std::fmt::Display) -> EngineError {
    let what = what.to_string();
    EngineError::InvalidInput {
        what: format!(
            "constrained decoding: {}",
            what.lines().next().unwrap_or("").trim()
        ),
    }
}

impl ConstraintVocab {
    /// Tables for `tok`'s vocabulary, for logits of length `n_logits` (ids past the
    /// tokenizer's vocabulary are padding and never allowed).
    ///
    /// # Errors
    /// When the tokenizer has no end-of-generation token or the engine rejects the vocabulary.
    pub fn new(tok: &Tokenizer, n_logits: usize) -> Result<Self, EngineError> {
        let n = tok.vocab_size();
        let size = n.max(n_logits);
        let eos = tok
            .eos_id()
            .or_else(|| tok.eog_ids().first().copied())
            .ok_or_else(|| err("the tokenizer has no end-of-generation token"))?;
        let words: Vec<Vec<u8>> = (0..size as u32)
            .map(|id| {
                let bytes = if (id as usize) < n {
                    tok.token_bytes(id)
                } else {
                    &[]
                };
                if (id as usize) >= n || tok.is_special(id) || bytes.is_empty() {
                    // special tokens are marked so grammar text never matches them
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    match tok
                        .token_str(id)
                        .filter(|s| !s.is_empty() && (id as usize) < n)
                    {
                        Some(s) => w.extend_from_slice(s.as_bytes()),
                        None => w.extend_from_slice(format!("<[{id}]>").as_bytes()),
                    }
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(size as u32, eos);
        info.tok_bos = tok.bos_id();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(err)?;
        factory.quiet();
        Ok(ConstraintVocab { factory, n_logits })
    }
}

/// Compact JSON for schemas: no free whitespace, so the model cannot pad forever.
fn compact(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(m) = &mut s {
        m.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    s
}

/// One request's constraint.
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").finish()
    }
}

impl Constraint {
    /// A constraint for `grammar` over `vocab`.
    ///
    /// # Errors
    /// When the schema or grammar is invalid or unsatisfiable (the message says where).
    pub fn new(vocab: &Arc<ConstraintVocab>, grammar: &Grammar) -> Result<Self, EngineError> {
        let top = match grammar {
            Grammar::JsonSchema(s) => {
                if !s.is_object() && !s.is_boolean() {
                    return Err(err("a JSON schema must be an object"));
                }
                TopLevelGrammar::from_json_schema(compact(s))
            }
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&json!({"type": "object"})))
            }
            Grammar::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let parser = vocab.factory.create_parser(top).map_err(err)?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(err(e));
        }
        // a shape no output can take (a `$ref` that only refers to itself, ...) is refused
        // here, before the request is queued, not at its first token
        match matcher.compute_mask_or_eos() {
            Ok(v) if !v.is_zero() => Ok(Constraint { matcher }),
            Ok(_) => Err(err("no output can match this schema or grammar")),
            Err(e) => Err(err(format!(
                "no output can match this schema or grammar: {e}"
            ))),
        }
    }

    /// Sets the logit of every token that may not come next to `-inf`.
    ///
    /// # Errors
    /// When the grammar engine fails or allows nothing.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), EngineError> {
        let vob = self.matcher.compute_mask_or_eos().map_err(err)?;
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            if i < vob.len() && vob.is_allowed(i as u32) {
                any |= l.is_finite() || *l == f32::INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            return Err(err("no token can continue the output"));
        }
        Ok(())
    }

    /// Advances past `token`.
    ///
    /// # Errors
    /// When `token` was not allowed.
    pub fn commit(&mut self, token: u32) -> Result<(), EngineError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| err(format!("token {token} is not allowed here ({e})")))
    }

    /// Whether the output is complete (only the end may follow).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

impl crate::scheduler::TokenConstraint for Constraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), EngineError> {
        Constraint::mask(self, logits)
    }

    fn commit(&mut self, token: u32) -> Result<(), EngineError> {
        Constraint::commit(self, token)
    }

    fn is_finished(&self) -> bool {
        Constraint::is_finished(self)
    }
}

/// How a model family writes tool calls (see the API layer's parsers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>` (Qwen 2.5, Hermes).
    Hermes,
    /// `{"name": .., "parameters": {..}}` (Llama 3).
    Llama3,
    /// `[TOOL_CALLS][{"name": .., "arguments": {..}}]` (Mistral).
    Mistral,
}

/// The grammar of one or more (`parallel`) calls of `tools` (name, argument schema) in
/// `format`: the name is one of the tools and the arguments match that tool's schema.
pub fn tool_call_grammar(format: ToolFormat, tools: &[(String, Value)], parallel: bool) -> Grammar {
    let args_key = match format {
        ToolFormat::Llama3 => "parameters",
        _ => "arguments",
    };
    let one = |name: &str, params: &Value| {
        let params = if params.is_object() {
            params.clone()
        } else {
            json!({"type": "object"})
        };
        json!({
            "type": "object",
            "properties": {"name": {"const": name}, args_key: params},
            "required": ["name", args_key],
            "additionalProperties": false,
        })
    };
    let alts: Vec<Value> = tools.iter().map(|(n, p)| one(n, p)).collect();
    let schema = if alts.len() == 1 {
        alts[0].clone()
    } else {
        json!({"anyOf": alts})
    };
    let body = compact(&schema).to_string();
    let lark = match (format, parallel) {
        (ToolFormat::Hermes, false) => format!("start: call\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {body}\n"),
        (ToolFormat::Hermes, true) => format!("start: call (\"\\n\" call)*\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {body}\n"),
        (ToolFormat::Llama3, false) => format!("start: body\nbody: %json {body}\n"),
        (ToolFormat::Llama3, true) => format!("start: body (\"; \" body)*\nbody: %json {body}\n"),
        (ToolFormat::Mistral, false) => format!("start: \"[TOOL_CALLS][\" body \"]\"\nbody: %json {body}\n"),
        (ToolFormat::Mistral, true) => format!("start: \"[TOOL_CALLS][\" body (\", \" body)* \"]\"\nbody: %json {body}\n"),
    };
    Grammar::Lark(lark)
}
