//! Kernel checks: every weight type at every instruction-set level this CPU has, against the
//! f64 reference over random blocks and random ragged shapes (the row counts sharding makes),
//! on one thread and on several; the reference's block layouts against candle's decoder.

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::reference::{dequantize_q8, dequantize_q8k, dequantize_row, dot_f64, synthetic_matrix};
use super::*;

fn random_matrix(ty: WeightType, rows: usize, blocks: usize, rng: &mut StdRng) -> Vec<u8> {
    synthetic_matrix(ty, rows, blocks, rng.random())
}

fn random_acts(n: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = rng.random_range(-1f32..1.0);
            if i % 97 == 5 {
                v * 30.0 // an outlier, as real hidden states have
            } else {
                v
            }
        })
        .collect()
}

/// The activation values a kernel really sees (after quantization), row by row.
fn seen_acts(ty: WeightType, x: &[f32], cols: usize) -> Vec<Vec<f32>> {
    x.chunks_exact(cols)
        .map(|row| match ty.act_format() {
            ActFormat::F32 => row.to_vec(),
            ActFormat::Q8 => {
                let mut b = vec![BlockQ8::default(); cols / QK];
                quantize_q8(row, &mut b);
                dequantize_q8(&b)
            }
            ActFormat::Q8K => {
                let mut b = vec![BlockQ8K::default(); cols / QK_K];
                quantize_q8k(row, &mut b);
                dequantize_q8k(&b)
            }
        })
        .collect()
}

/// Tolerance of one output: f32 accumulation relative to the sum of |products|, plus for the
/// types with a minimum the f16 rounding of the activation sums they use.
fn tolerance(ty: WeightType, w_row: &[u8], x_row: &[f32], mag: f64) -> f64 {
    let mut tol = 2e-5 * mag + 1e-5;
    if matches!(ty, WeightType::Q4_1 | WeightType::Q5_1) {
        let mut b = vec![BlockQ8::default(); x_row.len() / QK];
        quantize_q8(x_row, &mut b);
        for (wb, ab) in w_row.chunks_exact(ty.block_bytes()).zip(&b) {
            let m = super::formats::f16_at(wb, 2);
            tol += (m * ab.s).abs() as f64 * 2e-3;
        }
    }
    tol
}

fn check(ty: WeightType, isa: Isa, rows: usize, blocks: usize, t: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let cols = blocks * ty.block_elems();
    let data = random_matrix(ty, rows, blocks, &mut rng);
    let x = random_acts(t * cols, &mut rng);
    check_data(ty, isa, rows, cols, data, &x);
}

/// Runs `x` (whole rows of `cols` values) through a matrix of `data` and checks every
/// output against the f64 reference.
fn check_data(ty: WeightType, isa: Isa, rows: usize, cols: usize, data: Vec<u8>, x: &[f32]) {
    let t = x.len() / cols;
    let m = QuantMatrix::with_isa(isa, ty, rows, cols, data).unwrap();
    let mut y = vec![f32::NAN; t * rows];
    m.matmul(x, &mut y).unwrap();
    let seen = seen_acts(ty, x, cols);
    for tok in 0..t {
        for r in 0..rows {
            let w = m.row(r);
            let (want, mag) = dot_f64(ty, &w, &seen[tok]);
            let got = y[tok * rows + r] as f64;
            let tol = tolerance(ty, &w, &x[tok * cols..(tok + 1) * cols], mag);
            assert!(
                (got - want).abs() <= tol,
                "{ty:?} {isa:?} {rows}x{cols} t={t}: y[{tok}][{r}] = {got}, reference {want} (tol {tol})"
            );
        }
    }
}

#[test]
fn every_type_at_every_level_matches_the_reference() {
    let one_thread = team::test_pool(1);
    for isa in Isa::available() {
        for ty in WeightType::ALL {
            let blocks = if ty.block_elems() == 1 { 67 } else { 3 };
            // t = 6 runs the four-row kernel once and the one-row kernel twice
            check(ty, isa, 5, blocks, 6, 7);
            // t = 37: the sixteen-row kernel twice (where the type has one), then four and one
            check(ty, isa, 3, blocks, 37, 13);
            check(ty, isa, 3, blocks, 1, 8);
            // several tiles (pairs of tiles under AVX-512) with a ragged last one; t = 13
            // runs the eight-, four- and one-row kernels
            check(ty, isa, 37, blocks, 9, 9);
            check(ty, isa, 37, blocks, 13, 10);
            // one row on one thread (one job): four whole tiles in one run-kernel call,
            // then the ragged last one
            one_thread.install(|| check(ty, isa, 37, blocks, 1, 11));
            // rows of more block columns than the x86 run kernels keep offsets for on the
            // stack (1024 activation blocks)
            let long = if ty.block_elems() == 32 { 1030 } else { 130 };
            one_thread.install(|| check(ty, isa, 17, long, 1, 12));
        }
    }
}

