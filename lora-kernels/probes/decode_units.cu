// Units claimed from a counter: a standalone probe (not part of the library
// or the bench; NOTES.md v31). `entry_timeline.cu` found the entry-clustered
// form's n = 256 time set by where its clusters land: 16 multiprocessors
// hold 3 of its 256 blocks, 100 hold 2, 8 hold 1 and 8 none, and the ones
// holding 3 finish last, so an op ends about a microsecond after most of
// its blocks (and clusters wait for their slowest block before the expand).
//
// Here no cluster is used. The apply is cut into units: a shrink unit
// (entry e, 512 columns of `in`) writes its partial rank vectors of e's rows
// to a scratch and counts itself done on e; an expand unit (entry e, 512
// outputs) sums e's 8 partials in a fixed order once all are done and
// expands. Resident blocks (3 a multiprocessor) claim units from a counter
// in order, shrink units first, so a unit that waits only waits for units
// already claimed by running blocks that never wait (no deadlock, however
// many blocks are resident). A block claims its next unit while its
// current one runs; when the current unit is a shrink unit and the next
// an expand unit, the next unit's B rows and y values are copied into
// shared memory (cp.async) while the shrink's loads are in flight. The
// last block to finish resets the counters for the next launch.
//
// The shape is the bench's n = 256 row: 256 rows naming 32 rank-16
// adapters, row i naming entry i % 32 (8 rows each), 4096 x 4096, bf16.
// The library's entry-clustered kernel runs in the same call, and every
// form is timed like the bench's in-a-graph rows (many calls in one graph
// over rotating input sets, per-call time = replay time / calls).
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -arch=sm_90a -O3 -std=c++17 -o decode_units decode_units.cu && ./decode_units
#define PROBE_LIBRARY_ROWS
#define PROBE_DECODE_N256
#include "probe.cuh"

// Slices per entry: of `in` (shrink units) and of the outputs (expand units).
constexpr int SL = 8;
constexpr int KW = IN / SL;
constexpr int OW = OUT / SL;
constexpr int SHRINK_UNITS = ENTRIES * SL;
constexpr int UNITS = 2 * SHRINK_UNITS;
constexpr int NT = 256;
constexpr int NW = NT / 32;
// Most rows of an entry (two m16n8 column tiles of rows).
constexpr int MR = 16;
// Staged y row pitch (64 bytes of padding), t row pitch.
constexpr int YP = OW + 32;
constexpr int TP = R + 4;
static_assert(N_ROWS == NT && KW == 32 * NW * 2 && OW == 32 * NW * 2, "a thread per row index, two chunks a warp");

struct Ctl {
    unsigned next;    // the next unit to claim
    unsigned exited;  // blocks that found no unit left
    unsigned done[ENTRIES];  // shrink units finished, per entry
};

struct UParams {
    const bf16_t* x;
    bf16_t* y;
    const int* idx;
    const PairEntry* table;
    Ctl* ctl;
    float* part;  // [ENTRIES][SL][R][MR] partial rank vectors
};

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The rows naming e (at most MR, in row order) into rows; every thread
// gets their count. `my` is this thread's row index (thread i holds row i).
__device__ __forceinline__ int list_rows(int e, int my, int* rows, int* wcount) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool m = my == e;
    const unsigned bal = __ballot_sync(0xffffffffu, m);
    if (lane == 0) wcount[warp] = __popc(bal);
    __syncthreads();
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        const int c = wcount[w];
        before += w < warp ? c : 0;
        total += c;
    }
    const int pos = before + __popc(bal & ((1u << lane) - 1u));
    if (m && pos < MR) rows[pos] = threadIdx.x;
    __syncthreads();
    return min(total, MR);
}

// An expand unit's B rows [OW][R] and its rows' y values [m][YP], copied into shared memory.
__device__ __forceinline__ void stage_expand(const PairEntry& en, int s, const int* rows, int m, const UParams& p,
                                             bf16_t* sb, bf16_t* sy) {
    const bf16_t* B = (const bf16_t*)en.b + (u64)s * OW * R;
    for (int i = threadIdx.x; i < OW * R / 8; i += NT) cp_async16(sb + 8 * i, B + 8 * i);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < m; r += NW) {
        const bf16_t* src = p.y + (u64)rows[r] * OUT + s * OW;
        for (int i = lane; i < OW / 8; i += 32) cp_async16(sy + r * YP + 8 * i, src + 8 * i);
    }
    cp_async_commit();
}

