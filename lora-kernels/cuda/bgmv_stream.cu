// Streamed decode: the row-indexed apply of bgmv.cu as a stream of equal
// units of weight bytes, for batches whose adapters' bytes dwarf the chain
// of round trips (compiled after bgmv.cu, in the same module: it reads the
// item lists bgmv_list writes).
//
// The fused kernel gives each item a cluster that reads A, sums the rank
// vector across the cluster and then reads B, so the grid holds one
// cluster's chain per item and a batch with more items than resident
// clusters pays the chain twice. Here every item's work is cut into units
// of about 16 KB of weights each:
//   shrink unit (target, item, K slice): A[0..rank, slice] and the item's x
//     rows over the slice -> partial rank vectors part[target][slice][row]
//     (f32, in the scratch), then one release increment of the item's
//     counter (ItemRows::done, which bgmv_list zeroed);
//   expand unit (target, item, output slice): B[slice, 0..stride] and the
//     item's y rows over the slice; waits (acquire) until the item's counter
//     has every K slice, sums the partials, scales, and adds B t to y.
// Every unit's bytes are requested with cp.async into a ring of stages as
// soon as the unit is known, so a block has several units in flight, an
// expand unit's B and y arrive while the shrink units it waits for run, and
// the whole grid streams the adapters' bytes in one wave.
//
// Units are numbered shrink first (target-major, then item, then slice),
// then expand, and a block takes a contiguous range of them by a virtual
// block number it claims from a counter when it starts. An expand unit waits
// only for shrink units, whose numbers are smaller; they belong to blocks
// that claimed a number no larger than its own, so they are resident or done,
// and the wait finishes whatever the number of resident blocks.

#define STREAM_THREADS 256
#define STREAM_WARPS (STREAM_THREADS / 32)
#define STREAM_MAX_STAGES 8
#define STREAM_MAX_UNITS 64  // units per block (the host sizes the grid for it)

struct BgmvStreamParams {
    u64 x;
    u64 y;
    u64 list;  // bgmv_list's lists (window 0 of every target, list_stride bytes apart)
    u64 part;  // partial rank vectors [targets][n_ks][n_rows][rank_stride] f32
    int n_rows;
    int in_dim;
    int x_stride;
    int y_stride;
    int rank_stride;
    int n_targets;
    int list_stride;
    int k_slice;      // A columns of a shrink unit (multiple of 8)
    int o_slice;      // outputs of an expand unit (multiple of 8)
    int n_ks;         // K slices: ceil(in_dim / k_slice)
    int n_stages;     // ring stages (2..=STREAM_MAX_STAGES)
    int stage_bytes;  // one stage: weights, then rows (multiple of 16)
    int rows_off;     // offset of a stage's rows region (x or y of up to G rows)
    int t_off;        // offset of the rank vectors [G][stride8] f32 after the stages
    int kp;           // pitch (elements) of staged A and x rows: k_slice + 8
    int bp;           // pitch (elements) of staged B rows: stride8, + 8 when a multiple of 32
    LoraTarget targets[MAX_TARGETS];
};
static_assert(sizeof(BgmvStreamParams) == 192 && sizeof(BgmvStreamParams) - sizeof(LoraTarget) * MAX_TARGETS == 96,
              "mirrors bgmv/stream.rs");

// What a block knows of one of its units.
struct StreamUnit {
    int target;
    int slice;
    int expand;  // 0: shrink unit
    int pad;
    ItemRows item;
    u64 done;  // address of the item's counter
};

__device__ __forceinline__ void cp_async_wait_upto(int n) {
    // cp.async.wait_group takes an immediate; the ring has at most 8 stages.
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        case 6: cp_async_wait<6>(); break;
        default: cp_async_wait<7>(); break;
    }
}

