//! Models read in place from the stores other tools keep, laid out by the test kit as Ollama
//! and LM Studio lay them out: `ollama:NAME[:TAG]` and `lmstudio:...` resolve to the GGUF file
//! (which opens as one), listings name every model by the argument that loads it, and each
//! broken or missing entry is refused with a message saying what is wrong and what to do.

use std::fs;
use std::path::{Path, PathBuf};

use shoal_model::gguf::GgufFile;
use shoal_model::source::{resolve_with, ModelSource, ResolveContext, ResolveError};
use shoal_model::stores::{self, Store};
use shoal_testkit::stores::{write_lmstudio, write_ollama};
use shoal_testkit::{GgmlType, GgufWriter, TinyModelSpec};

fn writer(seed: u64) -> GgufWriter {
    let mut spec = TinyModelSpec::llama(seed);
    spec.n_layers = 1;
    spec.build().unwrap().gguf_writer(GgmlType::Q8_0).unwrap()
}

fn gguf_bytes(dir: &Path, seed: u64) -> Vec<u8> {
    let p = dir.join(format!("m{seed}.gguf"));
    writer(seed).write_to(&p).unwrap();
    fs::read(p).unwrap()
}

fn ctx(ollama: &Path, lmstudio: &Path) -> ResolveContext {
    ResolveContext {
        ollama: Some(ollama.to_path_buf()),
        lmstudio: vec![lmstudio.to_path_buf()],
        ..ResolveContext::default()
    }
}

fn gguf_path(s: ModelSource) -> PathBuf {
    match s {
        ModelSource::Gguf(p) => p,
        other => panic!("not a GGUF source: {other:?}"),
    }
}

