// llama.cpp's side of benches/ternary-vs-llama-cpp.sh: times ggml_mul_mat(W, x) for one f32
// token x against a random weight matrix W of a ternary type, on ggml's CPU backend, as
// llama.cpp's decode does (x is converted to q8_K inside the op, part of the timing).
//
// Usage: ref-gemv TYPE ROWS COLS THREADS RUNS   (TYPE: tq2_0 | tq1_0)
// Prints: "ref TYPE ROWSxCOLS t=THREADS median_us=... min_us=..."
#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s tq2_0|tq1_0 ROWS COLS THREADS RUNS\n", argv[0]);
        return 2;
    }
    const std::string tname = argv[1];
    const ggml_type type = tname == "tq1_0" ? GGML_TYPE_TQ1_0 : GGML_TYPE_TQ2_0;
    if (tname != "tq1_0" && tname != "tq2_0") {
        fprintf(stderr, "unknown type %s\n", tname.c_str());
        return 2;
    }
    const int64_t rows = atoll(argv[2]), cols = atoll(argv[3]);
    const int threads = atoi(argv[4]), runs = atoi(argv[5]);
    if (rows <= 0 || cols <= 0 || cols % 256 != 0 || threads <= 0 || runs <= 0) {
        fprintf(stderr, "bad shape/threads/runs\n");
        return 2;
    }
    ggml_cpu_init();
    const size_t wbytes = ggml_row_size(type, cols) * rows;
    ggml_init_params ip = { wbytes + cols * 8 + rows * 8 + (size_t) 64 * 1024 * 1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * w = ggml_new_tensor_2d(ctx, type, cols, rows);
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, cols, 1);
    ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);

    std::mt19937 rng(42);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    {
        // Quantize in slices of rows to keep the f32 staging buffer small.
        const int64_t step = 256;
        std::vector<float> buf(step * cols);
        for (int64_t r0 = 0; r0 < rows; r0 += step) {
            const int64_t nr = std::min(step, rows - r0);
            for (int64_t i = 0; i < nr * cols; ++i) buf[i] = nd(rng) * 0.02f;
            // ggml_quantize_chunk offsets both src and dst by `start`: pass 0 and offset dst.
            char * dst = (char *) w->data + r0 * ggml_row_size(type, cols);
            ggml_quantize_chunk(type, buf.data(), dst, 0, nr, cols, nullptr);
        }
    }
    float * xd = (float *) x->data;
    for (int64_t i = 0; i < cols; ++i) xd[i] = nd(rng);

    std::vector<double> us;
    for (int i = 0; i < runs + 5; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        if (ggml_graph_compute_with_ctx(ctx, gf, threads) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "compute failed\n");
            return 1;
        }
        auto t1 = std::chrono::steady_clock::now();
        if (i >= 5) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::sort(us.begin(), us.end());
    printf("ref %s %lldx%lld t=%d median_us=%.1f min_us=%.1f checksum=%g\n", tname.c_str(),
           (long long) rows, (long long) cols, threads, us[us.size() / 2], us[0],
           (double) ((float *) y->data)[0]);
    ggml_free(ctx);
    return 0;
}
