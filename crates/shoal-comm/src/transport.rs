//! The [`Transport`] trait: point-to-point byte messages between the ranks of one world,
//! built around one primitive, [`Transport::exchange`], that progresses a batch of sends and
//! receives together. Because every send and receive of a collective step is in flight at
//! once, no step can deadlock on full socket buffers or rings, whatever the message sizes.
//! This file also holds small helpers shared by the implementations (argument checks, and
//! recycling the allocation of an operation list between calls).

use std::time::Instant;

use crate::CommError;

/// Point-to-point messages between the ranks of one world.
///
/// Messages to one peer arrive in the order they were sent (FIFO per direction); a receive
/// must name the exact length of the message it takes, and a message of another length is a
/// [`CommError::Protocol`] error. One `exchange` runs at a time per transport (concurrent
/// calls from several threads are serialized); every rank must issue its exchanges in the
/// same order as its peers expect them.
///
/// After `exchange` fails with anything but [`CommError::Usage`], the transport is broken
/// (a stream may have stopped mid-message): it closes its links so that peers fail fast
/// instead of waiting for their deadline, and every later call fails with
/// [`CommError::Link`]. Build a new world to recover.
pub trait Transport: Send + Sync {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the world.
    fn world_size(&self) -> usize;

    /// Sends each `(peer, bytes)` of `sends` and fills each `(peer, buffer)` of `recvs` with
    /// the next message from that peer, progressing all of them together; returns when all
    /// are done. Several entries may name the same peer: they are matched in slice order.
    /// A send may complete before the peer has received it.
    ///
    /// # Errors
    /// [`CommError::Usage`] for a peer outside the world or this rank itself;
    /// [`CommError::Timeout`] when the `deadline` passes first; [`CommError::Link`] when a
    /// link fails or a peer closed it; [`CommError::Protocol`] when a peer sent a message of
    /// another length or protocol version.
    fn exchange(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError>;
}

impl<T: Transport + ?Sized> Transport for std::sync::Arc<T> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn exchange(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError> {
        (**self).exchange(sends, recvs, deadline)
    }
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn exchange(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), CommError> {
        (**self).exchange(sends, recvs, deadline)
    }
}

/// Checks that every peer named in an exchange is another rank of the world.
pub(crate) fn check_peers(
    rank: usize,
    world: usize,
    sends: &[(usize, &[u8])],
    recvs: &[(usize, &mut [u8])],
) -> Result<(), CommError> {
    let peers = sends.iter().map(|s| s.0).chain(recvs.iter().map(|r| r.0));
    for peer in peers {
        if peer >= world || peer == rank {
            return Err(CommError::Usage {
                rank,
                reason: format!(
                    "exchange with rank {peer}: peers must be other ranks of the world \
                     (0..{world}, not {rank})"
                ),
            });
        }
    }
    Ok(())
}

/// The error every call on a transport broken by an earlier failure returns.
pub(crate) fn broken(
    rank: usize,
    why: &str,
    sends: &[(usize, &[u8])],
    recvs: &[(usize, &mut [u8])],
) -> CommError {
    // name the first peer the refused exchange wanted
    let peer = sends.first().map(|s| s.0).or(recvs.first().map(|r| r.0));
    CommError::Link {
        rank,
        peer: peer.unwrap_or(rank),
        reason: format!(
            "the transport is closed after an earlier error ({why}); build a new world to recover"
        ),
    }
}

/// Empties a list of send operations and returns its allocation under a fresh lifetime, so a
/// list kept between calls can hold the borrowed slices of the next call without allocating.
pub(crate) fn recycle_sends<'b>(mut v: Vec<(usize, &[u8])>) -> Vec<(usize, &'b [u8])> {
    v.clear();
    // In-place collection: the element types have the same layout, so the buffer is reused.
    v.into_iter()
        .map(|(p, _)| (p, <&[u8]>::default()))
        .collect()
}

/// [`recycle_sends`] for a list of receive operations.
pub(crate) fn recycle_recvs<'b>(mut v: Vec<(usize, &mut [u8])>) -> Vec<(usize, &'b mut [u8])> {
    v.clear();
    v.into_iter()
        .map(|(p, _)| (p, <&mut [u8]>::default()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycle_keeps_capacity() {
        let data = [1u8, 2, 3];
        let mut v: Vec<(usize, &[u8])> = Vec::with_capacity(8);
        v.push((1, &data));
        let cap = v.capacity();
        let w: Vec<(usize, &'static [u8])> = recycle_sends(v);
        assert!(w.is_empty());
        // Only a performance property; std keeps the buffer for same-layout in-place collects.
        assert_eq!(w.capacity(), cap);
    }
}
