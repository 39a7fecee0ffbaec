// Forms for the bench's n = 256 row (256 rows naming 32 rank-16 adapters,
// 8 rows each, 4096 x 4096): a standalone probe (not part of the library or
// the bench; NOTES.md v33). It times, in a graph of many calls over 24
// rotating input sets (cold, as the bench) and over 2 (every byte in L2):
//   - the library's entry-clustered kernel as the bench stages it
//     (`bgmv_entry_c8_r16`) and its register kernels (`bgmv_entry_c8_r16_reg`, from
//     bgmv_entry.cu or ENTRY_SRC);
//   - `wide_entry`: a cluster of CK blocks of T threads per entry, CO
//     clusters per entry splitting the outputs (CK = 2, CO = 2 at one block
//     a multiprocessor reads each entry's A and x twice, through L2; CK = 8
//     lands as the library's clusters do), every byte a block reads
//     requested into registers at once (A and x, then B and y), in the
//     copies of `WideMode`: whole, or with one step removed (what that step
//     costs), or with A and B requested before the row scan;
//   - with `cudaOccupancyMaxActiveClusters` for each, and a timeline of the
//     traced form (thread 0 of each block stamps the global timer).
//
// Block (q of CK, output part h of CO, entry e): the rows naming e (a ballot
// per warp); NCH chunks of 32 columns of A (ranks g, g + 8) and x a warp,
// 8 columns a lane (as bgmv_entry.cu), and NG groups of 32 outputs a warp:
// B's 4 tiles (8 bytes a lane) and y's 16 bytes of rows g and g + 8; shrink
// (m16n8k16, M = ranks, N = rows), warps' partials summed in shared
// memory, pushed to the cluster's peers (st.async); expand (M = rows, N =
// outputs, t as hi + lo), y stored.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o entry_wide entry_wide.cu && ./entry_wide
#include <cstdint>

// Per block: stamps, then the multiprocessor's number (written past y).
constexpr int TRACE_SLOTS = 8;
constexpr int TRACE_SM = 7;
constexpr int TRACE_STAMPS = 7;
constexpr unsigned long long TRACE_Y_ELEMS = 256ull * 4096ull;

#define PROBE_LIBRARY_ROWS
#define PROBE_DECODE_N256
#include "probe.cuh"

#define WIDE_STAMP(k)                                                           \
    do {                                                                        \
        if (TRACE && threadIdx.x == 0) {                                        \
            unsigned long long gt_;                                             \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt_)::"memory");   \
            tr[k] = gt_;                                                        \
        }                                                                       \
    } while (0)

// st_global16: the library's (bgmv_entry.cu).
// What a launch does (step-removal copies measure what a step costs):
enum WideMode {
    FULL = 0,
    NO_EXPAND = 1,     // no B or y loaded, no expand (t[0] stored so the sum is live)
    LOADS_ONLY = 2,    // every load of FULL, folded into one value; no arithmetic
    LOADS_STATIC = 3,  // LOADS_ONLY with the rows known without idx (row i names entry i % 32)
    NO_EXCHANGE = 4,   // FULL with each block's own partial as t (wrong; timing only)
    EARLY_AB = 5,      // FULL with A and B requested before the row scan
};

