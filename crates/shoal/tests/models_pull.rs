//! `shoal models pull` against the test kit's hub on loopback (nothing else is reached): a
//! fresh pull lands in the Hugging Face cache layout and runs by the name it was pulled by; a
//! download cut part way resumes with a range request, within the run and after the process
//! was killed; a file whose sha256 is not the listed one is deleted and refused; a set with a
//! part missing, a missing repository, file or quant are refused naming what is missing; a
//! split set pulls whole.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use shoal_testkit::hub::{Fault, HubFile, HubRepo, HubServer};
use shoal_testkit::{GgmlType, GgufWriter, TinyModelSpec};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn writer(seed: u64) -> GgufWriter {
    let mut spec = TinyModelSpec::llama(seed);
    spec.n_layers = 2;
    spec.build().unwrap().gguf_writer(GgmlType::Q8_0).unwrap()
}

fn bytes(dir: &Path, seed: u64) -> Vec<u8> {
    let p = dir.join(format!("w{seed}.gguf"));
    writer(seed).write_to(&p).unwrap();
    fs::read(p).unwrap()
}

/// `shoal ARGS` with the hub at `hub`, the cache and home in `home`.
fn shoal(home: &Path, hub: &HubServer) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_shoal"));
    c.env("HF_ENDPOINT", hub.url())
        .env("HF_HUB_CACHE", home.join("hub"))
        .env("HOME", home)
        .env("SHOAL_HOME", home.join("shoal"))
        .env_remove("HF_TOKEN")
        .env_remove("HF_HOME");
    c
}

fn pull(home: &Path, hub: &HubServer, name: &str) -> Output {
    shoal(home, hub)
        .args(["models", "pull", name])
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn failed(o: &Output) -> String {
    assert!(!o.status.success(), "should fail: {o:?}");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn repo_dir(home: &Path, repo: &str) -> PathBuf {
    home.join("hub")
        .join(format!("models--{}", repo.replace('/', "--")))
}

fn sha(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// Greedy raw continuation of `model`.
fn answer(home: &Path, hub: &HubServer, model: &str) -> String {
    let o = shoal(home, hub)
        .args([
            "run",
            model,
            "hello world",
            "--raw",
            "--temp",
            "0",
            "-n",
            "12",
            "-t",
            "1",
        ])
        .output()
        .unwrap();
    ok(&o)
}

/// A repository with two quants of one model and a README.
fn two_quants(tmp: &Path) -> (HubRepo, Vec<u8>, Vec<u8>) {
    let q8 = bytes(tmp, 1);
    let f16 = bytes(tmp, 2);
    let repo = HubRepo {
        repo: "org/Tiny-GGUF".into(),
        commit: COMMIT.into(),
        files: vec![
            HubFile::new("README.md", b"# tiny".to_vec()),
            HubFile::new("Tiny-Q8_0.gguf", q8.clone()),
            HubFile::new("Tiny-F16.gguf", f16.clone()),
        ],
    };
    (repo, q8, f16)
}

#[test]
fn a_fresh_pull_lands_in_the_cache_layout_and_runs_by_its_name() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let (repo, q8, _) = two_quants(home);
    let hub = HubServer::start(vec![repo]);

    let o = pull(home, &hub, "hf:org/Tiny-GGUF:Q8_0");
    let out = ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    let dir = repo_dir(home, "org/Tiny-GGUF");
    let link = dir.join("snapshots").join(COMMIT).join("Tiny-Q8_0.gguf");
    assert_eq!(out.trim(), link.display().to_string());
    assert!(
        err.contains("Tiny-Q8_0.gguf") && err.contains("100%"),
        "{err}"
    );
    assert!(err.contains("shoal run hf:org/Tiny-GGUF:Q8_0"), "{err}");
    // the layout the hub's own tools use: blob by sha256, relative link, refs/main
    let blob = dir.join("blobs").join(sha(&q8));
    assert_eq!(fs::read(&blob).unwrap(), q8);
    assert_eq!(
        fs::read_link(&link).unwrap(),
        PathBuf::from("../../blobs").join(sha(&q8))
    );
    assert_eq!(fs::read_to_string(dir.join("refs/main")).unwrap(), COMMIT);
    assert!(!dir
        .join("snapshots")
        .join(COMMIT)
        .join("Tiny-F16.gguf")
        .exists());
    // one listing, one redirected download, nothing else
    let paths: Vec<String> = hub.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(paths.len(), 3, "{paths:?}");
    assert!(
        paths[0].starts_with("/api/models/org/Tiny-GGUF/revision/main"),
        "{paths:?}"
    );
    assert_eq!(hub.downloads("Tiny-Q8_0.gguf"), [None]);

    // it runs by the name it was pulled by, as the file itself does
    let by_name = answer(home, &hub, "hf:org/Tiny-GGUF:Q8_0");
    assert_eq!(by_name, answer(home, &hub, link.to_str().unwrap()));
    assert!(!by_name.is_empty());
    // listed under the Hugging Face store
    let list = ok(&shoal(home, &hub).args(["models", "list"]).output().unwrap());
    assert!(
        list.lines()
            .any(|l| l.starts_with("hf ") && l.contains("hf:org/Tiny-GGUF:Q8_0")),
        "{list}"
    );

    // pulled again: nothing downloads
    let o = pull(home, &hub, "hf:org/Tiny-GGUF:q8_0");
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains("already in the cache"));
    assert_eq!(hub.downloads("Tiny-Q8_0.gguf").len(), 1);
}

#[test]
fn a_cut_download_resumes_within_the_run_from_where_it_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let (repo, q8, _) = two_quants(home);
    let hub = HubServer::start(vec![repo]);
    let cut = q8.len() / 3;
    hub.fault("Tiny-Q8_0.gguf", Fault::CutAfter(cut));

    let o = pull(home, &hub, "hf:org/Tiny-GGUF:Q8_0");
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("resuming"), "{err}");
    assert_eq!(
        hub.downloads("Tiny-Q8_0.gguf"),
        [None, Some(format!("bytes={cut}-"))]
    );
    let blob = repo_dir(home, "org/Tiny-GGUF").join("blobs").join(sha(&q8));
    assert_eq!(fs::read(blob).unwrap(), q8);
}

