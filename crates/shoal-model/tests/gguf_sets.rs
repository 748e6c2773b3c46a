//! Split GGUF sets as llama.cpp's `gguf-split` writes them (the test kit's
//! `GgufWriter::split`): any part opens the whole set, which reads as the single file does
//! (the same metadata, tensors and bytes; tensor ranges laid end to end over the parts);
//! and each broken set is refused with a message naming the file and what is wrong.

use std::path::{Path, PathBuf};

use shoal_model::gguf::GgufFile;
use shoal_model::source::{resolve, ModelSource};
use shoal_testkit::{GgmlType, GgufWriter, TinyModelSpec};

fn writer(seed: u64, layers: usize) -> GgufWriter {
    let mut spec = TinyModelSpec::qwen2(seed);
    spec.n_layers = layers;
    spec.build().unwrap().gguf_writer(GgmlType::Q8_0).unwrap()
}

fn set(dir: &Path, w: &GgufWriter, parts: usize) -> Vec<PathBuf> {
    w.write_split(dir, "model", parts).unwrap()
}

fn err(path: &Path) -> String {
    GgufFile::open(path).unwrap_err().to_string()
}

#[test]
fn any_part_opens_the_set_and_it_reads_as_the_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(1, 2);
    let single = dir.path().join("single.gguf");
    w.write_to(&single).unwrap();
    let one = GgufFile::open(&single).unwrap();
    let set_dir = dir.path().join("set");
    std::fs::create_dir(&set_dir).unwrap();
    let paths = set(&set_dir, &w, 3);
    for given in &paths {
        let s = GgufFile::open(given).unwrap();
        assert_eq!(s.path(), paths[0].as_path());
        assert_eq!(
            s.part_paths(),
            paths.iter().map(PathBuf::as_path).collect::<Vec<_>>()
        );
        assert_eq!(
            s.metadata().get("general.architecture"),
            one.metadata().get("general.architecture")
        );
        assert_eq!(s.tensors().len(), one.tensors().len());
        for t in one.tensors() {
            assert_eq!(
                s.tensor_data(&t.name).unwrap(),
                one.tensor_data(&t.name).unwrap(),
                "{}",
                t.name
            );
            assert_eq!(s.tensor(&t.name).unwrap().dims, t.dims);
        }
    }
    // ranges over the parts laid end to end hold the tensors' bytes
    let s = GgufFile::open(&paths[1]).unwrap();
    let all: Vec<u8> = paths
        .iter()
        .flat_map(|p| std::fs::read(p).unwrap())
        .collect();
    assert_eq!(s.size(), all.len() as u64);
    for t in s.tensors() {
        let r = s.tensor_range(&t.name).unwrap();
        assert_eq!(
            &all[r.start as usize..r.end as usize],
            s.tensor_data(&t.name).unwrap()
        );
    }
    let headers = s.header_ranges();
    assert_eq!(headers.len(), 3);
    assert_eq!(headers[0].start, 0);
    assert_eq!(
        headers[1].start,
        std::fs::metadata(&paths[0]).unwrap().len()
    );
    // the set's folder and any part resolve to the set
    for arg in [set_dir.as_path(), paths[2].as_path()] {
        let ModelSource::Gguf(p) = resolve(arg.to_str().unwrap()).unwrap() else {
            panic!("{arg:?} is not a GGUF model");
        };
        assert_eq!(GgufFile::open(p).unwrap().part_paths().len(), 3);
    }
}

#[test]
fn broken_sets_are_refused_naming_the_file_and_the_fault() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(1, 2);

    // a missing part
    let d = dir.path().join("missing");
    std::fs::create_dir(&d).unwrap();
    let paths = set(&d, &w, 3);
    std::fs::remove_file(&paths[1]).unwrap();
    let e = err(&paths[0]);
    eprintln!("{e}");
    assert!(
        e.contains("model-00002-of-00003.gguf")
            && e.contains("part 2 of 3")
            && e.contains("is missing"),
        "{e}"
    );
    let e = err(&paths[2]);
    eprintln!("{e}");
    assert!(
        e.contains("model-00002-of-00003.gguf: part 2 of 3"),
        "whichever part is given: {e}"
    );

    // a part of another set (of a model with more tensors) in its place
    let d = dir.path().join("mixed");
    std::fs::create_dir(&d).unwrap();
    let paths = set(&d, &w, 3);
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let theirs = set(&other, &writer(2, 3), 3);
    std::fs::copy(&theirs[1], &paths[1]).unwrap();
    let e = err(&paths[0]);
    eprintln!("{e}");
    assert!(
        e.contains("model-00002-of-00003.gguf") && e.contains("two different sets"),
        "{e}"
    );

    // a part whose split count disagrees with its name and the others
    let d = dir.path().join("count");
    std::fs::create_dir(&d).unwrap();
    let paths = set(&d, &w, 3);
    let mut bad = w.split(4).remove(1);
    bad.set_kv("split.count", 3u16);
    bad.write_to(&paths[1]).unwrap();
    let mut four = w.split(4).remove(2);
    four.set_kv("split.no", 2u16);
    four.write_to(&paths[2]).unwrap();
    let e = err(&paths[0]);
    eprintln!("{e}");
    assert!(
        e.contains("model-0000") && (e.contains("two different sets") || e.contains("parts")),
        "{e}"
    );
    let mut counted = w.split(3).remove(2);
    counted.set_kv("split.count", 4u16);
    let paths = set(&d, &w, 3);
    counted.write_to(&paths[2]).unwrap();
    let e = err(&paths[0]);
    eprintln!("{e}");
    assert!(
        e.contains("model-00003-of-00003.gguf")
            && e.contains("says the set has 4 parts, the others say 3"),
        "{e}"
    );

    // a tensor in two parts
    let d = dir.path().join("twice");
    std::fs::create_dir(&d).unwrap();
    let mut parts = w.split(3);
    let dup = parts[0].tensors()[0].clone();
    parts[1].tensors_mut().push(dup.clone());
    let paths: Vec<PathBuf> = (1..=3)
        .map(|i| d.join(format!("model-{i:05}-of-00003.gguf")))
        .collect();
    for (p, w) in paths.iter().zip(&parts) {
        w.write_to(p).unwrap();
    }
    let e = err(&paths[0]);
    eprintln!("{e}");
    assert!(
        e.contains(&format!("tensor `{}`", dup.name))
            && e.contains("model-00001-of-00003.gguf")
            && e.contains("model-00002-of-00003.gguf"),
        "{e}"
    );

    // a part renamed so that its name no longer says where the others are
    let d = dir.path().join("renamed");
    std::fs::create_dir(&d).unwrap();
    let paths = set(&d, &w, 3);
    let renamed = d.join("model.gguf");
    std::fs::rename(&paths[0], &renamed).unwrap();
    let e = err(&renamed);
    eprintln!("{e}");
    assert!(
        e.contains("part 1 of a split set of 3") && e.contains("NAME-00001-of-00003.gguf"),
        "{e}"
    );
}
