// The entry-clustered form of the row-indexed apply (bgmv.rs `entry`):
// one cluster of C blocks per (table entry, target) serves every row that
// names the entry, on tensor cores, with the shrink's fragments loaded
// straight from global memory. Compiled with bgmv.cu (one module): it uses
// that file's helpers.
//
// Why: where entries hold several rows (decode batches of tens to hundreds
// of rows over tens of adapters), the fused kernel's per-item staging loops
// cost more instructions than the bytes they move (NOTES.md v20). Here a
// warp moves 16 bytes per lane per load straight into mma fragments, and an
// entry's A and B are read once for all of its rows.
//
// Block (cluster rank q of entry e, target z):
//   1. reads entry e of the table and every row index (one load each per
//      thread and 256 rows), lists the rows naming e in row order (a ballot
//      per warp, two barriers per 256 rows); no rows: the whole cluster returns.
//   2. shrink: its 1/C slice of `in`, in 32-column chunks dealt to the
//      warps. m16n8k16 with M = 16 ranks, N = 8 rows, K = 16 columns: a lane
//      loads 8 consecutive columns of A rows g and g + 8 and of x row g, and
//      two mma take its words (0, 1) and (2, 3) as their k pairs (2c, 2c+1)
//      and (2c+8, 2c+9). The k order is a permutation shared by both
//      operands, so the sum is the same. Once the first chunks' loads are
//      out, the block's B rows and y values are copied into shared memory
//      (cp.async; where they fit) for the expand.
//   3. sum: the warps' partials in shared memory, then the cluster's
//      blocks' partials (pushed into every peer's receive buffer, or read
//      from the peers at rank 64), in rank order, times the scale:
//      t [rows][ranks] f32, the same in every block.
//   4. expand: its 1/C slice of the outputs, in groups of 32 outputs dealt
//      to the warps. m16n8k16 with M = 16 rows, N = 8 outputs, K = 16
//      ranks, t split into bf16 hi + lo (two mma). The 8 outputs of tile j
//      are permuted so that lane (g, c) ends with outputs 8c .. 8c+7 of row
//      g (and g + 8) in its four tiles' accumulators: one 16-byte load of
//      y before (the mma's C operand) and one store after. At rank stride
//      64 with B and y staged, outputs are the M instead (B's rows through
//      ldmatrix, y's staged values through ldmatrix.trans and back through
//      stmatrix.trans, then stored 16 bytes a lane), so the form above is
//      built unstaged there and keeps within its registers. Either way the
//      DoRA epilogue (common.cuh) rescales a row's sums before they are
//      rounded, where the entry has a rescale at the target.
// Rows are taken 16 at a time (a pass); an entry with more rows runs more
// passes, each reading its A slice again (from L2 after the first) and
// copying its rows' y values.
//
// Requirements the host checks: bf16 y; in, x_stride, y_stride, every
// target's out and column offset multiples of 8; x and y 16-byte aligned;
// rank stride 16 * KS. A and B addresses of any 2-byte alignment are read
// (16-byte loads where aligned, else element loads; B is staged only when
// 16-byte aligned).

// Probe hooks (probes/entry_timeline.cu stamps each phase of a block):
// nothing in the library.
#ifndef BGE_TRACE_BEGIN
#define BGE_TRACE_BEGIN(p)
#define BGE_STAMP(k, dep)
#endif

// BGE_THREADS: from the host's prelude (`cuda_rt::prelude`).
#define BGE_WARPS (BGE_THREADS / 32)
// Rows per pass (the expand's M).
#define BGE_ROWS 16
// Most rows of a launch (row indices held per thread: BGE_MAX_ROWS / BGE_THREADS).
// BGE_MAX_ROWS: from the host's prelude (`cuda_rt::prelude`).

// BgeParams, load8_any, split_pair and rank_mask: decode.cuh (the row-register form shares them).


// bge_wait_first, bge_next_after_work: decode.cuh.

#if __CUDA_ARCH__ >= 900
// Asks `bytes` (a multiple of 16) from p (16-byte aligned) into L2; nothing comes to the block.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
#else
__device__ __forceinline__ void prefetch_l2_bulk(const void*, u32) {}
#endif

// The prefetching kernels (`_pf`, bgmv/entry.rs `prefetch_by_default`),
// before a waiting-first block's wait: its slice of its entry's A rows (its
// 1/C of the columns) and B rows (its 1/C of the outputs, rank stride S)
// asked into L2, a bulk prefetch a row of A and one for B, so DRAM streams
// them while the previous kernel ends. The entry is read before that
// kernel completed and may be stale; a prefetch returns nothing to the
// block, so at worst it warms L2 with bytes the block then does not read
// (the H200 took prefetches of null, unmapped and freed addresses without
// a fault: probes/entry_prefetch.cu). A separate kernel, not a flag: the
// flag's branch alone moved a B load of the register kernel past its first
// barrier (0.2-1 us at n = 256, NOTES.md v35).
template <int C, int S>
__device__ __forceinline__ void bge_prefetch_weights(const BgeParams& p) {
    const int tid = threadIdx.x;
    const int e = (int)blockIdx.y;
    const LoraTarget& tg = p.targets[blockIdx.z];
    if (e >= tg.n_entries || tid > S) return;
    int k0, k1, o0, o1;
    split8(p.in_dim, C, (int)(blockIdx.x % C), k0, k1);
    split8(tg.out_dim, C, (int)(blockIdx.x % C), o0, o1);
    const PairEntry en = ((const PairEntry*)tg.table)[e];
    const int rank = (int)min(en.rank, (u32)S);
    if (tid < rank) {
        const bf16_t* a = (const bf16_t*)en.a + (u64)tid * p.in_dim + k0;
        if (aligned16(a) && k1 > k0 && (p.in_dim & 7) == 0) prefetch_l2_bulk(a, (u32)(k1 - k0) * 2u);
    } else if (tid == S && rank > 0) {
        const bf16_t* b = (const bf16_t*)en.b + (u64)o0 * S;
        if (aligned16(b) && o1 > o0) prefetch_l2_bulk(b, (u32)(o1 - o0) * S * 2u);
    }
}

// One round of the row listing (every thread of the block, one row each):
// row j, which names the entry when `m`, goes to s_rows after the
// `listed` rows of earlier rounds and the lower rows of this one (a ballot
// per warp, the warps' counts through s_wcount, one barrier). Returns the
// rows listed so far (the same in every thread). The caller synchronises
// before s_wcount is written again or s_rows is read.
__device__ __forceinline__ int bge_list_round(bool m, int j, int listed, int* s_wcount, int* s_rows) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const unsigned bal = __ballot_sync(0xffffffffu, m);
    if (lane == 0) s_wcount[warp] = __popc(bal);
    __syncthreads();
    int before = listed;
    int total = listed;
#pragma unroll
    for (int w = 0; w < BGE_WARPS; ++w) {
        const int cnt = s_wcount[w];
        before += w < warp ? cnt : 0;
        total += cnt;
    }
    if (m) s_rows[before + __popc(bal & ((1u << lane) - 1u))] = j;
    return total;
}

