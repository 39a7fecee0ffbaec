// Segment-grouped LoRA apply (prefill, mixed segments, and one adapter):
// rows cu_seqlens[s] .. cu_seqlens[s + 1] use the entry seg_slot[s] (-1: no
// delta); with uniform_entry >= 0 every row uses that entry.
//
// Two launches:
//   sgmv_shrink: t[ks][row][k] = sum over K split ks of A[k, i] x[row, i],
//                tensor cores (mma.sync m16n8k16 bf16, f32 accumulate), a
//                64-row tile of one segment per block, cp.async pipeline
//                (sgmv_shrink_r16_bf16, chosen by SgmvTuning::narrow_shrink:
//                16-row A tiles and a deeper pipeline for rank strides up
//                to 16; sgmv_shrink_split_bf16: the
//                64-row kernel with v6's split staging, to time against).
//   sgmv_expand: y[row, col_off + o] += scale * sum_k B[o, k] t[row][k]
//                (t summed over the K splits), tensor cores with t split
//                into a bf16 high and low part so t keeps ~16 bits; B and t
//                staged in shared memory first; y read once, the DoRA
//                epilogue applied where the tile's entry has a rescale
//                (common.cuh), and rounded once. Persistent blocks, each
//                a balanced run of the items; the host may launch it as a
//                programmatic dependent of the shrink (it waits before
//                reading t).
// On sm_90a (compute capability 9.0) both phases also have warpgroup-MMA
// kernels, the host's default there: sgmv_shrink_wg{16,32,64}_bf16 (A tiles
// of 16, 32 or 64 rows, x and A in 128-byte-swizzled tiles read by wgmma)
// and sgmv_expand_wg{,f}_{bf16,f32} (t's two bf16 parts and B swizzled, t
// staged once per tile; `wgf`: the MMAs before y lands).
// A tile never crosses a segment: tile i of the launch is found by a prefix
// sum of ceil(len_s / 64) over segments, so the grid (sized by the host from
// the row and segment counts) stays fixed while the contents change.

#define SG_BM 64
#define SG_BK 64
#define SG_BN 64
#define SG_STAGES 3
// Pipeline depth of the shrink for rank strides up to 16 (`STAGES_R16` in sgmv.rs).
#define SG_STAGES_R16 6
#define SG_THREADS 128
#define SG_LD (SG_BK + 8)
#define SG_BO 128
// Table entries the shrink copies into shared memory (`SHRINK_STATIC_SMEM` in sgmv.rs counts them):
// run 257 (NOTES.md v26), prefill r16 0.3 µs faster in a graph, 0.6-0.8 alone.
#define SG_TABLE_SMEM 64
// Most K splits of the shrink (`MAX_K_SPLITS` in workspace.rs).
#define SG_MAX_K_SPLITS 8

struct SgmvParams {
    u64 x;
    u64 y;
    u64 cu_seqlens;
    u64 seg_slot;
    u64 ws;
    u64 fault;
    int n_rows;
    int in_dim;
    int x_stride;
    int y_stride;
    int rank_stride;
    int n_targets;
    int n_segments;
    int uniform_entry;
    int k_splits;
    int ws_rows;
    int ws_rank_pad;
    int max_tiles;
    int rank_chunks;
    int out_tiles;
    int balance_items;
    int y_buffers;  // the expand's y tiles: 2 (the next item's tile requested during this one) or 1
    int early_dependents;  // the shrink lets the expand get resident at its start (1) or after its main loop (0)
    int pad_;
    LoraTarget targets[MAX_TARGETS];
};
static_assert(sizeof(SgmvParams) == 280 && sizeof(SgmvParams) - sizeof(LoraTarget) * MAX_TARGETS == 120, "mirrors sgmv.rs");

// The dynamic shared memory of both kernels (one declaration for the file).
extern __shared__ __align__(128) unsigned char dyn[];

struct TileInfo {
    int row0;
    int rows;
    int entry;
    int valid;
};



// Zeroed accumulators of N 8-column mma tiles.
template <int N>
__device__ __forceinline__ void zero_acc(float (&acc)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// The bf16 rounding of what (lo, hi) keeps beyond its bf16 pair `high` (pack_bf2_rn(lo, hi)): with
// `high`, t keeps ~16 bits through bf16 MMAs.
__device__ __forceinline__ u32 bf2_rest(float lo, float hi, u32 high) {
    return pack_bf2_rn(lo - bf_lo(high), hi - bf_hi(high));
}

// The first STAGES - 1 stages of a cp.async ring over nk chunks from kc0, a group per stage.
template <int STAGES, typename LoadStage>
__device__ __forceinline__ void ring_prologue(int nk, int kc0, LoadStage&& load_stage) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nk) load_stage(s, kc0 + s);
        cp_async_commit();
    }
}

// Chunk i's turn in the ring: chunk i + STAGES - 1 into the stage chunk i - 1 left, as a group.
template <int STAGES, typename LoadStage>
__device__ __forceinline__ void ring_refill(int i, int nk, int kc0, LoadStage&& load_stage) {
    const int nxt = i + STAGES - 1;
    if (nxt < nk) load_stage(nxt % STAGES, kc0 + nxt);
    cp_async_commit();
}

// Whether rows [start, end) are a segment of an n_rows batch, and the tiles
// of one of `len` rows: the one segment rule of find_tile and count_tiles.
__device__ __forceinline__ bool segment_ok(int start, int end, int n_rows) {
    return start >= 0 && end >= start && end <= n_rows;
}
__device__ __forceinline__ int segment_tiles(int len) { return (len + SG_BM - 1) / SG_BM; }

// Warp 0: find tile `tile` of target `tg` and the entry it uses. Writes *out.
__device__ void find_tile(const SgmvParams& p, const LoraTarget& tg, int tile, TileInfo* out, bool report) {
    const int lane = threadIdx.x & 31;
    if (lane == 0) out->valid = 0;
    __syncwarp();
    if (p.uniform_entry >= 0) {
        if (lane == 0) {
            const int e = p.uniform_entry;
            const int nt = segment_tiles(p.n_rows);
            if (e >= tg.n_entries) {
                if (report) raise_fault(p.fault, FAULT_BAD_INDEX);
            } else if (tile < nt) {
                out->row0 = tile * SG_BM;
                out->rows = min(SG_BM, p.n_rows - tile * SG_BM);
                out->entry = e;
                out->valid = 1;
            }
        }
        __syncwarp();
        return;
    }
    const int* cu = (const int*)p.cu_seqlens;
    const int* slots = (const int*)p.seg_slot;
    int running = 0;
    for (int base = 0; base < p.n_segments; base += 32) {
        const int s = base + lane;
        int nt = 0;
        int start = 0;
        int end = 0;
        int e = -1;
        if (s < p.n_segments) {
            start = cu[s];
            end = cu[s + 1];
            e = slots[s];
            if (!segment_ok(start, end, p.n_rows)) {
                if (report) raise_fault(p.fault, FAULT_BAD_SEQLENS);
                e = -1;
            } else if (e >= tg.n_entries) {
                if (report) raise_fault(p.fault, FAULT_BAD_INDEX);
                e = -1;
            }
            if (e >= 0) nt = segment_tiles(end - start);
        }
        int incl = nt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += n;
        }
        const int excl = incl - nt;
        if (nt > 0 && tile >= running + excl && tile < running + incl) {
            const int r0 = start + (tile - running - excl) * SG_BM;
            out->row0 = r0;
            out->rows = min(SG_BM, end - r0);
            out->entry = e;
            out->valid = 1;
        }
        running += __shfl_sync(0xffffffffu, incl, 31);
        if (running > tile) break;
    }
    __syncwarp();
}