/// The largest codes every type can hold against activations of the largest magnitude
/// (every value quantizes to +-127), both signs: the AVX2 kernels add several 16-bit pair
/// sums before widening them, and an overflow there would show here.
#[test]
fn largest_codes_and_activations_stay_exact() {
    for isa in Isa::available() {
        for ty in WeightType::ALL {
            if ty.block_elems() == 1 {
                continue;
            }
            let (rows, blocks) = (9, 2);
            let mut data = synthetic_matrix(ty, rows, blocks, 3);
            let bb = ty.block_bytes();
            for b in data.chunks_exact_mut(bb) {
                // keep each block's f16 scale fields; every other byte at its extreme
                let keep = match ty {
                    WeightType::Q4_0
                    | WeightType::Q5_0
                    | WeightType::Q8_0
                    | WeightType::Iq4Nl
                    | WeightType::Iq4Xs
                    | WeightType::Iq1S
                    | WeightType::Iq2Xxs
                    | WeightType::Iq2Xs
                    | WeightType::Iq2S
                    | WeightType::Iq3Xxs
                    | WeightType::Iq3S => 0..2,
                    // `d` is spread over the top nibbles of the scale words
                    WeightType::Iq1M => 48..56,
                    WeightType::Mxfp4 => 0..1,
                    WeightType::Q6K => 208..210,
                    WeightType::Q2K => 80..84,
                    WeightType::Q3K => 108..110,
                    _ => 0..4,
                };
                for (i, v) in b.iter_mut().enumerate() {
                    if keep.contains(&i) {
                        continue;
                    }
                    *v = match ty {
                        WeightType::Q8_0 => 0x81,                           // -127
                        WeightType::Q6K if (192..208).contains(&i) => 0x80, // scale -128
                        _ => 0xFF,
                    };
                }
            }
            let cols = blocks * ty.block_elems();
            for sign in [1.0f32, -1.0] {
                // five rows: the four-row kernel and the one-row kernel
                let x = vec![sign; 5 * cols];
                check_data(ty, isa, rows, cols, data.clone(), &x);
            }
        }
    }
}

/// Q2_K and Q3_K at the extremes their kernels' 16-bit steps must hold: every byte but the
/// f16 fields 0xFF (the largest codes and scales: Q2_K scale and minimum 15, Q3_K scale 31
/// and code 7), 0x00 (Q3_K scale -32 and code 0, standing for -4), or alternating between
/// the two (neighbouring bytes unlike, as the 16-bit shifts that unpack codes carry bits
/// between bytes), against activations of the largest magnitude of both signs.
#[test]
fn two_and_three_bit_extremes_stay_exact() {
    for isa in Isa::available() {
        for ty in [WeightType::Q2K, WeightType::Q3K] {
            let (rows, blocks) = (17, 2);
            let keep = if ty == WeightType::Q2K {
                80..84
            } else {
                108..110
            };
            let fills: [fn(usize) -> u8; 4] = [
                |_| 0xFF,
                |_| 0x00,
                |i| if i % 2 == 0 { 0xFF } else { 0x00 },
                |i| if i % 2 == 0 { 0x00 } else { 0xFF },
            ];
            for fill in fills {
                let mut data = synthetic_matrix(ty, rows, blocks, 4);
                for b in data.chunks_exact_mut(ty.block_bytes()) {
                    for (i, v) in b.iter_mut().enumerate() {
                        if !keep.contains(&i) {
                            *v = fill(i);
                        }
                    }
                }
                let cols = blocks * QK_K;
                for sign in [1.0f32, -1.0] {
                    let x = vec![sign; 5 * cols];
                    check_data(ty, isa, rows, cols, data.clone(), &x);
                }
            }
        }
    }
}

/// The level feature detection picks, when the run says which it must be
/// (`SHOAL_EXPECT_ISA`, set by `scripts/test-aarch64.sh` for each emulated CPU).
#[test]
fn detection_picks_the_expected_level() {
    let best = Isa::detected();
    assert!(
        Isa::levels().contains(&best),
        "{best:?} is not this architecture's"
    );
    assert_eq!(Isa::available().last(), Some(&best));
    assert!(Isa::available().iter().all(|i| i.runs_here()));
    if let Ok(want) = std::env::var("SHOAL_EXPECT_ISA") {
        assert_eq!(best.name(), want, "feature detection on this CPU");
    }
}

#[test]
fn levels_agree_with_the_portable_kernels() {
    let mut rng = StdRng::seed_from_u64(3);
    for ty in WeightType::ALL {
        let blocks = if ty.block_elems() == 1 { 300 } else { 4 };
        let cols = blocks * ty.block_elems();
        let data = random_matrix(ty, 9, blocks, &mut rng);
        let x = random_acts(5 * cols, &mut rng);
        let mut base = vec![0f32; 5 * 9];
        QuantMatrix::with_isa(Isa::Portable, ty, 9, cols, data.clone())
            .unwrap()
            .matmul(&x, &mut base)
            .unwrap();
        for isa in Isa::available() {
            let m = QuantMatrix::with_isa(isa, ty, 9, cols, data.clone()).unwrap();
            assert_eq!(
                &*m.row(8),
                &data[8 * data.len() / 9..],
                "{ty:?} {isa:?} row 8"
            );
            let mut y = vec![0f32; 5 * 9];
            m.matmul(&x, &mut y).unwrap();
            for (i, (a, b)) in base.iter().zip(&y).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                    "{ty:?} {isa:?} output {i}: portable {a}, got {b}"
                );
            }
        }
    }
}

