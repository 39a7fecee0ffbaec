// The row-register form of the row-indexed apply (bgmv/rows.rs): a cluster
// of 2 blocks of 512 threads per (row, target), every block loading its half
// of the row's A slice, x, B rows and y values straight into registers as
// soon as the row's entry is known. Compiled after bgmv.cu and bgmv_entry.cu
// (one module): it uses their helpers and the entry form's parameter block
// (its stage_cols unread).
//
// Why: with one row per adapter (n = 64 of 64 adapters) each row's A and B
// are read once whatever the form, and the time is how fast 128 KB per
// multiprocessor arrive after the row index. The row-mapped fused form
// stages them in shared memory (cp.async); register loads, 8 of A and 8 of
// B in flight per thread with no work between them, stream them faster
// (NOTES.md v29: a standalone probe, then this kernel).
//
// Block q of the cluster of row `row`, target z:
//   1. reads idx[row] while the table is copied into shared memory (small
//      tables) and checks the entry; no delta: the whole cluster returns.
//   2. loads: thread (g = tid / 256, c = tid % 256) holds 8 columns
//      (piece c of the block's half of `in`) of rank rows g, g + 2, ..., g +
//      14 of A, and the same 8 columns of x; and the 16 rank columns of B
//      rows o .. o + 3 (o = o0 + 4 tid, the block's half of the outputs) and
//      y's values there. Under the overlap, x and y only after the wait.
//   3. shrink: 8 dot products of 8 columns a thread, each summed over the
//      warp and over the 8 warps of each g in shared memory: the block's
//      partial rank vector.
//   4. sum: each block pushes its partial into both blocks' receive buffer
//      (st.async on an mbarrier); t = scale * (partial 0 + partial 1), the
//      same in both.
//   5. expand: y[o + i] += sum_k B[o + i, k] t[k], through the DoRA
//      epilogue (common.cuh) where the entry has a rescale, rounded once.
//
// Two forms of steps 2-5: the general one (slices guarded, ranks masked,
// element loads where rows are not aligned) and, in the _full kernels, a
// straight-line one for rank-16 entries with aligned weights in calls of
// in = out = BGR_MAX_IN with aligned x and y rows; each guard the general
// form adds cost 0.2-0.8 us there (NOTES.md v29).
//
// Requirements the host checks (RowsShape::check): rank stride 16, in a
// multiple of 8 of at most BGR_MAX_IN, outputs of at most BGR_MAX_OUT per
// target; for the _full kernels also full_form. A, B, x and y of any 2-byte
// alignment and stride (16-byte loads where aligned, else element loads).

// BGR_THREADS: from the host's prelude (`cuda_rt::prelude`).
// Threads per rank group: the 8-column pieces of a block's half of `in`.
// BGR_PIECES: from the host's prelude (`cuda_rt::prelude`).
#define BGR_GROUPS (BGR_THREADS / BGR_PIECES)
// BGR_RANKS: from the host's prelude (`cuda_rt::prelude`).
#define BGR_ROWS_PER_THREAD (BGR_RANKS / BGR_GROUPS)
// Outputs per thread: a block serves up to BGR_THREADS * BGR_OUT_PER_THREAD.
#define BGR_OUT_PER_THREAD 4
#define BGR_MAX_IN (2 * 8 * BGR_PIECES)
#define BGR_MAX_OUT (2 * BGR_THREADS * BGR_OUT_PER_THREAD)

// Four consecutive outputs of one row, loaded before the shrink and kept as
// raw words (an unpack right after the load would wait for it there):
// bf16 in two words where 8-byte aligned, else one value a word; f32 a word each.
__device__ __forceinline__ void bgr_load_y(const bf16_t* p, bool vec, int live, u32* w) {
    if (vec) {
        const uint2 v = *(const uint2*)p;
        w[0] = v.x;
        w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = i < live ? (u32)p[i] : 0u;
    }
}
__device__ __forceinline__ void bgr_load_y(const float* p, bool vec, int live, u32* w) {
    if (vec) {
        const uint4 v = *(const uint4*)p;
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = i < live ? __float_as_uint(p[i]) : 0u;
    }
}
// Value i of four outputs bgr_load_y loaded, widened.
__device__ __forceinline__ float bgr_y(const bf16_t*, bool vec, const u32* w, int i) {
    return vec ? ((i & 1) ? bf_hi(w[i >> 1]) : bf_lo(w[i >> 1])) : bf2f((bf16_t)w[i]);
}
__device__ __forceinline__ float bgr_y(const float*, bool, const u32* w, int i) { return __uint_as_float(w[i]); }

