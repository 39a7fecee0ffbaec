// Row-indexed LoRA apply (decode, mixed slots): every row of x names a
// PairEntry by index (-1: no delta) and
//   y[row, col_off + o] += scale * sum_k B[o, k] * (sum_i A[k, i] * x[row, i])
// for each target, in one launch.
//
// Work split. Rows are grouped by entry inside a window of at most
// BGMV_WIN_MAX rows, so an adapter's A and B are read once for up to BGMV_G
// rows ("items"). A cluster of C blocks serves one item: block r of the
// cluster reduces its 1/C slice of `in` (shrink) into shared memory, the
// partial rank vectors are summed over the cluster through distributed shared
// memory, and then each block adds its 1/C share of the outputs (expand). The
// grid is (C * out_splits, n_windows * clusters_per_window, n_targets); each
// out split recomputes the (tiny) rank vector instead of paying a second
// launch. All of a block's A, B, x and y bytes are requested into L2 with
// bulk prefetches as soon as the entry is known, so the loads that follow
// find them in flight.

#define BGMV_THREADS 256
#define BGMV_WARPS (BGMV_THREADS / 32)
#define BGMV_G 8
#define BGMV_MAX_RANK 256
#define BGMV_KCH 1024
#define BGMV_WIN_MAX 512

struct BgmvParams {
    u64 x;
    u64 y;
    u64 idx;
    u64 fault;
    int n_rows;
    int in_dim;
    int x_stride;
    int y_stride;
    int rank_stride;
    int n_targets;
    int out_splits;
    int clusters_per_window;
    int window;
    int n_windows;
    int pad0;
    int pad1;
    LoraTarget targets[MAX_TARGETS];
};

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u64 g = (u64)p;
    u64 s;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"(g));
    return (u32)s;
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
#else
__device__ __forceinline__ void cluster_arrive() {}
__device__ __forceinline__ void cluster_wait() {}
__device__ __forceinline__ float ld_dsmem(const float* local, u32) { return *local; }
#endif

// Piece i of [0, n) split into `parts` pieces whose starts are multiples of 8.
__device__ __forceinline__ void split8(int n, int parts, int i, int& b, int& e) {
    int per = (n + parts - 1) / parts;
    per = (per + 7) & ~7;
    b = min(n, i * per);
    e = min(n, b + per);
}