// The push form's cluster sum of a pass: the block's warps' partials
// (`red`, [warps][PART] f32, complete: the caller synchronised) summed in
// rank order and stored into slot q of every peer's receive buffer
// `passes & 1` (`recv`, [2][C][PART]; st.async, counted on the peer's
// mbarrier); then this block's C slots waited for. No cluster barrier, so
// no GPU-scope release fence. A buffer is written again two passes later,
// only by a peer that received this block's next push, sent after this
// pass's sum read it. Returns the pass's receive buffer; counts the pass.
template <int C, int PART>
__device__ __forceinline__ const float* bge_push_partials(const float* red, float* recv, u64* mbar, int& passes, int q) {
    const int b = passes & 1;
    const u32 parity = (u32)(passes >> 1) & 1u;
    ++passes;
    if (passes == 1) cluster_wait();  // the peers' mbarriers are initialised
    if (threadIdx.x == 0) mbar_arrive_expect(&mbar[b], (u32)(C * PART * 4));
    float* buf = recv + b * C * PART;
    static_assert(PART / 4 <= BGE_THREADS, "a thread a float4 of the partial");
    const int i = threadIdx.x;
    if (i < PART / 4) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < BGE_WARPS; ++w) {
            const float4 r = *(const float4*)(red + w * PART + 4 * i);
            v.x += r.x;
            v.y += r.y;
            v.z += r.z;
            v.w += r.w;
        }
#pragma unroll
        for (int pq = 0; pq < C; ++pq)
            st_async_f4(cluster_addr(buf + q * PART + 4 * i, (u32)pq), v, cluster_addr(&mbar[b], (u32)pq));
    }
    mbar_wait(&mbar[b], parity);
    return buf;
}

// DORA: the DoRA epilogue compiled in (the _dora kernels); a plain
// instantiation has none of it.
template <int C, int KS, bool PF, bool DORA>
__device__ __forceinline__ void bge_body(const BgeParams& p) {
    static_assert(C > 1, "a cluster of blocks per entry");
    constexpr int S = 16 * KS;  // rank stride
    constexpr int RPT = BGE_MAX_ROWS / BGE_THREADS;
    // Loads of several chunks (groups) in flight per warp, as registers allow.
    constexpr int SHRINK_UNROLL = KS <= 2 ? 2 : 1;
    constexpr int EXPAND_UNROLL = KS == 1 ? 2 : 1;
    extern __shared__ __align__(16) unsigned char bge_smem[];
    // Dynamic shared memory: red [warps][S][16] f32, part [S][16] f32 (the
    // pull form) or recv [2][C][S][16] f32 (the push form), t [16][S + 4]
    // f32, rows [n_rows] int, then (staged) the block's B rows
    // [stage_cols][S] bf16 (as in global memory) and its y values
    // [16][stage_cols + 32] bf16 (64 bytes of padding per row: the 16-byte
    // reads of a quarter warp fall in distinct banks).
    // Push form for strides up to 32 (its receive buffers: 16 KB at 16 in clusters of 8).
    constexpr bool PUSH = KS <= 2;
    constexpr int PART = S * BGE_ROWS;  // floats of one block's partial
    float* s_red = (float*)bge_smem;
    float* s_part = s_red + BGE_WARPS * PART;  // pull: part; push: recv
    float* s_t = s_part + (PUSH ? 2 * C : 1) * PART;
    constexpr int TP = S + 4;  // t row pitch
    int* s_rows = (int*)(s_t + BGE_ROWS * TP);
    // The staging area: the byte offset past the row list, rounded to 16
    // (an offset, not the row list's address rounded: 32-bit arithmetic,
    // which keeps rank 16 at its 16 bytes of spills instead of 76).
    bf16_t* s_b =
        (bf16_t*)(bge_smem + ((4 * ((BGE_WARPS + (PUSH ? 2 * C : 1)) * PART + BGE_ROWS * TP + p.n_rows) + 15) & ~15));
    const int yp = p.stage_cols + 32;  // staged y row pitch
    bf16_t* s_y = s_b + p.stage_cols * S;
    __shared__ int s_wcount[BGE_WARPS];
    __shared__ __align__(8) u64 s_mbar[2];  // push form: one per receive buffer

    BGE_TRACE_BEGIN(p);
    BGE_STAMP(0, 0u);
    if (PF) bge_prefetch_weights<C, S>(p);
    bge_wait_first(p);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int c = lane & 3;
    const int q = (int)(blockIdx.x % C);  // rank in the cluster (clusters span x)
    const int e = (int)blockIdx.y;
    const LoraTarget tg = p.targets[blockIdx.z];
    const int* idx = (const int*)p.idx;
    // Block (0, 0) of each target reports indices past the table (they count as no delta).
    const bool report_index = e == 0 && q == 0;

    // 1. The rows naming e, in row order.
    int raw[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int j = i * BGE_THREADS + tid;
        raw[i] = j < p.n_rows ? idx[j] : -1;
    }
    if (report_index) {
#pragma unroll
        for (int i = 0; i < RPT; ++i) checked_index(raw[i], tg.n_entries, p.fault, true);
    }
    // Uniform over the cluster: the same entry and target.
    if (e >= tg.n_entries) return;
    const PairEntry en = ((const PairEntry*)tg.table)[e];
    BGE_STAMP(1, (u32)raw[0]);
    BGE_STAMP(2, en.rank);
    int n_found = 0;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        if (i * BGE_THREADS >= p.n_rows) break;
        const int j = i * BGE_THREADS + tid;
        n_found = bge_list_round(raw[i] == e, j, n_found, s_wcount, s_rows);
        __syncthreads();  // s_wcount is rewritten next round; s_rows complete after the last
    }
    BGE_STAMP(3, (u32)n_found);
    if (n_found == 0) return;  // uniform over the cluster: every block counted the same rows
    if (bad_entry(en, S)) {
        if (q == 0 && tid == 0) raise_fault(p.fault, FAULT_BAD_RANK);
        return;
    }
    const int rank = (int)en.rank;
    if (rank == 0) return;
    if (PUSH) {
        if (tid == 0) {
            mbar_init(&s_mbar[0], 1);
            mbar_init(&s_mbar[1], 1);
            fence_mbar_init();
        }
        // Waited for before the first push: every peer is running and its mbarriers are initialised.
        cluster_arrive_relaxed();
    }

    const bf16_t* A = (const bf16_t*)en.a;
    const bf16_t* B = (const bf16_t*)en.b;
    const int in = p.in_dim;
    const bool a_vec = aligned16(A) && (in & 7) == 0;
    const bool b_vec = (en.b & (u64)(S / 2 - 1)) == 0;  // a lane's S/4 ranks of a B row: S/2 bytes
    int k0, k1, o0, o1;
    split8(in, C, q, k0, k1);
    split8(tg.out_dim, C, q, o0, o1);
    const int n_chunks = (k1 - k0 + 31) / 32;
    const int n_groups = (o1 - o0 + 31) / 32;
    // The rank masks of this lane's B words: ranks c * S/4 + 2w, + 1.
    u32 bmask[KS * 2];
#pragma unroll
    for (int w = 0; w < KS * 2; ++w) bmask[w] = rank_mask(c * (S / 4) + 2 * w, rank);

    // The expand's B rows and y values are copied into shared memory
    // (cp.async) while the shrink runs, so its loads are all in flight at
    // once instead of one output group after another. Uniform per block.
    const bool staged = p.stage_cols >= o1 - o0 && aligned16(B);

    if (p.overlap == CHAIN_EARLY_READS) grid_dependency_wait();
    const bf16_t* x = (const bf16_t*)p.x;
    bf16_t* y = (bf16_t*)p.y + tg.y_col_off;

    bool pending = false;  // pull: an arrive on the cluster barrier not yet waited for
    int passes = 0;
