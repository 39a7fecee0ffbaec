// Where the entry-clustered form's time goes: a standalone probe (not part
// of the library or the bench; NOTES.md v31). It runs the library's
// entry-clustered kernel (`bgmv_entry_c8_r16`, staged: the bench's n = 256
// row, 256 rows naming 32 rank-16 adapters, row i naming entry i % 32, 4096
// x 4096, bf16) in a graph of many calls over rotating input sets, as the
// bench's in-a-graph rows do, with the kernel's BGE_STAMP hooks (empty in
// the library) defined: thread 0 of every block writes the global timer at
// each phase, and its multiprocessor's number, past the end of the call's
// y (stores only, so the kernel waits for nothing it would not wait for).
// For the last two calls of the graph it prints when blocks reach each
// phase relative to the call's first block, the blocks' end by how many
// of them share a multiprocessor, and the gap between the two calls.
//
// Run twice: over 24 input sets (nothing left in L2, as the bench) and
// over 2 (every byte an L2 hit after the first replay), which separates
// what DRAM costs from what the kernel's chain of steps costs.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -arch=sm_90a -O3 -std=c++17 -o entry_timeline entry_timeline.cu && ./entry_timeline
#include <cstdint>

constexpr int TRACE_STAMPS = 13;
// Per block: the stamps, then the multiprocessor's number.
constexpr int TRACE_SLOTS = 16;
constexpr int TRACE_SM = 13;
constexpr int TRACE_BLOCKS = 8 * 32;
// y's elements: the trace starts past them.
constexpr unsigned long long TRACE_Y_ELEMS = 256ull * 4096ull;

#define BGE_TRACE_BEGIN(p)                                                                                         \
    unsigned long long* const bge_tr =                                                                             \
        threadIdx.x != 0 ? nullptr                                                                                 \
                         : (unsigned long long*)((unsigned short*)(p).y + TRACE_Y_ELEMS) +                         \
                               (size_t)(blockIdx.y * gridDim.x + blockIdx.x) * TRACE_SLOTS;                        \
    if (bge_tr) {                                                                                                  \
        unsigned sm_;                                                                                              \
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                                                           \
        bge_tr[TRACE_SM] = sm_;                                                                                    \
    }
// The stamp branches on `dep`, so it marks that value's arrival.
#define BGE_STAMP(k, dep)                                                                   \
    do {                                                                                    \
        if (bge_tr && (unsigned)(dep) != 0x7fc00001u) {                                     \
            unsigned long long gt_;                                                         \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt_)::"memory");               \
            bge_tr[k] = gt_;                                                                \
        }                                                                                   \
    } while (0)

#define PROBE_LIBRARY_ROWS
#define PROBE_DECODE_N256
#include "probe.cuh"

constexpr int C = 8;
static_assert(TRACE_Y_ELEMS == (unsigned long long)N_ROWS * OUT && TRACE_BLOCKS == C * ENTRIES, "trace layout");

static const char* STAMP_NAMES[TRACE_STAMPS] = {
    "start",          "idx[0] arrived", "entry arrived",  "rows listed",    "loads issued",
    "first A, x in",  "shrink done",    "warps summed",   "cluster summed", "staged B, y in",
    "expand issued",  "end",            "t split",
};
// Print order: the expand's t split (stamp 12) comes before its groups.
static const int STAMP_ORDER[TRACE_STAMPS] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 10, 11};

