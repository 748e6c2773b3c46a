//! The GPU backend against the f64 oracle and the CPU backend, on the test kit's tiny
//! models written as real GGUF files. Runs on whatever GPU adapter the machine has; CI has
//! Mesa's software Vulkan driver (lavapipe), which runs the same WGSL on the CPU. Without an
//! adapter the tests skip, except under `CI=true` or `SHOAL_REQUIRE_GPU=1`, where they fail.
//!
//! Tolerances, and why: the GPU computes in f32 from the weights' exact values (it decodes
//! quantized blocks as it reads them and never quantizes activations), and keeps keys and
//! values in f16 as the oracle models; so its logits differ from the oracle's by f32
//! rounding, in a different order of summation than the CPU's, plus an f16 rounding that
//! falls on the other side of a midpoint (seen in the CPU tests: up to 5.6e-4 on the
//! 256-wide shapes). `TOL = 2e-3` absolute, on logits of magnitude 1-10; a real mistake (a
//! wrong pairing, mask, scale, window or block decoding) moves them by 1e-1 or more.
//! Greedy tokens are compared with the CPU backend's; where they differ, the CPU's top-2
//! margin at that step must be under twice the tolerance (a near-tie, as the golden test
//! treats it), and the comparison stops there.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shoal_engine::device::{GpuLayers, Placement};
use shoal_engine::transformer::argmax;
use shoal_engine::weights::GgufWeights;
use shoal_engine::{arch, Device, Transformer};
use shoal_model::gguf::GgufFile;
use shoal_testkit::{GgmlType, TinyModel, TinyModelSpec};

const TOL: f32 = 2e-3;
const PROMPT: [u32; 12] = [1, 17, 250, 42, 99, 3, 311, 7, 128, 64, 200, 5];

/// Whether a GPU adapter is there (else the test skips, or fails under CI).
fn have_gpu(test: &str) -> bool {
    if shoal_engine::device::gpus().is_empty() {
        assert!(
            std::env::var("SHOAL_REQUIRE_GPU").as_deref() != Ok("1"),
            "{test}: no GPU adapter, and SHOAL_REQUIRE_GPU=1"
        );
        shoal_testkit::skip_or_fail(
            test,
            "no GPU adapter (on Debian: apt-get install mesa-vulkan-drivers libvulkan1)",
        );
        return false;
    }
    true
}

fn load(path: &Path, device: impl Into<Placement>) -> Transformer {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, "gpu test").unwrap();
    let src = GgufWeights::new(file);
    Transformer::load_on_device(device, &src, cfg, Arc::new(shoal_comm::Solo)).unwrap()
}

/// The error of loading `path` on `device`, which must fail.
fn load_error(path: &Path, device: Device) -> String {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, "gpu test").unwrap();
    match Transformer::load_on_device(
        device,
        &GgufWeights::new(file),
        cfg,
        Arc::new(shoal_comm::Solo),
    ) {
        Ok(_) => panic!("{} loaded on {device}", path.display()),
        Err(e) => e.to_string(),
    }
}

fn write(m: &TinyModel, dir: &Path, ty: GgmlType) -> PathBuf {
    let p = dir.join(format!("{}-{}-{ty:?}.gguf", m.spec().name, m.spec().seed));
    m.write_gguf(&p, ty).unwrap();
    p
}