// The counter is polled with relaxed loads and acquired once: on sm_90 every
// ld.acquire.gpu invalidates the multiprocessor's L1 (CCTL.IVALL), which a
// polling loop would do every round under the co-resident block's copies.
__device__ __forceinline__ int ld_relaxed_s32(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void fence_acquire() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void red_release_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Copy n bf16-sized or larger elements (bytes `n * esize`) from global to
// shared: 16-byte cp.async when `vec`, else plain loads; every thread of the block.
__device__ __forceinline__ void stage_copy(void* dst, const void* src, int bytes, bool vec) {
    if (vec) {
#pragma unroll 1
        for (int c = threadIdx.x; c < (bytes >> 4); c += STREAM_THREADS)
            cp_async16((unsigned char*)dst + c * 16, (const unsigned char*)src + c * 16);
    } else {
#pragma unroll 1
        for (int c = threadIdx.x; c < (bytes >> 1); c += STREAM_THREADS)
            ((unsigned short*)dst)[c] = ((const unsigned short*)src)[c];
    }
}

// Request a unit's bytes into its stage (one cp.async group, committed by the caller).
//   shrink: A rows [rank][kp] then, at rows_off, x rows [G][kp] (zero past
//           the slice's length up to a multiple of 8);
//   expand: B rows [lo][bp] (rank8 columns, zero past the rank) then, at
//           rows_off, y rows [G][o_slice].
// Rows the tensor-core tiles read past these (A rows up to the rank rounded
// to 16, x rows past the item's, B rows past lo) hold stale values that only
// reach results nobody stores.
template <typename Y>
__device__ __forceinline__ void stream_issue(const BgmvStreamParams& p, const StreamUnit& u, unsigned char* stage) {
    const PairEntry& en = u.item.entry;
    const int rank = (int)en.rank;
    const int nr = u.item.nrows;
    if (rank == 0 || nr == 0) return;
    const int tid = threadIdx.x;
    if (!u.expand) {
        const int kc = u.slice * p.k_slice;
        const int len = min(p.k_slice, p.in_dim - kc);
        const int len8 = (len + 7) & ~7;
        const bf16_t* A = (const bf16_t*)en.a;
        const bf16_t* X = (const bf16_t*)p.x;
        bf16_t* sA = (bf16_t*)stage;
        bf16_t* sX = (bf16_t*)(stage + p.rows_off);
        const bool vec_a = (p.in_dim % 8 == 0) && aligned16(A);
        const bool vec_x = (p.in_dim % 8 == 0) && (p.x_stride % 8 == 0) && aligned16(X);
        if (vec_a && vec_x) {
            // Every 16-byte chunk of the A rows, then of the x rows, one loop
            // over the block (the slice's length is a multiple of 8 here).
            const int cpr = len >> 3;
#pragma unroll 1
            for (int v = tid; v < (rank + nr) * cpr; v += STREAM_THREADS) {
                const int r = v / cpr;
                const int c = v - r * cpr;
                const bool is_a = r < rank;
                bf16_t* dst = (is_a ? sA + r * p.kp : sX + (r - rank) * p.kp) + c * 8;
                const bf16_t* src =
                    (is_a ? A + (u64)r * p.in_dim : X + (u64)u.item.rows[r - rank] * p.x_stride) + kc + c * 8;
                cp_async16(dst, src);
            }
            return;
        }
        // Unaligned rows: one warp per row, plain loads, zero past the length.
        const int warp = tid >> 5;
        const int lane = tid & 31;
#pragma unroll 1
        for (int r = warp; r < rank + nr; r += STREAM_WARPS) {
            const bool is_a = r < rank;
            bf16_t* dst = is_a ? sA + r * p.kp : sX + (r - rank) * p.kp;
            const bf16_t* src = is_a ? A + (u64)r * p.in_dim + kc : X + (u64)u.item.rows[r - rank] * p.x_stride + kc;
            stage_row(dst, src, len, len8, is_a ? vec_a : vec_x, lane, 32);
        }
    } else {
        const LoraTarget& tg = p.targets[u.target];
        const int o0 = u.slice * p.o_slice;
        const int lo = min(p.o_slice, tg.out_dim - o0);
        const int stride = p.rank_stride;
        const bf16_t* B = (const bf16_t*)en.b + (u64)o0 * stride;
        bf16_t* sB = (bf16_t*)stage;
        // B row o: whole 8-column chunks below the rank by cp.async, the last one zero past the rank.
        const int cpr = (rank + 7) >> 3;
        const int full = (stride % 8 == 0 && aligned16(B)) ? (rank >> 3) : 0;
#pragma unroll 1
        for (int v = tid; v < lo * cpr; v += STREAM_THREADS) {
            const int r = v / cpr;
            const int c = v - r * cpr;
            const bf16_t* src = B + (u64)r * stride + c * 8;
            bf16_t* dst = sB + r * p.bp + c * 8;
            if (c < full) {
                cp_async16(dst, src);
            } else {
#pragma unroll 1
                for (int j = 0; j < 8; ++j) dst[j] = c * 8 + j < rank ? src[j] : (bf16_t)0;
            }
        }
        Y* sY = (Y*)(stage + p.rows_off);
        const Y* Yp = (const Y*)p.y;
        const int y_bytes = lo * (int)sizeof(Y);
#pragma unroll 1
        for (int g = 0; g < nr; ++g) {
            const Y* src = Yp + (u64)u.item.rows[g] * p.y_stride + tg.y_col_off + o0;
            const bool vec_y = aligned16(src) && y_bytes % 16 == 0;
            stage_copy(sY + g * p.o_slice, src, y_bytes, vec_y);
        }
    }
}

// A shrink unit from its stage, on tensor cores (mma m16n8k8: 16 ranks x
// the item's 8 rows x 8 columns per step): its partial rank vectors added to
// the run's sums in sAcc [G][tp]. Rank tiles are dealt to warps; when there
// are fewer tiles than warps, the warps of a tile split its column steps and
// their fragments meet in sRed, summed in warp order.
__device__ __forceinline__ void stream_shrink(const BgmvStreamParams& p, const StreamUnit& u, const unsigned char* stage,
                                              float* sAcc, float* sRed) {
    const int rank = (int)u.item.entry.rank;
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int tp = (p.rank_stride + 7) & ~7;
    const int len = min(p.k_slice, p.in_dim - u.slice * p.k_slice);
    const int n8 = (len + 7) >> 3;
    const bf16_t* sA = (const bf16_t*)stage;
    const bf16_t* sX = (const bf16_t*)(stage + p.rows_off);
    const int tiles = (rank + 15) >> 4;
    const int wpt = tiles >= STREAM_WARPS ? 1 : STREAM_WARPS / tiles;  // warps per tile
    const int sub = warp % wpt;
    // d[0..1]: rank m0 + lane / 4, rows 2 (lane % 4) + {0, 1}; d[2..3]: rank + 8.
    const int kq = (lane & 3) * 2;
#pragma unroll 1
    for (int m = warp / wpt; m < tiles; m += STREAM_WARPS / wpt) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        float e[4] = {0.f, 0.f, 0.f, 0.f};  // every other step: two independent chains
        const bf16_t* arow = sA + (m * 16 + (lane & 15)) * p.kp;
        const bf16_t* xrow = sX + (lane & 7) * p.kp;
#pragma unroll 1
        for (int ks = sub; ks < n8; ks += 2 * wpt) {
            u32 a0, a1, b0;
            ldsm_x2(a0, a1, arow + ks * 8);
            ldsm_x1(b0, xrow + ks * 8);
            const int ks2 = ks + wpt;
            if (ks2 < n8) {
                u32 c0, c1, b1;
                ldsm_x2(c0, c1, arow + ks2 * 8);
                ldsm_x1(b1, xrow + ks2 * 8);
                mma_k8(e, c0, c1, b1);
            }
            mma_k8(d, a0, a1, b0);
        }
#pragma unroll
        for (int f = 0; f < 4; ++f) d[f] += e[f];
        if (wpt == 1) {
#pragma unroll
            for (int f = 0; f < 4; ++f) {
                const int k = m * 16 + (lane >> 2) + (f >> 1) * 8;
                if (k < rank) sAcc[(kq + (f & 1)) * tp + k] += d[f];
            }
        } else {
            *(float4*)(sRed + warp * 128 + lane * 4) = make_float4(d[0], d[1], d[2], d[3]);
        }
    }
    if (wpt > 1) {
        __syncthreads();
        // Warp w * wpt of each tile sums the tile's warps' fragments.
        if (sub == 0 && warp / wpt < tiles) {
            const int m = warp / wpt;
#pragma unroll
            for (int f = 0; f < 4; ++f) {
                float v = 0.f;
#pragma unroll 1
                for (int w = warp; w < warp + wpt; ++w) v += sRed[w * 128 + lane * 4 + f];
                const int k = m * 16 + (lane >> 2) + (f >> 1) * 8;
                if (k < rank) sAcc[(kq + (f & 1)) * tp + k] += v;
            }
        }
    }
}

