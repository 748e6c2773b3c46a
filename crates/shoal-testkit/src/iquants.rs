//! Files of the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) for
//! tests. The test kit cannot quantize to these types (llama.cpp's own quantizer searches
//! their lattices with an importance matrix), so it writes *random* blocks instead: random
//! grid indices, signs and sub-block scales, with the block scale `d` drawn from a range that
//! gives values of about the tiny models' weights' size. A model so written is a different
//! model from the one its spec describes, but a well-formed file of that type, and an engine
//! that reads it must give llama.cpp's logits on it.

use std::path::Path;

use crate::gguf_writer::GgufWriter;
use crate::quants::GgmlType;
use crate::rng::SplitMix64;
use crate::tiny_model::TinyModelSpec;
use crate::TestkitError;

/// A grid i-quant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GridIquant {
    /// IQ1_S (GGUF id 19).
    Iq1S,
    /// IQ1_M (id 29).
    Iq1M,
    /// IQ2_XXS (id 16).
    Iq2Xxs,
    /// IQ2_XS (id 17).
    Iq2Xs,
    /// IQ2_S (id 22).
    Iq2S,
    /// IQ3_XXS (id 18).
    Iq3Xxs,
    /// IQ3_S (id 21).
    Iq3S,
}

impl GridIquant {
    /// Every grid i-quant.
    pub const ALL: [GridIquant; 7] = [
        GridIquant::Iq1S,
        GridIquant::Iq1M,
        GridIquant::Iq2Xxs,
        GridIquant::Iq2Xs,
        GridIquant::Iq2S,
        GridIquant::Iq3Xxs,
        GridIquant::Iq3S,
    ];

    /// The id GGUF stores for this type.
    pub fn id(self) -> u32 {
        match self {
            GridIquant::Iq2Xxs => 16,
            GridIquant::Iq2Xs => 17,
            GridIquant::Iq3Xxs => 18,
            GridIquant::Iq1S => 19,
            GridIquant::Iq3S => 21,
            GridIquant::Iq2S => 22,
            GridIquant::Iq1M => 29,
        }
    }

    /// Bytes of one 256-value block.
    pub fn block_bytes(self) -> usize {
        match self {
            GridIquant::Iq1S => 50,
            GridIquant::Iq1M => 56,
            GridIquant::Iq2Xxs => 66,
            GridIquant::Iq2Xs => 74,
            GridIquant::Iq2S => 82,
            GridIquant::Iq3Xxs => 98,
            GridIquant::Iq3S => 110,
        }
    }

    /// The range `d` is drawn from: a value is `d` times a sub-block scale of a few units
    /// times a grid value (IQ2: 8 to 43, IQ3_XXS: 4 to 62, IQ3_S: 1 to 15, IQ1: about 1),
    /// so these give values of a few hundredths, as the tiny models' weights are.
    fn d_range(self) -> (f32, f32) {
        match self {
            GridIquant::Iq1S | GridIquant::Iq1M => (0.003, 0.012),
            GridIquant::Iq2Xxs | GridIquant::Iq2Xs | GridIquant::Iq2S => (0.0006, 0.0025),
            GridIquant::Iq3Xxs | GridIquant::Iq3S => (0.0002, 0.0008),
        }
    }

    /// `n` random blocks (see the module docs), from `seed`.
    pub fn random_blocks(self, n: usize, seed: u64) -> Vec<u8> {
        let mut out = vec![0u8; n * self.block_bytes()];
        self.fill_random(&mut SplitMix64::new(seed), &mut out);
        out
    }

    /// Fills `out` (whole blocks) with random blocks (see the module docs) drawn from `rng`.
    pub fn fill_random(self, rng: &mut SplitMix64, out: &mut [u8]) {
        for b in out.chunks_exact_mut(self.block_bytes()) {
            for v in b.iter_mut() {
                *v = rng.next_u64() as u8;
            }
            let (lo, hi) = self.d_range();
            let d = half::f16::from_f32(rng.uniform(lo, hi)).to_bits();
            if self == GridIquant::Iq1M {
                // `d`'s four nibbles are the top nibbles of the four scale words (bytes 48..56)
                for k in 0..4 {
                    let at = 49 + 2 * k;
                    b[at] = (b[at] & 0x0F) | ((((d >> (4 * k)) & 0xF) as u8) << 4);
                }
            } else {
                b[..2].copy_from_slice(&d.to_le_bytes());
            }
        }
    }
}

/// Turns every matrix of `w` whose rows are whole 256-value blocks into random blocks of
/// `ty` (the expert router stays as it is, as llama.cpp's quantizer keeps it); returns how
/// many it turned. Each tensor's blocks are drawn from `seed` and its name.
pub fn randomize_to_grid_iquant(w: &mut GgufWriter, ty: GridIquant, seed: u64) -> usize {
    let mut turned = 0;
    for t in w.tensors_mut() {
        if t.ne.len() < 2 || t.ne[0] % 256 != 0 || t.name.ends_with("ffn_gate_inp.weight") {
            continue;
        }
        let rows: u64 = t.ne.iter().skip(1).product();
        let blocks = (t.ne[0] / 256 * rows) as usize;
        let name_seed = t
            .name
            .bytes()
            .fold(seed, |h, c| h.rotate_left(5) ^ u64::from(c));
        t.type_id = ty.id();
        t.data = ty.random_blocks(blocks, name_seed);
        turned += 1;
    }
    turned
}

/// Writes `spec`'s model to `path` with every matrix [`randomize_to_grid_iquant`] turns made
/// random blocks of `ty` (drawn from `seed`); returns how many it turned.
///
/// # Errors
/// When the spec is invalid or the file cannot be written.
pub fn write_grid_iquant_gguf(
    spec: &TinyModelSpec,
    ty: GridIquant,
    seed: u64,
    path: impl AsRef<Path>,
) -> Result<usize, TestkitError> {
    let mut w = spec.build()?.gguf_writer(GgmlType::F32)?;
    let turned = randomize_to_grid_iquant(&mut w, ty, seed);
    w.write_to(path)?;
    Ok(turned)
}
