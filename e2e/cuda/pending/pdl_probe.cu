// Probe: programmatic edges in a captured graph, made three ways, on this driver. Prints each
// call's status and a chain's time with and without them.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#define R(x) do { cudaError_t e = (x); printf("%-60s %s\n", #x, cudaGetErrorString(e)); } while (0)

__global__ void busy(float* p, int n, int wait) {
    if (wait) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = p[i]; for (int k = 0; k < 64; k++) v = v * 1.0001f + 0.5f; p[i] = v; }
}

static float time_graph(cudaGraphExec_t ex, cudaStream_t s) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 3; i++) cudaGraphLaunch(ex, s);
    cudaEventRecord(a, s);
    for (int i = 0; i < 20; i++) cudaGraphLaunch(ex, s);
    cudaEventRecord(b, s); cudaStreamSynchronize(s);
    float ms; cudaEventElapsedTime(&ms, a, b); return ms / 20;
}

int main() {
    const int N = 132 * 256 * 4, K = 150;
    float* p; cudaMalloc(&p, N * 4); cudaMemset(p, 0, N * 4);
    cudaStream_t s; cudaStreamCreate(&s);
    int drv; cudaDriverGetVersion(&drv); printf("driver %d\n", drv);
    for (int mode = 0; mode < 3; mode++) {
        // mode 0: plain; 1: edges changed after capture; 2: launch attribute in the capture.
        cudaGraph_t g; cudaGraphExec_t ex;
        cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
        for (int k = 0; k < K; k++) {
            cudaLaunchConfig_t c = {}; cudaLaunchAttribute at[1];
            c.gridDim = N / 256; c.blockDim = 256; c.stream = s;
            if (mode == 2 && k > 0) {
                at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                at[0].val.programmaticStreamSerializationAllowed = 1;
                c.attrs = at; c.numAttrs = 1;
            }
            cudaError_t e = cudaLaunchKernelEx(&c, busy, p, N, mode ? 1 : 0);
            if (e != cudaSuccess && k < 2) printf("launch %d: %s\n", k, cudaGetErrorString(e));
        }
        R(cudaStreamEndCapture(s, &g));
        size_t n = 0;
        R(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n));
        std::vector<cudaGraphNode_t> from(n), to(n); std::vector<cudaGraphEdgeData> d(n);
        R(cudaGraphGetEdges(g, from.data(), to.data(), d.data(), &n));
        printf("mode %d: %zu edges, first edge type %d from_port %d\n", mode, n,
               n ? d[0].type : -1, n ? d[0].from_port : -1);
        if (mode == 1) {
            int bad = 0;
            for (size_t i = 0; i < n; i++) {
                cudaGraphEdgeData e = d[i];
                cudaError_t r1 = cudaGraphRemoveDependencies(g, &from[i], &to[i], &e, 1);
                e.from_port = cudaGraphKernelNodePortProgrammatic;
                e.type = cudaGraphDependencyTypeProgrammatic;
                cudaError_t r2 = cudaGraphAddDependencies(g, &from[i], &to[i], &e, 1);
                if ((r1 || r2) && bad++ < 2)
                    printf("edge %zu: remove %s, add %s\n", i, cudaGetErrorString(r1), cudaGetErrorString(r2));
            }
        }
        cudaError_t e = cudaGraphInstantiateWithFlags(&ex, g, 0);
        printf("mode %d instantiate: %s\n", mode, cudaGetErrorString(e));
        if (e == cudaSuccess) printf("mode %d: %d kernels a graph, %.2f us each\n", mode, K, 1e3 * time_graph(ex, s) / K);
        cudaGetLastError();
    }
    return 0;
}
