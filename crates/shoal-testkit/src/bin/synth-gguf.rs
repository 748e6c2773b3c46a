//! Writes a synthetic mixture-of-experts GGUF file: a real model's shapes and a Q4_K_M-like
//! mix with random weights, for speed benchmarks only (the text it generates is
//! meaningless). See `shoal_testkit::synth`.
//!
//! ```text
//! synth-gguf SHAPE OUT.gguf     write SHAPE to OUT.gguf (through OUT.gguf.tmp)
//! synth-gguf --list             the shapes, their file sizes and bytes read per token
//! synth-gguf --info SHAPE       SHAPE's tensor mix, without writing
//! synth-gguf --canonical SHAPE  the shape's name (resolving aliases)
//! ```

use std::process::ExitCode;
use std::time::Instant;

use shoal_testkit::synth::{shape, shapes, Shape, SynthPlan};

const USAGE: &str = "usage: synth-gguf SHAPE OUT.gguf | --list | --info SHAPE | --canonical SHAPE";

fn find(name: &str) -> Result<Shape, String> {
    shape(name).ok_or_else(|| {
        let names: Vec<&str> = shapes().iter().map(|s| s.name).collect();
        format!("unknown shape `{name}` (shapes: {})", names.join(", "))
    })
}

fn plan(s: &Shape) -> Result<SynthPlan, String> {
    SynthPlan::new(s).map_err(|e| e.to_string())
}

fn summary(p: &SynthPlan) -> String {
    format!(
        "{}: {} ({} of {} layers), {:.2} GB, {:.1} MB read per token",
        p.shape.name,
        p.shape.arch.gguf_name(),
        p.shape.n_layer,
        p.shape.model_layers,
        p.total_len as f64 / 1e9,
        p.active_bytes_per_token() as f64 / 1e6
    )
}

fn run(args: &[String]) -> Result<(), String> {
    match args {
        [flag] if flag == "--list" => {
            for s in shapes() {
                let aka = if s.aliases.is_empty() {
                    String::new()
                } else {
                    format!(" (alias {})", s.aliases.join(", "))
                };
                println!("{}{aka}; model {}", summary(&plan(&s)?), s.model);
            }
            Ok(())
        }
        [flag, name] if flag == "--canonical" => {
            println!("{}", find(name)?.name);
            Ok(())
        }
        [flag, name] if flag == "--info" => {
            let p = plan(&find(name)?)?;
            println!("{}", summary(&p));
            println!("{}", p.shape.general_name());
            for (ty, (n, bytes)) in p.bytes_by_type() {
                println!("  {:<5} {n:>5} tensors {:>14} bytes", ty.name(), bytes);
            }
            let routed = if p.shape.experts.count == 0 {
                "every block tensor".to_string()
            } else {
                format!(
                    "blocks with routed experts at {}/{}",
                    p.shape.experts.used, p.shape.experts.count
                )
            };
            println!(
                "  active bytes per token: {} ({routed}, plus output)",
                p.active_bytes_per_token()
            );
            for line in p.mix_lines() {
                println!("  {line}");
            }
            Ok(())
        }
        [name, out] if !name.starts_with('-') => {
            let p = plan(&find(name)?)?;
            eprintln!("{}", summary(&p));
            eprintln!("writing {out} (through {out}.tmp)");
            let start = Instant::now();
            let mut next = 0.1;
            p.write(out, |done, total| {
                let f = done as f64 / total as f64;
                if f >= next || done == total {
                    eprintln!(
                        "  {:5.1}%  {:.2} GB  {:.0} s",
                        100.0 * f,
                        done as f64 / 1e9,
                        start.elapsed().as_secs_f64()
                    );
                    while next <= f {
                        next += 0.1;
                    }
                }
            })
            .map_err(|e| e.to_string())?;
            let secs = start.elapsed().as_secs_f64();
            eprintln!(
                "wrote {out}: {} bytes in {secs:.1} s ({:.0} MB/s); {} weight bytes per token",
                p.total_len,
                p.total_len as f64 / 1e6 / secs,
                p.active_bytes_per_token()
            );
            Ok(())
        }
        _ => Err(USAGE.to_string()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("synth-gguf: {e}");
            ExitCode::from(2)
        }
    }
}
