//! The shoal inference engine: the forward pass of each supported architecture (built from
//! layers that are already cut for tensor parallelism and are plain layers at world size 1),
//! the KV cache, the sampler and the generation loop. It reads weights through a
//! [`weights::WeightSource`] in their file's quantization and talks to other ranks only
//! through `shoal_comm::Communicator`.

pub mod activation;
pub mod arch;
pub mod attention;
pub mod config;
pub mod constrain;
mod error;
pub mod generate;
pub mod kernels;
pub mod kv_cache;
pub mod layers;
pub mod model;
pub mod parallel;
pub mod profile;
pub mod sampler;
pub mod scheduler;
pub mod shard;
pub mod transformer;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use error::EngineError;
pub use kv_cache::KvCache;
pub use sampler::{Sampler, SamplerConfig};
pub use transformer::Transformer;
