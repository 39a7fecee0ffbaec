// One-row items in registers: a standalone probe (not part of the library
// or the bench; NOTES.md v29). It times a decode apply of n = 64 rows, each
// naming its own rank-16 adapter (4096 x 4096, bf16), in the row-register
// form: a cluster of C blocks per row, every block loading its 1/C slice of
// A, x, B and y straight into registers as soon as the row's entry is known
// (nothing staged in shared memory), the rank vector summed over the
// cluster by pushing partials (st.async), then the expand from the
// registers. `rows_reg` is the probe's own kernel (clusters of 8, 4 or 2;
// its F flags add, one at a time, what the library's general form needs);
// `library_rows` runs the library's `cuda/bgmv_rows.cu` body (`_full` or
// general) under the same harness. Timed the way `xtask bench` times an op
// in a graph: many calls captured in one CUDA graph over rotating input
// sets (16 of 17 MB, so nothing is left in L2), replayed, per-call time =
// replay time / calls, median of 21 replays. Copy 0 is checked against a
// host reference first.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -arch=sm_90a -O3 -std=c++17 -o decode_rows decode_rows.cu && ./decode_rows
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#define PROBE_LIBRARY_ROWS
#include "probe.cuh"

constexpr int N_ROWS = 64;
constexpr int IN = 4096;
constexpr int OUT = 4096;
constexpr int R = 16;
constexpr int ENTRIES = 64;

struct Params {
    const bf16_t* x;
    bf16_t* y;
    const int* idx;
    const PairEntry* table;
    int n_entries;
};

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ u32 peer_addr(const void* local, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    return remote;
}

// F (bisection of the library form's differences): 1 B masked by rank,
// 2 loads guarded by the split8 slices, 4 the transposed butterfly, 8 y
// through the library's helpers, 16 the entry through checked_entry.
template <int C, int NT, int MINB, int F = 0>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(NT, MINB) rows_reg(const Params p) {
    constexpr int CH = IN / (8 * C);  // 8-column pieces per block and rank row
    constexpr int KG = NT / CH;       // rank rows loaded at once by the block
    constexpr int RPT = R / KG;       // rank rows per thread
    constexpr int OPT = OUT / (C * NT);
    constexpr int NW = NT / 32;
    static_assert(CH * KG == NT && RPT * KG == R && OPT * C * NT == OUT && CH % 32 == 0, "shape");
    static_assert(OPT == 2 || OPT == 4, "y as one 4- or 8-byte word");
    __shared__ __align__(16) PairEntry s_table[ENTRIES];
    __shared__ float s_part[NW][RPT];
    __shared__ __align__(16) float s_mine[R];
    __shared__ __align__(16) float s_recv[C][R];
    __shared__ __align__(16) float s_t[R];
    __shared__ __align__(8) u64 s_bar;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int q = (int)blockIdx.x % C;
    const int row = (int)blockIdx.y;
    const int e = __ldg(p.idx + row);
    for (int w = tid; w < p.n_entries * (int)sizeof(PairEntry) / 16; w += NT)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr((char*)s_table + 16 * w)),
                     "l"((const char*)p.table + 16 * w)
                     : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
    if (tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&s_bar)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    // Uniform over the cluster: every block reads the same row.
    if (e < 0 || e >= p.n_entries) {
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
        return;
    }
    PairEntry en = s_table[e];
    if (F & 16) {
        checked_entry(e, p.n_entries, s_table, R, 0ull, false, &en);
        if (en.rank == 0) {
            asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
            return;
        }
    }
    const int rank = (int)en.rank;
    int k0, k1, o0, o1;
    split8(IN, C, q, k0, k1);
    split8(OUT, C, q, o0, o1);
    const bf16_t* A = (const bf16_t*)en.a;
    const bf16_t* B = (const bf16_t*)en.b;
    const int c = tid % CH;
    const int kg = tid / CH;
    const int col = q * (IN / C) + 8 * c;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 a[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
        const int k = kg + KG * j;
        a[j] = k < rank && (!(F & 2) || col < k1) ? ldg16(A + (u64)k * IN + col) : zero;
    }
    const uint4 xv = !(F & 2) || col < k1 ? ldg16(p.x + (u64)row * IN + col) : zero;
    const int o = q * (OUT / C) + OPT * tid;
    const int live = max(0, min(OPT, o1 - o));
    uint4 b[2 * OPT];