// The end of a run of shrink units of one item (K slices s0 .. s0 + len):
// the run's sums go to slot s0 of the partials and zeros to the run's other
// slots, then the item's counter grows by len (release: the slots first).
__device__ __forceinline__ void stream_run_done(const BgmvStreamParams& p, const StreamUnit& u, int s0, int len,
                                                const float* sAcc) {
    const int rank = (int)u.item.entry.rank;
    const int nr = u.item.nrows;
    const int tid = threadIdx.x;
    const int stride = p.rank_stride;
    const int tp = (stride + 7) & ~7;
    const u64 slot_step = (u64)p.n_rows * stride;
    float* part = (float*)p.part + (u64)u.target * p.n_ks * slot_step;
    __syncthreads();  // sAcc is complete
#pragma unroll 1
    for (int v = tid; v < len * nr * rank; v += STREAM_THREADS) {
        const int i = v / (nr * rank);
        const int w = v - i * nr * rank;
        const int g = w / rank;
        const int k = w - g * rank;
        part[(s0 + i) * slot_step + (u64)u.item.rows[g] * stride + k] = i == 0 ? sAcc[g * tp + k] : 0.f;
    }
    __syncthreads();  // every slot of the run is written
    if (tid == 0) {
        __threadfence();
        red_release_add((int*)u.done, len);
    }
}