#pragma unroll 1
    for (int r0 = 0; r0 < n_found; r0 += BGE_ROWS) {
        const int rows_here = min(BGE_ROWS, n_found - r0);
        const int row_a = g < rows_here ? s_rows[r0 + g] : -1;
        const int row_b = g + 8 < rows_here ? s_rows[r0 + g + 8] : -1;
        const bool two_tiles = rows_here > 8;
        // 2. Shrink: acc[mt][nt] is ranks 16 mt + (g, g + 8) x rows 8 nt + (2c, 2c + 1).
        float acc[KS][2][4];
#pragma unroll
        for (int mt = 0; mt < KS; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        // Chunk ch's fragments: 8 columns of x rows g, g + 8 and of A rows 16 mt + (g, g + 8).
        struct Frag {
            uint4 xa, xb, a0[KS], a1[KS];
        };
        auto load_chunk = [&](int ch) {
            Frag f;
            const int col = k0 + ch * 32 + c * 8;
            const bool ok = ch < n_chunks && col + 8 <= k1;
            f.xa = ok && row_a >= 0 ? ldg16(x + (u64)row_a * p.x_stride + col) : zero;
            f.xb = ok && row_b >= 0 ? ldg16(x + (u64)row_b * p.x_stride + col) : zero;
#pragma unroll
            for (int mt = 0; mt < KS; ++mt) {
                const int ra = 16 * mt + g;
                f.a0[mt] = ok && ra < rank ? load8_any(A + (u64)ra * in + col, a_vec) : zero;
                f.a1[mt] = ok && ra + 8 < rank ? load8_any(A + (u64)(ra + 8) * in + col, a_vec) : zero;
            }
            return f;
        };
        auto mma_chunk = [&](const Frag& f) {
#pragma unroll
            for (int mt = 0; mt < KS; ++mt) {
                const uint4 a0 = f.a0[mt], a1 = f.a1[mt];
                mma_k16(acc[mt][0], a0.x, a1.x, a0.y, a1.y, f.xa.x, f.xa.y);
                mma_k16(acc[mt][0], a0.z, a1.z, a0.w, a1.w, f.xa.z, f.xa.w);
                if (two_tiles) {
                    mma_k16(acc[mt][1], a0.x, a1.x, a0.y, a1.y, f.xb.x, f.xb.y);
                    mma_k16(acc[mt][1], a0.z, a1.z, a0.w, a1.w, f.xb.z, f.xb.w);
                }
            }
        };
        // The shrink's first loads go out before the expand's staging: they
        // are on the critical path, the staged bytes are needed only after the sum.
        Frag first[SHRINK_UNROLL];
#pragma unroll
        for (int u = 0; u < SHRINK_UNROLL; ++u) first[u] = load_chunk(warp + u * BGE_WARPS);
        if (staged) {
            if (r0 == 0) {
#pragma unroll 1
                for (int i = tid; i < (o1 - o0) * S / 8; i += BGE_THREADS)
                    cp_async16(s_b + 8 * i, B + (u64)o0 * S + 8 * i);
            }
            // A warp per row (two rows per warp past 8): every warp copies at once.
            const int pieces = (o1 - o0) / 8;
#pragma unroll 1
            for (int r = warp; r < rows_here; r += BGE_WARPS) {
                const bf16_t* src = y + (u64)s_rows[r0 + r] * p.y_stride + o0;
#pragma unroll 1
                for (int i = lane; i < pieces; i += 32) cp_async16(s_y + r * yp + 8 * i, src + 8 * i);
            }
        }
        cp_async_commit();
        BGE_STAMP(4, 0u);
#pragma unroll
        for (int u = 0; u < SHRINK_UNROLL; ++u) mma_chunk(first[u]);
        BGE_STAMP(5, __float_as_uint(acc[0][0][0]));
#pragma unroll SHRINK_UNROLL
        for (int ch = warp + SHRINK_UNROLL * BGE_WARPS; ch < n_chunks; ch += BGE_WARPS) mma_chunk(load_chunk(ch));
        BGE_STAMP(6, __float_as_uint(acc[0][0][0]));

        // 3. Sum over the warps, then over the cluster, in fixed orders.
        // Push: bge_push_partials. Pull: a cluster barrier, the peers' partials
        // read in place, a relaxed arrive once read (waited for before the
        // next pass's partial is written, or before exit).
        if (pending) cluster_wait();
        pending = false;
#pragma unroll
        for (int mt = 0; mt < KS; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                float* r = s_red + ((warp * S + 16 * mt + g) * BGE_ROWS + 8 * nt + 2 * c);
                *(float2*)r = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
                *(float2*)(r + 8 * BGE_ROWS) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
            }
        __syncthreads();
        BGE_STAMP(7, 0u);
        if (PUSH) {
            const float* recv = bge_push_partials<C, PART>(s_red, s_part, s_mbar, passes, q);
            BGE_STAMP(8, 0u);
            for (int i = tid; i < PART; i += BGE_THREADS) {
                float v = 0.f;
#pragma unroll
                for (int pq = 0; pq < C; ++pq) v += recv[pq * PART + i];
                s_t[(i % BGE_ROWS) * TP + i / BGE_ROWS] = v * en.scale;
            }
        } else {
#pragma unroll
            for (int i = tid; i < PART; i += BGE_THREADS) {
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < BGE_WARPS; ++w) v += s_red[w * PART + i];
                s_part[i] = v;
            }
            cluster_arrive();
            cluster_wait();
#pragma unroll
            for (int i = tid; i < PART; i += BGE_THREADS) {
                float v = 0.f;
#pragma unroll
                for (int pq = 0; pq < C; ++pq) v += ld_dsmem(s_part + i, (u32)pq);
                s_t[(i % BGE_ROWS) * TP + i / BGE_ROWS] = v * en.scale;
            }
            // The values are in registers (summed above): nothing to release.
            cluster_arrive_relaxed();
            pending = true;
        }
        cp_async_wait<0>();
        __syncthreads();
        BGE_STAMP(9, 0u);

        // 4. Expand.
        if (KS == 4 && staged) {
            // Rank stride 64, staged: outputs as the mma's M. m16n8k16 with M
            // = 16 outputs (the staged B rows, read with ldmatrix), N = 8 rows,
            // K = 16 ranks (t as the B operand, split into bf16 hi + lo). y's
            // staged values are the C operand, read transposed (ldmatrix.trans)
            // and written back the same way (stmatrix.trans); the warp then
            // stores its group's rows, 16 bytes a lane. Its point: the form
            // below is then built for unstaged calls only at this stride, which
            // keeps it within its registers (NOTES.md v32). At strides 16 and
            // 32 the form below, staged, measured faster than this expand.
            const int n_tiles = rows_here > 8 ? 2 : 1;
            // t fragments: rows 8 nt + g; ranks 16 ks + 2c, + 1 (b0) and 16 ks + 2c + 8, + 9 (b1).
            u32 tbh[2][KS][2], tbl[2][KS][2];
            u32 km0[KS], km1[KS];
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                km0[ks] = rank_mask(16 * ks + 2 * c, rank);
                km1[ks] = rank_mask(16 * ks + 2 * c + 8, rank);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const float* tr = s_t + (8 * nt + g) * TP + 16 * ks + 2 * c;
                    split_pair(tr[0], tr[1], tbh[nt][ks][0], tbl[nt][ks][0]);
                    split_pair(tr[8], tr[9], tbh[nt][ks][1], tbl[nt][ks][1]);
                }
            }
            BGE_STAMP(12, tbh[0][0][0]);
            // This lane's ldmatrix rows: B row (lane & 15) of a 16-output half, ranks 8 (lane >> 4) on
            // (rows past the staged ones, in a last group that ends early, read the last one: their
            // outputs are not stored); y row (lane & 7) of a row tile, outputs 8 (lane >> 3) on of the group.
            const int n_staged = o1 - o0;
            const bf16_t* b_lane = s_b + 8 * (lane >> 4);
            bf16_t* y_lane = s_y + (lane & 7) * yp + 8 * (lane >> 3);