// Warp 0: how many tiles the launch really has (the most over targets, in
// find_tile's numbering: segments of a bad range or entry have none), at
// most max_tiles. The host sizes grids for max_tiles, which counts one
// partial tile per segment that aligned segments do not have.
__device__ int count_tiles(const SgmvParams& p) {
    const int lane = threadIdx.x & 31;
    if (p.uniform_entry >= 0) return min(p.max_tiles, segment_tiles(p.n_rows));
    const int* cu = (const int*)p.cu_seqlens;
    const int* slots = (const int*)p.seg_slot;
    int counts[MAX_TARGETS] = {0, 0, 0, 0};
    for (int s = lane; s < p.n_segments; s += 32) {
        const int start = cu[s];
        const int end = cu[s + 1];
        const int e = slots[s];
        if (segment_ok(start, end, p.n_rows) && e >= 0) {
            const int nt = segment_tiles(end - start);
#pragma unroll
            for (int t = 0; t < MAX_TARGETS; ++t)
                if (t < p.n_targets && e < p.targets[t].n_entries) counts[t] += nt;
        }
    }
    int most = 0;
#pragma unroll
    for (int t = 0; t < MAX_TARGETS; ++t) {
        int c = counts[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
        most = max(most, c);
    }
    return min(most, p.max_tiles);
}

// The items [*it0, *it1) of this block of a persistent expand with
// `per_tile` items per tile: balanced contiguous runs over the tiles the
// launch really has when p.balance_items (warp 0 counts them; every thread
// must call), else runs of ceil(items / grid) over max_tiles.
__device__ __forceinline__ void block_items(const SgmvParams& p, int per_tile, int* it0, int* it1) {
    __shared__ int s_total;
    if (p.balance_items) {
        if (threadIdx.x < 32) {
            const int tiles = count_tiles(p);
            if (threadIdx.x == 0) s_total = tiles * per_tile;
        }
        __syncthreads();
        const long long total = s_total;
        *it0 = (int)(blockIdx.x * total / gridDim.x);
        *it1 = (int)((blockIdx.x + 1) * total / gridDim.x);
    } else {
        const int total = p.max_tiles * per_tile;
        const int per = (total + gridDim.x - 1) / gridDim.x;
        *it0 = min(total, (int)blockIdx.x * per);
        *it1 = min(total, *it0 + per);
    }
}

// Loads the entry of a found tile and checks it; returns its rank (0: skip).
// Entries below `n_staged` come from `staged`, a shared-memory copy of the table's first entries.
__device__ __forceinline__ void load_tile_entry(const SgmvParams& p, const LoraTarget& tg, TileInfo* tile,
                                                PairEntry* out, bool report, const PairEntry* staged = nullptr,
                                                int n_staged = 0) {
    if (threadIdx.x == 0) {
        PairEntry en;
        en.a = 0;
        en.b = 0;
        en.scale = 0.f;
        en.rank = 0;
        if (tile->valid) {
            en = tile->entry < n_staged ? staged[tile->entry] : ((const PairEntry*)tg.table)[tile->entry];
            if (en.rank > (u32)p.rank_stride || (en.rank > 0 && (en.a == 0 || en.b == 0))) {
                if (report) raise_fault(p.fault, FAULT_BAD_RANK);
                en.rank = 0;
            }
        }
        *out = en;
    }
}

// How the shrink stages one K chunk. Split: the x tile, then the A tile, each
// piece choosing the vector or scalar copy by itself (any AR). Paired (AR ==
// SG_BM only): the x and A pieces at the same position issued together, the
// vector-path check hoisted above the piece loop, so the vector path of the
// main loop is straight-line cp.async (v5's loop was this short; the split
// form lengthened the 64-row kernel's main loop by about a third).
enum class StageForm { Split, Paired, Wgmma };

// The shrink's main loop over K chunks [kc0, kc1): acc[nt] = warp `warp`'s
// 16 rows of the x tile (rows row0.., `rows` of them real, the rest zero)
// times A rows n0 + nt * 8.. (`nlen` of them real), summed over those chunks.
// Stages in the dynamic shared memory: x tiles [STAGES][SG_BM][SG_LD], then A tiles [STAGES][AR][SG_LD].
template <int AR, int STAGES, StageForm FORM>
__device__ __forceinline__ void shrink_tile(const SgmvParams& p, const bf16_t* A, int row0, int rows, int n0, int nlen,
                                            int kc0, int kc1, float (&acc)[AR / 8][4]) {
    static_assert(FORM == StageForm::Split || (FORM == StageForm::Paired && AR == SG_BM),
                  "paired staging needs A tiles as tall as x tiles; the wgmma form is shrink_tile_wg");
    typedef bf16_t XTile[SG_BM][SG_LD];
    typedef bf16_t ATile[AR][SG_LD];
    XTile* s_x = (XTile*)dyn;
    ATile* s_a = (ATile*)(dyn + sizeof(XTile) * STAGES);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int NT = (nlen + 7) / 8;
    const int in = p.in_dim;
    const bf16_t* X = (const bf16_t*)p.x;
    const int nk = kc1 - kc0;
    const bool vec = (in % 8 == 0) && (p.x_stride % 8 == 0) && aligned16(X) && aligned16(A);

    // One row piece (8 columns from col) of a staged tile: rows past `valid_rows` are zero.
    auto load_piece = [&](bf16_t* dst, const bf16_t* base, u64 pitch, int r, int valid_rows, int col) {
        const bool rv = r < valid_rows;
        const bf16_t* src = base + (u64)(rv ? r : 0) * pitch;
        if (vec) {
            const bool inb = col < in;
            cp_async16(dst, inb && rv ? src + col : base, inb && rv);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) dst[j] = col + j < in && rv ? src[col + j] : (bf16_t)0;
        }
    };
    // Paired staging: the x and A pieces at (r, c) of stage `st`, by the vector path or the scalar one
    // (a constant at each inlined call, so each path is compiled on its own).
    auto load_pair = [&](bool vec_path, int st, int r, int c, int col) {
        const bool xv = r < rows;
        const bool av = r < nlen;
        const bf16_t* xs = X + (u64)(row0 + (xv ? r : 0)) * p.x_stride;
        const bf16_t* as = A + (u64)(n0 + (av ? r : 0)) * in;
        if (vec_path) {
            const bool inb = col < in;
            cp_async16(&s_x[st][r][c], inb && xv ? xs + col : X, inb && xv);
            cp_async16(&s_a[st][r][c], inb && av ? as + col : A, inb && av);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const bool inb = col + j < in;
                s_x[st][r][c + j] = inb && xv ? xs[col + j] : (bf16_t)0;
                s_a[st][r][c + j] = inb && av ? as[col + j] : (bf16_t)0;
            }
        }
    };
    // Stage `st` <- K chunk `kc`: SG_BM x-rows and AR A-rows of SG_BK columns each.
    auto load_stage = [&](int st, int kc) {
        const int col0 = kc * SG_BK;
        if constexpr (FORM == StageForm::Paired) {
            auto pieces = [&](bool vec_path) {
#pragma unroll
                for (int u = 0; u < SG_BM * SG_BK / 8 / SG_THREADS; ++u) {
                    const int v = tid + u * SG_THREADS;
                    const int c = (v % (SG_BK / 8)) * 8;
                    load_pair(vec_path, st, v / (SG_BK / 8), c, col0 + c);
                }
            };
            if (vec)
                pieces(true);
            else
                pieces(false);
        } else {
#pragma unroll
            for (int u = 0; u < SG_BM * SG_BK / 8 / SG_THREADS; ++u) {
                const int v = tid + u * SG_THREADS;
                const int r = v / (SG_BK / 8);
                const int c = (v % (SG_BK / 8)) * 8;
                load_piece(&s_x[st][r][c], X + (u64)row0 * p.x_stride, (u64)p.x_stride, r, rows, col0 + c);
            }
#pragma unroll
            for (int u = 0; u < (AR * SG_BK / 8 + SG_THREADS - 1) / SG_THREADS; ++u) {
                const int v = tid + u * SG_THREADS;
                if (v < AR * SG_BK / 8) {
                    const int r = v / (SG_BK / 8);
                    const int c = (v % (SG_BK / 8)) * 8;
                    load_piece(&s_a[st][r][c], A + (u64)n0 * in, (u64)in, r, nlen, col0 + c);
                }
            }
        }
    };

    zero_acc(acc);
    ring_prologue<STAGES>(nk, kc0, load_stage);
    for (int i = 0; i < nk; ++i) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        ring_refill<STAGES>(i, nk, kc0, load_stage);
        const int st = i % STAGES;