#[test]
fn many_threads_give_the_same_result_as_one() {
    let mut rng = StdRng::seed_from_u64(11);
    // t = 1: each thread's range of tiles goes to one run-kernel call
    for (ty, t) in [
        (WeightType::Q4K, 5),
        (WeightType::Q5_0, 5),
        (WeightType::F16, 5),
        (WeightType::Q4K, 1),
        (WeightType::Q6K, 1),
        (WeightType::Q5_0, 1),
        (WeightType::Q2K, 1),
        (WeightType::Q3K, 1),
        (WeightType::Q2K, 5),
        (WeightType::Q3K, 5),
    ] {
        let (rows, blocks) = (77, 2);
        let blocks = if ty.block_elems() == 1 { 256 } else { blocks };
        let cols = blocks * ty.block_elems();
        let m =
            QuantMatrix::new(ty, rows, cols, random_matrix(ty, rows, blocks, &mut rng)).unwrap();
        let x = random_acts(t * cols, &mut rng);
        let run = |threads: usize| {
            let pool = team::test_pool(threads);
            let mut y = vec![0f32; t * rows];
            pool.install(|| m.matmul(&x, &mut y)).unwrap();
            y
        };
        let one = run(1);
        assert_eq!(one, run(3), "{ty:?}");
        assert_eq!(one, run(8), "{ty:?}");
    }
}

#[test]
fn simd_quantization_is_bit_exact() {
    let mut rng = StdRng::seed_from_u64(21);
    for case in 0..20 {
        let mut x = random_acts(4 * QK_K, &mut rng);
        if case % 4 == 1 {
            x[..QK_K].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
        }
        if case % 4 == 2 {
            x[7] = 100.0; // equal magnitudes of both signs: the first one wins
            x[9] = -100.0;
            x[40] = -100.0;
        }
        let (mut a, mut b) = (vec![BlockQ8::default(); 32], vec![BlockQ8::default(); 32]);
        super::formats::quantize_q8(&x, &mut a);
        quantize_q8(&x, &mut b);
        assert_eq!(a, b, "q8 case {case}");
        let (mut a, mut b) = (vec![BlockQ8K::default(); 4], vec![BlockQ8K::default(); 4]);
        super::formats::quantize_q8k(&x, &mut a);
        quantize_q8k(&x, &mut b);
        assert_eq!(a, b, "q8k case {case}");
    }
}

#[test]
fn bad_shapes_are_errors() {
    let ty = WeightType::Q8_0;
    assert!(QuantMatrix::new(ty, 2, 33, vec![0; 68]).is_err());
    assert!(QuantMatrix::new(ty, 2, 32, vec![0; 67]).is_err());
    assert!(QuantMatrix::new(ty, usize::MAX, 32, vec![]).is_err());
    let m = QuantMatrix::new(ty, 2, 32, vec![0; 68]).unwrap();
    let mut y = vec![0f32; 2];
    assert!(m.matmul(&[0.0; 31], &mut y).is_err());
    assert!(m.matmul(&[0.0; 64], &mut y).is_err());
    assert!(m.dequantize_row(2, &mut [0.0; 32]).is_err());
    assert!(m.dequantize_row(0, &mut [0.0; 31]).is_err());
    m.matmul(&[], &mut []).unwrap();
}

#[test]
fn reference_layouts_match_candle() {
    use candle_core::quantized::{GgmlDType, QStorage, QTensor};
    use candle_core::Device;
    let mut rng = StdRng::seed_from_u64(5);
    for ty in WeightType::ALL {
        let dt = match ty {
            WeightType::F32 => GgmlDType::F32,
            WeightType::F16 => GgmlDType::F16,
            WeightType::Bf16 => GgmlDType::BF16,
            WeightType::Q4_0 => GgmlDType::Q4_0,
            WeightType::Q4_1 => GgmlDType::Q4_1,
            WeightType::Q5_0 => GgmlDType::Q5_0,
            WeightType::Q5_1 => GgmlDType::Q5_1,
            WeightType::Q8_0 => GgmlDType::Q8_0,
            WeightType::Q4K => GgmlDType::Q4K,
            WeightType::Q5K => GgmlDType::Q5K,
            WeightType::Q6K => GgmlDType::Q6K,
            WeightType::Q2K => GgmlDType::Q2K,
            WeightType::Q3K => GgmlDType::Q3K,
            // candle has no decoder for these: the test kit's (IQ4, MXFP4) and gguf-py's (the
            // grid i-quants) are checked below
            WeightType::Iq4Nl
            | WeightType::Iq4Xs
            | WeightType::Mxfp4
            | WeightType::Iq1S
            | WeightType::Iq1M
            | WeightType::Iq2Xxs
            | WeightType::Iq2Xs
            | WeightType::Iq2S
            | WeightType::Iq3Xxs
            | WeightType::Iq3S => continue,
        };
        let blocks = if ty.block_elems() == 1 { 512 } else { 2 };
        let cols = blocks * ty.block_elems();
        let data = random_matrix(ty, 1, blocks, &mut rng);
        let storage =
            QStorage::from_data(std::borrow::Cow::Borrowed(&data[..]), &Device::Cpu, dt).unwrap();
        let q = QTensor::new(storage, vec![cols]).unwrap();
        let theirs = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut ours = vec![0f32; cols];
        dequantize_row(ty, &data, &mut ours);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "{ty:?} value {i}: ours {a}, candle {b}"
            );
        }
    }
}

