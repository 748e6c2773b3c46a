//! Property test: all-reduce of random sizes on random world sizes, over the in-process and
//! TCP transports, on both algorithm paths, always equals the member-order sum on every rank.

use std::sync::Arc;

use proptest::prelude::*;

use super::{bits, inputs, on_ranks, ordered_sum, world, Kind};
use crate::{Communicator, Group};

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_random_sizes(
        len in 0usize..40_000,
        n in 1usize..=4,
        tcp in any::<bool>(),
        scatter in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let kind = if tcp { Kind::Tcp } else { Kind::Mem };
        let limit = if scatter { 0 } else { usize::MAX };
        let ts = world(kind, n);
        let xs: Vec<Vec<f32>> = (0..n).map(|r| inputs(r, len, seed)).collect();
        let want = bits(&ordered_sum(&xs));
        let got = on_ranks(&ts, |r, t| {
            let g = Group::world(Arc::clone(t)).with_one_shot_limit(limit);
            let mut x = xs[r].clone();
            g.all_reduce_sum(&mut x).map(|()| bits(&x))
        });
        for g in got {
            prop_assert!(g.as_ref().ok() == Some(&want));
        }
    }
}
