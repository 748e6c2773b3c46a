//! Finding GPUs: the adapters wgpu offers on this machine (Vulkan, Metal, DX12), described
//! for `shoal doctor` and the node's report, and opened once per process (every model
//! loaded on the same adapter shares its device). Software adapters (Mesa's lavapipe, a
//! CPU-type adapter) are listed and may be asked for by number, but are never taken by
//! `auto`: they compute on the CPU, slower than the CPU backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::context::GpuContext;
use crate::EngineError;

/// One adapter as this machine offers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuAdapter {
    /// Its number in `--device gpu:N`.
    pub index: usize,
    /// The adapter's name.
    pub name: String,
    /// The API it is reached through (Vulkan, Metal, Dx12).
    pub api: String,
    /// Whether it computes on the CPU (a software rasteriser such as lavapipe).
    pub software: bool,
    /// Whether it is a discrete card (rather than integrated into the CPU package).
    pub discrete: bool,
    /// The largest buffer it allows, bytes.
    pub max_buffer_bytes: u64,
    /// Its own memory, bytes: the largest device-local heap its Vulkan driver reports
    /// (`None` through Metal and DX12, which do not say; on a Mac the GPU shares the
    /// machine's memory).
    pub memory_bytes: Option<u64>,
}

fn instance() -> &'static wgpu::Instance {
    static INSTANCE: OnceLock<wgpu::Instance> = OnceLock::new();
    INSTANCE.get_or_init(|| {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
        wgpu::Instance::new(desc)
    })
}

fn raw_adapters() -> &'static [wgpu::Adapter] {
    static ADAPTERS: OnceLock<Vec<wgpu::Adapter>> = OnceLock::new();
    ADAPTERS.get_or_init(|| {
        let mut all = pollster::block_on(instance().enumerate_adapters(wgpu::Backends::all()));
        // the same card can appear through two APIs; list real GPUs first, then software
        all.sort_by_key(|a| a.get_info().device_type == wgpu::DeviceType::Cpu);
        all
    })
}

/// The adapters of this machine, real GPUs first.
pub fn adapters() -> Vec<GpuAdapter> {
    raw_adapters()
        .iter()
        .enumerate()
        .map(|(index, a)| {
            let info = a.get_info();
            GpuAdapter {
                index,
                name: info.name.clone(),
                api: format!("{:?}", info.backend),
                software: info.device_type == wgpu::DeviceType::Cpu,
                discrete: info.device_type == wgpu::DeviceType::DiscreteGpu,
                max_buffer_bytes: a.limits().max_buffer_size,
                memory_bytes: device_memory(a),
            }
        })
        .collect()
}

/// The largest device-local memory heap of a Vulkan adapter, bytes.
#[cfg(any(windows, all(unix, not(target_vendor = "apple"))))]
fn device_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    /// `VK_MEMORY_HEAP_DEVICE_LOCAL_BIT`.
    const DEVICE_LOCAL: u32 = 1;
    // SAFETY: the raw adapter is only read, while `adapter` keeps it alive
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let instance = hal.shared_instance().raw_instance();
    // SAFETY: the physical device belongs to this instance and outlives the call
    let props =
        unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
    props
        .memory_heaps_as_slice()
        .iter()
        .filter(|h| h.flags.as_raw() & DEVICE_LOCAL != 0)
        .map(|h| h.size)
        .max()
}

#[cfg(not(any(windows, all(unix, not(target_vendor = "apple")))))]
fn device_memory(_adapter: &wgpu::Adapter) -> Option<u64> {
    None
}

fn opened() -> &'static Mutex<HashMap<usize, Arc<GpuContext>>> {
    static OPEN: OnceLock<Mutex<HashMap<usize, Arc<GpuContext>>>> = OnceLock::new();
    OPEN.get_or_init(Mutex::default)
}

/// The GPUs this process opened that failed (lost, or an error that leaves their work
/// unusable), by number, with what went wrong.
pub fn failed() -> Vec<(usize, String)> {
    let open = opened().lock().unwrap_or_else(|p| p.into_inner());
    let mut out: Vec<(usize, String)> = open
        .iter()
        .filter_map(|(&i, ctx)| Some((i, ctx.failure()?)))
        .collect();
    out.sort();
    out
}

/// Destroys the device of GPU `index` if this process opened it (see
/// [`crate::device::simulate_gpu_loss`]); whether it had.
pub(crate) fn destroy(index: usize) -> bool {
    let ctx = opened()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&index)
        .cloned();
    ctx.map(|c| c.destroy()).is_some()
}

/// The device of adapter `index`, opened on first use.
///
/// # Errors
/// When there is no such adapter or it refuses a device.
pub(crate) fn open(index: usize) -> Result<Arc<GpuContext>, EngineError> {
    let all = raw_adapters();
    let Some(adapter) = all.get(index) else {
        return Err(EngineError::Unsupported {
            what: if all.is_empty() {
                "no GPU adapter found (no Vulkan, Metal or DX12 driver answered); on Linux \
                 install the GPU's Vulkan driver (for a software check, Mesa's \
                 `mesa-vulkan-drivers`), or use --device cpu"
                    .into()
            } else {
                format!(
                    "there is no GPU {index}: this machine has {} ({}); `shoal doctor` lists them",
                    all.len(),
                    all.iter()
                        .enumerate()
                        .map(|(i, a)| format!("gpu:{i} {}", a.get_info().name))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
        });
    };
    let mut open = opened().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(ctx) = open.get(&index) {
        return Ok(ctx.clone());
    }
    let ctx = Arc::new(GpuContext::open(adapter)?);
    open.insert(index, ctx.clone());
    Ok(ctx)
}
