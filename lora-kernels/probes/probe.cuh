// What the standalone probes share (not part of the library): the CUDA
// error check, the copy bandwidth and in-a-graph timing the way `xtask
// bench` measures them, and (with PROBE_LIBRARY_ROWS defined before the
// include) the library's row-register kernel body under a probe's own
// declaration and bf16 helpers.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                 \
    do {                                                                      \
        cudaError_t e = (x);                                                  \
        if (e != cudaSuccess) {                                               \
            printf("error %s at line %d\n", cudaGetErrorString(e), __LINE__); \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

// Device-to-device copy bandwidth, bytes read + written, GB/s: the best of
// 10 copies of 256 MB (as the bench measures it).
static double probe_copy_bandwidth(cudaStream_t st) {
    char *s = nullptr, *d = nullptr;
    const size_t bytes = 256u << 20;
    CK(cudaMalloc(&s, bytes));
    CK(cudaMalloc(&d, bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float best = 1e30f;
    for (int k = 0; k < 10; ++k) {
        CK(cudaEventRecord(e0, st));
        CK(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms = 0.f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        best = std::min(best, ms);
    }
    CK(cudaFree(s));
    CK(cudaFree(d));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return 2.0 * bytes / (best * 1e-3) / 1e9;
}

// Per-call time in a graph: `calls` calls of `launch(k)` captured in one
// graph, replayed once to warm up, then `runs` times; median, p10 and p90
// of replay time / calls, in us.
struct ProbeTime {
    float median, p10, p90;
};
template <class Launch>
static ProbeTime probe_time_graph(cudaStream_t st, int calls, Launch launch, int runs = 21) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int k = 0; k < calls; ++k) launch(k);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ts(runs);
    for (int k = 0; k < runs; ++k) {
        CK(cudaEventRecord(e0, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms = 0.f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        ts[k] = ms * 1000.f / calls;
    }
    std::sort(ts.begin(), ts.end());
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return ProbeTime{ts[runs / 2], ts[runs / 10], ts[runs - 1 - runs / 10]};
}

__global__ void probe_empty_kernel() {}

// An empty kernel's time in a graph of 256 (the launch floor), in us.
static float probe_empty_in_graph(cudaStream_t st) {
    return probe_time_graph(st, 256, [&](int) { probe_empty_kernel<<<1, 32, 0, st>>>(); }).median;
}

#ifdef PROBE_LIBRARY_ROWS
#include "../cuda/common.cuh"
// The library's sm_90 kernels sit under `#if __CUDA_ARCH__ >= 900`, which
// the host pass must see too (NVRTC compiles device code only).
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#define PROBE_HOST_ARCH
#endif
#include "../cuda/bgmv.cu"
#include "../cuda/bgmv_entry.cu"
#ifdef ROWS_SRC
#include ROWS_SRC
#else
#include "../cuda/bgmv_rows.cu"
#endif
#ifdef PROBE_HOST_ARCH
#undef __CUDA_ARCH__
#endif

// The library kernel's body under the probe's own declaration (the
// library's is compiled for device code only).
template <bool FULL>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(BGR_THREADS, 1) library_rows(const BgeParams p) {
    bgr_body<bf16_t, FULL>(p);
}

// Hashed uniform values in [-amp, amp), as bf16.
__global__ void probe_fill_bf16(bf16_t* p, size_t n, u32 seed, float amp) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        const float v = ((float)(h & 0xffffu) / 65536.f - 0.5f) * 2.f * amp;
        p[i] = f2bf(v);
    }
}

// A bf16 value's float, on the host.
static float host_bf(bf16_t h) {
    const u32 u = (u32)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// A decode apply on the device: A [entries][rank][in], B [entries][out][rank],
// x [n_rows][in], y [n_rows][out] (all bf16, dense), idx [n_rows].
struct ProbeApply {
    const bf16_t *a, *b, *x, *y;
    const int* idx;
    int n_rows, in, out, rank, entries;
    float scale;
};

// The relative error of y, computed from y = 0 (the rounded delta), against
// a host reference in double.
static double probe_apply_error(const ProbeApply& d) {
    const size_t a_elems = (size_t)d.entries * d.rank * d.in, b_elems = (size_t)d.entries * d.out * d.rank;
    const size_t x_elems = (size_t)d.n_rows * d.in, y_elems = (size_t)d.n_rows * d.out;
    std::vector<bf16_t> ha(a_elems), hb(b_elems), hx(x_elems), hy(y_elems);
    std::vector<int> hidx(d.n_rows);
    CK(cudaMemcpy(ha.data(), d.a, a_elems * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), d.b, b_elems * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hx.data(), d.x, x_elems * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hy.data(), d.y, y_elems * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hidx.data(), d.idx, (size_t)d.n_rows * 4, cudaMemcpyDeviceToHost));
    double num = 0.0, den = 0.0;
    std::vector<double> t(d.rank);
    for (int r = 0; r < d.n_rows; ++r) {
        const int e = hidx[r];
        for (int k = 0; k < d.rank; ++k) {
            double s = 0.0;
            for (int i = 0; i < d.in; ++i)
                s += (double)host_bf(ha[((size_t)e * d.rank + k) * d.in + i]) * host_bf(hx[(size_t)r * d.in + i]);
            t[k] = d.scale * s;
        }
        for (int o = 0; o < d.out; ++o) {
            double delta = 0.0;
            for (int k = 0; k < d.rank; ++k)
                delta += (double)host_bf(hb[((size_t)e * d.out + o) * d.rank + k]) * t[k];
            const double got = host_bf(hy[(size_t)r * d.out + o]);
            num += (got - delta) * (got - delta);
            den += delta * delta;
        }
    }
    return std::sqrt(num / den);
}
#endif
