//! `shoal bench MODEL --json` end to end on a tiny model the test kit writes as GGUF: the
//! report holds a bandwidth probe per decode repetition, the weight bytes per token and the
//! ceiling are those of the tiny model's file (counted by hand below), each repetition's
//! fraction of the ceiling is its decode rate against the ceiling of one probe of its own,
//! and the host's steal time, where there is one, is a fraction; with `--profile`, each
//! matrix product's bandwidth times its time is that product's bytes in the file, and the
//! profile's times add up to the decode time the decode rates give.

use std::path::Path;
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

/// Weight bytes a token of the tiny Q8_0 llama reads, counted by hand from its shapes
/// (hidden 64, 4 heads and 2 KV heads of 16, FFN 128, vocab 320, 2 layers, untied head).
/// Q8_0 stores 32 weights in 34 bytes (an f16 scale and 32 signed bytes); 1-D norms are F32.
/// Per layer: q 64x64 = 4352 B, k and v 32x64 = 2176 B each (q/k/v 8704 B), attn out
/// 64x64 = 4352 B, gate and up 128x64 = 8704 B each (17408 B), down 64x128 = 8704 B.
const QKV_BYTES: f64 = 2.0 * 8704.0;
const ATTN_OUT_BYTES: f64 = 2.0 * 4352.0;
const GATE_UP_BYTES: f64 = 2.0 * 17408.0;
const DOWN_BYTES: f64 = 2.0 * 8704.0;
/// The output head, 320x64 in Q8_0.
const HEAD_BYTES: f64 = 21760.0;
/// Every block tensor (the products above and the two 64-float norms of each layer, 512 B)
/// plus the head; the embedding row and the final norm are not counted.
const TOKEN_BYTES: f64 =
    QKV_BYTES + ATTN_OUT_BYTES + GATE_UP_BYTES + DOWN_BYTES + 2.0 * 512.0 + HEAD_BYTES;