/// The grid i-quants read as gguf-py (llama.cpp's Python package, numpy code written apart
/// from ggml's C) reads them: random blocks of every type, decoded by both, agree to f32
/// rounding. Needs python3 with the `gguf` package (skipped without it, failed under CI).
#[test]
#[cfg_attr(
    target_arch = "aarch64",
    ignore = "spawns python3: under qemu-user (where CI runs the arm64 tests) a fork from a \
              multithreaded test process can hang, and the decoding checked is the same code \
              on every architecture"
)]
fn grid_iquants_read_as_gguf_py_reads_them() {
    let have = std::process::Command::new("python3")
        .args(["-c", "import gguf.quants, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        shoal_testkit::skip_or_fail(
            "grid_iquants_read_as_gguf_py_reads_them",
            "python3 with the gguf and numpy packages is missing (python3 -m pip install gguf numpy)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (ty, name) in [
        (WeightType::Iq1S, "IQ1_S"),
        (WeightType::Iq1M, "IQ1_M"),
        (WeightType::Iq2Xxs, "IQ2_XXS"),
        (WeightType::Iq2Xs, "IQ2_XS"),
        (WeightType::Iq2S, "IQ2_S"),
        (WeightType::Iq3Xxs, "IQ3_XXS"),
        (WeightType::Iq3S, "IQ3_S"),
    ] {
        let blocks = 64;
        let data = synthetic_matrix(ty, 1, blocks, 23);
        let path = dir.path().join(name);
        std::fs::write(&path, &data).unwrap();
        let script = format!(
            "import sys, numpy as np\n\
             from gguf import quants, GGMLQuantizationType as T\n\
             raw = np.fromfile(sys.argv[1], dtype=np.uint8).reshape(1, -1)\n\
             v = quants.dequantize(raw, T.{name}).astype(np.float32).reshape(-1)\n\
             sys.stdout.buffer.write(v.tobytes())\n"
        );
        let out = std::process::Command::new("python3")
            .args(["-c", &script])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let theirs: Vec<f32> = out
            .stdout
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut ours = vec![0f32; blocks * ty.block_elems()];
        dequantize_row(ty, &data, &mut ours);
        assert_eq!(theirs.len(), ours.len(), "{name}");
        let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{name}: all zero");
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * scale,
                "{name} value {i}: ours {a}, gguf-py {b}"
            );
        }
    }
}

/// The batched path of the grid i-quants (each super-block column unpacked once per batch;
/// x86-64, sixteen rows a group with AVX-512 VNNI, eight with AVX2): whole and ragged groups
/// of rows through the eight-, four- and one-row kernels, at every level (the others read the
/// blocks directly).
#[test]
fn batched_iquant_products_match_the_reference() {
    use WeightType::{Iq1M, Iq1S, Iq2S, Iq2Xs, Iq2Xxs, Iq3S, Iq3Xxs};
    for isa in Isa::available() {
        for ty in [Iq1S, Iq1M, Iq2Xxs, Iq2Xs, Iq2S, Iq3Xxs, Iq3S] {
            // 37 rows: two groups of sixteen and five more; t = 31: 8 + 8 + 8 + 4 + 1 + 1 + 1
            check(ty, isa, 37, 2, 31, 21);
            check(ty, isa, 16, 1, 16, 22);
            check(ty, isa, 3, 3, 16, 23);
        }
    }
}

/// The x86 unpackings (vectors and a transpose in registers; sixteen rows for AVX-512 and,
/// with the values signed, eight for AVX2) write every byte of the portable definition's,
/// for whole and ragged groups of rows of every grid type.
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_unpacking_equals_the_definition() {
    fn same<L: iquants::Lattice>() {
        let data = synthetic_matrix(L::TYPE, 16, 2, 31);
        let bb = L::TYPE.block_bytes();
        let row = data.len() / 16;
        for live in [16, 5, 1] {
            for b in 0..2 {
                let blocks: Vec<&[u8]> = (0..live)
                    .map(|r| &data[r * row + b * bb..r * row + (b + 1) * bb])
                    .collect();
                let mut want = vec![0xAAu8; iquants::unpacked::BYTES];
                iquants::unpack::<L>(&blocks, &mut want);
                let mut got = vec![0x55u8; iquants::unpacked::BYTES];
                // SAFETY: `same` runs only once the CPU is known to have AVX-512 (below).
                unsafe { x86_unpacked::unpack::<L>(&blocks, &mut got) };
                assert!(got == want, "{:?}: {live} rows, block {b}", L::TYPE);
            }
        }
    }
    /// The AVX2 form: the same values, signed, eight rows.
    fn same_narrow<L: iquants::Lattice>() {
        use x86_unpacked::narrow::{BYTES, D, QS, ROWS, SC};
        let data = synthetic_matrix(L::TYPE, 8, 2, 37);
        let bb = L::TYPE.block_bytes();
        let row = data.len() / 8;
        for live in [8, 3] {
            let blocks: Vec<&[u8]> = (0..live)
                .map(|r| &data[r * row + bb..r * row + 2 * bb])
                .collect();
            let mut want = vec![0xAAu8; iquants::unpacked::BYTES];
            iquants::unpack::<L>(&blocks, &mut want);
            let mut got = vec![0x55u8; BYTES];
            // SAFETY: `same_narrow` runs only once the CPU is known to have AVX2 (below).
            unsafe { x86_unpacked::unpack_narrow::<L>(&blocks, &mut got) };
            let wide = iquants::unpacked::QS;
            for r in 0..ROWS {
                assert_eq!(
                    got[D + 4 * r..D + 4 * r + 4],
                    want[4 * r..4 * r + 4],
                    "{:?} unit {r}",
                    L::TYPE
                );
                for h in 0..16 {
                    assert_eq!(
                        got[SC + ROWS * h + r],
                        want[iquants::unpacked::SC + 16 * h + r],
                        "{:?} scale {h} of row {r}",
                        L::TYPE
                    );
                }
                for v in 0..QK_K / 4 {
                    for j in 0..4 {
                        let w = want[wide + 64 * v + 4 * r + j] ^ 0x80;
                        assert_eq!(
                            got[QS + 32 * v + 4 * r + j],
                            w,
                            "{:?} value {} of row {r} ({live} rows)",
                            L::TYPE,
                            4 * v + j
                        );
                    }
                }
            }
        }
    }
    if Isa::detected() >= Isa::Avx2 {
        same_narrow::<iquants::Iq1S>();
        same_narrow::<iquants::Iq1M>();
        same_narrow::<iquants::Iq2Xxs>();
        same_narrow::<iquants::Iq2Xs>();
        same_narrow::<iquants::Iq2S>();
        same_narrow::<iquants::Iq3Xxs>();
        same_narrow::<iquants::Iq3S>();
    }
    if Isa::detected() < Isa::Avx512Vnni {
        return;
    }
    same::<iquants::Iq1S>();
    same::<iquants::Iq1M>();
    same::<iquants::Iq2Xxs>();
    same::<iquants::Iq2Xs>();
    same::<iquants::Iq2S>();
    same::<iquants::Iq3Xxs>();
    same::<iquants::Iq3S>();
}

