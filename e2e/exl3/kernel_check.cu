// The EXL3 kernels (kernels/cuda/exl3.cu) on a GPU without the Rust binary (nvcc and cuBLAS
// only: the device machines carry no cargo): every codebook and rate (1..8, 1.5, 2.5, 3.5)
// on random trellises, the decoded weights against a host decoder written from the format's
// definition (bit for bit), products through the GEMV and through reconstruct + SGEMM against
// the float64 product (rel. L2 1e-4), then GEMV timings. The launches mirror
// node-server/src/backend/cuda/exl3.rs (splits from `blocks`, 512 there). cuda-check's group
// `exl3` is the same proof through the product's own wrappers.
//   nvcc -O3 -arch=sm_90 -std=c++17 -Ikernels/cuda e2e/exl3/kernel_check.cu -lcublas -o /tmp/k
//   /tmp/k [check|quick|speed] [blocks]     # default: check, then speed
#include "exl3.cu"
#include <cuda_fp16.h>
#include <cublas_v2.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <random>
#include <array>

// Outputs a GEMV block computes: kernels before the 32-output strip took 16.
#ifndef EXL3_STRIP
#define EXL3_STRIP 16
#endif

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(2); } } while (0)

static float h2f_host(unsigned short b) { __half_raw r; r.x = b; return __half2float(__half(r)); }
static float rnd16(float v) { return __half2float(__float2half_rn(v)); }

static float ref_value(int cb, uint32_t x) {
    if (cb == 2) {
        uint32_t y = x * 0x83DCD12Du;
        int s = (y & 255) + ((y >> 8) & 255) + ((y >> 16) & 255) + (y >> 24);
        return rnd16((float)(1774 * s - 905216) / 262144.0f);
    }
    uint32_t y = cb == 1 ? x * 0xCBAC1FEDu : x * 89226354u + 64248484u;
    y = (y & 0x8FFF8FFFu) ^ 0x3B603B60u;
    return rnd16(h2f_host(y & 0xFFFF) + h2f_host(y >> 16));
}

static void ref_decode(const std::vector<uint32_t>& tr, int halves, int cb, int K, int N, std::vector<float>& what) {
    const int nt_n = N / 16, tw = 4 * halves, L = 32 * tw;
    static const int offs[8][2] = {{0,0},{1,0},{8,0},{9,0},{0,8},{1,8},{8,8},{9,8}};
    what.assign((size_t)K * N, 0.f);
    for (int kt = 0; kt < K / 16; kt++) for (int nt = 0; nt < nt_n; nt++) {
        const uint32_t* t = &tr[((size_t)kt * nt_n + nt) * tw];
        int end = 0;
        for (int p = 0; p < 256; p++) {
            end += halves / 2 + ((halves & 1) && (p & 1));
            uint32_t st = 0;
            for (int i = 0; i < 16; i++) {
                int b = ((end - 16 + i) % L + L) % L;
                st = (st << 1) | ((t[b / 32] >> (31 - b % 32)) & 1);
            }
            int g = p / 8, j = p % 8;
            what[(size_t)(16 * kt + 2 * (g % 4) + offs[j][0]) * N + 16 * nt + g / 4 + offs[j][1]] = ref_value(cb, st);
        }
    }
}

static void had(double* v, int n) {
    for (int b = 0; b < n; b += 128) {
        for (int h = 1; h < 128; h <<= 1)
            for (int i = 0; i < 128; i++) if (!(i & h)) { double a = v[b + i], c = v[b + i + h]; v[b + i] = a + c; v[b + i + h] = a - c; }
        for (int i = 0; i < 128; i++) v[b + i] /= std::sqrt(128.0);
    }
}

struct Dev { uint32_t* tr; float *suh, *svh, *bias; int K, N, halves, cb; };

// The Rust wrapper's launches: rotate_input, then the gemv (it rotates the output) or
// reconstruct + SGEMM and rotate_output.
static int g_blocks = 512;
static uint32_t* g_tickets;  // zeros, a ticket per 128 outputs (the GEMV leaves them zero)
static void product(const Dev& d, const float* x, int n, float* y, float* xr, float* part, float* wide, cublasHandle_t blas, bool gemm) {
    exl3_rotate_input<<<dim3(d.K / 128, n), 128>>>(x, d.suh, d.K, gemm ? 0 : 1, xr);
    int splits = 1;
    if (!gemm) {
        int kt = d.K / 16, ntl = d.N / EXL3_STRIP;  // a block per strip of outputs
        int maxs = kt / EXL3_GEMV_WARPS > 1 ? kt / EXL3_GEMV_WARPS : 1;
        splits = (g_blocks + ntl - 1) / ntl; if (splits < 1) splits = 1; if (splits > maxs) splits = maxs;
        int per = (kt + splits - 1) / splits;
        exl3_gemv<<<dim3(ntl, splits), EXL3_GEMV_WARPS * 32>>>(d.tr, d.halves, d.cb, d.K, d.N, per, (const uint32_t*)xr, n, part, d.svh, d.bias, 1, g_tickets, y, nullptr, nullptr, 0);
        return;  // the GEMV's last blocks rotate the output
    } else {
        int tps = (8 << 20) / d.N / 16; if (tps < 1) tps = 1; if (tps > d.K / 16) tps = d.K / 16;
        for (int kt0 = 0; kt0 < d.K / 16; kt0 += tps) {
            int kt1 = kt0 + tps < d.K / 16 ? kt0 + tps : d.K / 16;
            int tiles = (kt1 - kt0) * (d.N / 16);
            exl3_reconstruct<<<(tiles + 7) / 8, 256>>>(d.tr, d.halves, d.cb, d.N, kt0, kt1, 0, wide);
            float alpha = 1.f, beta = kt0 == 0 ? 0.f : 1.f;
            cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, d.N, n, 16 * (kt1 - kt0), &alpha, wide, d.N, xr + 16 * kt0, d.K, &beta, part, d.N);
        }
    }
    exl3_rotate_output<<<dim3(d.N / 128, n), 128>>>(part, splits, n, d.N, d.svh, d.bias, 1, y);
}