// An expand unit from its stage, on tensor cores: warps take 16-output
// tiles; per 8-rank step the B operand is t (row g = lane / 4, ranks
// 2 (lane % 4) + {0, 1}) as bf16 hi and lo (about 16 bits kept), from sTh
// [2][G][tp] (stream_load_t). y[row, slice] = staged y + B t.
template <typename Y>
__device__ __forceinline__ void stream_expand(const BgmvStreamParams& p, const StreamUnit& u, const unsigned char* stage,
                                              const bf16_t* sTh) {
    const int rank = (int)u.item.entry.rank;
    const int nr = u.item.nrows;
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int rank8 = (rank + 7) & ~7;
    const int tp = (p.rank_stride + 7) & ~7;
    const LoraTarget& tg = p.targets[u.target];
    const int o0 = u.slice * p.o_slice;
    const int lo = min(p.o_slice, tg.out_dim - o0);
    const bf16_t* sB = (const bf16_t*)stage;
    const Y* sY = (const Y*)(stage + p.rows_off);
    Y* Yp = (Y*)p.y;
    const int kq = (lane & 3) * 2;
    const bf16_t* th = sTh + (lane >> 2) * tp + kq;
    const bf16_t* tl = th + BGMV_G * tp;
    Y* yg[2];
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        live[h] = kq + h < nr;
        yg[h] = Yp + (u64)u.item.rows[live[h] ? kq + h : 0] * p.y_stride + tg.y_col_off + o0;
    }
