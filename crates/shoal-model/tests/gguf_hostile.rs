//! The GGUF reader against hostile and corrupted files written by `shoal-testkit`: every
//! failure is an `Err` naming the file and the field, never a panic, and never an allocation
//! out of proportion to the file (checked with a counting allocator). Also checks that valid
//! files read back exactly, including row and column slices of quantized tensors.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ops::Range;

use proptest::prelude::*;
use shoal_model::gguf::{GgmlType, GgufFile, GgufHeader, MetaArray, MetaValue};
use shoal_testkit::{GgmlType as Tk, GgufValue, GgufValueType, GgufWriter};

// ---------------------------------------------------------------------------------------------
// A global allocator that, on threads that ask for it, records the largest single allocation
// and the total bytes allocated, so tests can assert a hostile count allocates nothing big.

struct Counting;

thread_local! {
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    static TOTAL: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = TRACK.try_with(|t| {
        if t.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
            let _ = TOTAL.try_with(|s| s.set(s.get().saturating_add(size)));
        }
    });
}

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f`, returning its result with the largest single allocation and the total allocated.
fn tracked<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    LARGEST.with(|l| l.set(0));
    TOTAL.with(|t| t.set(0));
    TRACK.with(|t| t.set(true));
    let out = f();
    TRACK.with(|t| t.set(false));
    (out, LARGEST.with(Cell::get), TOTAL.with(Cell::get))
}

const LABEL: &str = "hostile.gguf";

/// Parses `bytes`, checking the allocation bound; returns the result.
fn parse(bytes: &[u8]) -> Result<GgufHeader, shoal_model::gguf::GgufError> {
    let (res, largest, total) = tracked(|| GgufHeader::parse(bytes, LABEL));
    // What a header may take in memory: a small constant plus a few times the file.
    let bound = 64 * 1024 + 8 * bytes.len();
    assert!(
        largest <= bound,
        "largest allocation {largest} > {bound} for a {}-byte file",
        bytes.len()
    );
    assert!(
        total <= 4 * bound,
        "total allocation {total} > {} for a {}-byte file",
        4 * bound,
        bytes.len()
    );
    res
}

/// Parses `bytes`, expecting an error whose message names the file and contains every one of
/// `needles`. Returns the message.
#[track_caller]
fn parse_err(bytes: &[u8], needles: &[&str]) -> String {
    let msg = match parse(bytes) {
        Ok(h) => panic!("expected an error, parsed {} tensors", h.tensors.len()),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.starts_with(LABEL),
        "message does not name the file: {msg}"
    );
    for n in needles {
        assert!(msg.contains(n), "message does not mention {n:?}: {msg}");
    }
    msg
}

fn f32s(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (i as f32 * 0.37 + seed).sin() * 3.0)
        .collect()
}

/// A small valid file: metadata of several types and F32, Q8_0 and Q4_0 tensors. The last
/// tensor ends exactly on the alignment, so the file has no trailing padding.
fn small_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama")
        .add_kv("llama.block_count", 2u32)
        .add_kv("flag", true)
        .add_kv("ids", GgufValue::i32s([1, -2, 3]))
        .add_kv("names", GgufValue::strings(["a", "bc"]));
    w.add_tensor("f32", &[8, 4], Tk::F32, &f32s(32, 0.0))
        .unwrap();
    w.add_tensor("q8", &[64, 3], Tk::Q8_0, &f32s(192, 1.0))
        .unwrap();
    w.add_tensor("q4", &[64, 4], Tk::Q4_0, &f32s(256, 2.0))
        .unwrap();
    w.add_tensor("tail", &[8], Tk::F32, &f32s(8, 3.0)).unwrap();
    w
}

/// A writer with one F32 tensor `w` and the given metadata, for tensor-info tests.
fn with_tensor(ne: Vec<u64>, type_id: u32, data: Vec<u8>) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama");
    w.add_raw_tensor("w", ne, type_id, data);
    w
}

/// Position of the value of metadata pair `key` (after its key string and type tag).
fn value_at(w: &GgufWriter, key: &str) -> usize {
    let (_, layout) = w.build().unwrap();
    let (_, at) = layout.kvs.iter().find(|(k, _)| k == key).unwrap();
    at + 8 + key.len() + 4
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A hand-made header: magic, version 3, the two counts, then `rest`.
fn raw(n_tensors: u64, n_kv: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b.extend_from_slice(rest);
    b
}

fn kv_prefix(key: &str, ty: u32) -> Vec<u8> {
    let mut b = (key.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(&ty.to_le_bytes());
    b
}

// ---------------------------------------------------------------------------------------------
// Magic and version.

#[test]
fn bad_magic() {
    let mut w = small_writer();
    w.set_magic(*b"GGML");
    parse_err(&w.to_bytes().unwrap(), &["not a GGUF file"]);
    parse_err(b"", &["not a GGUF file"]);
    parse_err(b"GG", &["not a GGUF file"]);
}

#[test]
fn bad_versions() {
    for (v, needles) in [
        (1u32, &["version 1", "convert"][..]),
        (99, &["version 99"][..]),
        (0, &["version 0"][..]),
        (3u32.swap_bytes(), &["big-endian"][..]),
        (2u32.swap_bytes(), &["big-endian"][..]),
    ] {
        let mut w = small_writer();
        w.set_version(v);
        let msg = parse_err(&w.to_bytes().unwrap(), needles);
        if v == 0 || v == 99 {
            assert!(!msg.contains("big-endian"), "{msg}");
        }
    }
    // Version 2 has the same layout as 3 and is accepted.
    let mut w = small_writer();
    w.set_version(2);
    assert_eq!(parse(&w.to_bytes().unwrap()).unwrap().version, 2);
}

// ---------------------------------------------------------------------------------------------
// Truncation.

#[test]
fn every_truncation_is_an_error() {
    let (bytes, layout) = small_writer().build().unwrap();
    let last = layout.tensors.last().unwrap();
    assert_eq!(
        last.data_start + last.data_len,
        bytes.len(),
        "the file must end with tensor data"
    );
    parse(&bytes).unwrap();
    for n in 0..bytes.len() {
        let res = parse(&bytes[..n]);
        let e = res
            .err()
            .unwrap_or_else(|| panic!("prefix of {n} bytes parsed"));
        assert!(e.to_string().starts_with(LABEL), "{e}");
    }
}

#[test]
fn truncation_in_trailing_padding_is_accepted() {
    // As llama.cpp's loader does, missing padding after the last tensor's data is fine; any
    // shorter prefix is an error.
    let mut w = small_writer();
    w.add_tensor("odd", &[3], Tk::F32, &[1.0, 2.0, 3.0])
        .unwrap();
    let (bytes, layout) = w.build().unwrap();
    let last = layout.tensors.last().unwrap();
    let end = last.data_start + last.data_len;
    assert!(end < bytes.len());
    for n in 0..=bytes.len() {
        let res = parse(&bytes[..n]);
        assert_eq!(
            res.is_ok(),
            n >= end,
            "prefix of {n} bytes (tensor data ends at {end})"
        );
    }
}

#[test]
fn truncation_inside_data_padding_with_empty_tensor() {
    // A zero-byte tensor whose data section starts past the end of the file: once a reader
    // panic (slicing past the end of the map), now an error.
    let mut w = with_tensor(vec![0], 0, vec![]);
    w.add_kv("pad", "x");
    let (bytes, layout) = w.build().unwrap();
    assert!(layout.tensor_infos_end < layout.data_start);
    let cut = &bytes[..layout.tensor_infos_end];
    parse_err(cut, &["tensor data", "padding"]);
    // The whole file is fine and the tensor is empty.
    let h = parse(&bytes).unwrap();
    assert_eq!(h.tensor_data(&bytes, "w").unwrap(), &[] as &[u8]);
}

// ---------------------------------------------------------------------------------------------
// Counts and lengths.

#[test]
fn absurd_tensor_and_kv_counts() {
    for count in [u64::MAX, 1 << 40, 1000] {
        let mut w = small_writer();
        w.override_tensor_count(Some(count));
        parse_err(&w.to_bytes().unwrap(), &["tensor_count", "cannot fit"]);
        let mut w = small_writer();
        w.override_kv_count(Some(count));
        parse_err(&w.to_bytes().unwrap(), &["metadata_kv_count", "cannot fit"]);
    }
    // A count that fits the file but not the entries there: fails on the entry, not the count.
    let mut w = small_writer();
    w.override_kv_count(Some(6));
    parse_err(&w.to_bytes().unwrap(), &[]);
}

#[test]
fn string_length_past_end() {
    for len in [u64::MAX, 1 << 40, 1 << 20, 10_000] {
        let w = small_writer();
        let mut b = w.to_bytes().unwrap();
        let at = value_at(&w, "general.architecture");
        put_u64(&mut b, at, len);
        parse_err(&b, &["metadata `general.architecture`", "cannot fit"]);
        // The same for a key and a tensor name.
        let mut b = w.to_bytes().unwrap();
        let (_, layout) = w.build().unwrap();
        put_u64(&mut b, layout.kvs[1].1, len);
        parse_err(&b, &["metadata entry 1 key"]);
        let mut b = w.to_bytes().unwrap();
        put_u64(&mut b, layout.tensors[2].info_start, len);
        parse_err(&b, &["tensor info 2 name"]);
    }
}

#[test]
fn huge_array_counts() {
    for count in [u64::MAX, 1 << 60, 1 << 40, 4] {
        let w = small_writer();
        // ids: elem type u32, then the count.
        let mut b = w.to_bytes().unwrap();
        put_u64(&mut b, value_at(&w, "ids") + 4, count);
        if count == 4 {
            // Off by one: the 4th element eats into the next key; the parse fails somewhere
            // later but must fail cleanly.
            assert!(parse(&b).is_err());
        } else {
            parse_err(&b, &["metadata `ids`", "cannot fit"]);
        }
        let mut b = w.to_bytes().unwrap();
        put_u64(&mut b, value_at(&w, "names") + 4, count);
        assert!(parse(&b).is_err());
    }
}

#[test]
fn counts_that_fit_allocate_in_proportion() {
    // Counts at the largest value the remaining bytes allow, followed by bytes that fail at
    // the first item. Once, the reader reserved the full count up front: several times the
    // file size for entries larger in memory than on disk.
    let junk = vec![0xffu8; 4 << 20];
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            raw(0, junk.len() as u64 / 13, &junk),
            "metadata entry 0 key",
        ),
        (raw(junk.len() as u64 / 32, 0, &junk), "tensor info 0 name"),
        (
            {
                let mut rest = kv_prefix("k", 9);
                rest.extend_from_slice(&8u32.to_le_bytes());
                rest.extend_from_slice(&(junk.len() as u64 / 8).to_le_bytes());
                rest.extend_from_slice(&junk);
                raw(0, 1, &rest)
            },
            "metadata `k`",
        ),
        (
            {
                let mut rest = kv_prefix("k", 9);
                rest.extend_from_slice(&9u32.to_le_bytes());
                rest.extend_from_slice(&(junk.len() as u64 / 12).to_le_bytes());
                rest.extend_from_slice(&junk);
                raw(0, 1, &rest)
            },
            "metadata `k`",
        ),
    ];
    for (bytes, field) in cases {
        let (res, largest, _) = tracked(|| GgufHeader::parse(&bytes, LABEL));
        let msg = res.unwrap_err().to_string();
        assert!(msg.contains(field), "{msg}");
        assert!(
            largest < bytes.len() / 4,
            "largest allocation {largest} for a {}-byte file: {msg}",
            bytes.len()
        );
    }
}

#[test]
fn nested_arrays_deeper_than_the_limit() {
    // Arrays of arrays nested `depth` deep, the innermost holding one u8.
    fn nested(depth: usize) -> Vec<u8> {
        let mut rest = kv_prefix("deep", 9);
        for _ in 1..depth {
            rest.extend_from_slice(&9u32.to_le_bytes());
            rest.extend_from_slice(&1u64.to_le_bytes());
        }
        rest.extend_from_slice(&0u32.to_le_bytes());
        rest.extend_from_slice(&1u64.to_le_bytes());
        rest.push(7);
        raw(0, 1, &rest)
    }
    let h = parse(&nested(4)).unwrap();
    assert!(matches!(
        h.metadata.get("deep"),
        Some(MetaValue::Array(MetaArray::Array(_)))
    ));
    parse_err(&nested(5), &["metadata `deep`", "nested deeper"]);
    // Far deeper than any stack could take if the reader recursed without a limit.
    parse_err(&nested(1_000_000), &["metadata `deep`", "nested deeper"]);
}

#[test]
fn unknown_metadata_types() {
    let w = small_writer();
    let mut b = w.to_bytes().unwrap();
    put_u32(&mut b, value_at(&w, "llama.block_count") - 4, 13);
    parse_err(
        &b,
        &[
            "metadata `llama.block_count`",
            "unknown metadata value type 13",
        ],
    );
    let mut b = w.to_bytes().unwrap();
    put_u32(&mut b, value_at(&w, "ids"), u32::MAX);
    parse_err(&b, &["metadata `ids`", "unknown array element type"]);
}

#[test]
fn bool_byte_two() {
    let w = small_writer();
    let mut b = w.to_bytes().unwrap();
    b[value_at(&w, "flag")] = 2;
    parse_err(&b, &["metadata `flag`", "bool value 2"]);

    let mut w = GgufWriter::new();
    w.add_kv(
        "bools",
        GgufValue::Array(
            GgufValueType::Bool,
            vec![GgufValue::Bool(true), GgufValue::Bool(false)],
        ),
    );
    let mut b = w.to_bytes().unwrap();
    b[value_at(&w, "bools") + 4 + 8 + 1] = 2;
    parse_err(&b, &["metadata `bools`", "bool array element 2"]);
}

#[test]
fn bad_alignment() {
    let cases: Vec<GgufValue> = vec![
        GgufValue::U32(0),
        GgufValue::U32(3),
        GgufValue::U32(48),
        GgufValue::U32(1 << 30),
        GgufValue::I32(-32),
        GgufValue::String("32".into()),
        GgufValue::F32(32.0),
        GgufValue::Bool(true),
        GgufValue::u32s([32]),
    ];
    for v in cases {
        let mut w = small_writer();
        w.add_kv("general.alignment", v.clone());
        parse_err(&w.to_bytes().unwrap(), &["general.alignment"]);
    }
    // A valid non-default alignment, written with the layout it implies.
    let mut w = small_writer();
    w.set_alignment(64).unwrap();
    let (bytes, layout) = w.build().unwrap();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.alignment, 64);
    assert_eq!(h.data_offset as usize, layout.data_start);
}

// ---------------------------------------------------------------------------------------------
// Tensor infos.

#[test]
fn unknown_tensor_type() {
    for id in [4u32, 5, 31, 40, 1000, u32::MAX] {
        let w = with_tensor(vec![32], id, vec![0; 32]);
        parse_err(
            &w.to_bytes().unwrap(),
            &["tensor info `w`", &format!("unknown tensor type id {id}")],
        );
    }
}

#[test]
fn bad_dimension_counts() {
    parse_err(
        &with_tensor(vec![], 0, vec![0; 4]).to_bytes().unwrap(),
        &["tensor info `w`", "0 dimensions"],
    );
    parse_err(
        &with_tensor(vec![1, 1, 1, 1, 1], 0, vec![0; 4])
            .to_bytes()
            .unwrap(),
        &["tensor info `w`", "5 dimensions"],
    );
    let w = with_tensor(vec![1, 1], 0, vec![0; 4]);
    let mut b = w.to_bytes().unwrap();
    let (_, layout) = w.build().unwrap();
    put_u32(&mut b, layout.tensors[0].info_start + 8 + 1, u32::MAX);
    parse_err(&b, &["tensor info `w`", "dimensions"]);
    // Four dimensions is the most, and fine.
    parse(
        &with_tensor(vec![1, 1, 1, 1], 0, vec![0; 4])
            .to_bytes()
            .unwrap(),
    )
    .unwrap();
}

#[test]
fn dimensions_that_overflow() {
    for ne in [
        vec![1 << 32, 1 << 32],
        vec![u64::MAX, 2],
        vec![1 << 16, 1 << 16, 1 << 16, 1 << 16],
        vec![1 << 63, 1],
        // The full product is 0, but the row count (product of the others) overflows: once
        // this parsed and `n_rows` overflowed (a panic in debug builds).
        vec![0, 1 << 40, 1 << 40],
        vec![32, 0, u64::MAX, 2],
    ] {
        let w = with_tensor(ne.clone(), 0, vec![]);
        parse_err(&w.to_bytes().unwrap(), &["tensor info `w`", "overflow"]);
    }
    // The byte size overflows even when the element count does not.
    let w = with_tensor(vec![1 << 62], 28, vec![]);
    parse_err(
        &w.to_bytes().unwrap(),
        &["tensor info `w`", "impossible for type F64"],
    );
}

#[test]
fn row_not_whole_blocks() {
    for (ne, id) in [
        (vec![33, 2], 8),
        (vec![16, 4], 2),
        (vec![255], 12),
        (vec![1, 32], 8),
    ] {
        let w = with_tensor(ne, id, vec![0; 1024]);
        parse_err(&w.to_bytes().unwrap(), &["tensor info `w`", "whole blocks"]);
    }
}

#[test]
fn offsets() {
    let name = "q8";
    for (off, needle) in [
        (1u64, "not a multiple of the alignment"),
        (3, "not a multiple of the alignment"),
        (u64::MAX, "not a multiple of the alignment"),
        (1 << 20, "runs past the end"),
        (u64::MAX - 31, "runs past the end"),
        (384, "runs past the end"),
    ] {
        let mut w = small_writer();
        assert!(w.set_tensor_offset(name, off));
        parse_err(&w.to_bytes().unwrap(), &["tensor info `q8`", needle]);
    }
    // Raw tensor whose bytes are shorter than its shape says.
    let w = with_tensor(vec![64], 0, vec![0; 100]);
    parse_err(
        &w.to_bytes().unwrap(),
        &["tensor info `w`", "runs past the end"],
    );
}

#[test]
fn duplicate_tensor_names() {
    let mut w = small_writer();
    w.add_tensor("q8", &[32], Tk::F32, &f32s(32, 0.5)).unwrap();
    parse_err(&w.to_bytes().unwrap(), &["tensor info `q8`", "same name"]);
}

#[test]
fn open_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.gguf");
    let mut w = small_writer();
    w.set_tensor_offset("q4", 7);
    w.write_to(&path).unwrap();
    let msg = GgufFile::open(&path).unwrap_err().to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("tensor info `q4`"), "{msg}");
    let msg = GgufFile::open(dir.path().join("missing.gguf"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("missing.gguf"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// Valid files.

fn to_meta(v: &GgufValue) -> MetaValue {
    match v {
        GgufValue::U8(x) => MetaValue::U8(*x),
        GgufValue::I8(x) => MetaValue::I8(*x),
        GgufValue::U16(x) => MetaValue::U16(*x),
        GgufValue::I16(x) => MetaValue::I16(*x),
        GgufValue::U32(x) => MetaValue::U32(*x),
        GgufValue::I32(x) => MetaValue::I32(*x),
        GgufValue::F32(x) => MetaValue::F32(*x),
        GgufValue::Bool(x) => MetaValue::Bool(*x),
        GgufValue::String(x) => MetaValue::String(x.clone()),
        GgufValue::U64(x) => MetaValue::U64(*x),
        GgufValue::I64(x) => MetaValue::I64(*x),
        GgufValue::F64(x) => MetaValue::F64(*x),
        GgufValue::Array(_, items) => MetaValue::Array(to_array(v, items)),
    }
}

fn to_array(v: &GgufValue, items: &[GgufValue]) -> MetaArray {
    let GgufValue::Array(ty, _) = v else {
        unreachable!()
    };
    macro_rules! each {
        ($variant:ident) => {
            MetaArray::$variant(
                items
                    .iter()
                    .map(|i| match i {
                        GgufValue::$variant(x) => Clone::clone(x),
                        _ => unreachable!(),
                    })
                    .collect(),
            )
        };
    }
    match ty {
        GgufValueType::U8 => each!(U8),
        GgufValueType::I8 => each!(I8),
        GgufValueType::U16 => each!(U16),
        GgufValueType::I16 => each!(I16),
        GgufValueType::U32 => each!(U32),
        GgufValueType::I32 => each!(I32),
        GgufValueType::F32 => each!(F32),
        GgufValueType::Bool => each!(Bool),
        GgufValueType::String => each!(String),
        GgufValueType::U64 => each!(U64),
        GgufValueType::I64 => each!(I64),
        GgufValueType::F64 => each!(F64),
        GgufValueType::Array => MetaArray::Array(
            items
                .iter()
                .map(|i| match i {
                    GgufValue::Array(_, inner) => to_array(i, inner),
                    _ => unreachable!(),
                })
                .collect(),
        ),
    }
}

fn every_value() -> Vec<(String, GgufValue)> {
    use GgufValue as V;
    use GgufValueType as T;
    let scalars = vec![
        V::U8(200),
        V::I8(-100),
        V::U16(60_000),
        V::I16(-30_000),
        V::U32(4_000_000_000),
        V::I32(-2_000_000_000),
        V::F32(-1.5e-7),
        V::Bool(true),
        V::Bool(false),
        V::String("héllo \u{1F600}".into()),
        V::String(String::new()),
        V::U64(u64::MAX),
        V::I64(i64::MIN),
        V::F64(std::f64::consts::PI),
    ];
    let mut out: Vec<(String, GgufValue)> = scalars
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("scalar.{i}.{:?}", v.value_type()), v.clone()))
        .collect();
    for (i, s) in scalars.iter().enumerate() {
        let t = s.value_type();
        out.push((
            format!("array.{i}.{t:?}"),
            V::Array(t, vec![s.clone(), s.clone(), s.clone()]),
        ));
        out.push((format!("empty.{i}.{t:?}"), V::Array(t, vec![])));
    }
    let inner = V::Array(
        T::Array,
        vec![V::i32s([1, 2]), V::strings(["x"]), V::Array(T::F64, vec![])],
    );
    out.push((
        "array.nested".into(),
        V::Array(T::Array, vec![inner.clone(), V::Array(T::Array, vec![])]),
    ));
    out
}

#[test]
fn every_metadata_type_round_trips() {
    let mut w = GgufWriter::new();
    let values = every_value();
    for (k, v) in &values {
        w.add_kv(k.clone(), v.clone());
    }
    w.add_tensor("t", &[4], Tk::F32, &[1.0, 2.0, 3.0, 4.0])
        .unwrap();
    let bytes = w.to_bytes().unwrap();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.metadata.entries().len(), values.len());
    for ((k, v), (rk, rv)) in values.iter().zip(h.metadata.entries()) {
        assert_eq!(k, rk);
        assert_eq!(&to_meta(v), rv, "{k}");
        assert_eq!(h.metadata.get(k), Some(rv));
    }
    assert_eq!(
        h.tensor_data(&bytes, "t").unwrap(),
        &bytes[h.data_offset as usize..][..16]
    );
}

fn open(
    w: &GgufWriter,
) -> (
    tempfile::TempDir,
    GgufFile,
    Vec<u8>,
    shoal_testkit::GgufLayout,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    w.write_to(&path).unwrap();
    let (bytes, layout) = w.build().unwrap();
    let f = GgufFile::open(&path).unwrap();
    (dir, f, bytes, layout)
}

/// The bytes the writer put down for tensor `name`.
fn written<'a>(bytes: &'a [u8], layout: &shoal_testkit::GgufLayout, name: &str) -> &'a [u8] {
    let p = layout.tensors.iter().find(|p| p.name == name).unwrap();
    &bytes[p.data_start..p.data_start + p.data_len]
}

#[test]
fn rows_and_cols_are_the_written_bytes() {
    let w = small_writer();
    let (_dir, f, bytes, layout) = open(&w);
    // (name, type, row length, rows, block length, block bytes)
    for (name, ty, row_len, n_rows, bl, bb) in [
        ("f32", GgmlType::F32, 8usize, 4usize, 1usize, 4usize),
        ("q8", GgmlType::Q8_0, 64, 3, 32, 34),
        ("q4", GgmlType::Q4_0, 64, 4, 32, 18),
    ] {
        let t = f.tensor(name).unwrap();
        assert_eq!(
            (t.dtype, t.row_len() as usize, t.n_rows() as usize),
            (ty, row_len, n_rows)
        );
        let data = written(&bytes, &layout, name);
        assert_eq!(f.tensor_data(name).unwrap(), data);
        let rb = row_len / bl * bb;
        assert_eq!(t.row_bytes() as usize, rb);
        for start in 0..n_rows {
            for end in start + 1..=n_rows {
                assert_eq!(
                    f.tensor_rows(name, start..end).unwrap(),
                    &data[start * rb..end * rb],
                    "{name} rows {start}..{end}"
                );
            }
        }
        for start in (0..row_len).step_by(bl) {
            for end in (start + bl..=row_len).step_by(bl) {
                let want: Vec<u8> = data
                    .chunks_exact(rb)
                    .flat_map(|r| r[start / bl * bb..end / bl * bb].iter().copied())
                    .collect();
                assert_eq!(
                    f.tensor_cols(name, start..end).unwrap(),
                    want,
                    "{name} cols {start}..{end}"
                );
            }
        }
        // Out of range and empty ranges.
        let bad_rows: [Range<usize>; 4] = [
            0..n_rows + 1,
            n_rows..n_rows + 1,
            1..1,
            usize::MAX - 1..usize::MAX,
        ];
        for r in bad_rows {
            let msg = f.tensor_rows(name, r.clone()).unwrap_err().to_string();
            assert!(
                msg.contains(&format!("tensor `{name}`")) && msg.contains("model.gguf"),
                "{r:?}: {msg}"
            );
        }
        let bad_cols: [Range<usize>; 3] = [0..row_len + bl, bl..bl, usize::MAX - 1..usize::MAX];
        for c in bad_cols {
            assert!(f.tensor_cols(name, c).is_err());
        }
        // Not block aligned.
        if bl > 1 {
            for c in [1..bl, 0..bl / 2, bl / 2..row_len, 0..row_len - 1] {
                let msg = f.tensor_cols(name, c.clone()).unwrap_err().to_string();
                assert!(msg.contains("block boundaries"), "{c:?}: {msg}");
            }
        }
    }
    assert!(f
        .tensor_rows("missing", 0..1)
        .unwrap_err()
        .to_string()
        .contains("not in the file"));
    assert!(f.tensor_cols("missing", 0..1).is_err());
    assert!(f.tensor_data("missing").is_err());
}

#[test]
fn header_slicing_checks_the_bytes_it_is_given() {
    let (bytes, _) = small_writer().build().unwrap();
    let h = parse(&bytes).unwrap();
    // Fewer bytes than the header was parsed from: an error, not a panic.
    for t in &h.tensors {
        assert!(h.tensor_data(&bytes[..64], &t.name).is_err());
        assert!(h.tensor_rows(&bytes[..64], &t.name, 0..1).is_err());
        assert!(h
            .tensor_cols(&bytes[..64], &t.name, 0..t.dtype.block_len())
            .is_err());
    }
}

#[test]
fn tensors_with_no_rows() {
    // Zero-sized tensors: once `tensor_cols` panicked on them (a chunk size of 0).
    let mut w = GgufWriter::new();
    w.add_raw_tensor("no_rows", vec![32, 0], 0, vec![]);
    w.add_raw_tensor("no_cols", vec![0, 5], 0, vec![]);
    w.add_raw_tensor("q_no_rows", vec![64, 0, 3], 8, vec![]);
    w.add_tensor("after", &[8], Tk::F32, &f32s(8, 0.0)).unwrap();
    let (bytes, layout) = w.build().unwrap();
    let h = parse(&bytes).unwrap();
    assert_eq!(
        h.tensor_cols(&bytes, "no_rows", 0..32).unwrap(),
        Vec::<u8>::new()
    );
    assert_eq!(
        h.tensor_cols(&bytes, "q_no_rows", 32..64).unwrap(),
        Vec::<u8>::new()
    );
    assert!(h.tensor_rows(&bytes, "no_rows", 0..1).is_err());
    assert!(h.tensor_cols(&bytes, "no_cols", 0..1).is_err());
    assert_eq!(
        h.tensor_rows(&bytes, "no_cols", 0..5).unwrap(),
        &[] as &[u8]
    );
    assert_eq!(
        h.tensor_data(&bytes, "after").unwrap(),
        written(&bytes, &layout, "after")
    );
}

// ---------------------------------------------------------------------------------------------
// Random mutations.

/// Touches everything a loader would: every tensor's data, some rows, some columns.
fn exercise(bytes: &[u8]) {
    let Ok(h) = parse(bytes) else { return };
    for t in &h.tensors {
        let _ = h.tensor_data(bytes, &t.name);
        let n_rows = t.n_rows().min(1 << 20) as usize;
        let row_len = t.row_len().min(1 << 20) as usize;
        let bl = t.dtype.block_len();
        for r in [0..1, 0..n_rows, n_rows / 2..n_rows, 1..n_rows + 1] {
            let _ = h.tensor_rows(bytes, &t.name, r);
        }
        for c in [
            0..bl,
            0..row_len,
            bl..row_len,
            row_len / 2..row_len,
            0..row_len + bl,
        ] {
            let _ = h.tensor_cols(bytes, &t.name, c);
        }
    }
}

fn mutation_base() -> Vec<u8> {
    let mut w = small_writer();
    w.add_kv(
        "nested",
        GgufValue::Array(
            GgufValueType::Array,
            vec![GgufValue::u32s([1, 2]), GgufValue::strings(["z"])],
        ),
    )
    .add_kv("f64", 2.5f64)
    .add_kv(
        "u8s",
        GgufValue::Array(GgufValueType::U8, vec![GgufValue::U8(1); 5]),
    );
    w.to_bytes().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn random_mutations_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..8),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let mut b = mutation_base();
        for (at, v, kind) in edits {
            let i = at.index(b.len());
            match kind {
                // Interesting values land where counts and lengths are.
                0 => b[i] = v,
                1 => b[i] = 0xff,
                2 => b[i] ^= 1 << (v % 8),
                _ => {
                    let end = (i + 8).min(b.len());
                    b[i..end].fill(if v & 1 == 0 { 0 } else { 0xff });
                }
            }
        }
        if do_cut {
            b.truncate(cut.index(b.len() + 1));
        }
        exercise(&b);
    }
}
