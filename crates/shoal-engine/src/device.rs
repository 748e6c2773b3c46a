//! Where a model's share is computed: the CPU, or a GPU through the wgpu backend
//! (`--device auto|cpu|gpu|gpu:N`). `auto` takes the first real GPU (never a software
//! adapter such as Mesa's lavapipe, which computes on the CPU more slowly than the CPU
//! backend) and the CPU where there is none; `gpu` takes the first adapter of any kind.
//! On a GPU, `--gpu-layers` says how many of a share's layers it takes (by default what its
//! memory holds); the rest run on the CPU beside it (`crate::offload`).

use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

pub use crate::backend::gpu::adapters::GpuAdapter;
pub use crate::backend::gpu::context::GpuCounters;

/// A device choice as the user gives it (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The first real GPU, else the CPU.
    Auto,
    /// The CPU backend.
    #[default]
    Cpu,
    /// GPU adapter `N` (`None`: the first).
    Gpu(Option<usize>),
}

/// A device choice resolved against this machine's adapters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// The CPU backend.
    Cpu,
    /// GPU adapter `N`.
    Gpu(usize),
}

impl Device {
    /// The device this choice means on this machine.
    pub fn resolve(self) -> Resolved {
        match self {
            Device::Cpu => Resolved::Cpu,
            Device::Gpu(n) => Resolved::Gpu(n.unwrap_or(0)),
            Device::Auto => gpus()
                .into_iter()
                .find(|a| !a.software)
                .map_or(Resolved::Cpu, |a| Resolved::Gpu(a.index)),
        }
    }
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "gpu" => Ok(Device::Gpu(None)),
            other => other
                .strip_prefix("gpu:")
                .and_then(|n| n.parse().ok())
                .map(|n| Device::Gpu(Some(n)))
                .ok_or_else(|| {
                    format!("device {s:?}: want auto, cpu, gpu or gpu:N (N from `shoal doctor`)")
                }),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Gpu(None) => f.write_str("gpu"),
            Device::Gpu(Some(n)) => write!(f, "gpu:{n}"),
        }
    }
}

/// How many of a share's layers a GPU takes (`--gpu-layers`); the rest are computed on the
/// CPU beside it, each layer's KV cache on the device of its layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuLayers {
    /// As many as the GPU's memory holds (all of them where its size is unknown).
    #[default]
    Fit,
    /// All of them.
    All,
    /// The first `N` (all of them when the share has fewer; none: the CPU alone).
    First(usize),
}

impl FromStr for GpuLayers {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(GpuLayers::Fit),
            "all" => Ok(GpuLayers::All),
            n => n.parse().map(GpuLayers::First).map_err(|_| {
                format!("--gpu-layers {s:?}: want a layer count, all, or auto (what fits)")
            }),
        }
    }
}

impl fmt::Display for GpuLayers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuLayers::Fit => f.write_str("auto"),
            GpuLayers::All => f.write_str("all"),
            GpuLayers::First(n) => write!(f, "{n}"),
        }
    }
}

/// Where a share goes: a device, and on a GPU how many of its layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Placement {
    /// The device.
    pub device: Device,
    /// On a GPU, how many layers it takes (the rest run on the CPU).
    pub gpu_layers: GpuLayers,
}

impl From<Device> for Placement {
    /// The whole share on `device`.
    fn from(device: Device) -> Self {
        Placement {
            device,
            gpu_layers: GpuLayers::All,
        }
    }
}

/// This process's defaults: a node's `--device` (the first of its list) and `--gpu-layers`.
pub fn placement_for_this_process() -> Placement {
    let (device, gpu_layers) = *PROCESS.lock().unwrap_or_else(|p| p.into_inner());
    Placement { device, gpu_layers }
}

static PROCESS: Mutex<(Device, GpuLayers)> = Mutex::new((Device::Cpu, GpuLayers::Fit));

