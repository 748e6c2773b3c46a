//! Where a model's share is computed: the CPU, or a GPU through the wgpu backend
//! (`--device auto|cpu|gpu|gpu:N`). `auto` takes the first real GPU (never a software
//! adapter such as Mesa's lavapipe, which computes on the CPU more slowly than the CPU
//! backend) and the CPU where there is none; `gpu` takes the first adapter of any kind.

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

static PROCESS: Mutex<Device> = Mutex::new(Device::Cpu);

/// Makes `device` where this process loads models by default ([`crate::Transformer::load`]
/// and [`crate::Transformer::load_shard`]): a node's `--device`.
pub fn use_for_this_process(device: Device) {
    *PROCESS.lock().unwrap_or_else(|p| p.into_inner()) = device;
}

/// Where this process loads models by default (the CPU unless told otherwise).
pub fn for_this_process() -> Device {
    *PROCESS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The read bandwidth of the GPU `device` resolves to, GB/s: a kernel streams a buffer of
/// up to 1 GiB, 20 passes per submission, best of 3.
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
}