// CK blocks a cluster (the K split), T threads, NCH shrink chunks and NG
// expand groups a warp at most, MINB blocks a multiprocessor for the
// register bound; CO = gridDim.x / CK output parts.
template <int CK, int T, int NCH, int NG, int MODE, bool TRACE = false, int MINB = 1>
__global__ void __launch_bounds__(T, MINB) wide_entry(const BgeParams p) {
    constexpr int W = T / 32;
    constexpr int PART = 16 * 16;  // ranks x rows of one partial (f32)
    constexpr int TP = 20;         // t row pitch
    constexpr bool EXPAND = MODE != NO_EXPAND;
    constexpr bool LOADS = MODE == LOADS_ONLY || MODE == LOADS_STATIC;
    extern __shared__ __align__(16) unsigned char smem[];
    float* s_red = (float*)smem;          // [W][PART]
    float* s_recv = s_red + W * PART;     // [CK][PART]
    float* s_t = s_recv + CK * PART;      // [16][TP]
    int* s_rows = (int*)(s_t + 16 * TP);  // [256]
    __shared__ int s_wcount[W];
    __shared__ int s_live;  // 1: read after the loads' fence, so no mma can be scheduled above it
    __shared__ __align__(8) u64 s_mbar;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    const int q = (int)(blockIdx.x % CK);
    const int h = (int)(blockIdx.x / CK);
    const int co = (int)(gridDim.x / CK);
    const int e = (int)blockIdx.y;
    unsigned long long* tr = nullptr;
    if (TRACE && tid == 0) {
        tr = (unsigned long long*)((unsigned short*)p.y + TRACE_Y_ELEMS) +
             (size_t)(blockIdx.y * gridDim.x + blockIdx.x) * TRACE_SLOTS;
        unsigned sm_;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));
        tr[TRACE_SM] = sm_;
    }
    WIDE_STAMP(0);
    const LoraTarget tg = p.targets[0];
    const int raw = MODE != LOADS_STATIC && tid < p.n_rows ? ((const int*)p.idx)[tid] : -1;
    const PairEntry en = ((const PairEntry*)tg.table)[e];
    const bf16_t* A = (const bf16_t*)en.a;
    const bf16_t* B = (const bf16_t*)en.b;
    const int in = p.in_dim;
    int k0, k1, o0, o1;
    split8(in, CK, q, k0, k1);
    split8(tg.out_dim, CK * co, h * CK + q, o0, o1);
    const int n_chunks = (k1 - k0 + 31) / 32;
    const int n_groups = (o1 - o0 + 31) / 32;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 xa[NCH], xb[NCH], a0[NCH], a1[NCH];
    uint2 bw[NG][4];
    uint4 ya[NG], yb[NG];
    auto load_a = [&]() {
#pragma unroll
        for (int u = 0; u < NCH; ++u) {
            const int ch = warp + u * W;
            const int col = k0 + ch * 32 + c * 8;
            const bool ok = ch < n_chunks && col + 8 <= k1;
            a0[u] = ok && g < (int)en.rank ? ldg16(A + (u64)g * in + col) : zero;
            a1[u] = ok && g + 8 < (int)en.rank ? ldg16(A + (u64)(g + 8) * in + col) : zero;
        }
    };
    auto load_b = [&]() {
#pragma unroll
        for (int u = 0; u < NG; ++u) {
            const int base = o0 + (warp + u * W) * 32;
            const bool b_ok = warp + u * W < n_groups && base + 8 * (g >> 1) + 8 <= o1;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int bo = base + 8 * (g >> 1) + 2 * j + (g & 1);
                bw[u][j] = b_ok ? __ldg((const uint2*)(B + (u64)bo * 16 + 4 * c)) : make_uint2(0u, 0u);
            }
        }
    };
    if (MODE == EARLY_AB) {
        load_a();
        load_b();
    }
    int n_found = 0;
    if (tid == 0) s_live = 1;
    if (MODE == LOADS_STATIC) {
        if (tid < 8) s_rows[tid] = e + 32 * tid;
        n_found = 8;
        __syncthreads();
    } else {
        const bool m = raw == e;
        const unsigned bal = __ballot_sync(0xffffffffu, m);
        if (lane == 0) s_wcount[warp] = __popc(bal);
        __syncthreads();
        int before = 0;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            const int cnt = s_wcount[w];
            before += w < warp ? cnt : 0;
            n_found += cnt;
        }
        if (m) s_rows[before + __popc(bal & ((1u << lane) - 1u))] = tid;
        if (tid == 0) {
            mbar_init(&s_mbar, 1);
            fence_mbar_init();
        }
        __syncthreads();
    }
    WIDE_STAMP(1);
    if (n_found == 0 || en.rank == 0) return;  // uniform over the cluster
    if (!LOADS && MODE != NO_EXCHANGE) cluster_arrive_relaxed();  // waited for before the first push

    const bf16_t* x = (const bf16_t*)p.x;
    bf16_t* y = (bf16_t*)p.y;
    // This probe serves up to 16 rows an entry (one pass).
    const int rows_here = min(16, n_found);
    const int row_a = g < rows_here ? s_rows[g] : -1;
    const int row_b = g + 8 < rows_here ? s_rows[g + 8] : -1;

    // Every load at once: A and x, then B and y.
    if (MODE != EARLY_AB) load_a();
