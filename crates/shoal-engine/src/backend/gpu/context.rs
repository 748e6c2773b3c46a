//! One GPU device as the backend drives it: the adapter it was opened on, its queue, the
//! compute pipelines built so far (one per shader and entry point, built on first use), and
//! the commands of the current step. Every operation is recorded into one pending command
//! encoder; the encoder is submitted only when the host needs values back (a read) or a
//! caller asks for it, so a step that reads back only its logits is one queue submission.
//!
//! wgpu reports validation failures and a lost device through callbacks; both are caught
//! here and turned into an [`EngineError`] at the next read or submission instead of a
//! panic, and a lost device stays lost: every later call fails with its reason.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::EngineError;

/// A pipeline's shader name and entry point.
type PipelineKey = (Cow<'static, str>, &'static str);

/// An open device and what records work on it (see the module).
pub struct GpuContext {
    pub(super) device: wgpu::Device,
    queue: wgpu::Queue,
    /// The adapter's description, for logs and errors.
    pub(super) info: wgpu::AdapterInfo,
    /// The limits the device was opened with.
    pub(super) limits: wgpu::Limits,
    pipelines: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
    pending: Mutex<Pending>,
    /// The uniform arena: one slot of parameters per dispatch of a submission.
    arena: wgpu::Buffer,
    /// Bytes per arena slot (the device's uniform offset alignment, at least 64).
    slot_bytes: usize,
    /// The first error wgpu reported (validation, out of memory, device lost), if any.
    failure: Arc<Mutex<Option<String>>>,
    /// Queue submissions made, for `--profile`.
    submissions: AtomicU64,
    /// Compute dispatches recorded, for `--profile`.
    dispatches: AtomicU64,
    /// Bytes read back to the host, for `--profile`.
    read_back: AtomicU64,
    /// Nanoseconds the host spent recording dispatches, for `--profile`.
    record_ns: AtomicU64,
    /// Nanoseconds the host waited for the device in reads, for `--profile`.
    wait_ns: AtomicU64,
}

/// Parameter blocks the uniform arena holds: a step with more dispatches is submitted in
/// parts.
const ARENA_SLOTS: usize = 4096;
/// Bytes of one dispatch's parameters (the largest block a kernel declares is 40).
const PARAMS_BYTES: usize = 64;

/// The commands recorded since the last submission.
struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    /// The open compute pass of `encoder` (ended before copies and at submission).
    pass: Option<wgpu::ComputePass<'static>>,
    /// Arena slots taken since the last submission, and their parameters.
    used: usize,
    staged: Vec<u8>,
    /// Per arena slot, the bind group last made for it.
    groups: Vec<Option<CachedGroup>>,
}

/// A bind group and what it binds besides its arena slot.
struct CachedGroup {
    pipeline: wgpu::ComputePipeline,
    buffers: Vec<wgpu::Buffer>,
    group: wgpu::BindGroup,
}

/// What a kernel binds: storage buffers in binding order after the parameters (binding 0
/// is always the uniform parameter block).
pub(super) enum Bind<'a> {
    /// A whole buffer.
    Whole(&'a wgpu::Buffer),
}

/// Counters of the work recorded so far (see [`GpuContext::counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuCounters {
    /// Queue submissions.
    pub submissions: u64,
    /// Compute dispatches.
    pub dispatches: u64,
    /// Bytes read back to the host.
    pub read_back: u64,
    /// Nanoseconds the host spent recording dispatches (binding, encoding).
    pub record_ns: u64,
    /// Nanoseconds the host waited for the device to finish before reading back.
    pub wait_ns: u64,
}