template <typename Y, int C>
__device__ __forceinline__ void bgmv_body(const BgmvParams& p) {
    __shared__ __align__(16) int s_idx[BGMV_WIN_MAX];
    __shared__ int s_items[BGMV_WIN_MAX];
    __shared__ int s_scan[BGMV_WARPS + 1];
    __shared__ int s_rows[BGMV_G];
    __shared__ int s_nrows;
    __shared__ PairEntry s_entry;
    __shared__ __align__(16) float s_tpart[BGMV_G][BGMV_MAX_RANK];
    __shared__ __align__(16) float s_t[BGMV_G][BGMV_MAX_RANK];
    __shared__ __align__(16) bf16_t s_x[BGMV_G][BGMV_KCH];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int crank = (int)(blockIdx.x % C);
    const int split = (int)(blockIdx.x / C);
    const int win = (int)blockIdx.y / p.clusters_per_window;
    const int q = (int)blockIdx.y % p.clusters_per_window;
    const LoraTarget tg = p.targets[blockIdx.z];
    const int row0 = win * p.window;
    const int nwin = min(p.window, p.n_rows - row0);
    // Uniform over the cluster (same blockIdx.y and z): no barrier is skipped by one rank only.
    if (nwin <= 0) return;
    const bool report = crank == 0 && split == 0 && q == 0;

    const int* idx = (const int*)p.idx;
    for (int j = tid; j < nwin; j += BGMV_THREADS) {
        int e = idx[row0 + j];
        if (e >= tg.n_entries) {
            if (report) raise_fault(p.fault, FAULT_BAD_INDEX);
            e = -1;
        }
        s_idx[j] = e < 0 ? -1 : e;
    }
    __syncthreads();

    // Row j leads an item when its occurrence number among the window's rows
    // of the same entry is a multiple of G. Thread t owns rows 2t and 2t + 1.
    int lead_flags = 0;
    int n_lead = 0;
    {
        const int j0 = 2 * tid;
        const int e0 = j0 < nwin ? s_idx[j0] : -1;
        const int e1 = j0 + 1 < nwin ? s_idx[j0 + 1] : -1;
        if (e0 >= 0 || e1 >= 0) {
            int occ0 = 0;
            int occ1 = 0;
            int i = 0;
            for (; i + 4 <= j0; i += 4) {
                const int4 v = *(const int4*)&s_idx[i];
                occ0 += (v.x == e0) + (v.y == e0) + (v.z == e0) + (v.w == e0);
                occ1 += (v.x == e1) + (v.y == e1) + (v.z == e1) + (v.w == e1);
            }
            for (; i < j0; ++i) {
                occ0 += s_idx[i] == e0;
                occ1 += s_idx[i] == e1;
            }
            occ1 += e0 == e1;
            if (e0 >= 0 && occ0 % BGMV_G == 0) {
                lead_flags |= 1;
                n_lead++;
            }
            if (e1 >= 0 && occ1 % BGMV_G == 0) {
                lead_flags |= 2;
                n_lead++;
            }
        }
    }
    int n_items;
    int pos = block_exclusive_scan<BGMV_THREADS>(n_lead, s_scan, &n_items);
    if (lead_flags & 1) s_items[pos++] = 2 * tid;
    if (lead_flags & 2) s_items[pos] = 2 * tid + 1;

    int k0, k1;
    split8(p.in_dim, C, crank, k0, k1);
    int s0, s1;
    split8(tg.out_dim, p.out_splits, split, s0, s1);
    int o0, o1;
    split8(s1 - s0, C, crank, o0, o1);
    o0 += s0;
    o1 += s0;

    const int in = p.in_dim;
    const int stride = p.rank_stride;
    const bf16_t* X = (const bf16_t*)p.x;
    Y* Yp = (Y*)p.y;
    const PairEntry* table = (const PairEntry*)tg.table;
    const int ys = p.y_stride;
    const int coff = tg.y_col_off;
    bool pending = false;

    for (int it = q; it < n_items; it += p.clusters_per_window) {
        __syncthreads();  // the previous item's shared state is no longer read
        if (warp == 0) {
            const int lead = s_items[it];
            const int e = s_idx[lead];
            int found = 0;
            for (int base = lead; base < nwin && found < BGMV_G; base += 32) {
                const int j = base + lane;
                const bool m = j < nwin && s_idx[j] == e;
                const unsigned bal = __ballot_sync(0xffffffffu, m);
                const int at = found + __popc(bal & ((1u << lane) - 1u));
                if (m && at < BGMV_G) s_rows[at] = row0 + j;
                found += __popc(bal);
            }
            if (lane == 0) {
                s_nrows = min(found, BGMV_G);
                PairEntry en = table[e];
                if (en.rank > (u32)stride || en.rank > BGMV_MAX_RANK || (en.rank > 0 && (en.a == 0 || en.b == 0))) {
                    if (report) raise_fault(p.fault, FAULT_BAD_RANK);
                    en.rank = 0;
                }
                s_entry = en;
            }
        }
        if (C > 1 && pending) {
            cluster_wait();  // every peer finished reading our s_tpart
            pending = false;
        }
        __syncthreads();
        const PairEntry en = s_entry;
        // rank 0 skips the arithmetic but not the cluster barriers, so the
        // ranks of a cluster stay in step whatever the table holds.
        const int rank = (int)en.rank;
        const int nr = rank > 0 ? s_nrows : 0;
        const bf16_t* A = (const bf16_t*)en.a;
        const bf16_t* B = (const bf16_t*)en.b;

        // Ask for everything this block will read while the first loads start.
        for (int k = tid; k < rank; k += BGMV_THREADS) prefetch_l2(A + (u64)k * in + k0, (u64)(k1 - k0) * 2);
        if (tid == BGMV_THREADS - 1 && nr > 0 && o1 > o0) prefetch_l2(B + (u64)o0 * stride, (u64)(o1 - o0) * stride * 2);
        if (tid >= 32 && tid < 32 + nr) {
            const int r = s_rows[tid - 32];
            prefetch_l2(X + (u64)r * p.x_stride + k0, (u64)(k1 - k0) * 2);
            if (o1 > o0) prefetch_l2(Yp + (u64)r * ys + coff + o0, (u64)(o1 - o0) * sizeof(Y));
        }

        const bool vec_x = (in % 8 == 0) && (p.x_stride % 8 == 0) && aligned16(X) && aligned16(A);
        const bool vec_b = (stride % 8 == 0) && aligned16(B);

        // ---- shrink: s_tpart[g][k] = sum over this rank's slice of A[k, i] x[row_g, i]
        for (int v = tid; v < nr * rank; v += BGMV_THREADS) {
            const int g = v / rank;
            s_tpart[g][v - g * rank] = 0.f;
        }
        for (int kc = k0; kc < k1; kc += BGMV_KCH) {
            const int len = min(BGMV_KCH, k1 - kc);
            __syncthreads();
            if (vec_x) {
                const int n8 = len >> 3;
                for (int v = tid; v < nr * n8; v += BGMV_THREADS) {
                    const int g = v / n8;
                    const int c = v - g * n8;
                    *(uint4*)&s_x[g][c * 8] = ldg16(X + (u64)s_rows[g] * p.x_stride + kc + c * 8);
                }
            } else {
                for (int v = tid; v < nr * len; v += BGMV_THREADS) {
                    const int g = v / len;
                    const int c = v - g * len;
                    s_x[g][c] = X[(u64)s_rows[g] * p.x_stride + kc + c];
                }
            }
            __syncthreads();
            for (int k = warp; k < rank; k += BGMV_WARPS) {
                float acc[BGMV_G];
#pragma unroll
                for (int g = 0; g < BGMV_G; ++g) acc[g] = 0.f;
                const bf16_t* arow = A + (u64)k * in + kc;
                if (vec_x) {
                    const int n8 = len >> 3;
                    for (int c0 = lane; c0 < n8; c0 += 128) {
                        uint4 a[4];
#pragma unroll
                        for (int u = 0; u < 4; ++u) {
                            const int c = c0 + 32 * u;
                            a[u] = c < n8 ? ldg16(arow + c * 8) : make_uint4(0u, 0u, 0u, 0u);
                        }
#pragma unroll
                        for (int u = 0; u < 4; ++u) {
                            const int c = c0 + 32 * u;
                            if (c < n8) {
#pragma unroll
                                for (int g = 0; g < BGMV_G; ++g)
                                    if (g < nr) acc[g] = dot8(a[u], *(const uint4*)&s_x[g][c * 8], acc[g]);
                            }
                        }
                    }
                } else {
                    for (int c = lane; c < len; c += 32) {
                        const float a = bf2f(arow[c]);
#pragma unroll
                        for (int g = 0; g < BGMV_G; ++g)
                            if (g < nr) acc[g] = fmaf(a, bf2f(s_x[g][c]), acc[g]);
                    }
                }
#pragma unroll
                for (int g = 0; g < BGMV_G; ++g)
                    if (g < nr) acc[g] = warp_sum(acc[g]);
                if (lane == 0) {
#pragma unroll
                    for (int g = 0; g < BGMV_G; ++g)
                        if (g < nr) s_tpart[g][k] += acc[g];
                }
            }
        }
        __syncthreads();

        // ---- sum the partial rank vectors over the cluster, scale them.
        const float scale = en.scale;
        if (C > 1) {
            cluster_arrive();
            cluster_wait();
            for (int v = tid; v < nr * rank; v += BGMV_THREADS) {
                const int g = v / rank;
                const int k = v - g * rank;
                float s = 0.f;
#pragma unroll
                for (int r = 0; r < C; ++r) s += ld_dsmem(&s_tpart[g][k], (u32)r);
                s_t[g][k] = s * scale;
            }
            cluster_arrive();
            pending = true;
        } else {
            for (int v = tid; v < nr * rank; v += BGMV_THREADS) {
                const int g = v / rank;
                const int k = v - g * rank;
                s_t[g][k] = s_tpart[g][k] * scale;
            }
        }
        const int rank8 = (rank + 7) & ~7;
        if (rank8 > rank) {
            const int pad = rank8 - rank;
            for (int v = tid; v < nr * pad; v += BGMV_THREADS) {
                const int g = v / pad;
                s_t[g][rank + (v - g * pad)] = 0.f;
            }
        }
        __syncthreads();

        // ---- expand: y[row_g, coff + o] += sum_k s_t[g][k] B[o, k]; one output per thread,
        // so a warp reads 32 consecutive B rows and writes 32 consecutive y values per row.
        for (int o = o0 + tid; nr > 0 && o < o1; o += BGMV_THREADS) {
            float yv[BGMV_G];
#pragma unroll
            for (int g = 0; g < BGMV_G; ++g) yv[g] = g < nr ? y_load(Yp + (u64)s_rows[g] * ys + coff + o) : 0.f;
            float acc[BGMV_G];
#pragma unroll
            for (int g = 0; g < BGMV_G; ++g) acc[g] = 0.f;
            const bf16_t* brow = B + (u64)o * stride;
            if (vec_b) {
                for (int kb = 0; kb < rank; kb += 8) {
                    float w[8];
                    unpack8(ldg16(brow + kb), w);
                    if (kb + 8 > rank) {
#pragma unroll
                        for (int j = 0; j < 8; ++j)
                            if (kb + j >= rank) w[j] = 0.f;
                    }
#pragma unroll
                    for (int g = 0; g < BGMV_G; ++g) {
                        if (g < nr) {
                            const float4 ta = *(const float4*)&s_t[g][kb];
                            const float4 tb = *(const float4*)&s_t[g][kb + 4];
                            float a = acc[g];
                            a = fmaf(ta.x, w[0], a);
                            a = fmaf(ta.y, w[1], a);
                            a = fmaf(ta.z, w[2], a);
                            a = fmaf(ta.w, w[3], a);
                            a = fmaf(tb.x, w[4], a);
                            a = fmaf(tb.y, w[5], a);
                            a = fmaf(tb.z, w[6], a);
                            a = fmaf(tb.w, w[7], a);
                            acc[g] = a;
                        }
                    }
                }
            } else {
                for (int k = 0; k < rank; ++k) {
                    const float w = bf2f(brow[k]);
#pragma unroll
                    for (int g = 0; g < BGMV_G; ++g)
                        if (g < nr) acc[g] = fmaf(s_t[g][k], w, acc[g]);
                }
            }
#pragma unroll
            for (int g = 0; g < BGMV_G; ++g)
                if (g < nr) y_store(Yp + (u64)s_rows[g] * ys + coff + o, yv[g] + acc[g]);
        }
    }
    if (C > 1 && pending) cluster_wait();  // keep our shared memory alive until every peer read it
}

extern "C" __global__ void __launch_bounds__(BGMV_THREADS) bgmv_c1_bf16(const BgmvParams p) { bgmv_body<bf16_t, 1>(p); }
extern "C" __global__ void __launch_bounds__(BGMV_THREADS) bgmv_c1_f32(const BgmvParams p) { bgmv_body<float, 1>(p); }

#if __CUDA_ARCH__ >= 900
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(BGMV_THREADS, 4) bgmv_c8_bf16(const BgmvParams p) {
    bgmv_body<bf16_t, 8>(p);
}
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(BGMV_THREADS, 4) bgmv_c8_f32(const BgmvParams p) {
    bgmv_body<float, 8>(p);
}
#endif