#[test]
fn a_range_answered_from_the_wrong_offset_starts_over() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let (repo, q8, _) = two_quants(home);
    let hub = HubServer::start(vec![repo]);
    let cut = q8.len() / 4;
    hub.fault("Tiny-Q8_0.gguf", Fault::CutAfter(cut));
    hub.fault("Tiny-Q8_0.gguf", Fault::WrongRange);

    let o = pull(home, &hub, "hf:org/Tiny-GGUF:Q8_0");
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("starting over"), "{err}");
    assert_eq!(
        hub.downloads("Tiny-Q8_0.gguf"),
        [None, Some(format!("bytes={cut}-")), None]
    );
    let blob = repo_dir(home, "org/Tiny-GGUF").join("blobs").join(sha(&q8));
    assert_eq!(fs::read(blob).unwrap(), q8);
}

#[test]
fn a_pull_killed_part_way_resumes_when_run_again() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let (repo, q8, _) = two_quants(home);
    let hub = HubServer::start(vec![repo]);
    let half = q8.len() / 2;
    hub.fault("Tiny-Q8_0.gguf", Fault::StallAfter(half));

    let mut child = shoal(home, &hub)
        .args(["models", "pull", "hf:org/Tiny-GGUF:Q8_0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let part = repo_dir(home, "org/Tiny-GGUF")
        .join("blobs")
        .join(format!("{}.incomplete", sha(&q8)));
    let t0 = Instant::now();
    while fs::metadata(&part).map(|m| m.len()).unwrap_or(0) < half as u64 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the download never got half way"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "pull ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    hub.release();
    assert_eq!(fs::metadata(&part).unwrap().len(), half as u64);

    ok(&pull(home, &hub, "hf:org/Tiny-GGUF:Q8_0"));
    assert_eq!(
        hub.downloads("Tiny-Q8_0.gguf"),
        [None, Some(format!("bytes={half}-"))]
    );
    assert!(!part.exists());
    let link = repo_dir(home, "org/Tiny-GGUF")
        .join("snapshots")
        .join(COMMIT)
        .join("Tiny-Q8_0.gguf");
    assert_eq!(fs::read(link).unwrap(), q8);
}

#[test]
fn a_wrong_checksum_is_refused_and_nothing_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let (mut repo, q8, _) = two_quants(home);
    let wrong = sha(b"another file");
    repo.files[1].listed_sha256 = Some(wrong.clone());
    let hub = HubServer::start(vec![repo]);

    let e = failed(&pull(home, &hub, "hf:org/Tiny-GGUF:Q8_0"));
    assert!(
        e.contains(&sha(&q8)) && e.contains(&wrong) && e.contains("deleted"),
        "{e}"
    );
    let dir = repo_dir(home, "org/Tiny-GGUF");
    let left: Vec<_> = fs::read_dir(dir.join("blobs")).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(!dir
        .join("snapshots")
        .join(COMMIT)
        .join("Tiny-Q8_0.gguf")
        .exists());
    // and it does not load by its name
    let o = shoal(home, &hub)
        .args(["run", "hf:org/Tiny-GGUF:Q8_0", "hi", "-n", "1"])
        .output()
        .unwrap();
    assert!(failed(&o).contains("shoal models pull"));
}

