// The spread form of the entry kernel (`bgmv_entry_spread_r16` in
// bgmv_entry.cu) against the library's register kernel, for the bench's
// n = 256 row (256 rows naming 32 rank-16 adapters, 8 rows each, 4096 x
// 4096): a standalone probe (not part of the bench; NOTES.md v34, v35). It
// times, in a graph of many calls over 24 rotating input sets (cold, as
// the bench) and over 2 (every byte in L2):
//   - the library's register kernel (clusters of 8, three blocks on 16
//     multiprocessors), plain, waiting first and under the overlap;
//   - the spread form, 4 blocks an entry (128 blocks, one a multiprocessor
//     by its shared memory), plain, waiting first (the next launch let in
//     early or late, the weights asked into L2 before the wait or not),
//     and cooperative with and without waiting first;
// checks each against the host reference, also over 2 passes (16 rows an
// entry, half the entries unnamed), and that every inbox is zero after.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o entry_spread entry_spread.cu && ./entry_spread
#include <cstdint>

#define PROBE_LIBRARY_ROWS
#define PROBE_DECODE_N256
#include "probe.cuh"

// The spread form is the library's (`bgmv_entry_spread_r16`, bgs_body in bgmv_entry.cu).

struct SpreadForm {
    const char* name;
    int q;       // blocks an entry
    int smem;    // dynamic shared memory (past half a multiprocessor's: one block each)
    bool coop;   // a cooperative launch
    int chain;   // p.overlap: a launch-chain code, BGS_PREFETCH or'd in (a programmatic launch unless plain)
};