fn rows(logits: Vec<f32>, vocab: usize) -> Vec<Vec<f32>> {
    logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

fn top2_margin(xs: &[f32]) -> f32 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

/// Logits at every position of `ids`, fed in `chunks` (prefill: one chunk; decode: ones).
fn chunked(t: &Transformer, ids: &[u32], chunks: &[usize]) -> Vec<Vec<f32>> {
    let mut cache = t.new_cache(64);
    let vocab = t.config().vocab;
    let mut out = Vec::new();
    let mut at = 0;
    for &n in chunks {
        out.extend(rows(
            t.forward(&ids[at..at + n], &mut cache, n).unwrap(),
            vocab,
        ));
        at += n;
    }
    out
}

/// The GPU's logits against the oracle (prefill, one at a time, and a mix), and its greedy
/// tokens against the CPU's.
fn check(spec: TinyModelSpec, ty: GgmlType) {
    let m = spec.build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = write(&m, dir.path(), ty);
    let gpu = load(&path, Device::Gpu(None));
    let cpu = load(&path, Device::Cpu);
    let label = format!("{} seed {} {ty:?}", m.spec().name, m.spec().seed);
    let oracle = m.reference_logits_f16_kv(&PROMPT);
    let ones = vec![1; PROMPT.len()];
    for (what, chunks) in [
        ("prefill", vec![PROMPT.len()]),
        ("decode", ones),
        ("chunks 5+1+6", vec![5, 1, 6]),
    ] {
        let got = chunked(&gpu, &PROMPT, &chunks);
        let d = max_abs_diff(&got, &oracle);
        eprintln!("{label}: {what}: max|gpu - oracle| {d:.2e}");
        assert!(
            d < TOL,
            "{label}: {what}: GPU logits differ from the oracle by {d}"
        );
    }
    // greedy tokens, GPU and CPU
    let (mut cg, mut cc) = (gpu.new_cache(64), cpu.new_cache(64));
    let mut lg = gpu.forward_last(&PROMPT, &mut cg).unwrap();
    let mut lc = cpu.forward_last(&PROMPT, &mut cc).unwrap();
    let mut same = 0;
    for step in 0..16 {
        let (g, c) = (argmax(&lg) as u32, argmax(&lc) as u32);
        if g != c {
            let margin = top2_margin(&lc);
            assert!(
                margin < 2.0 * 0.15,
                "{label}: step {step}: GPU token {g}, CPU token {c}, CPU margin {margin}"
            );
            eprintln!("{label}: near-tie at step {step} (CPU margin {margin:.3}); stopped");
            break;
        }
        same += 1;
        lg = gpu.forward_last(&[g], &mut cg).unwrap();
        lc = cpu.forward_last(&[c], &mut cc).unwrap();
    }
    eprintln!("{label}: {same} greedy tokens equal the CPU's");
}

#[test]
fn dense_f32_models_match_the_oracle() {
    if !have_gpu("dense_f32_models_match_the_oracle") {
        return;
    }
    check(TinyModelSpec::llama(1), GgmlType::F32);
    check(TinyModelSpec::qwen2(3).tied(false), GgmlType::F32);
    check(TinyModelSpec::qwen3(9), GgmlType::F32);
    check(TinyModelSpec::gemma3(5), GgmlType::F32);
    check(TinyModelSpec::llama31(11), GgmlType::F32);
}

#[test]
fn f16_models_match_the_oracle() {
    if !have_gpu("f16_models_match_the_oracle") {
        return;
    }
    check(
        TinyModelSpec::llama(21).snapped_to(GgmlType::F16),
        GgmlType::F16,
    );
    check(
        TinyModelSpec::qwen2(22).snapped_to(GgmlType::F16),
        GgmlType::F16,
    );
}

#[test]
fn moe_models_match_the_oracle() {
    if !have_gpu("moe_models_match_the_oracle") {
        return;
    }
    check(TinyModelSpec::qwen3moe(1), GgmlType::F32);
    check(TinyModelSpec::mixtral(2), GgmlType::F32);
    // GLM: biased q/k/v, q/k norms, RoPE on half of each head, sigmoid routing with a
    // selection bias beside a shared expert
    check(TinyModelSpec::glm4moe(3), GgmlType::F32);
}

/// DeepSeek V2 and V3 (multi-head latent attention, shared experts, leading dense layers,
/// YaRN; V3's sigmoid routing with a correction bias).
#[test]
fn latent_attention_models_match_the_oracle() {
    if !have_gpu("latent_attention_models_match_the_oracle") {
        return;
    }
    check(TinyModelSpec::deepseek2(1), GgmlType::F32);
    check(TinyModelSpec::deepseek3(2), GgmlType::F32);
    check(
        TinyModelSpec::deepseek2(3).snapped_to(GgmlType::Q8_0),
        GgmlType::Q8_0,
    );
}

/// Every quantized type the test kit writes, in a whole model: the weights are snapped to
/// the type, so the oracle computes over exactly the values the file holds. (Q5_0, Q5_1
/// and Q5_K, which it does not write, are checked block by block in the backend's unit
/// tests, against candle's decoding.)
#[test]
fn quantized_models_match_the_oracle() {
    if !have_gpu("quantized_models_match_the_oracle") {
        return;
    }
    for (spec, ty) in [
        (TinyModelSpec::llama(153), GgmlType::Q8_0),
        (TinyModelSpec::qwen2(159).tied(false), GgmlType::Q4_0),
        (TinyModelSpec::gemma3(133), GgmlType::Q4_1),
        (TinyModelSpec::qwen3(31), GgmlType::BF16),
        (TinyModelSpec::llama(147).k_quant_shapes(), GgmlType::Q2_K),
        (TinyModelSpec::qwen2(127).k_quant_shapes(), GgmlType::Q3_K),
        (TinyModelSpec::llama31(163).k_quant_shapes(), GgmlType::Q4_K),
        (TinyModelSpec::qwen3(162).k_quant_shapes(), GgmlType::Q6_K),
    ] {
        check(spec.snapped_to(ty), ty);
    }
}

/// The routed experts in a quantized file.
#[test]
fn quantized_moe_matches_the_oracle() {
    if !have_gpu("quantized_moe_matches_the_oracle") {
        return;
    }
    check(
        TinyModelSpec::qwen3moe(3).snapped_to(GgmlType::Q8_0),
        GgmlType::Q8_0,
    );
    check(
        TinyModelSpec::mixtral(4).snapped_to(GgmlType::Q4_0),
        GgmlType::Q4_0,
    );
}

/// Greedy tokens of a tensor-parallel split over two in-process ranks, rank `r` on
/// `devices[r]`: rank 1 serves steps, rank 0 leads (`parallel::Lead`, as a split instance
/// runs).
fn split_tokens(path: &Path, devices: [Placement; 2], n: usize) -> Vec<u32> {
    use shoal_comm::{mem_mesh, Transport};
    use shoal_engine::parallel::{serve, Lead, RankContext, Want};
    use shoal_engine::shard::{self, ExpertSplit, Layout};
    let layout = Layout { tp: 2, pp: 1 };
    let capacity = PROMPT.len() + n + 1;
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, "gpu test").unwrap();
    let src = GgufWeights::new(file);
    let plans = shard::plan(&cfg, &src, layout, None, ExpertSplit::Auto).unwrap();
    let mut ctxs: Vec<RankContext> = mem_mesh(2)
        .into_iter()
        .map(|t| {
            let t: Arc<dyn Transport> = Arc::new(t);
            let mut ctx = RankContext::over(t, layout, std::time::Duration::from_secs(60)).unwrap();
            ctx.plans = plans.clone();
            ctx
        })
        .collect();
    let ctx1 = ctxs.pop().unwrap();
    let ctx0 = ctxs.pop().unwrap();
    let (path1, cfg1, plan1) = (path.to_path_buf(), cfg.clone(), plans[1].clone());
    let worker = std::thread::spawn(move || {
        let src = GgufWeights::new(GgufFile::open(&path1).unwrap());
        let m = Transformer::load_shard_on(devices[1], &src, cfg1, plan1, ctx1.tp.clone()).unwrap();
        serve(&ctx1, &m, capacity)
    });
    let model =
        Transformer::load_shard_on(devices[0], &src, cfg, plans[0].clone(), ctx0.tp.clone())
            .unwrap();
    let mut lead = Lead::new(ctx0, &model, capacity).unwrap();
    let mut logits = lead.step_with(&PROMPT, Want::All).unwrap();
    let mut tokens = Vec::new();
    for _ in 0..n {
        let id = argmax(&logits) as u32;
        tokens.push(id);
        logits = lead.step_with(&[id], Want::All).unwrap();
    }
    lead.stop().unwrap();
    drop(lead);
    worker.join().unwrap().unwrap();
    tokens
}

