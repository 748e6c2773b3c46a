//! Constrained decoding enforces its grammar whatever the model prefers: driven by random
//! logits (the worst model there is), the output is still JSON that matches the schema, a
//! JSON object, or tool calls in the family's format with arguments that match the tool's
//! schema; a disallowed token is refused and a bad schema is an error. On the Qwen 2.5
//! tokenizer (151k tokens, when qwen05 is cached) and on the test kit's tiny tokenizer.

mod common;

use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use shoal_engine::constrain::{
    tool_call_grammar, Constraint, ConstraintVocab, Grammar, ToolFormat,
};
use shoal_model::gguf::GgufFile;
use shoal_model::tokenizer::Tokenizer;
use shoal_testkit::{GgmlType, TinyModelSpec};

/// Runs `grammar` with seeded random logits until it is complete; returns the text and the
/// mean time of one mask. Tokens that close strings and objects get a bonus, as a real
/// model's would (random logits alone write unbounded strings forever).
fn drive(
    tok: &Tokenizer,
    vocab: &Arc<ConstraintVocab>,
    n_logits: usize,
    grammar: &Grammar,
    seed: u64,
) -> (String, f64) {
    let mut c = Constraint::new(vocab, grammar).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let bonus: Vec<f32> = (0..n_logits as u32)
        .map(|id| {
            let b = if (id as usize) < tok.vocab_size() {
                tok.token_bytes(id)
            } else {
                &[]
            };
            if b.iter().any(|&c| c == b'"' || c == b'}' || c == b']') {
                4.0
            } else {
                0.0
            }
        })
        .collect();
    let mut ids = Vec::new();
    let mut mask_s = 0.0;
    for step in 0..600 {
        let mut logits: Vec<f32> = (0..n_logits)
            .map(|i| rng.random::<f32>() * 10.0 + bonus[i])
            .collect();
        let t0 = Instant::now();
        c.mask(&mut logits).unwrap();
        mask_s += t0.elapsed().as_secs_f64();
        let best = shoal_engine::transformer::argmax(&logits) as u32;
        c.commit(best).unwrap();
        if !tok.is_eog(best) {
            ids.push(best);
        }
        if tok.is_eog(best) || c.is_finished() {
            let text = tok.decode(&ids, true);
            return (text, mask_s / (step + 1) as f64);
        }
    }
    panic!(
        "the grammar did not complete in 600 tokens: {}",
        tok.decode(&ids, true)
    );
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}
        }, "required": ["name", "age", "role", "tags"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "point": {"type": "object", "properties": {
                "x": {"type": "number", "minimum": -1000, "maximum": 1000},
                "y": {"type": "integer", "minimum": -5, "maximum": 5}},
                      "required": ["x", "y"], "additionalProperties": false},
            "ok": {"type": "boolean"}
        }, "required": ["point", "ok"], "additionalProperties": false}),
    ]
}

/// Checks the parts of `schemas()` the tests use, by hand.
fn check(schema_i: usize, v: &Value) {
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    match schema_i {
        0 => {
            assert_eq!(o.len(), 4, "{v}");
            assert!(o["name"].as_str().unwrap().chars().count() <= 12, "{v}");
            assert!((0..=150).contains(&o["age"].as_i64().unwrap()), "{v}");
            assert!(
                ["admin", "user"].contains(&o["role"].as_str().unwrap()),
                "{v}"
            );
            let tags = o["tags"].as_array().unwrap();
            assert!(
                tags.len() <= 3
                    && tags
                        .iter()
                        .all(|t| t.as_str().unwrap().chars().count() <= 6),
                "{v}"
            );
        }
        _ => {
            assert!(
                o["point"]["x"].as_f64().is_some_and(|x| x.abs() <= 1000.0),
                "{v}"
            );
            // "-0" is an integer to JSON Schema (serde reads it as -0.0)
            let y = o["point"]["y"].as_f64().unwrap_or(f64::NAN);
            assert!(y.fract() == 0.0 && (-5.0..=5.0).contains(&y), "{v}");
            assert!(o["ok"].is_boolean(), "{v}");
            assert_eq!(o.len(), 2, "{v}");
        }
    }
}