/// The IQ4 grids' ends (code 0: -127) and MXFP4's largest negative values (code 15: -12),
/// which the all-0xFF blocks above do not reach, against activations of the largest
/// magnitude of both signs.
#[test]
fn grid_ends_stay_exact() {
    for isa in Isa::available() {
        for (ty, keep) in [
            (WeightType::Iq4Nl, 0..2),
            (WeightType::Iq4Xs, 0..4),
            (WeightType::Mxfp4, 0..1),
        ] {
            let (rows, blocks) = (17, 2);
            for fill in [0x00u8, 0x0F, 0xF0] {
                let mut data = synthetic_matrix(ty, rows, blocks, 5);
                for b in data.chunks_exact_mut(ty.block_bytes()) {
                    for (i, v) in b.iter_mut().enumerate() {
                        // IQ4_XS: the sub-block scales' bytes at their extreme too (-32)
                        if !keep.contains(&i) {
                            *v = if ty == WeightType::Iq4Xs && i < 8 {
                                0
                            } else {
                                fill
                            };
                        }
                    }
                }
                let cols = blocks * ty.block_elems();
                for sign in [1.0f32, -1.0] {
                    let x = vec![sign; 5 * cols];
                    check_data(ty, isa, rows, cols, data.clone(), &x);
                }
            }
        }
    }
}

/// The test kit's Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 blocks (which its GGUF files, and so
/// the llama.cpp oracle, hold) read the same through the reference here as through the test
/// kit's decoder (written apart from it, in f64, from each format's definition), and the
/// kernels multiply them as the reference says.
#[test]
fn test_kit_blocks_read_the_same() {
    use shoal_testkit::quants::{dequantize, quantize, GgmlType};
    let mut rng = StdRng::seed_from_u64(17);
    for (ty, gt) in [
        (WeightType::Q2K, GgmlType::Q2_K),
        (WeightType::Q3K, GgmlType::Q3_K),
        (WeightType::Iq4Nl, GgmlType::IQ4_NL),
        (WeightType::Iq4Xs, GgmlType::IQ4_XS),
        (WeightType::Mxfp4, GgmlType::MXFP4),
    ] {
        let (rows, cols) = (11, 3 * QK_K);
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1f32..1.0) * 0.05)
            .collect();
        let data = quantize(gt, &w).unwrap();
        let theirs = dequantize(gt, &data, w.len()).unwrap();
        let mut ours = vec![0f32; w.len()];
        for (r, o) in ours.chunks_exact_mut(cols).enumerate() {
            let rb = data.len() / rows;
            dequantize_row(ty, &data[r * rb..(r + 1) * rb], o);
        }
        // f32 products here (IQ4_XS: two of them) against one f64 product rounded there
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{ty:?} value {i}: ours {a}, the test kit's {b}"
            );
        }
        assert!(theirs.iter().any(|&v| v != 0.0), "{ty:?}: all zero");
        let x = random_acts(3 * cols, &mut rng);
        for isa in Isa::available() {
            check_data(ty, isa, rows, cols, data.clone(), &x);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_ragged_shapes(
        ty_i in 0usize..WeightType::ALL.len(),
        rows in 1usize..40,
        blocks in 1usize..7,
        t in 1usize..40,
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let ty = WeightType::ALL[ty_i];
        let blocks = if ty.block_elems() == 1 { blocks * 32 } else { blocks };
        let pool = team::test_pool(threads);
        for isa in Isa::available() {
            pool.install(|| check(ty, isa, rows, blocks, t, seed));
        }
    }
}

