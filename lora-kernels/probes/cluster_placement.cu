// Where 32 clusters land: a standalone probe (not part of the library or the
// bench; NOTES.md v32). For cluster sizes 4-16, blocks of 128-512 threads and
// a shared-memory footprint that allows k blocks per SM (k = 1..6), it
// prints cudaOccupancyMaxActiveClusters, how many SMs hold 0..7 blocks of a
// grid of 32 clusters (a kernel that spins 5 us and records %smid), the
// busiest SM against the even share, and the per-call time of the same
// launch as an empty kernel in a graph of 200, with and without the cluster
// attribute. The entry-clustered form launches 32 clusters of 8 at the
// bench's n = 256 row.
//
// Build and run on the GPU machine (from lora-kernels/probes):
//   nvcc -arch=sm_90a -O3 -std=c++17 -o cluster_placement cluster_placement.cu && ./cluster_placement
#include "probe.cuh"

__global__ void spin(unsigned* smid, unsigned long long ns) {
    extern __shared__ char sm[];
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    if (threadIdx.x == 0) {
        unsigned s;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
        smid[blockIdx.x] = s;
        sm[0] = 1;
    }
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    unsigned* d;
    CK(cudaMalloc(&d, 4096 * 4));
    CK(cudaFuncSetAttribute(spin, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CK(cudaFuncSetAttribute(spin, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    printf("%d SMs\n", sms);
    const int clusters = 32;
    for (int C : {4, 6, 8, 12, 16})
        for (int thr : {128, 256, 512})
            for (int k : {1, 2, 3, 4, 5, 6}) {
                if (thr * k > 2048) continue;
                const int blocks = clusters * C;
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(blocks);
                cfg.blockDim = dim3(thr);
                cfg.dynamicSmemBytes = (227 * 1024) / k - 2048;  // at most k blocks per SM
                cfg.stream = st;
                cudaLaunchAttribute at[1];
                at[0].id = cudaLaunchAttributeClusterDimension;
                at[0].val.clusterDim.x = C;
                at[0].val.clusterDim.y = 1;
                at[0].val.clusterDim.z = 1;
                cfg.attrs = at;
                cfg.numAttrs = 1;
                int maxc = 0;
                if (cudaOccupancyMaxActiveClusters(&maxc, (void*)spin, &cfg) != cudaSuccess) {
                    cudaGetLastError();
                    continue;
                }
                printf("C=%2d thr=%3d k=%d: max active clusters %2d", C, thr, k, maxc);
                if (maxc < clusters) {
                    printf(" (< %d)\n", clusters);
                    continue;
                }
                CK(cudaLaunchKernelEx(&cfg, spin, d, 5000ull));
                CK(cudaStreamSynchronize(st));
                std::vector<unsigned> h(blocks);
                CK(cudaMemcpy(h.data(), d, blocks * 4, cudaMemcpyDeviceToHost));
                std::vector<int> per(sms, 0), hist(8, 0);
                for (unsigned s : h) per[s % sms]++;
                for (int v : per) hist[std::min(v, 7)]++;
                const int worst = *std::max_element(per.begin(), per.end());
                printf("; SMs holding 0..7 blocks:");
                for (int v : hist) printf(" %3d", v);
                printf("; busiest %d = %.0f%% of the even share", worst, 100.0 * worst / ((double)blocks / sms));
                const double with = probe_time_graph(st, 200, [&](int) { CK(cudaLaunchKernelEx(&cfg, spin, d, 0ull)); }).median;
                cfg.numAttrs = 0;
                const double without = probe_time_graph(st, 200, [&](int) { CK(cudaLaunchKernelEx(&cfg, spin, d, 0ull)); }).median;
                printf("; empty in a graph %.2f us, %.2f without clusters\n", with, without);
            }
    return 0;
}