#pragma unroll EXPAND_UNROLL
            for (int gi = warp; gi < n_groups; gi += BGE_WARPS) {
                const int lb = gi * 32;
                u32 af[2][KS][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int br = min(lb + 16 * h + (lane & 15), n_staged - 1);
#pragma unroll
                    for (int ks = 0; ks < KS; ++ks) {
                        ldsm_x4(af[h][ks], b_lane + br * S + 16 * ks);
                        af[h][ks][0] &= km0[ks];
                        af[h][ks][1] &= km0[ks];
                        af[h][ks][2] &= km1[ks];
                        af[h][ks][3] &= km1[ks];
                    }
                }
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    if (nt >= n_tiles) break;
                    bf16_t* yt = y_lane + 8 * nt * yp + lb;
                    u32 yv[4];
                    ldsm_x4_trans(yv, yt);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        // d: outputs g, g + 8 of the half x rows 2c, 2c + 1 of the tile.
                        float d[4] = {bf_lo(yv[2 * h]), bf_hi(yv[2 * h]), bf_lo(yv[2 * h + 1]), bf_hi(yv[2 * h + 1])};
#pragma unroll
                        for (int ks = 0; ks < KS; ++ks) {
                            const u32* a = af[h][ks];
                            mma_k16(d, a[0], a[1], a[2], a[3], tbh[nt][ks][0], tbh[nt][ks][1]);
                            mma_k16(d, a[0], a[1], a[2], a[3], tbl[nt][ks][0], tbl[nt][ks][1]);
                        }
                        // The DoRA epilogue: d[0..1] are output lb + 16h + g (of the block's
                        // slice), d[2..3] output + 8; outputs past the slice are not stored.
                        if constexpr (DORA) {
                            const float* dg = dora_scale_of(tg, e);
                            if (dg != nullptr) {
                                const int oa = lb + 16 * h + g;
                                if (oa < n_staged) {
                                    d[0] = dora_epilogue(d[0], dg, tg, o0 + oa);
                                    d[1] = dora_epilogue(d[1], dg, tg, o0 + oa);
                                }
                                if (oa + 8 < n_staged) {
                                    d[2] = dora_epilogue(d[2], dg, tg, o0 + oa + 8);
                                    d[3] = dora_epilogue(d[3], dg, tg, o0 + oa + 8);
                                }
                            }
                        }
                        yv[2 * h] = pack_bf2_rn(d[0], d[1]);
                        yv[2 * h + 1] = pack_bf2_rn(d[2], d[3]);
                    }
                    stsm_x4_trans(yt, yv);
                }
                __syncwarp();
                // Lane: row 8 nt + (lane >> 2), outputs lb + 8 (lane & 3) .. + 7.
                const int ol = lb + 8 * (lane & 3);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const int r = 8 * nt + (lane >> 2);
                    if (r < rows_here && ol < n_staged)
                        *(uint4*)(y + (u64)s_rows[r0 + r] * p.y_stride + o0 + ol) = *(const uint4*)(s_y + r * yp + ol);
                }
            }
            BGE_STAMP(10, 0u);
            __syncthreads();  // s_t and s_red are rewritten by the next pass
            continue;
        }
        // Staged here at rank strides 16 and 32 only (above at 64).
        const bool stg = KS != 4 && staged;
        // Outputs as the mma's N. t fragments: rows g, g + 8; ranks c * S/4 + 4 ks + (0, 1) and (2, 3).
        u32 th[KS][4], tl[KS][4];
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int rb = c * (S / 4) + 4 * ks;
            const float* ta = s_t + g * TP + rb;
            const float* tb = s_t + (g + 8) * TP + rb;
            split_pair(ta[0], ta[1], th[ks][0], tl[ks][0]);
            split_pair(tb[0], tb[1], th[ks][1], tl[ks][1]);
            split_pair(ta[2], ta[3], th[ks][2], tl[ks][2]);
            split_pair(tb[2], tb[3], th[ks][3], tl[ks][3]);
        }
        BGE_STAMP(12, th[0][0]);
#pragma unroll EXPAND_UNROLL
        for (int gi = warp; gi < n_groups; gi += BGE_WARPS) {
            const int base = o0 + gi * 32;
            // Tile j, column g: output base + 8 (g / 2) + 2 j + g % 2 (whole when its 8-piece is).
            const bool b_ok = base + 8 * (g >> 1) + 8 <= o1;
            u32 bw[4][KS * 2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int bo = base + 8 * (g >> 1) + 2 * j + (g & 1);
                const bf16_t* brow = B + (u64)bo * S + c * (S / 4);
#pragma unroll
                for (int w = 0; w < KS * 2; ++w) bw[j][w] = 0u;
                if (b_ok) {
                    if (stg) {
                        const u32* sw = (const u32*)(s_b + (bo - o0) * S + c * (S / 4));
#pragma unroll
                        for (int w = 0; w < KS * 2; ++w) bw[j][w] = sw[w];
                    } else if (b_vec) {
                        if (KS == 1) {
                            const uint2 v = __ldg((const uint2*)brow);
                            bw[j][0] = v.x;
                            bw[j][1] = v.y;
                        } else {
#pragma unroll
                            for (int h = 0; h < KS / 2; ++h) {
                                const uint4 v = ldg16(brow + 8 * h);
                                bw[j][4 * h + 0] = v.x;
                                bw[j][4 * h + 1] = v.y;
                                bw[j][4 * h + 2] = v.z;
                                bw[j][4 * h + 3] = v.w;
                            }
                        }
                    } else {
#pragma unroll
                        for (int w = 0; w < KS * 2; ++w)
                            bw[j][w] = (u32)__ldg(brow + 2 * w) | ((u32)__ldg(brow + 2 * w + 1) << 16);
                    }
                }
#pragma unroll
                for (int w = 0; w < KS * 2; ++w) bw[j][w] &= bmask[w];
            }
            // Lane (g, c): outputs base + 8c .. + 7 of rows g and g + 8.
            const bool y_ok = base + 8 * c + 8 <= o1;
            bf16_t* ya = row_a >= 0 && y_ok ? y + (u64)row_a * p.y_stride + base + 8 * c : nullptr;
            bf16_t* yb = row_b >= 0 && y_ok ? y + (u64)row_b * p.y_stride + base + 8 * c : nullptr;
            const uint4 va = !ya ? zero : stg ? *(const uint4*)(s_y + g * yp + (base - o0) + 8 * c) : *(const uint4*)ya;
            const uint4 vb = !yb ? zero : stg ? *(const uint4*)(s_y + (g + 8) * yp + (base - o0) + 8 * c) : *(const uint4*)yb;
            const u32 wa[4] = {va.x, va.y, va.z, va.w};
            const u32 wb[4] = {vb.x, vb.y, vb.z, vb.w};
            float d[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                d[j][0] = bf_lo(wa[j]);
                d[j][1] = bf_hi(wa[j]);
                d[j][2] = bf_lo(wb[j]);
                d[j][3] = bf_hi(wb[j]);
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    mma_k16(d[j], th[ks][0], th[ks][1], th[ks][2], th[ks][3], bw[j][2 * ks], bw[j][2 * ks + 1]);
                    mma_k16(d[j], tl[ks][0], tl[ks][1], tl[ks][2], tl[ks][3], bw[j][2 * ks], bw[j][2 * ks + 1]);
                }
            }
            if (ya) {
                if constexpr (DORA) bge_dora8(d, 0, p.targets[blockIdx.z], (int)blockIdx.y, base + 8 * c);
                *(uint4*)ya = make_uint4(pack_bf2_rn(d[0][0], d[0][1]), pack_bf2_rn(d[1][0], d[1][1]),
                                         pack_bf2_rn(d[2][0], d[2][1]), pack_bf2_rn(d[3][0], d[3][1]));
            }
            if (yb) {
                if constexpr (DORA) bge_dora8(d, 2, p.targets[blockIdx.z], (int)blockIdx.y, base + 8 * c);
                *(uint4*)yb = make_uint4(pack_bf2_rn(d[0][2], d[0][3]), pack_bf2_rn(d[1][2], d[1][3]),
                                         pack_bf2_rn(d[2][2], d[2][3]), pack_bf2_rn(d[3][2], d[3][3]));
            }
        }
        BGE_STAMP(10, 0u);
        __syncthreads();  // s_t and s_red are rewritten by the next pass
    }
    bge_next_after_work(p);
    if (pending) cluster_wait();  // keep our partials alive until every peer read them
    BGE_STAMP(11, 0u);
}