#pragma unroll
    for (int i = 0; i < 2 * OPT; ++i) b[i] = !(F & 2) || i / 2 < live ? ldg16(B + (u64)o * R + 8 * i) : zero;
    bf16_t* yp = p.y + (u64)row * OUT + o;
    u32 yw[4];
    const bool y_vec = live == OPT && ((u64)yp % 8) == 0ull;
    if constexpr (OPT == 4 && (F & 8)) {
        bgr_load_y(yp, y_vec, live, yw);
    } else if constexpr (OPT == 4) {
        const uint2 v = *(const uint2*)yp;
        yw[0] = v.x;
        yw[1] = v.y;
    } else {
        yw[0] = *(const u32*)yp;
    }

    float s[RPT];
#pragma unroll
    if constexpr ((F & 4) && RPT == 8) {
#pragma unroll
        for (int j = 0; j < RPT; ++j) s[j] = dot8(a[j], xv, 0.f);
#pragma unroll
        for (int h = 4, bit = 16; h >= 1; h >>= 1, bit >>= 1) {
            const bool upper = (lane & bit) != 0;
#pragma unroll
            for (int i = 0; i < h; ++i) {
                const float keep = upper ? s[i + h] : s[i];
                const float send = upper ? s[i] : s[i + h];
                s[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
            }
        }
        float v = s[0];
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        if ((lane & 3) == 0) s_part[warp][((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1)] = v;
    } else {
#pragma unroll
        for (int j = 0; j < RPT; ++j) s[j] = warp_sum(dot8(a[j], xv, 0.f));
        if (lane == 0)
#pragma unroll
            for (int j = 0; j < RPT; ++j) s_part[warp][j] = s[j];
    }
    __syncthreads();
    if (tid < R) {
        const int g = tid % KG;
        const int j = tid / KG;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < CH / 32; ++w) v += s_part[g * (CH / 32) + w][j];
        s_mine[tid] = v;
    }
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");  // the peers' mbarriers are initialised
    if (warp == 0) {
        __syncwarp();
        if (lane == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&s_bar)),
                         "r"((u32)(C * R * 4))
                         : "memory");
        if (lane < 4 * C) {
            const u32 r = (u32)(lane / 4);
            const int k4 = 4 * (lane % 4);
            const float4 v = *(const float4*)&s_mine[k4];
            asm volatile(
                "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                    peer_addr(&s_recv[q][k4], r)),
                "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
                "r"(__float_as_uint(v.w)), "r"(peer_addr(&s_bar, r))
                : "memory");
        }
    }
    u32 done = 0;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, "
            "p;\n}"
            : "=r"(done)
            : "r"(smem_addr(&s_bar))
            : "memory");
    } while (!done);
    if (tid < R) {
        float v = 0.f;
#pragma unroll
        for (int r = 0; r < C; ++r) v += s_recv[r][tid];
        s_t[tid] = v * en.scale;
    }
    __syncthreads();
    float t[R];
#pragma unroll
    for (int k = 0; k < R; k += 4) {
        const float4 v = *(const float4*)&s_t[k];
        t[k] = v.x;
        t[k + 1] = v.y;
        t[k + 2] = v.z;
        t[k + 3] = v.w;
    }
    if (F & 1) {
#pragma unroll
        for (int i = 0; i < 2 * OPT; ++i) {
            const int h = (i & 1) * 8;
            b[i] = make_uint4(b[i].x & rank_mask(h, rank), b[i].y & rank_mask(h + 2, rank), b[i].z & rank_mask(h + 4, rank),
                              b[i].w & rank_mask(h + 6, rank));
        }
    }
    u32 outw[OPT / 2];
    float d[OPT];
