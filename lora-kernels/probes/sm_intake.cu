// How fast one multiprocessor takes bytes in: a standalone probe (not part
// of the library or the bench; NOTES.md v33). 128 blocks, one a
// multiprocessor (the shared memory asks for more than half of it), each
// bringing in its own contiguous KB kilobytes at once, the way a
// one-block-a-multiprocessor decode form would: 16-byte loads into
// registers (all issued before any is used), 16-byte cp.async into shared
// memory (one group), or bulk copies (cp.async.bulk on one mbarrier) of
// PIECE bytes issued by one thread or by the 32 lanes of warp 0. Timed as
// the bench's in-a-graph rows (many calls over rotating input sets: 24
// sets, nothing in L2, or 2 sets, every byte an L2 hit), with thread 0
// stamping when its block's bytes are all in.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o sm_intake sm_intake.cu && ./sm_intake
#include <cstdint>

#include "probe.cuh"

constexpr int BLOCKS = 128;
constexpr int SMEM = 160 * 1024;

__device__ __forceinline__ unsigned s_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}

// stamps[block]: {start, all in}.
template <int KB>
__global__ void __launch_bounds__(512, 1) in_ldg(const char* base, unsigned long long* stamps, unsigned* out) {
    constexpr int N = KB * 1024 / 512 / 16;
    const unsigned long long t0 = gtimer();
    const uint4* p = (const uint4*)(base + (size_t)blockIdx.x * KB * 1024) + threadIdx.x;
    uint4 v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = __ldg(p + i * 512);
    unsigned acc = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    __syncthreads();
    if (threadIdx.x == 0) {
        stamps[2 * blockIdx.x] = t0;
        stamps[2 * blockIdx.x + 1] = gtimer();
    }
    if (acc == 0x12345678u) out[0] = acc;
}

template <int KB>
__global__ void __launch_bounds__(512, 1) in_cp_async(const char* base, unsigned long long* stamps, unsigned* out) {
    extern __shared__ __align__(128) char sm[];
    constexpr int N = KB * 1024 / 512 / 16;
    const unsigned long long t0 = gtimer();
    const char* p = base + (size_t)blockIdx.x * KB * 1024;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int off = (i * 512 + threadIdx.x) * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s_addr(sm + off)), "l"(p + off) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        stamps[2 * blockIdx.x] = t0;
        stamps[2 * blockIdx.x + 1] = gtimer();
    }
    if (((const unsigned*)sm)[threadIdx.x] == 0x12345678u) out[0] = 1;
}

// LANES threads of warp 0 issue the pieces (lane l: pieces l, l + LANES, ...).
template <int KB, int PIECE, int LANES>
__global__ void __launch_bounds__(512, 1) in_bulk(const char* base, unsigned long long* stamps, unsigned* out) {
    extern __shared__ __align__(128) char sm[];
    __shared__ __align__(8) unsigned long long bar;
    constexpr int PIECES = KB * 1024 / PIECE;
    const unsigned long long t0 = gtimer();
    const char* p = base + (size_t)blockIdx.x * KB * 1024;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(s_addr(&bar)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(s_addr(&bar)), "r"(KB * 1024) : "memory");
    if (threadIdx.x < LANES) {
        for (int k = threadIdx.x; k < PIECES; k += LANES)
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    s_addr(sm + k * PIECE)),
                "l"(p + (size_t)k * PIECE), "r"(PIECE), "r"(s_addr(&bar))
                : "memory");
    }
    asm volatile("{ .reg .pred P; W: mbarrier.try_wait.parity.shared.b64 P, [%0], 0; @!P bra W; }" ::"r"(s_addr(&bar))
                 : "memory");
    if (threadIdx.x == 0) {
        stamps[2 * blockIdx.x] = t0;
        stamps[2 * blockIdx.x + 1] = gtimer();
    }
    if (((const unsigned*)sm)[threadIdx.x] == 0x12345678u) out[0] = 1;
}

int main() {
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    const size_t set_bytes = (size_t)BLOCKS * 144 * 1024;
    const int max_sets = 24;
    char* pool = nullptr;
    CK(cudaMalloc(&pool, set_bytes * max_sets));
    CK(cudaMemset(pool, 1, set_bytes * max_sets));
    unsigned long long* stamps = nullptr;
    CK(cudaMalloc(&stamps, (size_t)BLOCKS * 2 * 8 * 256));
    unsigned* out = nullptr;
    CK(cudaMalloc(&out, 64));
    printf("copy bandwidth %.0f GB/s; empty kernel in a graph %.2f us\n", probe_copy_bandwidth(st),
           probe_empty_in_graph(st));
    struct Form {
        const char* name;
        void (*k)(const char*, unsigned long long*, unsigned*);
        int kb;
    };
    const Form forms[] = {
        {"ldg 96K", in_ldg<96>, 96},
        {"ldg 144K", in_ldg<144>, 144},
        {"cp.async 96K", in_cp_async<96>, 96},
        {"cp.async 144K", in_cp_async<144>, 144},
        {"bulk 96K 4K x1 lane", in_bulk<96, 4096, 1>, 96},
        {"bulk 96K 16K x1 lane", in_bulk<96, 16384, 1>, 96},
        {"bulk 96K 4K x8 lanes", in_bulk<96, 4096, 8>, 96},
        {"bulk 144K 4K x1 lane", in_bulk<144, 4096, 1>, 144},
        {"bulk 144K 16K x1 lane", in_bulk<144, 16384, 1>, 144},
        {"bulk 144K 2K x32 lanes", in_bulk<144, 2048, 32>, 144},
        {"bulk 144K 4K x8 lanes", in_bulk<144, 4096, 8>, 144},
    };
    for (const Form& f : forms) CK(cudaFuncSetAttribute(f.k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    for (int sets : {24, 2}) {
        printf("\n== %d input sets (%s)\n", sets, sets > 2 ? "cold" : "L2");
        for (const Form& f : forms) {
            const int calls = 96;
            const ProbeTime tm = probe_time_graph(st, calls, [&](int k) {
                f.k<<<BLOCKS, 512, SMEM, st>>>(pool + (size_t)(k % sets) * set_bytes, stamps + (size_t)(k % 2) * BLOCKS * 2, out);
            });
            CK(cudaGetLastError());
            std::vector<unsigned long long> h((size_t)BLOCKS * 2);
            CK(cudaMemcpy(h.data(), stamps, h.size() * 8, cudaMemcpyDeviceToHost));
            unsigned long long t0 = ~0ull;
            for (int b = 0; b < BLOCKS; ++b) t0 = std::min(t0, h[2 * b]);
            std::vector<double> start, in;
            for (int b = 0; b < BLOCKS; ++b) {
                start.push_back((double)(h[2 * b] - t0));
                in.push_back((double)(h[2 * b + 1] - t0));
            }
            const double bytes = (double)BLOCKS * f.kb * 1024;
            printf("%-24s %6.2f us a call (%5.0f GB/s); start max %5.0f ns; all in med %5.0f max %5.0f ns "
                   "(%4.1f GB/s an SM at the median)\n",
                   f.name, tm.median, bytes / tm.median / 1e3, probe_pct(start, 1.0), probe_pct(in, 0.5), probe_pct(in, 1.0),
                   f.kb * 1024 / probe_pct(in, 0.5));
        }
    }
    return 0;
}