// The register form (bgmv/entry.rs `EntryKernel::Registers`): rank stride 16, clusters
// of 8, a block's K slice and output slice at most BGE_REG_CHUNKS and
// BGE_REG_GROUPS pieces of 32 per warp (512 columns and 512 outputs: `in`
// and every target up to 4096). The block's A slice and B rows are loaded
// into registers once, for every pass; each pass loads its rows' x and y
// into registers too, so every byte a pass needs is requested before its
// first mma, and the expand reads nothing from shared memory but t.
//
// ptxas schedules an mma (and the moves that gather its operands, which
// wait for the loads) above later loads, even above a barrier, so the
// block's loads would go out in two round trips: every pass's mma sit in a
// branch on a value read after a barrier that follows the loads.
#define BGE_REG_CHUNKS 2
#define BGE_REG_GROUPS 2
// BGE_REG_MAX_ROWS: from the host's prelude (`cuda_rt::prelude`).

// One 16-byte store (the compiler splits `*(uint4*)p = v` of packed halves into four).
__device__ __forceinline__ void st_global16(void* p, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Not inlined: its registers stay out of the register form's allocation.
template <int C, bool DORA>
__device__ __noinline__ void bge_reg_fallback(const BgeParams p) {
    bge_body<C, 1, false, DORA>(p);
}

// The block's weights are requested as soon as its entry is known, before
// the row indices arrive, so also by clusters whose entry no row names (the
// host takes this kernel by default only for batches of several rows per
// entry). Requested after a barrier had found a row naming the entry, the
// kernel lost to the staged one at every shape the bench has (NOTES.md v33).
template <int C, bool PF, bool DORA>
__device__ __forceinline__ void bge_reg_body(const BgeParams& p) {
    constexpr int NCH = BGE_REG_CHUNKS, NG = BGE_REG_GROUPS;
    // One row index a thread: at most BGE_REG_MAX_ROWS rows (more would
    // spill, and a spilled load result waits for its load).
    constexpr int RPT = BGE_REG_MAX_ROWS / BGE_THREADS;
    static_assert(RPT == 1, "one row index a thread");
    // Rows per pass: 8 (the shrink's N, half the expand's M), so a pass's
    // x and y take 16 registers a thread, not 32.
    constexpr int PR = 8;
    constexpr int PART = 16 * PR;  // ranks x rows of a partial (f32)
    constexpr int TP = 16 + 4;     // t row pitch
    extern __shared__ __align__(16) unsigned char bge_smem[];
    // Dynamic shared memory, within bge_body's push-form plan at stride 16:
    // red [warps][16][8], recv [2][C][16][8], t [8][20] f32, rows [n_rows].
    float* s_red = (float*)bge_smem;
    float* s_recv = s_red + BGE_WARPS * PART;
    float* s_t = s_recv + 2 * C * PART;
    int* s_rows = (int*)(s_t + PR * TP);
    __shared__ int s_wcount[BGE_WARPS];
    __shared__ int s_live;  // 1, read after each pass's loads (the scheduling fence above)
    __shared__ __align__(8) u64 s_mbar[2];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int c = lane & 3;
    const int q = (int)(blockIdx.x % C);
    const int e = (int)blockIdx.y;
    const LoraTarget tg = p.targets[blockIdx.z];
    if (PF) bge_prefetch_weights<C, 16>(p);
    bge_wait_first(p);

    // 1. The row index of this thread's row, and the entry.
    const int raw = tid < p.n_rows ? ((const int*)p.idx)[tid] : -1;
    if (e == 0 && q == 0) checked_index(raw, tg.n_entries, p.fault, true);
    if (e >= tg.n_entries) return;
    const PairEntry en = ((const PairEntry*)tg.table)[e];
    // Weights not 16- and 8-byte aligned: the staged body's element loads
    // (uniform over the cluster; it reads the indices again, unstaged). In
    // the _dora kernels an entry with a DoRA rescale at the target likewise:
    // the staged body applies the epilogue, which inlined here spilled this
    // kernel's registers.
    bool fallback = !aligned16((const void*)en.a) || (en.b & 7ull) != 0;
    if constexpr (DORA) fallback = fallback || dora_scale_of(tg, e) != nullptr;
    if (fallback) {
        bge_reg_fallback<C, DORA>(p);
        return;
    }
    if (tid == 0) s_live = 1;
    const bool valid = !bad_entry(en, 16) && en.rank > 0;
    const int rank = valid ? (int)en.rank : 0;
    const bf16_t* A = (const bf16_t*)en.a;
    const bf16_t* B = (const bf16_t*)en.b;
    const int in = p.in_dim;
    int k0, k1, o0, o1;
    split8(in, C, q, k0, k1);
    split8(tg.out_dim, C, q, o0, o1);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    // 2. The block's A slice (chunk u: 8 columns of ranks g, g + 8) and B
    // rows (group u, tile j: ranks 4c .. 4c + 3 of output base + 8 (g / 2)
    // + 2 j + g % 2), for every pass; nothing of a bad entry.
    uint4 a0[NCH], a1[NCH];
#pragma unroll
    for (int u = 0; u < NCH; ++u) {
        const int col = k0 + (warp + u * BGE_WARPS) * 32 + c * 8;
        const bool ok = col < k1;  // k1 - k0 is a multiple of 8
        a0[u] = ok && g < rank ? ldg16(A + (u64)g * in + col) : zero;
        a1[u] = ok && g + 8 < rank ? ldg16(A + (u64)(g + 8) * in + col) : zero;
    }
    uint2 bw[NG][4];
#pragma unroll
    for (int u = 0; u < NG; ++u) {
        const int base = o0 + (warp + u * BGE_WARPS) * 32;
        const bool b_ok = rank > 0 && base + 8 * (g >> 1) + 8 <= o1;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int bo = base + 8 * (g >> 1) + 2 * j + (g & 1);
            bw[u][j] = b_ok ? __ldg((const uint2*)(B + (u64)bo * 16 + 4 * c)) : make_uint2(0u, 0u);
        }
    }

    // 3. The rows naming e, in row order.
    const int n_found = bge_list_round(raw == e, tid, 0, s_wcount, s_rows);
    if (tid == 0) {
        mbar_init(&s_mbar[0], 1);
        mbar_init(&s_mbar[1], 1);
        fence_mbar_init();
    }
    __syncthreads();
    if (n_found == 0) return;  // uniform over the cluster
    if (!valid) {
        if (q == 0 && tid == 0 && en.rank > 0) raise_fault(p.fault, FAULT_BAD_RANK);
        return;
    }
    cluster_arrive_relaxed();  // waited for before the first push

    if (p.overlap == CHAIN_EARLY_READS) grid_dependency_wait();
    const bf16_t* x = (const bf16_t*)p.x;
    bf16_t* y = (bf16_t*)p.y + tg.y_col_off;
    int passes = 0;
#pragma unroll 1
    for (int r0 = 0; r0 < n_found; r0 += PR) {
        const int row = g < n_found - r0 ? s_rows[r0 + g] : -1;
        // The pass's x (chunk u: 8 columns of row g) and y (group u: outputs
        // base + 8c .. + 7 of row g).
        uint4 xr[NCH], yr[NG];
#pragma unroll
        for (int u = 0; u < NCH; ++u) {
            const int col = k0 + (warp + u * BGE_WARPS) * 32 + c * 8;
            xr[u] = col < k1 && row >= 0 ? ldg16(x + (u64)row * p.x_stride + col) : zero;
        }
#pragma unroll
        for (int u = 0; u < NG; ++u) {
            const int base = o0 + (warp + u * BGE_WARPS) * 32;
            const bool y_ok = base + 8 * c + 8 <= o1 && row >= 0;
            yr[u] = y_ok ? *(const uint4*)(y + (u64)row * p.y_stride + base + 8 * c) : zero;
        }
        __syncthreads();  // the scheduling fence (above); also: s_t and s_red free again
        const int live = *(volatile int*)&s_live;

        // 4. Shrink: acc is ranks (g, g + 8) x rows (2c, 2c + 1).
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (live) {
#pragma unroll
            for (int u = 0; u < NCH; ++u) {
                mma_k16(acc, a0[u].x, a1[u].x, a0[u].y, a1[u].y, xr[u].x, xr[u].y);
                mma_k16(acc, a0[u].z, a1[u].z, a0[u].w, a1[u].w, xr[u].z, xr[u].w);
            }
        }
        {
            float* r = s_red + (warp * 16 + g) * PR + 2 * c;
            *(float2*)r = make_float2(acc[0], acc[1]);
            *(float2*)(r + 8 * PR) = make_float2(acc[2], acc[3]);
        }
        __syncthreads();
        const float* recv = bge_push_partials<C, PART>(s_red, s_recv, s_mbar, passes, q);
        if (tid < PART) {
            float v = 0.f;
#pragma unroll
            for (int pq = 0; pq < C; ++pq) v += recv[pq * PART + tid];
            s_t[(tid % PR) * TP + tid / PR] = v * en.scale;
        }
        __syncthreads();

        // 5. Expand: M = rows (g; rows g + 8 of the mma empty), N = outputs,
        // K = ranks 4c .. 4c + 3 (t as hi + lo).
        const u32 bm0 = rank_mask(4 * c, rank), bm1 = rank_mask(4 * c + 2, rank);
        u32 th[2], tl[2];
        {
            const float* ta = s_t + g * TP + 4 * c;
            split_pair(ta[0], ta[1], th[0], tl[0]);
            split_pair(ta[2], ta[3], th[1], tl[1]);
        }
#pragma unroll
        for (int u = 0; u < NG; ++u) {
            const int base = o0 + (warp + u * BGE_WARPS) * 32;
            const bool y_ok = base + 8 * c + 8 <= o1 && row >= 0;
            const u32 wa[4] = {yr[u].x, yr[u].y, yr[u].z, yr[u].w};
            float d[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                d[j][0] = bf_lo(wa[j]);
                d[j][1] = bf_hi(wa[j]);
                d[j][2] = 0.f;
                d[j][3] = 0.f;
                // Masked here, not at the load: nothing may wait for a load before the fence.
                const u32 b0 = bw[u][j].x & bm0, b1 = bw[u][j].y & bm1;
                mma_k16(d[j], th[0], 0u, th[1], 0u, b0, b1);
                mma_k16(d[j], tl[0], 0u, tl[1], 0u, b0, b1);
            }
            // No DoRA epilogue here: an entry with a rescale runs the staged body (above).
            if (y_ok)
                st_global16(y + (u64)row * p.y_stride + base + 8 * c,
                            make_uint4(pack_bf2_rn(d[0][0], d[0][1]), pack_bf2_rn(d[1][0], d[1][1]),
                                       pack_bf2_rn(d[2][0], d[2][1]), pack_bf2_rn(d[3][0], d[3][1])));
        }
    }
    bge_next_after_work(p);
}