// The plain kernels' store: four outputs y + d (y as bgr_load_y loaded them).
__device__ __forceinline__ void bgr_store_y(bf16_t* p, bool vec, int live, const u32* w, const float* d) {
    if (vec) {
        *(uint2*)p = make_uint2(pack_bf2_rn(bf_lo(w[0]) + d[0], bf_hi(w[0]) + d[1]),
                                pack_bf2_rn(bf_lo(w[1]) + d[2], bf_hi(w[1]) + d[3]));
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < live) p[i] = f2bf(bf2f((bf16_t)w[i]) + d[i]);
    }
}
__device__ __forceinline__ void bgr_store_y(float* p, bool vec, int live, const u32* w, const float* d) {
    if (vec) {
        *(float4*)p = make_float4(__uint_as_float(w[0]) + d[0], __uint_as_float(w[1]) + d[1],
                                  __uint_as_float(w[2]) + d[2], __uint_as_float(w[3]) + d[3]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < live) p[i] = __uint_as_float(w[i]) + d[i];
    }
}

// The _dora kernels: the values y + d of four outputs from column c (of the
// target) on, through the DoRA epilogue where g is non-null (columns past
// `live` are not stored and their g is not read).
template <typename Y>
__device__ __forceinline__ void bgr_out(const Y* p, bool vec, int live, const u32* w, const float* d,
                                        const float* g, const LoraTarget& tg, int c, float* v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = bgr_y(p, vec, w, i) + d[i];
        if (g != nullptr && i < live) v[i] = dora_epilogue(v[i], g, tg, c + i);
    }
}

// The _dora kernels' store: four outputs' final values v (as bgr_load_y loaded them).
__device__ __forceinline__ void bgr_store_v(bf16_t* p, bool vec, int live, const float* v) {
    if (vec) {
        *(uint2*)p = make_uint2(pack_bf2_rn(v[0], v[1]), pack_bf2_rn(v[2], v[3]));
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < live) p[i] = f2bf(v[i]);
    }
}
__device__ __forceinline__ void bgr_store_v(float* p, bool vec, int live, const float* v) {
    if (vec) {
        *(float4*)p = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < live) p[i] = v[i];
    }
}

// The block's shared state (bgr_body's), for the apply forms below.
struct BgrShared {
    float (*part)[BGR_ROWS_PER_THREAD];
    float* mine;
    float (*recv)[BGR_RANKS];
    float* t;
    u64* bar;
};

// Steps 3b-4: this block's partial rank vector (in sh.mine, written by
// lanes 0-15 of warp 0) pushed into slot q of both blocks' receive
// buffers; t = scale * (partial 0 + partial 1) into sh.t, the same in both.
__device__ __forceinline__ void bgr_cluster_sum(const BgrShared& sh, int q, float scale) {
    constexpr int C = 2;
    constexpr int R = BGR_RANKS;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    cluster_wait();  // both blocks run, their mbarriers initialised
    if (tid < 32) {
        __syncwarp();
        if (lane == 0) mbar_arrive_expect(sh.bar, (u32)(C * R * 4));
        if (lane < 4 * C) {
            const u32 peer = (u32)(lane / 4);
            const int k4 = 4 * (lane % 4);
            st_async_f4(cluster_addr(&sh.recv[q][k4], peer), *(const float4*)&sh.mine[k4], cluster_addr(sh.bar, peer));
        }
    }
    mbar_wait(sh.bar, 0u);
    if (tid < R) {
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < C; ++r) sum += sh.recv[r][tid];
        sh.t[tid] = sum * scale;
    }
    __syncthreads();
}

