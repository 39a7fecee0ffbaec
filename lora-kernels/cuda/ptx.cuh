// PTX wrappers every family shares: async copies and the tensor-core
// matrix loads, stores and MMAs. Prepended to a family's translation unit
// after common.cuh (`cuda_rt::Family::source`).

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// The same with a zero fill where `valid` is false (16 bytes of zeros, no read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(smem)), "l"(gmem), "r"(n) : "memory");
}

// Tensor-core pieces of the TC kernels. ldmatrix: lanes 0-7 (x1) or 0-15
// (x2) give the 16-byte row addresses of 8x8 bf16 tiles.
__device__ __forceinline__ void ldsm_x1(u32& r0, const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r0) : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldsm_x2(u32& r0, u32& r1, const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(smem_u32(row)));
}
// d (16x8 f32) += a (16x8 bf16, row-major) * b (8x8 bf16, column-major).
__device__ __forceinline__ void mma_k8(float* d, u32 a0, u32 a1, u32 b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// d (16x8 f32) += a (16x16 bf16, row-major) * b (16x8 bf16, column-major).
// Registers as PTX lays them out: a0 (row g, k 2t..2t+1), a1 (row g + 8,
// same k), a2 (row g, k 2t+8..2t+9), a3 (row g + 8, those k); b0 (k 2t..2t+1,
// column g), b1 (k 2t+8..2t+9); d0, d1 (row g, columns 2t, 2t+1), d2, d3
// (row g + 8), for lane = 4 g + t.
__device__ __forceinline__ void mma_k16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same with a's four registers as an array.
__device__ __forceinline__ void mma_k16(float* d, const u32* a, u32 b0, u32 b1) {
    mma_k16(d, a[0], a[1], a[2], a[3], b0, b1);
}

// Four 8x8 bf16 tiles; lanes 8m .. 8m + 7 give the 16-byte row addresses of tile m.
__device__ __forceinline__ void ldsm_x4(u32* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}
// The same, each tile transposed: lane (g, c) gets tile elements (2c, g) and (2c + 1, g).
__device__ __forceinline__ void ldsm_x4_trans(u32* r, const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}
#if __CUDA_ARCH__ >= 900
// The inverse of ldsm_x4_trans at the same addresses.
__device__ __forceinline__ void stsm_x4_trans(bf16_t* row, const u32* r) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(smem_u32(row)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
#endif
