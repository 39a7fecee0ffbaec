// Adapters in registers across their rows: a standalone probe (not part of
// the library or the bench; NOTES.md v30). It times a decode apply of n =
// 256 rows naming 32 rank-16 adapters, 8 rows each (4096 x 4096, bf16), in
// an entry-register form: a cluster of C blocks per table entry, every
// block loading its 1/C slice of the entry's A and B straight into
// registers (nothing staged in shared memory), finding the entry's rows in
// idx, loading those rows' x and y slices, then shrinking all of them at
// once (32 sums a lane, reduced over the warp by a transposed butterfly),
// summing the rank vectors over the cluster in one push (st.async), and
// expanding from the B registers. SPEC: A and B requested before the scan
// says whether the entry has rows (a library form could do that only for
// tables it knows are all in use). `library_rows<true>` (the row-register
// form, one cluster per row) runs under the same harness to tie it to the
// bench's rows (21.3 us there, run 300). Timed like the bench's in-a-graph
// rows: many calls in one graph over rotating input sets (24 of 12 MB, so
// nothing is left in L2), per-call time = replay time / calls, median of
// 21 replays. Copy 0 is checked against a host reference first.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -arch=sm_90a -O3 -std=c++17 -o decode_entries decode_entries.cu && ./decode_entries
#include <cmath>
#include <cstdint>
#include <type_traits>

#define PROBE_LIBRARY_ROWS
#define PROBE_DECODE_N256
#include "probe.cuh"

// Rows of one entry a block holds at once (the probe's batches have 8).
constexpr int RB = 8;

struct EParams {
    const bf16_t* x;
    bf16_t* y;
    const int* idx;
    const PairEntry* table;
};

// Block q of entry e's cluster: columns [q IN/C, (q+1) IN/C) of A (thread
// (g, c): rank rows g, g + G, ... of piece c) and outputs [q OUT/C, ...)
// of B (OPT a thread).
template <int C, int NT, int MINB, bool SPEC>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(NT, MINB) entry_reg(const EParams p) {
    constexpr int PIECES = IN / C / 8;
    constexpr int G = NT / PIECES;
    constexpr int RPT = R / G;
    constexpr int OUTB = OUT / C;
    constexpr int OPT = OUTB / NT;
    constexpr int NW = NT / 32;
    constexpr int WPG = PIECES / 32;
    static_assert(G * PIECES == NT && RPT * G == R && OPT == 2 && RB * RPT == 32 && 32 * C <= NT, "shape");
    __shared__ int s_rows[N_ROWS];
    __shared__ int s_count[N_ROWS / 32];
    __shared__ float s_part[NW][32];
    __shared__ __align__(16) float s_mine[RB * R];
    __shared__ __align__(16) float s_recv[C][RB * R];
    __shared__ __align__(16) float s_t[RB * R];
    __shared__ __align__(8) u64 s_bar;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int q = (int)blockIdx.x;
    const int e = (int)blockIdx.y;
    const int my_idx = tid < N_ROWS ? p.idx[tid] : -1;
    const PairEntry en = p.table[e];
    if (tid == 0) {
        mbar_init(&s_bar, 1);
        fence_mbar_init();
    }
    cluster_arrive_relaxed();

    const bf16_t* A = (const bf16_t*)en.a;
    const bf16_t* B = (const bf16_t*)en.b;
    const int col = q * (IN / C) + 8 * (tid % PIECES);
    const int g = tid / PIECES;
    const int o = q * OUTB + OPT * tid;
    uint4 a[RPT], b[2 * OPT];
    auto load_weights = [&]() {
#pragma unroll
        for (int i = 0; i < RPT; ++i) a[i] = ldg16(A + (u64)(g + G * i) * IN + col);
#pragma unroll
        for (int i = 0; i < 2 * OPT; ++i) b[i] = ldg16(B + (u64)o * R + 8 * i);
    };
    if (SPEC) load_weights();

    // The entry's rows, in order.
    const bool mine = my_idx == e;
    const u32 ballot = __ballot_sync(0xffffffffu, mine);
    if (warp < N_ROWS / 32 && lane == 0) s_count[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, m = 0;
#pragma unroll
    for (int w = 0; w < N_ROWS / 32; ++w) {
        before += w < warp ? s_count[w] : 0;
        m += s_count[w];
    }
    if (mine) s_rows[before + __popc(ballot & ((1u << lane) - 1u))] = tid;
    __syncthreads();
    if (m == 0) {  // uniform over the cluster
        cluster_wait();
        return;
    }
    if (!SPEC) load_weights();
    m = min(m, RB);  // the probe's batches have exactly RB rows an entry

    uint4 xv[RB];
    u32 yw[RB];
#pragma unroll
    for (int j = 0; j < RB; ++j) {
        const int row = j < m ? s_rows[j] : 0;
        xv[j] = j < m ? ldg16(p.x + (u64)row * IN + col) : make_uint4(0u, 0u, 0u, 0u);
        yw[j] = j < m ? *(const u32*)(p.y + (u64)row * OUT + o) : 0u;
    }

    // Shrink: value j RPT + i is row j's dot over rank row g + G i; the
    // transposed butterfly leaves lane l the warp's sum of value l.
    float v[32];
#pragma unroll
    for (int j = 0; j < RB; ++j)
#pragma unroll
        for (int i = 0; i < RPT; ++i) v[j * RPT + i] = dot8(a[i], xv[j], 0.f);
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1) {
        const bool up = (lane & w) != 0;
#pragma unroll
        for (int k = 0; k < w; ++k) {
            const float send = up ? v[k] : v[k + w];
            const float keep = up ? v[k + w] : v[k];
            v[k] = keep + __shfl_xor_sync(0xffffffffu, send, w);
        }
    }
    s_part[warp][lane] = v[0];
    __syncthreads();
    if (tid < RB * R) {
        const int j = tid / R, k = tid % R;
        const int gk = k % G, i = k / G;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WPG; ++w) sum += s_part[gk * WPG + w][j * RPT + i];
        s_mine[tid] = sum;
    }
    __syncthreads();
    // The cluster's sum: every block pushes its partials into slot q of every peer.
    cluster_wait();
    if (tid == 0) mbar_arrive_expect(&s_bar, (u32)(C * RB * R * 4));
    if (tid < 32 * C) {
        const u32 peer = (u32)(tid / 32);
        const int c4 = 4 * (tid % 32);
        st_async_f4(cluster_addr(&s_recv[q][c4], peer), *(const float4*)&s_mine[c4], cluster_addr(&s_bar, peer));
    }
    mbar_wait(&s_bar, 0u);
    if (tid < RB * R) {
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < C; ++r) sum += s_recv[r][tid];
        s_t[tid] = sum * en.scale;
    }
    __syncthreads();
    // Expand from the B registers, row by row.