// Step 3a: the block's partial from each thread's RPT dot products (s[j]:
// rank row g + 2 j), each summed over its warp, then over the group's warps
// in order, into sh.mine.
__device__ __forceinline__ void bgr_block_partial(const BgrShared& sh, float* s) {
    constexpr int G = BGR_GROUPS;
    constexpr int RPT = BGR_ROWS_PER_THREAD;
    constexpr int WPG = BGR_PIECES / 32;  // warps per rank group
    const int tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < RPT; ++j) s[j] = warp_sum(s[j]);
    if ((tid & 31) == 0)
#pragma unroll
        for (int j = 0; j < RPT; ++j) sh.part[tid >> 5][j] = s[j];
    __syncthreads();
    // Rank k: group k % G, its sum j = k / G.
    if (tid < BGR_RANKS) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WPG; ++w) sum += sh.part[(tid % G) * WPG + w][tid / G];
        sh.mine[tid] = sum;
    }
}

// Steps 3-4 from the thread's A pieces and x piece: the row's scaled rank
// vector t, the same in both blocks, in registers.
__device__ __forceinline__ void bgr_rank_vector(const BgrShared& sh, const uint4* a, uint4 xv, int q, float scale,
                                                float* t) {
    float s[BGR_ROWS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < BGR_ROWS_PER_THREAD; ++j) s[j] = dot8(a[j], xv, 0.f);
    bgr_block_partial(sh, s);
    bgr_cluster_sum(sh, q, scale);
#pragma unroll
    for (int k = 0; k < BGR_RANKS; k += 4) {
        const float4 v = *(const float4*)&sh.t[k];
        t[k] = v.x;
        t[k + 1] = v.y;
        t[k + 2] = v.z;
        t[k + 3] = v.w;
    }
}

// Steps 2-5 for the common case, straight-line: in = out = BGR_MAX_IN
// (every thread's piece and outputs inside its block's halves), x rows
// 16-byte aligned and y rows aligned to 4 outputs (the host checked those:
// the _full kernels), rank 16 and A and B 16-byte aligned (this block
// checked). NOTES.md v29: the guards, masks and load order the general
// form below needs cost 0.2-0.8 us each at n = 64 (measured; why is not
// understood: the loads and their first uses are the same).
template <typename Y, bool DORA>
__device__ __forceinline__ void bgr_apply_full(const BgeParams& p, const LoraTarget& tg, const PairEntry& en,
                                               const float* dora_g, int row, int q, const BgrShared& sh) {
    constexpr int R = BGR_RANKS;
    constexpr int G = BGR_GROUPS;
    constexpr int RPT = BGR_ROWS_PER_THREAD;
    constexpr int OPT = BGR_OUT_PER_THREAD;
    constexpr int HALF_IN = BGR_MAX_IN / 2;
    constexpr int HALF_OUT = BGR_MAX_OUT / 2;
    const int tid = threadIdx.x;
    const bf16_t* A = (const bf16_t*)en.a;
    const bf16_t* B = (const bf16_t*)en.b;
    const int col = q * HALF_IN + 8 * (tid % BGR_PIECES);
    const int g = tid / BGR_PIECES;
    uint4 a[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) a[j] = ldg16(A + (u64)(g + G * j) * BGR_MAX_IN + col);
    const uint4 xv = ldg16((const bf16_t*)p.x + (u64)row * p.x_stride + col);
    const int o = q * HALF_OUT + OPT * tid;
    uint4 b[2 * OPT];
#pragma unroll
    for (int i = 0; i < 2 * OPT; ++i) b[i] = ldg16(B + (u64)o * R + 8 * i);
    Y* yp = (Y*)p.y + (u64)row * p.y_stride + tg.y_col_off + o;
    u32 yw[4];
    bgr_load_y(yp, true, OPT, yw);

    float t[R];
    bgr_rank_vector(sh, a, xv, q, en.scale, t);
    float d[OPT];
#pragma unroll
    for (int i = 0; i < OPT; ++i) d[i] = dot8f(b[2 * i + 1], t + 8, dot8f(b[2 * i], t, 0.f));
    if constexpr (DORA) {
        float v[OPT];
        bgr_out(yp, true, OPT, yw, d, dora_g, tg, o, v);
        bgr_store_v(yp, true, OPT, v);
    } else {
        bgr_store_y(yp, true, OPT, yw, d);
    }
}

