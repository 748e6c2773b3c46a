// Greedy reference tokens from llama.cpp, for shoal's token-exactness tests.
//
// For each prompt: tokenizes it the way `shoal run --raw` does (BOS when the model asks
// for it, special tokens not parsed), greedily decodes N tokens, and prints one JSON line
// with the prompt ids, the generated ids, and at every step the two best logits (to show a
// divergence is a near-tie). Built and run by bench/golden.sh; not part of CI.
//
//   llamacpp-golden MODEL.gguf N "prompt one" "prompt two" ...
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

static void json_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c == '\n') printf("\\n");
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N PROMPT...\n", argv[0]);
        return 2;
    }
    int n_gen = atoi(argv[2]);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);
    for (int p = 3; p < argc; p++) {
        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 1024;
        cp.n_batch = 1024;
        cp.n_threads = 1;
        cp.n_threads_batch = 1;
        if (getenv("GOLDEN_KV_F32")) { cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32; }
        if (getenv("GOLDEN_NO_FA")) cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        struct llama_context *ctx = llama_init_from_model(model, cp);
        llama_token toks[1024];
        int n = llama_tokenize(vocab, argv[p], (int)strlen(argv[p]), toks, 1024, true, getenv("GOLDEN_PARSE_SPECIAL") != NULL);
        if (n < 0) { fprintf(stderr, "prompt too long\n"); return 1; }
        printf("{\"prompt\":");
        json_string(argv[p]);
        printf(",\"prompt_ids\":[");
        for (int i = 0; i < n; i++) printf(i ? ",%d" : "%d", toks[i]);
        printf("],\"ids\":[");
        struct llama_batch batch = llama_batch_get_one(toks, n);
        char top2[64 * 1024];
        size_t off = 0;
        top2[0] = 0;
        for (int step = 0; step < n_gen; step++) {
            if (llama_decode(ctx, batch)) { fprintf(stderr, "decode failed\n"); return 1; }
            const float *logits = llama_get_logits_ith(ctx, -1);
            int b1 = 0, b2 = -1;
            for (int i = 1; i < n_vocab; i++) {
                if (logits[i] > logits[b1]) { b2 = b1; b1 = i; }
                else if (b2 < 0 || logits[i] > logits[b2]) b2 = i;
            }
            printf(step ? ",%d" : "%d", b1);
            if (off < sizeof(top2) - 128)
                off += snprintf(top2 + off, sizeof(top2) - off, "%s[%d,%.5f,%d,%.5f]", step ? "," : "", b1, logits[b1], b2, logits[b2]);
            static llama_token next;
            next = b1;
            batch = llama_batch_get_one(&next, 1);
        }
        printf("],\"top2\":[%s]}\n", top2);
        fflush(stdout);
        llama_free(ctx);
    }
    llama_model_free(model);
    return 0;
}
