//! The typed control protocol between the drivers of a cluster's nodes. A node sends a
//! [`ControlRequest`] to another node's driver through [`Node::ask`] (which carries JSON):
//! the manifest of a file it fetches from, or a load, unload or drain for the coordinator.
//! The coordinator answers the last three with a [`ControlAnswer`]: the [`Outcome`], a
//! refusal with the HTTP status the client should see, or, while the two nodes still
//! disagree on who coordinates, the name of the node it takes for the coordinator. A
//! manifest request is answered with the `Manifest` itself (see `fetch.rs`).
//!
//! JSON is made and read only at the edges ([`ControlRequest::to_value`],
//! [`ControlRequest::from_value`], [`ControlAnswer::to_value`],
//! [`ControlAnswer::from_value`]); a malformed or unknown request is an error string for
//! the asker, never a panic. The wire form is the one the untyped protocol used: requests
//! are objects tagged by `op`, answers `{"ok": ..}`, `{"refused": {"status", "message"}}`
//! or `{"not_coordinator": {"node", "ask"}}`.
//!
//! [`LoadBody`] is the typed form of a client's load request (the HTTP body of
//! `POST /cluster/instances`), with the checks and messages the client sees.
//!
//! [`Node::ask`]: shoal_cluster::node::Node::ask

use serde::{Deserialize, Serialize};
use serde_json::Value;
use shoal_api::ControlError;
use shoal_cluster::instances::Instance;
use shoal_planner::split::ExpertSplit;
use shoal_planner::{ModelProfile, PlanRequest, Strategy};

use crate::err;

/// What one node's driver asks another's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    /// The chunk list of the file with this SHA-256 (answered with a `Manifest`).
    Manifest {
        /// The file's SHA-256, hex.
        sha256: String,
    },
    /// Place a new instance (coordinator).
    Load(Box<LoadOp>),
    /// Unload instance `id` (coordinator).
    Unload {
        /// The instance.
        id: String,
    },
    /// Move every instance off node `node`, an id (coordinator).
    Drain {
        /// The node's id.
        node: String,
    },
}

/// A load, as the coordinator applies it: the model file resolved by the node the client
/// asked, with the planner's profile and request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadOp {
    /// The new instance's id.
    pub id: String,
    /// The model's name.
    pub model: String,
    /// The model file's SHA-256, hex.
    pub sha256: Option<String>,
    /// What the planner needs to know about the model.
    pub profile: ModelProfile,
    /// What to plan for.
    pub request: PlanRequest,
}

/// The operations a request may name, for messages.
const OPS: &str = "manifest, load, unload, drain";

impl ControlRequest {
    /// The operation's name on the wire (`op`).
    pub fn name(&self) -> &'static str {
        match self {
            ControlRequest::Manifest { .. } => "manifest",
            ControlRequest::Load(_) => "load",
            ControlRequest::Unload { .. } => "unload",
            ControlRequest::Drain { .. } => "drain",
        }
    }

    /// Whether only the coordinator answers it.
    pub fn for_coordinator(&self) -> bool {
        !matches!(self, ControlRequest::Manifest { .. })
    }

    /// The JSON body [`Node::ask`](shoal_cluster::node::Node::ask) carries.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("a control request serializes")
    }

    /// Reads a request another node sent.
    ///
    /// # Errors
    /// A message naming what is wrong: no operation, an unknown one, or a field of a known
    /// one missing or of the wrong type.
    pub fn from_value(body: Value) -> Result<Self, String> {
        let op = match body.get("op") {
            Some(Value::String(op)) => op.clone(),
            Some(other) => {
                return Err(format!(
                    "the control request's op is {other}, not one of {OPS}"
                ))
            }
            None => return Err(format!("the control request names no op (one of {OPS})")),
        };
        if !["manifest", "load", "unload", "drain"].contains(&op.as_str()) {
            return Err(format!("unknown operation {op:?} (one of {OPS})"));
        }
        serde_json::from_value(body).map_err(|e| format!("a malformed {op} request: {e}"))
    }
}

/// What the coordinator answers a load, unload or drain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlAnswer {
    /// Applied.
    Ok(Outcome),
    /// Not applied; `status` is the HTTP status for the client.
    Refused {
        /// HTTP status.
        status: u16,
        /// Why, and what to do.
        message: String,
    },
    /// The node asked is not the coordinator in its own view: it takes `ask` for it.
    NotCoordinator {
        /// The node that answered.
        node: String,
        /// The node it takes for the coordinator (`none` when it knows none).
        ask: String,
    },
}