#if __CUDA_ARCH__ >= 900
// Rank 16 in at most 80 registers: three blocks per multiprocessor, so 8-block
// clusters of 32 entries are all resident at once (`blocks_per_sm` in bgmv/entry.rs).
// Each macro defines NAME in the plain module and NAME_dora, the same body
// with the DoRA epilogue compiled in, in the DoRA module (decode.cuh).
#define BGE_KERNEL(NAME, C, KS, BLOCKS, PF)                                               \
    extern "C" __global__ void __cluster_dims__(C, 1, 1)                                  \
        __launch_bounds__(BGE_THREADS, BLOCKS) DECODE_NAME(NAME)(const BgeParams p) {     \
        bge_body<C, KS, PF, kDecodeDora>(p);                                              \
    }
BGE_KERNEL(bgmv_entry_c8_r16, 8, 1, 3, false)
BGE_KERNEL(bgmv_entry_c8_r32, 8, 2, 2, false)
BGE_KERNEL(bgmv_entry_c8_r64, 8, 4, 2, false)
BGE_KERNEL(bgmv_entry_c4_r16, 4, 1, 3, false)
BGE_KERNEL(bgmv_entry_c4_r32, 4, 2, 2, false)
BGE_KERNEL(bgmv_entry_c4_r64, 4, 4, 2, false)
// Rank 16, asking the weights into L2 before the wait.
BGE_KERNEL(bgmv_entry_c8_r16_pf, 8, 1, 3, true)
BGE_KERNEL(bgmv_entry_c4_r16_pf, 4, 1, 3, true)
// The register form: rank 16 in at most 80 registers, as bgmv_entry_c8_r16
// (plain, or with the DoRA epilogue's redirect compiled in: _dora).
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(BGE_THREADS, 3) DECODE_NAME(bgmv_entry_c8_r16_reg)(const BgeParams p) {
    bge_reg_body<8, false, kDecodeDora>(p);
}
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(BGE_THREADS, 3) DECODE_NAME(bgmv_entry_c8_r16_reg_pf)(const BgeParams p) {
    bge_reg_body<8, true, kDecodeDora>(p);
}
#endif

