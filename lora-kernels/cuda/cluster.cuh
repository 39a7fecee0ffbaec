// Cluster barriers, distributed shared memory, mbarriers and st.async
// (sm_90; empty stand-ins below it), and named barriers. Prepended after
// common.cuh to the decode families (`cuda_rt::Family::source`).

// Named barriers (0 is __syncthreads): `count` threads, whole warps, take part.
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(u32 id, u32 count) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ float ld_dsmem(const float* local, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
// The push form of the cluster sum: every block stores its partial rank
// vectors into each peer's receive slots with st.async, which counts the
// bytes on the peer's mbarrier; a block waits on its own mbarrier only. No
// cluster barrier per item, and so no release fence (MEMBAR.ALL.GPU) in it.
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_addr(const void* local, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
    return remote;
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// The inits visible to the cluster's peers before their first st.async (with a cluster barrier after it).
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, "
            "p;\n}"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(parity)
            : "memory");
    } while (!done);
}
__device__ __forceinline__ void st_async_f4(u32 remote, float4 v, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(remote),
                 "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
                 "r"(__float_as_uint(v.w)), "r"(remote_bar)
                 : "memory");
}
#else
__device__ __forceinline__ void cluster_arrive() {}
__device__ __forceinline__ void cluster_wait() {}
__device__ __forceinline__ float ld_dsmem(const float* local, u32) { return *local; }
__device__ __forceinline__ void cluster_arrive_relaxed() {}
__device__ __forceinline__ u32 cluster_addr(const void* local, u32) { return smem_u32(local); }
__device__ __forceinline__ void mbar_init(u64*, u32) {}
__device__ __forceinline__ void fence_mbar_init() {}
__device__ __forceinline__ void mbar_arrive_expect(u64*, u32) {}
__device__ __forceinline__ void mbar_wait(u64*, u32) {}
__device__ __forceinline__ void st_async_f4(u32, float4, u32) {}
#endif
