//! What can be wrong with a planning question: the cluster, the model description or the
//! request itself, or a model that no candidate placement can hold. Each message says what
//! was wrong and what to do about it.

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The cluster (or the chosen subset) has no node.
    #[error(
        "no nodes to plan for; describe at least one node (a [[node]] table in a cluster file)"
    )]
    NoNodes,

    /// A node subset names a node the cluster does not have.
    #[error("unknown node `{id}` in the node subset; the cluster has: {known}")]
    UnknownNode {
        /// The name given.
        id: String,
        /// The nodes the cluster has, comma separated.
        known: String,
    },

    /// Two nodes share an id.
    #[error("node `{id}` is described twice; node ids must be unique")]
    DuplicateNode {
        /// The repeated id.
        id: String,
    },

    /// A node's facts are unusable.
    #[error("node `{id}`: {problem}")]
    BadNode {
        /// The node.
        id: String,
        /// What is wrong and what to give instead.
        problem: String,
    },

    /// A link's facts are unusable.
    #[error("link {a} - {b}: {problem}")]
    BadLink {
        /// One end.
        a: String,
        /// The other end.
        b: String,
        /// What is wrong and what to give instead.
        problem: String,
    },

    /// The model profile is inconsistent.
    #[error("model `{model}`: {problem}")]
    BadModel {
        /// The model's name.
        model: String,
        /// What is inconsistent.
        problem: String,
    },

    /// The request is out of range.
    #[error("{problem}")]
    BadRequest {
        /// What is wrong and what to give instead.
        problem: String,
    },

    /// The strategy hint leaves no candidate at all.
    #[error("no {strategy} placement is possible with {nodes} node(s): {why}")]
    NoCandidate {
        /// The hint.
        strategy: String,
        /// Nodes available.
        nodes: usize,
        /// Why, and what to use instead.
        why: String,
    },

    /// Candidates exist but none fits (memory, a missing link, a split finer than the model
    /// allows).
    #[error("model `{model}` fits nowhere: {closest}")]
    FitsNowhere {
        /// The model's name.
        model: String,
        /// The closest candidate and its shortfall, with what to change.
        closest: String,
    },
}
