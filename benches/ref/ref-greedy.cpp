// ref-greedy: greedy reference generations from the reference engine (llama.cpp), as JSON.
//
// Our own harness over llama.cpp's public C API (include/llama.h) only; built by
// scripts/make-references.sh against the static libraries of scripts/build-llama-cpp.sh.
// It does what llama-simple does (tokenize with add_special + parse_special, decode the whole
// prompt as one batch, greedy sampler, stop on end-of-generation), but prints token ids and, per
// generated step, the top-k logits, so ternfleet can be compared token for token and a
// divergence can be told apart from a near-tie.
//
// usage: ref-greedy -m MODEL [-n N] [-t THREADS] [-c CTX] [--fa auto|on|off] [--top K] PROMPT
// stdout: one line
//   {"prompt_tokens":[..],"tokens":[..],"text":"..","top":[[[id,logit],..],..],"eog":bool,...}
// "text" is the continuation only: llama_token_to_piece(.., special=false) pieces, concatenated
// (invalid UTF-8 shown as U+FFFD; "text_hex" has the exact bytes). "text_special" and
// "prompt_special" are rendered with special=true, as llama-simple prints them.
// "top"[i] are the k largest logits of the distribution token i was drawn from.
#include "llama.h"

#include <algorithm>
#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

static bool g_verbose = false;

