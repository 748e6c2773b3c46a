//! Every collective of [`Group`] over every transport, for worlds of 1 to 5 ranks and for
//! subsets of a world: results must be bit-identical on every rank and equal to the plain
//! sum in member order, on the one-shot and on the reduce-scatter/all-gather path.

use std::sync::Arc;

use super::{bits, inputs, on_ranks, ordered_sum, world, KINDS};
use crate::{CommError, Communicator, Group};

/// All-reduces `len` floats on every rank of `kind`'s `n`-rank world with `limit` as the
/// one-shot limit, and checks the result on every rank.
fn check_all_reduce(kind: super::Kind, n: usize, len: usize, limit: usize) {
    let ts = world(kind, n);
    let xs: Vec<Vec<f32>> = (0..n).map(|r| inputs(r, len, len as u64)).collect();
    let want = bits(&ordered_sum(&xs));
    let got = on_ranks(&ts, |r, t| {
        let g = Group::world(Arc::clone(t)).with_one_shot_limit(limit);
        let mut x = xs[r].clone();
        g.all_reduce_sum(&mut x).unwrap();
        // A second call on warm scratch must agree too.
        let mut y = xs[r].clone();
        g.all_reduce_sum(&mut y).unwrap();
        assert_eq!(
            bits(&x),
            bits(&y),
            "{kind:?} n={n} len={len}: calls disagree"
        );
        bits(&x)
    });
    for (r, g) in got.iter().enumerate() {
        assert!(
            *g == want,
            "{kind:?} n={n} len={len} limit={limit}: rank {r} differs"
        );
    }
}

#[test]
fn all_reduce_small_every_transport_and_world() {
    for kind in KINDS {
        for n in 1..=5 {
            for len in [0, 1, 7, 1000] {
                check_all_reduce(kind, n, len, crate::DEFAULT_ONE_SHOT_LIMIT);
            }
        }
    }
}

#[test]
fn all_reduce_large_goes_through_scatter_gather() {
    for kind in KINDS {
        for n in [2, 3, 4, 5] {
            // 160 KB and an odd length that does not split evenly.
            for len in [40_000, 50_001] {
                check_all_reduce(kind, n, len, crate::DEFAULT_ONE_SHOT_LIMIT);
            }
        }
    }
}