// Steps 2-5 for any call the form serves: slices guarded, rank rows past
// the rank not read and B's columns past it masked (padding is never
// trusted), element loads where A, B, x or y are not aligned for vectors;
// under the overlap x and y are read only after the wait.
template <typename Y, bool DORA>
__device__ __forceinline__ void bgr_apply_general(const BgeParams& p, const LoraTarget& tg, const PairEntry& en,
                                                  const float* dora_g, int row, int q, const BgrShared& sh) {
    constexpr int C = 2;
    constexpr int R = BGR_RANKS;
    constexpr int G = BGR_GROUPS;
    constexpr int RPT = BGR_ROWS_PER_THREAD;
    constexpr int OPT = BGR_OUT_PER_THREAD;
    const int tid = threadIdx.x;
    const int rank = (int)en.rank;
    const bf16_t* A = (const bf16_t*)en.a;
    const bf16_t* B = (const bf16_t*)en.b;
    const int in = p.in_dim;
    int k0, k1, o0, o1;
    split8(in, C, q, k0, k1);
    split8(tg.out_dim, C, q, o0, o1);
    const int g = tid / BGR_PIECES;
    const int col = k0 + 8 * (tid % BGR_PIECES);
    const bool col_live = col < k1;  // in is a multiple of 8: a piece is whole or past the slice
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const bool a_vec = aligned16(A);
    uint4 a[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
        const int k = g + G * j;
        a[j] = col_live && k < rank ? load8_any(A + (u64)k * in + col, a_vec) : zero;
    }
    const int o = o0 + OPT * tid;
    // The thread's outputs: OPT where the block's range holds them all, else
    // those left (none past it). Not `max(0, min(OPT, o1 - o)) == OPT` for
    // `whole`: ptxas folded that test into the clamp's predicate output and
    // threads with 1 output left took the 4-output vector store, writing
    // back stale y over the next target's columns (NOTES.md v30).
    const bool whole = o + OPT <= o1;
    const int live = whole ? OPT : max(0, o1 - o);
    const bool b_vec = aligned16(B);
    uint4 b[2 * OPT];
#pragma unroll
    for (int i = 0; i < OPT; ++i) {
        b[2 * i] = i < live ? load8_any(B + (u64)(o + i) * R, b_vec) : zero;
        b[2 * i + 1] = i < live ? load8_any(B + (u64)(o + i) * R + 8, b_vec) : zero;
    }
    if (p.overlap == CHAIN_EARLY_READS) grid_dependency_wait();
    const bf16_t* xrow = (const bf16_t*)p.x + (u64)row * p.x_stride;
    const uint4 xv = col_live ? load8_any(xrow + col, aligned16(xrow)) : zero;
    Y* yp = (Y*)p.y + (u64)row * p.y_stride + tg.y_col_off + o;
    const bool y_vec = whole && ((u64)yp % (OPT * sizeof(Y))) == 0ull;
    u32 yw[4];
    bgr_load_y(yp, y_vec, live, yw);

    float t[R];
    bgr_rank_vector(sh, a, xv, q, en.scale, t);
    float d[OPT];
#pragma unroll
    for (int i = 0; i < OPT; ++i) {
        uint4 lo = b[2 * i], hi = b[2 * i + 1];
        lo = make_uint4(lo.x & rank_mask(0, rank), lo.y & rank_mask(2, rank), lo.z & rank_mask(4, rank),
                        lo.w & rank_mask(6, rank));
        hi = make_uint4(hi.x & rank_mask(8, rank), hi.y & rank_mask(10, rank), hi.z & rank_mask(12, rank),
                        hi.w & rank_mask(14, rank));
        d[i] = dot8f(hi, t + 8, dot8f(lo, t, 0.f));
    }
    if constexpr (DORA) {
        float v[OPT];
        bgr_out(yp, y_vec, live, yw, d, dora_g, tg, o, v);
        if (live > 0) bgr_store_v(yp, y_vec, live, v);
    } else {
        if (live > 0) bgr_store_y(yp, y_vec, live, yw, d);
    }
}