/// Attention's vector helpers (scores and weighted sum over f16 cache rows, softmax) and
/// the gated activation at the level this CPU runs, against f64, over head dimensions with and without the 8-row
/// and 64-value fast paths and row counts around their edges.
#[test]
fn attention_helpers_match_f64() {
    let mut rng = StdRng::seed_from_u64(7);
    for hd in [8usize, 20, 64, 72, 128, 136] {
        for n in [0usize, 1, 7, 8, 9, 17, 40] {
            let q = random_acts(hd, &mut rng);
            let rows: Vec<half::f16> = random_acts(n * hd, &mut rng)
                .into_iter()
                .map(half::f16::from_f32)
                .collect();
            let mut s = vec![0f32; n];
            scores(&q, &rows, 0.125, &mut s);
            for (j, &got) in s.iter().enumerate() {
                let row = &rows[j * hd..(j + 1) * hd];
                let want: f64 = q
                    .iter()
                    .zip(row)
                    .map(|(&a, &b)| a as f64 * b.to_f64())
                    .sum();
                let mag: f64 = q
                    .iter()
                    .zip(row)
                    .map(|(&a, &b)| (a as f64 * b.to_f64()).abs())
                    .sum();
                assert!(
                    (got as f64 - 0.125 * want).abs() <= 1e-6 * mag,
                    "scores hd {hd} n {n} row {j}: {got} vs {}",
                    0.125 * want
                );
            }
            let w = random_acts(n, &mut rng);
            let mut out = vec![0f32; hd];
            weighted_sum(&w, &rows, &mut out);
            // in two blocks of rows, adding to what the first left: the same bits
            let mut split = vec![0f32; hd];
            let h = n / 2;
            weighted_sum(&w[..h], &rows[..h * hd], &mut split);
            weighted_sum(&w[h..], &rows[h * hd..], &mut split);
            assert_eq!(split, out, "weighted_sum hd {hd} n {n} in two blocks");
            for (i, &got) in out.iter().enumerate() {
                let col = (0..n).map(|j| (w[j] as f64, rows[j * hd + i].to_f64()));
                let want: f64 = col.clone().map(|(a, b)| a * b).sum();
                let mag: f64 = col.map(|(a, b)| (a * b).abs()).sum();
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * mag.max(1e-30),
                    "weighted_sum hd {hd} n {n} value {i}: {got} vs {want}"
                );
            }
            let mut p = s.clone();
            softmax(&mut p);
            if n > 0 {
                let total: f32 = p.iter().sum();
                assert!((total - 1.0).abs() < 1e-5, "softmax sums to {total}");
            }
        }
    }
    let g = random_acts(1000, &mut rng);
    let u = random_acts(1000, &mut rng);
    let mut got = vec![0f32; 1000];
    gated(crate::config::Activation::Silu, &g, &u, &mut got);
    for i in 0..1000 {
        let x = g[i] as f64;
        let want = x / (1.0 + (-x).exp()) * u[i] as f64;
        assert!((got[i] as f64 - want).abs() < 1e-6 * want.abs().max(1.0));
    }
}

/// Several matrices through `matmul_many` give each matrix's own `matmul` bit for bit:
/// types that share an activation format (one quantization, one parallel region), types
/// that do not (one by one), ragged row counts, on one and on three threads.
#[test]
fn matmul_many_equals_one_by_one() {
    use WeightType::*;
    let mut rng = StdRng::seed_from_u64(11);
    let cols = 512;
    let groups: [&[(WeightType, usize)]; 7] = [
        &[(Q4_1, 64), (Q8_0, 24), (Q5_0, 19)],
        &[(Iq4Xs, 40), (Iq4Nl, 16), (Mxfp4, 9)],
        &[(Iq4Xs, 16), (Q4_0, 8)],
        &[(Q4K, 40), (Q6K, 16), (Q5K, 9)],
        &[(Q2K, 40), (Q3K, 27), (Q4K, 8)],
        &[(Q4_0, 16), (Q4K, 16), (F32, 5)],
        &[(Q8_0, 3)],
    ];
    for threads in [1, 3] {
        let pool = team::test_pool(threads);
        for group in groups {
            for t in [1usize, 5, 16] {
                let mats: Vec<QuantMatrix> = group
                    .iter()
                    .map(|&(ty, rows)| {
                        let blocks = cols / ty.block_elems();
                        QuantMatrix::new(ty, rows, cols, random_matrix(ty, rows, blocks, &mut rng))
                            .unwrap()
                    })
                    .collect();
                let x = random_acts(t * cols, &mut rng);
                let want: Vec<Vec<f32>> = mats
                    .iter()
                    .map(|m| {
                        let mut y = vec![0f32; t * m.rows()];
                        pool.install(|| m.matmul(&x, &mut y)).unwrap();
                        y
                    })
                    .collect();
                let mut got: Vec<Vec<f32>> =
                    mats.iter().map(|m| vec![f32::NAN; t * m.rows()]).collect();
                let refs: Vec<&QuantMatrix> = mats.iter().collect();
                let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|y| &mut y[..]).collect();
                pool.install(|| QuantMatrix::matmul_many(&refs, &x, &mut outs))
                    .unwrap();
                assert_eq!(got, want, "{group:?} t={t} threads={threads}");
                // into new vectors (not zeroed first where the tiled path writes them), on
                // rayon and on a decode step's team
                let fresh = pool.install(|| QuantMatrix::products(&refs, &x)).unwrap();
                assert_eq!(fresh, want, "products: {group:?} t={t} threads={threads}");
                let fresh = pool
                    .install(|| team::step(|| QuantMatrix::products(&refs, &x)))
                    .unwrap();
                assert_eq!(
                    fresh, want,
                    "products in a step: {group:?} t={t} threads={threads}"
                );
            }
        }
    }
    let m = QuantMatrix::new(Q8_0, 8, 64, vec![0; 8 * 68]).unwrap();
    let mut short = [0f32; 7];
    assert!(QuantMatrix::matmul_many(&[&m], &[0.0; 64], &mut [&mut short[..]]).is_err());
    assert!(QuantMatrix::matmul_many(&[&m, &m], &[0.0; 64], &mut [&mut short[..]]).is_err());
    assert!(QuantMatrix::products(&[&m], &[0.0; 65]).is_err());
    assert!(QuantMatrix::products(&[&m], &[]).unwrap()[0].is_empty());
}