#[test]
fn missing_parts_files_repositories_and_quants_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let (mut repo, _, _) = two_quants(home);
    repo.files[2].served = false; // F16: listed, but 404 to download
    let set_dir = home.join("set");
    fs::create_dir(&set_dir).unwrap();
    let parts = writer(3).write_split(&set_dir, "Big-Q8_0", 3).unwrap();
    let broken = HubRepo {
        repo: "org/Big-GGUF".into(),
        commit: COMMIT.into(),
        files: [0, 2]
            .iter()
            .map(|&i| {
                let p = &parts[i];
                HubFile::new(
                    p.file_name().unwrap().to_str().unwrap(),
                    fs::read(p).unwrap(),
                )
            })
            .collect(),
    };
    let hub = HubServer::start(vec![repo, broken]);

    let e = failed(&pull(home, &hub, "hf:org/Big-GGUF:Q8_0"));
    assert!(
        e.contains("lacks part(s) Big-Q8_0-00002-of-00003.gguf"),
        "{e}"
    );
    let e = failed(&pull(home, &hub, "hf:org/Tiny-GGUF:F16"));
    assert!(
        e.contains("no file Tiny-F16.gguf") && e.contains("404"),
        "{e}"
    );
    let e = failed(&pull(home, &hub, "hf:org/Nothing-GGUF:Q8_0"));
    assert!(e.contains("no repository org/Nothing-GGUF"), "{e}");
    let e = failed(&pull(home, &hub, "hf:org/Tiny-GGUF:Q2_K"));
    assert!(
        e.contains("no GGUF file matches quant tag `Q2_K`") && e.contains("Q8_0 (Tiny-Q8_0.gguf)"),
        "{e}"
    );
    let e = failed(&pull(home, &hub, "hf:org/Tiny-GGUF"));
    assert!(e.contains("name one with its quant tag"), "{e}");
    let e = failed(&pull(home, &hub, "org/Tiny-GGUF"));
    assert!(e.contains("hf:ORG/REPO"), "{e}");
    // no hub named: refused, naming the setting
    let o = shoal(home, &hub)
        .env_remove("HF_ENDPOINT")
        .args(["models", "pull", "hf:org/Tiny-GGUF:Q8_0"])
        .output()
        .unwrap();
    assert!(failed(&o).contains("set HF_ENDPOINT"));
    // --hub names it instead
    let o = shoal(home, &hub)
        .env_remove("HF_ENDPOINT")
        .args([
            "models",
            "pull",
            "hf:org/Tiny-GGUF:Q8_0",
            "--hub",
            &hub.url(),
        ])
        .output()
        .unwrap();
    ok(&o);
}

#[test]
fn a_split_set_pulls_whole_and_runs_as_one_model() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path();
    let w = writer(4);
    let single = home.join("single.gguf");
    w.write_to(&single).unwrap();
    let set_dir = home.join("set");
    fs::create_dir(&set_dir).unwrap();
    let parts = w.write_split(&set_dir, "Big-Q8_0", 3).unwrap();
    let mut files: Vec<HubFile> = parts
        .iter()
        .map(|p| {
            HubFile::new(
                &format!("Q8_0/{}", p.file_name().unwrap().to_str().unwrap()),
                fs::read(p).unwrap(),
            )
        })
        .collect();
    files.push(HubFile::new("Big-F16.gguf", bytes(home, 5)));
    let hub = HubServer::start(vec![HubRepo {
        repo: "org/Big-GGUF".into(),
        commit: COMMIT.into(),
        files,
    }]);
    // a cut in the middle part is resumed too
    hub.fault("Q8_0/Big-Q8_0-00002-of-00003.gguf", Fault::CutAfter(100));

    let out = ok(&pull(home, &hub, "hf:org/Big-GGUF:Q8_0"));
    let snap = repo_dir(home, "org/Big-GGUF")
        .join("snapshots")
        .join(COMMIT);
    assert_eq!(
        out.trim(),
        snap.join("Q8_0/Big-Q8_0-00001-of-00003.gguf")
            .display()
            .to_string()
    );
    for p in &parts {
        let name = p.file_name().unwrap().to_str().unwrap();
        let linked = snap.join("Q8_0").join(name);
        assert_eq!(fs::read(&linked).unwrap(), fs::read(p).unwrap(), "{name}");
        // one folder deeper, one more step up to the blobs
        assert!(fs::read_link(&linked)
            .unwrap()
            .starts_with("../../../blobs"));
    }
    assert_eq!(
        hub.downloads("Q8_0/Big-Q8_0-00002-of-00003.gguf"),
        [None, Some("bytes=100-".to_string())]
    );
    assert!(!snap.join("Big-F16.gguf").exists());
    assert_eq!(
        answer(home, &hub, "hf:org/Big-GGUF:Q8_0"),
        answer(home, &hub, single.to_str().unwrap())
    );
}