impl GpuContext {
    /// Opens `adapter`.
    ///
    /// # Errors
    /// When the adapter refuses a device with its own limits.
    pub(super) fn open(adapter: &wgpu::Adapter) -> Result<Self, EngineError> {
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("shoal"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| EngineError::Unsupported {
            what: format!(
                "GPU {} ({:?}) refused a device: {e}",
                info.name, info.backend
            ),
        })?;
        let failure: Arc<Mutex<Option<String>>> = Arc::default();
        let f = failure.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = f.lock().unwrap_or_else(|p| p.into_inner());
            tracing::error!("GPU error: {e}");
            slot.get_or_insert_with(|| e.to_string());
        }));
        let f = failure.clone();
        device.set_device_lost_callback(move |reason, message| {
            let mut slot = f.lock().unwrap_or_else(|p| p.into_inner());
            tracing::error!("GPU device lost ({reason:?}): {message}");
            let detail = if message.is_empty() {
                String::new()
            } else {
                format!(": {message}")
            };
            slot.get_or_insert_with(|| {
                format!(
                    "the GPU device was lost ({reason:?}){detail}; restart shoal to compute on \
                     it again, or use --device cpu"
                )
            });
        });
        let slot_bytes = (limits.min_uniform_buffer_offset_alignment as usize).max(PARAMS_BYTES);
        let arena = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("parameters"),
            size: (ARENA_SLOTS * slot_bytes) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let pending = Pending {
            encoder: None,
            pass: None,
            used: 0,
            staged: vec![0; ARENA_SLOTS * slot_bytes],
            groups: (0..ARENA_SLOTS).map(|_| None).collect(),
        };
        Ok(GpuContext {
            arena,
            slot_bytes,
            device,
            queue,
            info,
            limits,
            pipelines: Mutex::default(),
            pending: Mutex::new(pending),
            failure,
            submissions: AtomicU64::new(0),
            dispatches: AtomicU64::new(0),
            read_back: AtomicU64::new(0),
            record_ns: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
        })
    }

    /// The adapter's name and API, for logs.
    pub fn describe(&self) -> String {
        format!("{} ({:?})", self.info.name, self.info.backend)
    }

    /// Work recorded so far.
    pub fn counters(&self) -> GpuCounters {
        GpuCounters {
            submissions: self.submissions.load(Ordering::Relaxed),
            dispatches: self.dispatches.load(Ordering::Relaxed),
            read_back: self.read_back.load(Ordering::Relaxed),
            record_ns: self.record_ns.load(Ordering::Relaxed),
            wait_ns: self.wait_ns.load(Ordering::Relaxed),
        }
    }

    /// The error wgpu reported, if any, as an engine error.
    pub(super) fn check(&self) -> Result<(), EngineError> {
        let slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        match &*slot {
            None => Ok(()),
            Some(e) => Err(EngineError::Generation(format!(
                "GPU {}: {e}",
                self.info.name
            ))),
        }
    }

    /// What went wrong with the device, once something has (see the module).
    pub(super) fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Destroys the device, as a driver reset or an unplugged card would lose it.
    pub(super) fn destroy(&self) {
        self.device.destroy();
        self.wait();
    }

    /// The pipeline of `entry` in the WGSL `source` (named `name`), built on first use.
    pub(super) fn pipeline(
        &self,
        name: impl Into<Cow<'static, str>>,
        entry: &'static str,
        source: impl FnOnce() -> String,
    ) -> Arc<wgpu::ComputePipeline> {
        let name = name.into();
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entry((name, entry))
            .or_insert_with_key(|(name, _)| {
                let module = self
                    .device
                    .create_shader_module(wgpu::ShaderModuleDescriptor {
                        label: Some(name),
                        source: wgpu::ShaderSource::Wgsl(Cow::Owned(source())),
                    });
                Arc::new(
                    self.device
                        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                            label: Some(name),
                            layout: None,
                            module: &module,
                            entry_point: Some(entry),
                            compilation_options: Default::default(),
                            cache: None,
                        }),
                )
            })
            .clone()
    }

    /// A storage buffer of `bytes` bytes (rounded up to whole words), uninitialised.
    pub(super) fn buffer(&self, bytes: usize, label: &str) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (bytes.max(4).div_ceil(4) * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `data` (padded with zeros to whole words).
    pub(super) fn buffer_with(&self, data: &[u8], label: &str) -> wgpu::Buffer {
        if data.len().is_multiple_of(4) && !data.is_empty() {
            // filled through a mapping at creation: no staging copy (a model's weights would
            // otherwise be staged whole until the load's submission)
            let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: data.len() as u64,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: true,
            });
            match buf.get_mapped_range_mut(..) {
                Ok(mut view) => {
                    view.copy_from_slice(data);
                    drop(view);
                    buf.unmap();
                }
                // a lost device maps nothing: the buffer is never read, the next read or
                // submission reports the loss
                Err(e) => {
                    let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert_with(|| format!("the GPU could not fill a buffer: {e}"));
                }
            }
            return buf;
        }
        let mut padded = data.to_vec();
        padded.resize(data.len().max(4).div_ceil(4) * 4, 0);
        self.buffer_with(&padded, label)
    }

    /// Writes `data` at the start of `buf`, ordered after the work recorded so far.
    pub(super) fn write(&self, buf: &wgpu::Buffer, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        // a staging copy recorded in order with the kernels (a queue write would land before
        // every command still pending in the encoder)
        let staging = self.buffer_with(data, "upload");
        let len = (data.len().div_ceil(4) * 4) as u64;
        self.record(|enc| enc.copy_buffer_to_buffer(&staging, 0, buf, 0, len));
    }

    /// Zeroes the first `bytes` bytes of `buf` (whole words), in order.
    pub(super) fn fill_zero(&self, buf: &wgpu::Buffer, bytes: usize) {
        let len = (bytes.div_ceil(4) * 4) as u64;
        if len > 0 {
            self.record(|enc| enc.clear_buffer(buf, 0, Some(len)));
        }
    }

    /// Copies `bytes` bytes from `from` at `from_at` to `to` at `to_at`, in order.
    pub(super) fn copy(
        &self,
        from: &wgpu::Buffer,
        from_at: u64,
        to: &wgpu::Buffer,
        to_at: u64,
        bytes: u64,
    ) {
        if bytes > 0 {
            self.record(|enc| enc.copy_buffer_to_buffer(from, from_at, to, to_at, bytes));
        }
    }

    /// Records `f` into the pending encoder (after ending the open compute pass).
    fn record(&self, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        p.pass = None;
        let enc = p.encoder.get_or_insert_with(|| self.encoder());
        f(enc);
    }

    fn encoder(&self) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("step"),
            })
    }

    /// Records one dispatch of `pipeline` over `groups` workgroups, with `params` as the
    /// uniform block at binding 0 and `binds` at bindings 1, 2, ...
    ///
    /// The parameters go to the next slot of the uniform arena (written to the device
    /// once, at the submission); the bind group of a slot is kept and used again while the
    /// slot's pipeline and buffers stay the same, as they do from one decode step to the
    /// next; the dispatch goes into the step's open compute pass.
    pub(super) fn dispatch(
        &self,
        pipeline: &wgpu::ComputePipeline,
        params: &[u32],
        binds: &[Bind<'_>],
        groups: [u32; 3],
    ) {
        if groups.contains(&0) {
            return;
        }
        let t0 = std::time::Instant::now();
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if p.used == ARENA_SLOTS {
            self.submit_locked(&mut p);
        }
        let slot = p.used;
        p.used += 1;
        let at = slot * self.slot_bytes;
        let bytes: &[u8] = bytemuck::cast_slice(params);
        p.staged[at..at + bytes.len()].copy_from_slice(bytes);
        fn buffer<'a>(b: &Bind<'a>) -> &'a wgpu::Buffer {
            let Bind::Whole(buf) = b;
            buf
        }
        let cached = p.groups[slot].as_ref().filter(|c| {
            c.pipeline == *pipeline
                && c.buffers.len() == binds.len()
                && c.buffers.iter().zip(binds).all(|(a, b)| a == buffer(b))
        });
        let group = match cached {
            Some(c) => c.group.clone(),
            None => {
                let mut entries = vec![wgpu::BindGroupEntry {
                    binding: 0,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &self.arena,
                        offset: at as u64,
                        size: std::num::NonZeroU64::new(PARAMS_BYTES as u64),
                    }),
                }];
                for (i, b) in binds.iter().enumerate() {
                    entries.push(wgpu::BindGroupEntry {
                        binding: i as u32 + 1,
                        resource: buffer(b).as_entire_binding(),
                    });
                }
                let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout: &pipeline.get_bind_group_layout(0),
                    entries: &entries,
                });
                p.groups[slot] = Some(CachedGroup {
                    pipeline: pipeline.clone(),
                    buffers: binds.iter().map(|b| buffer(b).clone()).collect(),
                    group: group.clone(),
                });
                group
            }
        };
        if p.pass.is_none() {
            let enc = p.encoder.get_or_insert_with(|| self.encoder());
            let pass = enc
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: None,
                })
                .forget_lifetime();
            p.pass = Some(pass);
        }
        let pass = p.pass.as_mut().expect("opened above");
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, &group, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        self.dispatches.fetch_add(1, Ordering::Relaxed);
        self.record_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Submits the pending commands.
    pub(super) fn submit(&self) {
        // submitted under the lock: commands recorded after these (from another thread
        // sharing the device) must not reach the queue first
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.submit_locked(&mut p);
    }

    fn submit_locked(&self, p: &mut Pending) {
        p.pass = None;
        if p.used > 0 {
            // the queue writes this before the submission's commands run
            self.queue
                .write_buffer(&self.arena, 0, &p.staged[..p.used * self.slot_bytes]);
            p.used = 0;
        }
        if let Some(enc) = p.encoder.take() {
            self.submissions.fetch_add(1, Ordering::Relaxed);
            self.queue.submit([enc.finish()]);
        }
    }

    /// Waits for every submission to finish.
    pub(super) fn wait(&self) {
        let _ = self.device.poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: None,
        });
    }

    /// The first `bytes` bytes of `buf`, after every command recorded so far has run.
    ///
    /// # Errors
    /// When the device reported an error or was lost.
    pub(super) fn read(&self, buf: &wgpu::Buffer, bytes: usize) -> Result<Vec<u8>, EngineError> {
        self.check()?;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let len = (bytes.div_ceil(4) * 4) as u64;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read back"),
            size: len,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.record(|enc| enc.copy_buffer_to_buffer(buf, 0, &staging, 0, len));
        self.submit();
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let t0 = std::time::Instant::now();
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map_err(|e| EngineError::Generation(format!("GPU {}: {e}", self.info.name)))?;
        self.wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.check()?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(EngineError::Generation(format!(
                    "GPU {}: reading back: {e}",
                    self.info.name
                )))
            }
            Err(_) => {
                return Err(EngineError::Generation(format!(
                    "GPU {}: the read back never completed",
                    self.info.name
                )))
            }
        }
        let out = match slice.get_mapped_range() {
            Ok(view) => view[..bytes].to_vec(),
            Err(e) => {
                return Err(EngineError::Generation(format!(
                    "GPU {}: reading back: {e}",
                    self.info.name
                )))
            }
        };
        staging.unmap();
        self.read_back.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(out)
    }
}