#pragma unroll
    for (int u = 0; u < NCH; ++u) {
        const int ch = warp + u * W;
        const int col = k0 + ch * 32 + c * 8;
        const bool ok = ch < n_chunks && col + 8 <= k1;
        xa[u] = ok && row_a >= 0 ? ldg16(x + (u64)row_a * p.x_stride + col) : zero;
        xb[u] = ok && row_b >= 0 ? ldg16(x + (u64)row_b * p.x_stride + col) : zero;
    }
    if (EXPAND && MODE != EARLY_AB) load_b();
#pragma unroll
    for (int u = 0; u < NG; ++u) {
        const int base = o0 + (warp + u * W) * 32;
        const bool y_ok = EXPAND && warp + u * W < n_groups && base + 8 * c + 8 <= o1;
        ya[u] = y_ok && row_a >= 0 ? *(const uint4*)(y + (u64)row_a * p.y_stride + base + 8 * c) : zero;
        yb[u] = y_ok && row_b >= 0 ? *(const uint4*)(y + (u64)row_b * p.y_stride + base + 8 * c) : zero;
    }
    __syncthreads();  // a scheduling fence: ptxas otherwise starts mma (whose operand moves wait for the loads) before the later loads issue
    WIDE_STAMP(2);
    if (LOADS) {
        u32 f = 0;
#pragma unroll
        for (int u = 0; u < NCH; ++u)
            f ^= xa[u].x ^ xa[u].y ^ xa[u].z ^ xa[u].w ^ xb[u].x ^ xb[u].w ^ a0[u].x ^ a0[u].y ^ a0[u].z ^ a0[u].w ^
                 a1[u].x ^ a1[u].y ^ a1[u].z ^ a1[u].w;
#pragma unroll
        for (int u = 0; u < NG; ++u) {
            f ^= ya[u].x ^ ya[u].y ^ ya[u].z ^ ya[u].w ^ yb[u].x ^ yb[u].w;
#pragma unroll
            for (int j = 0; j < 4; ++j) f ^= bw[u][j].x ^ bw[u][j].y;
        }
        if (f == 0x12345678u) y[0] = (bf16_t)f;
        return;
    }

    // Shrink: acc[nt] is ranks (g, g + 8) x rows 8 nt + (2c, 2c + 1).
    float acc[2][4] = {};
    // ptxas hoists mma (and the moves that wait for their operands) above
    // later loads and even above a barrier: a branch on a value read after
    // the fence keeps every load issued before the first wait.
    const int live = *(volatile int*)&s_live;
    if (live)
#pragma unroll
    for (int u = 0; u < NCH; ++u) {
        mma_k16(acc[0], a0[u].x, a1[u].x, a0[u].y, a1[u].y, xa[u].x, xa[u].y);
        mma_k16(acc[0], a0[u].z, a1[u].z, a0[u].w, a1[u].w, xa[u].z, xa[u].w);
        if (rows_here > 8) {
            mma_k16(acc[1], a0[u].x, a1[u].x, a0[u].y, a1[u].y, xb[u].x, xb[u].y);
            mma_k16(acc[1], a0[u].z, a1[u].z, a0[u].w, a1[u].w, xb[u].z, xb[u].w);
        }
    }
    WIDE_STAMP(3);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        float* r = s_red + (warp * 16 + g) * 16 + 8 * nt + 2 * c;
        *(float2*)r = make_float2(acc[nt][0], acc[nt][1]);
        *(float2*)(r + 8 * 16) = make_float2(acc[nt][2], acc[nt][3]);
    }
    __syncthreads();
    if (MODE == NO_EXCHANGE) {
        if (tid < PART) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < W; ++w) v += s_red[w * PART + tid];
            s_t[(tid % 16) * TP + tid / 16] = v * en.scale;
        }
    } else {
        cluster_wait();  // the peers are running, their mbarriers initialised
        if (tid == 0) mbar_arrive_expect(&s_mbar, (u32)(CK * PART * 4));
        if (tid < PART / 4) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int w = 0; w < W; ++w) {
                const float4 r = *(const float4*)(s_red + w * PART + 4 * tid);
                v.x += r.x;
                v.y += r.y;
                v.z += r.z;
                v.w += r.w;
            }
