// A repro of the row-register form on tiny calls (not part of the library
// or the bench; NOTES.md v30): the library's `bgmv_rows` general body on
// n of a few rows, in = 8, several narrow targets, against a host
// reference, many launches each on fresh y; counts per (case, row, target)
// the launches whose target came back wrong, and of those how many left y
// exactly unchanged.
//
// It found the miscompile of NOTES.md v30: a target whose last thread has
// 1 output, followed by another target in the same 8 bytes of y, lost the
// second target's first columns (y left as it was) in most launches.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -arch=sm_90a -O3 -std=c++17 -o rows_tiny rows_tiny.cu && ./rows_tiny [launches]
// -DROWS_SRC='"path"' builds it on another copy of bgmv_rows.cu (an older
// revision, to compare the two in one call).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define PROBE_LIBRARY_ROWS
#include "probe.cuh"

static bf16_t host_f2bf(float f) {
    u32 u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}
static float urand() { return (float)rand() / (float)RAND_MAX * 2.f - 1.f; }

struct Case {
    const char* name;
    int n;
    int in;
    std::vector<int> outs;
    std::vector<int> idx;
    int y_stride;  // 0: sum of outs rounded up to 8, + 8
    int quiet_target = -1;  // this target's entries of rank 0 (its blocks exit at once)
};

static void run_case(const Case& cs, int launches) {
    const int R = 16;
    const int entries = 17;
    const int nt = (int)cs.outs.size();
    int width = 0;
    std::vector<int> off(nt);
    for (int t = 0; t < nt; ++t) {
        off[t] = width;
        width += cs.outs[t];
    }
    const int ys = cs.y_stride ? cs.y_stride : (width + 7) / 8 * 8 + 8;
    const int xs = (cs.in + 7) / 8 * 8 + 8;
    // Weights: per target, per entry, A [16, in] then B [out, 16]; rows past the rank poisoned.
    std::vector<std::vector<bf16_t>> ha(nt), hb(nt);
    std::vector<std::vector<u32>> rank(nt);
    for (int t = 0; t < nt; ++t) {
        ha[t].resize((size_t)entries * R * cs.in);
        hb[t].resize((size_t)entries * cs.outs[t] * R);
        rank[t].resize(entries);
        for (int e = 0; e < entries; ++e) {
            const u32 r = t == cs.quiet_target ? 0u : (u32)(1 + (e + 3 * t) % 16);
            rank[t][e] = r;
            for (int k = 0; k < R; ++k)
                for (int i = 0; i < cs.in; ++i)
                    ha[t][((size_t)e * R + k) * cs.in + i] = k < (int)r ? host_f2bf(urand()) : (bf16_t)0x7fc0;
            for (int o = 0; o < cs.outs[t]; ++o)
                for (int k = 0; k < R; ++k)
                    hb[t][((size_t)e * cs.outs[t] + o) * R + k] = k < (int)r ? host_f2bf(urand()) : (bf16_t)0x7fc0;
        }
    }
    std::vector<bf16_t> hx((size_t)cs.n * xs), hy0((size_t)cs.n * ys);
    for (auto& v : hx) v = host_f2bf(urand());
    for (auto& v : hy0) v = host_f2bf(urand());
    // Reference.
    std::vector<double> ref((size_t)cs.n * ys);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = host_bf(hy0[i]);
    for (int r = 0; r < cs.n; ++r) {
        const int e = cs.idx[r];
        if (e < 0) continue;
        for (int t = 0; t < nt; ++t) {
            double tv[16] = {0};
            for (int k = 0; k < (int)rank[t][e]; ++k) {
                double s = 0;
                for (int i = 0; i < cs.in; ++i)
                    s += (double)host_bf(ha[t][((size_t)e * R + k) * cs.in + i]) * host_bf(hx[(size_t)r * xs + i]);
                tv[k] = s * 0.5;
            }
            for (int o = 0; o < cs.outs[t]; ++o) {
                double d = 0;
                for (int k = 0; k < (int)rank[t][e]; ++k)
                    d += (double)host_bf(hb[t][((size_t)e * cs.outs[t] + o) * R + k]) * tv[k];
                ref[(size_t)r * ys + off[t] + o] += d;
            }
        }
    }
    // Device.
    bf16_t *dx, *dy;
    int* didx;
    u64* dfault;
    CK(cudaMalloc(&dx, hx.size() * 2));
    CK(cudaMalloc(&dy, hy0.size() * 2));
    CK(cudaMalloc(&didx, cs.n * 4));
    CK(cudaMalloc(&dfault, 8));
    CK(cudaMemset(dfault, 0, 8));
    CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(didx, cs.idx.data(), cs.n * 4, cudaMemcpyHostToDevice));
    PairEntry* dtable;
    CK(cudaMalloc(&dtable, sizeof(PairEntry) * entries * nt));
    BgeParams p;
    memset(&p, 0, sizeof p);
    for (int t = 0; t < nt; ++t) {
        bf16_t *da, *db;
        CK(cudaMalloc(&da, ha[t].size() * 2));
        CK(cudaMalloc(&db, hb[t].size() * 2));
        CK(cudaMemcpy(da, ha[t].data(), ha[t].size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(db, hb[t].data(), hb[t].size() * 2, cudaMemcpyHostToDevice));
        std::vector<PairEntry> tab(entries);
        for (int e = 0; e < entries; ++e)
            tab[e] = PairEntry{(u64)(da + (size_t)e * R * cs.in), (u64)(db + (size_t)e * cs.outs[t] * R), 0.5f, rank[t][e]};
        CK(cudaMemcpy(dtable + entries * t, tab.data(), sizeof(PairEntry) * entries, cudaMemcpyHostToDevice));
        p.targets[t] = LoraTarget{(u64)(dtable + entries * t), entries, cs.outs[t], off[t], 0};
    }
    p.x = (u64)dx;
    p.y = (u64)dy;
    p.idx = (u64)didx;
    p.fault = (u64)dfault;
    p.n_rows = cs.n;
    p.in_dim = cs.in;
    p.x_stride = xs;
    p.y_stride = ys;
    p.overlap = 0;
    p.stage_cols = 0;
    std::vector<int> bad((size_t)cs.n * nt, 0), unchanged((size_t)cs.n * nt, 0);
    std::vector<bf16_t> hy(hy0.size());
    bool shown = false;
    for (int l = 0; l < launches; ++l) {
        CK(cudaMemcpy(dy, hy0.data(), hy0.size() * 2, cudaMemcpyHostToDevice));
        library_rows<false><<<dim3(2, cs.n, nt), BGR_THREADS>>>(p);
        CK(cudaGetLastError());
        CK(cudaMemcpy(hy.data(), dy, hy.size() * 2, cudaMemcpyDeviceToHost));
        for (int r = 0; r < cs.n; ++r)
            for (int t = 0; t < nt; ++t) {
                bool wrong = false, same = true;
                for (int o = 0; o < cs.outs[t]; ++o) {
                    const size_t i = (size_t)r * ys + off[t] + o;
                    const double g = host_bf(hy[i]);
                    if (!(fabs(g - ref[i]) <= 0.02 + 0.02 * fabs(ref[i]))) wrong = true;
                    if (hy[i] != hy0[i]) same = false;
                }
                if (wrong && !shown) {
                    shown = true;
                    printf("  first bad: launch %d row %d target %d; cols y0/ref/gpu:", l, r, t);
                    for (int o = 0; o < width; ++o) {
                        const size_t i = (size_t)r * ys + o;
                        printf(" %d:%.3f/%.3f/%.3f", o, host_bf(hy0[i]), ref[i], host_bf(hy[i]));
                    }
                    printf("\n");
                }
                if (wrong) {
                    bad[(size_t)r * nt + t]++;
                    if (same) unchanged[(size_t)r * nt + t]++;
                }
            }
    }
    u64 fault = 0;
    CK(cudaMemcpy(&fault, dfault, 8, cudaMemcpyDeviceToHost));
    printf("%-28s n=%d in=%d ys=%d fault=%llu:", cs.name, cs.n, cs.in, ys, (unsigned long long)fault);
    int total = 0;
    for (int r = 0; r < cs.n; ++r)
        for (int t = 0; t < nt; ++t) {
            const int b = bad[(size_t)r * nt + t];
            total += b;
            if (b) printf(" [r%d t%d out%d off%d: %d bad, %d unchanged]", r, t, cs.outs[t], off[t], b,
                          unchanged[(size_t)r * nt + t]);
        }
    printf(" total %d of %d launches\n", total, launches);
}

