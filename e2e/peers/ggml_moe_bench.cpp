// ggml's CPU kernels on one decode token's routed experts, the work llama.cpp does for a MoE layer
// with `-ot exps=CPU`: `ggml_mul_mat_id` of the gate and up experts, SwiGLU, `ggml_mul_mat_id` of
// the down experts, for K picks among E experts of HIDDEN x WIDTH, the weights in one ggml type
// (default q4_K, llama.cpp's Q4_K_M expert type). Beside `glmflash-node bench --lane` with the same
// shapes it compares the two CPU expert kernels on one machine, thread for thread (issue 16).
//
//   ggml_moe_bench [THREADS] [TYPE] [HIDDEN] [WIDTH] [EXPERTS] [TOPK] [STEPS] [repack|plain]
//                  (defaults: 1 q4_K 4096 2048 64 8 200 repack)
//
// `repack` puts the expert weights in the CPU backend's CPU_REPACK buffer, as llama.cpp does by
// default for weights on the CPU (Q4_K rows interleaved 8 x 8 for the AVX2 / AVX-512 kernels);
// `plain` keeps ggml's row layout. Prints one JSON line: ms a step and GB/s of expert weights for
// "cold" steps (each step's K experts the next K of the E, cycling: the weights come from DRAM, as
// `bench --lane`'s cold set) and "hot" (the same K every step).
// Build (a CMake build of llama.cpp's ggml in LC, BUILD_SHARED_LIBS=ON):
//   g++ -O2 -std=c++17 e2e/peers/ggml_moe_bench.cpp -I$LC/ggml/include -L$LC/build/bin \
//       -lggml -lggml-base -lggml-cpu -Wl,-rpath,$LC/build/bin -o ggml_moe_bench
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static ggml_type type_named(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && name == n) {
            return (ggml_type) t;
        }
    }
    fprintf(stderr, "unknown ggml type %s (e.g. q4_K, q8_0, bf16)\n", name.c_str());
    exit(2);
}

// A [cols, rows, experts] tensor's bytes: ggml's quantization of 64 rows of random floats,
// repeated (quantizing all of it takes minutes; the kernels' speed does not depend on the values,
// only on reading every row from its own memory).
static void fill(ggml_tensor * t, std::mt19937 & rng) {
    const int64_t cols = t->ne[0], rows = t->ne[1] * t->ne[2];
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<float> src(cols * 64);
    for (auto & v : src) {
        v = normal(rng);
    }
    const size_t row_bytes = ggml_row_size(t->type, cols);
    std::vector<char> bytes(ggml_nbytes(t));
    ggml_quantize_chunk(t->type, src.data(), bytes.data(), 0, 64, cols, nullptr);
    for (int64_t r = 64; r < rows; r += 64) {
        memcpy(bytes.data() + r * row_bytes, bytes.data(), std::min<int64_t>(64, rows - r) * row_bytes);
    }
    ggml_backend_tensor_set(t, bytes.data(), 0, bytes.size());
}

static ggml_backend_buffer_type_t repack_buffer_type(ggml_backend_t backend) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * b = get_extra ? get_extra(dev) : nullptr; b && *b; ++b) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return nullptr;
}