#pragma unroll
            for (int pq = 0; pq < CK; ++pq)
                st_async_f4(cluster_addr(s_recv + q * PART + 4 * tid, (u32)pq), v, cluster_addr(&s_mbar, (u32)pq));
        }
        mbar_wait(&s_mbar, 0u);
        if (tid < PART) {
            float v = 0.f;
#pragma unroll
            for (int pq = 0; pq < CK; ++pq) v += s_recv[pq * PART + tid];
            s_t[(tid % 16) * TP + tid / 16] = v * en.scale;
        }
    }
    __syncthreads();
    WIDE_STAMP(4);
    if (!EXPAND) {
        if (tid == 0 && row_a >= 0) y[(u64)row_a * p.y_stride + o0] = f2bf(s_t[0]);
        return;
    }

    // Expand: t fragments rows g, g + 8, ranks 4c .. 4c + 3 (hi + lo).
    u32 th[4], tl[4];
    {
        const float* ta = s_t + g * TP + 4 * c;
        const float* tb = s_t + (g + 8) * TP + 4 * c;
        split_pair(ta[0], ta[1], th[0], tl[0]);
        split_pair(tb[0], tb[1], th[1], tl[1]);
        split_pair(ta[2], ta[3], th[2], tl[2]);
        split_pair(tb[2], tb[3], th[3], tl[3]);
    }
    const u32 bm0 = rank_mask(4 * c, (int)en.rank), bm1 = rank_mask(4 * c + 2, (int)en.rank);
#pragma unroll
    for (int u = 0; u < NG; ++u) {
        const int base = o0 + (warp + u * W) * 32;
        const bool y_ok = warp + u * W < n_groups && base + 8 * c + 8 <= o1;
        const u32 wa[4] = {ya[u].x, ya[u].y, ya[u].z, ya[u].w};
        const u32 wb[4] = {yb[u].x, yb[u].y, yb[u].z, yb[u].w};
        float d[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            d[j][0] = bf_lo(wa[j]);
            d[j][1] = bf_hi(wa[j]);
            d[j][2] = bf_lo(wb[j]);
            d[j][3] = bf_hi(wb[j]);
            const u32 b0 = bw[u][j].x & bm0, b1 = bw[u][j].y & bm1;
            mma_k16(d[j], th[0], th[1], th[2], th[3], b0, b1);
            mma_k16(d[j], tl[0], tl[1], tl[2], tl[3], b0, b1);
        }
        if (y_ok && row_a >= 0)
            st_global16(y + (u64)row_a * p.y_stride + base + 8 * c,
                make_uint4(pack_bf2_rn(d[0][0], d[0][1]), pack_bf2_rn(d[1][0], d[1][1]), pack_bf2_rn(d[2][0], d[2][1]),
                           pack_bf2_rn(d[3][0], d[3][1])));
        if (y_ok && row_b >= 0)
            st_global16(y + (u64)row_b * p.y_stride + base + 8 * c,
                make_uint4(pack_bf2_rn(d[0][2], d[0][3]), pack_bf2_rn(d[1][2], d[1][3]), pack_bf2_rn(d[2][2], d[2][3]),
                           pack_bf2_rn(d[3][2], d[3][3])));
    }
    WIDE_STAMP(5);
    // Peers wrote into this block's receive buffer only before its wait
    // above and read nothing of it: it may exit.
    WIDE_STAMP(6);
}

struct WideForm {
    const char* name;
    void (*kernel)(BgeParams);
    int ck, co, threads, smem;

    // The launch: CO clusters of CK blocks per entry (clusters span x).
    cudaLaunchConfig_t config(cudaLaunchAttribute* cluster_attr, cudaStream_t st) const {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(ck * co, ENTRIES, 1);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = st;
        cluster_attr->id = cudaLaunchAttributeClusterDimension;
        cluster_attr->val.clusterDim.x = ck;
        cluster_attr->val.clusterDim.y = 1;
        cluster_attr->val.clusterDim.z = 1;
        cfg.attrs = cluster_attr;
        cfg.numAttrs = 1;
        return cfg;
    }
};