#pragma unroll
    for (int i = 0; i < OPT; i += 2) {
        const float d0 = dot8f(b[2 * i + 1], t + 8, dot8f(b[2 * i], t, 0.f));
        const float d1 = dot8f(b[2 * i + 3], t + 8, dot8f(b[2 * i + 2], t, 0.f));
        d[i] = d0;
        d[i + 1] = d1;
        outw[i / 2] = pack_bf2(bf_lo(yw[i / 2]) + d0, bf_hi(yw[i / 2]) + d1);
    }
    if constexpr (OPT == 4 && (F & 8)) {
        if (live > 0) bgr_store_y(yp, y_vec, live, yw, d);
    } else if constexpr (OPT == 4) {
        *(uint2*)yp = make_uint2(outw[0], outw[1]);
    } else {
        *(u32*)yp = outw[0];
    }
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int copies = 16;
    srand(7);
    std::vector<ProbeCopy> cs = probe_decode_copies(copies, N_ROWS, IN, OUT, R, ENTRIES, [](int) {
        std::vector<int> perm(N_ROWS);
        for (int r = 0; r < N_ROWS; ++r) perm[r] = r;
        for (int r = N_ROWS - 1; r > 0; --r) std::swap(perm[r], perm[rand() % (r + 1)]);
        return perm;
    });
    cudaStream_t st;
    CK(cudaStreamCreate(&st));

    // Copy bandwidth (bytes read + written), as the bench measures it.
    probe_print_floor(st, N_ROWS, IN, OUT, R, ENTRIES);

    auto run_form = [&](const char* name, auto kernel, int C, int NT) {
        int clusters = 0;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(C, N_ROWS, 1);
        cfg.blockDim = dim3(NT, 1, 1);
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = C;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        CK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, kernel));
        auto launch = [&](const ProbeCopy& c) {
            if constexpr (std::is_invocable_v<decltype(kernel), BgeParams>) {
                const BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES);
                kernel<<<dim3(C, N_ROWS, 1), NT, 0, st>>>(b);
            } else {
                Params p{c.x, c.y, c.idx, c.table, ENTRIES};
                kernel<<<dim3(C, N_ROWS, 1), NT, 0, st>>>(p);
            }
        };
        // Correctness on copy 0 from y = 0: the result is the rounded delta.
        const double rel = probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, launch);

        const ProbeTime tm = probe_time_graph(st, copies * 4, [&](int k) { launch(cs[k % copies]); });
        printf("%-28s %6.2f us (p10 %.2f, p90 %.2f)  rel err %.2e  %d regs, %zu B spilled, %d clusters resident\n",
               name, tm.median, tm.p10, tm.p90, rel, fa.numRegs, (size_t)fa.localSizeBytes, clusters);
    };
    for (int pass = 0; pass < 2; ++pass) {
        run_form("clusters of 8, 256 threads", rows_reg<8, 256, 4>, 8, 256);
        run_form("clusters of 4, 256 threads", rows_reg<4, 256, 2>, 4, 256);
        run_form("clusters of 2, 512 threads", rows_reg<2, 512, 1>, 2, 512);
        run_form("c2 F1 B masked", rows_reg<2, 512, 1, 1>, 2, 512);
        run_form("c2 F2 guarded loads", rows_reg<2, 512, 1, 2>, 2, 512);
        run_form("c2 F4 butterfly", rows_reg<2, 512, 1, 4>, 2, 512);
        run_form("c2 F8 y helpers", rows_reg<2, 512, 1, 8>, 2, 512);
        run_form("c2 F16 checked entry", rows_reg<2, 512, 1, 16>, 2, 512);
        run_form("c2 F31 all", rows_reg<2, 512, 1, 31>, 2, 512);
        run_form("library full", library_rows<true>, 2, 512);
        run_form("library general", library_rows<false>, 2, 512);
    }
    printf("empty kernel in a graph %.2f us\n", probe_empty_in_graph(st));
    return 0;
}