// The expand's four tiles of one group of 32 outputs, as the library's
// entry-clustered expand computes them: d[j] starts from y (va: row g, vb:
// row g + 8) and adds t times B tile j, t split into bf16 hi + lo parts.
__device__ __forceinline__ void expand_tiles(float (&d)[4][4], uint4 va, uint4 vb, const u32 (&th)[4], const u32 (&tl)[4],
                                             const u32 (&bw)[4][2]) {
    const u32 wa[4] = {va.x, va.y, va.z, va.w};
    const u32 wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        d[j][0] = bf_lo(wa[j]);
        d[j][1] = bf_hi(wa[j]);
        d[j][2] = bf_lo(wb[j]);
        d[j][3] = bf_hi(wb[j]);
        mma_k16(d[j], th[0], th[1], th[2], th[3], bw[j][0], bw[j][1]);
        mma_k16(d[j], tl[0], tl[1], tl[2], tl[3], bw[j][0], bw[j][1]);
    }
}

// Row g (h = 0) or g + 8 (h = 1) of expand_tiles' result: 8 consecutive outputs as bf16.
__device__ __forceinline__ uint4 pack_row(const float (&d)[4][4], int h) {
    return make_uint4(pack_bf2_rn(d[0][2 * h], d[0][2 * h + 1]), pack_bf2_rn(d[1][2 * h], d[1][2 * h + 1]),
                      pack_bf2_rn(d[2][2 * h], d[2][2 * h + 1]), pack_bf2_rn(d[3][2 * h], d[3][2 * h + 1]));
}