#pragma unroll
        for (int kk = 0; kk < SG_BK; kk += 16) {
            u32 a[4];
            ldsm_x4(a, &s_x[st][warp * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
            for (int np = 0; np < AR / 16; ++np) {
                if (2 * np < NT) {
                    u32 b[4];
                    ldsm_x4(b, &s_a[st][np * 16 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
                    mma_k16(acc[2 * np], a, b[0], b[1]);
                    if (2 * np + 1 < NT) mma_k16(acc[2 * np + 1], a, b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
}

// ---- The shrink on warpgroup MMAs (sm_90a) ----
// The block's four warps are one warpgroup: per K chunk, four wgmma
// m64nARk16 read the staged x tile (64 rows) and A tile (AR rows) straight
// from shared memory, once for the group, where mma.sync had every warp
// load the whole A tile through ldmatrix (about 7 µs of the r64 shrink's
// 38, NOTES.md v27). Tiles are 64 bf16 columns (128-byte rows) in the
// 128-byte swizzle wgmma reads: 16-byte piece c of row r lies at
// r * 128 + ((c ^ (r & 7)) * 16), every tile starting on a 1024-byte
// boundary of the dynamic shared memory (the host adds 1 KB to align it).
#define SG_WG_ALIGN 1024
// Stages of the wgmma shrink for A tiles of `ar` rows: as many as fit
// 56 KB, so four blocks stay resident per SM (`wg_stages` in sgmv.rs).
#define SG_WG_STAGE_BUDGET (56 * 1024)
__host__ __device__ constexpr int sg_wg_stages(int ar) { return SG_WG_STAGE_BUDGET / ((SG_BM + ar) * 2 * SG_BK); }

// Byte offset of 16-byte piece c of row r in a swizzled tile.
__device__ __forceinline__ u32 swz128(int r, int c) { return (u32)(r * (2 * SG_BK) + ((c ^ (r & 7)) << 4)); }

// The wgmma descriptor of a swizzled K-major tile at shared address `addr`:
// 128-byte swizzle, 8-row groups 1024 bytes apart (the leading offset is
// unused by this layout and set to 1, its encoded minimum).
__device__ __forceinline__ u64 wg_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// Generic-proxy writes of shared memory (cp.async, stores) made visible to wgmma's reads.
__device__ __forceinline__ void fence_async_smem() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// acc (64 x N, f32, mma.sync's fragment order per 8 columns) += the 64 x 16
// tile of descriptor da times the N x 16 tile of descriptor db, transposed.
template <int N>
__device__ __forceinline__ void wgmma_k16(float (&acc)[N / 8][4], u64 da, u64 db);
template <>
__device__ __forceinline__ void wgmma_k16<16>(float (&acc)[2][4], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 0, 0;"
        : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]), "+f"(acc[1][0]), "+f"(acc[1][1]), "+f"(acc[1][2]), "+f"(acc[1][3])
        : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_k16<32>(float (&acc)[4][4], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;"
        : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]), "+f"(acc[1][0]), "+f"(acc[1][1]), "+f"(acc[1][2]), "+f"(acc[1][3]), "+f"(acc[2][0]), "+f"(acc[2][1]), "+f"(acc[2][2]), "+f"(acc[2][3]), "+f"(acc[3][0]), "+f"(acc[3][1]), "+f"(acc[3][2]), "+f"(acc[3][3])
        : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_k16<64>(float (&acc)[8][4], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, 0, 0;"
        : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]), "+f"(acc[1][0]), "+f"(acc[1][1]), "+f"(acc[1][2]), "+f"(acc[1][3]), "+f"(acc[2][0]), "+f"(acc[2][1]), "+f"(acc[2][2]), "+f"(acc[2][3]), "+f"(acc[3][0]), "+f"(acc[3][1]), "+f"(acc[3][2]), "+f"(acc[3][3]), "+f"(acc[4][0]), "+f"(acc[4][1]), "+f"(acc[4][2]), "+f"(acc[4][3]), "+f"(acc[5][0]), "+f"(acc[5][1]), "+f"(acc[5][2]), "+f"(acc[5][3]), "+f"(acc[6][0]), "+f"(acc[6][1]), "+f"(acc[6][2]), "+f"(acc[6][3]), "+f"(acc[7][0]), "+f"(acc[7][1]), "+f"(acc[7][2]), "+f"(acc[7][3])
        : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_k16<128>(float (&acc)[16][4], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 0;"
        : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]), "+f"(acc[1][0]), "+f"(acc[1][1]), "+f"(acc[1][2]), "+f"(acc[1][3]), "+f"(acc[2][0]), "+f"(acc[2][1]), "+f"(acc[2][2]), "+f"(acc[2][3]), "+f"(acc[3][0]), "+f"(acc[3][1]), "+f"(acc[3][2]), "+f"(acc[3][3]), "+f"(acc[4][0]), "+f"(acc[4][1]), "+f"(acc[4][2]), "+f"(acc[4][3]), "+f"(acc[5][0]), "+f"(acc[5][1]), "+f"(acc[5][2]), "+f"(acc[5][3]), "+f"(acc[6][0]), "+f"(acc[6][1]), "+f"(acc[6][2]), "+f"(acc[6][3]), "+f"(acc[7][0]), "+f"(acc[7][1]), "+f"(acc[7][2]), "+f"(acc[7][3]), "+f"(acc[8][0]), "+f"(acc[8][1]), "+f"(acc[8][2]), "+f"(acc[8][3]), "+f"(acc[9][0]), "+f"(acc[9][1]), "+f"(acc[9][2]), "+f"(acc[9][3]), "+f"(acc[10][0]), "+f"(acc[10][1]), "+f"(acc[10][2]), "+f"(acc[10][3]), "+f"(acc[11][0]), "+f"(acc[11][1]), "+f"(acc[11][2]), "+f"(acc[11][3]), "+f"(acc[12][0]), "+f"(acc[12][1]), "+f"(acc[12][2]), "+f"(acc[12][3]), "+f"(acc[13][0]), "+f"(acc[13][1]), "+f"(acc[13][2]), "+f"(acc[13][3]), "+f"(acc[14][0]), "+f"(acc[14][1]), "+f"(acc[14][2]), "+f"(acc[14][3]), "+f"(acc[15][0]), "+f"(acc[15][1]), "+f"(acc[15][2]), "+f"(acc[15][3])
        : "l"(da), "l"(db));
}
#endif

// shrink_tile's contract on warpgroup MMAs: acc[nt] = warp `warp`'s 16 rows
// of the x tile (rows row0.., `rows` real) times A rows n0 + nt * 8..
// (`nlen` real; A rows past them are staged as zeros, so every column of
// acc is computed and the caller stores the real ones), over K chunks
// [kc0, kc1). Dynamic shared memory, aligned up to SG_WG_ALIGN: x tiles
// [STAGES][SG_BM][SG_BK], then A tiles [STAGES][AR][SG_BK], swizzled.
template <int AR, int STAGES>
__device__ __forceinline__ void shrink_tile_wg(const SgmvParams& p, const bf16_t* A, int row0, int rows, int n0,
                                               int nlen, int kc0, int kc1, float (&acc)[AR / 8][4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(AR % 16 == 0 && AR <= SG_BM, "wgmma n of 16, 32 or 64");
    constexpr u32 X_TILE = SG_BM * SG_BK * 2;
    constexpr u32 A_TILE = AR * SG_BK * 2;
    const u32 base = (smem_u32(dyn) + SG_WG_ALIGN - 1) & ~(u32)(SG_WG_ALIGN - 1);
    unsigned char* const tiles = dyn + (base - smem_u32(dyn));
    const u32 x0 = base;
    const u32 a0 = base + STAGES * X_TILE;
    const int tid = threadIdx.x;
    const int in = p.in_dim;
    const bf16_t* X = (const bf16_t*)p.x + (u64)row0 * p.x_stride;
    const bf16_t* An = A + (u64)n0 * in;
    const int nk = kc1 - kc0;
    const bool vec = (in % 8 == 0) && (p.x_stride % 8 == 0) && aligned16((const bf16_t*)p.x) && aligned16(A);

    // `n` rows of a tile (rows past `valid` zero) <- columns col0.. of rows at `src` (row pitch `pitch`).
    auto stage_rows = [&](u32 tile, const bf16_t* src, u64 pitch, int n, int valid, int col0) {
#pragma unroll
        for (int u = 0; u < n * (SG_BK / 8) / SG_THREADS; ++u) {
            const int v = tid + u * SG_THREADS;
            const int r = v / (SG_BK / 8);
            const int c = v % (SG_BK / 8);
            const int col = col0 + c * 8;
            const bool rv = r < valid;
            const bf16_t* row = src + (u64)(rv ? r : 0) * pitch;
            const u32 off = tile - base + swz128(r, c);
            if (vec) {
                const bool ok = rv && col < in;
                cp_async16(tiles + off, ok ? row + col : src, ok);
            } else {
                bf16_t* d = (bf16_t*)(tiles + off);
#pragma unroll
                for (int j = 0; j < 8; ++j) d[j] = rv && col + j < in ? row[col + j] : (bf16_t)0;
            }
        }
    };
    auto load_stage = [&](int st, int kc) {
        stage_rows(x0 + st * X_TILE, X, (u64)p.x_stride, SG_BM, rows, kc * SG_BK);
        stage_rows(a0 + st * A_TILE, An, (u64)in, AR, nlen, kc * SG_BK);
    };

    zero_acc(acc);
    ring_prologue<STAGES>(nk, kc0, load_stage);
    for (int i = 0; i < nk; ++i) {
        cp_async_wait<STAGES - 2>();
        fence_async_smem();
        __syncthreads();  // chunk i staged by every thread; chunk i - 1's wgmma done in every warp
        ring_refill<STAGES>(i, nk, kc0, load_stage);
        const int st = i % STAGES;
        const u64 dx = wg_desc(x0 + st * X_TILE);
        const u64 da = wg_desc(a0 + st * A_TILE);
        wg_fence();
        // K steps of 16 columns (32 bytes, 2 in the descriptor's address units) within the swizzled rows.
#pragma unroll
        for (int kk = 0; kk < SG_BK / 16; ++kk) wgmma_k16<AR>(acc, dx + 2 * kk, da + 2 * kk);
        wg_commit();
        wg_wait_all();
    }
    cp_async_wait<0>();
#else
    // Launched only on sm_90a (the host checks); other targets compile a stub.
    (void)p, (void)A, (void)row0, (void)rows, (void)n0, (void)nlen, (void)kc0, (void)kc1;
    zero_acc(acc);
    __trap();
#endif
}

// The shrink body for A tiles of AR rows (a rank chunk of at most AR) and a
// cp.async pipeline STAGES deep. Dynamic shared memory: x tiles
// [STAGES][SG_BM][SG_LD], then A tiles [STAGES][AR][SG_LD].
template <int AR, int STAGES, StageForm FORM>
__device__ __forceinline__ void sgmv_shrink_body(const SgmvParams& p) {
    __shared__ TileInfo s_tile;
    __shared__ PairEntry s_entry;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int per_tile = p.n_targets * p.rank_chunks;
    const int tile = (int)blockIdx.x / per_tile;
    const int rem = (int)blockIdx.x % per_tile;
    const int ti = rem / p.rank_chunks;
    const int rc = rem % p.rank_chunks;
    const int ks = (int)blockIdx.y;
    const LoraTarget tg = p.targets[ti];
    const bool report = ks == 0 && rc == 0;
    // A dependent expand may get resident now (or, with p.early_dependents off, once this block is past
    // its main loop): it waits for this grid to complete before reading t.
    if (p.early_dependents) grid_launch_dependents();

    const int nkc = (p.in_dim + SG_BK - 1) / SG_BK;
    const int per = (nkc + p.k_splits - 1) / p.k_splits;
    const int kc0 = min(nkc, ks * per);
    const int kc1 = min(nkc, kc0 + per);

    // The table's first entries, copied by warps 1.. while warp 0 finds the tile: the tile's entry is
    // then a shared-memory read, not a second round trip after the segments'.
    __shared__ PairEntry s_table[SG_TABLE_SMEM];
    const int n_staged = p.uniform_entry < 0 ? min(tg.n_entries, SG_TABLE_SMEM) : 0;
    if (warp > 0) {
        const u64* src = (const u64*)tg.table;
        u64* dst = (u64*)s_table;
        constexpr int words = sizeof(PairEntry) / sizeof(u64);
        for (int i = tid - 32; i < n_staged * words; i += SG_THREADS - 32) dst[i] = src[i];
    }
    if (warp == 0) find_tile(p, tg, tile, &s_tile, report);
    __syncthreads();
    // The first two stages' x lines start towards L2 while the entry is
    // read (x does not depend on it): one 128-byte line per thread. In a
    // graph of applies 0.1-0.9 µs faster at every prefill shape measured,
    // alone 0.3-0.9 slower (NOTES.md v26); a prefetch of the block's whole
    // x range was slower both ways.
    {
        const int r = tid & (SG_BM - 1);
        const int kc = kc0 + tid / SG_BM;
        if (s_tile.valid && r < s_tile.rows && kc < kc1) {
            const bf16_t* line = (const bf16_t*)p.x + (u64)(s_tile.row0 + r) * p.x_stride + kc * SG_BK;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
        }
    }
    load_tile_entry(p, tg, &s_tile, &s_entry, report, s_table, n_staged);
    __syncthreads();
    if (!s_tile.valid) return;
    const PairEntry en = s_entry;
    const int rank = (int)en.rank;
    const int n0 = rc * AR;
    if (n0 >= rank) return;
    const int nlen = min(AR, rank - n0);
    const int row0 = s_tile.row0;
    const int rows = s_tile.rows;

    float acc[AR / 8][4];
    if constexpr (FORM == StageForm::Wgmma)
        shrink_tile_wg<AR, STAGES>(p, (const bf16_t*)en.a, row0, rows, n0, nlen, kc0, kc1, acc);
    else
        shrink_tile<AR, STAGES, FORM>(p, (const bf16_t*)en.a, row0, rows, n0, nlen, kc0, kc1, acc);
    if (!p.early_dependents) grid_launch_dependents();
    const int NT = (nlen + 7) / 8;

    float* W = (float*)p.ws + (u64)(ti * p.k_splits + ks) * p.ws_rows * p.ws_rank_pad;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int ra = warp * 16 + g;
#pragma unroll
    for (int nt = 0; nt < AR / 8; ++nt) {
        if (nt < NT) {
            const int k = n0 + nt * 8 + 2 * t4;
            if (ra < rows) *(float2*)&W[(u64)(row0 + ra) * p.ws_rank_pad + k] = make_float2(acc[nt][0], acc[nt][1]);
            if (ra + 8 < rows)
                *(float2*)&W[(u64)(row0 + ra + 8) * p.ws_rank_pad + k] = make_float2(acc[nt][2], acc[nt][3]);
        }
    }
}

// Rank chunks of 64: A tiles as tall as x tiles, x and A pieces staged in pairs.
extern "C" __global__ void __launch_bounds__(SG_THREADS) sgmv_shrink_bf16(const SgmvParams p) {
    sgmv_shrink_body<SG_BN, SG_STAGES, StageForm::Paired>(p);
}
// The same with split staging (v6's form), kept to time against the paired one.
extern "C" __global__ void __launch_bounds__(SG_THREADS) sgmv_shrink_split_bf16(const SgmvParams p) {
    sgmv_shrink_body<SG_BN, SG_STAGES, StageForm::Split>(p);
}
// The wgmma shrinks (sm_90a), for rank strides up to 16, up to 32, and rank chunks of 64.
extern "C" __global__ void __launch_bounds__(SG_THREADS) sgmv_shrink_wg16_bf16(const SgmvParams p) {
    sgmv_shrink_body<16, sg_wg_stages(16), StageForm::Wgmma>(p);
}
extern "C" __global__ void __launch_bounds__(SG_THREADS) sgmv_shrink_wg32_bf16(const SgmvParams p) {
    sgmv_shrink_body<32, sg_wg_stages(32), StageForm::Wgmma>(p);
}
extern "C" __global__ void __launch_bounds__(SG_THREADS) sgmv_shrink_wg64_bf16(const SgmvParams p) {
    sgmv_shrink_body<SG_BN, sg_wg_stages(SG_BN), StageForm::Wgmma>(p);
}
// Rank strides up to 16: A tiles of 16 rows leave room for a deeper
// pipeline (more x bytes in flight per block) at 3 blocks per SM.
extern "C" __global__ void __launch_bounds__(SG_THREADS) sgmv_shrink_r16_bf16(const SgmvParams p) {
    sgmv_shrink_body<16, SG_STAGES_R16, StageForm::Split>(p);
}

// The expand is persistent: block b walks a contiguous run of the work
// items (tile, target, 128-output chunk) in order (`block_items`), so
// consecutive items mostly share a tile (its entry and rank vectors are staged once). Per item
// the y tile moves through shared memory in 16-byte pieces: copied in with
// cp.async (with p.y_buffers == 2 the next item's tile is requested while
// this one computes, into the other buffer; one buffer leaves room for more
// resident blocks), the mma result added there at fragment positions, and
// written back with coalesced 16-byte stores. Dynamic shared memory:
//   sB [SG_BO][r16 + 8] bf16     B rows o_base.., columns past rank zeroed
//   sT [SG_BM][r16 + 4] f32      t summed over the K splits, times scale; zero past rank
//   sY [y_buffers][SG_BM][SG_BO + YPAD]  y tiles (YPAD keeps fragment accesses off shared banks;
//                                         a DoRA entry's g and bias columns live there, dora_col)
// r16 = the stride rounded up to 16 (the host sizes the buffer from it).
struct ExpandItem {
    int tile;
    int ti;
    int o_base;
};

__device__ __forceinline__ ExpandItem expand_item(const SgmvParams& p, int it) {
    const int per_tile = p.n_targets * p.out_tiles;
    ExpandItem e;
    e.tile = it / per_tile;
    const int rem = it - e.tile * per_tile;
    e.ti = rem / p.out_tiles;
    e.o_base = (rem - e.ti * p.out_tiles) * SG_BO;
    return e;
}

// The item after e in expand_item's order, without its divisions.
__device__ __forceinline__ ExpandItem next_expand_item(const SgmvParams& p, ExpandItem e) {
    e.o_base += SG_BO;
    if (e.o_base >= p.out_tiles * SG_BO) {
        e.o_base = 0;
        if (++e.ti == p.n_targets) {
            e.ti = 0;
            ++e.tile;
        }
    }
    return e;
}

// Every thread of a persistent expand calls this for each item it works on:
// for a new (tile, target) warp 0 finds the tile and thread 0 loads and
// checks its entry into shared memory. False when the item has nothing to
// do (no such tile, or an entry of rank 0).
__device__ __forceinline__ bool begin_tile(const SgmvParams& p, const LoraTarget& tg, const ExpandItem& item,
                                           bool new_tile, int warp, TileInfo* s_tile, PairEntry* s_entry) {
    if (new_tile) {
        if (warp == 0) find_tile(p, tg, item.tile, s_tile, false);
        __syncthreads();
        load_tile_entry(p, tg, s_tile, s_entry, false);
        __syncthreads();
    }
    return s_tile->valid && s_entry->rank != 0;
}

// Pitch of a staged y row, in elements: 16 bytes of padding.
template <typename Y>
__device__ __forceinline__ int y_pitch() {
    return SG_BO + 16 / (int)sizeof(Y);
}

// Copy rows [0, rows) x columns [0, len) of a y tile between global (row
// pitch ys) and shared memory: 16-byte pieces where `vec` and the piece is
// whole, elements otherwise. `to_shared`: cp.async in (the caller commits
// and waits); else plain 16-byte stores out.
template <typename Y>
__device__ __forceinline__ void move_y_tile(Y* sy, Y* gy, int ys, int rows, int len, bool vec, bool to_shared) {
    constexpr int per = 16 / (int)sizeof(Y);
    constexpr int pieces = SG_BO / per;
    const int yp = y_pitch<Y>();
    static_assert(SG_THREADS % pieces == 0 && SG_BM % (SG_THREADS / pieces) == 0, "whole-tile steps");
    if (vec && rows == SG_BM && len == SG_BO) {
        // A whole tile (the common case): a thread's pieces are one column of
        // rows SG_THREADS / pieces apart, so its addresses step by constants
        // and no piece is checked (the general loop's index arithmetic was
        // about a quarter of the expand's instructions).
        constexpr int step = SG_THREADS / pieces;
        const int r0 = threadIdx.x / pieces;
        const int c = (threadIdx.x % pieces) * per;
        Y* s = sy + r0 * yp + c;
        Y* g = gy + (u64)r0 * ys + c;
        const u64 gstep = (u64)step * ys;
#pragma unroll
        for (int k = 0; k < SG_BM / step; ++k) {
            if (to_shared) cp_async16(s + k * step * yp, g + k * gstep, true);
            else *(uint4*)(g + k * gstep) = *(const uint4*)(s + k * step * yp);
        }
        return;
    }
    for (int v = threadIdx.x; v < SG_BM * pieces; v += SG_THREADS) {
        const int r = v / pieces;
        const int c = (v - r * pieces) * per;
        if (r >= rows || c >= len) continue;
        Y* s = sy + r * yp + c;
        Y* g = gy + (u64)r * ys + c;
        if (vec && c + per <= len) {
            if (to_shared) cp_async16(s, g, true);
            else *(uint4*)g = *(const uint4*)s;
        } else {
            const int m = min(per, len - c);
            for (int j = 0; j < m; ++j) {
                if (to_shared) s[j] = g[j];
                else g[j] = s[j];
            }
        }
    }
}

// A DoRA entry's g (f < SG_BO) and bias (f - SG_BO) at an item's columns
// live in the 16-byte pads of its y tile's rows, which y never uses: four
// floats a row, SG_BM rows for 2 x SG_BO of them (no shared memory of their
// own, so no resident block less for any shape).
template <typename Y>
__device__ __forceinline__ float* dora_col(Y* sy, int f) {
    static_assert(16 / sizeof(float) * SG_BM == 2 * SG_BO, "the row pads hold g and bias");
    return (float*)(sy + (f >> 2) * y_pitch<Y>() + SG_BO) + (f & 3);
}

// Stage g[o_base + c] and bias[o_base + c] (zeros without a bias) for the
// item's columns c < len at dora_col(sy, c) and dora_col(sy, SG_BO + c), by
// cp.async in the caller's group, so the epilogue reads them from shared
// memory instead of waiting on 2 x 32 dependent global loads per thread
// after the MMAs. Columns past `len` are left as they were (the epilogue
// uses none of them).
template <typename Y>
__device__ __forceinline__ void stage_dora_cols(Y* sy, const float* g, u64 bias, int o_base, int len) {
    static_assert(SG_BO == SG_THREADS, "a column a thread");
    const int c = threadIdx.x;
    if (c < len) {
        cp_async4(dora_col(sy, c), g + o_base + c);
        if (bias != 0ull)
            cp_async4(dora_col(sy, SG_BO + c), (const float*)bias + o_base + c);
        else
            *dora_col(sy, SG_BO + c) = 0.f;
    }
}

// Stage B rows o_base.. (SG_BO of them, `out` real) into sB (pitch bp):
// cp.async where a 16-byte piece is whole and aligned, columns past `rank`
// and rows past `out` zeroed. The caller commits and waits.
__device__ __forceinline__ void stage_b_rows(bf16_t* sB, int bp, const bf16_t* B, int stride, int o_base, int out,
                                             int rank) {
    const int tid = threadIdx.x;
    const int rk16 = (rank + 15) & ~15;
    const bool vec_b = (stride % 8 == 0) && aligned16(B);
    const int full8 = vec_b ? rank / 8 : 0;
    const int cpr = rk16 / 8;  // 16-byte pieces per staged B row
    if (full8 == cpr && SG_THREADS % cpr == 0 && o_base + SG_BO <= out) {
        // Every piece whole (the common case): a thread's pieces sit at
        // constant steps, so no piece is checked or divided out.
        const int c = tid % cpr;
        const int r0 = tid / cpr;
        const int step = SG_THREADS / cpr;  // rows per pass
        const bf16_t* src = B + (u64)(o_base + r0) * stride + c * 8;
        bf16_t* dst = sB + r0 * bp + c * 8;
#pragma unroll 4
        for (int r = r0; r < SG_BO; r += step, src += (u64)step * stride, dst += step * bp) cp_async16(dst, src, true);
    } else {
        for (int v = tid; v < SG_BO * cpr; v += SG_THREADS) {
            const int r = v / cpr;
            const int c = v - r * cpr;
            const int n = o_base + r;
            bf16_t* dst = sB + r * bp + c * 8;
            const bf16_t* src = B + (u64)n * stride + c * 8;
            if (n < out && c < full8) {
                cp_async16(dst, src, true);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) dst[j] = (n < out && c * 8 + j < rank) ? src[j] : (bf16_t)0;
            }
        }
    }
}

// acc[nt] += the delta of a warp's 16 rows x 8-wide tile nt of the item's outputs: t (sT, f32, scaled)
// split into a bf16 high part and the bf16 rounding of the rest, times the staged B rows (sB). Row i
// of tile j is output j * 8 + i.
__device__ __forceinline__ void expand_tile_mma(float (&acc)[16][4], const bf16_t* sB, int bp, const float* sT,
                                                int tpch, int rk16, int warp, int lane) {
    const int g = lane >> 2;
    const int t4 = lane & 3;
    // ldmatrix rows: lanes 0-15 give tile 2 * np, lanes 16-31 the next one.
    const bf16_t* b_lane = sB + ((lane >> 4) * 8 + (lane & 7)) * bp + ((lane >> 3) & 1) * 8;
    for (int kst = 0; kst < rk16 / 16; ++kst) {
        // t in mma A-register order: (g, k), (g + 8, k), (g, k + 8), (g + 8, k + 8).
        u32 a_hi[4];
        u32 a_lo[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int r = warp * 16 + g + (q & 1) * 8;
            const int k = kst * 16 + 2 * t4 + (q >> 1) * 8;
            const float2 t = *(const float2*)(sT + r * tpch + k);
            a_hi[q] = pack_bf2_rn(t.x, t.y);
            a_lo[q] = bf2_rest(t.x, t.y, a_hi[q]);
        }
#pragma unroll
        for (int np = 0; np < 8; ++np) {
            u32 b[4];
            ldsm_x4(b, b_lane + np * 16 * bp + kst * 16);
            mma_k16(acc[2 * np], a_hi, b[0], b[1]);
            mma_k16(acc[2 * np], a_lo, b[0], b[1]);
            mma_k16(acc[2 * np + 1], a_hi, b[2], b[3]);
            mma_k16(acc[2 * np + 1], a_lo, b[2], b[3]);
        }
    }
}

// The wgmma expand's B rows: SG_BO rows of rk16 columns as K atoms of 64
// columns ([atoms][SG_BO][SG_BK], 16 KB each, swizzled like the shrink's
// tiles) at shared address `sb`; pieces past `rank` and rows past `out` are
// zero. Columns past rk16 are never read. The caller commits and waits.
__device__ __forceinline__ void stage_b_rows_wg(unsigned char* sB, const bf16_t* B, int stride, int o_base, int out,
                                                int rank) {
    const int tid = threadIdx.x;
    const int rk16 = (rank + 15) & ~15;
    const bool vec_b = (stride % 8 == 0) && aligned16(B);
    const int full8 = vec_b ? rank / 8 : 0;
    const int cpr = rk16 / 8;  // 16-byte pieces per row
    for (int v = tid; v < SG_BO * cpr; v += SG_THREADS) {
        const int r = v / cpr;
        const int c = v - r * cpr;
        const int n = o_base + r;
        unsigned char* dst = sB + (c / 8) * (SG_BO * SG_BK * 2) + swz128(r, c % 8);
        const bf16_t* src = B + (u64)n * stride + c * 8;
        if (n < out && c < full8) {
            cp_async16(dst, src, true);
        } else {
            bf16_t* d = (bf16_t*)dst;
#pragma unroll
            for (int j = 0; j < 8; ++j) d[j] = (n < out && c * 8 + j < rank) ? src[j] : (bf16_t)0;
        }
    }
}

// The wgmma expand's t: a bf16 high part and the bf16 rounding of the rest,
// each [atoms][SG_BM][SG_BK] swizzled like B, written once per tile by the
// t sum. Stores t[r][k..k + 3] (k a multiple of 4) into both.
__device__ __forceinline__ void store_t4_wg(unsigned char* t_hi, unsigned char* t_lo, int r, int k, float4 v) {
    const u32 off = (k / SG_BK) * (SG_BM * SG_BK * 2) + swz128(r, (k % SG_BK) / 8) + (k % 8) * 2;
    const u32 h01 = pack_bf2_rn(v.x, v.y);
    const u32 h23 = pack_bf2_rn(v.z, v.w);
    *(uint2*)(t_hi + off) = make_uint2(h01, h23);
    *(uint2*)(t_lo + off) = make_uint2(bf2_rest(v.x, v.y, h01), bf2_rest(v.z, v.w, h23));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// acc += STEPS K steps of t's high and low parts (atoms at shared addresses
// th, tl) times the B atom at `b`, one fence and one wait for them all.
template <int STEPS>
__device__ __forceinline__ void expand_atom_wg(float (&acc)[16][4], u32 th, u32 tl, u32 b) {
    // Orders the accumulators' last writes (y loaded into them) before the MMAs read them.
    wg_fence();
#pragma unroll
    for (int j = 0; j < STEPS; ++j) {
        wgmma_k16<SG_BO>(acc, wg_desc(th + j * 32), wg_desc(b + j * 32));
        wgmma_k16<SG_BO>(acc, wg_desc(tl + j * 32), wg_desc(b + j * 32));
    }
    wg_commit();
    wg_wait_all();
}
#endif

// expand_tile_mma on warpgroup MMAs: acc += t (its high and low parts at
// shared addresses th, tl, from store_t4_wg) times the B rows staged by
// stage_b_rows_wg at `sb`, over rk16 columns.
__device__ __forceinline__ void expand_tile_wg(float (&acc)[16][4], u32 sb, u32 th, u32 tl, int rk16) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ATOM_STEPS = SG_BK / 16;
    for (int k0 = 0; k0 < rk16 / 16; k0 += ATOM_STEPS) {
        const int atom = k0 / ATOM_STEPS;
        const u32 b = sb + atom * (SG_BO * SG_BK * 2);
        const u32 h = th + atom * (SG_BM * SG_BK * 2);
        const u32 l = tl + atom * (SG_BM * SG_BK * 2);
        // Each count of steps straight-line: MMAs issued under a condition made the compiler wait after each.
        switch (min(ATOM_STEPS, rk16 / 16 - k0)) {
            case 1: expand_atom_wg<1>(acc, h, l, b); break;
            case 2: expand_atom_wg<2>(acc, h, l, b); break;
            case 3: expand_atom_wg<3>(acc, h, l, b); break;
            default: expand_atom_wg<4>(acc, h, l, b); break;
        }
    }
#else
    // Launched only on sm_90a (the host checks); other targets compile a stub.
    (void)acc, (void)sb, (void)th, (void)tl, (void)rk16;
    __trap();
#endif
}

// MMA_FIRST (wgmma only): the MMAs start from zero as soon as B lands and y
// is added after it lands, instead of starting from y (prefill r64 in a
// graph 83.5 -> 82.0 µs; at ranks 16 and 32 the extra barrier costs
// 0.3-0.5, so the host picks it past rank stride 32; NOTES.md v27).
template <typename Y, bool WG, bool MMA_FIRST>
__device__ __forceinline__ void sgmv_expand_body(const SgmvParams& p) {
    static_assert(WG || !MMA_FIRST, "the MMAs before y need the wgmma expand");
    __shared__ TileInfo s_tile;
    __shared__ PairEntry s_entry;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    int it0;
    int it1;
    block_items(p, p.n_targets * p.out_tiles, &it0, &it1);
    const int stride = p.rank_stride;
    const int bp = ((stride + 15) & ~15) + 8;
    const int tpch = ((stride + 15) & ~15) + 4;
    const int yp = y_pitch<Y>();
    // wgmma: B rows as swizzled K atoms from the first 1024-byte boundary (the host adds 1 KB).
    // wgmma: then t's high and low parts as swizzled atoms in place of the f32 sT.
    unsigned char* const b_base = WG ? dyn + (((smem_u32(dyn) + 1023) & ~1023u) - smem_u32(dyn)) : dyn;
    const int atoms = (stride + SG_BK - 1) / SG_BK;
    const size_t b_bytes = WG ? (size_t)atoms * SG_BO * SG_BK * 2 : (size_t)SG_BO * bp * 2;
    const size_t t_bytes = WG ? (size_t)2 * atoms * SG_BM * SG_BK * 2 : (size_t)SG_BM * tpch * 4;
    bf16_t* sB = (bf16_t*)b_base;
    float* sT = (float*)(b_base + b_bytes);
    unsigned char* const t_hi = b_base + b_bytes;
    unsigned char* const t_lo = t_hi + t_bytes / 2;
    Y* sY0 = (Y*)(b_base + b_bytes + t_bytes);
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int ra = warp * 16 + g;
    Y* Yp = (Y*)p.y;
    const int ys = p.y_stride;
    const bool vec_y_base = ((int)sizeof(Y) * ys % 16 == 0) && aligned16(Yp);

    int cur_tile = -1;
    int cur_ti = -1;
    int buf = 0;
    bool staged = false;  // this item's y tile was requested by the previous item
    ExpandItem item = expand_item(p, it0);
    for (int it = it0; it < it1; ++it, item = next_expand_item(p, item)) {
        const LoraTarget tg = p.targets[item.ti];
        const int out = tg.out_dim;
        if (item.o_base >= out) {
            staged = false;
            continue;  // uniform over the block
        }
        __syncthreads();  // the previous item no longer reads sB / sT / s_tile, and its y tile is stored
        const bool new_tile = item.tile != cur_tile || item.ti != cur_ti;
        if (!begin_tile(p, tg, item, new_tile, warp, &s_tile, &s_entry)) {
            cur_tile = item.tile;
            cur_ti = item.ti;
            staged = false;
            continue;
        }
        const PairEntry en = s_entry;
        const int rank = (int)en.rank;
        const int row0 = s_tile.row0;
        const int rows = s_tile.rows;
        const bf16_t* B = (const bf16_t*)en.b;
        const int rk16 = (rank + 15) & ~15;
        const int o_base = item.o_base;
        const int coff = tg.y_col_off;
        const int len = min(SG_BO, out - o_base);
        const bool vec_y = vec_y_base && ((int)sizeof(Y) * coff % 16 == 0);
        Y* sY = sY0 + (size_t)buf * SG_BM * yp;
        Y* gY = Yp + (u64)row0 * ys + coff + o_base;
        const float* dg = dora_scale_of(tg, s_tile.entry);  // the DoRA epilogue's rescale, or null (uniform)

        // ---- group A: this item's y tile (unless already requested), its B rows and, for a DoRA
        // entry, its g and bias columns; MMA_FIRST: B's rows (from L2) a group of their own before
        // y's (from DRAM).
        if constexpr (MMA_FIRST) {
            stage_b_rows_wg(b_base, B, stride, o_base, out, rank);
            cp_async_commit();
            if (!staged) move_y_tile<Y>(sY, gY, ys, rows, len, vec_y, true);
        } else {
            if (!staged) move_y_tile<Y>(sY, gY, ys, rows, len, vec_y, true);
            if constexpr (WG)
                stage_b_rows_wg(b_base, B, stride, o_base, out, rank);
            else
                stage_b_rows(sB, bp, B, stride, o_base, out, rank);
        }
        if (dg != nullptr) stage_dora_cols<Y>(sY, dg, tg.bias, o_base, len);
        cp_async_commit();

        // ---- group B: the next item's y tile when it is the same tile (the
        // common case) and there are two y buffers; its B rows towards L2.
        staged = false;
        if (it + 1 < it1) {
            const ExpandItem nx = next_expand_item(p, item);
            if (nx.tile == item.tile && nx.ti == item.ti && nx.o_base < out) {
                const int nlen = min(SG_BO, out - nx.o_base);
                if (p.y_buffers > 1) {
                    move_y_tile<Y>(sY0 + (size_t)(buf ^ 1) * SG_BM * yp, Yp + (u64)row0 * ys + coff + nx.o_base, ys,
                                   rows, nlen, vec_y, true);
                    staged = true;
                }
                if (tid == SG_THREADS - 1) prefetch_l2(B + (u64)nx.o_base * stride, (u64)nlen * stride * 2);
            }
        }
        cp_async_commit();

        // ---- t of a new tile: sum the K-split partials of its rows, scale, zero past rank.
        if (new_tile) {
            grid_dependency_wait();  // a dependent launch: the shrink's partials are visible past this
            const float* W = (const float*)p.ws + (u64)item.ti * p.k_splits * p.ws_rows * p.ws_rank_pad;
            const u64 split_stride = (u64)p.ws_rows * p.ws_rank_pad;
            const int q4 = rk16 / 4;
            const float scale = en.scale;
            // Each thread sums T_PAIR (row, 4-rank) pieces per pass, every split of all of them loaded
            // unconditionally before the first add: the compiler issues the loads together, one L2
            // round trip per pass (loads guarded one by one were issued one after another, each
            // waiting for the last). Pieces out of range load the first partial and are not added;
            // splits past k_splits load split 0 again and are not added.
            constexpr int T_PAIR = 2;
            for (int v0 = tid; v0 < SG_BM * q4; v0 += T_PAIR * SG_THREADS) {
                float4 w[T_PAIR][SG_MAX_K_SPLITS];
                int rr[T_PAIR];
                int kk[T_PAIR];
                bool in_tile[T_PAIR];  // a piece of this tile's sT
                bool ok[T_PAIR];       // ... whose row and rank have partials
#pragma unroll
                for (int u = 0; u < T_PAIR; ++u) {
                    const int v = v0 + u * SG_THREADS;
                    rr[u] = v / q4;
                    kk[u] = (v - rr[u] * q4) * 4;
                    in_tile[u] = v < SG_BM * q4;
                    ok[u] = in_tile[u] && rr[u] < rows && kk[u] < rank;
                    const float* q = W + (ok[u] ? (u64)(row0 + rr[u]) * p.ws_rank_pad + kk[u] : 0);
#pragma unroll
                    for (int ks = 0; ks < SG_MAX_K_SPLITS; ++ks)
                        w[u][ks] = *(const float4*)(q + (ks < p.k_splits ? ks : 0) * split_stride);
                }
#pragma unroll
                for (int u = 0; u < T_PAIR; ++u) {
                    const int r = rr[u];
                    const int k = kk[u];
                    if (!in_tile[u]) continue;
                    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (ok[u]) {
#pragma unroll
                        for (int ks = 0; ks < SG_MAX_K_SPLITS; ++ks) {
                            if (ks < p.k_splits) {
                                sum.x += w[u][ks].x;
                                sum.y += w[u][ks].y;
                                sum.z += w[u][ks].z;
                                sum.w += w[u][ks].w;
                            }
                        }
                    }
                    const float4 v = make_float4(k < rank ? sum.x * scale : 0.f, k + 1 < rank ? sum.y * scale : 0.f,
                                                 k + 2 < rank ? sum.z * scale : 0.f, k + 3 < rank ? sum.w * scale : 0.f);
                    if constexpr (WG) {
                        store_t4_wg(t_hi, t_lo, r, k, v);
                    } else {
                        float* d = sT + r * tpch + k;
                        d[0] = v.x;
                        d[1] = v.y;
                        d[2] = v.z;
                        d[3] = v.w;
                    }
                }
            }
            cur_tile = item.tile;
            cur_ti = item.ti;
        }
        float acc[16][4];
        if constexpr (MMA_FIRST) {
            cp_async_wait<2>();  // B landed; y and the next tile may still be in flight
            fence_async_smem();
            __syncthreads();
            // The delta from zero while y is in flight, then y added in f32: y is rounded once.
            zero_acc(acc);
            expand_tile_wg(acc, smem_u32(b_base), smem_u32(t_hi), smem_u32(t_lo), rk16);
            cp_async_wait<1>();  // y landed
            __syncthreads();
#pragma unroll
            for (int nt = 0; nt < 16; ++nt) {
                const Y* ya = sY + ra * yp + nt * 8 + 2 * t4;
                float y0, y1, y2, y3;
                y_load2(ya, y0, y1);
                y_load2(ya + 8 * yp, y2, y3);
                acc[nt][0] += y0;
                acc[nt][1] += y1;
                acc[nt][2] += y2;
                acc[nt][3] += y3;
            }
        } else {
            cp_async_wait<1>();  // group A landed; the next tile may still be in flight
            if constexpr (WG) fence_async_smem();
            __syncthreads();
            // The MMAs' C starts as this item's y, so the delta is added in f32 inside them (no
            // zeroed accumulators, no separate add) and y is rounded once.
#pragma unroll
            for (int nt = 0; nt < 16; ++nt) {
                const Y* ya = sY + ra * yp + nt * 8 + 2 * t4;
                y_load2(ya, acc[nt][0], acc[nt][1]);
                y_load2(ya + 8 * yp, acc[nt][2], acc[nt][3]);
            }
            if constexpr (WG)
                expand_tile_wg(acc, smem_u32(b_base), smem_u32(t_hi), smem_u32(t_lo), rk16);
            else
                expand_tile_mma(acc, sB, bp, sT, tpch, rk16, warp, lane);
        }

        // ---- the DoRA epilogue (common.cuh) where the tile's entry has a rescale
        // at the target, on g and bias staged in group A (landed and visible
        // past the barrier above): acc[nt][0, 2] are column nt * 8 + 2 t4 of
        // the tile (rows ra, ra + 8), acc[nt][1, 3] the next; columns past
        // `len` are neither staged nor stored.
        if (dg != nullptr) {
#pragma unroll
            for (int nt = 0; nt < 16; ++nt) {
                const int c0 = nt * 8 + 2 * t4;
                if (c0 < len) {
                    const float2 gv = *(const float2*)dora_col(sY, c0);
                    const float2 bv = *(const float2*)dora_col(sY, SG_BO + c0);
                    acc[nt][0] = dora_rescale(acc[nt][0], gv.x, bv.x);
                    acc[nt][2] = dora_rescale(acc[nt][2], gv.x, bv.x);
                    if (c0 + 1 < len) {
                        acc[nt][1] = dora_rescale(acc[nt][1], gv.y, bv.y);
                        acc[nt][3] = dora_rescale(acc[nt][3], gv.y, bv.y);
                    }
                }
            }
        }

        // ---- the summed tile back to shared memory, then out in 16-byte pieces.
        // Columns past `len` and rows past `rows` hold nothing and are never stored.
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
            Y* ya = sY + ra * yp + nt * 8 + 2 * t4;
            y_store2(ya, acc[nt][0], acc[nt][1]);
            y_store2(ya + 8 * yp, acc[nt][2], acc[nt][3]);
        }
        __syncthreads();
        move_y_tile<Y>(sY, gY, ys, rows, len, vec_y, false);
        if (staged) buf ^= 1;
    }
    cp_async_wait<0>();
}

extern "C" __global__ void __launch_bounds__(SG_THREADS, 4) sgmv_expand_bf16(const SgmvParams p) {
    sgmv_expand_body<bf16_t, false, false>(p);
}
extern "C" __global__ void __launch_bounds__(SG_THREADS, 4) sgmv_expand_f32(const SgmvParams p) {
    sgmv_expand_body<float, false, false>(p);
}
// On warpgroup MMAs (sm_90a), starting from y or before it.
extern "C" __global__ void __launch_bounds__(SG_THREADS, 4) sgmv_expand_wg_bf16(const SgmvParams p) {
    sgmv_expand_body<bf16_t, true, false>(p);
}
extern "C" __global__ void __launch_bounds__(SG_THREADS, 4) sgmv_expand_wg_f32(const SgmvParams p) {
    sgmv_expand_body<float, true, false>(p);
}
extern "C" __global__ void __launch_bounds__(SG_THREADS, 4) sgmv_expand_wgf_bf16(const SgmvParams p) {
    sgmv_expand_body<bf16_t, true, true>(p);
}
extern "C" __global__ void __launch_bounds__(SG_THREADS, 4) sgmv_expand_wgf_f32(const SgmvParams p) {
    sgmv_expand_body<float, true, true>(p);
}