/// Makes `device` where this process loads models by default ([`crate::Transformer::load`]
/// and [`crate::Transformer::load_shard`]): a node's `--device`.
pub fn use_for_this_process(device: Device) {
    PROCESS.lock().unwrap_or_else(|p| p.into_inner()).0 = device;
}

/// Where this process loads models by default (the CPU unless told otherwise).
pub fn for_this_process() -> Device {
    PROCESS.lock().unwrap_or_else(|p| p.into_inner()).0
}

/// Makes `layers` how many of a share's layers this process puts on its GPU by default (a
/// node's `--gpu-layers`).
pub fn use_gpu_layers_for_this_process(layers: GpuLayers) {
    PROCESS.lock().unwrap_or_else(|p| p.into_inner()).1 = layers;
}

/// How many of a share's layers this process puts on its GPU by default (what fits unless
/// told otherwise).
pub fn gpu_layers_for_this_process() -> GpuLayers {
    PROCESS.lock().unwrap_or_else(|p| p.into_inner()).1
}

/// The read bandwidth of the GPU `device` resolves to, GB/s: a kernel streams a buffer of
/// up to 1 GiB, up to 20 passes per submission, best of 3 (fewer on a slow device).
///
/// # Errors
/// When `device` is the CPU here, or the GPU fails.
pub fn gpu_read_bandwidth(device: Device) -> Result<f64, crate::EngineError> {
    match device.resolve() {
        Resolved::Gpu(n) => crate::backend::gpu::Gpu::open(n)?.read_bandwidth(),
        Resolved::Cpu => Err(crate::EngineError::InvalidInput {
            what: format!("device {device} is the CPU here: no GPU to probe"),
        }),
    }
}

/// The GPUs this process computes on that failed (the device was lost, or reported an
/// error that leaves its work unusable), by number, with the reason. Every later step on
/// such a GPU fails with that reason; the CPU and other GPUs go on.
pub fn failed_gpus() -> Vec<(usize, String)> {
    crate::backend::gpu::adapters::failed()
}

/// Destroys this process's device of GPU `index`, as a driver reset would lose it, to test
/// what a lost GPU does; whether the process had opened it.
#[doc(hidden)]
pub fn simulate_gpu_loss(index: usize) -> bool {
    crate::backend::gpu::adapters::destroy(index)
}

/// The matrix-product throughput of the GPU `device` resolves to, GFLOP/s: the backend's
/// product of an F16 4096 x 4096 matrix with 64 rows, up to 8 per submission, best of 3
/// (fewer on a slow device).
///
/// # Errors
/// When `device` is the CPU here, or the GPU fails.
pub fn gpu_matmul_gflops(device: Device) -> Result<f64, crate::EngineError> {
    match device.resolve() {
        Resolved::Gpu(n) => crate::backend::gpu::Gpu::open(n)?.matmul_gflops(),
        Resolved::Cpu => Err(crate::EngineError::InvalidInput {
            what: format!("device {device} is the CPU here: no GPU to probe"),
        }),
    }
}

/// The GPU adapters of this machine, real GPUs first.
pub fn gpus() -> Vec<GpuAdapter> {
    crate::backend::gpu::adapters::adapters()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_and_print_back() {
        for s in ["auto", "cpu", "gpu", "gpu:0", "gpu:3"] {
            assert_eq!(s.parse::<Device>().unwrap().to_string(), s);
        }
        for bad in ["", "GPU", "gpu:", "gpu:x", "cuda", "gpu:-1"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.contains("auto, cpu, gpu or gpu:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn layer_counts_parse_and_print_back() {
        for s in ["auto", "all", "0", "12"] {
            assert_eq!(s.parse::<GpuLayers>().unwrap().to_string(), s);
        }
        for bad in ["", "-1", "half", "1.5"] {
            let e = bad.parse::<GpuLayers>().unwrap_err();
            assert!(e.contains("a layer count, all, or auto"), "{bad}: {e}");
        }
    }
}