impl ControlAnswer {
    /// The answer for what applying a request gave.
    pub fn of(result: Result<Outcome, ControlError>) -> Self {
        match result {
            Ok(o) => ControlAnswer::Ok(o),
            Err(e) => ControlAnswer::Refused {
                status: e.status,
                message: e.message,
            },
        }
    }

    /// The JSON answer [`Node::ask`](shoal_cluster::node::Node::ask) returns.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("a control answer serializes")
    }

    /// Reads the coordinator's answer.
    ///
    /// # Errors
    /// A message quoting the answer when it is none of the three.
    pub fn from_value(answer: Value) -> Result<Self, String> {
        serde_json::from_value(answer.clone())
            .map_err(|e| format!("the coordinator answered {answer} ({e})"))
    }
}

/// What an applied operation did, as the client sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Outcome {
    /// A load: the new instance (`{"instance": ..}`).
    Loaded {
        /// As placed.
        instance: Box<Instance>,
    },
    /// An unload (`{"unloading": id}`).
    Unloading {
        /// The instance being unloaded.
        unloading: String,
    },
    /// A drain (`{"drained": node, "moved": [..]}`).
    Drained {
        /// The node drained.
        drained: String,
        /// The instances re-placed off it.
        moved: Vec<String>,
    },
}

impl Outcome {
    /// The JSON the client gets.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("an outcome serializes")
    }
}

/// A client's load request: `{"model", "id"?, "strategy"?, "experts"?, "ctx"?, "nodes"?}`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadBody {
    /// The model's name (or path on the node asked).
    pub model: String,
    /// The instance's id (default: the model file's name).
    pub id: Option<String>,
    /// How to split it (default `auto`).
    pub strategy: Strategy,
    /// How to cut a mixture of experts' routed experts (default `auto`).
    pub experts: ExpertSplit,
    /// Context length, tokens (default 4096).
    pub ctx: u32,
    /// The nodes it may use (default: any).
    pub nodes: Option<Vec<String>>,
}

