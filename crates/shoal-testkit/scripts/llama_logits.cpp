// Teacher-forced oracle: what llama.cpp computes for a GGUF file, as one JSON line.
//
// Usage:
//   llama_logits MODEL.gguf [--text TEXT | --raw-text TEXT | --tokens 1,2,3] [--generate N]
//                [--top K] [--all-logits] [--kv-f16]
//
// The prompt is TEXT tokenized by the model's vocabulary (no BOS added, special tokens such
// as <|im_end|> parsed), TEXT of --raw-text tokenized as `shoal run --raw` does (a BOS where
// the model asks for one, special tokens taken literally), or the comma-separated ids of
// --tokens. The whole prompt is decoded
// as one batch with logits requested at every position; then N more tokens (default 0) are
// generated greedily (argmax, the lowest id on an exact tie), one decode each. Everything
// runs with an F32 KV cache (F16 with --kv-f16, llama.cpp's default and shoal's cache type),
// flash attention disabled and one thread, so F32 weights give logits within rounding of an
// exact forward pass.
//
// Output, one line of JSON:
//   ids           the prompt's ids
//   generated     the N greedy ids
//   n_vocab, eos, bos
//   chat          the model's chat template applied to one user message "hi" with the
//                 assistant prefix (null when the model has no template)
//   steps         N+1 entries: the logits after the last prompt token, then after each
//                 generated token; each is the top K (default 8) as [[id, logit], ...], best
//                 first (ties: lower id first)
//   prompt_steps  the same top K at every prompt position (entry i: after prompt token i)
//   logits        with --all-logits only: the full logit rows of `steps`
// Floats are printed with %.9g (exact for f32); a non-finite logit is printed as null.
//
//   llama_logits --split REGEX
//
// runs llama.cpp's pre-tokenizer split for REGEX (the first of a `tokenizer.ggml.pre`
// value's expressions, which selects llama.cpp's own scanner where it has one) over each
// NUL-terminated text on stdin, without the byte encoding, and prints one line per text:
// its words, each as lowercase hex of its UTF-8 bytes, separated by spaces.
//
// scripts/build-llama-oracle.sh builds it against a minimal CPU-only llama.cpp; the test
// kit's oracle module (crates/shoal-testkit/src/oracle.rs) runs it and parses the line.
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// llama.cpp's pre-tokenizer (src/unicode.h, exported by the library, not in its API)
std::vector<std::string> unicode_regex_split(const std::string & text,
                                             const std::vector<std::string> & regex_exprs,
                                             bool byte_encode);

static int split_stdin(const char * regex) {
    std::string text;
    int c;
    while ((c = getchar()) != EOF) {
        if (c != 0) {
            text.push_back((char) c);
            continue;
        }
        // an empty text has no words (llama.cpp's scanners return none for it, and the
        // function then falls back to std::regex, which cannot read their expressions)
        const std::vector<std::string> words =
            text.empty() ? std::vector<std::string>() : unicode_regex_split(text, { regex }, false);
        for (size_t w = 0; w < words.size(); w++) {
            if (w > 0) {
                putchar(' ');
            }
            for (unsigned char b : words[w]) {
                printf("%02x", b);
            }
        }
        putchar('\n');
        text.clear();
    }
    return 0;
}

static void die(const char * msg) {
    fprintf(stderr, "llama_logits: %s\n", msg);
    exit(1);
}

static void usage() {
    die("usage: llama_logits MODEL.gguf [--text TEXT | --raw-text TEXT | --tokens 1,2,3] "
        "[--generate N] [--top K] [--all-logits] [--kv-f16]");
}

static void print_float(float v) {
    if (std::isfinite(v)) {
        printf("%.9g", v);
    } else {
        printf("null");
    }
}

static void print_string(const std::string & s) {
    putchar('"');
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') {
            printf("\\%c", c);
        } else if (c == '\n') {
            printf("\\n");
        } else if (c < 0x20) {
            printf("\\u%04x", c);
        } else {
            putchar(c);
        }
    }
    putchar('"');
}