#[test]
fn scatter_gather_with_tiny_and_empty_chunks() {
    for kind in KINDS {
        for n in [3, 5] {
            for len in [0, 1, 2, 4, 6, 13] {
                check_all_reduce(kind, n, len, 0);
            }
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for kind in KINDS {
        for n in 1..=5 {
            let ts = world(kind, n);
            on_ranks(&ts, |r, t| {
                let g = Group::world(Arc::clone(t));
                for root in 0..n {
                    for len in [0usize, 5, 70_000] {
                        let want: Vec<u8> = (0..len).map(|i| (i * 7 + root) as u8).collect();
                        let mut buf = if r == root {
                            want.clone()
                        } else {
                            vec![0; len]
                        };
                        g.broadcast(&mut buf, root).unwrap();
                        assert!(buf == want, "{kind:?} n={n} root={root} len={len} rank {r}");
                    }
                }
            });
        }
    }
}

#[test]
fn all_gather_every_transport_and_world() {
    for kind in KINDS {
        for n in 1..=5 {
            let ts = world(kind, n);
            for len in [0usize, 3, 20_000] {
                let want: Vec<u8> = (0..n)
                    .flat_map(|r| (0..len).map(move |i| (i + 31 * r) as u8))
                    .collect();
                let got = on_ranks(&ts, |r, t| {
                    let g = Group::world(Arc::clone(t));
                    let mine = &want[r * len..(r + 1) * len];
                    let mut out = vec![0u8; n * len];
                    g.all_gather(mine, &mut out).unwrap();
                    out
                });
                for (r, out) in got.iter().enumerate() {
                    assert!(*out == want, "{kind:?} n={n} len={len} rank {r}");
                }
            }
        }
    }
}

#[test]
fn send_recv_between_every_pair() {
    for kind in KINDS {
        for n in 2..=5 {
            let ts = world(kind, n);
            on_ranks(&ts, |r, t| {
                let g = Group::world(Arc::clone(t));
                for a in 0..n {
                    for b in a + 1..n {
                        // Large enough to exceed socket buffers and shm rings.
                        let msg: Vec<u8> = (0..300_000).map(|i| (i + a * 3 + b) as u8).collect();
                        let mut back = vec![0u8; msg.len()];
                        if r == a {
                            g.send(b, &msg).unwrap();
                            g.recv(b, &mut back).unwrap();
                            assert!(back.iter().zip(&msg).all(|(x, y)| *x == !*y));
                        } else if r == b {
                            g.recv(a, &mut back).unwrap();
                            assert!(back == msg, "{kind:?} {a}->{b}");
                            let reply: Vec<u8> = back.iter().map(|x| !x).collect();
                            g.send(a, &reply).unwrap();
                        }
                    }
                }
            });
        }
    }
}

#[test]
fn subset_groups_run_side_by_side() {
    for kind in KINDS {
        let ts = world(kind, 4);
        let len = 30_000;
        let xs: Vec<Vec<f32>> = (0..4).map(|r| inputs(r, len, 9)).collect();
        // Ranks {0,1} and, in reversed member order, {3,2}: both at once on one transport.
        let want_a = bits(&ordered_sum(&[xs[0].clone(), xs[1].clone()]));
        let want_b = bits(&ordered_sum(&[xs[3].clone(), xs[2].clone()]));
        let want_all = bits(&ordered_sum(&xs));
        let want_odd = bits(&ordered_sum(&[xs[1].clone(), xs[2].clone(), xs[3].clone()]));
        on_ranks(&ts, |r, t| {
            let members = if r < 2 { vec![0, 1] } else { vec![3, 2] };
            let g = Group::new(Arc::clone(t), members).unwrap();
            assert_eq!(g.world_size(), 2);
            assert_eq!(g.rank(), [0, 1, 1, 0][r]);
            let mut x = xs[r].clone();
            g.all_reduce_sum(&mut x).unwrap();
            assert!(
                bits(&x)
                    == if r < 2 {
                        want_a.clone()
                    } else {
                        want_b.clone()
                    }
            );
            let world = Group::world(Arc::clone(t)).with_one_shot_limit(0);
            let mut x = xs[r].clone();
            world.all_reduce_sum(&mut x).unwrap();
            assert!(bits(&x) == want_all, "{kind:?} rank {r}");
            // Three of four ranks take part; rank 0 sits out.
            if r > 0 {
                let g = Group::new(Arc::clone(t), vec![1, 2, 3])
                    .unwrap()
                    .with_one_shot_limit(0);
                let mut x = xs[r].clone();
                g.all_reduce_sum(&mut x).unwrap();
                assert!(bits(&x) == want_odd, "{kind:?} rank {r} in {{1,2,3}}");
                let mut b = vec![r as u8; 4];
                g.broadcast(&mut b, 2).unwrap();
                assert_eq!(b, vec![3u8; 4]);
            }
        });
    }
}

#[test]
fn misuse_is_a_usage_error() {
    let ts = world(super::Kind::Mem, 3);
    let t = Arc::clone(&ts[1]);
    assert!(matches!(
        Group::new(Arc::clone(&t), vec![0, 2]),
        Err(CommError::Usage { .. })
    ));
    assert!(matches!(
        Group::new(Arc::clone(&t), vec![1, 1]),
        Err(CommError::Usage { .. })
    ));
    assert!(matches!(
        Group::new(Arc::clone(&t), vec![1, 9]),
        Err(CommError::Usage { .. })
    ));
    let g = Group::world(t);
    assert!(matches!(
        g.broadcast(&mut [0u8; 2], 3),
        Err(CommError::Usage { .. })
    ));
    assert!(matches!(
        g.all_gather(&[0u8; 2], &mut [0u8; 5]),
        Err(CommError::Usage { .. })
    ));
    assert!(matches!(g.send(1, &[1]), Err(CommError::Usage { .. })));
    assert!(matches!(g.recv(7, &mut [1]), Err(CommError::Usage { .. })));
    let e = ts[0].exchange(&[(0, &[1u8][..])], &mut [], std::time::Instant::now());
    assert!(matches!(e, Err(CommError::Usage { .. })));
}
