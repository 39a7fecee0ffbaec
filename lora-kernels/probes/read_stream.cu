// What a bare read costs: a standalone probe (not part of the library or
// the bench; NOTES.md v23, run 199). It times read-only kernels that stream
// S bytes (8, 16, 32 and 64 MB) the way `xtask bench` times an op in a
// graph: many calls captured in one CUDA graph over rotating buffers (1 GB
// in all, so nothing is left in L2), replayed, per-call time = replay time
// / calls, median of 7 replays. Each kernel folds what it reads into a
// value it never stores, so no load is dead.
//
// Forms: grid-stride 16-byte loads, 8 in flight per thread; a contiguous
// chunk per block with U loads in flight per thread; bulk copies
// (cp.async.bulk on an mbarrier) into a ring of shared-memory stages;
// 16-byte cp.async into such a ring. Blocks per SM as labelled.
//
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O3 -std=c++17 -o read_stream read_stream.cu && ./read_stream
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "probe.cuh"

__global__ void rd_grid_stride(const uint4* __restrict__ p, size_t n16, unsigned* out) {
    unsigned acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __ldg(p + i + j * stride);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}

template <int U>
__global__ void rd_chunk(const uint4* __restrict__ p, size_t n16, unsigned* out) {
    const size_t per = (n16 + gridDim.x - 1) / gridDim.x;
    const size_t b = (size_t)blockIdx.x * per;
    const size_t e = b + per < n16 ? b + per : n16;
    unsigned acc = 0;
    for (size_t i = b + threadIdx.x; i < e; i += (size_t)U * blockDim.x) {
        uint4 v[U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const size_t k = i + (size_t)j * blockDim.x;
            v[j] = k < e ? __ldg(p + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < U; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

template <int CH, int ST>
__global__ void rd_bulk(const char* __restrict__ p, size_t nbytes, unsigned* out) {
    extern __shared__ __align__(128) char sm[];
    __shared__ __align__(8) unsigned long long bar[ST];
    const size_t per = ((nbytes + gridDim.x - 1) / gridDim.x + CH - 1) / CH * CH;
    const size_t b = (size_t)blockIdx.x * per;
    const size_t e = b + per < nbytes ? b + per : nbytes;
    const int pieces = e > b ? (int)((e - b + CH - 1) / CH) : 0;
    if (threadIdx.x == 0)
        for (int s = 0; s < ST; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_u32(&bar[s])));
    asm volatile("fence.proxy.async.shared::cta;");
    __syncthreads();
    unsigned acc = 0;
    auto issue = [&](int k) {
        const int s = k % ST;
        const size_t off = b + (size_t)k * CH;
        const unsigned bytes = (unsigned)(e - off < (size_t)CH ? e - off : (size_t)CH);
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(smem_u32(&bar[s])), "r"(bytes));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         smem_u32(sm + s * CH)),
                     "l"(p + off), "r"(bytes), "r"(smem_u32(&bar[s]))
                     : "memory");
    };
    if (threadIdx.x == 0)
        for (int k = 0; k < ST && k < pieces; ++k) issue(k);
    for (int k = 0; k < pieces; ++k) {
        const int s = k % ST;
        const unsigned phase = (k / ST) & 1;
        asm volatile("{ .reg .pred P; W: mbarrier.try_wait.parity.shared.b64 P, [%0], %1; @!P bra W; }" ::"r"(
                         smem_u32(&bar[s])),
                     "r"(phase)
                     : "memory");
        const unsigned* w = (const unsigned*)(sm + s * CH);
        for (int i = threadIdx.x; i < CH / 4; i += blockDim.x) acc ^= w[i];
        __syncthreads();
        if (threadIdx.x == 0 && k + ST < pieces) issue(k + ST);
    }
    if (acc == 0x12345678u) out[0] = acc;
}

