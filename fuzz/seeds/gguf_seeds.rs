//! Writes small valid GGUF files covering every metadata type, nested arrays, a non-default
//! alignment, version 2, and F32 / F16 / Q8_0 / Q4_0 / Q4_K tensors (including zero-sized
//! ones), as the seed corpus of the `gguf_header` fuzz target.

use shoal_testkit::{GgmlType, GgufValue, GgufValueType, GgufWriter};

fn vals(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.61 + seed).sin()).collect()
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "corpus/gguf_header".into());
    std::fs::create_dir_all(&dir).expect("create the corpus folder");
    let mut seeds: Vec<(&str, GgufWriter)> = Vec::new();

    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama")
        .add_kv("llama.block_count", 1u32);
    w.add_tensor("f32", &[4, 2], GgmlType::F32, &vals(8, 0.0))
        .unwrap();
    seeds.push(("tiny", w));

    let mut w = GgufWriter::new();
    for (i, v) in [
        GgufValue::U8(1),
        GgufValue::I8(-1),
        GgufValue::U16(2),
        GgufValue::I16(-2),
        GgufValue::U32(3),
        GgufValue::I32(-3),
        GgufValue::F32(0.5),
        GgufValue::Bool(true),
        GgufValue::String("s".into()),
        GgufValue::U64(4),
        GgufValue::I64(-4),
        GgufValue::F64(0.25),
        GgufValue::strings(["a", "bc"]),
        GgufValue::i32s([1, 2]),
        GgufValue::Array(GgufValueType::Bool, vec![GgufValue::Bool(false)]),
        GgufValue::Array(
            GgufValueType::Array,
            vec![
                GgufValue::f32s([1.0]),
                GgufValue::Array(GgufValueType::Array, vec![GgufValue::u32s([7])]),
            ],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        w.add_kv(format!("k{i}"), v);
    }
    w.add_tensor("q8", &[32, 2], GgmlType::Q8_0, &vals(64, 1.0))
        .unwrap();
    seeds.push(("every_type", w));

    let mut w = GgufWriter::new();
    w.set_alignment(64).unwrap();
    w.add_tensor("q4", &[64, 2], GgmlType::Q4_0, &vals(128, 2.0))
        .unwrap();
    w.add_tensor("f16", &[4, 3], GgmlType::F16, &vals(12, 3.0))
        .unwrap();
    w.add_raw_tensor("empty", vec![32, 0], 8, vec![]);
    seeds.push(("aligned64", w));

    let mut w = GgufWriter::new();
    w.set_version(2);
    w.add_tensor("qk", &[256, 1], GgmlType::Q4_K, &vals(256, 4.0))
        .unwrap();
    w.add_tensor("v", &[3], GgmlType::F32, &vals(3, 5.0))
        .unwrap();
    seeds.push(("v2_q4k", w));

    for (name, w) in seeds {
        let path = std::path::Path::new(&dir).join(format!("seed_{name}.gguf"));
        w.write_to(&path).expect("write a seed");
        println!(
            "{} ({} bytes)",
            path.display(),
            std::fs::metadata(&path).unwrap().len()
        );
    }
}