int main(int argc, char** argv) {
    const int launches = argc > 1 ? atoi(argv[1]) : 300;
    srand(11);
    const Case cases[] = {
        {"outs 8,5,3", 3, 8, {8, 5, 3}, {2, 1, 0}, 0},
        {"outs 8,5,3 t1 quiet", 3, 8, {8, 5, 3}, {2, 1, 0}, 0, 1},
        {"outs 8,5,3 t0 quiet", 3, 8, {8, 5, 3}, {2, 1, 0}, 0, 0},
        {"outs 13,3", 3, 8, {13, 3}, {2, 1, 0}, 0},
        {"outs 5,3", 3, 8, {5, 3}, {2, 1, 0}, 0},
        {"outs 1,3", 3, 8, {1, 3}, {2, 1, 0}, 0},
        {"outs 2,3", 3, 8, {2, 3}, {2, 1, 0}, 0},
        {"outs 1,3 t0 quiet", 3, 8, {1, 3}, {2, 1, 0}, 0, 0},
        {"outs 1,2", 3, 8, {1, 2}, {2, 1, 0}, 0},
        {"outs 1,2 one row", 1, 8, {1, 2}, {0}, 0},
        {"outs 1,2 one row t0 quiet", 1, 8, {1, 2}, {0}, 0, 0},
        {"outs 1,9", 3, 8, {1, 9}, {2, 1, 0}, 0},
        {"outs 3 stride 17", 3, 8, {3}, {2, 1, 0}, 17},
    };
    for (const Case& c : cases) run_case(c, launches);
    return 0;
}
