//! What a node can do, as the rest of the cluster sees it: memory, backend, measured memory
//! bandwidth and compute throughput, and the addresses of its ports.
//!
//! The measurements come from a short self-test the binary runs at start (it owns the
//! kernels); this module holds the facts, reads the memory figures from `/proc/meminfo`, and
//! turns facts into the planner's `NodeSpec`.

use serde::{Deserialize, Serialize};

/// One node's facts, published in membership as JSON.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeFacts {
    pub name: String,
    /// The node's HTTP address (APIs and admin), as others should dial it.
    pub api: String,
    /// The node's cluster (session) address.
    pub listen: String,
    pub memory_total_bytes: u64,
    pub memory_free_bytes: u64,
    /// Where the node computes: `cpu`, or `gpu:N` (its `--device`).
    pub backend: String,
    /// Compute threads.
    pub threads: u32,
    /// Measured read bandwidth, GB/s.
    pub mem_bandwidth_gbs: f64,
    /// Measured throughput of the batched (prefill) kernels, GFLOP/s.
    pub compute_gflops: f64,
    /// shoal version.
    pub version: String,
    /// The GPU adapters the node has (absent from nodes older than this field).
    #[serde(default)]
    pub gpus: Vec<GpuFacts>,
    /// Layers of a share its GPU takes at most, as it was told (`--gpu-layers N`, `all`
    /// as `u32::MAX`); absent: what the GPU's memory holds.
    #[serde(default)]
    pub gpu_layers: Option<u32>,
    /// The node holds no shares (`shoal serve --no-compute`): it answers the APIs and
    /// forwards every request to the node leading its instance.
    #[serde(default)]
    pub entry_only: bool,
    /// The cluster protocol version it speaks (1 for nodes older than this field).
    #[serde(default = "first_protocol")]
    pub protocol: u32,
    /// The oldest cluster protocol version it works with.
    #[serde(default = "first_protocol")]
    pub oldest_protocol: u32,
    /// Its measured decode costs of the model shapes it calibrated (`shoal bench
    /// --calibrate`), which the planner predicts its ranks from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calibrations: Vec<shoal_planner::Calibration>,
}

fn first_protocol() -> u32 {
    1
}

/// One GPU adapter of a node.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GpuFacts {
    /// Its number in `--device gpu:N`.
    pub index: usize,
    /// The adapter's name.
    pub name: String,
    /// The API it is reached through (Vulkan, Metal, Dx12).
    pub api: String,
    /// Whether it computes on the CPU (a software driver such as lavapipe).
    pub software: bool,
    /// Its measured read bandwidth, GB/s, where the node computes on it.
    pub read_gb_s: Option<f64>,
    /// Its own memory, bytes, where the driver says (absent from older nodes).
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    /// Its measured matrix-product throughput, GFLOP/s, where the node computes on it.
    #[serde(default)]
    pub compute_gflops: Option<f64>,
    /// Why it no longer computes (the device was lost), once it failed.
    #[serde(default)]
    pub failed: Option<String>,
}

impl NodeFacts {
    /// The cluster protocol versions it speaks.
    pub fn versions(&self) -> crate::protocol::Versions {
        crate::protocol::Versions {
            version: self.protocol,
            oldest: self.oldest_protocol.min(self.protocol),
        }
    }

    /// The planner's view of this node.
    pub fn to_spec(&self, id: &str) -> shoal_planner::NodeSpec {
        shoal_planner::NodeSpec {
            id: id.to_string(),
            name: self.name.clone(),
            memory_total_bytes: self.memory_total_bytes,
            // a node whose GPU failed computes nothing more until it restarts; an entry
            // node never does
            memory_free_bytes: if self.compute_gpu_failed() || self.entry_only {
                0
            } else {
                self.memory_free_bytes
            },
            backend: self.backend.clone(),
            mem_bandwidth_gbs: self.mem_bandwidth_gbs,
            compute_gflops: self.compute_gflops,
            threads: self.threads,
            gpu: self.compute_gpu().and_then(|g| {
                Some(shoal_planner::GpuSpec {
                    memory_bytes: g.memory_bytes,
                    mem_bandwidth_gbs: g.read_gb_s?,
                    compute_gflops: g.compute_gflops,
                    max_layers: self.gpu_layers,
                })
            }),
            calibrations: self.calibrations.clone(),
        }
    }
}

impl NodeFacts {
    /// The GPU this node computes on (its `backend`), if any.
    pub fn compute_gpu(&self) -> Option<&GpuFacts> {
        self.gpus
            .iter()
            .find(|g| self.backend == format!("gpu:{}", g.index))
    }

    /// Whether the GPU this node computes on has failed.
    pub fn compute_gpu_failed(&self) -> bool {
        self.compute_gpu().is_some_and(|g| g.failed.is_some())
    }
}

/// Total and available memory in bytes, from `/proc/meminfo` (`None` where it cannot be read).
pub fn memory() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text)
}

fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_parsed_and_garbage_is_none() {
        let t = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(
            parse_meminfo(t),
            Some((24_000_000 * 1024, 20_000_000 * 1024))
        );
        assert_eq!(parse_meminfo("MemTotal: x kB"), None);
        assert!(memory().is_some_and(|(t, f)| t >= f && t > 0));
    }

    #[test]
    fn a_node_whose_compute_gpu_failed_offers_the_planner_no_memory() {
        let gpu = |index, failed: Option<&str>| GpuFacts {
            index,
            name: "card".into(),
            api: "Vulkan".into(),
            software: false,
            read_gb_s: None,
            memory_bytes: Some(8 << 30),
            compute_gflops: None,
            failed: failed.map(str::to_string),
        };
        let mut f = NodeFacts {
            name: "a".into(),
            api: String::new(),
            listen: String::new(),
            memory_total_bytes: 16 << 30,
            memory_free_bytes: 12 << 30,
            backend: "gpu:1".into(),
            threads: 4,
            mem_bandwidth_gbs: 100.0,
            compute_gflops: 50.0,
            version: "0".into(),
            gpus: vec![gpu(0, None), gpu(1, None)],
            gpu_layers: None,
            entry_only: false,
            protocol: 1,
            oldest_protocol: 1,
            calibrations: Vec::new(),
        };
        assert_eq!(f.to_spec("x").memory_free_bytes, 12 << 30);
        // another GPU than the one it computes on: no matter
        f.gpus[0].failed = Some("lost".into());
        assert_eq!(f.to_spec("x").memory_free_bytes, 12 << 30);
        f.gpus[1].failed = Some("lost".into());
        assert!(f.compute_gpu_failed());
        assert_eq!(f.to_spec("x").memory_free_bytes, 0);
        f.gpus[1].failed = None;
        f.entry_only = true;
        assert_eq!(
            f.to_spec("x").memory_free_bytes,
            0,
            "an entry node holds nothing"
        );
        // facts from a node older than these fields still read
        let old = r#"{"name":"b","api":"","listen":"","memory_total_bytes":1,"memory_free_bytes":1,
            "backend":"gpu:0","threads":1,"mem_bandwidth_gbs":1.0,"compute_gflops":1.0,
            "version":"0","gpus":[{"index":0,"name":"c","api":"Vulkan","software":false,"read_gb_s":null}]}"#;
        let old: NodeFacts = serde_json::from_str(old).unwrap();
        assert_eq!(old.versions().version, 1);
        assert_eq!(old.versions().oldest, 1);
        assert_eq!(
            (old.gpus[0].memory_bytes, old.gpus[0].failed.clone()),
            (None, None)
        );
    }
}