fn exercise(tok: &Tokenizer, n_logits: usize, label: &str) {
    let t0 = Instant::now();
    let vocab = Arc::new(ConstraintVocab::new(tok, n_logits).unwrap());
    eprintln!("{label}: vocabulary tables in {:?}", t0.elapsed());
    let mut mask_times = Vec::new();
    for (i, s) in schemas().into_iter().enumerate() {
        for seed in 0..3 {
            let (text, mask) = drive(tok, &vocab, n_logits, &Grammar::JsonSchema(s.clone()), seed);
            mask_times.push(mask);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            check(i, &v);
        }
    }
    for seed in 0..3 {
        let (text, _) = drive(tok, &vocab, n_logits, &Grammar::JsonObject, seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v.is_object(), "{text}");
    }
    let tools = vec![
        ("get_weather".to_string(), schemas()[0].clone()),
        ("get_point".to_string(), schemas()[1].clone()),
    ];
    for (format, parallel) in [
        (ToolFormat::Hermes, true),
        (ToolFormat::Hermes, false),
        (ToolFormat::Llama3, false),
    ] {
        for seed in 0..3 {
            let (text, _) = drive(
                tok,
                &vocab,
                n_logits,
                &tool_call_grammar(format, &tools, parallel),
                seed,
            );
            let bodies: Vec<&str> = match format {
                ToolFormat::Hermes => text
                    .split("<tool_call>\n")
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| s.trim().trim_end_matches("</tool_call>").trim())
                    .collect(),
                _ => vec![text.as_str()],
            };
            assert!(!bodies.is_empty(), "{text}");
            if !parallel {
                assert_eq!(bodies.len(), 1, "{text}");
            }
            for b in bodies {
                let v: Value =
                    serde_json::from_str(b).unwrap_or_else(|e| panic!("{e}: {b:?} in {text:?}"));
                let key = if format == ToolFormat::Llama3 {
                    "parameters"
                } else {
                    "arguments"
                };
                match v["name"].as_str() {
                    Some("get_weather") => check(0, &v[key]),
                    Some("get_point") => check(1, &v[key]),
                    other => panic!("unknown tool {other:?} in {text}"),
                }
            }
        }
    }
    mask_times.sort_by(f64::total_cmp);
    eprintln!(
        "{label}: median mask time {:.3} ms per token",
        mask_times[mask_times.len() / 2] * 1e3
    );
    // refusals
    let mut c = Constraint::new(&vocab, &Grammar::JsonObject).unwrap();
    let mut logits = vec![0f32; n_logits];
    c.mask(&mut logits).unwrap();
    let banned = logits.iter().position(|l| l.is_infinite()).unwrap() as u32;
    assert!(c.commit(banned).is_err(), "a disallowed token is refused");
    assert!(Constraint::new(&vocab, &Grammar::JsonSchema(json!([1, 2]))).is_err());
    assert!(Constraint::new(
        &vocab,
        &Grammar::JsonSchema(json!({"type": "no-such-type"}))
    )
    .is_err());
    assert!(Constraint::new(&vocab, &Grammar::Lark("start: (".into())).is_err());
}

#[test]
fn enforced_on_the_qwen_tokenizer() {
    let Some(path) = common::model_path("qwen05") else {
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(file.metadata()).unwrap();
    exercise(&tok, 151_936, "qwen2.5");
}

#[test]
fn enforced_on_a_tiny_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyModelSpec::qwen2(1)
        .build()
        .unwrap()
        .write_gguf(&path, GgmlType::F32)
        .unwrap();
    let file = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(file.metadata()).unwrap();
    exercise(&tok, 320, "tiny");
}