static void log_cb(enum ggml_log_level level, const char * text, void *) {
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

// JSON string; invalid UTF-8 bytes become U+FFFD (and *valid is cleared) so the line always parses.
static std::string json_str(const std::string & s, bool * valid) {
    std::string out = "\"";
    size_t i = 0;
    while (i < s.size()) {
        unsigned char c = (unsigned char) s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        bool ok = len > 0 && i + len <= s.size();
        for (size_t k = 1; ok && k < len; k++) {
            ok = ((unsigned char) s[i + k] >> 6) == 0x2;
        }
        if (!ok) {
            out += "\\ufffd";
            if (valid) *valid = false;
            i += 1;
            continue;
        }
        if (len == 1) {
            switch (c) {
                case '"':  out += "\\\""; break;
                case '\\': out += "\\\\"; break;
                case '\n': out += "\\n"; break;
                case '\r': out += "\\r"; break;
                case '\t': out += "\\t"; break;
                default:
                    if (c < 0x20 || c == 0x7f) {
                        char buf[8];
                        snprintf(buf, sizeof(buf), "\\u%04x", c);
                        out += buf;
                    } else {
                        out += (char) c;
                    }
            }
        } else {
            out.append(s, i, len);
        }
        i += len;
    }
    return out + "\"";
}

static std::string hex(const std::string & s) {
    static const char * digits = "0123456789abcdef";
    std::string out = "\"";
    for (unsigned char c : s) { out += digits[c >> 4]; out += digits[c & 15]; }
    return out + "\"";
}

static std::string piece(const llama_vocab * vocab, llama_token id, bool special) {
    std::vector<char> buf(256);
    int n = llama_token_to_piece(vocab, id, buf.data(), (int32_t) buf.size(), 0, special);
    if (n < 0) {
        buf.resize(-n);
        n = llama_token_to_piece(vocab, id, buf.data(), (int32_t) buf.size(), 0, special);
    }
    return n < 0 ? std::string() : std::string(buf.data(), n);
}

static void usage(const char * argv0) {
    fprintf(stderr,
            "usage: %s -m MODEL [-n N] [-t THREADS] [-c CTX] [--fa auto|on|off] [--top K] [-v] PROMPT\n",
            argv0);
    exit(2);
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    std::string model_path, prompt, fa = "auto";
    int n_predict = 32, n_threads = 2, n_ctx = 0, top_k = 5;
    bool have_prompt = false;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> const char * { if (i + 1 >= argc) usage(argv[0]); return argv[++i]; };
        if (a == "-m") model_path = next();
        else if (a == "-n") n_predict = atoi(next());
        else if (a == "-t") n_threads = atoi(next());
        else if (a == "-c") n_ctx = atoi(next());
        else if (a == "--fa") fa = next();
        else if (a == "--top") top_k = atoi(next());
        else if (a == "-v") g_verbose = true;
        else if (!have_prompt) { prompt = a; have_prompt = true; }
        else usage(argv[0]);
    }
    if (model_path.empty() || !have_prompt || n_predict < 1 || n_threads < 1) usage(argv[0]);

    llama_log_set(log_cb, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (!model) { fprintf(stderr, "ref-greedy: cannot load %s\n", model_path.c_str()); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    const int n_prompt = -llama_tokenize(vocab, prompt.data(), (int32_t) prompt.size(), nullptr, 0, true, true);
    std::vector<llama_token> ptoks(n_prompt);
    if (n_prompt <= 0 ||
        llama_tokenize(vocab, prompt.data(), (int32_t) prompt.size(), ptoks.data(), n_prompt, true, true) < 0) {
        fprintf(stderr, "ref-greedy: tokenization failed\n");
        return 1;
    }

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = n_ctx > 0 ? n_ctx : n_prompt + n_predict;
    cparams.n_batch = std::max(n_prompt, 1);
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.no_perf = true;
    cparams.flash_attn_type = fa == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                            : fa == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED
                            : LLAMA_FLASH_ATTN_TYPE_AUTO;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) { fprintf(stderr, "ref-greedy: cannot create context\n"); return 1; }

    llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    llama_batch batch = llama_batch_init(std::max(n_prompt, 1), 0, 1);
    auto fill = [&](const llama_token * toks, int n, int pos0) {
        batch.n_tokens = n;
        for (int i = 0; i < n; i++) {
            batch.token[i] = toks[i];
            batch.pos[i] = pos0 + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = i == n - 1;
        }
    };

    std::vector<llama_token> out;
    std::vector<std::vector<std::pair<llama_token, float>>> tops;
    std::string text;
    bool eog = false;
    fill(ptoks.data(), n_prompt, 0);
    int n_past = 0, n_in_batch = n_prompt;
    for (int step = 0; step < n_predict; step++) {
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "ref-greedy: decode failed\n"); return 1; }
        n_past += n_in_batch;
        const float * logits = llama_get_logits_ith(ctx, -1);
        std::vector<int> idx(n_vocab);
        for (int i = 0; i < n_vocab; i++) idx[i] = i;
        const int k = std::min(top_k, n_vocab);
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        });
        std::vector<std::pair<llama_token, float>> top;
        for (int i = 0; i < k; i++) top.emplace_back(idx[i], logits[idx[i]]);
        tops.push_back(top);

        llama_token id = llama_sampler_sample(smpl, ctx, -1);
        if (llama_vocab_is_eog(vocab, id)) { eog = true; break; }
        out.push_back(id);
        text += piece(vocab, id, false);
        fill(&id, 1, n_past);
        n_in_batch = 1;
    }

    std::string prompt_special;  // the prompt as llama-simple echoes it (pieces with special=true)
    for (auto t : ptoks) prompt_special += piece(vocab, t, true);
    std::string text_special;    // the continuation as llama-simple prints it
    for (auto t : out) text_special += piece(vocab, t, true);

    bool valid = true;
    std::string j = "{\"prompt_tokens\":[";
    for (int i = 0; i < n_prompt; i++) j += (i ? "," : "") + std::to_string(ptoks[i]);
    j += "],\"tokens\":[";
    for (size_t i = 0; i < out.size(); i++) j += (i ? "," : "") + std::to_string(out[i]);
    j += "],\"text\":" + json_str(text, &valid);
    j += ",\"text_hex\":" + hex(text);
    j += ",\"text_special\":" + json_str(text_special, nullptr);
    j += ",\"text_special_hex\":" + hex(text_special);
    j += ",\"prompt_special\":" + json_str(prompt_special, nullptr);
    j += ",\"prompt_special_hex\":" + hex(prompt_special);
    j += std::string(",\"text_valid_utf8\":") + (valid ? "true" : "false");
    j += std::string(",\"eog\":") + (eog ? "true" : "false");
    j += ",\"n_threads\":" + std::to_string(n_threads);
    j += ",\"n_ctx\":" + std::to_string(llama_n_ctx(ctx));
    j += ",\"flash_attn\":\"" + fa + "\"";
    j += ",\"top\":[";
    for (size_t s = 0; s < tops.size(); s++) {
        j += s ? ",[" : "[";
        for (size_t i = 0; i < tops[s].size(); i++) {
            char buf[64];
            snprintf(buf, sizeof(buf), "%s[%d,%.9g]", i ? "," : "", tops[s][i].first, tops[s][i].second);
            j += buf;
        }
        j += "]";
    }
    j += "]}";
    puts(j.c_str());

    llama_batch_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
