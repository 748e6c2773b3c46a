//! A GPU lost mid-service (a driver reset, an unplugged card; simulated by destroying the
//! device): the requests on it fail with the reason instead of hanging or panicking, the
//! process lists the GPU as failed, and models on the CPU in the same process go on. In a
//! test binary of its own: the lost device is the process's, and would fail every other
//! GPU test beside it.

use std::path::Path;
use std::sync::Arc;

use shoal_engine::device::{self, Device, GpuLayers};
use shoal_engine::model::LoadedModel;
use shoal_engine::scheduler::{Scheduler, SchedulerConfig, SequenceRequest};
use shoal_engine::SamplerConfig;
use shoal_model::source::ModelSource;
use shoal_testkit::{GgmlType, TinyModelSpec};

fn load(path: &Path, device: Device) -> Arc<LoadedModel> {
    device::use_for_this_process(device);
    device::use_gpu_layers_for_this_process(GpuLayers::All);
    Arc::new(LoadedModel::load(&ModelSource::Gguf(path.to_path_buf())).unwrap())
}

fn start(model: Arc<LoadedModel>) -> Scheduler {
    let config = SchedulerConfig {
        max_batch: 2,
        max_queue: 4,
        ctx: 128,
        prefix_cache: false,
        draft_max: 0,
        adaptive_drafts: false,
    };
    Scheduler::start(model, config).unwrap()
}

fn request(max_tokens: usize) -> SequenceRequest {
    SequenceRequest {
        prompt: vec![1, 17, 250, 42, 99, 3],
        max_tokens,
        sampler: SamplerConfig::default(),
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        stop: Vec::new(),
        logprobs: None,
        constraint: None,
        ignore_eos: true,
        special_text: false,
        resume: Vec::new(),
        report_resumed: false,
    }
}

#[test]
fn a_lost_gpu_fails_its_requests_with_the_reason_and_the_cpu_goes_on() {
    if device::gpus().is_empty() {
        assert!(
            std::env::var("SHOAL_REQUIRE_GPU").as_deref() != Ok("1"),
            "no GPU adapter, and SHOAL_REQUIRE_GPU=1"
        );
        shoal_testkit::skip_or_fail(
            "a_lost_gpu_fails_its_requests_with_the_reason_and_the_cpu_goes_on",
            "no GPU adapter (on Debian: apt-get install mesa-vulkan-drivers libvulkan1)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    TinyModelSpec::qwen2(3)
        .build()
        .unwrap()
        .write_gguf(&path, GgmlType::F32)
        .unwrap();
    let on_cpu = start(load(&path, Device::Cpu));
    let on_gpu = start(load(&path, Device::Gpu(Some(0))));
    let before = on_gpu.generate(request(6), &mut |_| true).unwrap();
    assert_eq!(before.tokens.len(), 6);
    assert!(device::failed_gpus().is_empty());

    assert!(device::simulate_gpu_loss(0), "the GPU was opened");
    for attempt in 0..2 {
        let e = on_gpu
            .generate(request(6), &mut |_| true)
            .unwrap_err()
            .to_string();
        eprintln!("request {attempt} after the loss: {e}");
        assert!(e.contains("lost"), "request {attempt}: {e}");
    }
    let failed = device::failed_gpus();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, 0);
    assert!(failed[0].1.contains("lost"), "{failed:?}");

    let after = on_cpu.generate(request(6), &mut |_| true).unwrap();
    assert_eq!(after.tokens.len(), 6, "the CPU's model goes on");
}
