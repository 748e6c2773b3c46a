//! The engine's error type: each variant says what failed (file, tensor, shape) so the
//! message is useful without a debugger.

use shoal_comm::CommError;
use shoal_model::gguf::GgufError;

/// What can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Reading the GGUF file failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A tensor the architecture needs is not in the file.
    #[error("{file}: tensor `{name}` is missing; is this file really the architecture it claims?")]
    MissingTensor {
        /// The file or folder.
        file: String,
        /// The tensor.
        name: String,
    },
    /// A tensor has a shape the hyperparameters do not allow.
    #[error("tensor `{tensor}` has shape {found:?}, expected {expected:?} from the model's hyperparameters")]
    Shape {
        /// The tensor.
        tensor: String,
        /// Its shape.
        found: Vec<usize>,
        /// The shape the config implies.
        expected: Vec<usize>,
    },
    /// A slice that cannot be cut.
    #[error("tensor `{tensor}`: cannot cut {problem}")]
    BadSlice {
        /// The tensor.
        tensor: String,
        /// What was asked.
        problem: String,
    },
    /// The hyperparameters are missing or inconsistent.
    #[error("{file}: bad hyperparameters: {problem}")]
    Config {
        /// The file or folder.
        file: String,
        /// What is wrong.
        problem: String,
    },
    /// Something shoal does not support (yet): a file feature, an architecture, a split.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What.
        what: String,
    },
    /// The caller asked for something that cannot be done: a token outside the
    /// vocabulary, an empty step, lengths that do not agree.
    #[error("invalid input: {what}")]
    InvalidInput {
        /// What was wrong.
        what: String,
    },
    /// A generation request ended in failure; the message says why.
    #[error("generation failed: {0}")]
    Generation(String),
    /// A broken internal invariant: a bug in shoal, not in the input.
    #[error("internal error (a bug in shoal; please report it): {what}")]
    Internal {
        /// What did not hold.
        what: String,
    },
    /// Reading a weights file failed.
    #[error("loading weights: {what}")]
    Load {
        /// What.
        what: String,
    },
    /// The tokenizer could not be built.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The prompt does not fit in the context.
    #[error("the prompt has {prompt} tokens and generation may add more, but the context holds {ctx}; shorten the prompt or raise --ctx")]
    ContextFull {
        /// Prompt tokens.
        prompt: usize,
        /// Context size.
        ctx: usize,
    },
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A tensor operation failed.
    #[error("{context}: {source}")]
    Candle {
        /// What the engine was doing.
        context: String,
        /// candle's error.
        source: candle_core::Error,
    },
}

impl EngineError {
    /// Wraps a candle error with what the engine was doing.
    pub fn candle(context: impl Into<String>, source: candle_core::Error) -> Self {
        EngineError::Candle {
            context: context.into(),
            source,
        }
    }
}

/// Adds context to candle results.
pub(crate) trait CandleContext<T> {
    fn ctx(self, context: &str) -> Result<T, EngineError>;
}

impl<T> CandleContext<T> for candle_core::Result<T> {
    fn ctx(self, context: &str) -> Result<T, EngineError> {
        self.map_err(|e| EngineError::candle(context, e))
    }
}
