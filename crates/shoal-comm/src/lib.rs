//! Communication between the ranks of one shoal instance. Every rank of a split model runs
//! the same step; the few points where ranks must agree (the sum of partial results of a
//! row-parallel layer, the sampled token) go through a [`Communicator`]. A model run on one
//! rank uses [`Solo`], for which every collective is the identity, so the engine's parallel
//! layers are plain layers at world size 1.

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
}

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