// The spread form (bgmv/entry.rs `EntryKernel::Spread`): rank stride 16,
// Q = gridDim.x blocks per (entry, target) group and no cluster, about one
// block a multiprocessor (its registers), every block of the launch resident
// at once (the host launches at most a block a multiprocessor, and
// cooperatively where it does not wait first), so 32 entries take 128
// multiprocessors evenly instead of clusters of 8 leaving 16 of them three
// blocks (NOTES.md v34, v35). A block's K slice and output slice are at
// most BGS_CHUNKS and BGS_GROUPS pieces of 32 per warp (1024 each: `in`
// and every target up to 1024 Q). Weights, x and y are requested into
// registers as in the register form; the group's partials are exchanged
// through global memory: each block writes its partial, word by word
// tagged with the pass, into every peer's inbox, and waits for its peers'
// words in its own. Tags are the pass count within the launch (1, 2, ...),
// so each block zeroes the inbox words it was sent before it exits, and
// every inbox is zero between launches (the host allocates it zeroed).
// Waiting first (CHAIN_WAIT_FIRST, CHAIN_WAIT_FIRST_EARLY_NEXT in p.overlap),
// a block asks its weights into L2 before the wait where BGS_PREFETCH is
// or'd in: the same rule as `bge_prefetch_weights`.
#define BGS_CHUNKS 4
#define BGS_GROUPS 4
#define BGS_MAX_SPREAD 8
#define BGS_PART 128  // 16 ranks x 8 rows, f32
// A block's inbox: [2 passes][BGS_MAX_SPREAD senders][BGS_PART] u64 words (tag << 32 | value).
#define BGS_INBOX_WORDS (2 * BGS_MAX_SPREAD * BGS_PART)
// Or'd into a waiting-first code (p.overlap): the weights asked into L2 before the wait.
#define BGS_PREFETCH 4

struct BgsParams {
    BgeParams base;
    u64 inbox;  // [blocks of the launch][BGS_INBOX_WORDS] u64, zero
};
static_assert(sizeof(BgsParams) == 224, "mirrors bgmv/entry.rs SpreadParams");

__device__ __forceinline__ void st_relaxed_u64(u64* p, u64 v) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_relaxed_u64(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __noinline__ void bgs_unaligned(const BgsParams sp);

// ALIGNED: 16-byte A and 8-byte B loads (the entry's weights are checked
// first and sent to the element-load body otherwise). DORA: the DoRA
// epilogue compiled in (the _dora kernel).
template <bool ALIGNED, bool DORA>
__device__ __forceinline__ void bgs_body(const BgsParams& sp) {
    const BgeParams& p = sp.base;
    constexpr int NCH = BGS_CHUNKS, NG = BGS_GROUPS;
    constexpr int PR = 8;  // rows per pass
    constexpr int PART = BGS_PART;
    constexpr int TP = 16 + 4;
    extern __shared__ __align__(16) unsigned char bge_smem[];
    // Dynamic shared memory: red [warps][16][8] f32, t [8][20] f32, rows [n_rows].
    float* s_red = (float*)bge_smem;
    float* s_t = s_red + BGE_WARPS * PART;
    int* s_rows = (int*)(s_t + PR * TP);
    __shared__ int s_wcount[BGE_WARPS];
    __shared__ int s_live;  // the rank, read after each pass's loads (the scheduling fence)

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int c = lane & 3;
    const int Q = (int)gridDim.x;
    const int q = (int)blockIdx.x;
    const int e = (int)blockIdx.y;
    const u64 first_block = ((u64)blockIdx.z * gridDim.y + blockIdx.y) * (u64)Q;
    const LoraTarget tg = p.targets[blockIdx.z];
    // This block's inbox into L2 (its peers in this launch write it; the
    // launch before zeroed it): its first poll then hits L2 instead of
    // waiting a DRAM round trip after an L2 flush.
    if (tid == 32) prefetch_l2_bulk((const u64*)sp.inbox + (first_block + q) * BGS_INBOX_WORDS, BGS_INBOX_WORDS * 8u);
    // Waiting first: the weights asked into L2 before the wait (BGS_PREFETCH),
    // the next launch let in at once or once the work is out.
    const int chain = p.overlap & 3;
    if (chain >= CHAIN_WAIT_FIRST) {
        // `bge_prefetch_weights` with the piece q of Q, written out: through
        // the shared helper ptxas reordered this kernel's and the _pf kernels'
        // prologues, a build the device has not measured.
        if ((p.overlap & BGS_PREFETCH) && e < tg.n_entries && tid <= 16) {
            int pk0, pk1, po0, po1;
            split8(p.in_dim, Q, q, pk0, pk1);
            split8(tg.out_dim, Q, q, po0, po1);
            const PairEntry pe = ((const PairEntry*)tg.table)[e];
            const int pr = (int)min(pe.rank, 16u);
            if (tid < pr) {
                const bf16_t* a = (const bf16_t*)pe.a + (u64)tid * p.in_dim + pk0;
                if (aligned16(a) && pk1 > pk0) prefetch_l2_bulk(a, (u32)(pk1 - pk0) * 2u);
            } else if (tid == 16 && pr > 0) {
                const bf16_t* b = (const bf16_t*)pe.b + (u64)po0 * 16;
                if (aligned16(b) && po1 > po0) prefetch_l2_bulk(b, (u32)(po1 - po0) * 32u);
            }
        }
        grid_dependency_wait();
        if (chain == CHAIN_WAIT_FIRST_EARLY_NEXT) grid_launch_dependents();
    }

    const int raw = tid < p.n_rows ? ((const int*)p.idx)[tid] : -1;
    if (e == 0 && q == 0) checked_index(raw, tg.n_entries, p.fault, true);
    if (e >= tg.n_entries) return;
    const PairEntry en = ((const PairEntry*)tg.table)[e];
    // Weights not 16- and 8-byte aligned: element loads (uniform over the group).
    static_assert(DORA == kDecodeDora, "the fallback is the module's own instantiation");
    if (ALIGNED && (!aligned16((const void*)en.a) || (en.b & 7ull) != 0)) {
        bgs_unaligned(sp);
        return;
    }
    const bool valid = !bad_entry(en, 16) && en.rank > 0;
    const int rank = valid ? (int)en.rank : 0;
    if (tid == 0) s_live = rank;
    const bf16_t* A = (const bf16_t*)en.a;
    const bf16_t* B = (const bf16_t*)en.b;
    const int in = p.in_dim;
    int k0, k1, o0, o1;
    split8(in, Q, q, k0, k1);
    split8(tg.out_dim, Q, q, o0, o1);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    // A: loads from clamped addresses, unpredicated, masked after the
    // fence: a predicated 16-byte load lands in a scratch register whose
    // moves into the mma's interleaved operands then wait for it before the
    // next load may reuse it (ptxas did that with eight loads a lane).
    // Nothing is read of a bad entry (uniform over the group; it exits
    // before the passes). `in` >= 8, so k1 - 8 >= 0 even in an empty slice.
    uint4 a0[NCH], a1[NCH];
    if (valid) {
        const bf16_t* ra = A + (u64)min(g, rank - 1) * in;
        const bf16_t* rb = A + (u64)min(g + 8, rank - 1) * in;
#pragma unroll
        for (int u = 0; u < NCH; ++u) {
            const int col = min(k0 + (warp + u * BGE_WARPS) * 32 + c * 8, k1 - 8);
            a0[u] = load8_any(ra + col, ALIGNED);
            a1[u] = load8_any(rb + col, ALIGNED);
        }
    }
    uint2 bw[NG][4];
#pragma unroll
    for (int u = 0; u < NG; ++u) {
        const int base = o0 + (warp + u * BGE_WARPS) * 32;
        const bool b_ok = rank > 0 && base + 8 * (g >> 1) + 8 <= o1;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int bo = base + 8 * (g >> 1) + 2 * j + (g & 1);
            const bf16_t* br = B + (u64)bo * 16 + 4 * c;
            if (!b_ok) {
                bw[u][j] = make_uint2(0u, 0u);
            } else if (ALIGNED) {
                bw[u][j] = __ldg((const uint2*)br);
            } else {
                bw[u][j] = make_uint2((u32)__ldg(br) | ((u32)__ldg(br + 1) << 16),
                                      (u32)__ldg(br + 2) | ((u32)__ldg(br + 3) << 16));
            }
        }
    }

    const int n_found = bge_list_round(raw == e, tid, 0, s_wcount, s_rows);
    __syncthreads();
    if (n_found == 0) return;  // uniform over the group
    if (!valid) {
        if (q == 0 && tid == 0 && en.rank > 0) raise_fault(p.fault, FAULT_BAD_RANK);
        return;
    }

    if (chain == CHAIN_EARLY_READS) grid_dependency_wait();
    const bf16_t* x = (const bf16_t*)p.x;
    bf16_t* y = (bf16_t*)p.y + tg.y_col_off;
    u64* inbox = (u64*)sp.inbox;
    int passes = 0;
#pragma unroll 1
    for (int r0 = 0; r0 < n_found; r0 += PR) {
        const int row = g < n_found - r0 ? s_rows[r0 + g] : -1;
        uint4 xr[NCH], yr[NG];
#pragma unroll
        for (int u = 0; u < NCH; ++u) {
            const int col = k0 + (warp + u * BGE_WARPS) * 32 + c * 8;
            xr[u] = col < k1 && row >= 0 ? ldg16(x + (u64)row * p.x_stride + col) : zero;
        }
#pragma unroll
        for (int u = 0; u < NG; ++u) {
            const int base = o0 + (warp + u * BGE_WARPS) * 32;
            const bool y_ok = base + 8 * c + 8 <= o1 && row >= 0;
            yr[u] = y_ok ? *(const uint4*)(y + (u64)row * p.y_stride + base + 8 * c) : zero;
        }
        __syncthreads();  // the scheduling fence (as the register form); s_t and s_red free again
        // The rank as ptxas cannot know it: A's masks (and the moves into the
        // mma's operands they make) stay below the fence, not hoisted out of the loop.
        const int live = *(volatile int*)&s_live;

        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (live) {
#pragma unroll
            for (int u = 0; u < NCH; ++u) {
                const bool col_ok = k0 + (warp + u * BGE_WARPS) * 32 + c * 8 < k1;
                const uint4 fa = col_ok && g < live ? a0[u] : zero;
                const uint4 fb = col_ok && g + 8 < live ? a1[u] : zero;
                mma_k16(acc, fa.x, fb.x, fa.y, fb.y, xr[u].x, xr[u].y);
                mma_k16(acc, fa.z, fb.z, fa.w, fb.w, xr[u].z, xr[u].w);
            }
        }
        {
            float* r = s_red + (warp * 16 + g) * PR + 2 * c;
            *(float2*)r = make_float2(acc[0], acc[1]);
            *(float2*)(r + 8 * PR) = make_float2(acc[2], acc[3]);
        }
        __syncthreads();
        // The exchange: word tid of this block's partial to every peer, then the peers' words tid.
        if (tid < PART) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < BGE_WARPS; ++w) v += s_red[w * PART + tid];
            ++passes;
            const u32 tag = (u32)passes;
            const int b = passes & 1;
            const u64 word = ((u64)tag << 32) | (u64)__float_as_uint(v);
#pragma unroll
            for (int r = 0; r < BGS_MAX_SPREAD; ++r)
                if (r < Q && r != q)
                    st_relaxed_u64(inbox + ((first_block + r) * 2 + b) * (BGS_MAX_SPREAD * PART) + q * PART + tid, word);
            const u64* mine = inbox + ((first_block + q) * 2 + b) * (BGS_MAX_SPREAD * PART) + tid;
            float got[BGS_MAX_SPREAD];
            u32 waiting = 0;
#pragma unroll
            for (int r = 0; r < BGS_MAX_SPREAD; ++r) {
                got[r] = v;
                if (r < Q && r != q) waiting |= 1u << r;
            }
            while (waiting) {
                u64 w8[BGS_MAX_SPREAD];
#pragma unroll
                for (int r = 0; r < BGS_MAX_SPREAD; ++r)
                    if (waiting & (1u << r)) w8[r] = ld_relaxed_u64(mine + r * PART);
#pragma unroll
                for (int r = 0; r < BGS_MAX_SPREAD; ++r)
                    if ((waiting & (1u << r)) && (u32)(w8[r] >> 32) == tag) {
                        got[r] = __uint_as_float((u32)w8[r]);
                        waiting &= ~(1u << r);
                    }
            }
            float sum = 0.f;
#pragma unroll
            for (int r = 0; r < BGS_MAX_SPREAD; ++r)
                if (r < Q) sum += got[r];
            s_t[(tid % PR) * TP + tid / PR] = sum * en.scale;
        } else {
            ++passes;
        }
        __syncthreads();

        // The register kernel's expand, written out again rather than shared:
        // through a common inline helper ptxas scheduled the register kernel
        // differently (2156 of its 6088 SASS lines changed, nvcc 13.0).
        const u32 bm0 = rank_mask(4 * c, rank), bm1 = rank_mask(4 * c + 2, rank);
        u32 th[2], tl[2];
        {
            const float* ta = s_t + g * TP + 4 * c;
            split_pair(ta[0], ta[1], th[0], tl[0]);
            split_pair(ta[2], ta[3], th[1], tl[1]);
        }
