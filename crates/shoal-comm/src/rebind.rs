//! A communicator whose ranks can be swapped for another set of the same shape: a rank that
//! keeps its loaded weights when its instance is placed again (same share, same rank index,
//! new peers) points the collectives its layers were built with at the new placement's
//! mesh instead of loading the weights again.

use std::sync::{Arc, RwLock};

use crate::{CommError, Communicator};

/// A [`Communicator`] that forwards every collective to the one it is bound to now.
///
/// Only one user may drive it at a time: whoever calls [`Rebindable::bind`] must know that
/// no collective of the old binding is still running (the ranks of the old placement have
/// stopped), or the two meshes' messages would mix.
pub struct Rebindable {
    rank: usize,
    world: usize,
    inner: RwLock<Arc<dyn Communicator>>,
}

impl Rebindable {
    /// Forwards to `inner` until bound to another.
    pub fn new(inner: Arc<dyn Communicator>) -> Self {
        Rebindable {
            rank: inner.rank(),
            world: inner.world_size(),
            inner: RwLock::new(inner),
        }
    }

    /// Forwards to `next` from now on.
    ///
    /// # Errors
    /// When `next` is another rank or a world of another size: the layers built for this
    /// rank's share would compute a different one's.
    pub fn bind(&self, next: Arc<dyn Communicator>) -> Result<(), CommError> {
        if next.rank() != self.rank || next.world_size() != self.world {
            return Err(CommError::Usage {
                rank: self.rank,
                reason: format!(
                    "cannot bind rank {} of {} to rank {} of {}",
                    self.rank,
                    self.world,
                    next.rank(),
                    next.world_size()
                ),
            });
        }
        *self.inner.write().unwrap_or_else(|e| e.into_inner()) = next;
        Ok(())
    }

    fn current(&self) -> Arc<dyn Communicator> {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl std::fmt::Debug for Rebindable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rebindable")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl Communicator for Rebindable {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        self.current().all_reduce_sum(data)
    }

    fn broadcast(&self, data: &mut [u8], root: usize) -> Result<(), CommError> {
        self.current().broadcast(data, root)
    }

    fn all_gather(&self, mine: &[u8], out: &mut [u8]) -> Result<(), CommError> {
        self.current().all_gather(mine, out)
    }

    fn send(&self, peer: usize, data: &[u8]) -> Result<(), CommError> {
        self.current().send(peer, data)
    }

    fn recv(&self, peer: usize, data: &mut [u8]) -> Result<(), CommError> {
        self.current().recv(peer, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{mem_mesh, Group, Transport};

    fn groups(n: usize) -> Vec<Arc<dyn Communicator>> {
        mem_mesh(n)
            .into_iter()
            .map(|t| {
                let t: Arc<dyn Transport> = Arc::new(t);
                Arc::new(Group::world(t)) as Arc<dyn Communicator>
            })
            .collect()
    }

    #[test]
    fn collectives_follow_the_binding() {
        let first = groups(2);
        let ranks: Vec<Arc<Rebindable>> = first
            .iter()
            .map(|c| Arc::new(Rebindable::new(c.clone())))
            .collect();
        let sum = |ranks: &[Arc<Rebindable>], scale: f32| {
            let handles: Vec<_> = ranks
                .iter()
                .cloned()
                .map(|r| {
                    std::thread::spawn(move || {
                        let mut v = vec![(r.rank() as f32 + 1.0) * scale];
                        r.all_reduce_sum(&mut v).unwrap();
                        v[0]
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(sum(&ranks, 1.0), vec![3.0, 3.0]);
        // a new mesh of the same shape: the old one is dropped and the ranks go on over it
        let second = groups(2);
        drop(first);
        for (r, c) in ranks.iter().zip(&second) {
            r.bind(c.clone()).unwrap();
        }
        assert_eq!(sum(&ranks, 10.0), vec![30.0, 30.0]);
    }

    #[test]
    fn a_binding_of_another_shape_is_refused() {
        let two = groups(2);
        let three = groups(3);
        let r = Rebindable::new(two[1].clone());
        let err = r.bind(three[1].clone()).unwrap_err().to_string();
        assert!(
            err.contains("cannot bind rank 1 of 2 to rank 1 of 3"),
            "{err}"
        );
        let err = r.bind(two[0].clone()).unwrap_err().to_string();
        assert!(err.contains("to rank 0 of 2"), "{err}");
        // still bound to the first
        assert_eq!(r.rank(), 1);
    }
}
