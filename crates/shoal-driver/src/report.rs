//! What a node says about the ranks it runs. Each node publishes (key `ranks`) one
//! [`RankReport`] per instance it runs a rank of: the generation the rank belongs to, its
//! [`RankState`] and a detail (progress while loading, the error once failed). The
//! coordinator follows these into the instances' states
//! ([`decisions::follow_reports`](crate::decisions::follow_reports)), and `shoal ps` shows
//! them. A failed rank whose session to another node broke names that node (`suspect`).
//! The wire form is `{"generation": 3, "state": "failed", "detail": "...", "suspect": "..."}`
//! (`detail` and `suspect` only when there is one).

use serde::{Deserialize, Serialize};

/// Where a rank is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankState {
    /// Finding, fetching or loading its shard, or joining the other ranks.
    Loading,
    /// Serving.
    Ready,
    /// Stopped by an error (the report's detail).
    Failed,
}

/// What a node reports about its rank of an instance.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RankReport {
    /// The placement of the instance the rank belongs to.
    pub generation: u64,
    /// Where it is.
    pub state: RankState,
    /// Progress while loading, the error once failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// For a failed rank: the node whose session to it broke, which the coordinator checks
    /// at once instead of waiting for the failure detector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspect: Option<String>,
    /// For a failed rank: it failed because this node's disk has no room for the share it
    /// had to fetch, so the coordinator places the instance without this node.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_room: bool,
}

impl RankReport {
    /// A report of `state` at `generation`.
    pub fn new(generation: u64, state: RankState, detail: Option<String>) -> Self {
        RankReport {
            generation,
            state,
            detail,
            suspect: None,
            no_room: false,
        }
    }

    /// The same report, naming `suspect` as the node it lost.
    pub fn suspecting(self, suspect: Option<String>) -> Self {
        RankReport { suspect, ..self }
    }

    /// The same report, saying whether the rank failed for want of disk room.
    pub fn for_want_of_room(self, no_room: bool) -> Self {
        RankReport { no_room, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reports_keep_the_gossiped_strings() {
        let cases = [
            (
                RankReport::new(3, RankState::Loading, Some("loading its shard".into())),
                json!({"generation": 3, "state": "loading", "detail": "loading its shard"}),
            ),
            (
                RankReport::new(3, RankState::Ready, None),
                json!({"generation": 3, "state": "ready"}),
            ),
            (
                RankReport::new(4, RankState::Failed, Some("out of memory".into())),
                json!({"generation": 4, "state": "failed", "detail": "out of memory"}),
            ),
            (
                RankReport::new(4, RankState::Failed, Some("link broke".into()))
                    .suspecting(Some("b".into())),
                json!({"generation": 4, "state": "failed", "detail": "link broke", "suspect": "b"}),
            ),
            (
                RankReport::new(5, RankState::Failed, Some("disk full".into()))
                    .for_want_of_room(true),
                json!({"generation": 5, "state": "failed", "detail": "disk full", "no_room": true}),
            ),
        ];
        for (report, wire) in cases {
            assert_eq!(serde_json::to_value(&report).unwrap(), wire);
            assert_eq!(serde_json::from_value::<RankReport>(wire).unwrap(), report);
        }
    }

    #[test]
    fn a_report_of_an_unknown_state_is_refused() {
        let r = serde_json::from_value::<RankReport>(json!({"generation": 1, "state": "busy"}));
        assert!(r.is_err());
        let r = serde_json::from_value::<RankReport>(json!({"generation": 1}));
        assert!(r.is_err());
    }
}