// FULL: the host checked the straight-line form's shape and alignment (the
// _full kernels); it serves every row whose entry is of rank 16 with A and
// B 16-byte aligned, the general form the others. DORA: the DoRA epilogue
// compiled in (the _dora kernels).
template <typename Y, bool FULL, bool DORA>
__device__ __forceinline__ void bgr_body(const BgeParams& p) {
    constexpr int C = 2;
    constexpr int R = BGR_RANKS;
    constexpr int RPT = BGR_ROWS_PER_THREAD;
    constexpr int NW = BGR_THREADS / 32;
    __shared__ __align__(16) PairEntry s_table[BGMV_TABLE_SMEM];
    __shared__ float s_part[NW][RPT];
    __shared__ __align__(16) float s_mine[R];
    __shared__ __align__(16) float s_recv[C][R];
    __shared__ __align__(16) float s_t[R];
    __shared__ __align__(8) u64 s_bar;

    const int tid = threadIdx.x;
    const int q = (int)(blockIdx.x % C);
    const int row = (int)blockIdx.y;
    const LoraTarget tg = p.targets[blockIdx.z];
    bge_wait_first(p);
    if (p.overlap == CHAIN_EARLY_READS) grid_launch_dependents();

    // 1. The row's entry. A small table is copied whole into shared memory
    // while the index arrives, so the entry is no second round trip.
    const int raw = ((const int*)p.idx)[row];
    const bool table_smem = tg.n_entries <= BGMV_TABLE_SMEM && (tg.table & 7ull) == 0ull;
    if (table_smem) {
        const u64* src = (const u64*)tg.table;
        u64* dst = (u64*)s_table;
#pragma unroll 1
        for (int w = tid; w < tg.n_entries * 3; w += BGR_THREADS) cp_async8(dst + w, src + w);
        cp_async_commit();
    }
    if (tid == 0) {
        mbar_init(&s_bar, 1);
        fence_mbar_init();
    }
    // Waited for before the push: both blocks are running, their mbarriers initialised.
    cluster_arrive_relaxed();
    if (table_smem) cp_async_wait<0>();
    __syncthreads();
    PairEntry en;
    const int e = checked_entry(raw, tg.n_entries, table_smem ? s_table : (const PairEntry*)tg.table, R, p.fault,
                                q == 0 && tid == 0, &en);
    // Uniform over the cluster: both blocks read the same row and entry.
    if (e < 0 || en.rank == 0) {
        cluster_wait();
        return;
    }
    const BgrShared sh = {s_part, s_mine, s_recv, s_t, &s_bar};
    const float* g = nullptr;  // the DoRA epilogue's rescale, or null
    if constexpr (DORA) g = dora_scale_of(tg, e);
    if (FULL && en.rank == (u32)R && aligned16((const void*)en.a) && aligned16((const void*)en.b))
        bgr_apply_full<Y, DORA>(p, tg, en, g, row, q, sh);
    else
        bgr_apply_general<Y, DORA>(p, tg, en, g, row, q, sh);
    if (p.overlap == CHAIN_WAIT_FIRST) grid_launch_dependents();  // the next launch once this block's work is out
}

#if __CUDA_ARCH__ >= 900
// One block per multiprocessor (up to 128 registers a thread): 8 A and 8 B
// loads of 16 bytes in flight per thread. _full: the straight-line form's
// shape (bgmv/rows.rs `full_form`). Each macro defines NAME in the plain
// module and NAME_dora, the same body with the DoRA epilogue compiled in, in
// the DoRA module (decode.cuh).
#define BGR_KERNEL(NAME, Y, FULL)                                                    \
    extern "C" __global__ void __cluster_dims__(2, 1, 1)                             \
        __launch_bounds__(BGR_THREADS, 1) DECODE_NAME(NAME)(const BgeParams p) {     \
        bgr_body<Y, FULL, kDecodeDora>(p);                                           \
    }
BGR_KERNEL(bgmv_rows_bf16, bf16_t, false)
BGR_KERNEL(bgmv_rows_f32, float, false)
BGR_KERNEL(bgmv_rows_full_bf16, bf16_t, true)
BGR_KERNEL(bgmv_rows_full_f32, float, true)
#endif
