// The entry-clustered kernels waiting first, with and without asking their
// weights into L2 before the wait (`BGE_PREFETCH_L2` in bgmv_entry.cu), for
// the bench's n = 256 row (256 rows naming 32 rank-16 adapters, 8 rows
// each, 4096 x 4096): a standalone probe (not part of the library or the
// bench; NOTES.md v35). It times, in a graph of many calls over 24
// rotating input sets (cold, as the bench) and over 2 (every byte in L2),
// the library's register kernel and its staged kernel (clusters of 8)
// under each launch-chain code, checks each against the host reference,
// and last asks L2 for bytes at addresses no allocation holds (null, an
// unmapped one, a freed one) to see whether the bulk prefetch faults.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o entry_prefetch entry_prefetch.cu && ./entry_prefetch
#include <cstdint>

#define PROBE_LIBRARY_ROWS
#define PROBE_DECODE_N256
#include "probe.cuh"

// The staged kernel's body under the probe's own declaration.
__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(BGE_THREADS, 3) probe_staged_c8_r16(const BgeParams p) {
    bge_body<8, 1, false, false>(p);
}

// One bulk prefetch of 4 KB at `addr` by thread 0.
__global__ void probe_prefetch_at(u64 addr) {
    if (threadIdx.x == 0) prefetch_l2_bulk((const void*)addr, 4096u);
}

struct Code {
    const char* name;
    int overlap;
};

int main() {
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    probe_print_floor(st, N_ROWS, IN, OUT, R, ENTRIES);
    u32* fault = nullptr;
    CK(cudaMalloc(&fault, 16));
    CK(cudaMemset(fault, 0, 16));
    const int reg_smem = probe_entry_smem(8, N_ROWS, 0);
    const int stage_cols = OUT / 8;
    const int staged_smem = probe_entry_smem(8, N_ROWS, stage_cols);
    CK(cudaFuncSetAttribute(bgmv_entry_c8_r16_reg, cudaFuncAttributeMaxDynamicSharedMemorySize, reg_smem));
    CK(cudaFuncSetAttribute(probe_staged_c8_r16, cudaFuncAttributeMaxDynamicSharedMemorySize, staged_smem));
    const std::vector<Code> codes = {
        {"plain", BGE_PLAIN},
        {"wait first, next late", BGE_WAIT_FIRST},
        {"  + prefetch", BGE_WAIT_FIRST | BGE_PREFETCH_L2},
        {"wait first, next early", BGE_WAIT_FIRST_EARLY_NEXT},
        {"  + prefetch", BGE_WAIT_FIRST_EARLY_NEXT | BGE_PREFETCH_L2},
        {"early reads (opt-in)", BGE_EARLY_READS},
    };
    auto launch = [&](bool staged, int overlap, const ProbeCopy& c) {
        BgeParams b = probe_library_params(c, N_ROWS, IN, OUT, ENTRIES, (u64)fault, staged ? stage_cols : 0);
        b.overlap = overlap;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(8, ENTRIES, 1);
        cfg.blockDim = dim3(BGE_THREADS);
        cfg.dynamicSmemBytes = staged ? staged_smem : reg_smem;
        cfg.stream = st;
        cudaLaunchAttribute at;
        at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &at;
        cfg.numAttrs = overlap == BGE_PLAIN ? 0 : 1;
        if (staged)
            CK(cudaLaunchKernelEx(&cfg, probe_staged_c8_r16, b));
        else
            CK(cudaLaunchKernelEx(&cfg, bgmv_entry_c8_r16_reg, b));
    };

    for (int copies : {24, 2}) {
        std::vector<ProbeCopy> cs = probe_decode_copies(copies, N_ROWS, IN, OUT, R, ENTRIES, [](int) {
            std::vector<int> idx(N_ROWS);
            for (int r = 0; r < N_ROWS; ++r) idx[r] = r % ENTRIES;
            return idx;
        });
        printf("\n== %d input sets (%s)\n", copies, copies > 2 ? "cold, as the bench" : "every byte in L2");
        const int calls = 96;
        for (int round = 0; round < 2; ++round) {
            for (bool staged : {false, true}) {
                for (const Code& code : codes) {
                    auto one = [&](const ProbeCopy& c) { launch(staged, code.overlap, c); };
                    const double rel = probe_check_copy(st, cs[0], N_ROWS, IN, OUT, R, ENTRIES, one);
                    const ProbeTime tm = probe_time_graph(st, calls, [&](int k) { one(cs[k % copies]); });
                    printf("  %-8s %-26s %.2f us (p10 %.2f, p90 %.2f); rel err %.2e\n", staged ? "staged" : "register",
                           code.name, tm.median, tm.p10, tm.p90, rel);
                }
            }
        }
        probe_free_copies(cs);
    }
    u32 hf = 0;
    CK(cudaMemcpy(&hf, fault, 4, cudaMemcpyDeviceToHost));
    printf("\nfault word %u; empty kernel in a graph %.2f us\n", hf, probe_empty_in_graph(st));

    // Addresses no allocation holds.
    char* freed = nullptr;
    CK(cudaMalloc(&freed, 1 << 20));
    CK(cudaFree(freed));
    const u64 bad[] = {0x0ull, 0x1000ull, 0x7f0000000000ull, (u64)freed};
    for (u64 a : bad) {
        probe_prefetch_at<<<1, 32, 0, st>>>(a);
        const cudaError_t e = cudaStreamSynchronize(st);
        printf("bulk prefetch of 4 KB at %#llx: %s\n", (unsigned long long)a, cudaGetErrorString(e));
        if (e != cudaSuccess) return 0;  // the context is gone
    }
    return 0;
}
