//! The shoal inference engine: the forward pass of each supported architecture, written
//! once over a backend seam ([`backend::Backend`]; the CPU backend owns shoal's kernels)
//! from layers that are already cut for tensor parallelism and are plain layers at world
//! size 1; the architectures' tensor tables ([`arch`]); the KV cache, the sampler, the
//! continuous-batching scheduler that every generation runs through, and split execution
//! over ranks. It reads weights through a [`weights::WeightSource`] in their file's
//! quantization and talks to other ranks only through `shoal_comm::Communicator`.

pub mod arch;
mod backend;
pub use backend::cpu::bench;
pub mod config;
pub mod constrain;
pub mod device;
mod error;
pub mod kv_cache;
mod lookup;
pub mod model;
mod network;
mod offload;
pub mod parallel;
pub mod planning;
pub mod profile;
pub mod sampler;
pub mod scheduler;
pub mod shard;
pub mod stop;
pub mod transformer;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use device::Device;
pub use error::EngineError;
pub use kv_cache::KvCache;
pub use sampler::{Sampler, SamplerConfig};
pub use transformer::Transformer;