int main(int argc, char ** argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    const ggml_type type = type_named(argc > 2 ? argv[2] : "q4_K");
    const int64_t hidden = argc > 3 ? atoll(argv[3]) : 4096;
    const int64_t width = argc > 4 ? atoll(argv[4]) : 2048;
    const int64_t experts = argc > 5 ? atoll(argv[5]) : 64;
    const int64_t topk = argc > 6 ? atoll(argv[6]) : 8;
    const int steps = argc > 7 ? atoi(argv[7]) : 200;
    const std::string layout = argc > 8 ? argv[8] : "repack";

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_backend_buffer_type_t weights_buft = ggml_backend_cpu_buffer_type();
    if (layout == "repack") {
        weights_buft = repack_buffer_type(backend);
        if (!weights_buft) {
            fprintf(stderr, "this CPU backend has no CPU_REPACK buffer type\n");
            return 1;
        }
    } else if (layout != "plain") {
        fprintf(stderr, "layout is repack or plain, not %s\n", layout.c_str());
        return 2;
    }

    ggml_init_params wp = { 8 * ggml_tensor_overhead(), nullptr, true };
    ggml_context * wctx = ggml_init(wp);
    ggml_tensor * gate = ggml_new_tensor_3d(wctx, type, hidden, width, experts);
    ggml_tensor * up = ggml_new_tensor_3d(wctx, type, hidden, width, experts);
    ggml_tensor * down = ggml_new_tensor_3d(wctx, type, width, hidden, experts);
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, weights_buft);
    if (!wbuf) {
        fprintf(stderr, "could not allocate the weights\n");
        return 1;
    }
    ggml_backend_buffer_set_usage(wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    std::mt19937 rng(7);
    fill(gate, rng);
    fill(up, rng);
    fill(down, rng);

    // One token: x [hidden, 1, 1], ids [topk, 1], as llama.cpp's build_moe_ffn shapes them.
    ggml_init_params cp = { 64 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(cp);
    ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, hidden, 1, 1);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, topk, 1);
    ggml_set_input(x);
    ggml_set_input(ids);
    ggml_tensor * g = ggml_mul_mat_id(ctx, gate, x, ids);
    ggml_tensor * u = ggml_mul_mat_id(ctx, up, x, ids);
    ggml_tensor * act = ggml_swiglu_split(ctx, g, u);
    ggml_tensor * out = ggml_mul_mat_id(ctx, down, act, ids);
    ggml_set_output(out);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    if (!ggml_gallocr_alloc_graph(galloc, gf)) {
        fprintf(stderr, "could not allocate the graph\n");
        return 1;
    }
    std::vector<float> xs(hidden);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto & v : xs) {
        v = normal(rng);
    }
    ggml_backend_tensor_set(x, xs.data(), 0, xs.size() * sizeof(float));

    const double expert_bytes =
        (double) (2 * ggml_row_size(type, hidden) * width + ggml_row_size(type, width) * hidden);
    printf("{\"type\": \"%s\", \"layout\": \"%s\", \"weights_buffer\": \"%s\", \"threads\": %d, \"hidden\": %lld, "
           "\"width\": %lld, \"experts\": %lld, \"topk\": %lld, \"expert_bytes\": %.0f",
           ggml_type_name(type), layout.c_str(), ggml_backend_buft_name(weights_buft), threads, (long long) hidden,
           (long long) width, (long long) experts, (long long) topk, expert_bytes);
    std::vector<int32_t> pick(topk);
    float first = 0.0f;
    for (const char * set : { "cold", "hot" }) {
        const bool cold = strcmp(set, "cold") == 0;
        double secs = 0.0;
        for (int s = -8; s < steps; ++s) {  // 8 steps untimed first
            for (int64_t j = 0; j < topk; ++j) {
                pick[j] = (int32_t) (cold ? ((s + 8) * topk + j) % experts : j);
            }
            ggml_backend_tensor_set(ids, pick.data(), 0, pick.size() * sizeof(int32_t));
            const auto t0 = std::chrono::steady_clock::now();
            if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
                fprintf(stderr, "graph compute failed\n");
                return 1;
            }
            if (s >= 0) {
                secs += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            }
        }
        const double ms = secs * 1e3 / steps;
        printf(", \"%s\": {\"ms_per_step\": %.4f, \"weights_gb_per_s\": %.3f}", set, ms,
               topk * expert_bytes / (ms / 1e3) / 1e9);
    }
    ggml_backend_tensor_get(out, &first, 0, sizeof(float));
    printf(", \"out0\": %.6g}\n", first);
    ggml_gallocr_free(galloc);
    ggml_free(ctx);
    ggml_backend_buffer_free(wbuf);
    ggml_free(wctx);
    ggml_backend_free(backend);
    return 0;
}
