//! The Responses API's kinds of tool, as the functions a chat template shows and back.
//!
//! Besides plain `function` tools, clients such as the Codex CLI send:
//! - `namespace` tools: functions grouped under one name (Codex's sub-agent tools). Each
//!   function is shown to the model as `namespace.name`; a call of it goes back as a
//!   `function_call` item with `namespace` and the function's own `name`, and a call the
//!   client sends in its history is read the same way.
//! - `custom` tools: a function whose input is free text (Codex's `apply_patch` on some
//!   models). Shown as a function with one string argument, `input`; a call goes back as a
//!   `custom_tool_call` item.
//! - hosted tools (`web_search`, `file_search`, `code_interpreter`, `image_generation`,
//!   `mcp`, ...), which the provider runs itself. This server cannot, so they are declined
//!   ([`Declined`]) and the rest of the request is served.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::declined::Declined;
use crate::error::ApiError;
use crate::generation::Tool;
use crate::tools::ToolCall;

/// How a function the model sees maps back to the client's tool.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    /// A function inside a namespace: (namespace, function name).
    Namespaced(String, String),
    /// A custom (free-text input) tool.
    Custom,
}

/// The functions a request's tools become, and where each came from.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ResponseTools {
    /// The functions the model is shown.
    pub functions: Vec<Tool>,
    origins: HashMap<String, Origin>,
}

/// The name the model sees for `name` inside `namespace`.
pub fn folded_name(namespace: &str, name: &str) -> String {
    format!("{namespace}.{name}")
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

fn function_of(t: &Value, name: String) -> Tool {
    Tool::new(
        name,
        t.get("description")
            .and_then(Value::as_str)
            .map(str::to_string),
        t.get("parameters").filter(|p| !p.is_null()).cloned(),
    )
}

fn name_of<'a>(t: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    t.get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad(&format!("{param}.name"), "a tool needs a name"))
}

impl ResponseTools {
    /// Reads `tools` (absent, null or a list), declining hosted tools into `declined`.
    ///
    /// # Errors
    /// 400 for a list that is not one, or a function or custom tool without a name.
    pub fn read(tools: Option<&Value>, declined: &mut Declined) -> Result<Self, ApiError> {
        let list = match tools {
            None | Some(Value::Null) => return Ok(Self::default()),
            Some(Value::Array(list)) => list,
            Some(_) => return Err(bad("tools", "tools must be a list")),
        };
        let mut out = Self::default();
        for (i, t) in list.iter().enumerate() {
            let param = format!("tools[{i}]");
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {
                    let name = name_of(t, &param)?.to_string();
                    out.functions.push(function_of(t, name));
                }
                Some("namespace") => {
                    let ns = name_of(t, &param)?;
                    let inner = t.get("tools").and_then(Value::as_array);
                    for (j, f) in inner.into_iter().flatten().enumerate() {
                        let fparam = format!("{param}.tools[{j}]");
                        if f.get("type").and_then(Value::as_str) != Some("function") {
                            declined.tool(&format!("{ns}.{}", f["type"].as_str().unwrap_or("?")));
                            continue;
                        }
                        let name = name_of(f, &fparam)?;
                        let folded = folded_name(ns, name);
                        out.origins.insert(
                            folded.clone(),
                            Origin::Namespaced(ns.to_string(), name.to_string()),
                        );
                        out.functions.push(function_of(f, folded));
                    }
                }
                Some("custom") => {
                    let name = name_of(t, &param)?.to_string();
                    let mut about = t
                        .get("description")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    if let Some(def) = t.pointer("/format/definition").and_then(Value::as_str) {
                        about.push_str("\nThe input follows this grammar:\n");
                        about.push_str(def);
                    }
                    out.origins.insert(name.clone(), Origin::Custom);
                    out.functions.push(Tool::new(
                        name,
                        Some(about),
                        Some(json!({
                            "type": "object",
                            "properties": {"input": {"type": "string", "description": "The tool's input, as free text."}},
                            "required": ["input"],
                        })),
                    ));
                }
                Some(hosted) => declined.tool(hosted),
                None => return Err(bad(&format!("{param}.type"), "a tool needs a type")),
            }
        }
        Ok(out)
    }

    /// The output item for a call the model made (`id` is the item's id).
    pub fn call_item(&self, id: &str, c: &ToolCall, status: &str) -> Value {
        let done = status != "in_progress";
        match self.origins.get(&c.name) {
            Some(Origin::Custom) => {
                let input = if done {
                    custom_input(&c.arguments)
                } else {
                    String::new()
                };
                json!({"type": "custom_tool_call", "id": id, "call_id": c.id, "name": c.name,
                       "input": input, "status": status})
            }
            Some(Origin::Namespaced(ns, name)) => {
                json!({"type": "function_call", "id": id, "call_id": c.id, "namespace": ns,
                       "name": name, "arguments": if done { c.arguments.to_string() } else { String::new() },
                       "status": status})
            }
            None => json!({"type": "function_call", "id": id, "call_id": c.id, "name": c.name,
                           "arguments": if done { c.arguments.to_string() } else { String::new() },
                           "status": status}),
        }
    }

    /// Whether the call goes back as a custom tool call (its input streamed as text).
    pub fn is_custom(&self, name: &str) -> bool {
        self.origins.get(name) == Some(&Origin::Custom)
    }
}

/// A custom tool's free-text input from the function arguments the model wrote.
pub fn custom_input(arguments: &Value) -> String {
    match arguments.get("input") {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_fold_custom_tools_take_text_and_hosted_tools_are_declined() {
        let tools = json!([
            {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents",
             "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]},
            {"type": "custom", "name": "apply_patch", "description": "Edit files.",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
            {"type": "web_search", "external_web_access": false},
        ]);
        let mut d = Declined::default();
        let t = ResponseTools::read(Some(&tools), &mut d).unwrap();
        let names: Vec<&str> = t.functions.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            ["exec_command", "multi_agent_v1.spawn_agent", "apply_patch"]
        );
        assert_eq!(d.tools, ["web_search"]);
        assert!(t.functions[2]
            .description
            .as_ref()
            .unwrap()
            .contains("start: /.+/"));

        let call = |name: &str, args: Value| ToolCall {
            id: "call_1".into(),
            name: name.into(),
            arguments: args,
        };
        let ns = t.call_item(
            "fc_1",
            &call("multi_agent_v1.spawn_agent", json!({"a": 1})),
            "completed",
        );
        assert_eq!(
            (
                ns["type"].as_str(),
                ns["namespace"].as_str(),
                ns["name"].as_str()
            ),
            (
                Some("function_call"),
                Some("multi_agent_v1"),
                Some("spawn_agent")
            )
        );
        assert_eq!(ns["arguments"], "{\"a\":1}");
        let custom = t.call_item(
            "ct_1",
            &call("apply_patch", json!({"input": "*** Begin Patch"})),
            "completed",
        );
        assert_eq!(custom["type"], "custom_tool_call");
        assert_eq!(custom["input"], "*** Begin Patch");
        let plain = t.call_item("fc_2", &call("exec_command", json!({})), "in_progress");
        assert_eq!(
            (plain["type"].as_str(), plain["arguments"].as_str()),
            (Some("function_call"), Some(""))
        );
        assert!(plain.get("namespace").is_none());
    }

    #[test]
    fn malformed_tools_are_still_refused() {
        let mut d = Declined::default();
        for bad in [
            json!("x"),
            json!([{"name": "f"}]),
            json!([{"type": "function"}]),
        ] {
            assert!(ResponseTools::read(Some(&bad), &mut d).is_err(), "{bad}");
        }
    }
}