impl LoadBody {
    /// Reads a client's load request.
    ///
    /// # Errors
    /// A 400 naming the field that is missing or wrong and what it may be.
    pub fn parse(req: &Value) -> Result<Self, ControlError> {
        let model = req["model"]
            .as_str()
            .filter(|m| !m.is_empty())
            .ok_or_else(|| err(400, "give the model to load: {\"model\": NAME}"))?
            .to_string();
        let strategy: Strategy = match req.get("strategy") {
            None | Some(Value::Null) => Strategy::Auto,
            Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
                err(
                    400,
                    format!("strategy {v} is not one of auto, tensor, pipeline, hybrid"),
                )
            })?,
        };
        let experts: ExpertSplit = match req.get("experts") {
            None | Some(Value::Null) => Default::default(),
            Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
                err(
                    400,
                    format!("experts {v} is not one of auto, whole, sliced"),
                )
            })?,
        };
        let ctx = match req.get("ctx") {
            None | Some(Value::Null) => 4096,
            Some(v) => v
                .as_u64()
                .filter(|&c| (2..=1 << 20).contains(&c))
                .ok_or_else(|| {
                    err(
                        400,
                        format!("ctx {v} must be a number of tokens, 2 to 1048576"),
                    )
                })? as u32,
        };
        let nodes: Option<Vec<String>> = match req.get("nodes") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                serde_json::from_value(v.clone())
                    .map_err(|_| err(400, "nodes must be a list of node ids or names"))?,
            ),
        };
        Ok(LoadBody {
            model,
            id: req["id"].as_str().map(str::to_string),
            strategy,
            experts,
            ctx,
            nodes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use shoal_cluster::instances::InstanceState;
    use shoal_planner::{Placement, SplitKind, StagePlacement};

    fn profile() -> ModelProfile {
        ModelProfile {
            name: "m".into(),
            n_layers: 2,
            hidden: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            vocab: 100,
            params: 1000,
            layer_bytes: vec![10, 10],
            embedding_bytes: 5,
            head_bytes: 5,
            tied_embeddings: true,
            kv_bytes_per_token_per_layer: 64,
            quant_block: 32,
            attn_quant_block: None,
            experts: None,
        }
    }

    fn load_op() -> LoadOp {
        LoadOp {
            id: "qwen".into(),
            model: "qwen05".into(),
            sha256: Some("ab12".into()),
            profile: profile(),
            request: PlanRequest {
                ctx: 512,
                strategy: Strategy::Pipeline,
                nodes: Some(vec!["a".into(), "b".into()]),
                ..PlanRequest::default()
            },
        }
    }

    fn instance() -> Instance {
        Instance {
            id: "qwen".into(),
            model: "qwen05".into(),
            model_sha256: Some("ab12".into()),
            ctx: 512,
            strategy: Strategy::Auto,
            experts: ExpertSplit::default(),
            placement: Placement {
                strategy: SplitKind::Pipeline,
                tp: 1,
                stages: vec![
                    StagePlacement {
                        layers: 0..1,
                        nodes: vec!["a".into()],
                    },
                    StagePlacement {
                        layers: 1..2,
                        nodes: vec!["b".into()],
                    },
                ],
                experts: ExpertSplit::default(),
            },
            state: InstanceState::Placing,
            generation: 1,
            updated_ms: 42,
            history: vec!["placed on [a,b]".into()],
        }
    }

    fn requests() -> Vec<ControlRequest> {
        vec![
            ControlRequest::Manifest {
                sha256: "ab12".into(),
            },
            ControlRequest::Load(Box::new(load_op())),
            ControlRequest::Unload { id: "qwen".into() },
            ControlRequest::Drain { node: "n1".into() },
        ]
    }

    #[test]
    fn every_request_goes_and_comes_back() {
        for r in requests() {
            let v = r.to_value();
            assert_eq!(v["op"], r.name(), "{v}");
            assert_eq!(ControlRequest::from_value(v.clone()), Ok(r.clone()), "{v}");
            // and through the text the session carries
            let text = serde_json::to_string(&v).unwrap();
            let back: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(ControlRequest::from_value(back), Ok(r));
        }
    }

    #[test]
    fn requests_keep_their_wire_form() {
        assert_eq!(
            ControlRequest::Unload { id: "x".into() }.to_value(),
            json!({"op": "unload", "id": "x"})
        );
        assert_eq!(
            ControlRequest::Drain { node: "n".into() }.to_value(),
            json!({"op": "drain", "node": "n"})
        );
        assert_eq!(
            ControlRequest::Manifest {
                sha256: "ab".into()
            }
            .to_value(),
            json!({"op": "manifest", "sha256": "ab"})
        );
        let load = ControlRequest::Load(Box::new(load_op())).to_value();
        assert_eq!(load["id"], "qwen");
        assert_eq!(load["model"], "qwen05");
        assert_eq!(load["sha256"], "ab12");
        assert_eq!(load["profile"]["n_layers"], 2);
        assert_eq!(load["request"]["ctx"], 512);
        assert!(!ControlRequest::Manifest { sha256: "a".into() }.for_coordinator());
        assert!(ControlRequest::Drain { node: "n".into() }.for_coordinator());
    }

    #[test]
    fn malformed_requests_are_errors_that_say_what_is_wrong() {
        let cases = [
            (json!({"id": "x"}), "names no op"),
            (json!({"op": 7}), "op is 7"),
            (json!({"op": "reboot"}), "unknown operation \"reboot\""),
            (json!({"op": "unload"}), "a malformed unload request"),
            (
                json!({"op": "unload", "id": 3}),
                "a malformed unload request",
            ),
            (
                json!({"op": "drain", "nodes": "a"}),
                "a malformed drain request",
            ),
            (json!({"op": "manifest"}), "a malformed manifest request"),
            (
                json!({"op": "load", "id": "x", "model": "m", "profile": {}, "request": {}}),
                "a malformed load request",
            ),
            (json!("unload"), "names no op"),
            (json!(null), "names no op"),
            (json!([1, 2]), "names no op"),
        ];
        for (body, want) in cases {
            let e = ControlRequest::from_value(body.clone()).expect_err(&body.to_string());
            assert!(e.contains(want), "{body}: {e}");
        }
    }

    fn answers() -> Vec<ControlAnswer> {
        vec![
            ControlAnswer::Ok(Outcome::Loaded {
                instance: Box::new(instance()),
            }),
            ControlAnswer::Ok(Outcome::Unloading {
                unloading: "qwen".into(),
            }),
            ControlAnswer::Ok(Outcome::Drained {
                drained: "n1".into(),
                moved: vec!["qwen".into(), "other".into()],
            }),
            ControlAnswer::Ok(Outcome::Drained {
                drained: "n1".into(),
                moved: vec![],
            }),
            ControlAnswer::Refused {
                status: 409,
                message: "instance `qwen` already exists".into(),
            },
            ControlAnswer::NotCoordinator {
                node: "b".into(),
                ask: "a".into(),
            },
        ]
    }

    #[test]
    fn every_answer_goes_and_comes_back() {
        for a in answers() {
            let v = a.to_value();
            assert_eq!(ControlAnswer::from_value(v.clone()), Ok(a), "{v}");
        }
    }

    #[test]
    fn answers_keep_their_wire_form() {
        assert_eq!(
            ControlAnswer::Refused {
                status: 404,
                message: "no instance".into()
            }
            .to_value(),
            json!({"refused": {"status": 404, "message": "no instance"}})
        );
        assert_eq!(
            ControlAnswer::NotCoordinator {
                node: "b".into(),
                ask: "a".into()
            }
            .to_value(),
            json!({"not_coordinator": {"node": "b", "ask": "a"}})
        );
        assert_eq!(
            ControlAnswer::Ok(Outcome::Unloading {
                unloading: "x".into()
            })
            .to_value(),
            json!({"ok": {"unloading": "x"}})
        );
        assert_eq!(
            Outcome::Drained {
                drained: "n".into(),
                moved: vec!["x".into()]
            }
            .to_value(),
            json!({"drained": "n", "moved": ["x"]})
        );
        let loaded = Outcome::Loaded {
            instance: Box::new(instance()),
        }
        .to_value();
        assert_eq!(loaded["instance"]["id"], "qwen");
        assert_eq!(loaded["instance"]["state"], "placing");
        // what a refusal of an apply becomes
        assert_eq!(
            ControlAnswer::of(Err(ControlError {
                status: 503,
                message: "retry".into()
            })),
            ControlAnswer::Refused {
                status: 503,
                message: "retry".into()
            }
        );
    }

    #[test]
    fn a_malformed_answer_is_an_error_quoting_it() {
        for v in [
            json!({"fine": 1}),
            json!({"refused": {"status": "bad"}}),
            json!({"refused": {"status": 70000, "message": "m"}}),
            json!({"ok": {"something": "else"}}),
            json!(null),
            json!("ok"),
        ] {
            let e = ControlAnswer::from_value(v.clone()).expect_err(&v.to_string());
            assert!(
                e.starts_with(&format!("the coordinator answered {v}")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_client_load_takes_defaults_and_checks_each_field() {
        let b = LoadBody::parse(&json!({"model": "qwen05"})).unwrap();
        assert_eq!(
            b,
            LoadBody {
                model: "qwen05".into(),
                id: None,
                strategy: Strategy::Auto,
                experts: ExpertSplit::default(),
                ctx: 4096,
                nodes: None,
            }
        );
        let b = LoadBody::parse(&json!({
            "model": "qwen05", "id": "q", "strategy": "pipeline", "experts": "whole",
            "ctx": 512, "nodes": ["a", "b"]
        }))
        .unwrap();
        assert_eq!(b.id.as_deref(), Some("q"));
        assert_eq!(b.strategy, Strategy::Pipeline);
        assert_eq!(b.experts, ExpertSplit::Whole);
        assert_eq!(b.ctx, 512);
        assert_eq!(b.nodes, Some(vec!["a".to_string(), "b".to_string()]));
        let cases = [
            (json!({}), "give the model to load"),
            (json!({"model": ""}), "give the model to load"),
            (json!("qwen05"), "give the model to load"),
            (
                json!({"model": "m", "strategy": "diagonal"}),
                "strategy \"diagonal\" is not one of",
            ),
            (
                json!({"model": "m", "experts": 3}),
                "experts 3 is not one of",
            ),
            (json!({"model": "m", "ctx": 1}), "ctx 1 must be"),
            (json!({"model": "m", "ctx": "big"}), "ctx \"big\" must be"),
            (json!({"model": "m", "nodes": "a"}), "nodes must be a list"),
        ];
        for (body, want) in cases {
            let e = LoadBody::parse(&body).expect_err(&body.to_string());
            assert_eq!(e.status, 400, "{body}");
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
    }
}