template <int MINB>
__global__ void __launch_bounds__(NT, MINB) units_kernel(const UParams p) {
    extern __shared__ __align__(16) unsigned char u_smem[];
    bf16_t* sb = (bf16_t*)u_smem;  // [OW][R]
    bf16_t* sy = sb + OW * R;      // [MR][YP]
    __shared__ __align__(16) float s_red[NW][R * MR];
    __shared__ __align__(16) float s_t[MR * TP];
    __shared__ int s_rows[2][MR];
    __shared__ int s_wcount[NW];
    __shared__ int s_claim[2];
    __shared__ PairEntry s_table[ENTRIES];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int my = p.idx[tid];
    if (tid < ENTRIES) s_table[tid] = p.table[tid];
    if (tid == 0) s_claim[0] = (int)atomicAdd(&p.ctl->next, 1u);
    __syncthreads();
    int u = s_claim[0];
    int cur = 0;        // the current unit's slot of s_rows and s_claim
    int staged = -1;    // the expand unit whose B and y are in sb, sy
    int m_staged = 0;   // its rows (listed in s_rows[cur] once it is current)
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    while (u < UNITS) {
        const bool shrink = u < SHRINK_UNITS;
        const int v = shrink ? u : u - SHRINK_UNITS;
        const int e = v / SL, s = v % SL;
        const PairEntry en = s_table[e];
        const int m = staged == u ? m_staged : list_rows(e, my, s_rows[cur], s_wcount);
        const int row_a = g < m ? s_rows[cur][g] : -1;
        const int row_b = g + 8 < m ? s_rows[cur][g + 8] : -1;
        int nu;
        if (shrink) {
            // Both chunks' fragments of this warp in flight at once.
            const bf16_t* A = (const bf16_t*)en.a;
            uint4 xa[2], xb[2], a0[2], a1[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = s * KW + (warp + h * NW) * 32 + c * 8;
                xa[h] = row_a >= 0 ? ldg16(p.x + (u64)row_a * IN + col) : zero;
                xb[h] = row_b >= 0 ? ldg16(p.x + (u64)row_b * IN + col) : zero;
                a0[h] = m > 0 ? ldg16(A + (u64)g * IN + col) : zero;
                a1[h] = m > 0 ? ldg16(A + (u64)(g + 8) * IN + col) : zero;
            }
            if (tid == 0) s_claim[cur ^ 1] = (int)atomicAdd(&p.ctl->next, 1u);
            __syncthreads();
            nu = s_claim[cur ^ 1];
            if (nu >= SHRINK_UNITS && nu < UNITS) {
                // The next unit expands: its B and y stream in while this shrink waits for A and x.
                const int nv = nu - SHRINK_UNITS;
                const int ne = nv / SL;
                m_staged = list_rows(ne, my, s_rows[cur ^ 1], s_wcount);
                if (m_staged > 0) stage_expand(s_table[ne], nv % SL, s_rows[cur ^ 1], m_staged, p, sb, sy);
                staged = nu;
            }
            float acc[2][4] = {};
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                mma_k16(acc[0], a0[h].x, a1[h].x, a0[h].y, a1[h].y, xa[h].x, xa[h].y);
                mma_k16(acc[0], a0[h].z, a1[h].z, a0[h].w, a1[h].w, xa[h].z, xa[h].w);
                if (m > 8) {
                    mma_k16(acc[1], a0[h].x, a1[h].x, a0[h].y, a1[h].y, xb[h].x, xb[h].y);
                    mma_k16(acc[1], a0[h].z, a1[h].z, a0[h].w, a1[h].w, xb[h].z, xb[h].w);
                }
            }
            // s_red[warp][rank][row]
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                float* r = &s_red[warp][g * MR + 8 * nt + 2 * c];
                *(float2*)r = make_float2(acc[nt][0], acc[nt][1]);
                *(float2*)(r + 8 * MR) = make_float2(acc[nt][2], acc[nt][3]);
            }
            __syncthreads();
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) sum += s_red[w][tid];
            __stcg(p.part + (size_t)(e * SL + s) * (R * MR) + tid, sum);
            __threadfence();
            __syncthreads();
            if (tid == 0) atomicAdd(&p.ctl->done[e], 1u);
        } else {
            if (staged != u && m > 0) stage_expand(en, s, s_rows[cur], m, p, sb, sy);
            staged = -1;
            if (tid == 0) {
                s_claim[cur ^ 1] = (int)atomicAdd(&p.ctl->next, 1u);
                if (m > 0)
                    while (ld_acquire_u32(&p.ctl->done[e]) < SL) __nanosleep(32);
            }
            __syncthreads();
            nu = s_claim[cur ^ 1];
            if (m > 0) {
                // t [row][rank]: the entry's partials summed in slice order, times the scale.
                float sum = 0.f;
#pragma unroll
                for (int sl = 0; sl < SL; ++sl) sum += __ldcg(p.part + (size_t)(e * SL + sl) * (R * MR) + tid);
                s_t[(tid % MR) * TP + tid / MR] = sum * en.scale;
                cp_async_wait<0>();
                __syncthreads();
                u32 th[4], tl[4];
                {
                    const float* ta = s_t + g * TP + 4 * c;
                    const float* tb = s_t + (g + 8) * TP + 4 * c;
                    split_pair(ta[0], ta[1], th[0], tl[0]);
                    split_pair(tb[0], tb[1], th[1], tl[1]);
                    split_pair(ta[2], ta[3], th[2], tl[2]);
                    split_pair(tb[2], tb[3], th[3], tl[3]);
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int base = (warp + h * NW) * 32;  // of this unit's OW outputs
                    u32 bw[4][2];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int bo = base + 8 * (g >> 1) + 2 * j + (g & 1);
                        const u32* sw = (const u32*)(sb + bo * R + c * 4);
                        bw[j][0] = sw[0];
                        bw[j][1] = sw[1];
                    }
                    const uint4 va = row_a >= 0 ? *(const uint4*)(sy + g * YP + base + 8 * c) : zero;
                    const uint4 vb = row_b >= 0 ? *(const uint4*)(sy + (g + 8) * YP + base + 8 * c) : zero;
                    float d[4][4];
                    expand_tiles(d, va, vb, th, tl, bw);
                    const int col = s * OW + base + 8 * c;
                    if (row_a >= 0) *(uint4*)(p.y + (u64)row_a * OUT + col) = pack_row(d, 0);
                    if (row_b >= 0) *(uint4*)(p.y + (u64)row_b * OUT + col) = pack_row(d, 1);
                }
            }
        }
        __syncthreads();  // s_red, s_t, the stage buffers and this unit's row list are rewritten next
        u = nu;
        cur ^= 1;
    }
    if (tid == 0) {
        // The last block out resets the counters: every unit is done and every claim made.
        if (atomicAdd(&p.ctl->exited, 1u) == gridDim.x - 1) {
            p.ctl->next = 0u;
            p.ctl->exited = 0u;
            for (int e = 0; e < ENTRIES; ++e) p.ctl->done[e] = 0u;
        }
    }
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int copies = 24;
    std::vector<ProbeCopy> cs = probe_decode_copies(copies, N_ROWS, IN, OUT, R, ENTRIES, [](int) {
        std::vector<int> idx(N_ROWS);
        for (int r = 0; r < N_ROWS; ++r) idx[r] = r % ENTRIES;
        return idx;
    });
    Ctl* ctl = nullptr;
    float* part = nullptr;
    u32* fault = nullptr;
    CK(cudaMalloc(&ctl, sizeof(Ctl)));
    CK(cudaMemset(ctl, 0, sizeof(Ctl)));
    CK(cudaMalloc(&part, (size_t)ENTRIES * SL * R * MR * 4));
    CK(cudaMalloc(&fault, 16));
    CK(cudaMemset(fault, 0, 16));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    printf("%d SMs; ", sms);
    probe_print_floor(st, N_ROWS, IN, OUT, R, ENTRIES);

    // The library's plan for this shape (bgmv/entry.rs `smem_plan`): clusters of 8, every block's 512 outputs staged.
    const int lib_stage = OUT / 8;
    const int lib_smem = probe_entry_smem(8, N_ROWS, lib_stage);
    CK(cudaFuncSetAttribute(bgmv_entry_c8_r16, cudaFuncAttributeMaxDynamicSharedMemorySize, lib_smem));
    const int unit_smem = OW * R * 2 + MR * YP * 2;
    auto library = [&](const ProbeCopy& c) {
        const BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, lib_stage);
        bgmv_entry_c8_r16<<<dim3(8, ENTRIES, 1), BGE_THREADS, lib_smem, st>>>(b);
    };
    auto run = [&](const char* name, auto launch, const void* kernel) {
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, kernel));
        const double rel = probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, launch);
        const ProbeTime tm = probe_time_graph(st, copies * 4, [&](int k) { launch(cs[k % copies]); });
        printf("%-40s %6.2f us (p10 %.2f, p90 %.2f)  rel err %.2e  %d regs, %zu B spilled\n", name, tm.median, tm.p10,
               tm.p90, rel, fa.numRegs, (size_t)fa.localSizeBytes);
    };
    CK(cudaFuncSetAttribute(units_kernel<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, unit_smem));
    CK(cudaFuncSetAttribute(units_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, unit_smem));
    for (int pass = 0; pass < 2; ++pass) {
        run("library entry-clustered (c8, staged)", library, (const void*)bgmv_entry_c8_r16);
        for (int per_sm : {3, 2}) {
            char name[64];
            snprintf(name, sizeof name, "units, %d blocks a SM", per_sm);
            auto units = [&](const ProbeCopy& c) {
                const UParams up{c.x, c.y, c.idx, c.table, ctl, part};
                if (per_sm == 3)
                    units_kernel<3><<<sms * 3, NT, unit_smem, st>>>(up);
                else
                    units_kernel<2><<<sms * 2, NT, unit_smem, st>>>(up);
            };
            run(name, units, per_sm == 3 ? (const void*)units_kernel<3> : (const void*)units_kernel<2>);
        }
    }
    printf("empty kernel in a graph %.2f us\n", probe_empty_in_graph(st));
    return 0;
}
