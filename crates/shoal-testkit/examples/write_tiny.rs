//! Writes the default tiny models to a folder, for looking at them by hand or feeding them to
//! other tools (llama.cpp, Python): `cargo run -p shoal-testkit --example write_tiny -- DIR`.
//!
//! For each architecture and GGUF type T in F32, Q8_0, Q4_0 it writes `{arch}-{t}.gguf` and
//! the matching HF folder `{arch}-{t}-hf/` (F32 safetensors holding the same values).

use shoal_testkit::{GgmlType, SafetensorsDtype, TinyModelSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: write_tiny OUT_DIR")?;
    let dir = std::path::Path::new(&dir);
    std::fs::create_dir_all(dir)?;
    for base in [
        TinyModelSpec::llama(1),
        TinyModelSpec::qwen2(1),
        TinyModelSpec::gemma3(1),
    ] {
        for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_0] {
            let model = base.clone().snapped_to(ty).build()?;
            let stem = format!("{}-{}", base.arch.gguf_name(), ty.name());
            model.write_gguf(dir.join(format!("{stem}.gguf")), ty)?;
            model.write_safetensors_dir(dir.join(format!("{stem}-hf")), SafetensorsDtype::F32)?;
            println!("{}", dir.join(stem).display());
        }
    }
    Ok(())
}
