//! Turns a request's enforced shapes into a token constraint for the scheduler:
//! `response_format` json_object / json_schema, and `tool_choice` required or a named
//! function, written as a grammar of the model family's own tool-call format so the output
//! parses as calls whose arguments match the tool's schema. The vocabulary tables the
//! constraint engine needs are built once per model, on its first constrained request.

use std::sync::Arc;

use shoal_engine::constrain::{self, Constraint, ConstraintVocab, Grammar};
use shoal_engine::scheduler::TokenConstraint;

use crate::error::ApiError;
use crate::generation::{GenRequest, OutputFormat, ToolChoice};
use crate::state::ServedModel;
use crate::tools::ToolFormat;

/// The grammar `req` must follow, if any.
fn grammar(served: &ServedModel, req: &GenRequest) -> Option<Grammar> {
    let tools = match &req.input {
        crate::generation::Input::Chat { tools, .. } => tools.as_slice(),
        crate::generation::Input::Text(_) => &[],
    };
    let format = match served.tool_format {
        // GLM's parser also takes a Hermes block of JSON, and every format a message that is
        // a bare JSON call (Llama 3's shape)
        ToolFormat::Hermes | ToolFormat::Glm => constrain::ToolFormat::Hermes,
        ToolFormat::Mistral => constrain::ToolFormat::Mistral,
        ToolFormat::Llama3 | ToolFormat::Generic | ToolFormat::Kimi => {
            constrain::ToolFormat::Llama3
        }
    };
    let pick = |only: Option<&str>| -> Vec<(String, serde_json::Value)> {
        tools
            .iter()
            .filter(|t| only.is_none_or(|n| n == t.name))
            .map(|t| (t.name.clone(), t.parameters.clone()))
            .collect()
    };
    match &req.tool_choice {
        ToolChoice::Required if !tools.is_empty() => {
            return Some(constrain::tool_call_grammar(format, &pick(None), true))
        }
        ToolChoice::Named(name) => {
            return Some(constrain::tool_call_grammar(
                format,
                &pick(Some(name)),
                false,
            ))
        }
        _ => {}
    }
    match &req.format {
        OutputFormat::Text => None,
        OutputFormat::JsonObject => Some(Grammar::JsonObject),
        OutputFormat::JsonSchema(s) => Some(Grammar::JsonSchema(s.clone())),
    }
}

/// The constraint enforcing `req`'s output format or forced tool call, if it has one.
///
/// # Errors
/// 400 for a schema or grammar the constraint engine rejects; 500 when the model's
/// vocabulary cannot be prepared.
pub fn for_request(
    served: &ServedModel,
    req: &GenRequest,
) -> Result<Option<Box<dyn TokenConstraint>>, ApiError> {
    let Some(grammar) = grammar(served, req) else {
        return Ok(None);
    };
    let vocab = served
        .constraint_vocab
        .get_or_init(|| {
            let model = served.model();
            ConstraintVocab::new(&model.tokenizer, model.transformer.config().vocab)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| {
            ApiError::internal(format!(
                "constrained decoding is unavailable for {}: {e}",
                served.id
            ))
        })?;
    let c = Constraint::new(vocab, &grammar).map_err(|e| {
        ApiError::invalid_param(
            "response_format",
            format!("cannot enforce the requested output shape: {e}"),
        )
    })?;
    Ok(Some(Box::new(c)))
}