int main() {
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    probe_print_floor(st, N_ROWS, IN, OUT, R, ENTRIES);
    u32* fault = nullptr;
    CK(cudaMalloc(&fault, 16));
    CK(cudaMemset(fault, 0, 16));
    const int max_blocks = 8 * ENTRIES;
    u64* inbox = nullptr;
    const size_t inbox_bytes = (size_t)max_blocks * BGS_INBOX_WORDS * 8;
    CK(cudaMalloc(&inbox, inbox_bytes));
    CK(cudaMemset(inbox, 0, inbox_bytes));
    const int small = (4 * (8 * 128 + 8 * 20 + N_ROWS) + 15) / 16 * 16;
    const std::vector<SpreadForm> forms = {
        {"spread 4, 1/SM", 4, 120 * 1024, false, BGE_PLAIN},
        {"  wait first, next late", 4, 120 * 1024, false, BGE_WAIT_FIRST},
        {"  wait first, next early", 4, 120 * 1024, false, BGE_WAIT_FIRST_EARLY_NEXT},
        {"  + prefetch", 4, 120 * 1024, false, BGE_WAIT_FIRST_EARLY_NEXT | BGS_PREFETCH},
        {"  prefetch, next late", 4, 120 * 1024, false, BGE_WAIT_FIRST | BGS_PREFETCH},
        {"spread 4, small smem, early + pf", 4, small, false, BGE_WAIT_FIRST_EARLY_NEXT | BGS_PREFETCH},
        {"spread 4, coop", 4, 120 * 1024, true, BGE_PLAIN},
        {"spread 4, coop, early + pf", 4, 120 * 1024, true, BGE_WAIT_FIRST_EARLY_NEXT | BGS_PREFETCH},
    };
    CK(cudaFuncSetAttribute(bgmv_entry_spread_r16, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
    {
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, bgmv_entry_spread_r16));
        printf("spread form %d regs, %zu B spilled\n", fa.numRegs, (size_t)fa.localSizeBytes);
        CK(cudaFuncGetAttributes(&fa, bgmv_entry_c8_r16_reg));
        printf("library c8 register form %d regs, %zu B spilled\n", fa.numRegs, (size_t)fa.localSizeBytes);
    }
    const int lib_reg_smem = probe_entry_smem(8, N_ROWS, 0);
    CK(cudaFuncSetAttribute(bgmv_entry_c8_r16_reg, cudaFuncAttributeMaxDynamicSharedMemorySize, lib_reg_smem));

    auto spread_launch = [&](const SpreadForm& f, const ProbeCopy& c) {
        BgsParams sp;
        sp.base = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, 0);
        sp.base.overlap = f.chain;
        sp.inbox = (u64)inbox;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(f.q, ENTRIES, 1);
        cfg.blockDim = dim3(BGE_THREADS);
        cfg.dynamicSmemBytes = f.smem;
        cfg.stream = st;
        cudaLaunchAttribute at[2];
        int n_at = 0;
        if (f.coop) {
            at[n_at].id = cudaLaunchAttributeCooperative;
            at[n_at++].val.cooperative = 1;
        }
        if (f.chain != BGE_PLAIN) {
            at[n_at].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[n_at++].val.programmaticStreamSerializationAllowed = 1;
        }
        cfg.attrs = at;
        cfg.numAttrs = n_at;
        CK(cudaLaunchKernelEx(&cfg, bgmv_entry_spread_r16, sp));
    };
    auto lib_reg = [&](const ProbeCopy& c) {
        const BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, 0);
        bgmv_entry_c8_r16_reg<<<dim3(8, ENTRIES, 1), BGE_THREADS, lib_reg_smem, st>>>(b);
    };
    // The library's register kernel as a programmatic dependent: waiting
    // first and letting the next launch in at once (as run 334 measured it)
    // or reading early (the opt-in overlap).
    auto pdl_launch = [&](int overlap, const ProbeCopy& c) {
        BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, 0);
        b.overlap = overlap;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(8, ENTRIES, 1);
        cfg.blockDim = dim3(BGE_THREADS);
        cfg.dynamicSmemBytes = lib_reg_smem;
        cfg.stream = st;
        cudaLaunchAttribute at;
        at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &at;
        cfg.numAttrs = 1;
        CK(cudaLaunchKernelEx(&cfg, bgmv_entry_c8_r16_reg, b));
    };
    // The library's default at this shape: waiting first, the next launch let in once the work is out.
    auto lib_wait_first = [&](const ProbeCopy& c) { pdl_launch(BGE_WAIT_FIRST, c); };
    auto lib_overlap = [&](const ProbeCopy& c) { pdl_launch(BGE_EARLY_READS, c); };

    // Two passes: rows r name entry r % 16 (16 rows each), entries 16..31 unnamed.
    {
        std::vector<ProbeCopy> cs = probe_decode_copies(1, N_ROWS, IN, OUT, R, ENTRIES, [](int) {
            std::vector<int> idx(N_ROWS);
            for (int r = 0; r < N_ROWS; ++r) idx[r] = r % 16;
            return idx;
        });
        printf("\n== 2 passes an entry: rel err library %.2e", probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, lib_reg));
        for (const SpreadForm& f : forms)
            printf(", %s %.2e", f.name,
                   probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, [&](const ProbeCopy& c) { spread_launch(f, c); }));
        printf("\n");
        probe_free_copies(cs);
    }

    for (int copies : {24, 2}) {
        std::vector<ProbeCopy> cs = probe_decode_copies(copies, N_ROWS, IN, OUT, R, ENTRIES, [](int) {
            std::vector<int> idx(N_ROWS);
            for (int r = 0; r < N_ROWS; ++r) idx[r] = r % ENTRIES;
            return idx;
        });
        printf("\n== %d input sets (%s)\n", copies, copies > 2 ? "cold, as the bench" : "every byte in L2");
        const int calls = 96;
        auto time_form = [&](const char* name, auto launch) {
            const double rel = probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, launch);
            for (int pass = 0; pass < 2; ++pass) {
                const ProbeTime tm = probe_time_graph(st, calls, [&](int k) { launch(cs[k % copies]); });
                printf("  %-28s pass %d: %.2f us (p10 %.2f, p90 %.2f); rel err %.2e\n", name, pass, tm.median, tm.p10,
                       tm.p90, rel);
            }
        };
        for (int round = 0; round < 2; ++round) {
            time_form("library c8 register form", lib_reg);
            time_form("register, wait first", lib_wait_first);
            time_form("register, overlap_previous", lib_overlap);
            for (const SpreadForm& f : forms) time_form(f.name, [&](const ProbeCopy& c) { spread_launch(f, c); });
        }
        probe_free_copies(cs);
    }
    std::vector<u64> h(inbox_bytes / 8);
    CK(cudaMemcpy(h.data(), inbox, inbox_bytes, cudaMemcpyDeviceToHost));
    size_t nonzero = 0;
    for (u64 w : h) nonzero += w != 0;
    u32 hf = 0;
    CK(cudaMemcpy(&hf, fault, 4, cudaMemcpyDeviceToHost));
    printf("\ninbox words not zero after every launch: %zu; fault word %u; empty kernel in a graph %.2f us\n", nonzero, hf,
           probe_empty_in_graph(st));
    return 0;
}