int main(int argc, char** argv) {
    bool quick = argc > 1 && !strcmp(argv[1], "quick");
    bool speed_only = argc > 1 && !strcmp(argv[1], "speed");
    bool check_only = argc > 1 && !strcmp(argv[1], "check");
    if (argc > 2) g_blocks = atoi(argv[2]);
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> U(-1.f, 1.f);
    cublasHandle_t blas; cublasCreate(&blas);
    cudaMalloc(&g_tickets, 65536 * sizeof(uint32_t));
    cudaMemset(g_tickets, 0, 65536 * sizeof(uint32_t));
    int fails = 0;
    const int halves_list[11] = {2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16};
    double worst[3] = {0, 0, 0};
    for (int cb = 0; cb < 3; cb++) for (int hi = 0; hi < 11 && !speed_only; hi++) {
        int halves = halves_list[hi];
        if ((halves & 1) && cb != 2) continue;
        int K = 256, N = 384;
        if (!quick && hi % 3 == 0) { K = 1024; N = 640; }
        std::vector<uint32_t> tr((size_t)K / 16 * N / 16 * 4 * halves);
        for (auto& w : tr) w = rng();
        std::vector<float> suh(K), svh(N), bias(N);
        for (auto& v : suh) v = U(rng); for (auto& v : svh) v = 0.05f * U(rng); for (auto& v : bias) v = 0.1f * U(rng);
        std::vector<float> what; ref_decode(tr, halves, cb, K, N, what);
        Dev d; d.K = K; d.N = N; d.halves = halves; d.cb = cb;
        CK(cudaMalloc(&d.tr, tr.size() * 4)); CK(cudaMemcpy(d.tr, tr.data(), tr.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d.suh, K * 4)); CK(cudaMemcpy(d.suh, suh.data(), K * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d.svh, N * 4)); CK(cudaMemcpy(d.svh, svh.data(), N * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d.bias, N * 4)); CK(cudaMemcpy(d.bias, bias.data(), N * 4, cudaMemcpyHostToDevice));
        // reconstruct, bit for bit
        float* rec; CK(cudaMalloc(&rec, (size_t)K * N * 4)); CK(cudaMemset(rec, 0xFF, (size_t)K * N * 4));
        int tiles = K / 16 * N / 16;
        exl3_reconstruct<<<(tiles + 7) / 8, 256>>>(d.tr, halves, cb, N, 0, K / 16, 0, rec);
        CK(cudaGetLastError());
        std::vector<float> got((size_t)K * N); CK(cudaMemcpy(got.data(), rec, got.size() * 4, cudaMemcpyDeviceToHost));
        size_t diff = 0; for (size_t i = 0; i < got.size(); i++) diff += memcmp(&got[i], &what[i], 4) != 0;
        if (diff) fails++;
        printf("cb %d bits %.1f %dx%d reconstruct: %zu of %zu differ%s\n", cb, halves / 2.0, K, N, diff, got.size(), diff ? "  FAIL" : "");
        int token_list[6] = {1, 3, 8, 9, 17, 70};
        for (int ti = 0; ti < 6; ti++) for (int gemm = 0; gemm < 2; gemm++) {
            int n = token_list[ti];
            if (gemm && n < 8) continue;
            std::vector<float> x((size_t)n * K); for (auto& v : x) v = U(rng);
            float *dx, *dy, *xr, *part, *wide;
            CK(cudaMalloc(&dx, x.size() * 4)); CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&dy, (size_t)n * N * 4)); CK(cudaMemset(dy, 0xFF, (size_t)n * N * 4));
            CK(cudaMalloc(&xr, (size_t)n * K * 4)); CK(cudaMemset(xr, 0xFF, (size_t)n * K * 4));
            CK(cudaMalloc(&part, (size_t)512 * n * N * 4)); CK(cudaMemset(part, 0xFF, (size_t)512 * n * N * 4));
            CK(cudaMalloc(&wide, (size_t)K * N * 4));
            product(d, dx, n, dy, xr, part, wide, blas, gemm);
            CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
            std::vector<float> y((size_t)n * N); CK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
            double num = 0, den = 0; bool finite = true;
            std::vector<double> xr_h(K), z(N);
            for (int t = 0; t < n; t++) {
                for (int i = 0; i < K; i++) xr_h[i] = (double)x[(size_t)t * K + i] * suh[i];
                had(xr_h.data(), K);
                for (int c = 0; c < N; c++) z[c] = 0;
                for (int i = 0; i < K; i++) for (int c = 0; c < N; c++) z[c] += xr_h[i] * what[(size_t)i * N + c];
                had(z.data(), N);
                for (int c = 0; c < N; c++) {
                    double want = z[c] * svh[c] + bias[c], g = y[(size_t)t * N + c];
                    if (!std::isfinite(g)) finite = false;
                    num += (g - want) * (g - want); den += want * want;
                }
            }
            double rel = std::sqrt(num / den);
            if (rel > worst[cb]) worst[cb] = rel;
            bool ok = finite && rel <= 1e-4;
            if (!ok) fails++;
            printf("cb %d bits %.1f %dx%d n=%d %s: rel %.3e%s\n", cb, halves / 2.0, K, N, n, gemm ? "reconstruct+sgemm" : "gemv", rel, ok ? "" : "  FAIL");
            cudaFree(dx); cudaFree(dy); cudaFree(xr); cudaFree(part); cudaFree(wide);
        }
        cudaFree(d.tr); cudaFree(d.suh); cudaFree(d.svh); cudaFree(d.bias); cudaFree(rec);
    }
    printf("worst rel vs f64 definition: 3inst %.3e mcg %.3e mul1 %.3e\n", worst[0], worst[1], worst[2]);
    if (!quick && !check_only) {
        // KC_SHAPES="K:N:halves,..." times those shapes (mul1) instead of the default set.
        std::vector<std::array<int, 3>> list;
        if (const char* e = getenv("KC_SHAPES")) {
            for (const char* c = e; *c;) {
                std::array<int, 3> v{};
                if (sscanf(c, "%d:%d:%d", &v[0], &v[1], &v[2]) == 3) list.push_back(v);
                while (*c && *c != ',') c++;
                if (*c) c++;
            }
        } else {
            int shapes[3][2] = {{4096, 2048}, {2048, 4096}, {16384, 16384}};
            int rates[4] = {4, 6, 8, 16};
            for (auto& s : shapes) for (int halves : rates) {
                if (s[0] == 16384 && halves == 16) continue;
                list.push_back({s[0], s[1], halves});
            }
        }
        for (auto& s : list) for (int cb = 0; cb < 3; cb++) {
            int halves = s[2];
            if ((halves & 1) && cb != 2) continue;
            if (cb != 2 && (halves != 6 || getenv("KC_SHAPES"))) continue;
            Dev d; d.K = s[0]; d.N = s[1]; d.halves = halves; d.cb = cb;
            size_t words = (size_t)d.K / 16 * d.N / 16 * 4 * halves;
            std::vector<uint32_t> tr(words); for (auto& w : tr) w = rng();
            CK(cudaMalloc(&d.tr, words * 4)); CK(cudaMemcpy(d.tr, tr.data(), words * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&d.suh, d.K * 4)); CK(cudaMemset(d.suh, 0, d.K * 4));
            CK(cudaMalloc(&d.svh, d.N * 4)); CK(cudaMemset(d.svh, 0, d.N * 4));
            CK(cudaMalloc(&d.bias, d.N * 4)); CK(cudaMemset(d.bias, 0, d.N * 4));
            for (int n : {1, 4, 8}) {
                float *dx, *dy, *xr, *part;
                CK(cudaMalloc(&dx, (size_t)n * d.K * 4)); CK(cudaMemset(dx, 0, (size_t)n * d.K * 4));
                CK(cudaMalloc(&dy, (size_t)n * d.N * 4)); CK(cudaMalloc(&xr, (size_t)n * d.K * 4));
                CK(cudaMalloc(&part, (size_t)512 * n * d.N * 4));
                cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
                for (int i = 0; i < 5; i++) product(d, dx, n, dy, xr, part, nullptr, blas, false);
                int reps = 200;
                cudaEventRecord(a);
                for (int i = 0; i < reps; i++) product(d, dx, n, dy, xr, part, nullptr, blas, false);
                cudaEventRecord(b); CK(cudaEventSynchronize(b));
                float ms; cudaEventElapsedTime(&ms, a, b);
                double us = ms * 1e3 / reps, bytes = words * 4.0;
                printf("speed blocks %d cb %d bits %.1f %dx%d n=%d: %.2f us, %.0f GB/s of trellis\n", g_blocks, cb, halves / 2.0, d.K, d.N, n, us, bytes / us / 1e3);
                cudaFree(dx); cudaFree(dy); cudaFree(xr); cudaFree(part);
            }
            cudaFree(d.tr); cudaFree(d.suh); cudaFree(d.svh); cudaFree(d.bias);
        }
    }
    printf("%d failures\n", fails);
    return fails != 0;
}