/// Activations quantized on several threads are the blocks one thread makes.
#[test]
fn parallel_quantization_equals_serial() {
    let mut rng = StdRng::seed_from_u64(5);
    let x = random_acts(16 * 1536, &mut rng);
    let pool = team::test_pool(3);
    let mut serial = vec![BlockQ8::default(); x.len() / QK];
    quantize_q8(&x, &mut serial);
    let mut par = vec![BlockQ8::default(); x.len() / QK];
    pool.install(|| quantize_rows(&x, &mut par, quantize_q8));
    assert!(serial
        .iter()
        .zip(&par)
        .all(|(a, b)| a.qs == b.qs && a.d == b.d && a.sum == b.sum));
    let mut serial = vec![BlockQ8K::default(); x.len() / QK_K];
    quantize_q8k(&x, &mut serial);
    let mut par = vec![BlockQ8K::default(); x.len() / QK_K];
    pool.install(|| quantize_rows(&x, &mut par, quantize_q8k));
    assert!(serial.iter().zip(&par).all(|(a, b)| a == b));
}

/// The KV cache's f32 -> f16 rounding at the level this CPU runs is `half`'s, bit for bit:
/// random values over many magnitudes, the f16 overflow and subnormal edges, and lengths
/// around the 8-wide step.
#[test]
fn to_f16_rounds_like_half() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut vals: Vec<f32> = (0..4000)
        .map(|_| {
            let m: f32 = rng.random_range(-1.0..1.0);
            m * 2f32.powi(rng.random_range(-30..20))
        })
        .collect();
    vals.extend([
        0.0,
        -0.0,
        65504.0,
        65520.0,
        -65520.0,
        1e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        6.0e-8,
        2.9e-8,
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
    ]);
    for len in [0usize, 1, 7, 8, 9, 17, vals.len()] {
        let src = &vals[vals.len() - len..];
        let mut got = vec![half::f16::ZERO; len];
        to_f16(src, &mut got);
        for (g, &s) in got.iter().zip(src) {
            assert_eq!(g.to_bits(), half::f16::from_f32(s).to_bits(), "{s:e}");
        }
    }
}

#[test]
fn stream_checksum_is_the_xor_of_the_words_at_every_prefetch_distance() {
    // the bandwidth probe must read every byte whichever way it prefetches
    let buf: Vec<u8> = (0..4096 + 128).map(|i| (i * 37 % 253) as u8).collect();
    let want = buf.chunks(8).fold(0u64, |a, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        a ^ u64::from_le_bytes(w)
    });
    for ahead in [0, 64, 2048, 8192] {
        for l2 in [0, 4096] {
            assert_eq!(
                super::stream_checksum(&buf, ahead, l2),
                want,
                "ahead {ahead}, l2 {l2}"
            );
        }
    }
}

#[test]
fn argmax_is_the_first_largest_and_simd_lanes_match_the_portable_ones() {
    let mut rng = StdRng::seed_from_u64(41);
    for len in [0, 1, 7, 8, 9, 17, 64, 1003, 49152] {
        for round in 0..20 {
            // few distinct values (ties), some NaN and minus infinity
            let xs: Vec<f32> = (0..len)
                .map(|_| match (rng.random_range(0..13), round % 4) {
                    (0, 0) => f32::NAN,
                    (1, 1) => f32::NEG_INFINITY,
                    (v, _) => v as f32 - 6.0,
                })
                .collect();
            #[cfg(target_arch = "x86_64")]
            if Isa::detected() >= Isa::Avx2 {
                let whole = len / 8 * 8;
                let want = portable_lane_maxima(&xs[..whole]);
                // SAFETY: AVX2 was detected; the lengths are whole vectors.
                let got = unsafe { x86::lane_maxima(&xs[..whole]) };
                assert_eq!(format!("{got:?}"), format!("{want:?}"), "len {len}");
            }
            // and the whole argmax is the first largest
            let first = xs
                .iter()
                .enumerate()
                .fold(None::<(usize, f32)>, |b, (i, &x)| {
                    (x > b.map_or(f32::NEG_INFINITY, |b| b.1))
                        .then_some((i, x))
                        .or(b)
                })
                .map_or(0, |b| b.0);
            assert_eq!(argmax(&xs), first, "len {len}: {xs:?}");
        }
    }
    assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 2, "a NaN never wins");
    assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);
}