#pragma unroll
        for (int u = 0; u < NG; ++u) {
            const int base = o0 + (warp + u * BGE_WARPS) * 32;
            const bool y_ok = base + 8 * c + 8 <= o1 && row >= 0;
            const u32 wa[4] = {yr[u].x, yr[u].y, yr[u].z, yr[u].w};
            float d[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                d[j][0] = bf_lo(wa[j]);
                d[j][1] = bf_hi(wa[j]);
                d[j][2] = 0.f;
                d[j][3] = 0.f;
                const u32 b0 = bw[u][j].x & bm0, b1 = bw[u][j].y & bm1;
                mma_k16(d[j], th[0], 0u, th[1], 0u, b0, b1);
                mma_k16(d[j], tl[0], 0u, tl[1], 0u, b0, b1);
            }
            if (y_ok) {
                if constexpr (DORA) bge_dora8(d, 0, p.targets[blockIdx.z], (int)blockIdx.y, base + 8 * c);
                st_global16(y + (u64)row * p.y_stride + base + 8 * c,
                            make_uint4(pack_bf2_rn(d[0][0], d[0][1]), pack_bf2_rn(d[1][0], d[1][1]),
                                       pack_bf2_rn(d[2][0], d[2][1]), pack_bf2_rn(d[3][0], d[3][1])));
            }
        }
    }
    if (chain == CHAIN_EARLY_READS || chain == CHAIN_WAIT_FIRST) grid_launch_dependents();
    // Every word sent to this block was read above and no peer sends more:
    // zero them for the next launch.
    if (tid < PART) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            if (b == 0 && passes < 2) continue;
            u64* mine = inbox + ((first_block + q) * 2 + b) * (BGS_MAX_SPREAD * PART) + tid;
#pragma unroll
            for (int r = 0; r < BGS_MAX_SPREAD; ++r)
                if (r < Q && r != q) mine[r * PART] = 0ull;
        }
    }
}

// Not inlined: its registers stay out of the aligned body's allocation.
__device__ __noinline__ void bgs_unaligned(const BgsParams sp) {
    bgs_body<false, kDecodeDora>(sp);
}

#if __CUDA_ARCH__ >= 900
// Plain, or with the DoRA epilogue compiled in (_dora; decode.cuh).
extern "C" __global__ void __launch_bounds__(BGE_THREADS, 1) DECODE_NAME(bgmv_entry_spread_r16)(const BgsParams sp) {
    bgs_body<true, kDecodeDora>(sp);
}
#endif