/// A tensor-parallel split with one rank on the GPU and one on the CPU gives the tokens of
/// one rank alone, for a dense model and mixtures of experts, gpt-oss's sinks and expert
/// biases split by head and by feature among them (F32 weights: no near-ties on these
/// seeds' paths, where the CPU's activations are not quantized either).
#[test]
fn a_split_over_gpu_and_cpu_ranks_gives_one_ranks_tokens() {
    if !have_gpu("a_split_over_gpu_and_cpu_ranks_gives_one_ranks_tokens") {
        return;
    }
    for spec in [
        TinyModelSpec::qwen2(3).tied(false),
        TinyModelSpec::qwen3moe(1),
        TinyModelSpec::gpt_oss(1),
    ] {
        let m = spec.build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = write(&m, dir.path(), GgmlType::F32);
        let one = load(&path, Device::Cpu);
        let mut cache = one.new_cache(64);
        let mut logits = one.forward_last(&PROMPT, &mut cache).unwrap();
        let mut want = Vec::new();
        for _ in 0..12 {
            let id = argmax(&logits) as u32;
            want.push(id);
            logits = one.forward_last(&[id], &mut cache).unwrap();
        }
        for devices in [
            [Device::Gpu(None).into(), Device::Cpu.into()],
            [Device::Cpu.into(), Device::Gpu(None).into()],
            // rank 1's share cut after its first layer: GPU, then CPU
            [Device::Cpu.into(), first_on_gpu(1)],
        ] {
            let got = split_tokens(&path, devices, 12);
            assert_eq!(got, want, "{} over {devices:?}", m.spec().name);
            eprintln!(
                "{} tp2 over {devices:?}: the 12 tokens of one rank",
                m.spec().name
            );
        }
    }
}