/// A gate/up pair gives what the two matrices and the activation give apart, bit for bit:
/// every tiled type at every level, token counts on both sides of the four- and eight-token
/// kernels, one to three threads, on rayon and in a decode step's team; matrices that cannot
/// pair are refused.
#[test]
fn gate_pairs_equal_gate_and_up_apart() {
    use crate::config::Activation;
    use WeightType::*;
    let mut rng = StdRng::seed_from_u64(31);
    for ty in [
        Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4K, Q5K, Q6K, Q2K, Q3K, Iq4Nl, Iq4Xs, Mxfp4,
    ] {
        let cols = 256;
        for isa in Isa::levels().iter().copied().filter(|i| i.runs_here()) {
            let rows = 40;
            let matrix = |ty: WeightType, rows: usize, rng: &mut StdRng| {
                let data = random_matrix(ty, rows, cols / ty.block_elems(), rng);
                QuantMatrix::with_isa(isa, ty, rows, cols, data).unwrap()
            };
            let (gate, up) = (matrix(ty, rows, &mut rng), matrix(ty, rows, &mut rng));
            let Some(pair) = GatePair::new(&gate, &up) else {
                assert!(!gate.tiled, "{ty:?} {isa:?}: tiled matrices pair");
                continue;
            };
            assert_eq!((pair.features(), pair.cols()), (rows, cols));
            let (bg, bu) = (random_acts(rows, &mut rng), random_acts(rows, &mut rng));
            for act in [
                Activation::Silu,
                Activation::GeluTanh,
                Activation::SwigluOai,
            ] {
                for t in [1, 3, 4, 9] {
                    let x = random_acts(t * cols, &mut rng);
                    let mut g = vec![0f32; t * rows];
                    let mut u = vec![0f32; t * rows];
                    gate.matmul(&x, &mut g).unwrap();
                    up.matmul(&x, &mut u).unwrap();
                    let mut want = vec![0f32; t * rows];
                    gated(act, &g, &u, &mut want);
                    // with biases (gpt-oss's experts): added to the products first
                    let add = |v: &[f32], b: &[f32]| -> Vec<f32> {
                        v.iter().zip(b.iter().cycle()).map(|(v, b)| v + b).collect()
                    };
                    let mut want_biased = vec![0f32; t * rows];
                    gated(act, &add(&g, &bg), &add(&u, &bu), &mut want_biased);
                    for threads in 1..=3 {
                        let pool = team::test_pool(threads);
                        let got = pool.install(|| pair.gated_products(&x, act)).unwrap();
                        assert_eq!(got, want, "{ty:?} {isa:?} {act:?} t={t} threads={threads}");
                        let got = pool
                            .install(|| team::step(|| pair.gated_products(&x, act)))
                            .unwrap();
                        assert_eq!(got, want, "in a step: {ty:?} {isa:?} {act:?} t={t}");
                        let mut got = Vec::new();
                        pool.install(|| {
                            pair.gated_products_into(&x, act, Some((&bg, &bu)), &mut got)
                        })
                        .unwrap();
                        assert_eq!(got, want_biased, "biased: {ty:?} {isa:?} {act:?} t={t}");
                    }
                }
            }
            assert!(pair
                .gated_products_into(
                    &[0.0; 256],
                    Activation::Silu,
                    Some((&bg[1..], &bu)),
                    &mut Vec::new()
                )
                .is_err());
            assert!(pair.gated_products(&[0.0; 255], Activation::Silu).is_err());
            assert!(pair
                .gated_products(&[], Activation::Silu)
                .unwrap()
                .is_empty());
            // unequal shapes, a ragged tile, another type
            let short = matrix(ty, 32, &mut rng);
            assert!(GatePair::new(&gate, &short).is_none());
            let ragged = matrix(ty, 36, &mut rng);
            assert!(GatePair::new(&ragged, &ragged).is_none());
            let other = matrix(if ty == Q8_0 { Q4_0 } else { Q8_0 }, rows, &mut rng);
            assert!(GatePair::new(&gate, &other).is_none());
        }
    }
}

/// One-token products big enough for a decode step's team to share them out with stealing
/// (`STEAL_BYTES` a thread) give what rayon gives, a gate/up pair included, at 2 and 3
/// threads.
#[test]
fn stolen_shares_give_the_products_rayon_gives() {
    use crate::config::Activation;
    let mut rng = StdRng::seed_from_u64(41);
    let ty = WeightType::Q8_0;
    let cols = 512;
    let row_bytes = cols / 32 * ty.block_bytes();
    // past the threshold at three threads, with a ragged last tile
    let rows = 3 * STEAL_BYTES / row_bytes + 13;
    let big =
        QuantMatrix::new(ty, rows, cols, random_matrix(ty, rows, cols / 32, &mut rng)).unwrap();
    let half = (rows / 2).next_multiple_of(16);
    let gate =
        QuantMatrix::new(ty, half, cols, random_matrix(ty, half, cols / 32, &mut rng)).unwrap();
    let up =
        QuantMatrix::new(ty, half, cols, random_matrix(ty, half, cols / 32, &mut rng)).unwrap();
    let pair = GatePair::new(&gate, &up);
    let x = random_acts(cols, &mut rng);
    let want = QuantMatrix::products(&[&big], &x).unwrap();
    let mut g = vec![0f32; half];
    let mut u = vec![0f32; half];
    gate.matmul(&x, &mut g).unwrap();
    up.matmul(&x, &mut u).unwrap();
    let mut want_h = vec![0f32; half];
    gated(Activation::Silu, &g, &u, &mut want_h);
    for threads in [2, 3] {
        let pool = team::test_pool(threads);
        team::until_teamed(
            &pool,
            || {
                let got = QuantMatrix::products(&[&big], &x).unwrap();
                let got_h = pair
                    .as_ref()
                    .map(|p| p.gated_products(&x, Activation::Silu).unwrap());
                (got, got_h)
            },
            |(got, got_h), _| {
                assert_eq!(got, want, "{threads} threads");
                if let Some(h) = got_h {
                    assert_eq!(h, want_h, "gate/up pair, {threads} threads");
                }
            },
        );
    }
}