static void print_ids(const std::vector<llama_token> & ids) {
    putchar('[');
    for (size_t i = 0; i < ids.size(); i++) {
        printf("%s%d", i ? "," : "", ids[i]);
    }
    putchar(']');
}

// The k largest entries of a row as (id, logit), best first, the lower id first on a tie.
static std::vector<std::pair<int, float>> top_k(const float * row, int n_vocab, int k) {
    std::vector<int> idx(n_vocab);
    for (int i = 0; i < n_vocab; i++) {
        idx[i] = i;
    }
    k = std::min(k, n_vocab);
    auto better = [row](int a, int b) {
        // NaN sorts last
        bool na = std::isnan(row[a]), nb = std::isnan(row[b]);
        if (na != nb) {
            return nb;
        }
        if (!na && row[a] != row[b]) {
            return row[a] > row[b];
        }
        return a < b;
    };
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
    std::vector<std::pair<int, float>> out;
    for (int i = 0; i < k; i++) {
        out.emplace_back(idx[i], row[idx[i]]);
    }
    return out;
}

static void print_top(const std::vector<std::pair<int, float>> & top) {
    putchar('[');
    for (size_t i = 0; i < top.size(); i++) {
        printf("%s[%d,", i ? "," : "", top[i].first);
        print_float(top[i].second);
        putchar(']');
    }
    putchar(']');
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        usage();
    }
    if (argc == 3 && strcmp(argv[1], "--split") == 0) {
        return split_stdin(argv[2]);
    }
    const char * model_path = argv[1];
    std::string text;
    bool have_text = false;
    bool raw_text = false;
    std::vector<llama_token> ids;
    bool have_tokens = false;
    int n_generate = 0;
    int k = 8;
    bool all_logits = false;
    bool kv_f16 = false;
    for (int i = 2; i < argc; i++) {
        std::string a = argv[i];
        bool has_value = i + 1 < argc;
        if ((a == "--text" || a == "--raw-text") && has_value) {
            text = argv[++i];
            have_text = true;
            raw_text = a == "--raw-text";
        } else if (a == "--tokens" && has_value) {
            std::string list = argv[++i];
            size_t start = 0;
            while (start <= list.size()) {
                size_t end = list.find(',', start);
                if (end == std::string::npos) {
                    end = list.size();
                }
                std::string item = list.substr(start, end - start);
                char * rest = nullptr;
                long v = strtol(item.c_str(), &rest, 10);
                if (item.empty() || *rest != '\0' || v < 0) {
                    die("--tokens takes comma-separated non-negative ids");
                }
                ids.push_back((llama_token) v);
                start = end + 1;
            }
            have_tokens = true;
        } else if (a == "--generate" && has_value) {
            n_generate = atoi(argv[++i]);
        } else if (a == "--top" && has_value) {
            k = atoi(argv[++i]);
        } else if (a == "--all-logits") {
            all_logits = true;
        } else if (a == "--kv-f16") {
            kv_f16 = true;
        } else {
            usage();
        }
    }
    if (have_text == have_tokens) {
        die("give exactly one of --text, --raw-text and --tokens");
    }
    if (n_generate < 0 || k < 1) {
        die("--generate must be >= 0 and --top >= 1");
    }

    llama_log_set([](enum ggml_log_level level, const char * msg, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) {
            fputs(msg, stderr);
        }
    }, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.progress_callback = [](float, void *) { return true; };  // no progress dots
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        die("cannot load the model");
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    if (have_text) {
        // --text: no BOS, specials parsed; --raw-text: BOS as the model asks, specials literal
        const bool add_special = raw_text, parse_special = !raw_text;
        int n = -llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), nullptr, 0,
                                add_special, parse_special);
        ids.resize(std::max(n, 0));
        if (n > 0 && llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), ids.data(), n,
                                    add_special, parse_special) != n) {
            die("tokenization failed");
        }
    }
    if (ids.empty()) {
        die("the prompt has no tokens");
    }
    for (llama_token t : ids) {
        if (t >= n_vocab) {
            die("a token id is not below n_vocab");
        }
    }
    const int n_prompt = (int) ids.size();

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (n_prompt + n_generate + 16);
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = cp.n_ctx;
    cp.n_seq_max = 1;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.type_k = kv_f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    cp.type_v = kv_f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        die("cannot create the context");
    }

    // The prompt, one batch, logits at every position.
    llama_batch batch = llama_batch_init(n_prompt, 0, 1);
    for (int i = 0; i < n_prompt; i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_prompt;
    if (llama_decode(ctx, batch)) {
        die("decoding the prompt failed");
    }
    std::vector<std::vector<std::pair<int, float>>> prompt_steps;
    for (int i = 0; i < n_prompt; i++) {
        prompt_steps.push_back(top_k(llama_get_logits_ith(ctx, i), n_vocab, k));
    }
    llama_batch_free(batch);

    // Step 0 is the last prompt position; each generated token adds one step.
    std::vector<std::vector<std::pair<int, float>>> steps;
    std::vector<std::vector<float>> rows;
    std::vector<llama_token> generated;
    const float * row = llama_get_logits_ith(ctx, n_prompt - 1);
    llama_batch one = llama_batch_init(1, 0, 1);
    for (int g = 0;; g++) {
        steps.push_back(top_k(row, n_vocab, k));
        if (all_logits) {
            rows.emplace_back(row, row + n_vocab);
        }
        if (g == n_generate) {
            break;
        }
        llama_token next = (llama_token) top_k(row, n_vocab, 1)[0].first;
        generated.push_back(next);
        one.token[0] = next;
        one.pos[0] = n_prompt + g;
        one.n_seq_id[0] = 1;
        one.seq_id[0][0] = 0;
        one.logits[0] = 1;
        one.n_tokens = 1;
        if (llama_decode(ctx, one)) {
            die("decoding a generated token failed");
        }
        row = llama_get_logits_ith(ctx, 0);
    }
    llama_batch_free(one);

    printf("{\"ids\":");
    print_ids(ids);
    printf(",\"generated\":");
    print_ids(generated);
    printf(",\"n_vocab\":%d,\"eos\":%d,\"bos\":%d,\"chat\":", n_vocab, llama_vocab_eos(vocab),
           llama_vocab_bos(vocab));
    const char * tmpl = llama_model_chat_template(model, nullptr);
    if (tmpl) {
        llama_chat_message msgs[1] = { { "user", "hi" } };
        std::vector<char> buf(1024);
        int r = llama_chat_apply_template(tmpl, msgs, 1, true, buf.data(), (int32_t) buf.size());
        if (r > (int) buf.size()) {
            buf.resize(r);
            r = llama_chat_apply_template(tmpl, msgs, 1, true, buf.data(), (int32_t) buf.size());
        }
        if (r < 0) {
            die("the chat template cannot be applied");
        }
        print_string(std::string(buf.data(), r));
    } else {
        printf("null");
    }
    printf(",\"steps\":[");
    for (size_t s = 0; s < steps.size(); s++) {
        if (s) {
            putchar(',');
        }
        print_top(steps[s]);
    }
    printf("],\"prompt_steps\":[");
    for (size_t s = 0; s < prompt_steps.size(); s++) {
        if (s) {
            putchar(',');
        }
        print_top(prompt_steps[s]);
    }
    putchar(']');
    if (all_logits) {
        printf(",\"logits\":[");
        for (size_t s = 0; s < rows.size(); s++) {
            printf("%s[", s ? "," : "");
            for (int i = 0; i < n_vocab; i++) {
                if (i) {
                    putchar(',');
                }
                print_float(rows[s][i]);
            }
            putchar(']');
        }
        putchar(']');
    }
    printf("}\n");

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
