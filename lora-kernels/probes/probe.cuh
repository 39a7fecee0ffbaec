// What the standalone probes share (not part of the library): the CUDA
// error check, the copy bandwidth and in-a-graph timing the way `xtask
// bench` measures them, and, with PROBE_LIBRARY_ROWS defined before the
// include, the library's decode kernels (bgmv.cu, bgmv_entry.cu and
// bgmv_rows.cu; ENTRY_SRC or ROWS_SRC name another copy of the last two to
// build on), the row-register body under a probe's own declaration, the
// decode input sets, the library's parameter block, the host reference
// check and the floor. PROBE_DECODE_N256 adds the bench's n = 256 shape.
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
    // Every replay enqueued before any is waited for (as the bench does), so
    // the device runs them back to back instead of idling between them.
    std::vector<cudaEvent_t> ev(2 * runs);
    for (auto& event : ev) CK(cudaEventCreate(&event));
    for (int k = 0; k < runs; ++k) {
        CK(cudaEventRecord(ev[2 * k], st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(ev[2 * k + 1], st));
    }
    CK(cudaStreamSynchronize(st));
    std::vector<float> ts(runs);
    for (int k = 0; k < runs; ++k) {
        float ms = 0.f;
        CK(cudaEventElapsedTime(&ms, ev[2 * k], ev[2 * k + 1]));
        ts[k] = ms * 1000.f / calls;
    }
    for (auto& event : ev) CK(cudaEventDestroy(event));
    std::sort(ts.begin(), ts.end());
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return ProbeTime{ts[runs / 2], ts[runs / 10], ts[runs - 1 - runs / 10]};
}

// The f-quantile (0..1) of v, nearest rank.
static double probe_pct(std::vector<double> v, double f) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[(size_t)(f * (v.size() - 1) + 0.5)];
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
#ifdef ENTRY_SRC
#include ENTRY_SRC
#else
#include "../cuda/bgmv_entry.cu"
#endif
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
    bgr_body<bf16_t, FULL, false>(p);
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

// One input set of a decode apply: A [entries][rank][in], B
// [entries][out][rank], x [n_rows][in], y [n_rows][out], idx [n_rows] and the
// entries' table.
struct ProbeCopy {
    bf16_t *a, *b, *x, *y;
    int* idx;
    PairEntry* table;
};

// `copies` input sets, filled as every probe fills them (A and B at 0.05,
// x at 1, y at 0.5, scale 0.5); copy i's row indices are `idx_of(i)`; y's
// allocation has `y_pad_bytes` more past its rows (a probe's own use).
template <class IdxOf>
static std::vector<ProbeCopy> probe_decode_copies(int copies, int n_rows, int in, int out, int rank, int entries,
                                                  IdxOf idx_of, size_t y_pad_bytes = 0) {
    const size_t a_elems = (size_t)entries * rank * in, b_elems = (size_t)entries * out * rank;
    const size_t x_elems = (size_t)n_rows * in, y_elems = (size_t)n_rows * out;
    std::vector<ProbeCopy> cs(copies);
    for (int i = 0; i < copies; ++i) {
        ProbeCopy& c = cs[i];
        CK(cudaMalloc(&c.a, a_elems * 2));
        CK(cudaMalloc(&c.b, b_elems * 2));
        CK(cudaMalloc(&c.x, x_elems * 2));
        CK(cudaMalloc(&c.y, y_elems * 2 + y_pad_bytes));
        CK(cudaMalloc(&c.idx, (size_t)n_rows * 4));
        CK(cudaMalloc(&c.table, (size_t)entries * sizeof(PairEntry)));
        probe_fill_bf16<<<1024, 256>>>(c.a, a_elems, 11u + 4u * i, 0.05f);
        probe_fill_bf16<<<1024, 256>>>(c.b, b_elems, 12u + 4u * i, 0.05f);
        probe_fill_bf16<<<1024, 256>>>(c.x, x_elems, 13u + 4u * i, 1.f);
        probe_fill_bf16<<<1024, 256>>>(c.y, y_elems, 14u + 4u * i, 0.5f);
        const std::vector<int> idx = idx_of(i);
        CK(cudaMemcpy(c.idx, idx.data(), (size_t)n_rows * 4, cudaMemcpyHostToDevice));
        std::vector<PairEntry> t(entries);
        for (int e = 0; e < entries; ++e)
            t[e] = PairEntry{(u64)(c.a + (size_t)e * rank * in), (u64)(c.b + (size_t)e * out * rank), 0.5f, (u32)rank};
        CK(cudaMemcpy(c.table, t.data(), (size_t)entries * sizeof(PairEntry), cudaMemcpyHostToDevice));
    }
    CK(cudaDeviceSynchronize());
    return cs;
}