template <int CH, int ST>
__global__ void rd_cp_async(const char* __restrict__ p, size_t nbytes, unsigned* out) {
    extern __shared__ __align__(128) char sm[];
    const size_t per = ((nbytes + gridDim.x - 1) / gridDim.x + CH - 1) / CH * CH;
    const size_t b = (size_t)blockIdx.x * per;
    const size_t e = b + per < nbytes ? b + per : nbytes;
    const int pieces = e > b ? (int)((e - b + CH - 1) / CH) : 0;
    unsigned acc = 0;
    auto issue = [&](int k) {
        const int s = k % ST;
        const size_t off = b + (size_t)k * CH;
        for (int i = threadIdx.x * 16; i < CH; i += blockDim.x * 16)
            if (off + i < e)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(sm + s * CH + i)), "l"(p + off + i));
        asm volatile("cp.async.commit_group;");
    };
    for (int k = 0; k < ST - 1; ++k) {
        if (k < pieces)
            issue(k);
        else
            asm volatile("cp.async.commit_group;");
    }
    for (int k = 0; k < pieces; ++k) {
        if (k + ST - 1 < pieces)
            issue(k + ST - 1);
        else
            asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group %0;" ::"n"(ST - 1));
        __syncthreads();
        const unsigned* w = (const unsigned*)(sm + (k % ST) * CH);
        for (int i = threadIdx.x; i < CH / 4; i += blockDim.x) acc ^= w[i];
        __syncthreads();
    }
    if (acc == 0x12345678u) out[0] = acc;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t sizes[] = {8u << 20, 16u << 20, 32u << 20, 64u << 20};
    const size_t total = 1024ull << 20;
    char* pool = nullptr;
    CK(cudaMalloc(&pool, total));
    CK(cudaMemset(pool, 1, total));
    unsigned* out = nullptr;
    CK(cudaMalloc(&out, 64));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    CK(cudaFuncSetAttribute(rd_bulk<16384, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536));
    CK(cudaFuncSetAttribute(rd_bulk<32768, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 98304));
    CK(cudaFuncSetAttribute(rd_bulk<65536, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 196608));
    CK(cudaFuncSetAttribute(rd_cp_async<16384, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536));
    for (const size_t S : sizes) {
        const int buffers = (int)(total / S);
        auto bench = [&](const char* name, auto launch) {
            const int calls = buffers * 4 < 32 ? 32 : buffers * 4;
            const float us =
                probe_time_graph(st, calls, [&](int r) { launch(pool + (size_t)(r % buffers) * S, S); }, 7).median;
            printf("S=%3zuMB %-30s %8.2f us  %6.0f GB/s\n", S >> 20, name, us, S / us / 1e3);
        };
        // S bytes of traffic: S/2 read and S/2 written.
        bench("memcpy d2d (read + written)", [&](char* p, size_t n) {
            CK(cudaMemcpyAsync(pool + ((p - pool + n) % total), p, n / 2, cudaMemcpyDeviceToDevice, st));
        });
        char name[64];
        for (int bps : {1, 2, 4, 8}) {
            snprintf(name, sizeof name, "grid-stride %dx/SM 512t", bps);
            bench(name, [&](char* p, size_t n) { rd_grid_stride<<<sms * bps, 512, 0, st>>>((const uint4*)p, n / 16, out); });
        }
        for (int bps : {1, 2, 4}) {
            snprintf(name, sizeof name, "chunk U8 %dx/SM 256t", bps);
            bench(name, [&](char* p, size_t n) { rd_chunk<8><<<sms * bps, 256, 0, st>>>((const uint4*)p, n / 16, out); });
        }
        for (int bps : {1, 2, 3}) {
            snprintf(name, sizeof name, "bulk 16Kx4 %dx/SM", bps);
            bench(name, [&](char* p, size_t n) { rd_bulk<16384, 4><<<sms * bps, 256, 65536, st>>>(p, n, out); });
        }
        bench("bulk 32Kx3 2x/SM", [&](char* p, size_t n) { rd_bulk<32768, 3><<<sms * 2, 256, 98304, st>>>(p, n, out); });
        bench("bulk 64Kx3 1x/SM", [&](char* p, size_t n) { rd_bulk<65536, 3><<<sms, 256, 196608, st>>>(p, n, out); });
        for (int bps : {1, 2, 3}) {
            snprintf(name, sizeof name, "cp.async 16Kx4 %dx/SM", bps);
            bench(name, [&](char* p, size_t n) { rd_cp_async<16384, 4><<<sms * bps, 256, 65536, st>>>(p, n, out); });
        }
        bench("empty kernel", [&](char* p, size_t) { rd_grid_stride<<<1, 32, 0, st>>>((const uint4*)p, 0, out); });
        CK(cudaGetLastError());
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