/// The first `n` layers of a share on the GPU, the rest on the CPU.
fn first_on_gpu(n: usize) -> Placement {
    Placement {
        device: Device::Gpu(None),
        gpu_layers: GpuLayers::First(n),
    }
}

/// A model cut across the GPU and the CPU (`--gpu-layers`) gives the oracle's logits and
/// the CPU's greedy tokens, whichever layer it is cut after, for a dense model with tied
/// embeddings (the head on the CPU reads the embedding too), a mixture of experts and
/// latent attention; a cache's prefix copies across both parts.
#[test]
fn a_model_cut_across_the_gpu_and_the_cpu_answers_like_the_cpu() {
    if !have_gpu("a_model_cut_across_the_gpu_and_the_cpu_answers_like_the_cpu") {
        return;
    }
    for mut spec in [
        TinyModelSpec::qwen2(3),
        TinyModelSpec::qwen3moe(1),
        TinyModelSpec::deepseek2(2),
    ] {
        spec.n_layers = 3;
        let m = spec.build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = write(&m, dir.path(), GgmlType::F32);
        let cpu = load(&path, Device::Cpu);
        let oracle = m.reference_logits_f16_kv(&PROMPT);
        for n in [1, 2] {
            let label = format!("{} seed {} cut after {n}", m.spec().name, m.spec().seed);
            let cut = load(&path, first_on_gpu(n));
            assert_eq!(cut.backend(), "gpu+cpu", "{label}");
            for chunks in [vec![PROMPT.len()], vec![1; PROMPT.len()], vec![5, 1, 6]] {
                let d = max_abs_diff(&chunked(&cut, &PROMPT, &chunks), &oracle);
                eprintln!("{label}: chunks {chunks:?}: max|cut - oracle| {d:.2e}");
                assert!(
                    d < TOL,
                    "{label}: {chunks:?}: logits differ from the oracle by {d}"
                );
            }
            // greedy tokens; the second half after a copied prefix
            let (mut cg, mut cc) = (cut.new_cache(64), cpu.new_cache(64));
            let mut lg = cut.forward_last(&PROMPT, &mut cg).unwrap();
            let mut lc = cpu.forward_last(&PROMPT, &mut cc).unwrap();
            for step in 0..12 {
                let (g, c) = (argmax(&lg) as u32, argmax(&lc) as u32);
                assert_eq!(g, c, "{label}: step {step}");
                if step == 6 {
                    let mut copy = cut.new_cache(64);
                    cut.copy_prefix(&cg, &mut copy, cg.len()).unwrap();
                    cg = copy;
                }
                lg = cut.forward_last(&[g], &mut cg).unwrap();
                lc = cpu.forward_last(&[c], &mut cc).unwrap();
            }
            assert_eq!(cg.len(), PROMPT.len() + 12, "{label}");
            // a cache of the plain model is refused, not misread
            let mut plain = cpu.new_cache(64);
            let e = cut
                .forward_last(&PROMPT, &mut plain)
                .unwrap_err()
                .to_string();
            assert!(e.contains("made by the cpu backend"), "{label}: {e}");
            eprintln!("{label}: the CPU's 12 greedy tokens");
        }
        // all layers, or none, is no cut
        assert_eq!(load(&path, first_on_gpu(3)).backend(), "gpu");
        assert_eq!(load(&path, first_on_gpu(0)).backend(), "cpu");
    }
}

