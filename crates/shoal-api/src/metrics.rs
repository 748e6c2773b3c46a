//! Prometheus metrics of one server, in its own registry (no process-global recorder, so
//! several servers in one test process do not mix): requests by route and status, prompt and
//! generated tokens, requests resumed after a lost node, cluster shards loaded or kept from
//! a previous placement, time to first token, inter-token latency, and, read from each model's
//! scheduler at scrape time, queue depth, active sequences and the last decode batch size.

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of the request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    /// The route pattern (`/v1/chat/completions`), never the raw path.
    pub route: String,
    /// The HTTP method.
    pub method: String,
    /// The response status code.
    pub status: String,
}

/// Labels of per-model series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    /// The model id.
    pub model: String,
}

fn latency_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

/// One model's running totals on this node, as the dashboard charts them (rates come from
/// the difference between two readings).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelFigures {
    /// Tokens generated since start.
    pub generated: u64,
    /// Requests that got their first token since start, and the sum of their times to it,
    /// seconds.
    pub first_tokens: u64,
    pub ttft_sum_s: f64,
    /// Requests holding a batch slot now, and waiting for one.
    pub active: u64,
    pub queued: u64,
}

/// The server's metrics.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// Per model, what the dashboard charts.
    figures: Mutex<std::collections::BTreeMap<String, ModelFigures>>,
    requests: Family<RouteLabels, Counter>,
    prompt_tokens: Family<ModelLabels, Counter>,
    generated_tokens: Family<ModelLabels, Counter>,
    resumed: Family<ModelLabels, Counter>,
    shards_loaded: Family<ModelLabels, Counter>,
    shards_kept: Family<ModelLabels, Counter>,
    shard_layers_kept: Family<ModelLabels, Counter>,
    too_long: Family<ModelLabels, Counter>,
    ttft: Family<ModelLabels, Histogram, fn() -> Histogram>,
    itl: Family<ModelLabels, Histogram, fn() -> Histogram>,
    queue_depth: Family<ModelLabels, Gauge>,
    active: Family<ModelLabels, Gauge>,
    batch_size: Family<ModelLabels, Gauge>,
    decode_steps: Family<ModelLabels, Gauge<u64, AtomicU64>>,
    sequences: Family<ModelLabels, Gauge<u64, AtomicU64>>,
    prefix_hits: Family<ModelLabels, Gauge<u64, AtomicU64>>,
    cached_tokens: Family<ModelLabels, Gauge<u64, AtomicU64>>,
    kept_tokens: Family<ModelLabels, Gauge<u64, AtomicU64>>,
    kept_bytes: Family<ModelLabels, Gauge<u64, AtomicU64>>,
    drafted: Family<ModelLabels, Gauge<u64, AtomicU64>>,
    accepted_drafts: Family<ModelLabels, Gauge<u64, AtomicU64>>,
    drafted_ahead: Family<ModelLabels, Gauge<u64, AtomicU64>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every series described.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("shoal");
        let requests = Family::<RouteLabels, Counter>::default();
        r.register(
            "http_requests",
            "HTTP requests answered, by route, method and status",
            requests.clone(),
        );
        let prompt_tokens = Family::<ModelLabels, Counter>::default();
        r.register(
            "prompt_tokens",
            "Prompt tokens of admitted requests",
            prompt_tokens.clone(),
        );
        let generated_tokens = Family::<ModelLabels, Counter>::default();
        r.register(
            "generated_tokens",
            "Tokens generated",
            generated_tokens.clone(),
        );
        let resumed = Family::<ModelLabels, Counter>::default();
        r.register(
            "requests_resumed",
            "Requests that went on where their instance was placed again after it lost a node",
            resumed.clone(),
        );
        let shards_loaded = Family::<ModelLabels, Counter>::default();
        r.register(
            "shards_loaded",
            "Shards of cluster instances this node loaded from their file",
            shards_loaded.clone(),
        );
        let shards_kept = Family::<ModelLabels, Counter>::default();
        r.register(
            "shards_kept",
            "Shards of cluster instances this node kept loaded from the instance's previous placement",
            shards_kept.clone(),
        );
        let shard_layers_kept = Family::<ModelLabels, Counter>::default();
        r.register(
            "shard_layers_kept",
            "Layers of cluster instances' shards this node kept loaded from the instance's \
             previous placement, in shards taken whole and in shards that grew or moved",
            shard_layers_kept.clone(),
        );
        let too_long = Family::<ModelLabels, Counter>::default();
        r.register(
            "prompts_too_long",
            "Requests refused because their prompt does not fit the model's context (a limit \
             clients act on, such as by compacting the conversation, not a fault)",
            too_long.clone(),
        );
        let ttft: Family<ModelLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        r.register(
            "time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token",
            ttft.clone(),
        );
        let itl: Family<ModelLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        r.register(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            itl.clone(),
        );
        let queue_depth = Family::<ModelLabels, Gauge>::default();
        r.register(
            "queue_depth",
            "Requests waiting for a batch slot",
            queue_depth.clone(),
        );
        let active = Family::<ModelLabels, Gauge>::default();
        r.register(
            "active_sequences",
            "Requests holding a batch slot",
            active.clone(),
        );
        let batch_size = Family::<ModelLabels, Gauge>::default();
        r.register(
            "batch_size",
            "Sequences in the most recent decode step",
            batch_size.clone(),
        );
        let decode_steps = Family::<ModelLabels, Gauge<u64, AtomicU64>>::default();
        r.register(
            "decode_steps",
            "Batched decode steps run since start",
            decode_steps.clone(),
        );
        let count = |r: &mut Registry, name: &str, help: &str| {
            let f = Family::<ModelLabels, Gauge<u64, AtomicU64>>::default();
            r.register(name, help, f.clone());
            f
        };
        let sequences = count(
            &mut r,
            "sequences_started",
            "Requests that began generating since start",
        );
        let prefix_hits = count(
            &mut r,
            "prefix_cache_hits",
            "Requests since start whose prompt started from the KV cache of an earlier or running request",
        );
        let cached_tokens = count(
            &mut r,
            "prompt_tokens_cached",
            "Prompt tokens since start taken from such caches instead of run",
        );
        let kept_tokens = count(
            &mut r,
            "prefix_cache_tokens",
            "Positions held by the KV caches kept for later requests",
        );
        let kept_bytes = count(
            &mut r,
            "prefix_cache_bytes",
            "The model's KV cache bytes for those positions (over every rank of a split model)",
        );
        let drafted = count(
            &mut r,
            "draft_tokens",
            "Tokens drafted by speculative decoding (prompt lookup, a draft model or the prediction layer) and checked",
        );
        let accepted_drafts = count(
            &mut r,
            "draft_tokens_accepted",
            "Of those, the tokens the model sampled too (emitted without a step of their own)",
        );
        let drafted_ahead = count(
            &mut r,
            "draft_tokens_ahead",
            "Drafted tokens a pipeline's lead made while the later stages checked the draft before them",
        );
        Metrics {
            registry: Mutex::new(r),
            figures: Mutex::default(),
            drafted,
            accepted_drafts,
            drafted_ahead,
            sequences,
            prefix_hits,
            cached_tokens,
            kept_tokens,
            kept_bytes,
            requests,
            prompt_tokens,
            generated_tokens,
            resumed,
            shards_loaded,
            shards_kept,
            shard_layers_kept,
            too_long,
            ttft,
            itl,
            queue_depth,
            active,
            batch_size,
            decode_steps,
        }
    }

    /// Counts an answered request.
    pub fn request(&self, route: &str, method: &str, status: u16) {
        self.requests
            .get_or_create(&RouteLabels {
                route: route.to_string(),
                method: method.to_string(),
                status: status.to_string(),
            })
            .inc();
    }

    fn model(model: &str) -> ModelLabels {
        ModelLabels {
            model: model.to_string(),
        }
    }

    /// Counts an admitted request's prompt.
    pub fn prompt(&self, model: &str, tokens: usize) {
        self.prompt_tokens
            .get_or_create(&Self::model(model))
            .inc_by(tokens as u64);
    }

    /// Records one generated token, and the latency since the previous one (or since
    /// arrival for the first).
    pub fn token(&self, model: &str, first: bool, since: Duration) {
        let m = Self::model(model);
        self.generated_tokens.get_or_create(&m).inc();
        let h = if first { &self.ttft } else { &self.itl };
        h.get_or_create(&m).observe(since.as_secs_f64());
        let mut figures = self.figures.lock().unwrap_or_else(|e| e.into_inner());
        // per token: the model's entry exists after its first token, so no key is built
        let f = match figures.get_mut(model) {
            Some(f) => f,
            None => figures.entry(model.to_string()).or_default(),
        };
        f.generated += 1;
        if first {
            f.first_tokens += 1;
            f.ttft_sum_s += since.as_secs_f64();
        }
    }

    /// Per model, the totals the dashboard charts.
    pub fn figures(&self) -> std::collections::BTreeMap<String, ModelFigures> {
        self.figures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Counts a request refused because its prompt does not fit the context.
    pub fn too_long(&self, model: &str) {
        self.too_long.get_or_create(&Self::model(model)).inc();
    }

    /// Counts a request that went on after its instance lost a node.
    pub fn resumed(&self, model: &str) {
        self.resumed.get_or_create(&Self::model(model)).inc();
    }

    /// Counts a shard of instance `model` this node's rank took: one that read
    /// `layers_loaded` layers from its file (counted as loaded), or none (taken whole from
    /// the rank it held in the previous placement), keeping `layers_kept` loaded layers.
    pub fn shard(&self, model: &str, layers_kept: usize, layers_loaded: usize) {
        let m = Self::model(model);
        let family = if layers_loaded == 0 {
            &self.shards_kept
        } else {
            &self.shards_loaded
        };
        family.get_or_create(&m).inc();
        self.shard_layers_kept
            .get_or_create(&m)
            .inc_by(layers_kept as u64);
    }

    /// Sets the scheduler gauges of `model`.
    pub fn scheduler(&self, model: &str, queued: usize, active: usize, batch: usize, steps: u64) {
        {
            let mut f = self.figures.lock().unwrap_or_else(|e| e.into_inner());
            let f = f.entry(model.to_string()).or_default();
            f.active = active as u64;
            f.queued = queued as u64;
        }
        let m = Self::model(model);
        self.queue_depth.get_or_create(&m).set(queued as i64);
        self.active.get_or_create(&m).set(active as i64);
        self.batch_size.get_or_create(&m).set(batch as i64);
        self.decode_steps.get_or_create(&m).set(steps);
    }

    /// Sets the prefix cache's and speculative decoding's figures of `model` from its
    /// scheduler's counters.
    pub fn prefix_cache(&self, model: &str, s: &shoal_engine::scheduler::SchedulerStats) {
        use std::sync::atomic::Ordering::Relaxed;
        let m = Self::model(model);
        self.sequences
            .get_or_create(&m)
            .set(s.sequences.load(Relaxed));
        self.prefix_hits
            .get_or_create(&m)
            .set(s.prefix_hits.load(Relaxed));
        self.cached_tokens
            .get_or_create(&m)
            .set(s.cached_prompt_tokens.load(Relaxed));
        self.kept_tokens
            .get_or_create(&m)
            .set(s.kept_tokens.load(Relaxed));
        self.kept_bytes
            .get_or_create(&m)
            .set(s.kept_bytes.load(Relaxed));
        self.drafted.get_or_create(&m).set(s.drafted.load(Relaxed));
        self.accepted_drafts
            .get_or_create(&m)
            .set(s.accepted_drafts.load(Relaxed));
        self.drafted_ahead
            .get_or_create(&m)
            .set(s.drafted_ahead.load(Relaxed));
    }

    /// The exposition in the OpenMetrics text format.
    pub fn render_openmetrics(&self) -> String {
        let mut out = String::new();
        let r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if encode(&mut out, &r).is_err() {
            out.clear();
        }
        out
    }

    /// The exposition in Prometheus' classic text format (0.0.4), which every scraper and
    /// `promtool check metrics` read: counters are described under their `_total` sample
    /// name, and there is no `# EOF`.
    pub fn render(&self) -> String {
        let open = self.render_openmetrics();
        let mut counters = std::collections::HashSet::new();
        for line in open.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                if let Some(name) = rest.strip_suffix(" counter") {
                    counters.insert(name.to_string());
                }
            }
        }
        let mut out = String::with_capacity(open.len() + 64);
        for line in open.lines() {
            if line == "# EOF" {
                continue;
            }
            let meta = line
                .strip_prefix("# HELP ")
                .map(|r| ("# HELP ", r))
                .or_else(|| line.strip_prefix("# TYPE ").map(|r| ("# TYPE ", r)));
            match meta {
                Some((kind, rest)) => {
                    let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                    if counters.contains(name) {
                        out.push_str(&format!("{kind}{name}_total {tail}"));
                    } else {
                        out.push_str(line);
                    }
                }
                None => out.push_str(line),
            }
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_series_with_labels() {
        let m = Metrics::new();
        m.request("/v1/chat/completions", "POST", 200);
        m.prompt("smollm2", 12);
        m.token("smollm2", true, Duration::from_millis(30));
        m.token("smollm2", false, Duration::from_millis(10));
        m.scheduler("smollm2", 1, 2, 2, 5);
        let text = m.render();
        assert!(text.contains(
            "shoal_http_requests_total{route=\"/v1/chat/completions\",method=\"POST\",status=\"200\"} 1"
        ), "{text}");
        assert!(
            text.contains("shoal_prompt_tokens_total{model=\"smollm2\"} 12"),
            "{text}"
        );
        assert!(text.contains("shoal_time_to_first_token_seconds_count{model=\"smollm2\"} 1"));
        assert!(text.contains("shoal_batch_size{model=\"smollm2\"} 2"));
        assert!(
            text.contains("# TYPE shoal_http_requests_total counter"),
            "{text}"
        );
        assert!(!text.contains("# EOF"));
        assert!(m.render_openmetrics().ends_with("# EOF\n"));
    }
}
