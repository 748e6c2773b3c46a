//! The model's own text of its earlier turns, so that a conversation sent again hits the
//! prefix cache.
//!
//! Coding agents send the whole conversation on every turn, the model's earlier answers
//! included, but rebuilt by the client: tool calls come back as structured JSON that the chat
//! template writes out again in its own spacing and key order, and text comes back trimmed.
//! The rendered prompt then differs from the tokens the model generated a few bytes into its
//! first answer, and everything after that point runs again. [`GeneratedTurns`] keeps, for
//! each finished chat turn, the tokens the model generated (tool-call markup included),
//! keyed by its first call id or, for a turn without calls, by its visible text; when an
//! assistant message comes back whose text and calls equal what was answered, the message's
//! place in the prompt is given those tokens as they are
//! ([`shoal_engine::model::LoadedModel::tokenize_chat`]): not the text re-tokenized,
//! since a model may well generate a split its tokenizer would merge. Bounded in count and
//! bytes, oldest out first.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use crate::generation::Message;
use crate::tools::ToolCall;

/// Turns kept at most.
pub const KEPT_TURNS: usize = 4096;
/// Text the kept turns hold at most, in bytes.
pub const KEPT_BYTES: usize = 32 << 20;

/// One answered turn: the tokens the model generated, and what the client was given.
#[derive(Debug)]
struct Turn {
    ids: Vec<u32>,
    visible: String,
    calls: Vec<ToolCall>,
}

impl Turn {
    fn bytes(&self) -> usize {
        self.ids.len() * 4
            + self.visible.len()
            + self
                .calls
                .iter()
                .map(|c| c.id.len() + c.name.len() + c.arguments.to_string().len())
                .sum::<usize>()
    }

    /// Whether `m` is this turn as a client sends it back.
    fn answers(&self, m: &Message) -> bool {
        m.content.trim() == self.visible.trim()
            && m.tool_calls.len() == self.calls.len()
            && m.tool_calls
                .iter()
                .zip(&self.calls)
                .all(|(a, b)| a.id == b.id && a.name == b.name && a.arguments == b.arguments)
    }
}

#[derive(Debug, Default)]
struct Kept {
    by_key: HashMap<u64, (Arc<Turn>, usize)>,
    order: VecDeque<u64>,
    bytes: usize,
}

/// The generated text of recent chat turns, by model and turn.
#[derive(Debug, Default)]
pub struct GeneratedTurns {
    inner: Mutex<Kept>,
}

/// The key of a turn of `model` with `calls` (by the first call's id) or else `visible` text.
fn key(model: &str, visible: &str, calls: &[ToolCall]) -> u64 {
    let mut h = DefaultHasher::new();
    model.hash(&mut h);
    match calls.first() {
        Some(c) => ("call", c.id.as_str()).hash(&mut h),
        None => ("text", visible.trim()).hash(&mut h),
    }
    h.finish()
}

impl GeneratedTurns {
    /// Keeps the turn `model` generated as the tokens `ids`, shown to the client as
    /// `visible` text and `calls`.
    pub fn remember(&self, model: &str, ids: Vec<u32>, visible: String, calls: Vec<ToolCall>) {
        if ids.is_empty() {
            return;
        }
        let k = key(model, &visible, &calls);
        let turn = Turn {
            ids,
            visible,
            calls,
        };
        let size = turn.bytes();
        if size > KEPT_BYTES / 4 {
            return;
        }
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, old)) = g.by_key.insert(k, (Arc::new(turn), size)) {
            g.bytes -= old;
            g.order.retain(|o| *o != k);
        }
        g.bytes += size;
        g.order.push_back(k);
        while g.order.len() > KEPT_TURNS || g.bytes > KEPT_BYTES {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            if let Some((_, n)) = g.by_key.remove(&old) {
                g.bytes -= n;
            }
        }
    }

    /// Marks each assistant message of `messages` that is a kept turn of `model`: its
    /// content becomes a marker ([`marker`]) and its calls go (they are inside the tokens);
    /// returns each marker with the tokens it stands for, in order.
    pub fn restore(&self, model: &str, messages: &mut [Message]) -> Vec<(String, Vec<u32>)> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut splices = Vec::new();
        if g.by_key.is_empty() {
            return splices;
        }
        for m in messages.iter_mut().filter(|m| m.role == "assistant") {
            let Some((turn, _)) = g.by_key.get(&key(model, &m.content, &m.tool_calls)) else {
                continue;
            };
            if turn.answers(m) {
                let mark = marker(splices.len());
                m.content = mark.clone();
                m.tool_calls.clear();
                splices.push((mark, turn.ids.clone()));
            }
        }
        splices
    }
}

/// The text standing for the `i`-th restored turn in a rendered prompt: private-use
/// characters around a number, which no client text is expected to hold.
pub fn marker(i: usize) -> String {
    format!("\u{F8FF}shoal-turn-{i}\u{F8FF}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(id: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: "read".into(),
            arguments: json!({"path": "a.txt", "n": 1}),
        }
    }

    fn answered(content: &str, calls: Vec<ToolCall>) -> Message {
        let mut m = Message::text("assistant", content);
        m.tool_calls = calls;
        m
    }

    #[test]
    fn a_turn_sent_back_unchanged_is_marked_for_its_tokens() {
        let t = GeneratedTurns::default();
        t.remember("m", vec![1, 2, 3], "Reading it.".into(), vec![call("c1")]);
        t.remember("m", vec![4, 5], "Hello there".into(), vec![]);
        let mut msgs = vec![
            Message::text("user", "hi"),
            answered("Reading it.\n", vec![call("c1")]),
            Message::text("tool", "x"),
            answered("Hello there", vec![]),
        ];
        let splices = t.restore("m", &mut msgs);
        assert_eq!(
            splices,
            [(marker(0), vec![1, 2, 3]), (marker(1), vec![4, 5])]
        );
        assert_eq!(msgs[1].content, marker(0));
        assert!(msgs[1].tool_calls.is_empty());
        assert_eq!(msgs[3].content, marker(1));
        assert_eq!(msgs[0].content, "hi", "only assistant turns");
    }

    #[test]
    fn a_changed_turn_or_another_model_is_rendered_as_sent() {
        let t = GeneratedTurns::default();
        t.remember("m", vec![7], "shown".into(), vec![call("c1")]);
        let mut other_args = call("c1");
        other_args.arguments = json!({"path": "b.txt"});
        let mut msgs = vec![
            answered("shown", vec![other_args]),
            answered("edited", vec![call("c1")]),
        ];
        assert!(t.restore("m", &mut msgs).is_empty());
        let mut same = vec![answered("shown", vec![call("c1")])];
        assert!(t.restore("other-model", &mut same).is_empty());
        assert_eq!(t.restore("m", &mut same).len(), 1);
    }

    #[test]
    fn the_oldest_turns_go_first() {
        let t = GeneratedTurns::default();
        for i in 0..=KEPT_TURNS {
            t.remember("m", vec![i as u32], format!("v{i}"), vec![]);
        }
        let mut first = vec![answered("v0", vec![])];
        assert!(t.restore("m", &mut first).is_empty());
        let mut last = vec![answered(&format!("v{KEPT_TURNS}"), vec![])];
        assert_eq!(t.restore("m", &mut last).len(), 1);
        let g = t.inner.lock().unwrap();
        assert_eq!(g.order.len(), KEPT_TURNS);
        assert_eq!(g.by_key.len(), KEPT_TURNS);
    }
}