// Frees what probe_decode_copies allocated.
static void probe_free_copies(std::vector<ProbeCopy>& cs) {
    for (ProbeCopy& c : cs) {
        CK(cudaFree(c.a));
        CK(cudaFree(c.b));
        CK(cudaFree(c.x));
        CK(cudaFree(c.y));
        CK(cudaFree(c.idx));
        CK(cudaFree(c.table));
    }
    cs.clear();
}

// The decode floor's bytes: every entry's A and B, x read, y read and written.
static double probe_decode_floor_bytes(int n_rows, int in, int out, int rank, int entries) {
    return (double)entries * ((double)rank * in + (double)out * rank) * 2 + (double)n_rows * (in * 2.0 + out * 4.0);
}

// The library's parameter block for a probe copy: one target over the whole
// table, dense x and y rows; `stage_cols` staged outputs (entry form), `fault`
// the fault word's address (0 where the kernel is given none).
static BgeParams probe_library_params(const ProbeCopy& c, int n_rows, int in, int out, int entries, u64 fault = 0,
                                      int stage_cols = 0) {
    BgeParams b = {};
    b.x = (u64)c.x;
    b.y = (u64)c.y;
    b.idx = (u64)c.idx;
    b.fault = fault;
    b.n_rows = n_rows;
    b.in_dim = in;
    b.x_stride = in;
    b.y_stride = out;
    b.stage_cols = stage_cols;
    b.targets[0] = LoraTarget{(u64)c.table, entries, out, 0, 0};
    return b;
}

// The entry-clustered form's dynamic shared memory (bgmv/entry.rs
// `smem_plan`) at rank stride 16 in the push form: clusters of `cluster`,
// `n_rows` rows, `stage_cols` staged outputs per block.
static int probe_entry_smem(int cluster, int n_rows, int stage_cols) {
    const int base = (4 * ((8 + 2 * cluster) * 16 * 16 + 16 * (16 + 4) + n_rows) + 15) / 16 * 16;
    return base + (stage_cols > 0 ? stage_cols * 16 * 2 + 16 * (stage_cols + 32) * 2 : 0);
}

// Measures the copy bandwidth and prints it with the decode floor (and the
// 50 % line) of a shape; returns the bandwidth, GB/s.
static double probe_print_floor(cudaStream_t st, int n_rows, int in, int out, int rank, int entries) {
    const double bw = probe_copy_bandwidth(st);
    const double floor_bytes = probe_decode_floor_bytes(n_rows, in, out, rank, entries);
    printf("copy bandwidth %.0f GB/s; floor %.2f us (50 %%: %.2f us)\n", bw, floor_bytes / bw / 1e3,
           2.0 * floor_bytes / bw / 1e3);
    return bw;
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

// A form's relative error on copy c0: y zeroed, one launch, the host
// reference; y refilled afterwards as probe_decode_copies filled it.
template <class Launch>
static double probe_check_copy(cudaStream_t st, const ProbeCopy& c0, int n_rows, int in, int out, int rank, int entries,
                               Launch launch) {
    const size_t y_elems = (size_t)n_rows * out;
    CK(cudaMemset(c0.y, 0, y_elems * 2));
    launch(c0);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    const double rel = probe_apply_error(ProbeApply{c0.a, c0.b, c0.x, c0.y, c0.idx, n_rows, in, out, rank, entries, 0.5f});
    probe_fill_bf16<<<1024, 256, 0, st>>>(c0.y, y_elems, 14u, 0.5f);
    return rel;
}
#endif

#ifdef PROBE_DECODE_N256
// The bench's n = 256 decode row: 256 rows over 32 rank-16 adapters, 4096 x 4096.
constexpr int N_ROWS = 256;
constexpr int IN = 4096;
constexpr int OUT = 4096;
constexpr int R = 16;
constexpr int ENTRIES = 32;
#endif