int main() {
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    probe_print_floor(st, N_ROWS, IN, OUT, R, ENTRIES);
    u32* fault = nullptr;
    CK(cudaMalloc(&fault, 16));
    CK(cudaMemset(fault, 0, 16));
    const size_t y_elems = (size_t)N_ROWS * OUT;
    const int max_blocks = 8 * ENTRIES;
    const size_t trace_bytes = (size_t)max_blocks * TRACE_SLOTS * 8;
    // More than half a multiprocessor's shared memory: one block each.
    const int one_per_sm = 120 * 1024;
    std::vector<WideForm> forms = {
        {"c2 x 512 full", (void (*)(BgeParams))wide_entry<2, 512, 4, 2, FULL>, 2, 2, 512, one_per_sm},
        {"c2 x 512 no expand", (void (*)(BgeParams))wide_entry<2, 512, 4, 2, NO_EXPAND>, 2, 2, 512, one_per_sm},
        {"c2 x 512 loads only", (void (*)(BgeParams))wide_entry<2, 512, 4, 2, LOADS_ONLY>, 2, 2, 512, one_per_sm},
        {"c2 x 512 loads, static rows", (void (*)(BgeParams))wide_entry<2, 512, 4, 2, LOADS_STATIC>, 2, 2, 512, one_per_sm},
        {"c2 x 512 no exchange", (void (*)(BgeParams))wide_entry<2, 512, 4, 2, NO_EXCHANGE>, 2, 2, 512, one_per_sm},
        {"c2 x 512 early A, B", (void (*)(BgeParams))wide_entry<2, 512, 4, 2, EARLY_AB>, 2, 2, 512, one_per_sm},
        {"c8 x 256 full", (void (*)(BgeParams))wide_entry<8, 256, 2, 2, FULL, false, 3>, 8, 1, 256, 48 * 1024},
        {"c8 x 256 loads only", (void (*)(BgeParams))wide_entry<8, 256, 2, 2, LOADS_ONLY, false, 3>, 8, 1, 256, 48 * 1024},
        {"c8 x 256 early A, B", (void (*)(BgeParams))wide_entry<8, 256, 2, 2, EARLY_AB, false, 3>, 8, 1, 256, 48 * 1024},
        {"c2 x 512 full, traced", (void (*)(BgeParams))wide_entry<2, 512, 4, 2, FULL, true>, 2, 2, 512, one_per_sm},
    };
    for (const WideForm& f : forms) {
        CK(cudaFuncSetAttribute(f.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, f.smem));
        CK(cudaFuncSetAttribute(f.kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, f.kernel));
        cudaLaunchAttribute at;
        const cudaLaunchConfig_t cfg = f.config(&at, st);
        int maxc = 0;
        CK(cudaOccupancyMaxActiveClusters(&maxc, (void*)f.kernel, &cfg));
        printf("%-26s %3d regs, %zu B spilled; max active clusters %d (launch %d)\n", f.name, fa.numRegs,
               (size_t)fa.localSizeBytes, maxc, f.co * ENTRIES);
    }
    // The library's default for this row, as entry_timeline.cu launches it.
    const int lib_stage = OUT / 8;
    const int lib_smem = probe_entry_smem(8, N_ROWS, lib_stage);
    CK(cudaFuncSetAttribute(bgmv_entry_c8_r16, cudaFuncAttributeMaxDynamicSharedMemorySize, lib_smem));
    const int lib_reg_smem = probe_entry_smem(8, N_ROWS, 0);
    CK(cudaFuncSetAttribute(bgmv_entry_c8_r16_reg, cudaFuncAttributeMaxDynamicSharedMemorySize, lib_reg_smem));
    {
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, bgmv_entry_c8_r16_reg));
        printf("library c8 register form %d regs, %zu B spilled\n", fa.numRegs, (size_t)fa.localSizeBytes);
    }

    for (int copies : {24, 2}) {
        std::vector<ProbeCopy> cs = probe_decode_copies(
            copies, N_ROWS, IN, OUT, R, ENTRIES,
            [](int) {
                std::vector<int> idx(N_ROWS);
                for (int r = 0; r < N_ROWS; ++r) idx[r] = r % ENTRIES;
                return idx;
            },
            trace_bytes);
        printf("\n== %d input sets (%s)\n", copies, copies > 2 ? "cold, as the bench" : "every byte in L2");
        auto lib = [&](const ProbeCopy& c) {
            const BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, lib_stage);
            bgmv_entry_c8_r16<<<dim3(8, ENTRIES, 1), BGE_THREADS, lib_smem, st>>>(b);
        };
        const int calls = 96;
        auto time_form = [&](const char* name, auto launch) {
            const double rel = probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, launch);
            float best = 1e30f;
            for (int pass = 0; pass < 2; ++pass) {
                const ProbeTime tm = probe_time_graph(st, calls, [&](int k) { launch(cs[k % copies]); });
                printf("  %-26s pass %d: %.2f us (p10 %.2f, p90 %.2f); rel err %.2e\n", name, pass, tm.median, tm.p10,
                       tm.p90, rel);
                best = std::min(best, tm.median);
            }
            return best;
        };
        time_form("library c8 (default)", lib);
        auto lib_reg = [&](const ProbeCopy& c) {
            const BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, 0);
            bgmv_entry_c8_r16_reg<<<dim3(8, ENTRIES, 1), BGE_THREADS, lib_reg_smem, st>>>(b);
        };
        time_form("library c8 register form", lib_reg);
        for (const WideForm& f : forms) {
            auto launch = [&](const ProbeCopy& c) {
                const BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, 0);
                cudaLaunchAttribute at;
                const cudaLaunchConfig_t cfg = f.config(&at, st);
                CK(cudaLaunchKernelEx(&cfg, f.kernel, b));
            };
            time_form(f.name, launch);
            if (strstr(f.name, "traced") == nullptr) continue;
            // The traced form's last two calls of the graph.
            const int nb = f.ck * f.co * ENTRIES;
            std::vector<unsigned long long> tr[2];
            for (int s = 0; s < 2; ++s) {
                tr[s].resize((size_t)nb * TRACE_SLOTS);
                CK(cudaMemcpy(tr[s].data(), cs[(calls - 2 + s) % copies].y + y_elems, (size_t)nb * TRACE_SLOTS * 8,
                              cudaMemcpyDeviceToHost));
            }
            auto at = [&](int s, int b, int k) { return tr[s][(size_t)b * TRACE_SLOTS + k]; };
            unsigned long long t0 = ~0ull, end0 = 0, start1 = ~0ull;
            for (int b = 0; b < nb; ++b) {
                t0 = std::min(t0, at(0, b, 0));
                end0 = std::max(end0, at(0, b, 6));
                start1 = std::min(start1, at(1, b, 0));
            }
            printf("    first start to last end %.0f ns; gap to the next call %.0f ns\n", (double)(end0 - t0),
                   (double)start1 - (double)end0);
            static const char* names[TRACE_STAMPS] = {"start", "rows listed", "loads issued", "shrink done",
                                                      "cluster summed", "expand stored", "end"};
            for (int k = 0; k < TRACE_STAMPS; ++k) {
                std::vector<double> v;
                for (int b = 0; b < nb; ++b) v.push_back((double)(at(0, b, k) - t0));
                printf("    %-16s p10 %6.0f med %6.0f p90 %6.0f max %6.0f\n", names[k], probe_pct(v, 0.1), probe_pct(v, 0.5),
                       probe_pct(v, 0.9), probe_pct(v, 1.0));
            }
            std::vector<int> per_sm(1024, 0);
            for (int b = 0; b < nb; ++b) per_sm[at(0, b, TRACE_SM) & 1023]++;
            int hist[4] = {0, 0, 0, 0};
            for (int s = 0; s < sms; ++s) hist[std::min(per_sm[s], 3)]++;
            printf("    SMs holding 0/1/2/3+ blocks: %d %d %d %d\n", hist[0], hist[1], hist[2], hist[3]);
        }
        probe_free_copies(cs);
    }
    u32 hf = 0;
    CK(cudaMemcpy(&hf, fault, 4, cudaMemcpyDeviceToHost));
    printf("\nfault word %u; empty kernel in a graph %.2f us\n", hf, probe_empty_in_graph(st));
    return 0;
}
