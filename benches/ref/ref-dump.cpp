// Debug harness (ours, over llama.h's public API): run one prompt through llama.cpp and print,
// for every F32 tensor the graph computes, its name, shape and a few statistics of the last
// token's row, so ternfleet's TERNFLEET_DUMP=1 output can be diffed layer by layer.
// Build: see scripts/make-references.sh (same link line as ref-greedy).
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <string>
#include <vector>

static bool dump_cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return t->type == GGML_TYPE_F32;
    if (!ggml_is_contiguous(t)) return true;
    const int64_t row = t->ne[0];
    const int64_t rows = ggml_nelements(t) / row;
    std::vector<float> buf(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
    const float * r = buf.data() + (rows - 1) * row;
    double s = 0, sa = 0, all = 0;
    for (int64_t i = 0; i < row * rows; i++) all += std::fabs(buf[i]);
    for (int64_t i = 0; i < row; i++) { s += r[i]; sa += std::fabs(r[i]); }
    printf("%-24s [%lld,%lld,%lld,%lld] all-abs %.9g last-row sum %.9g abs %.9g first %.9g %.9g %.9g %.9g\n", t->name,
           (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3], all, s, sa,
           r[0], row > 1 ? r[1] : 0.0f, row > 2 ? r[2] : 0.0f, row > 3 ? r[3] : 0.0f);
    if (getenv("DUMP_ROWS")) {
        printf("  rows:");
        for (int64_t q = 0; q < rows && q < 16; q++) {
            double a = 0;
            for (int64_t i = 0; i < row; i++) a += std::fabs(buf[q * row + i]);
            printf(" %.7g", a);
        }
        printf("\n");
        if (const char * rr = getenv("DUMP_ROW")) {
            int64_t q = atoi(rr);
            if (q < rows) { printf("  row %lld:", (long long) q); for (int64_t i = 0; i < row; i++) printf(" %.9g", buf[q*row+i]); printf("\n"); }
        }
    }
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: ref-dump MODEL PROMPT\n"); return 1; }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    auto mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::string prompt = argv[2];
    int n = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), nullptr, 0, true, true);
    std::vector<llama_token> toks(n);
    llama_tokenize(vocab, prompt.c_str(), prompt.size(), toks.data(), n, true, true);
    auto cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.cb_eval = dump_cb; cp.cb_eval_user_data = nullptr;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (llama_decode(ctx, llama_batch_get_one(toks.data(), n))) return 1;
    return 0;
}