/// Whether `a` and `b` agree to a relative 1e-9 (float rounding, not approximation).
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
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

    // the bytes are the file's, counted by hand, and the ceiling is the median probe's
    assert_eq!(
        report["weight_bytes_per_token"].as_f64().unwrap(),
        TOKEN_BYTES,
        "{report}"
    );
    let bw = report["mem_read_gb_s"].as_f64().unwrap();
    let ceiling = report["decode_ceiling_tok_s"].as_f64().unwrap();
    assert!(close(ceiling, bw * 1e9 / TOKEN_BYTES), "ceiling {ceiling}");

    // each repetition against its own probe: the ceiling scales with the probe, so a rate
    // paired with probe p is a fraction rate / (ceiling * p / median). The report gives the
    // three rates (min, median, max) but not their order, so the three fractions must be
    // some one-to-one pairing of rates with probes; set against the median or mean probe,
    // or against the wrong bytes, they are none
    let decode = &report["decode"];
    let rates = ["min", "median", "max"].map(|k| decode[k].as_f64().unwrap());
    let frac = &report["decode_fraction_of_ceiling"];
    let fractions = ["min", "median", "max"].map(|k| frac[k].as_f64().unwrap());
    let pairings = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    let paired = pairings.iter().any(|rate_of_probe| {
        let mut want: Vec<f64> = (0..3)
            .map(|i| rates[rate_of_probe[i]] / (ceiling * probes[i] / bw))
            .collect();
        want.sort_by(f64::total_cmp);
        want.iter().zip(&fractions).all(|(w, f)| close(*w, *f))
    });
    assert!(
        paired,
        "fractions {frac} are no pairing of rates {rates:?} with probes {probes:?}"
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
    // each product's bandwidth times its time per token is its weights' bytes in the file
    let products = [
        ("q/k/v matmul", QKV_BYTES),
        ("attn out matmul", ATTN_OUT_BYTES),
        ("gate/up matmul", GATE_UP_BYTES),
        ("down matmul", DOWN_BYTES),
        ("output head", HEAD_BYTES),
    ];
    let mut seen = 0;
    let mut total_ms = 0.0;
    for op in ops {
        let name = op["op"].as_str().unwrap();
        let ms = op["ms_per_token"].as_f64().unwrap();
        total_ms += ms;
        let gb_s = op["weight_gb_s"].as_f64();
        match products.iter().find(|(p, _)| *p == name) {
            Some((_, bytes)) => {
                seen += 1;
                let gb_s = gb_s.unwrap_or_else(|| panic!("{name} has no bandwidth: {op}"));
                let read = gb_s * 1e9 * ms / 1e3;
                assert!(
                    close(read, *bytes),
                    "{name}: {read} bytes, not {bytes}: {op}"
                );
            }
            None => assert!(gb_s.is_none(), "{name} reads no weights: {op}"),
        }
    }
    assert_eq!(seen, products.len(), "{ops:?}");
    // the times per token (the rest line included) add up to the decode time, which the two
    // repetitions' rates give: 16 tokens at each rate, over the 32 tokens decoded
    let decode = &report["decode"];
    let (slow, fast) = (
        decode["min"].as_f64().unwrap(),
        decode["max"].as_f64().unwrap(),
    );
    let decode_ms = (16.0 / slow + 16.0 / fast) * 1e3 / 32.0;
    assert!(
        close(total_ms, decode_ms),
        "profile {total_ms} ms per token, decode {decode_ms}"
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
    let kv = |r: &serde_json::Value| r["kv_read_bytes_per_token"].as_f64().unwrap();
    // a position takes 128 bytes in each of the two layers
    assert_eq!(shallow["kv_bytes_per_token"], 256, "{shallow}");
    // a position holds, per layer, f16 keys and values of 2 KV heads of 16: 128 bytes, 256
    // over the two layers; 3.5 positions on average without depth, 23.5 with
    assert_eq!(kv(&shallow), 256.0 * 3.5, "{shallow}");
    assert_eq!(kv(&deep), 256.0 * 23.5, "{deep}");
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

/// `--calibrate` stores this node's measured costs of the tiny model's shape, and a cluster
/// file naming them makes `shoal plan` predict the one-node decode and prefill from them:
/// at the bandwidth probed beside the measurement, a one-position context and the measured
/// prompt length, the predictions are the rates the measurement ran at (the costs add up to
/// its times; the decode adds the KV cache of one position). A missing calibration file is
/// refused, naming it.
#[test]
fn a_calibration_is_stored_and_the_planner_predicts_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    TinyModelSpec::llama(5)
        .build()
        .unwrap()
        .write_gguf(&model, GgmlType::Q8_0)
        .unwrap();
    let home = dir.path().join("home");
    let shoal = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_shoal"));
        c.env("SHOAL_HOME", &home);
        c
    };
    let out = shoal()
        .arg("bench")
        .arg(&model)
        .args([
            "-p",
            "0",
            "-n",
            "16",
            "-r",
            "2",
            "-t",
            "1",
            "--calibrate",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cal = &report["calibration"];
    let file = report["calibration_file"].as_str().expect("a stored file");
    assert!(
        Path::new(file).starts_with(home.join("calibrations")),
        "{file}"
    );
    let stored: serde_json::Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
    assert_eq!(&stored, cal);
    assert!(cal["dense"]["weights_gbs"].as_f64().unwrap() > 0.0, "{cal}");
    assert!(
        cal["moe"].is_null(),
        "a dense model has no expert layers: {cal}"
    );

    let plan = |calibrations: &str| {
        let cluster = dir.path().join("cluster.toml");
        std::fs::write(
            &cluster,
            format!(
                "[[node]]\nname = \"a\"\nmemory_gb = 8\nmem_bandwidth_gbs = {}\n\
                 compute_gflops = 100\n{calibrations}\n",
                cal["mem_bandwidth_gbs"]
            ),
        )
        .unwrap();
        shoal()
            .arg("plan")
            .arg(&model)
            .arg("--cluster")
            .arg(&cluster)
            .args(["--ctx", "1", "--json", "--top", "0", "--prompt-tokens"])
            .arg(cal["measured_prefill_rows"].to_string())
            .output()
            .unwrap()
    };
    let out = plan(&format!("calibrations = [{:?}]", file));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let one = &rows[0];
    assert_eq!(one["calibrated"], true, "{one}");
    let (predicted, measured) = (
        one["decode_tok_s"].as_f64().unwrap(),
        cal["measured_tok_s"].as_f64().unwrap(),
    );
    assert!(
        (predicted / measured - 1.0).abs() < 0.02,
        "predicted {predicted} tok/s from the costs of a run at {measured}"
    );
    // and the prefill of the measured prompt length: what the measurement's prefill took
    let (predicted, measured) = (
        one["prefill_tok_s"].as_f64().unwrap(),
        cal["measured_prefill_tok_s"].as_f64().unwrap(),
    );
    assert!(
        (predicted / measured - 1.0).abs() < 1e-6,
        "predicted {predicted} tok/s prefill from the costs of a run at {measured}"
    );

    let rows: serde_json::Value = serde_json::from_slice(&plan("").stdout).unwrap();
    assert_eq!(rows[0]["calibrated"], false, "{}", rows[0]);

    let missing = dir.path().join("missing.json");
    let out = plan(&format!(
        "calibrations = [{:?}]",
        missing.display().to_string()
    ));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("missing.json") && err.contains("calibrations"),
        "{err}"
    );
}
