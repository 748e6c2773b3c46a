//! This node's measured decode costs of the model shapes it may serve, for the planner
//! ([`shoal_planner::calibration`]). `shoal bench MODEL --calibrate` measures one shape: it
//! decodes with the engine's profile on, which times each part of every step apart by where
//! it ran (a dense block, a mixture-of-experts block, the head, the rest), and turns those
//! times into per-layer costs with the planner's own count of the bytes each part reads. The
//! result is kept in the node's calibration store (`calibrations/` beside the models
//! folder), one file per shape and thread count; `shoal serve` publishes the ones measured
//! with its thread count, and a cluster file may name them (`shoal plan --help`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use shoal_engine::model::LoadedModel;
use shoal_engine::profile::{self, Op, Part};
use shoal_engine::transformer::argmax;
use shoal_planner::{Calibration, DecodeTimes, ModelProfile, PrefillTimes};

use crate::bench::{measure_read_bandwidth, prompt_tokens, timed_on_pool};

/// Where this node keeps its calibrations.
///
/// # Errors
/// When neither `SHOAL_HOME` nor `HOME` is set.
pub fn dir() -> anyhow::Result<PathBuf> {
    let models = shoal_model::catalog::models_dir()?;
    Ok(models
        .parent()
        .map_or_else(|| models.join("calibrations"), |p| p.join("calibrations")))
}

/// Seconds in `part`'s ops since the profile was reset: (not reading weights, reading
/// weights).
fn part_secs(part: Part) -> (f64, f64) {
    profile::snapshot_of(part)
        .into_iter()
        .fold((0.0, 0.0), |(fixed, weights), (op, s)| {
            if op.reads_weights() {
                (fixed, weights + s)
            } else {
                (fixed + s, weights)
            }
        })
}

/// Prompt rows of the prefill runs a calibration times (one chunk).
const PREFILL_ROWS: usize = 128;

/// Measures this node's decode and prefill costs of `model` (whose planner profile is
/// `profile`) with `threads` threads: `tokens` one-token steps from an empty cache, `reps`
/// times, and `reps` prefills of [`PREFILL_ROWS`] rows, each with the profile on, then a
/// read-bandwidth probe.
///
/// # Errors
/// When the model runs on a GPU (a GPU's layers are predicted from its bandwidth) or a step
/// fails.
pub fn measure(
    model: &LoadedModel,
    profile: &ModelProfile,
    threads: usize,
    tokens: usize,
    reps: usize,
) -> anyhow::Result<Calibration> {
    let t = &model.transformer;
    if t.backend() != "cpu" {
        anyhow::bail!(
            "calibration measures the CPU's costs, and {} runs on the {}; run it with \
             --device cpu",
            model.name,
            t.backend()
        );
    }
    let (tokens, reps) = (tokens.max(1), reps.max(1));
    let ctx = (tokens + 1).min(t.config().context_len);
    let vocab = t.config().vocab;
    let mut cache = t.new_cache(ctx);
    // page the weights in before timing
    t.prefill(&prompt_tokens(2.min(ctx), vocab), &mut cache)?;
    profile::reset();
    let mut secs = 0.0;
    let mut steps = 0;
    for rep in 0..reps {
        cache.clear();
        let mut tok = prompt_tokens(rep + 1, vocab)[rep];
        let n = tokens.min(ctx);
        profile::enable(true);
        let timed = timed_on_pool(|| {
            for _ in 0..n {
                let logits = t.forward_last(&[tok], &mut cache)?;
                tok = argmax(&logits) as u32;
            }
            Ok(())
        });
        profile::enable(false);
        secs += timed?;
        steps += n;
    }
    let decode = decode_times(steps, secs);
    let rows = PREFILL_ROWS.min(t.config().context_len);
    let mut cache = t.new_cache(rows);
    profile::reset();
    let mut prefill_secs = 0.0;
    for rep in 0..reps {
        cache.clear();
        let prompt = prompt_tokens(rows + rep, vocab)[rep..].to_vec();
        profile::enable(true);
        let timed = timed_on_pool(|| {
            t.prefill(&prompt, &mut cache)?;
            Ok(())
        });
        profile::enable(false);
        prefill_secs += timed?;
    }
    let prefill = PrefillTimes {
        rows,
        runs: reps,
        dense: attention_and_rest(Part::DenseLayer),
        moe: attention_and_rest(Part::MoeLayer),
        total_secs: prefill_secs,
    };
    let bw = measure_read_bandwidth(threads);
    Calibration::from_times(profile, threads as u32, bw, &decode, &prefill)
        .map_err(|e| anyhow::anyhow!("calibrating {}: {e}", profile.name))
}

/// Seconds in `part`'s ops since the profile was reset: (attention's scores and sums,
/// everything else).
fn attention_and_rest(part: Part) -> (f64, f64) {
    profile::snapshot_of(part)
        .into_iter()
        .fold((0.0, 0.0), |(attention, rest), (op, s)| {
            if op == Op::Attention {
                (attention + s, rest)
            } else {
                (attention, rest + s)
            }
        })
}

/// The decode times the profile gathered over `tokens` one-token steps that took
/// `total_secs`.
fn decode_times(tokens: usize, total_secs: f64) -> DecodeTimes {
    let head_secs = profile::snapshot_of(Part::Outside)
        .into_iter()
        .find(|(op, _)| *op == Op::Head)
        .map_or(0.0, |(_, s)| s);
    DecodeTimes {
        tokens,
        dense: part_secs(Part::DenseLayer),
        moe: part_secs(Part::MoeLayer),
        head_secs,
        total_secs,
    }
}

/// Writes `cal` into the store (replacing an earlier one of the same shape and threads) and
/// returns its path.
///
/// # Errors
/// When the store cannot be written.
pub fn store(cal: &Calibration) -> anyhow::Result<PathBuf> {
    let dir = dir()?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{}-t{}.json", cal.shape, cal.threads));
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(cal)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Reads one calibration file.
///
/// # Errors
/// When it cannot be read or is not a valid calibration; the message names the file.
pub fn read(path: &Path) -> anyhow::Result<Calibration> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let cal: Calibration = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a calibration (write one with `shoal bench MODEL --calibrate`)",
            path.display()
        )
    })?;
    cal.validate()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(cal)
}

/// The stored calibrations measured with `threads` threads. A file that cannot be used is
/// skipped with a warning naming it.
pub fn stored(threads: usize) -> Vec<Calibration> {
    let Ok(dir) = dir() else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut found: Vec<Calibration> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| match read(&p) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!("skipping a calibration: {e:#}");
                None
            }
        })
        .filter(|c| c.threads as usize == threads)
        .collect();
    found.sort_by(|a, b| a.shape.cmp(&b.shape));
    found
}
