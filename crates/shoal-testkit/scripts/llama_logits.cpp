#include "llama.h"
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
// Prints, as one JSON line, what llama.cpp makes of a GGUF file: the ids of TEXT (no BOS,
// specials parsed), EOS/BOS ids, and the logits of the last position (F32 KV cache, no flash
// attention, one thread, so F32 weights give logits within ~1e-6 of the reference).
// Build against a llama.cpp build tree (SRC = source, BIN = folder holding libllama.so):
//   g++ -O1 -std=c++17 llama_logits.cpp -I$SRC/include -I$SRC/ggml/include -L$BIN \
//       -lllama -lggml -lggml-base -Wl,-rpath,$BIN -o llama_logits
// Usage: llama_logits MODEL.gguf TEXT
// The test `llama_cpp_agrees_with_reference` runs it when SHOAL_LLAMA_LOGITS_BIN names it.
int main(int argc, char ** argv) {
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::string text = argv[2];
    int n = -llama_tokenize(vocab, text.c_str(), text.size(), NULL, 0, false, true);
    std::vector<llama_token> toks(n);
    llama_tokenize(vocab, text.c_str(), text.size(), toks.data(), n, false, true);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_threads = 1; cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32; cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "ctx failed\n"); return 1; }
    llama_batch b = llama_batch_get_one(toks.data(), n);
    if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
    const float * logits = llama_get_logits_ith(ctx, -1);
    int nv = llama_vocab_n_tokens(vocab);
    printf("{\"ids\":[");
    for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", toks[i]);
    printf("],\"n_vocab\":%d,\"eos\":%d,\"bos\":%d,\"logits\":[", nv, llama_vocab_eos(vocab), llama_vocab_bos(vocab));
    for (int i = 0; i < nv; i++) printf("%s%.9g", i ? "," : "", logits[i]);
    printf("]");
    const char * tmpl = llama_model_chat_template(model, NULL);
    llama_chat_message msgs[1] = {{"user", "hi"}};
    char buf[1024];
    int r = llama_chat_apply_template(tmpl, msgs, 1, true, buf, sizeof buf);
    printf(",\"chat\":\"");
    for (int i = 0; i < r && i < (int) sizeof buf; i++) {
        if (buf[i] == '\n') printf("\\n"); else if (buf[i] == '"' || buf[i] == '\\') printf("\\%c", buf[i]); else putchar(buf[i]);
    }
    printf("\"}\n");
    llama_free(ctx); llama_model_free(model);
    return 0;
}
