//! Communication between the ranks of one shoal instance. Every rank of a split model runs
//! the same step; the few points where ranks must agree (the sum of partial results of a
//! row-parallel layer, the sampled token) go through a [`Communicator`]. A model run on one
//! rank uses [`Solo`], for which every collective is the identity, so the engine's parallel
//! layers are plain layers at world size 1.
//!
//! Below the [`Communicator`] sits a [`Transport`]: point-to-point byte messages between the
//! ranks of one world, driven by a single primitive, [`Transport::exchange`], that progresses
//! several sends and receives at once (so no collective can deadlock on full buffers). The
//! transports are [`TcpTransport`] (a full mesh of TCP connections, across hosts),
//! [`ShmTransport`] (rings in one shared-memory file, processes on one host),
//! [`MemTransport`] (threads of one process, for tests) and [`EmulatedLink`] (wraps another
//! transport and adds latency and a bandwidth cap). [`Group`] implements the collectives of
//! [`Communicator`] over any transport, for the whole world or a subset of its ranks.
//! [`Rebindable`] forwards to a communicator that can be swapped for another of the same
//! shape, so layers built once can run over a later placement's mesh.

mod clock;
mod emulated;
pub mod frame;
mod group;
mod mem;
#[cfg(feature = "rdma")]
mod rdma;
mod rebind;
mod shm;
mod stream;
mod tcp;
mod transport;

pub use emulated::{EmulatedLink, LinkSpec};
pub use group::{Group, DEFAULT_ONE_SHOT_LIMIT, DEFAULT_TIMEOUT};
pub use mem::{mem_mesh, MemTransport};
#[cfg(feature = "rdma")]
pub use rdma::{RdmaConfig, RdmaTransport, DEFAULT_SLOTS, DEFAULT_SLOT_BYTES};
pub use rebind::Rebindable;
pub use shm::{shm_mesh_local, ShmTransport, DEFAULT_RING_BYTES};
pub use tcp::{connect_mesh, tcp_mesh_local, TcpTransport};
pub use transport::Transport;

/// What can go wrong in a collective.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A peer did not answer within the deadline.
    #[error("rank {rank}: peer rank {peer} did not answer within {deadline_ms} ms")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The silent peer.
        peer: usize,
        /// The deadline that passed.
        deadline_ms: u64,
    },
    /// A peer sent something other than what this rank expected (a different protocol
    /// version, a frame of the wrong length, or ranks running different steps).
    #[error("rank {rank}: protocol error with rank {peer}: {reason}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What was wrong.
        reason: String,
    },
    /// A caller asked for something the communicator cannot do (a rank outside the world,
    /// buffers of mismatched sizes).
    #[error("rank {rank}: {reason}")]
    Usage {
        /// This rank.
        rank: usize,
        /// What was wrong.
        reason: String,
    },
    /// The link to a peer failed.
    #[error("rank {rank}: link to rank {peer} failed: {reason}")]
    Link {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What failed.
        reason: String,
    },
}

/// The collectives the engine needs, over the ranks of one instance.
pub trait Communicator: Send + Sync {
    /// This rank's index, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Replaces `data` on every rank with the element-wise sum over all ranks, summed in
    /// rank order so that every rank holds bit-identical results.
    ///
    /// # Errors
    /// When a peer fails or misses the deadline.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError>;
    /// Copies `data` from rank `root` to every rank.
    ///
    /// # Errors
    /// When a peer fails or misses the deadline.
    fn broadcast(&self, data: &mut [u8], root: usize) -> Result<(), CommError>;
    /// Concatenates every rank's `mine` (all the same length) in rank order into `out`
    /// (`world_size() * mine.len()` bytes) on every rank.
    ///
    /// # Errors
    /// When a peer fails or misses the deadline, or `out` has the wrong length.
    fn all_gather(&self, mine: &[u8], out: &mut [u8]) -> Result<(), CommError>;
    /// Sends `data` to rank `peer`, which must post a [`Communicator::recv`] of the same
    /// length. May return before the peer has received it.
    ///
    /// # Errors
    /// When the link fails or the peer does not take the data within the deadline.
    fn send(&self, peer: usize, data: &[u8]) -> Result<(), CommError>;
    /// Receives exactly `data.len()` bytes sent by rank `peer` with [`Communicator::send`].
    ///
    /// # Errors
    /// When the link fails, nothing arrives within the deadline, or the peer sent a
    /// message of another length.
    fn recv(&self, peer: usize, data: &mut [u8]) -> Result<(), CommError>;
}

/// The communicator of a single-rank instance: every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct Solo;

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&self, _data: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }

    fn broadcast(&self, _data: &mut [u8], _root: usize) -> Result<(), CommError> {
        Ok(())
    }

    fn all_gather(&self, mine: &[u8], out: &mut [u8]) -> Result<(), CommError> {
        if out.len() != mine.len() {
            return Err(CommError::Usage {
                rank: 0,
                reason: format!(
                    "all_gather output of {} bytes for 1 rank of {} bytes",
                    out.len(),
                    mine.len()
                ),
            });
        }
        out.copy_from_slice(mine);
        Ok(())
    }

    fn send(&self, peer: usize, _data: &[u8]) -> Result<(), CommError> {
        Err(CommError::Usage {
            rank: 0,
            reason: format!("send to rank {peer} in a world of 1 rank"),
        })
    }

    fn recv(&self, peer: usize, _data: &mut [u8]) -> Result<(), CommError> {
        Err(CommError::Usage {
            rank: 0,
            reason: format!("recv from rank {peer} in a world of 1 rank"),
        })
    }
}

#[cfg(test)]
mod suite;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solo_is_identity() {
        let mut x = [1.0f32, -2.5, 3.0];
        Solo.all_reduce_sum(&mut x).unwrap();
        assert_eq!(x, [1.0, -2.5, 3.0]);
        let mut b = [7u8, 8];
        Solo.broadcast(&mut b, 0).unwrap();
        assert_eq!(b, [7, 8]);
        assert_eq!((Solo.rank(), Solo.world_size()), (0, 1));
    }
}