#pragma unroll 1
    for (int m0 = warp * 16; m0 < lo; m0 += STREAM_WARPS * 16) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
        for (int kb = 0; kb < rank8; kb += 8) {
            u32 a0, a1;
            ldsm_x2(a0, a1, sB + (m0 + (lane & 15)) * p.bp + kb);
            mma_k8(d, a0, a1, *(const u32*)(th + kb));
            mma_k8(d, a0, a1, *(const u32*)(tl + kb));
        }
        // d[0..1]: output m0 + lane / 4, rows kq + {0, 1}; d[2..3]: output + 8.
#pragma unroll
        for (int f = 0; f < 4; ++f) {
            const int o = m0 + (lane >> 2) + (f >> 1) * 8;
            const int h = f & 1;
            if (o < lo && live[h]) y_store(yg[h] + o, y_load(sY + (kq + h) * p.o_slice + o) + d[f]);
        }
    }
}

// The item's rank vectors, as bf16 hi then lo into sTh [2][G][tp] (zero
// past the rank), once its counter shows every K slice: t[g][k] = scale * the
// sum of the slots in slot order, each (row, rank) pair split over `per`
// lanes whose sums meet by shuffles (the same order in every launch).
__device__ __forceinline__ void stream_load_t(const BgmvStreamParams& p, const StreamUnit& u, bf16_t* sTh) {
    const int rank = (int)u.item.entry.rank;
    const int nr = u.item.nrows;
    const int tid = threadIdx.x;
    const int stride = p.rank_stride;
    const int rank8 = (rank + 7) & ~7;
    const int tp = (stride + 7) & ~7;
    if (tid == 0) {
#pragma unroll 1
        while (ld_relaxed_s32((const int*)u.done) < p.n_ks) __nanosleep(256);
        fence_acquire();
    }
    __syncthreads();
    const u64 slot_step = (u64)p.n_rows * stride;
    const float* part = (const float*)p.part + (u64)u.target * p.n_ks * slot_step;
    const float scale = u.item.entry.scale;
    const int pairs = nr * rank8;
    int per = 1;
    while (per < 32 && per * 2 * pairs <= STREAM_THREADS) per *= 2;
#pragma unroll 1
    for (int base = 0; base < pairs * per; base += STREAM_THREADS) {
        const int v = base + tid;
        const int pair = v / per;
        const int sub = v - pair * per;
        const int g = pair / rank8;
        const int k = pair - g * rank8;
        float sum = 0.f;
        if (pair < pairs && k < rank) {
            const float* src = part + (u64)u.item.rows[g] * stride + k;
#pragma unroll 4
            for (int s = sub; s < p.n_ks; s += per) sum += __ldcg(src + s * slot_step);
        }
#pragma unroll
        for (int o = 1; o < 32; o *= 2)
            if (o < per) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (pair < pairs && sub == 0) {
            const float v = sum * scale;
            const bf16_t h = f2bf(v);
            sTh[g * tp + k] = h;
            sTh[(BGMV_G + g) * tp + k] = f2bf(v - bf2f(h));
        }
    }
}

// Whether units a and b belong to the same run (same kind, target and item).
__device__ __forceinline__ bool same_item(const StreamUnit& a, const StreamUnit& b) {
    return a.expand == b.expand && a.done == b.done;
}

