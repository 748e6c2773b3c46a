//! Times building the tokenizer of a GGUF file and encoding a long text with it.
use shoal_model::gguf::GgufFile;
use shoal_model::tokenizer::Tokenizer;

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: tok_bench MODEL.gguf [TEXT_FILE]");
    let t0 = std::time::Instant::now();
    let file = GgufFile::open(&path).expect("open");
    let t1 = std::time::Instant::now();
    let tok = Tokenizer::from_gguf(file.metadata()).expect("tokenizer");
    let t2 = std::time::Instant::now();
    println!("open {:?}, build {:?} ({})", t1 - t0, t2 - t1, tok.kind());
    let text = match std::env::args().nth(2) {
        Some(p) => std::fs::read_to_string(p).expect("read text"),
        None => "The quick brown fox jumps over the lazy dog. fn main() { println!(\"hi\"); }\n"
            .repeat(400),
    };
    let t3 = std::time::Instant::now();
    let ids = tok.encode(&text, true, true).expect("encode");
    let t4 = std::time::Instant::now();
    println!(
        "encode {} bytes -> {} tokens in {:?}",
        text.len(),
        ids.len(),
        t4 - t3
    );
    let long_word = "a".repeat(20000);
    let t5 = std::time::Instant::now();
    let n = tok.encode(&long_word, false, false).expect("encode").len();
    println!("20000-char word -> {n} tokens in {:?}", t5.elapsed());
}
