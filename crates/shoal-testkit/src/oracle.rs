//! llama.cpp as a teacher-forced correctness oracle.
//!
//! `scripts/llama_logits.cpp` (built by `scripts/build-llama-oracle.sh` against a minimal
//! CPU-only llama.cpp, and named by the `SHOAL_LLAMA_LOGITS_BIN` environment variable) runs
//! a GGUF file on a prompt, greedily generates N tokens and prints, for the last prompt
//! position and each generated token, llama.cpp's top-K logits ([`run_llama_oracle`] runs it
//! and parses its line into an [`OracleRun`]). An implementation under test is then fed the
//! same tokens (the prompt followed by llama.cpp's generated ids, so one early difference
//! cannot derail the rest of the sequence) and [`compare_teacher_forced`] checks its logit row
//! at every step against llama.cpp's: every top-K logit within a tolerance relative to the
//! step's logit scale, and the same argmax unless llama.cpp's own top two are a near-tie. It
//! checks every step and reports every failure, not only the first.
//!
//! [`require_oracle`] is how a test gets the binary: without the variable a test is skipped
//! with a printed line, except under CI (`CI=true`), where a missing oracle fails the test.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The prompt given to the oracle.
#[derive(Debug, Clone, PartialEq)]
pub enum OracleInput {
    /// Text, tokenized by the model's vocabulary (no BOS added, special tokens parsed).
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// What the oracle printed for one run (see `scripts/llama_logits.cpp`).
#[derive(Debug, Clone, PartialEq)]
pub struct OracleRun {
    /// The prompt's ids.
    pub ids: Vec<u32>,
    /// The greedily generated ids (as many as asked for).
    pub generated: Vec<u32>,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// End-of-sequence id (`None` when the vocabulary has none).
    pub eos: Option<u32>,
    /// Beginning-of-sequence id (`None` when the vocabulary has none).
    pub bos: Option<u32>,
    /// The chat template applied to one user message "hi" with the assistant prefix (`None`
    /// when the model has no template).
    pub chat: Option<String>,
    /// Top-K `(id, logit)` after the last prompt token and after each generated token
    /// (`generated.len() + 1` steps), best first. A non-finite logit reads as NaN.
    pub steps: Vec<Vec<(u32, f32)>>,
    /// Top-K `(id, logit)` at every prompt position, best first.
    pub prompt_steps: Vec<Vec<(u32, f32)>>,
    /// With `all_logits`: the full logit rows of `steps`.
    pub logits: Option<Vec<Vec<f32>>>,
}

impl OracleRun {
    /// The teacher-forced sequence: the prompt ids followed by the generated ids. Feeding it
    /// to a model gives, at positions `ids.len() - 1 ..`, the rows that match `steps`.
    pub fn sequence(&self) -> Vec<u32> {
        self.ids.iter().chain(&self.generated).copied().collect()
    }