/// `auto` takes the first real GPU and never a software adapter; `gpu` takes any.
#[test]
fn auto_never_takes_a_software_adapter() {
    use shoal_engine::device::Resolved;
    if !have_gpu("auto_never_takes_a_software_adapter") {
        return;
    }
    let gpus = shoal_engine::device::gpus();
    let want = gpus
        .iter()
        .find(|g| !g.software)
        .map_or(Resolved::Cpu, |g| Resolved::Gpu(g.index));
    assert_eq!(Device::Auto.resolve(), want, "{gpus:?}");
    assert_eq!(Device::Gpu(None).resolve(), Resolved::Gpu(0));
    // there is no adapter past the last: a clear error, not a panic
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &TinyModelSpec::llama(1).build().unwrap(),
        dir.path(),
        GgmlType::F32,
    );
    let e = load_error(&path, Device::Gpu(Some(gpus.len())));
    assert!(
        e.contains(&format!("there is no GPU {}", gpus.len())),
        "{e}"
    );
}

/// gpt-oss on the GPU: attention sinks, sliding-window layers, biased attention and
/// experts, the clamped SwiGLU, YaRN; in F32, and with every matrix in MXFP4 (as its experts
/// are stored).
#[test]
fn gpt_oss_models_match_the_oracle() {
    if !have_gpu("gpt_oss_models_match_the_oracle") {
        return;
    }
    check(TinyModelSpec::gpt_oss(1), GgmlType::F32);
    check(
        TinyModelSpec::gpt_oss(2).snapped_to(GgmlType::MXFP4),
        GgmlType::MXFP4,
    );
}

/// GLM's prediction layer on the GPU: its logits over the prompt (from the GPU model's own
/// hidden states) and for chained drafts equal the f64 reference's.
#[test]
fn the_prediction_layer_matches_the_oracle() {
    if !have_gpu("the_prediction_layer_matches_the_oracle") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let m = TinyModel::new(TinyModelSpec::glm4moe(7)).unwrap();
    let path = write(&m, dir.path(), GgmlType::F32);
    let file = GgufFile::open(&path).unwrap();
    let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
    let cfg = arch::config_from_gguf(file.metadata(), vocab, "gpu test").unwrap();
    let cfg = shoal_engine::ModelConfig {
        load_mtp: true,
        ..cfg
    };
    let src = GgufWeights::new(file);
    let t = Transformer::load_on_device(Device::Gpu(None), &src, cfg, Arc::new(shoal_comm::Solo))
        .unwrap();
    let (h, vocab, n) = (t.config().hidden, t.config().vocab, PROMPT.len());
    let mut cache = t.new_cache(64);
    let (_, hidden) = t.step_hidden(&PROMPT, &[n], &mut [&mut cache], 1).unwrap();
    let mut mtp = t.new_mtp_cache(64).expect("the layer loads on the GPU");
    let (mut logits, mut state) = t
        .mtp_step(
            hidden[..(n - 1) * h].to_vec(),
            &PROMPT[1..],
            &[n - 1],
            &mut [&mut mtp],
            n - 1,
        )
        .unwrap();
    let mut got = rows(logits.clone(), vocab);
    for _ in 0..2 {
        let token = argmax(&logits[logits.len() - vocab..]) as u32;
        let last = state[state.len() - h..].to_vec();
        (logits, state) = t
            .mtp_step(last, &[token], &[1], &mut [&mut mtp], 1)
            .unwrap();
        got.extend(rows(logits.clone(), vocab));
    }
    let d = max_abs_diff(&got, &m.reference_mtp_logits(&PROMPT, 2));
    eprintln!("prediction layer on the GPU: max |gpu - reference| {d:.2e}");
    assert!(d <= TOL, "{d} > {TOL}");
}