template <typename Y>
__device__ __forceinline__ void bgmv_stream_body(const BgmvStreamParams& p) {
    extern __shared__ __align__(16) unsigned char dyn[];
    __shared__ StreamUnit s_units[STREAM_MAX_UNITS];
    __shared__ __align__(16) float s_red[STREAM_WARPS * 128];  // the shrink's per-warp fragments
    __shared__ int s_count[MAX_TARGETS];
    __shared__ int s_vb;
    const int tid = threadIdx.x;
    const int T = p.n_targets;

    grid_dependency_wait();  // bgmv_list completed: lists, counters and the block counter are written
    // One round trip: this block's number and every target's item count.
    if (tid == 0) s_vb = atomicAdd((int*)(p.list + 8), 1);
    if (tid >= 32 && tid < 32 + T)
        s_count[tid - 32] = (int)(u32)__ldcg((const u64*)(p.list + (u64)(tid - 32) * p.list_stride));
    __syncthreads();
    int n_shrink = 0;
    int n_units = 0;
#pragma unroll 1
    for (int t = 0; t < T; ++t) {
        n_shrink += s_count[t] * p.n_ks;
        n_units += s_count[t] * ((p.targets[t].out_dim + p.o_slice - 1) / p.o_slice);
    }
    n_units += n_shrink;
    const int per_block = (n_units + (int)gridDim.x - 1) / (int)gridDim.x;
    const int u0 = s_vb * per_block;
    const int mine = max(0, min(n_units - u0, min(per_block, STREAM_MAX_UNITS)));
    if (mine == 0) return;  // uniform over the block

    // One more round trip: the item record of every unit of the block.
#pragma unroll 1
    for (int v = tid; v < mine * 16; v += STREAM_THREADS) {
        const int j = v >> 4;
        int u = u0 + j;
        const bool expand = u >= n_shrink;
        if (expand) u -= n_shrink;
        int t = 0;
        int per = 0;
#pragma unroll 1
        for (; t < T; ++t) {
            per = expand ? (p.targets[t].out_dim + p.o_slice - 1) / p.o_slice : p.n_ks;
            if (u < s_count[t] * per) break;
            u -= s_count[t] * per;
        }
        const int item = u / per;
        const ItemRows* list = (const ItemRows*)(p.list + (u64)t * p.list_stride) + 1 + item;
        ((int*)&s_units[j].item)[v & 15] = __ldcg((const int*)list + (v & 15));
        if ((v & 15) == 0) {
            s_units[j].target = t;
            s_units[j].slice = u - item * per;
            s_units[j].expand = expand;
            s_units[j].done = (u64)&list->done;
        }
    }
    __syncthreads();

    const int nst = p.n_stages;
    const int tp = (p.rank_stride + 7) & ~7;
    // Shrink runs sum into it, expand units read the item's rank vectors from
    // it: a block's shrink units all come before its expand units.
    float* sT = (float*)(dyn + p.t_off);
#pragma unroll 1
    for (int j = 0; j < nst; ++j) {
        if (j < mine) stream_issue<Y>(p, s_units[j], dyn + j * p.stage_bytes);
        cp_async_commit();
    }
    int run0 = 0;  // first unit of the current run
#pragma unroll 1
    for (int j = 0; j < mine; ++j) {
        unsigned char* stage = dyn + (j % nst) * p.stage_bytes;
        const StreamUnit& u = s_units[j];
        const bool live = u.item.entry.rank > 0 && u.item.nrows > 0;
        const bool first = j == 0 || !same_item(s_units[j - 1], u);
        if (first) run0 = j;
        if (first && live) {
            if (u.expand) {
                stream_load_t(p, u, (bf16_t*)sT);
            } else {
                for (int v = tid; v < BGMV_G * tp; v += STREAM_THREADS) sT[v] = 0.f;
            }
        }
        cp_async_wait_upto(nst - 1);  // unit j's group (one group per stage issue, in order)
        __syncthreads();
        if (live) {
            if (u.expand) {
                stream_expand<Y>(p, u, stage, (const bf16_t*)sT);
            } else {
                stream_shrink(p, u, stage, sT, s_red);
                if (j + 1 == mine || !same_item(u, s_units[j + 1]))
                    stream_run_done(p, u, s_units[run0].slice, j + 1 - run0, sT);
            }
        }
        __syncthreads();  // the stage and sT are free again
        if (j + nst < mine) stream_issue<Y>(p, s_units[j + nst], stage);
        cp_async_commit();
    }
    cp_async_wait<0>();
}

extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 2) bgmv_stream_bf16(const BgmvStreamParams p) {
    bgmv_stream_body<bf16_t>(p);
}
extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 2) bgmv_stream_f32(const BgmvStreamParams p) {
    bgmv_stream_body<float>(p);
}