int main() {
    const size_t y_elems = (size_t)N_ROWS * OUT;
    const size_t trace_bytes = (size_t)TRACE_BLOCKS * TRACE_SLOTS * 8;
    u32* fault = nullptr;
    CK(cudaMalloc(&fault, 16));
    CK(cudaMemset(fault, 0, 16));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    probe_print_floor(st, N_ROWS, IN, OUT, R, ENTRIES);
    // The library's plan (bgmv/entry.rs `smem_plan`): every block's 512 outputs staged.
    const int stage_cols = OUT / C;
    const int smem = probe_entry_smem(C, N_ROWS, stage_cols);
    CK(cudaFuncSetAttribute(bgmv_entry_c8_r16, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, bgmv_entry_c8_r16));
    printf("%d regs, %zu B spilled, %d B dynamic shared memory\n", fa.numRegs, (size_t)fa.localSizeBytes, smem);
    for (int copies : {24, 2}) {
        std::vector<ProbeCopy> cs = probe_decode_copies(
            copies, N_ROWS, IN, OUT, R, ENTRIES,
            [](int) {
                std::vector<int> idx(N_ROWS);
                for (int r = 0; r < N_ROWS; ++r) idx[r] = r % ENTRIES;
                return idx;
            },
            trace_bytes);
        auto launch = [&](const ProbeCopy& c) {
            const BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, stage_cols);
            bgmv_entry_c8_r16<<<dim3(C, ENTRIES, 1), BGE_THREADS, smem, st>>>(b);
        };
        const double rel = probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, launch);
        const int calls = 96;
        printf("\n== %d input sets: rel err %.2e\n", copies, rel);
        for (int pass = 0; pass < 2; ++pass) {
            const ProbeTime tm = probe_time_graph(st, calls, [&](int k) { launch(cs[k % copies]); });
            printf("pass %d: %.2f us (p10 %.2f, p90 %.2f)\n", pass, tm.median, tm.p10, tm.p90);
        }
        // The graph's last two calls: copies (calls - 2) % copies and (calls - 1) % copies.
        std::vector<unsigned long long> tr[2];
        for (int s = 0; s < 2; ++s) {
            tr[s].resize((size_t)TRACE_BLOCKS * TRACE_SLOTS);
            CK(cudaMemcpy(tr[s].data(), cs[(calls - 2 + s) % copies].y + y_elems, trace_bytes, cudaMemcpyDeviceToHost));
        }
        auto at = [&](int s, int b, int k) { return tr[s][(size_t)b * TRACE_SLOTS + k]; };
        unsigned long long t0 = ~0ull, end0 = 0, start1 = ~0ull;
        for (int b = 0; b < TRACE_BLOCKS; ++b) {
            t0 = std::min(t0, at(0, b, 0));
            end0 = std::max(end0, at(0, b, 11));
            start1 = std::min(start1, at(1, b, 0));
        }
        printf("call: first start to last end %.0f ns; gap to the next call's first start %.0f ns\n",
               (double)(end0 - t0), (double)start1 - (double)end0);
        printf("%-16s %s\n", "phase", "ns since the call's first block: p10 med p90 max");
        for (int o = 0; o < TRACE_STAMPS; ++o) {
            const int k = STAMP_ORDER[o];
            std::vector<double> v;
            for (int b = 0; b < TRACE_BLOCKS; ++b) v.push_back((double)(at(0, b, k) - t0));
            printf("%-16s %7.0f %7.0f %7.0f %7.0f\n", STAMP_NAMES[k], probe_pct(v, 0.1), probe_pct(v, 0.5), probe_pct(v, 0.9),
                   probe_pct(v, 1.0));
        }
        std::vector<int> per_sm(1024, 0);
        for (int b = 0; b < TRACE_BLOCKS; ++b) per_sm[at(0, b, TRACE_SM) & 1023]++;
        for (int k = 1; k <= 4; ++k) {
            std::vector<double> arrive, fin;
            for (int b = 0; b < TRACE_BLOCKS; ++b)
                if (per_sm[at(0, b, TRACE_SM) & 1023] == k) {
                    arrive.push_back((double)(at(0, b, 5) - t0));
                    fin.push_back((double)(at(0, b, 11) - t0));
                }
            if (!arrive.empty())
                printf("blocks on SMs of %d: %3zu; first A, x in med %.0f max %.0f; end med %.0f max %.0f\n", k,
                       arrive.size(), probe_pct(arrive, 0.5), probe_pct(arrive, 1.0), probe_pct(fin, 0.5), probe_pct(fin, 1.0));
        }
        probe_free_copies(cs);
    }
    printf("\nempty kernel in a graph %.2f us\n", probe_empty_in_graph(st));
    return 0;
}
