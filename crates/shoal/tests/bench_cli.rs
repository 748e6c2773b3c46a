//! `shoal bench MODEL --json` end to end on a tiny model the test kit writes as GGUF: the
//! report holds a bandwidth probe per decode repetition, each repetition's fraction of its
//! own ceiling agrees with the decode rate and that probe, and the host's steal time, where
//! there is one, is a fraction; with `--profile`, each matrix product carries the bandwidth
//! its weights were read at, and together they account for the token's weights.

use std::process::Command;

use shoal_testkit::{GgmlType, TinyModelSpec};

/// `shoal bench --json` with `args` on a tiny Q8_0 llama (weights from `seed`): the run's
/// output, whatever its status.
fn bench_output(seed: u64, args: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    TinyModelSpec::llama(seed)
        .build()
        .unwrap()
        .write_gguf(&model, GgmlType::Q8_0)
        .unwrap();
    Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("bench")
        .arg(&model)
        .args(args)
        .arg("--json")
        .output()
        .unwrap()
}

/// [`bench_output`] of a run that must succeed: the report.
fn bench_report(seed: u64, args: &[&str]) -> serde_json::Value {
    let out = bench_output(seed, args);
    assert!(
        out.status.success(),
        "shoal bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn bench_probes_after_every_decode_repetition() {
    let report = bench_report(5, &["-p", "8", "-n", "8", "-r", "3", "-t", "1"]);
    let probes: Vec<f64> = report["mem_read_gb_s_probes"]
        .as_array()
        .expect("a list of probes")
        .iter()
        .map(|p| p.as_f64().unwrap())
        .collect();
    assert_eq!(probes.len(), 3, "one probe per repetition: {report}");
    assert!(probes.iter().all(|&p| p > 0.0), "{probes:?}");
    let mut sorted = probes.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(
        report["mem_read_gb_s"].as_f64().unwrap(),
        sorted[1],
        "the median"
    );

    // every repetition against its own probe: the spread brackets decode / ceiling
    let bytes = report["weight_bytes_per_token"].as_f64().unwrap();
    let decode = &report["decode"];
    let frac = &report["decode_fraction_of_ceiling"];
    let (lo, mid, hi) = (
        frac["min"].as_f64().unwrap(),
        frac["median"].as_f64().unwrap(),
        frac["max"].as_f64().unwrap(),
    );
    assert!(0.0 < lo && lo <= mid && mid <= hi, "{frac}");
    let slowest = decode["min"].as_f64().unwrap() * bytes / (sorted[2] * 1e9);
    let fastest = decode["max"].as_f64().unwrap() * bytes / (sorted[0] * 1e9);
    assert!(
        slowest <= lo * (1.0 + 1e-9) && hi <= fastest * (1.0 + 1e-9),
        "fractions {frac} outside [{slowest}, {fastest}]"
    );

    // absent without /proc/stat, or when the decodes took less than a clock tick
    if let Some(s) = report["host_steal"].as_f64() {
        assert!((0.0..=1.0).contains(&s), "steal {s}");
    }
}

#[test]
fn profile_gives_each_matrix_product_its_weight_bandwidth() {
    let report = bench_report(
        7,
        &["-p", "0", "-n", "16", "-r", "2", "-t", "1", "--profile"],
    );
    let ops = report["decode_profile"].as_array().expect("a profile");
    let products = [
        "q/k/v matmul",
        "attn out matmul",
        "gate/up matmul",
        "down matmul",
        "output head",
    ];
    let mut read = 0.0;
    for op in ops {
        let name = op["op"].as_str().unwrap();
        let gb_s = op["weight_gb_s"].as_f64();
        if products.contains(&name) {
            let gb_s = gb_s.unwrap_or_else(|| panic!("{name} has no bandwidth: {op}"));
            assert!(gb_s > 0.0, "{op}");
            read += gb_s * 1e9 * op["ms_per_token"].as_f64().unwrap() / 1e3;
        } else {
            assert!(gb_s.is_none(), "{name} reads no weights: {op}");
        }
    }
    // the products read every weight of a token but the norms and the embedding row
    let bytes = report["weight_bytes_per_token"].as_f64().unwrap();
    assert!(
        read <= bytes * 1.001 && read >= 0.8 * bytes,
        "{read} of {bytes} bytes attributed"
    );
}

/// `-d` fills the cache before every run: each decoding sequence ends at `depth + n_gen`
/// positions, and the KV bytes read per token grow by one position's bytes per token of
/// depth (the average decode step at depth `d` reads `d + (n + 1) / 2` positions).
#[test]
fn depth_fills_the_cache_before_each_run() {
    let args = |d: &'static str| ["-p", "4", "-n", "6", "-d", d, "-r", "2", "-t", "1"];
    let shallow = bench_report(3, &args("0"));
    let deep = bench_report(3, &args("20"));
    assert_eq!(shallow["depth"], 0);
    assert_eq!(deep["depth"], 20);
    assert_eq!(shallow["decode_end_position"], 6, "{shallow}");
    assert_eq!(deep["decode_end_position"], 26, "{deep}");
    assert!(deep["prefill_tok_s"].as_f64().unwrap() > 0.0);
    assert!(deep["decode_tok_s"].as_f64().unwrap() > 0.0);
    let kv = |r: &serde_json::Value| r["kv_bytes_per_token"].as_f64().unwrap();
    // 3.5 positions on average without depth, 23.5 with
    let per_position = kv(&shallow) / 3.5;
    assert!(
        per_position > 0.0 && per_position.fract() == 0.0,
        "{shallow}"
    );
    assert_eq!(kv(&deep), per_position * 23.5, "{deep}");
    // batched decode fills every sequence's cache
    let batched = bench_report(
        3,
        &["-p", "0", "-n", "6", "-d", "20", "--seqs", "3", "-r", "1"],
    );
    assert_eq!(batched["decode_end_position"], 26, "{batched}");
}

/// A depth the model's context cannot hold is refused up front, with the numbers.
#[test]
fn depth_past_the_context_is_refused() {
    let out = bench_output(3, &["-p", "4", "-n", "4", "-d", "1000000", "-r", "1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-d 1000000") && err.contains("context of"),
        "{err}"
    );
}