#pragma unroll
    for (int j = 0; j < RB; ++j) {
        if (j < m) {
            float t[R];
#pragma unroll
            for (int k = 0; k < R; k += 4) {
                const float4 w4 = *(const float4*)&s_t[j * R + k];
                t[k] = w4.x;
                t[k + 1] = w4.y;
                t[k + 2] = w4.z;
                t[k + 3] = w4.w;
            }
            const float d0 = dot8f(b[1], t + 8, dot8f(b[0], t, 0.f));
            const float d1 = dot8f(b[3], t + 8, dot8f(b[2], t, 0.f));
            *(u32*)(p.y + (u64)s_rows[j] * OUT + o) = pack_bf2_rn(bf_lo(yw[j]) + d0, bf_hi(yw[j]) + d1);
        }
    }
}

int main() {
    const int copies = 24;
    srand(7);
    std::vector<ProbeCopy> cs = probe_decode_copies(copies, N_ROWS, IN, OUT, R, ENTRIES, [](int) {
        // Every entry named by N_ROWS / ENTRIES rows, shuffled.
        std::vector<int> idx(N_ROWS);
        for (int r = 0; r < N_ROWS; ++r) idx[r] = r % ENTRIES;
        for (int r = N_ROWS - 1; r > 0; --r) std::swap(idx[r], idx[rand() % (r + 1)]);
        return idx;
    });
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    probe_print_floor(st, N_ROWS, IN, OUT, R, ENTRIES);

    auto run_form = [&](const char* name, auto kernel, dim3 grid, int NT) {
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, kernel));
        auto launch = [&](const ProbeCopy& c) {
            if constexpr (std::is_invocable_v<decltype(kernel), BgeParams>) {
                const BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES);
                kernel<<<grid, NT, 0, st>>>(b);
            } else {
                kernel<<<grid, NT, 0, st>>>(EParams{c.x, c.y, c.idx, c.table});
            }
        };
        // Correctness on copy 0 from y = 0: the result is the rounded delta.
        const double rel = probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, launch);
        const ProbeTime tm = probe_time_graph(st, copies * 4, [&](int k) { launch(cs[k % copies]); });
        printf("%-34s %6.2f us (p10 %.2f, p90 %.2f)  rel err %.2e  %d regs, %zu B spilled\n", name, tm.median, tm.p10,
               tm.p90, rel, fa.numRegs, (size_t)fa.localSizeBytes);
    };
    for (int pass = 0; pass < 2; ++pass) {
        run_form("entries c4 x 512, A and B first", entry_reg<4, 512, 1, true>, dim3(4, ENTRIES), 512);
        run_form("entries c4 x 512, after the scan", entry_reg<4, 512, 1, false>, dim3(4, ENTRIES), 512);
        run_form("entries c8 x 256, A and B first", entry_reg<8, 256, 2, true>, dim3(8, ENTRIES), 256);
        run_form("entries c8 x 256, after the scan", entry_reg<8, 256, 2, false>, dim3(8, ENTRIES), 256);
        run_form("library rows (a cluster a row)", library_rows<true>, dim3(2, N_ROWS), 512);
    }
    printf("empty kernel in a graph %.2f us\n", probe_empty_in_graph(st));
    return 0;
}