#[test]
fn ollama_names_resolve_to_the_model_blob() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ollama");
    let a = gguf_bytes(tmp.path(), 1);
    let b = gguf_bytes(tmp.path(), 2);
    write_ollama(&root, "registry.example", "library", "tiny", "latest", &a).unwrap();
    write_ollama(&root, "registry.example", "library", "tiny", "q8", &b).unwrap();
    write_ollama(&root, "registry.example", "someone", "other", "7b", &b).unwrap();
    let c = ctx(&root, &tmp.path().join("none"));

    for (name, want) in [
        ("ollama:tiny", &a),
        ("ollama:tiny:latest", &a),
        ("ollama:library/tiny:q8", &b),
        ("ollama:registry.example/library/tiny:q8", &b),
        ("ollama:someone/other:7b", &b),
    ] {
        let p = gguf_path(resolve_with(name, &c).unwrap());
        assert_eq!(&fs::read(&p).unwrap(), want, "{name}");
        assert!(p.starts_with(root.join("blobs")), "{name}: {}", p.display());
        // a blob has no .gguf name, and still opens as GGUF
        GgufFile::open(&p).unwrap();
    }

    let listed: Vec<(Store, String)> = stores::ollama_list(&root)
        .into_iter()
        .map(|m| {
            assert!(m.problem.is_none(), "{m:?}");
            assert!(m.size > 0);
            (m.store, m.key)
        })
        .collect();
    assert_eq!(
        listed,
        [
            (Store::Ollama, "ollama:tiny:latest".to_string()),
            (Store::Ollama, "ollama:tiny:q8".to_string()),
            (Store::Ollama, "ollama:someone/other:7b".to_string()),
        ]
    );
    // the tag `latest` is left off the id, as the APIs leave it off requested names
    assert_eq!(stores::ollama_id("ollama:tiny").as_deref(), Some("tiny"));
    assert_eq!(
        stores::ollama_id("ollama:tiny:q8").as_deref(),
        Some("tiny:q8")
    );
    assert_eq!(
        stores::ollama_id("ollama:someone/other:7b").as_deref(),
        Some("other:7b")
    );

    // the same name from a second registry: ambiguous until the registry is named
    write_ollama(&root, "mirror.example", "library", "tiny", "q8", &a).unwrap();
    let e = resolve_with("ollama:tiny:q8", &c).unwrap_err();
    assert!(matches!(e, ResolveError::AmbiguousInStore { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("ollama:mirror.example/library/tiny:q8"),
        "{e}"
    );
    let p = gguf_path(resolve_with("ollama:mirror.example/library/tiny:q8", &c).unwrap());
    assert_eq!(fs::read(p).unwrap(), a);
    let keys: Vec<String> = stores::ollama_list(&root)
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert!(
        keys.contains(&"ollama:registry.example/library/tiny:q8".to_string()),
        "{keys:?}"
    );
}

#[test]
fn broken_or_missing_ollama_models_say_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ollama");
    let a = gguf_bytes(tmp.path(), 3);
    let manifest =
        write_ollama(&root, "registry.example", "library", "tiny", "latest", &a).unwrap();
    let c = ctx(&root, &tmp.path().join("none"));

    let e = resolve_with("ollama:nothing", &c).unwrap_err().to_string();
    assert!(
        e.contains("ollama:tiny:latest") && e.contains("ollama pull nothing:latest"),
        "{e}"
    );
    for bad in [
        "ollama:",
        "ollama:a/b/c/d",
        "ollama:../x",
        "ollama:tiny:",
        "ollama:x y",
    ] {
        let e = resolve_with(bad, &c).unwrap_err();
        assert!(matches!(e, ResolveError::BadStoreName { .. }), "{bad}: {e}");
    }
    let e = resolve_with("ollama:tiny", &ctx(&tmp.path().join("nope"), tmp.path()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("OLLAMA_MODELS"), "{e}");

    // an interrupted pull: the blob is short, or gone
    let blob = gguf_path(resolve_with("ollama:tiny", &c).unwrap());
    fs::write(&blob, &a[..100]).unwrap();
    let e = resolve_with("ollama:tiny", &c).unwrap_err().to_string();
    assert!(
        e.contains("100 bytes") && e.contains("ollama pull tiny:latest"),
        "{e}"
    );
    let listed = stores::ollama_list(&root);
    assert!(listed[0]
        .problem
        .as_deref()
        .is_some_and(|p| p.contains("100 bytes")));
    fs::remove_file(&blob).unwrap();
    let e = resolve_with("ollama:tiny", &c).unwrap_err();
    assert!(matches!(e, ResolveError::MissingBlob { .. }), "{e}");

    // a manifest that is not one, or names no GGUF model
    for (text, says) in [
        ("{not json", "not JSON"),
        (r#"{"layers": 3}"#, "no `layers`"),
        (r#"{"layers": []}"#, "no layer of media type"),
        (
            r#"{"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "md5:x"}]}"#,
            "not sha256:HEX",
        ),
    ] {
        fs::write(&manifest, text).unwrap();
        let e = resolve_with("ollama:tiny", &c).unwrap_err().to_string();
        assert!(e.contains(says), "{text}: {e}");
    }
    // a model layer that is not GGUF
    let digest = shoal_testkit::stores::ollama_blob(&root, b"not a gguf file").unwrap();
    fs::write(
        &manifest,
        format!(
            r#"{{"layers": [{{"mediaType": "application/vnd.ollama.image.model", "digest": "{digest}", "size": 15}}]}}"#
        ),
    )
    .unwrap();
    let e = resolve_with("ollama:tiny", &c).unwrap_err().to_string();
    assert!(e.contains("not a GGUF file"), "{e}");
}

#[test]
fn lmstudio_files_resolve_by_path_and_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let lm = tmp.path().join("lmstudio");
    let a = gguf_bytes(tmp.path(), 4);
    let b = gguf_bytes(tmp.path(), 5);
    write_lmstudio(
        &lm,
        "pub",
        "Tiny-GGUF",
        &[
            ("Tiny-Q8_0.gguf", &a),
            ("Tiny-F16.gguf", &b),
            ("mmproj-Tiny-F16.gguf", &b),
        ],
    )
    .unwrap();
    write_lmstudio(&lm, "pub", "Solo-GGUF", &[("Solo-Q4_0.gguf", &b)]).unwrap();
    let set_dir = lm.join("other/Big-GGUF");
    fs::create_dir_all(&set_dir).unwrap();
    let parts = writer(6).write_split(&set_dir, "Big-Q8_0", 3).unwrap();
    let c = ctx(&tmp.path().join("none"), &lm);

    let ok = |name: &str| gguf_path(resolve_with(name, &c).unwrap());
    assert_eq!(
        ok("lmstudio:pub/Tiny-GGUF/Tiny-Q8_0.gguf"),
        lm.join("pub/Tiny-GGUF/Tiny-Q8_0.gguf")
    );
    assert_eq!(
        ok("lmstudio:Tiny-Q8_0"),
        lm.join("pub/Tiny-GGUF/Tiny-Q8_0.gguf")
    );
    assert_eq!(
        ok("lmstudio:tiny-f16.gguf"),
        lm.join("pub/Tiny-GGUF/Tiny-F16.gguf")
    );
    assert_eq!(
        ok("lmstudio:Solo-GGUF"),
        lm.join("pub/Solo-GGUF/Solo-Q4_0.gguf")
    );
    assert_eq!(
        ok("lmstudio:pub/Solo-GGUF"),
        lm.join("pub/Solo-GGUF/Solo-Q4_0.gguf")
    );
    // a split set is one model, named by its folder or its set name
    assert_eq!(ok("lmstudio:Big-GGUF"), parts[0]);
    assert_eq!(ok("lmstudio:Big-Q8_0"), parts[0]);
    assert_eq!(GgufFile::open(&parts[0]).unwrap().part_paths().len(), 3);

    let e = resolve_with("lmstudio:Tiny-GGUF", &c).unwrap_err();
    assert!(matches!(e, ResolveError::AmbiguousInStore { .. }), "{e}");
    let e = resolve_with("lmstudio:nothing", &c)
        .unwrap_err()
        .to_string();
    assert!(e.contains("lmstudio:pub/Solo-GGUF/Solo-Q4_0.gguf"), "{e}");
    assert!(!e.contains("mmproj"), "a projector is not a model: {e}");
    let e = resolve_with("lmstudio:../etc/x.gguf", &c).unwrap_err();
    assert!(matches!(e, ResolveError::BadStoreName { .. }), "{e}");
    let e = resolve_with("lmstudio:x", &ctx(tmp.path(), &tmp.path().join("no")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("SHOAL_LMSTUDIO_MODELS"), "{e}");

    let listed: Vec<String> = stores::lmstudio_list(std::slice::from_ref(&lm))
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(
        listed,
        [
            "lmstudio:other/Big-GGUF/Big-Q8_0-00001-of-00003.gguf",
            "lmstudio:pub/Solo-GGUF/Solo-Q4_0.gguf",
            "lmstudio:pub/Tiny-GGUF/Tiny-F16.gguf",
            "lmstudio:pub/Tiny-GGUF/Tiny-Q8_0.gguf",
        ]
    );
    // a part gone: listed with the problem, refused on load naming it
    fs::remove_file(&parts[1]).unwrap();
    let big = &stores::lmstudio_list(std::slice::from_ref(&lm))[0];
    assert!(
        big.problem
            .as_deref()
            .is_some_and(|p| p.contains("00002-of-00003")),
        "{big:?}"
    );
    let e = GgufFile::open(ok("lmstudio:Big-Q8_0"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("00002-of-00003"), "{e}");
}

#[test]
fn hf_quant_names_resolve_in_the_cache_and_are_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let snap = cache.join("models--org--Tiny-GGUF/snapshots/abc");
    fs::create_dir_all(&snap).unwrap();
    fs::create_dir_all(cache.join("models--org--Tiny-GGUF/refs")).unwrap();
    fs::write(cache.join("models--org--Tiny-GGUF/refs/main"), "abc").unwrap();
    writer(7).write_to(snap.join("Tiny-Q8_0.gguf")).unwrap();
    writer(8).write_to(snap.join("Tiny-F16.gguf")).unwrap();
    let c = ResolveContext {
        hf_cache: Some(cache.clone()),
        ..ResolveContext::default()
    };
    assert_eq!(
        gguf_path(resolve_with("hf:org/Tiny-GGUF:Q8_0", &c).unwrap()),
        snap.join("Tiny-Q8_0.gguf")
    );
    let e = resolve_with("hf:org/Tiny-GGUF", &c)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("2 GGUF models") && e.contains("shoal models pull"),
        "{e}"
    );
    let e = resolve_with("hf:org/Tiny-GGUF:Q2_K", &c)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no GGUF file matches quant tag `Q2_K`"), "{e}");
    let e = resolve_with("hf:org/Absent:Q8_0", &c)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("run: shoal models pull hf:org/Absent:Q8_0"),
        "{e}"
    );
    let keys: Vec<String> = stores::hf_list(&cache).into_iter().map(|m| m.key).collect();
    assert_eq!(keys, ["hf:org/Tiny-GGUF:F16", "hf:org/Tiny-GGUF:Q8_0"]);
}

/// A store's blob is named by its SHA-256: an Ollama blob, a Hugging Face blob through its
/// snapshot's link; anything else is not.
#[test]
fn blobs_name_their_digest() {
    use shoal_model::stores::blob_sha256;
    let dir = tempfile::tempdir().unwrap();
    let blobs = dir.path().join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let hex = "ab".repeat(32);
    let write = |p: &std::path::Path| std::fs::write(p, b"GGUF").unwrap();
    let ollama = blobs.join(format!("sha256-{hex}"));
    write(&ollama);
    assert_eq!(blob_sha256(&ollama), Some(hex.clone()));
    let colon = blobs.join(format!("sha256:{}", "CD".repeat(32)));
    write(&colon);
    assert_eq!(blob_sha256(&colon), Some("cd".repeat(32)));
    let hf = blobs.join("ef".repeat(32));
    write(&hf);
    let snap = dir.path().join("snapshots").join("rev");
    std::fs::create_dir_all(&snap).unwrap();
    let link = snap.join("model.gguf");
    std::os::unix::fs::symlink(format!("../../blobs/{}", "ef".repeat(32)), &link).unwrap();
    assert_eq!(blob_sha256(&link), Some("ef".repeat(32)));
    // not a blob: another folder, another length, not hex, missing
    let plain = dir.path().join(format!("sha256-{hex}"));
    write(&plain);
    assert_eq!(blob_sha256(&plain), None);
    for name in ["sha256-abc", &"zz".repeat(32), &"ab".repeat(20)] {
        let p = blobs.join(name);
        write(&p);
        assert_eq!(blob_sha256(&p), None, "{name}");
    }
    assert_eq!(blob_sha256(&blobs.join("ab".repeat(32) + "x")), None);
}