    /// With `all_logits`: every step's full row as `(id, logit)` sorted best first (ties:
    /// lower id first), the shape [`compare_teacher_forced`] takes as its reference, so that
    /// every logit of the vocabulary is compared rather than the top K.
    pub fn full_steps(&self) -> Option<Vec<Vec<(u32, f32)>>> {
        let rows = self.logits.as_ref()?;
        Some(
            rows.iter()
                .map(|row| {
                    let mut v: Vec<(u32, f32)> = row
                        .iter()
                        .enumerate()
                        .map(|(i, l)| (i as u32, *l))
                        .collect();
                    v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                    v
                })
                .collect(),
        )
    }
}

/// The oracle binary named by `SHOAL_LLAMA_LOGITS_BIN`, if set and not empty.
pub fn oracle_bin() -> Option<PathBuf> {
    std::env::var_os("SHOAL_LLAMA_LOGITS_BIN")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The oracle binary for `test`. Without `SHOAL_LLAMA_LOGITS_BIN` it returns `None` after
/// printing why the test is skipped, unless this is CI (`CI=true`): there it panics, since
/// CI must run the comparison, not skip it.
pub fn require_oracle(test: &str) -> Option<PathBuf> {
    let bin = oracle_bin();
    if bin.is_none() {
        crate::skip_or_fail(
            test,
            "SHOAL_LLAMA_LOGITS_BIN is not set (build the oracle with scripts/build-llama-oracle.sh \
             and set the variable to the path it prints)",
        );
    }
    bin
}

/// llama.cpp's pre-tokenizer words for each of `texts`, from the oracle at `bin` (its
/// `--split` mode): `regex` is the first expression llama.cpp lists for a
/// `tokenizer.ggml.pre` value, which selects its hand-written scanner where it has one
/// (`\\p{Han}+` for Kimi K2). An error says what failed.
pub fn llama_pretokenize(
    bin: &Path,
    regex: &str,
    texts: &[&str],
) -> Result<Vec<Vec<String>>, String> {
    use std::io::Write;
    if let Some(t) = texts.iter().find(|t| t.contains('\0')) {
        return Err(format!(
            "text {t:?} holds a NUL, which ends a text for the oracle"
        ));
    }
    let mut child = Command::new(bin)
        .arg("--split")
        .arg(regex)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run the oracle {}: {e}", bin.display()))?;
    let mut input = Vec::new();
    for t in texts {
        input.extend_from_slice(t.as_bytes());
        input.push(0);
    }
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(&input)
        .map_err(|e| format!("cannot write to the oracle: {e}"))?;
    let out = child
        .wait_with_output()
        .map_err(|e| format!("the oracle did not finish: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the oracle's split failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8(out.stdout).map_err(|e| format!("oracle output: {e}"))?;
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() != texts.len() {
        return Err(format!(
            "the oracle split {} texts into {} lines",
            texts.len(),
            lines.len()
        ));
    }
    lines
        .iter()
        .map(|line| {
            line.split(' ')
                .filter(|w| !w.is_empty())
                .map(|w| {
                    let bytes = (0..w.len())
                        .step_by(2)
                        .map(|i| u8::from_str_radix(w.get(i..i + 2).unwrap_or("zz"), 16))
                        .collect::<Result<Vec<u8>, _>>()
                        .map_err(|e| format!("oracle word {w:?}: {e}"))?;
                    String::from_utf8(bytes).map_err(|e| format!("oracle word {w:?}: {e}"))
                })
                .collect()
        })
        .collect()
}

/// The KV cache type the oracle runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OracleCache {
    /// F32 keys and values: the closest to an exact forward pass.
    F32,
    /// F16 keys and values: llama.cpp's default, and the type shoal's CPU cache keeps.
    F16,
}

/// Runs the oracle at `bin` on `gguf`: the prompt, then `generate` greedy tokens, reporting
/// the top `top_k` logits per step (and full rows with `all_logits`), with an F32 KV cache.
/// An error says what failed: the binary not starting, a non-zero exit (with its stderr),
/// or unreadable output.
pub fn run_llama_oracle(
    bin: &Path,
    gguf: &Path,
    input: OracleInput,
    generate: usize,
    top_k: usize,
    all_logits: bool,
) -> Result<OracleRun, String> {
    run_llama_oracle_with(
        bin,
        gguf,
        input,
        generate,
        top_k,
        all_logits,
        OracleCache::F32,
    )
}

/// [`run_llama_oracle`] with the KV cache of type `cache`.
pub fn run_llama_oracle_with(
    bin: &Path,
    gguf: &Path,
    input: OracleInput,
    generate: usize,
    top_k: usize,
    all_logits: bool,
    cache: OracleCache,
) -> Result<OracleRun, String> {
    let mut cmd = Command::new(bin);
    cmd.arg(gguf);
    match &input {
        OracleInput::Text(t) => cmd.arg("--text").arg(t),
        OracleInput::Tokens(ids) => cmd.arg("--tokens").arg(
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ),
    };
    cmd.arg("--generate")
        .arg(generate.to_string())
        .arg("--top")
        .arg(top_k.to_string());
    if all_logits {
        cmd.arg("--all-logits");
    }
    if cache == OracleCache::F16 {
        cmd.arg("--kv-f16");
    }
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run the oracle {}: {e}", bin.display()))?;
    if !out.status.success() {
        return Err(format!(
            "the oracle {} failed ({}) on {}: {}",
            bin.display(),
            out.status,
            gguf.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let v: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("the oracle's output is not JSON: {e}"))?;
    let run = parse_run(&v)?;
    if run.generated.len() != generate || run.steps.len() != generate + 1 {
        return Err(format!(
            "the oracle gave {} generated ids and {} steps for --generate {generate}",
            run.generated.len(),
            run.steps.len()
        ));
    }
    if run.prompt_steps.len() != run.ids.len() {
        return Err(format!(
            "the oracle gave {} prompt steps for {} prompt ids",
            run.prompt_steps.len(),
            run.ids.len()
        ));
    }
    if all_logits != run.logits.is_some() {
        return Err("the oracle's full logit rows are missing or unasked for".into());
    }
    Ok(run)
}

fn parse_run(v: &Value) -> Result<OracleRun, String> {
    let field = |k: &str| v.get(k).ok_or_else(|| format!("oracle output lacks `{k}`"));
    let ids = |k: &str| -> Result<Vec<u32>, String> {
        field(k)?
            .as_array()
            .ok_or_else(|| format!("`{k}` is not an array"))?
            .iter()
            .map(|x| as_u32(x).ok_or_else(|| format!("`{k}` holds {x}, not a token id")))
            .collect()
    };
    let opt_id = |k: &str| -> Result<Option<u32>, String> {
        let x = field(k)?
            .as_i64()
            .ok_or_else(|| format!("`{k}` is not an integer"))?;
        Ok(u32::try_from(x).ok())
    };
    let logit = |x: &Value| -> Result<f32, String> {
        match x {
            Value::Null => Ok(f32::NAN),
            _ => x
                .as_f64()
                .map(|f| f as f32)
                .ok_or_else(|| format!("{x} is not a logit")),
        }
    };
    let top = |k: &str| -> Result<Vec<Vec<(u32, f32)>>, String> {
        let steps = field(k)?
            .as_array()
            .ok_or_else(|| format!("`{k}` is not an array"))?;
        steps
            .iter()
            .map(|step| {
                step.as_array()
                    .ok_or_else(|| format!("a step of `{k}` is not an array"))?
                    .iter()
                    .map(|pair| match pair.as_array().map(Vec::as_slice) {
                        Some([id, l]) => Ok((
                            as_u32(id).ok_or_else(|| format!("{id} is not a token id"))?,
                            logit(l)?,
                        )),
                        _ => Err(format!("{pair} is not an [id, logit] pair")),
                    })
                    .collect()
            })
            .collect()
    };
    let logits = match v.get("logits") {
        None => None,
        Some(rows) => Some(
            rows.as_array()
                .ok_or("`logits` is not an array")?
                .iter()
                .map(|row| {
                    row.as_array()
                        .ok_or_else(|| "a row of `logits` is not an array".to_string())?
                        .iter()
                        .map(logit)
                        .collect::<Result<Vec<f32>, String>>()
                })
                .collect::<Result<Vec<_>, String>>()?,
        ),
    };
    let n_vocab = field("n_vocab")?
        .as_u64()
        .ok_or("`n_vocab` is not a count")? as usize;
    if let Some(rows) = &logits {
        if rows.iter().any(|r| r.len() != n_vocab) {
            return Err(format!("a row of `logits` is not {n_vocab} long"));
        }
    }
    Ok(OracleRun {
        ids: ids("ids")?,
        generated: ids("generated")?,
        n_vocab,
        eos: opt_id("eos")?,
        bos: opt_id("bos")?,
        chat: field("chat")?.as_str().map(str::to_string),
        steps: top("steps")?,
        prompt_steps: top("prompt_steps")?,
        logits,
    })
}

fn as_u32(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

/// How close a teacher-forced row must be to the reference's, relative to the step's logit
/// scale (the largest |logit| among the reference's top entries, at least 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Largest allowed |ours - reference| for a reference top entry, times the scale.
    pub rel_logit: f32,
    /// A differing argmax is excused only when the reference's own best and our pick are
    /// within `near_tie` times the scale in the reference's row.
    pub near_tie: f32,
}

impl Tolerance {
    /// For F32 weights in SiLU models (Llama, Qwen2). llama.cpp computes in f32, with other
    /// summation orders than an f64 forward pass: over 96 seeds of each tiny F32 Llama and
    /// Qwen2 variant (a 20-token teacher-forced run, every logit of every step), the worst
    /// difference was 4.0e-7 of the scale. 1e-5 leaves a factor of 25 for other compilers
    /// and SIMD widths, and is a thousand times below what a RoPE base off by a factor of
    /// two (9e-3 and up) or two exchanged attention heads (0.3 and up) do to those models.
    pub const F32: Tolerance = Tolerance {
        rel_logit: 1e-5,
        near_tie: 1e-5,
    };

    /// For F32 weights through GELU (Gemma 3): llama.cpp's CPU GELU reads an f16 lookup
    /// table of its input, which moved the tiny Gemma 3 models' logits by up to 2.9e-4 of
    /// the scale (96 seeds, median 1.7e-4); 2e-3 leaves a factor of about 7.
    pub const F32_GELU: Tolerance = Tolerance {
        rel_logit: 2e-3,
        near_tie: 2e-3,
    };

    /// For quantized weights (Q8_0, Q4_0, ...) on the default tiny shapes (hidden 64, head
    /// dim 16), with the weights snapped to the type so that they are exact on both sides:
    /// llama.cpp's quantized products also round the activations to 8-bit blocks, which the
    /// f64 reference does not. Over 96 seeds that moved logits by up to 2.6e-2 of the scale
    /// (Q8_0 Gemma 3; Q8_0 Llama 2.3e-2, Q4_0 Qwen2 1.9e-2); 0.05 leaves a factor of 2, and
    /// is still below what two exchanged attention heads do (0.3 of the scale and more).
    pub const QUANTIZED: Tolerance = Tolerance {
        rel_logit: 0.05,
        near_tie: 0.05,
    };

    /// For quantized weights on the wider K-quant shapes (hidden 256, head dim 64,
    /// [`crate::TinyModelSpec::k_quant_shapes`]): the same activation rounding over longer
    /// dot products moved logits by up to 7.0e-2 of the scale (96 seeds: Q4_K 7.0e-2, Q6_K
    /// 6.4e-2, and Q8_0 on those shapes 5.2e-2); 0.12 leaves a factor of 1.7.
    pub const QUANTIZED_WIDE: Tolerance = Tolerance {
        rel_logit: 0.12,
        near_tie: 0.12,
    };
}

/// The outcome of [`compare_teacher_forced`].
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// Steps compared.
    pub steps: usize,
    /// One line per violated rule, naming the step, the token id and both values.
    pub failures: Vec<String>,
    /// The largest |ours - reference| / scale seen over every compared entry (infinite when a
    /// value was not finite).
    pub worst_rel: f32,
    /// Steps where the argmaxes differ but the reference itself rates them a near-tie.
    pub excused: Vec<String>,
    /// The sum of |ours - reference| / scale over every compared entry, and how many were
    /// compared: a deviation spread over many entries (a systematic fault) shows in their
    /// mean before any single entry crosses `rel_logit`.
    pub sum_rel: f64,
    /// Entries compared.
    pub entries: usize,
}

impl Comparison {
    /// The mean |ours - reference| / scale over every compared entry (0 when none was).
    pub fn mean_rel(&self) -> f64 {
        self.sum_rel / self.entries.max(1) as f64
    }

    /// Whether every rule held at every step.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// Panics listing every failure; otherwise prints a one-line summary (and any excused
    /// near-ties) to stderr.
    pub fn assert_ok(&self, label: &str) {
        assert!(
            self.passed(),
            "{label}: {} of the teacher-forced checks failed over {} steps (worst |diff|/scale \
             {:.3e}):\n  {}",
            self.failures.len(),
            self.steps,
            self.worst_rel,
            self.failures.join("\n  ")
        );
        eprintln!(
            "{label}: {} steps agree, worst |diff|/scale {:.3e}, {} near-ties excused",
            self.steps,
            self.worst_rel,
            self.excused.len()
        );
        for e in &self.excused {
            eprintln!("  {label}: {e}");
        }
    }
}

/// Compares our logit rows with a reference's top entries, step by step, teacher-forced
/// (both sides saw the same tokens at every step).
///
/// `reference[s]` holds the reference's top entries `(id, logit)` of step `s`, best first;
/// `ours[s]` is our full logit row of the same step. For each step, with `scale` the largest
/// |logit| among the reference's entries (at least 1.0):
///
/// 1. every reference entry `(id, r)` needs `|ours[id] - r| <= tol.rel_logit * scale`; a
///    failure names the step, the id and both values;
/// 2. our argmax (the lowest id among equal maxima) must be the reference's first entry,
///    unless the reference itself holds our pick within `tol.near_tie * scale` of its best
///    (for our pick being its second entry: its top-1/top-2 gap is below that). Only the
///    reference's values can excuse a difference: our own flat row does not, and a pick
///    outside the reference's entries is never excused. An excused step is listed in
///    `excused`.
///
/// A differing number of steps, an empty reference step, an id outside our row and any
/// non-finite value are failures too. Every step is checked, whatever failed before it.
pub fn compare_teacher_forced(
    reference: &[Vec<(u32, f32)>],
    ours: &[Vec<f32>],
    tol: Tolerance,
) -> Comparison {
    let mut failures = Vec::new();
    let mut excused = Vec::new();
    let mut worst_rel = 0f32;
    let (mut sum_rel, mut entries) = (0f64, 0usize);
    if reference.len() != ours.len() {
        failures.push(format!(
            "the reference has {} steps and ours {}",
            reference.len(),
            ours.len()
        ));
    }
    let steps = reference.len().min(ours.len());
    for (s, (refs, row)) in reference.iter().zip(ours).enumerate() {
        let Some(&(ref_best, ref_top)) = refs.first() else {
            failures.push(format!("step {s}: the reference has no entries"));
            continue;
        };
        if refs.iter().any(|(_, r)| !r.is_finite()) {
            failures.push(format!("step {s}: the reference has a non-finite logit"));
            worst_rel = f32::INFINITY;
            continue;
        }
        let scale = refs.iter().fold(1f32, |m, (_, r)| m.max(r.abs()));
        let limit = tol.rel_logit * scale;
        for &(id, r) in refs {
            let Some(&o) = row.get(id as usize) else {
                failures.push(format!(
                    "step {s}: id {id} is outside our row of {}",
                    row.len()
                ));
                continue;
            };
            let diff = (o - r).abs();
            let rel = diff / scale;
            let within = diff <= limit; // false for NaN
            worst_rel = worst_rel.max(if rel.is_nan() { f32::INFINITY } else { rel });
            sum_rel += f64::from(rel);
            entries += 1;
            if !within {
                failures.push(format!(
                    "step {s}: id {id}: ours {o} vs reference {r} (|diff| {diff:.3e} > \
                     {limit:.3e} = {} x scale {scale})",
                    tol.rel_logit
                ));
            }
        }
        let Some(our_best) = argmax(row) else {
            failures.push(format!("step {s}: our row is empty or not finite"));
            continue;
        };
        if our_best != ref_best {
            let ours_in_ref = refs.iter().find(|(id, _)| *id == our_best).map(|p| p.1);
            let band = tol.near_tie * scale;
            match ours_in_ref {
                Some(r) if ref_top - r < band => excused.push(format!(
                    "step {s}: our argmax {our_best} vs reference {ref_best}, a near-tie in the \
                     reference ({ref_top} vs {r}, gap {:.3e} < {band:.3e})",
                    ref_top - r
                )),
                _ => failures.push(format!(
                    "step {s}: our argmax {our_best} ({}) vs reference {ref_best} ({ref_top}); the \
                     reference rates ours {}, not within {band:.3e} of its best",
                    row[our_best as usize],
                    ours_in_ref.map_or("outside its top entries".to_string(), |r| r.to_string()),
                )),
            }
        }
    }
    Comparison {
        steps,
        failures,
        worst_rel,
        excused,
        sum_rel,
        entries,
    }
}

/// The index of the largest value (the lowest index among equal maxima); `None` when the
/// row is empty or holds a non-finite value.
fn argmax(row: &[f32]) -> Option<u32> {
    if row.is_empty() || row.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    Some(best as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOL: Tolerance = Tolerance {
        rel_logit: 1e-3,
        near_tie: 1e-2,
    };

    /// A row of 16 logits with a clear order: id 3 best (5.0), then id 7 (4.0), then the
    /// rest descending below 2.0.
    fn row(seed: usize) -> Vec<f32> {
        let mut r: Vec<f32> = (0..16)
            .map(|i| 2.0 - ((i * 7 + seed * 3) % 16) as f32 * 0.25)
            .collect();
        r[3] = 5.0;
        r[7] = 4.0;
        r
    }

    /// The top `k` of a row as the reference gives it: best first, lower id on ties.
    fn top(row: &[f32], k: usize) -> Vec<(u32, f32)> {
        let mut v: Vec<(u32, f32)> = row
            .iter()
            .enumerate()
            .map(|(i, l)| (i as u32, *l))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(k);
        v
    }

    fn steps(n: usize) -> Vec<Vec<f32>> {
        (0..n).map(row).collect()
    }

    fn reference_of(rows: &[Vec<f32>]) -> Vec<Vec<(u32, f32)>> {
        rows.iter().map(|r| top(r, 8)).collect()
    }

    #[test]
    fn identical_rows_pass() {
        let ours = steps(6);
        let c = compare_teacher_forced(&reference_of(&ours), &ours, TOL);
        assert!(c.passed(), "{:?}", c.failures);
        assert_eq!(c.steps, 6);
        assert_eq!(c.worst_rel, 0.0);
        assert!(c.excused.is_empty());
        c.assert_ok("identical");
    }

    #[test]
    fn small_differences_within_tolerance_pass() {
        let rows = steps(3);
        let ours: Vec<Vec<f32>> = rows
            .iter()
            .map(|r| r.iter().map(|v| v + 0.5 * TOL.rel_logit * 5.0).collect())
            .collect();
        let c = compare_teacher_forced(&reference_of(&rows), &ours, TOL);
        assert!(c.passed(), "{:?}", c.failures);
        assert!(
            (c.worst_rel - 0.5 * TOL.rel_logit).abs() < 1e-6,
            "{}",
            c.worst_rel
        );
    }

    /// A deviation spread over every entry shows in the mean, at its own size, while no
    /// single entry fails: what a caller bounding the mean catches.
    #[test]
    fn spread_deviation_shows_in_the_mean() {
        let rows = steps(4);
        let ours: Vec<Vec<f32>> = rows
            .iter()
            .map(|r| r.iter().map(|v| v - 0.25 * TOL.rel_logit * 5.0).collect())
            .collect();
        let c = compare_teacher_forced(&reference_of(&rows), &ours, TOL);
        assert!(c.passed(), "{:?}", c.failures);
        assert_eq!(c.entries, 4 * 8);
        assert!(
            (c.mean_rel() - f64::from(0.25 * TOL.rel_logit)).abs() < 1e-7,
            "{}",
            c.mean_rel()
        );
        let same = compare_teacher_forced(&reference_of(&rows), &rows, TOL);
        assert_eq!(same.mean_rel(), 0.0);
    }

    #[test]
    fn flattened_row_fails() {
        let rows = steps(4);
        let mut ours = rows.clone();
        // same argmax, same order, half the spread: a temperature bug
        ours[1].iter_mut().for_each(|v| *v *= 0.5);
        let c = compare_teacher_forced(&reference_of(&rows), &ours, TOL);
        assert!(!c.passed());
        assert!(
            c.failures.iter().all(|f| f.starts_with("step 1:")),
            "{:?}",
            c.failures
        );
        assert!(
            c.failures[0].contains("id 3: ours 2.5 vs reference 5"),
            "{}",
            c.failures[0]
        );
        assert!((c.worst_rel - 0.5).abs() < 1e-6, "{}", c.worst_rel);
    }

    #[test]
    fn constant_shift_fails() {
        let rows = steps(2);
        // scale is 5.0 (the best logit); shift by twice the tolerance
        let shift = 2.0 * TOL.rel_logit * 5.0;
        let ours: Vec<Vec<f32>> = rows
            .iter()
            .map(|r| r.iter().map(|v| v + shift).collect())
            .collect();
        let c = compare_teacher_forced(&reference_of(&rows), &ours, TOL);
        // every top-8 entry of both steps, and no argmax complaint
        assert_eq!(c.failures.len(), 16, "{:?}", c.failures);
        assert!(
            (c.worst_rel - 2.0 * TOL.rel_logit).abs() < 1e-5,
            "{}",
            c.worst_rel
        );
    }

    #[test]
    fn swapped_top_entries_fail_unless_reference_near_tie() {
        // tolerance wide enough that only the argmax rule can fail
        let wide = Tolerance {
            rel_logit: 1.0,
            near_tie: 0.05,
        };
        let reference = row(0);
        let mut ours = reference.clone();
        ours.swap(3, 7);
        let c = compare_teacher_forced(&[top(&reference, 8)], &[ours.clone()], wide);
        assert_eq!(c.failures.len(), 1, "{:?}", c.failures);
        assert!(
            c.failures[0].contains("our argmax 7 (5) vs reference 3 (5)"),
            "{}",
            c.failures[0]
        );
        // the reference's own gap is 1.0 = 0.2 of the scale: no near-tie excuse
        assert!(c.excused.is_empty());

        // the same swap where the reference's top two are 0.1 apart (0.02 of the scale)
        let mut tied = reference.clone();
        tied[7] = 4.9;
        let mut ours = tied.clone();
        ours.swap(3, 7);
        let c = compare_teacher_forced(&[top(&tied, 8)], &[ours.clone()], wide);
        assert!(c.passed(), "{:?}", c.failures);
        assert_eq!(c.excused.len(), 1);
        assert!(c.excused[0].contains("near-tie"), "{}", c.excused[0]);

        // our own near-tie does not excuse us: the reference is clear, ours is flat at the top
        let mut flat = reference.clone();
        flat[7] = 5.0 + 1e-6;
        let c = compare_teacher_forced(&[top(&reference, 8)], &[flat], wide);
        assert_eq!(c.failures.len(), 1, "{:?}", c.failures);
        assert!(c.excused.is_empty());
    }

    #[test]
    fn argmax_outside_reference_entries_is_not_excused() {
        let wide = Tolerance {
            rel_logit: 1.0,
            near_tie: 1.0,
        };
        let reference = row(0);
        let mut ours = reference.clone();
        // id 15 is outside the reference's top 2
        ours[15] = 6.0;
        let c = compare_teacher_forced(&[top(&reference, 2)], &[ours], wide);
        assert_eq!(c.failures.len(), 1, "{:?}", c.failures);
        assert!(
            c.failures[0].contains("outside its top entries"),
            "{}",
            c.failures[0]
        );
    }

    #[test]
    fn every_step_is_checked() {
        let rows = steps(8);
        let mut ours = rows.clone();
        ours[2][3] += 1.0;
        ours[5][7] -= 1.0;
        let c = compare_teacher_forced(&reference_of(&rows), &ours, TOL);
        assert_eq!(c.failures.len(), 2, "{:?}", c.failures);
        assert!(
            c.failures[0].starts_with("step 2: id 3:"),
            "{}",
            c.failures[0]
        );
        assert!(
            c.failures[1].starts_with("step 5: id 7:"),
            "{}",
            c.failures[1]
        );
        assert_eq!(c.steps, 8);
    }

    #[test]
    fn malformed_inputs_fail() {
        let rows = steps(3);
        let reference = reference_of(&rows);
        // a missing step
        assert!(!compare_teacher_forced(&reference, &rows[..2], TOL).passed());
        // a NaN in our row
        let mut nan = rows.clone();
        nan[1][3] = f32::NAN;
        let c = compare_teacher_forced(&reference, &nan, TOL);
        assert!(!c.passed());
        assert_eq!(c.worst_rel, f32::INFINITY);
        // a NaN outside the reference's entries still fails the argmax rule
        let mut nan = rows.clone();
        let outside = (0..16)
            .find(|i| !reference[0].iter().any(|(id, _)| id == i))
            .unwrap();
        nan[0][outside as usize] = f32::NAN;
        assert!(!compare_teacher_forced(&reference, &nan, TOL).passed());
        // a short row
        let short = vec![rows[0][..4].to_vec(), rows[1].clone(), rows[2].clone()];
        assert!(!compare_teacher_forced(&reference, &short, TOL).passed());
        // an empty reference step
        let mut empty = reference.clone();
        empty[0].clear();
        assert!(!compare_teacher_forced(&empty, &rows, TOL).passed());
    }

    #[test]
    #[should_panic(expected = "teacher-forced checks failed")]
    fn assert_ok_panics_on_failure() {
        let rows = steps(1);
        let mut ours = rows.clone();
        ours[0][3] = 0.0;
        compare_teacher_forced(&reference_of(&rows), &ours, TOL).assert_ok("planted");
    }

    #[test]
    fn parses_the_oracle_line() {
        let line = r#"{"ids":[5,6],"generated":[7],"n_vocab":4,"eos":3,"bos":-1,"chat":"a\nb",
            "steps":[[[2,1.5],[0,null]],[[1,2.25],[3,-1]]],"prompt_steps":[[[0,1]],[[2,1.5]]],
            "logits":[[0,1,1.5,0.5],[0,2.25,1,-1]]}"#;
        let run = parse_run(&serde_json::from_str(line).unwrap()).unwrap();
        assert_eq!(run.ids, vec![5, 6]);
        assert_eq!(run.generated, vec![7]);
        assert_eq!(run.sequence(), vec![5, 6, 7]);
        assert_eq!(run.n_vocab, 4);
        assert_eq!((run.eos, run.bos), (Some(3), None));
        assert_eq!(run.chat.as_deref(), Some("a\nb"));
        assert_eq!(run.steps[0][0], (2, 1.5));
        assert!(run.steps[0][1].1.is_nan());
        assert_eq!(run.steps[1], vec![(1, 2.25), (3, -1.0)]);
        assert_eq!(run.prompt_steps.len(), 2);
        let full = run.full_steps().unwrap();
        assert_eq!(full[0], vec![(2, 1.5), (1, 1.0), (3, 0.5), (0, 0.0)]);
        // a row of the wrong length is refused
        let bad = line.replace("[0,2.25,1,-1]", "[0,2.25,1]");
        assert!(parse_run(&serde_json::from_str(&bad).unwrap()).is_err());
    }
}
