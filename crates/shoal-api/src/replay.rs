//! Recorded model output given back instead of sampled (`shoal serve --replay FILE`), for
//! testing API clients against output no model at hand would write: a thinking model's
//! reasoning and tool calls, say, served by a small model with that model's chat template.
//! The recorded text is tokenized by the served model's tokenizer and forced token by
//! token through the sampler ([`ReplayConstraint`]), so it passes through the real
//! scheduler, detokenizer, stop strings and output parsers, and streams as generated text
//! does. A file holds several outputs; a request gets the first whose conditions (thinking
//! on or off, tools offered or not) it meets.

use serde::Deserialize;
use shoal_engine::scheduler::TokenConstraint;
use shoal_engine::EngineError;

/// One recorded output and when it is given.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Recorded {
    /// Given only when the request's thinking is on (`true`) or off (`false`); any when
    /// absent.
    #[serde(default)]
    pub thinking: Option<bool>,
    /// Given only when the request offers tools (`true`) or none (`false`); any when absent.
    #[serde(default)]
    pub tools: Option<bool>,
    /// The output text, special tokens written as their text (`<|im_end|>` is not needed:
    /// the end of generation follows the text).
    pub text: String,
}

/// A replay file: where its outputs were recorded, and the outputs.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Replay {
    /// What the outputs are (the model and how they were recorded).
    #[serde(default)]
    pub source: String,
    /// The outputs, tried in order.
    pub outputs: Vec<Recorded>,
}

impl Replay {
    /// Reads a replay file.
    ///
    /// # Errors
    /// When the file cannot be read or is not a replay file (the message says which).
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the replay file {}: {e}", path.display()))?;
        let r: Replay = serde_json::from_str(&text).map_err(|e| {
            format!(
                "{} is not a replay file ({e}); it must be a JSON object \
                 {{\"outputs\": [{{\"thinking\": true, \"tools\": false, \"text\": \"...\"}}]}}",
                path.display()
            )
        })?;
        if r.outputs.is_empty() {
            return Err(format!("the replay file {} has no outputs", path.display()));
        }
        Ok(r)
    }

    /// The text for a request with thinking `thinking` and tools offered or not.
    pub fn output_for(&self, thinking: bool, tools: bool) -> Option<&str> {
        self.outputs
            .iter()
            .find(|o| {
                o.thinking.is_none_or(|t| t == thinking) && o.tools.is_none_or(|t| t == tools)
            })
            .map(|o| o.text.as_str())
    }
}

/// Allows exactly the next recorded token, then the end.
#[derive(Debug)]
pub struct ReplayConstraint {
    tokens: Vec<u32>,
    next: usize,
}

impl ReplayConstraint {
    /// A constraint that forces `tokens` (ending with the end-of-generation token).
    pub fn new(tokens: Vec<u32>) -> Self {
        ReplayConstraint { tokens, next: 0 }
    }
}

impl TokenConstraint for ReplayConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), EngineError> {
        let Some(&want) = self.tokens.get(self.next) else {
            return Err(EngineError::Unsupported {
                what: "the recorded output has ended".into(),
            });
        };
        if want as usize >= logits.len() {
            return Err(EngineError::Unsupported {
                what: format!("recorded token {want} is outside the vocabulary"),
            });
        }
        for (i, l) in logits.iter_mut().enumerate() {
            if i != want as usize {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), EngineError> {
        if self.tokens.get(self.next) != Some(&token) {
            return Err(EngineError::Unsupported {
                what: format!("token {token} is not the recorded one"),
            });
        }
        self.next += 1;
        Ok(())
    }

    fn is_finished(&self) -> bool {
        self.next >= self.tokens.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_picked_by_their_conditions_in_order() {
        let r: Replay = serde_json::from_str(
            r#"{"outputs": [
                {"thinking": true, "tools": true, "text": "a"},
                {"thinking": false, "text": "b"},
                {"text": "c"}
            ]}"#,
        )
        .unwrap();
        assert_eq!(r.output_for(true, true), Some("a"));
        assert_eq!(r.output_for(false, true), Some("b"));
        assert_eq!(r.output_for(false, false), Some("b"));
        assert_eq!(r.output_for(true, false), Some("c"));
        assert!(serde_json::from_str::<Replay>(r#"{"outputs": [{"txt": "a"}]}"#).is_err());
    }

    #[test]
    fn the_constraint_allows_only_the_next_recorded_token() {
        let mut c = ReplayConstraint::new(vec![2, 0]);
        let mut logits = [1.0f32; 4];
        c.mask(&mut logits).unwrap();
        assert_eq!(logits.iter().filter(|l| l.is_finite()).count(), 1);
        assert!(logits[2].is_finite());
        assert!(c.commit(1).is_err());
        c.commit(2).unwrap();
        assert!(!c.is_finished());
        c.commit(0).unwrap();
        assert!(c.is_finished());
        assert!(c.mask(&mut logits).is_err());
        assert!(ReplayConstraint::new(vec![9]).mask(&mut [0.0; 4]).is_err());
    }
}
