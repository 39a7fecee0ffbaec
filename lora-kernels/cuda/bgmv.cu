// Row-indexed LoRA apply (decode, mixed slots), the fused, list and
// two-phase forms (the entry-clustered form is bgmv_entry.cu, compiled after
// this file in the same module): every row of x names a
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
// launch. All of a block's A, B, x and y bytes are requested (cp.async) in
// one batch as soon as the entry is known. The scalar clusters of 2 run
// blocks of 16 warps: for a one-row item, warps 0-7 request A and x and
// shrink while warps 8-15 request B and y; otherwise all 16 share each phase.
//
// Cluster sum: by default (p.push, small rank strides) each block pushes its
// partial rank vectors into every peer's receive buffer with st.async, whose
// bytes complete on the peer's mbarrier, and waits on its own mbarrier: one
// one-way hop per item, no cluster barrier and so no GPU-scope release
// fence. Otherwise a cluster barrier, loads from the peers' shared memory,
// and a second barrier before the partials are overwritten.
//
// Overlap (p.overlap): launched as a programmatic dependent of the stream's
// previous kernel, a scanning block reads idx, the table and its first
// item's B and A before griddepcontrol.wait and x and y only after it, so
// the chain idx -> entry -> weights runs under that kernel's tail; bgmv_list
// and bgmv2_shrink_rows (below) read idx and the table before their wait and
// write the scratch after it. The caller guarantees the previous kernel
// writes neither idx, the tables nor the adapters.
//
// Items: every block of the scanning kernels lists its window's items itself
// (scan_window, then load_item per item). The _list kernels read them from a
// list bgmv_list (a first, one-block-per-window launch) wrote into the
// backend's scratch; they run on tensor cores only, and are picked for
// batches whose items hold many rows.
// Row-mapped (the 16-warp clusters of 2 with a cluster for every row of the
// window): cluster q serves row q alone, an item of one row named by row q's
// index, so its A, x, y and B are requested as soon as the entry is known and
// no window is scanned (rows of one entry read its A and B again, from L2).

// BGMV_THREADS, BGMV_G, BGMV_MAX_RANK and BGMV_WIN_MAX come from the host's
// prelude (`cuda_rt::PRELUDE`).
#define BGMV_WARPS (BGMV_THREADS / 32)

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
    int k_chunk;
    int lo_max;
    int off_y;
    int off_t;
    int off_a;
    int off_x;
    u64 list;         // the launch's item lists (bgmv_list writes them), or 0: every block scans its window
    int list_stride;  // bytes per (window, target) list: a 64-byte header, then `window` ItemRows
    int off_r;        // push: the cluster sum's receive slots in the dynamic shared memory
    int push;         // clusters sum their partial rank vectors by pushing them (st.async), not by barrier and pull
    int overlap;      // a programmatic dependent: idx, tables and adapters read before griddepcontrol.wait, x and y after
    int b_pitch;      // staged B row pitch, elements: the stride rounded to 8, plus 8 (no bank
                      // conflicts) where shared memory allows
    int pad;
    LoraTarget targets[MAX_TARGETS];
};
static_assert(sizeof(BgmvParams) == 288 && sizeof(BgmvParams) - sizeof(LoraTarget) * MAX_TARGETS == 128, "mirrors bgmv.rs");

// Copy n bf16 from global to shared and zero the tail up to n_pad (a
// multiple of 8): 16-byte cp.async when `vec` (both ends 16-byte aligned,
// n a multiple of 8), else plain loads. `lane_id` of `lanes` threads share it.
// Not inlined: the kernel runs once per block from a cold instruction cache,
// so code size is time.
__device__ __noinline__ void stage_row(bf16_t* dst, const bf16_t* src, int n, int n_pad, bool vec, int lane_id,
                                       int lanes) {
    if (vec) {
#pragma unroll 1
        for (int c = lane_id; c < (n >> 3); c += lanes) cp_async16(dst + c * 8, src + c * 8);
    } else {
#pragma unroll 1
        for (int c = lane_id; c < n; c += lanes) dst[c] = src[c];
    }
#pragma unroll 1
    for (int c = n + lane_id; c < n_pad; c += lanes) dst[c] = 0;
}

// The row window of one launch in shared memory (for a block of NT
// threads): each row's checked entry (-1: none) and the rows that lead an item.
template <int NT>
struct WindowScan {
    __align__(16) int idx[BGMV_WIN_MAX];
    int items[BGMV_WIN_MAX];
    int scan[NT / 32 + 1];
};

// One item: its rows (absolute row numbers) and its checked table entry.
// Also the record of the item list in the scratch (64 bytes, copied as 16 words).
struct ItemRows {
    int rows[BGMV_G];
    int nrows;
    PairEntry entry;
};
static_assert(sizeof(ItemRows) == 64, "item list record");

// The window row index this thread reads first (row row0 + tid; -1 past
// the window), read by the caller before its other setup so the load is in
// flight meanwhile (the first dependent round trip of every scanning kernel).
__device__ __forceinline__ int first_index(const int* idx, int row0, int nwin) {
    return (int)threadIdx.x < nwin ? idx[row0 + (int)threadIdx.x] : -1;
}


// Every thread of the block: read the window's entry indices (an index past
// the table raises a fault when `report` and counts as no delta), then list
// the rows that lead an item. Row j leads an item when its occurrence number
// among the window's rows of the same entry is a multiple of G. `first` is
// first_index's value. With `drain`, the caller's cp.async copies are
// complete (and visible to the block) on return. Returns the item count
// (the same in every thread).
//
// Windows of up to NT rows (one row per thread of a block of NT): a row's
// occurrence number is the count of lower lanes holding its entry
// (__match_any_sync) plus the rows of the lower warps holding it, and the
// leads are numbered by a ballot per warp and the warps' counts: three
// barriers (one for up to 32 rows). Longer windows: rows 2t and 2t + 1 are
// counted by thread t and the leads numbered by a block scan.
template <int NT>
__device__ __forceinline__ int scan_window(const int* idx, int row0, int nwin, int n_entries, u64 fault, bool report,
                                           WindowScan<NT>* w, int first, bool drain) {
    const int tid = threadIdx.x;
    if (nwin <= NT) {
        const int lane = tid & 31;
        const int warp = tid >> 5;
        const bool one_warp = nwin <= 32;  // uniform: only warp 0 holds rows
        int e = -1;
        if (tid < nwin) {
            e = checked_index(first, n_entries, fault, report);
            w->idx[tid] = e;
        }
        const unsigned below = (1u << lane) - 1u;
        int occ = __popc(__match_any_sync(0xffffffffu, e) & below);
        if (!one_warp) {
            __syncthreads();  // every row's entry in w->idx
            // Rows [0, 32 warp) all lie in the window when this warp holds one.
            if (e >= 0) {
#pragma unroll 4
                for (int i = 0; i < warp * 32; i += 4) {
                    const int4 v = *(const int4*)&w->idx[i];
                    occ += (v.x == e) + (v.y == e) + (v.z == e) + (v.w == e);
                }
            }
        }
        const bool lead = e >= 0 && occ % BGMV_G == 0;
        const unsigned leads = __ballot_sync(0xffffffffu, lead);
        int before = 0;
        int total = __popc(leads);
        if (!one_warp) {
            if (lane == 0) w->scan[warp] = total;
            __syncthreads();
            total = 0;
#pragma unroll
            for (int v = 0; v < NT / 32; ++v) {
                const int c = w->scan[v];
                before += v < warp ? c : 0;
                total += c;
            }
        } else if (tid == 0) {
            w->scan[0] = total;
        }
        if (lead) w->items[before + __popc(leads & below)] = tid;
        if (drain) cp_async_wait<0>();
        __syncthreads();
        return one_warp ? w->scan[0] : total;
    }
#pragma unroll 1
    for (int j = tid; j < nwin; j += NT) {
        w->idx[j] = checked_index(j == tid ? first : idx[row0 + j], n_entries, fault, report);
    }
    __syncthreads();
    const int j0 = 2 * tid;
    const int e0 = j0 < nwin ? w->idx[j0] : -1;
    const int e1 = j0 + 1 < nwin ? w->idx[j0 + 1] : -1;
    int occ0 = 0;
    int occ1 = e0 == e1;
    if (e0 >= 0 || e1 >= 0) {
        int i = 0;
#pragma unroll 4
        for (; i + 4 <= j0; i += 4) {
            const int4 v = *(const int4*)&w->idx[i];
            occ0 += (v.x == e0) + (v.y == e0) + (v.z == e0) + (v.w == e0);
            occ1 += (v.x == e1) + (v.y == e1) + (v.z == e1) + (v.w == e1);
        }
#pragma unroll 1
        for (; i < j0; ++i) {
            occ0 += w->idx[i] == e0;
            occ1 += w->idx[i] == e1;
        }
    }
    const bool lead0 = e0 >= 0 && occ0 % BGMV_G == 0;
    const bool lead1 = e1 >= 0 && occ1 % BGMV_G == 0;
    int n_items;
    int pos = block_exclusive_scan<NT>((int)lead0 + (int)lead1, w->scan, &n_items);
    if (lead0) w->items[pos++] = j0;
    if (lead1) w->items[pos] = j0 + 1;
    if (drain) cp_async_wait<0>();
    __syncthreads();
    return n_items;
}


// One warp: the rows (up to G) of the item led by window row `lead`, and
// its table entry, checked against the stride (a bad entry raises a fault
// when `report` and counts as rank 0).
__device__ __forceinline__ void load_item(const int* win_idx, int lead, int nwin, int row0, const PairEntry* table,
                                          int stride, u64 fault, bool report, ItemRows* out) {
    const int lane = threadIdx.x & 31;
    const int e = win_idx[lead];
    // The entry's load is in flight while the rows are gathered.
    PairEntry en = {0ull, 0ull, 0.f, 0u};
    if (lane == 0) en = table[e];
    int found = 0;
    for (int base = lead; base < nwin && found < BGMV_G; base += 32) {
        const int j = base + lane;
        const bool m = j < nwin && win_idx[j] == e;
        const unsigned bal = __ballot_sync(0xffffffffu, m);
        const int at = found + __popc(bal & ((1u << lane) - 1u));
        if (m && at < BGMV_G) out->rows[at] = row0 + j;
        found += __popc(bal);
    }
    if (lane == 0) {
        out->nrows = min(found, BGMV_G);
        if (bad_entry(en, stride)) {
            if (report) raise_fault(fault, FAULT_BAD_RANK);
            en.rank = 0;
        }
        out->entry = en;
    }
}

// Lane 0 of a warp: row `row` as an item of its own (the two-phase row
// form), with its checked entry: an index past the table raises
// FAULT_BAD_INDEX and a bad entry FAULT_BAD_RANK when `report`, and either
// leaves the row without a delta (nrows 0 or rank 0), as the scan and
// load_item do.
__device__ __forceinline__ void load_row_item(const int* idx, int row, int n_entries, const PairEntry* table, int stride,
                                              u64 fault, bool report, ItemRows* out) {
    if ((threadIdx.x & 31) != 0) return;
    PairEntry en;
    const int e = checked_entry(idx[row], n_entries, table, stride, fault, report, &en);
    out->rows[0] = row;
    out->nrows = e >= 0 ? 1 : 0;
    out->entry = en;
}

// Lanes 0-15 of a warp: item `i` of a list bgmv_list wrote (64 bytes) into
// *out, through L2 (.cg): nothing of a previous launch's list may come from L1.
__device__ __forceinline__ void copy_list_item(const ItemRows* list, int i, ItemRows* out, int lane) {
    if (lane < 16) ((int*)out)[lane] = __ldcg((const int*)(list + i) + lane);
}

// Dynamic shared memory layout, in this order (each region 16-byte aligned):
//   sB   [lo_max][b_pitch] bf16      this block's B rows, zero past rank (padded by 8 columns,
//                                    no bank conflicts, except in clusters of 2)
//   sY   [G][lo_max] Y                this block's y values of the item's rows
//   sTp  [G][tp] f32                  partial rank vectors (read by the cluster peers)
//   sT   [G][tp] f32                  summed, scaled rank vectors
//   sRed [warps][128] f32             per-warp partial tiles of the TC shrink
//   sA   [stages][stride16][kch + 8] bf16   A slice chunk(s)
//   sX   [stages][G][kch + 8] bf16          x slice chunk(s)
// tp = stride8 = stride rounded up to 8; lo_max is a multiple of 16 and the
// A stage holds stride rounded up to 16 rows, so whole 16-row tensor-core
// tiles stay inside the allocation (rows past the rank or the block's outputs
// hold stale values that only reach outputs nobody writes). A and x rows are
// 8 columns longer than a chunk: ldmatrix rows then fall in distinct banks.
// Every staged row is zero-padded to a multiple of 8 columns, so the
// arithmetic below has one (16-byte) path. The host sizes it and passes the
// offsets in.
//
// TC: shrink and expand on tensor cores (mma m16n8k8 bf16, f32 accumulate):
// the shrink is rank rows x the item's 8 rows x K, the expand 16 outputs x
// the item's rows x rank, with t split into bf16 hi + lo so it keeps about 16
// bits. Worth it when items hold several rows; without TC each (row, rank)
// pair is one warp reduction and each (output, row) pair a scalar dot.
//
// LIST: the items come from the list bgmv_list wrote into the scratch (the
// kernel is launched as its programmatic dependent) instead of every block
// scanning the window and gathering its item's rows and entry: the block
// waits for the list, then reads the item count and its first item in one
// round trip. Faults are raised by bgmv_list then, never here.

template <typename Y, int C, bool TC, bool LIST, int NT, bool DORA>
__device__ __forceinline__ void bgmv_body(const BgmvParams& p) {
    constexpr int NW = NT / 32;
    static_assert(NT == BGMV_THREADS || (NT == 2 * BGMV_THREADS && !TC), "512 threads: the scalar kernels only");
    static_assert(!LIST || TC, "the item list serves the tensor-core kernels only");
    extern __shared__ __align__(16) unsigned char dyn[];
    __shared__ WindowScan<NT> s_win;
    __shared__ ItemRows s_item;
    __shared__ int s_nitems;
    __shared__ __align__(16) PairEntry s_table[BGMV_TABLE_SMEM];
    __shared__ __align__(8) u64 s_mbar[2];  // push: one per receive buffer

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
    // Row-mapped: the 16-warp scanning kernels with a cluster for every row
    // of the window. Cluster q serves row q alone, as an item of one row
    // (rows of one entry are not grouped: the clusters are there anyway, and
    // an entry's A and B read again by another cluster come from L2), so
    // row q's index alone names the item and no window is scanned: warps 0-7
    // request A, x and y and warps 8-15 B as soon as the entry is known.
    // Uniform over the cluster.
    const bool row_mapped = !LIST && !TC && NT > BGMV_THREADS && p.overlap == 0 && nwin <= NT &&
                            p.clusters_per_window >= nwin;
    // The first round trip (the thread's window row, or row q) starts before the cluster and table setup.
    const int idx_first = LIST || row_mapped ? -1 : first_index((const int*)p.idx, row0, nwin);
    const int idx_mine = row_mapped && q < nwin ? ((const int*)p.idx)[row0 + q] : -1;
    // An item's entry depends on idx: a small table is copied whole into
    // shared memory while idx arrives (requested first, as it depends on
    // nothing); a larger one is pulled towards L2, so the entry load after
    // the row scan is not a cold round trip.
    const bool table_smem = !LIST && tg.n_entries <= BGMV_TABLE_SMEM && (tg.table & 7ull) == 0ull;
    if (table_smem) {
        const u64* src = (const u64*)tg.table;
        u64* dst = (u64*)s_table;
#pragma unroll 1
        for (int w = tid; w < tg.n_entries * 3; w += NT) cp_async8(dst + w, src + w);
        cp_async_commit();
    } else if (!LIST && tid == 0) {
        prefetch_l2((const void*)tg.table, (u64)min(tg.n_entries, 4096) * sizeof(PairEntry));
    }
    const PairEntry* table = table_smem ? s_table : (const PairEntry*)tg.table;
    // Index faults are raised by one block per (window, target); an item's
    // entry fault by rank 0 of split 0 of the one cluster that serves it.
    const bool report = crank == 0 && split == 0 && q == 0;
    const bool report_entry = crank == 0 && split == 0;
    // Uniform over the cluster (a launch parameter).
    const bool push = C > 1 && p.push != 0;
    if (push) {
        if (tid == 0) {
            mbar_init(&s_mbar[0], 1);
            mbar_init(&s_mbar[1], 1);
            fence_mbar_init();
        }
        // Waited for before the first push: every peer is running and its mbarriers are initialised.
        cluster_arrive_relaxed();
    }
    bool peers_ready = false;
    int pushes = 0;  // items summed by pushing so far (the same count in every block of the cluster)
    // Overlap: the previous kernel may still run until grid_dependency_wait;
    // it writes neither idx, the tables nor the adapters (the caller's
    // contract), only x and y may be its outputs. The next apply may start
    // as early. The LIST form is bgmv_list's dependent, which waited for that
    // kernel before writing the list: it only lets the next apply start.
    const bool overlap = p.overlap != 0;
    bool waited = LIST || !overlap;
    if (overlap) grid_launch_dependents();

    // The block's slices and shared-memory layout depend on no row index:
    // worked out while the first index (or the item list) is in flight.
    int k0, k1;
    split8(p.in_dim, C, crank, k0, k1);
    int s0, s1;
    split8(tg.out_dim, p.out_splits, split, s0, s1);
    int o0, o1;
    split8(s1 - s0, C, crank, o0, o1);
    o0 += s0;
    o1 += s0;
    const int lo = o1 - o0;

    const int in = p.in_dim;
    const int stride = p.rank_stride;
    const int bpitch = p.b_pitch;
    const int kch = p.k_chunk;
    const int kp = kch + 8;  // staged A / x row pitch
    const int arows = (stride + 15) & ~15;
    const int lo_max = p.lo_max;
    bf16_t* sB = (bf16_t*)dyn;
    Y* sY = (Y*)(dyn + p.off_y);
    bf16_t* sA = (bf16_t*)(dyn + p.off_a);
    bf16_t* sX = (bf16_t*)(dyn + p.off_x);
    const int tp = (stride + 7) & ~7;
    float* sTp = (float*)(dyn + p.off_t);
    float* sT = sTp + BGMV_G * tp;
    float* sRed = sT + BGMV_G * tp;  // [warps][128] f32: the TC shrink's per-warp tiles
    bf16_t* sTh = (bf16_t*)sT;       // TC: t as bf16 hi and lo, in place of the f32 sT
    const bf16_t* X = (const bf16_t*)p.x;
    Y* Yp = (Y*)p.y;
    const int ys = p.y_stride;
    const int coff = tg.y_col_off;
    const bool vec_y = ((int)sizeof(Y) * ys % 16 == 0) && ((int)sizeof(Y) * (coff + o0) % 16 == 0) && aligned16(Yp) &&
                       ((int)sizeof(Y) * lo % 16 == 0);
    const int n_chunks = (k1 - k0 + kch - 1) / kch;

    // Warps w0, w0 + nw, ... stage the rows [r0, r1) of chunk c of an item of
    // entry (A, rank): A rows k < rank, then x rows (s_item.rows[r - rank]).
    auto stage_chunk = [&](const bf16_t* A, int rank, bool vec_x, int c, int r0, int r1, int w0, int nw) {
        const int kc = k0 + c * kch;
        const int len = min(kch, k1 - kc);
        bf16_t* a = sA + (c & 1) * arows * kp;
        bf16_t* x = sX + (c & 1) * BGMV_G * kp;
#pragma unroll 1
        for (int r = r0 + w0; r < r1; r += nw) {
            const bool is_a = r < rank;
            bf16_t* dst = is_a ? a + r * kp : x + (r - rank) * kp;
            const bf16_t* src = is_a ? A + (u64)r * in + kc : X + (u64)s_item.rows[r - rank] * p.x_stride + kc;
            stage_row(dst, src, len, (len + 7) & ~7, vec_x, lane, 32);
        }
    };
    // Threads t0, t0 + nt, ... request the block's B rows of entry (B, rank):
    // `rank` useful columns; whole 8-column chunks are copied, the rest zeroed.
    auto request_b = [&](const bf16_t* B, int rank, bool vec_b, int t0, int nt) {
        const int cpr = ((rank + 7) & ~7) >> 3;
        const int full = vec_b ? (rank >> 3) : 0;
#pragma unroll 1
        for (int v = t0; v < lo * cpr; v += nt) {
            const int r = v / cpr;
            const int c = v - r * cpr;
            const bf16_t* src = B + (u64)(o0 + r) * stride + c * 8;
            bf16_t* dst = sB + r * bpitch + c * 8;
            if (c < full) {
                cp_async16(dst, src);
            } else {
#pragma unroll 1
                for (int j = 0; j < 8; ++j) dst[j] = c * 8 + j < rank ? src[j] : (bf16_t)0;
            }
        }
    };
    // Threads t0, t0 + nt, ... request the block's y values of item rows [g0, g1).
    auto request_y = [&](int g0, int g1, int t0, int nt) {
        const int y_per_row = vec_y ? lo * (int)sizeof(Y) / 16 : lo;
#pragma unroll 1
        for (int g = g0; g < g1; ++g) {
            const Y* src = Yp + (u64)s_item.rows[g] * ys + coff + o0;
#pragma unroll 1
            for (int c = t0; c < y_per_row; c += nt) {
                if (vec_y)
                    cp_async16((unsigned char*)(sY + g * lo_max) + c * 16, (const unsigned char*)src + c * 16);
                else
                    sY[g * lo_max + c] = src[c];
            }
        }
    };

    int n_items = 0;
    PairEntry row_entry = {0ull, 0ull, 0.f, 0u};  // row-mapped: row q's checked entry
    const ItemRows* list = nullptr;  // LIST: this (window, target)'s items, after the 64-byte header
    if (LIST) {
        list = (const ItemRows*)(p.list + (u64)(win * p.n_targets + (int)blockIdx.z) * p.list_stride) + 1;
        const u64* header = (const u64*)(list - 1);
        grid_dependency_wait();  // bgmv_list completed and its writes are visible
        if (warp == 0 && lane < 16) {
            // Header: the item count. L2 loads (.cg): nothing of a previous
            // launch's list may come from L1. Item q is read with the count
            // (q < clusters_per_window <= window: inside the list) and used
            // only when q < count.
            const u64 h = __ldcg(header);
            copy_list_item(list, q, &s_item, lane);
            if (lane == 0) s_nitems = (int)(u32)h;
        }
        __syncthreads();
        n_items = s_nitems;
    } else if (row_mapped) {
        // Row q's checked entry (an index past the table or a bad entry
        // raises its fault here, as the scan and load_item do). A row of no
        // entry ends its cluster.
        if (table_smem) cp_async_wait<0>();
        if (tid == 0) s_item.rows[0] = row0 + q;
        __syncthreads();  // the table and the row in shared memory
        const int e = checked_entry(idx_mine, tg.n_entries, table, stride, p.fault, report_entry && tid == 0, &row_entry);
        n_items = e >= 0 ? 1 : 0;
        // The row's requests: A, x and y by warps 0-7, then B by warps 8-15.
        if (row_entry.rank > 0 && lo > 0 && n_chunks == 1) {  // uniform over the block
            const int rank = (int)row_entry.rank;
            const bf16_t* A = (const bf16_t*)row_entry.a;
            const bf16_t* B = (const bf16_t*)row_entry.b;
            if (warp < BGMV_WARPS) {
                const bool vec_x = (in % 8 == 0) && (p.x_stride % 8 == 0) && aligned16(X) && aligned16(A);
                stage_chunk(A, rank, vec_x, 0, 0, rank + 1, warp, BGMV_WARPS);
                request_y(0, 1, tid, BGMV_THREADS);
                cp_async_commit();
                named_barrier_arrive(1, NT);
            } else {
                named_barrier_sync(1, NT);  // A, x and y requested
                request_b(B, rank, (stride % 8 == 0) && aligned16(B), tid - BGMV_THREADS, BGMV_THREADS);
                cp_async_commit();
            }
        }
    } else {
        // The table copy completes within the scan's last barrier.
        n_items = scan_window<NT>((const int*)p.idx, row0, nwin, tg.n_entries, p.fault, report, &s_win, idx_first,
                                  table_smem);
    }

    bool pending = false;
    // Row-mapped: one item at most, row q (in s_item.rows[0] and row_entry).
    const int it_first = row_mapped ? 0 : q;
    const int it_step = row_mapped ? 1 : p.clusters_per_window;

    for (int it = it_first; it < n_items; it += it_step) {
        // The previous item's shared state is no longer read (the first follows the scan's or list's barrier).
        if (it != it_first) __syncthreads();
        if (warp == 0 && !row_mapped) {
            if (LIST) {
                if (it != q) copy_list_item(list, it, &s_item, lane);
            } else {
                load_item(s_win.idx, s_win.items[it], nwin, row0, table, stride, p.fault, report_entry, &s_item);
            }
        }
        if (C > 1 && pending) {
            cluster_wait();  // every peer finished reading our sTp
            pending = false;
        }
        if (!row_mapped) __syncthreads();
        const PairEntry en = row_mapped ? row_entry : s_item.entry;
        // rank 0 skips the arithmetic but not the cluster barriers, so the
        // ranks of a cluster stay in step whatever the table holds.
        const int rank = (int)en.rank;
        const int nr = rank > 0 ? (row_mapped ? 1 : s_item.nrows) : 0;
        // The DoRA epilogue's rescale of the item's entry (the entry its first row names), or null.
        const float* dora_g = nullptr;
        if constexpr (DORA)
            dora_g = nr > 0 && tg.dora != 0ull ? dora_scale_of(tg, ((const int*)p.idx)[s_item.rows[0]]) : nullptr;
        const bf16_t* A = (const bf16_t*)en.a;
        const bf16_t* B = (const bf16_t*)en.b;
        const bool vec_x = (in % 8 == 0) && (p.x_stride % 8 == 0) && aligned16(X) && aligned16(A);
        const bool vec_b = (stride % 8 == 0) && aligned16(B);
        const int rank8 = (rank + 7) & ~7;
        // Overlap, first item: B and every A chunk (at most two, so all fit
        // the stages) are requested before the wait, y and x after it, in one group.
        const bool early = !waited && nr > 0 && lo > 0 && n_chunks <= 2;
        if (!waited && !early) grid_dependency_wait();

        // ---- one batch of copies for everything the block reads: B rows and
        // y values (group 0), then the first two chunks of A and x (groups 1, 2).
        // Scalar kernels: an A slice of one chunk goes first, in its own
        // group, and the shrink waits for it alone, so B and y arrive during
        // the shrink and the cluster sum. (On tensor cores, whose shrink is
        // short, measured slower at n = 256 of 32 adapters: 14.5 against
        // 13.8 µs in a graph.)
        const bool lead_a = !TC && !early && nr > 0 && lo > 0 && n_chunks == 1;
        // Blocks of 16 warps, one-row one-chunk items summed by pushing:
        // warps 0-7 request A and x, then warps 8-15 B and y while warps 0-7
        // shrink and push (B requested beside A delays A, and so the shrink;
        // B held back until A arrived delays the expand more). Items of
        // several rows shrink longer: all 16 warps take part.
        const bool split_warps = NT > BGMV_THREADS && push && lead_a && nr == 1;
        const bool b_warp = split_warps && warp >= BGMV_WARPS;
        // Row-mapped: the row's A, x and y (one group, by warps 0-7) and B
        // (by warps 8-15) are already requested.
        const bool pre = row_mapped && lead_a;
        if (!pre && split_warps && !b_warp) {
            stage_chunk(A, rank, vec_x, 0, 0, rank + nr, warp, BGMV_WARPS);
            named_barrier_arrive(1, NT);
        } else if (!pre) {
            if (b_warp) named_barrier_sync(1, NT);  // A and x requested
            if (lead_a && !split_warps) {
                stage_chunk(A, rank, vec_x, 0, 0, rank + nr, warp, NW);
                cp_async_commit();
            }
            if (nr > 0 && lo > 0) {
                // Threads t0, t0 + nt, ... request B and y.
                const int t0 = b_warp ? tid - BGMV_THREADS : tid;
                const int nt = split_warps ? BGMV_THREADS : NT;
                request_b(B, rank, vec_b, t0, nt);
                if (early) {
#pragma unroll 1
                    for (int c = 0; c < n_chunks; ++c) stage_chunk(A, rank, vec_x, c, 0, rank, warp, NW);
                    grid_dependency_wait();
#pragma unroll 1
                    for (int c = 0; c < n_chunks; ++c) stage_chunk(A, rank, vec_x, c, rank, rank + nr, warp, NW);
                }
                request_y(0, nr, t0, nt);
            }
        }
        if (!pre) cp_async_commit();
        waited = true;

        // ---- shrink: sTp[g][k] = sum over this rank's slice of A[k, i] x[row_g, i].
        // A and x arrive in chunks of kch columns through two stages; step s
        // computes chunk s - 2 and stages chunk s (one staging site: small code).
#pragma unroll 1
        for (int g = 0; g < nr; ++g)
#pragma unroll 1
            for (int k = tid; k < rank; k += NT) sTp[g * tp + k] = 0.f;
        // The scalar shrink of one staged chunk (a, x; n8 column steps) by
        // 8 * halves warps, the calling one being wi. A warp takes rank rows
        // k and k + 8 together and each lane SC column steps at once: 2 SC
        // independent dot chains sharing the x loads, then one halving
        // exchange for both rows. With a handful of warps per multiprocessor
        // the chains' latency, not the bytes, is this phase's time. Clusters
        // of 2 (registers to spare, 2048 columns per block at 4096) take four
        // steps, the others two. With two halves (16 warps) warps 8-15 take
        // the upper half of the column steps and leave their sums in sT (free
        // until the cluster sum), added to sTp after the step's barrier.
        auto scalar_shrink = [&](const bf16_t* a, const bf16_t* x, int n8, int wi, int halves) {
            constexpr int SC = C == 2 ? 4 : 2;
            constexpr int RW = BGMV_WARPS;  // warps along the rank rows
            const int rw = halves == 1 ? wi : wi % RW;
            const int half = halves == 1 ? 0 : wi / RW;
            const int per_half = (n8 + halves - 1) / halves;
            const int c_lo = half * per_half;
            const int c_hi = min(n8, c_lo + per_half);
            float* dst = half == 0 ? sTp : sT;
            const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll 1
            for (int g = 0; g < nr; ++g) {
                const bf16_t* xg = x + g * kp;
#pragma unroll 1
                for (int k = rw; k < rank; k += 2 * RW) {
                    const bool two = k + RW < rank;
                    const bf16_t* a0 = a + k * kp;
                    const bf16_t* a1 = a + (two ? k + RW : k) * kp;
                    float s0[SC], s1[SC];
#pragma unroll
                    for (int i = 0; i < SC; ++i) s0[i] = s1[i] = 0.f;
#pragma unroll 1
                    for (int c = c_lo + lane; c < c_hi; c += 32 * SC) {
                        uint4 xv[SC], pv[SC], qv[SC];
#pragma unroll
                        for (int i = 0; i < SC; ++i) {
                            const bool in = i == 0 || c + 32 * i < c_hi;
                            const int off = (c + 32 * i) * 8;
                            xv[i] = in ? *(const uint4*)(xg + off) : zero;
                            pv[i] = in ? *(const uint4*)(a0 + off) : zero;
                            qv[i] = in ? *(const uint4*)(a1 + off) : zero;
                        }
#pragma unroll
                        for (int i = 0; i < SC; ++i) {
                            s0[i] = dot8(pv[i], xv[i], s0[i]);
                            s1[i] = dot8(qv[i], xv[i], s1[i]);
                        }
                    }
                    float v0 = s0[0], v1 = s1[0];
#pragma unroll
                    for (int i = 1; i < SC; ++i) {
                        v0 += s0[i];
                        v1 += s1[i];
                    }
                    // Lanes 0-15 keep row k, 16-31 row k + WARPS.
                    const bool upper = (lane & 16) != 0;
                    float v = (upper ? v1 : v0) + __shfl_xor_sync(0xffffffffu, upper ? v0 : v1, 16);
#pragma unroll
                    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (half == 0) {
                        if (lane == 0) dst[g * tp + k] += v;
                        if (lane == 16 && two) dst[g * tp + k + RW] += v;
                    } else {
                        if (lane == 0) dst[g * tp + k] = v;
                        if (lane == 16 && two) dst[g * tp + k + RW] = v;
                    }
                }
            }
        };
        const int chunks = nr > 0 && !split_warps ? n_chunks : 0;
#pragma unroll 1
        for (int step = 0; step < chunks + 2; ++step) {
            const int ch = step - 2;
            if (ch >= 0) {
                // Groups: (lead_a: A and x), B and y, then one per step.
                // Row-mapped, a thread's groups: warps 0-7 (A, x, y), steps;
                // warps 8-15 (B), steps, not needed before the expand.
                if (pre) {
                    if (warp < BGMV_WARPS) cp_async_wait<2>();
                } else if (lead_a) {
                    cp_async_wait<3>();
                } else {
                    cp_async_wait<1>();
                }
                __syncthreads();
                const int st = ch & 1;
                const int len = min(kch, k1 - (k0 + ch * kch));
                const bf16_t* a = sA + st * arows * kp;
                const bf16_t* x = sX + st * BGMV_G * kp;
                const int n8 = (len + 7) >> 3;
                if (TC) {
                    // Warp w takes the 8-column steps w, w + 8, ... of every
                    // 16-rank tile; the warps' tiles are summed in warp order
                    // through sRed (shared float atomics are CAS loops on sm_90).
#pragma unroll 1
                    for (int m0 = 0; m0 < rank; m0 += 16) {
                        float d[4] = {0.f, 0.f, 0.f, 0.f};
                        float e[4] = {0.f, 0.f, 0.f, 0.f};  // odd steps: two independent chains
#pragma unroll 1
                        for (int ks = warp; ks < n8; ks += 2 * NW) {
                            u32 a0, a1, b0;
                            ldsm_x2(a0, a1, a + (m0 + (lane & 15)) * kp + ks * 8);
                            ldsm_x1(b0, x + (lane & 7) * kp + ks * 8);
                            const int ks2 = ks + NW;
                            if (ks2 < n8) {
                                u32 c0, c1, b1;
                                ldsm_x2(c0, c1, a + (m0 + (lane & 15)) * kp + ks2 * 8);
                                ldsm_x1(b1, x + (lane & 7) * kp + ks2 * 8);
                                mma_k8(e, c0, c1, b1);
                            }
                            mma_k8(d, a0, a1, b0);
                        }
                        *(float4*)(sRed + warp * 128 + lane * 4) =
                            make_float4(d[0] + e[0], d[1] + e[1], d[2] + e[2], d[3] + e[3]);
                        __syncthreads();
                        // Thread t < 128 owns fragment value t: lane t / 4, slot t % 4, that is
                        // rank m0 + t / 16 + 8 ((t / 2) & 1), row 2 ((t / 4) % 4) + t % 2.
                        if (tid < 128) {
                            const int kk = m0 + (tid >> 4) + ((tid >> 1) & 1) * 8;
                            const int gg = ((tid >> 2) & 3) * 2 + (tid & 1);
                            if (kk < rank && gg < nr) {
                                float sum = 0.f;
#pragma unroll
                                for (int w = 0; w < NW; ++w) sum += sRed[w * 128 + tid];
                                sTp[gg * tp + kk] += sum;
                            }
                        }
                        __syncthreads();
                    }
                } else {
                    scalar_shrink(a, x, n8, warp, NW / BGMV_WARPS);
                }
                __syncthreads();  // stage ch & 1 is free again
                if (NW > BGMV_WARPS) {
#pragma unroll 1
                    for (int v = tid; v < nr * rank; v += NT) {
                        const int g = v / rank;
                        const int k = v - g * rank;
                        sTp[g * tp + k] += sT[g * tp + k];
                    }
                }
            }
            // (early: every chunk is in the first group; the empty groups keep the count.)
            if (step < chunks && !early && !lead_a) stage_chunk(A, rank, vec_x, step, 0, rank + nr, warp, NW);
            cp_async_commit();
        }
        if (split_warps) {
            // Warps 0-7 shrink as soon as their A and x arrived, while B and y stream.
            if (!b_warp) {
                cp_async_wait<0>();
                named_barrier_sync(2, BGMV_THREADS);  // A and x arrived, sTp zeroed
                scalar_shrink(sA, sX, (k1 - k0 + 7) >> 3, warp, 1);
                named_barrier_sync(2, BGMV_THREADS);  // sTp complete
            }
        } else if (chunks == 0 || NW > BGMV_WARPS) {
            // Without a chunk no step's barrier follows the zeroing of sTp, which
            // the cluster sum reads; with 16 warps none follows the last halves' sum.
            __syncthreads();
        }

        // ---- sum the partial rank vectors over the cluster, scale them.
        const float scale = en.scale;
        // Push form: each block stores its partials (whole float4s of rows x
        // rank8, past the rank unread) into slot crank of every block's
        // receive buffer `pushes & 1`, then waits for its own C slots. A
        // buffer is written again two items later, only by a peer that has
        // received this block's next push, sent after this sum read it.
        // Pull form: one (row, rank) value per thread, all rows at once; the C
        // peer loads are issued together and summed in rank order.
        const int b = pushes & 1;  // this item's receive buffer and mbarrier
        const float* recv = (const float*)(dyn + p.off_r) + b * C * BGMV_G * tp;
        // Split warps: warps 0-7 push and sum while warps 8-15 wait for B and y.
        const int sum_threads = split_warps ? BGMV_THREADS : NT;
        if (push && nr > 0) {
            const u32 parity = (u32)(pushes >> 1) & 1u;
            ++pushes;
            if (!peers_ready) {
                cluster_wait();
                peers_ready = true;
            }
            if (tid == 0) mbar_arrive_expect(&s_mbar[b], (u32)(C * nr * rank8 * 4));
            const int q4 = rank8 >> 2;
            const int per_peer = nr * q4;
#pragma unroll 1
            for (int v = tid; !b_warp && v < C * per_peer; v += sum_threads) {
                const int r = v / per_peer;
                const int gk = v - r * per_peer;
                const int g = gk / q4;
                const int k = (gk - g * q4) * 4;
                st_async_f4(cluster_addr(recv + (crank * BGMV_G + g) * tp + k, (u32)r),
                            *(const float4*)&sTp[g * tp + k], cluster_addr(&s_mbar[b], (u32)r));
            }
            if (!b_warp) mbar_wait(&s_mbar[b], parity);
        } else if (C > 1 && !push) {
            cluster_arrive();
            cluster_wait();
        }
#pragma unroll 1
        for (int v = tid; !b_warp && v < nr * rank8; v += sum_threads) {
            const int g = v / rank8;
            const int k = v - g * rank8;
            float s = 0.f;
            if (k < rank) {
                float part[C];
#pragma unroll
                for (int r = 0; r < C; ++r)
                    part[r] = push ? recv[(r * BGMV_G + g) * tp + k]
                                   : (C > 1 ? ld_dsmem(&sTp[g * tp + k], (u32)r) : sTp[g * tp + k]);
#pragma unroll
                for (int r = 0; r < C; ++r) s += part[r];
            }
            s *= scale;
            if (TC) {
                // The expand's B operand, once per item: t as bf16 hi [G][tp] then lo [G][tp].
                const bf16_t h = f2bf(s);
                sTh[g * tp + k] = h;
                sTh[(BGMV_G + g) * tp + k] = f2bf(s - bf2f(h));
            } else {
                sT[g * tp + k] = s;
            }
        }
        if (C > 1 && !push) {
            cluster_arrive();
            pending = true;
        }
        // B and y (and nothing else) may still be in flight: they arrived during the cluster sum.
        cp_async_wait<0>();
        __syncthreads();

        // ---- expand from shared memory: y[row_g, coff + o] = sY + sum_k sT[g][k] sB[o][k].
        if (TC) {
            // Warps take 16-output tiles; per 8-rank step the B operand is t
            // (row g = lane / 4, ranks 2 (lane % 4) + {0, 1}) as bf16 hi and lo.
            // d[0..1]: output m0 + lane / 4, rows kq + {0, 1}; d[2..3]: output + 8.
            const int kq = (lane & 3) * 2;
            const bf16_t* th = sTh + (lane >> 2) * tp + kq;
            const bf16_t* tl = th + BGMV_G * tp;
            // This lane's two item rows: y in global memory and in sY, from this block's first output.
            Y* yg[2];
            const Y* ysh[2];
            bool live[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                live[h] = kq + h < nr;
                yg[h] = Yp + (u64)s_item.rows[live[h] ? kq + h : 0] * ys + coff + o0;
                ysh[h] = sY + (kq + h) * lo_max;
            }
#pragma unroll 1
            for (int m0 = warp * 16; nr > 0 && m0 < lo; m0 += NW * 16) {
                float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
                for (int kb = 0; kb < rank8; kb += 8) {
                    u32 a0, a1;
                    ldsm_x2(a0, a1, sB + (m0 + (lane & 15)) * bpitch + kb);
                    mma_k8(d, a0, a1, *(const u32*)(th + kb));
                    mma_k8(d, a0, a1, *(const u32*)(tl + kb));
                }
#pragma unroll
                for (int f = 0; f < 4; ++f) {
                    const int o = m0 + (lane >> 2) + (f >> 1) * 8;
                    const int h = f & 1;
                    if (o < lo && live[h])
                        y_store(yg[h] + o, dora_epilogue_if<DORA>(y_load(ysh[h] + o) + d[f], dora_g, tg, o0 + o));
                }
            }
        }
        // Scalar expand: a thread takes EO outputs THREADS apart together,
        // each summed as two chains (rank steps 8 apart), so 2 EO FMA chains
        // run at once behind one batch of shared loads. Clusters of 2 (one
        // block per multiprocessor, registers to spare, 8 outputs per thread
        // at 4096) take four at once, the others two. Their unpadded B rows
        // of an even number of 16-byte pieces (rank stride 16: 32 bytes) put
        // lanes i and i + 4 in the same banks, so lanes 4-7 of every 8 read
        // a rank step's upper half first (h0): each load then spans all the banks.
        constexpr int EO = C == 2 ? 4 : 2;
        const bool swap_halves = C == 2 && (bpitch & 15) == 0;
#pragma unroll 1
        for (int r = tid; !TC && nr > 0 && r < lo; r += EO * NT) {
            const bf16_t* brow[EO];
            bool live[EO];
#pragma unroll
            for (int j = 0; j < EO; ++j) {
                live[j] = r + j * NT < lo;
                brow[j] = sB + (live[j] ? r + j * NT : r) * bpitch;
            }
#pragma unroll 1
            for (int g = 0; g < nr; ++g) {
                const float* tv = sT + g * tp;
                float e[EO], f[EO];
#pragma unroll
                for (int j = 0; j < EO; ++j) e[j] = f[j] = 0.f;
#pragma unroll 1
                for (int kb = 0; kb < rank8; kb += 16) {
                    const bool k2 = kb + 8 < rank8;  // uniform over the block
                    const int h0 = swap_halves && k2 ? (lane & 4) * 2 : 0;  // the half u holds: 0 or 8
                    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
                    uint4 u[EO], v[EO];
#pragma unroll
                    for (int j = 0; j < EO; ++j) {
                        u[j] = *(const uint4*)(brow[j] + kb + h0);
                        v[j] = k2 ? *(const uint4*)(brow[j] + kb + (h0 ^ 8)) : zero;  // unread past rank8
                    }
                    float t[16];
#pragma unroll
                    for (int i = 0; i < 16; i += 4) {
                        const float4 q = *(const float4*)(tv + kb + (k2 ? (i ^ h0) : (i & 7)));
                        t[i] = q.x;
                        t[i + 1] = q.y;
                        t[i + 2] = q.z;
                        t[i + 3] = q.w;
                    }
#pragma unroll
                    for (int j = 0; j < EO; ++j) e[j] = dot8f(u[j], t, e[j]);
                    if (k2) {
#pragma unroll
                        for (int j = 0; j < EO; ++j) f[j] = dot8f(v[j], t + 8, f[j]);
                    }
                }
                Y* yrow = Yp + (u64)s_item.rows[g] * ys + coff + o0;
#pragma unroll
                for (int j = 0; j < EO; ++j) {
                    const int o = r + j * NT;
                    if (live[j])
                        y_store(yrow + o,
                                dora_epilogue_if<DORA>(y_load(sY + g * lo_max + o) + (e[j] + f[j]), dora_g, tg, o0 + o));
                }
            }
        }
    }
    if (C > 1 && pending) cluster_wait();  // keep our shared memory alive until every peer read it
}

// Every kernel scans its window (NAME); the tensor-core ones also read
// bgmv_list's list (NAME_list, LIST). Each macro defines NAME in the plain
// module and NAME_dora, the same body with the DoRA epilogue compiled in
// (launched where a target of the call carries a DoRA table), in the DoRA
// module (decode.cuh). Register
// bounds as for the clusters below: the scalar kernels' two-row shrink and
// expand need more than 64 registers without spilling.
#define BGMV_KERNEL_C1(NAME, Y, TC, LIST, BLOCKS)                                                              \
    extern "C" __global__ void __launch_bounds__(BGMV_THREADS, BLOCKS) DECODE_NAME(NAME)(const BgmvParams p) { \
        bgmv_body<Y, 1, TC, LIST, BGMV_THREADS, kDecodeDora>(p);                                               \
    }
BGMV_KERNEL_C1(bgmv_c1_bf16, bf16_t, false, false, 3)
BGMV_KERNEL_C1(bgmv_c1_f32, float, false, false, 3)
BGMV_KERNEL_C1(bgmv_tc_c1_bf16, bf16_t, true, false, 4)
BGMV_KERNEL_C1(bgmv_tc_c1_f32, float, true, false, 4)
BGMV_KERNEL_C1(bgmv_tc_c1_bf16_list, bf16_t, true, true, 4)
BGMV_KERNEL_C1(bgmv_tc_c1_f32_list, float, true, true, 4)

#if __CUDA_ARCH__ >= 900
// The TC kernels need fewer registers: four blocks per multiprocessor
// (`TC_BLOCKS_PER_SM` in bgmv.rs), so more items are served in one round; the scalar ones three.
#define BGMV_KERNEL_CL(NAME, Y, C, TC, LIST, NT, BLOCKS)                                             \
    extern "C" __global__ void __cluster_dims__(C, 1, 1)                                             \
        __launch_bounds__(NT, BLOCKS) DECODE_NAME(NAME)(const BgmvParams p) {                        \
        bgmv_body<Y, C, TC, LIST, NT, kDecodeDora>(p);                                               \
    }
// Clusters of 2 serve batches whose items outnumber the resident clusters
// of 8: one block per multiprocessor (a whole half of A and B staged at
// once), so every item of a 64-row batch is served in one round. Their
// scalar blocks run 16 warps (`fused_threads` in bgmv.rs), so a one-row
// item's B and y are requested by warps of their own while the others
// shrink on A (split_warps in bgmv_body).
BGMV_KERNEL_CL(bgmv_c2_bf16, bf16_t, 2, false, false, 2 * BGMV_THREADS, 1)
BGMV_KERNEL_CL(bgmv_c2_f32, float, 2, false, false, 2 * BGMV_THREADS, 1)
BGMV_KERNEL_CL(bgmv_c8_bf16, bf16_t, 8, false, false, BGMV_THREADS, 3)
BGMV_KERNEL_CL(bgmv_c8_f32, float, 8, false, false, BGMV_THREADS, 3)
BGMV_KERNEL_CL(bgmv_tc_c2_bf16, bf16_t, 2, true, false, BGMV_THREADS, 1)
BGMV_KERNEL_CL(bgmv_tc_c2_f32, float, 2, true, false, BGMV_THREADS, 1)
BGMV_KERNEL_CL(bgmv_tc_c8_bf16, bf16_t, 8, true, false, BGMV_THREADS, 4)
BGMV_KERNEL_CL(bgmv_tc_c8_f32, float, 8, true, false, BGMV_THREADS, 4)
BGMV_KERNEL_CL(bgmv_tc_c2_bf16_list, bf16_t, 2, true, true, BGMV_THREADS, 1)
BGMV_KERNEL_CL(bgmv_tc_c2_f32_list, float, 2, true, true, BGMV_THREADS, 1)
BGMV_KERNEL_CL(bgmv_tc_c8_bf16_list, bf16_t, 8, true, true, BGMV_THREADS, 4)
BGMV_KERNEL_CL(bgmv_tc_c8_f32_list, float, 8, true, true, BGMV_THREADS, 4)
#endif

// ---- The item list of a launch: bgmv_list, then a fused kernel's _list form ----
//
// One block per (window, target) lists the window's items once, instead of
// every fused block scanning the window, gathering its item's rows and
// loading its entry (idle clusters included), and writes them into the
// backend's scratch at list + (window * n_targets + target) * list_stride:
// a 64-byte header (the item count), then the items as ItemRows
// (absolute rows, checked entry). Faults: a bad index raises FAULT_BAD_INDEX
// and the row gets no delta, a bad entry FAULT_BAD_RANK and its item rank 0,
// as in the scanning kernel.
//
// One thread per row, nothing serial: a row's place among its entry's rows
// is a shared atomic on a per-entry counter (the host launches this only
// for tables of at most BGMV_LIST_MAP entries), the entries' items are
// numbered by one block scan over each entry's first row, and each item's
// first row loads and checks its entry, all items at once. Which rows of an
// entry share an item depends on the atomics' order; each row's result does
// not (every row's shrink and expand are its own dot products).
//
// The fused kernel is launched as a programmatic dependent: its blocks get
// resident while this runs (launch_dependents first) and wait for this
// grid's completion (griddepcontrol.wait) before they read the list.
// BGMV_LIST_MAP: from the host's prelude (`cuda_rt::prelude`).

#if !DECODE_DORA
extern "C" __global__ void __launch_bounds__(BGMV_THREADS) bgmv_list(const BgmvParams p) {
    static_assert(BGMV_WIN_MAX <= 2 * BGMV_THREADS && BGMV_WIN_MAX < (1 << 16), "two rows per thread, 16-bit counts");
    __shared__ int s_map[BGMV_LIST_MAP];  // per entry: its row count, then count | first item << 16
    __shared__ int s_scan[BGMV_WARPS + 1];
    const int tid = threadIdx.x;
    const int win = (int)blockIdx.x;
    const LoraTarget tg = p.targets[blockIdx.z];
    const int row0 = win * p.window;
    const int nwin = min(p.window, p.n_rows - row0);
    u64* header = (u64*)(p.list + (u64)(win * p.n_targets + (int)blockIdx.z) * p.list_stride);
    ItemRows* items = (ItemRows*)header + 1;
    // Overlap: a programmatic dependent of the stream's previous kernel,
    // which may still read the scratch (a previous apply): idx and the table
    // are read before the wait, the scratch written only after it.
    const bool overlap = p.overlap != 0;
    if (!overlap) grid_launch_dependents();
    const PairEntry* table = (const PairEntry*)tg.table;
    // The table is small: pull it towards L2 while idx arrives.
    if (tid == 0) prefetch_l2((const void*)table, (u64)min(tg.n_entries, BGMV_LIST_MAP) * sizeof(PairEntry));
    const bool listed = nwin > 0 && tg.n_entries <= BGMV_LIST_MAP;  // uniform over the block

    int e[2];
    int occ[2] = {0, 0};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = tid + r * BGMV_THREADS;
        e[r] = checked_index(listed && j < nwin ? ((const int*)p.idx)[row0 + j] : -1, tg.n_entries, p.fault, true);
        if (e[r] >= 0) s_map[e[r]] = 0;
    }
    if (overlap) {
        grid_dependency_wait();
        grid_launch_dependents();
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (e[r] >= 0) occ[r] = atomicAdd(&s_map[e[r]], 1);
    __syncthreads();
    // Each entry's first row (place 0) counts its items, G rows each.
    int cnt[2] = {0, 0};
    int mine = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (e[r] >= 0 && occ[r] == 0) {
            cnt[r] = s_map[e[r]];
            mine += (cnt[r] + BGMV_G - 1) / BGMV_G;
        }
    }
    int n_items;
    int first = block_exclusive_scan<BGMV_THREADS>(mine, s_scan, &n_items);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (e[r] >= 0 && occ[r] == 0) {
            s_map[e[r]] = cnt[r] | first << 16;
            first += (cnt[r] + BGMV_G - 1) / BGMV_G;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (e[r] < 0) continue;
        const int m = s_map[e[r]];
        const int count = m & 0xffff;
        ItemRows* item = items + (m >> 16) + occ[r] / BGMV_G;
        const int slot = occ[r] % BGMV_G;
        item->rows[slot] = row0 + tid + r * BGMV_THREADS;
        if (slot == 0) {
            PairEntry en = table[e[r]];
            item->nrows = min(BGMV_G, count - occ[r]);
            if (bad_entry(en, p.rank_stride)) {
                raise_fault(p.fault, FAULT_BAD_RANK);
                en.rank = 0;
            }
            item->entry = en;
        }
    }
    if (tid == 0) *header = (u64)(u32)n_items;
}
#endif

// The launch floor of a measurement: one block that does nothing. The
// bench times it like every op (graph replay after an L2 flush), so a
// reader sees how much of a small batch's time is launch and cold start.
#if !DECODE_DORA
extern "C" __global__ void lora_empty(const u64 unused) { (void)unused; }
#endif

// ---- Two-phase decode: a shrink launch, then an expand launch ----------------
//
// For batches of one row window (n <= BGMV_WIN_MAX) whose adapters' bytes
// dwarf the latency chain. The fused kernel above keeps the whole chain in
// one block (idx -> entry -> A -> cluster sum -> B -> y), so a block streams
// A, then waits, then streams B; here every block of each launch only
// streams. Every row is an item of its own (the _rows kernels, in p.row_ks
// K slices), so the shrink scans no window and the expand finds each row's
// entry from idx and the table itself. bgmv2_shrink_rows: units (row, K
// slice), A read straight into registers (16-byte loads, several rows in
// flight per lane), partial rank vectors into the backend's scratch
// (bgmv2_shrink_tc_rows: the same units on tensor cores).
// bgmv2_expand_rows: units (row, output chunk), B read with whole warps on
// contiguous rows, partials summed and scaled, y staged through shared memory
// so it moves in 16-byte pieces. Both sum a lane's partial dots over the lanes
// that share them by halving exchanges (butterfly8 in the shrink, two halving
// steps in the expand): the reductions were what kept a warp from its next
// loads. Neither the expand's entries nor its B depend on the shrink, so a
// block's first unit copies its y values in (not under the overlap) and
// loads its first B rows before griddepcontrol.wait. Rows of one adapter
// each read its A and B (from L2 after the first). The expand is the
// shrink's programmatic dependent, and under the overlap (CHAIN_EARLY_READS)
// the shrink is the previous kernel's (idx and the tables read before its
// wait; x and the scratch after it). Waiting first, the shrink is the
// previous kernel's dependent too but waits before any read and only then
// lets the expand in, so the expand reads y before its own wait as after a
// plain shrink, and lets the next apply in at its start or before its last
// stores.
//
// Scratch layout (the host sizes and checks it; `BGMV2_*` mirror bgmv.rs):
//   [0, 256)                      Bgmv2Header per target (written by the shrink, read by nothing)
//   [BGMV2_DESC_OFF, +desc)       unused (the removed scanning form's item descriptors)
//   [BGMV2_PART_OFF, ...)         f32 partials [targets][ks_max][n_rows][rpad], rpad = stride rounded up to 8

// BGMV2_DESC_OFF: from the host's prelude (`cuda_rt::prelude`).
#define BGMV2_PART_OFF (BGMV2_DESC_OFF + MAX_TARGETS * BGMV_WIN_MAX * 64)
#define BGMV2_UNROLL 4
// Tensor-core shrink: 32-column chunks per warp in flight (each lane 2 16-byte A loads per chunk).
#define BGMV2_TC_UNROLL 4
// Most K slices of the shrink (`TWO_PHASE_MAX_SPLITS` in bgmv.rs).
// BGMV2_MAX_SPLITS: from the host's prelude (`cuda_rt::prelude`).

struct Bgmv2Params {
    u64 x;
    u64 y;
    u64 idx;
    u64 fault;
    u64 scratch;
    int n_rows;
    int in_dim;
    int x_stride;
    int y_stride;
    int rank_stride;
    int n_targets;
    int ks_max;
    int expand_cols;
    int pad;      // keeps the fields below where the kernels read them, and targets 8-byte aligned
    int overlap;  // how the shrink follows the stream's previous kernel: a CHAIN_* code (common.cuh)
    int row_ks;   // K slices of every row (each row its own item)
    LoraTarget targets[MAX_TARGETS];
};
static_assert(sizeof(Bgmv2Params) == 248 && sizeof(Bgmv2Params) - sizeof(LoraTarget) * MAX_TARGETS == 88, "mirrors bgmv.rs");

struct Bgmv2Header {
    int n_items;
    int k_splits;
    int pad[2];
};

// Eight bf16 from p, of which the first `valid` are read (the rest zero and
// never touched): one 16-byte load when `vec` (p 16-byte aligned) and all 8 valid.
__device__ __forceinline__ uint4 load8(const bf16_t* p, int valid, bool vec) {
    if (vec && valid >= 8) return ldg16(p);
    u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < valid) w[j >> 1] |= ((u32)p[j]) << ((j & 1) * 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Eight outputs at a 16-byte aligned address, rounded once, in 16-byte stores.
__device__ __forceinline__ void y_store8(bf16_t* p, const float* v) {
    *(uint4*)p = make_uint4(pack_bf2(v[0], v[1]), pack_bf2(v[2], v[3]), pack_bf2(v[4], v[5]), pack_bf2(v[6], v[7]));
}
__device__ __forceinline__ void y_store8(float* p, const float* v) {
    *(float4*)p = make_float4(v[0], v[1], v[2], v[3]);
    *(float4*)(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ Bgmv2Header* bgmv2_header(const Bgmv2Params& p, int t) {
    return (Bgmv2Header*)p.scratch + t;
}
// Partial rank vector of window row `row`, K slice `ks`, target t.
__device__ __forceinline__ float* bgmv2_part(const Bgmv2Params& p, int t, int ks, int row) {
    const int rpad = (p.rank_stride + 7) & ~7;
    return (float*)(p.scratch + BGMV2_PART_OFF) + (((u64)t * p.ks_max + ks) * p.n_rows + row) * rpad;
}

// The sums over a warp's 32 lanes of 8 values per lane, in 9 shuffles
// instead of 8 reductions of 5: each step halves the values a lane keeps and
// sends the other half to its partner. Returns the total of value
// `butterfly8_index(lane)`, which lanes that differ only in bits 0-1 share.
__device__ __forceinline__ float butterfly8(float (&v)[8], int lane) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const bool h = (lane & 16) != 0;
        const float send = h ? v[i] : v[i + 4];
        v[i] = (h ? v[i + 4] : v[i]) + __shfl_xor_sync(0xffffffffu, send, 16);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const bool h = (lane & 8) != 0;
        const float send = h ? v[i] : v[i + 2];
        v[i] = (h ? v[i + 2] : v[i]) + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    const bool h = (lane & 4) != 0;
    float s = (h ? v[1] : v[0]) + __shfl_xor_sync(0xffffffffu, h ? v[0] : v[1], 4);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    return s;
}
__device__ __forceinline__ int butterfly8_index(int lane) {
    return ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
}

// The tensor-core shrink's sums of one round: every warp's 16 x 8 tile (rank
// rows x item rows, in mma_k16's fragment order) in sRed, summed over the
// warps that share a group in warp order, into sT: no float atomics, so the
// result does not depend on the warps' timing (a graph replays its eager
// run bit for bit). Groups gph + round * gw, gph < gw; between barriers.
__device__ __forceinline__ void shrink_tc_sum(float* sT, const float* sRed, int round, int gw, int cw, int groups16,
                                              int rank, int nr) {
#pragma unroll 1
    for (int v = threadIdx.x; v < gw * 128; v += BGMV_THREADS) {
        const int gph = v >> 7;
        const int e = v & 127;
        const int grp = gph + round * gw;
        const int lane = e & 31;
        const int i = e >> 5;
        const int k = grp * 16 + (lane >> 2) + (i >> 1) * 8;
        const int row = (lane & 3) * 2 + (i & 1);
        if (grp < groups16 && k < rank && row < nr) {
            float sum = 0.f;
            for (int c = 0; c < cw; ++c) sum += sRed[(gph * cw + c) * 128 + e];
            sT[row * BGMV_MAX_RANK + k] = sum;
        }
    }
}

// One warp's 16 rank rows (a_lo: row g, a_hi: row g + 8 of lane 4 g + t)
// times its item rows over its chunks cph, cph + cw, ... of 32 columns
// from k0, into d, U chunks in flight. VEC: A and x rows 16-byte aligned
// (in a multiple of 8), so every chunk is whole 16-byte loads; else element
// loads, one chunk at a time (the registers they need).
template <bool VEC, int U>
__device__ __forceinline__ void shrink_tc_group(float* d, const bf16_t* a_lo, const bf16_t* a_hi, const bf16_t* xrow,
                                                bool lo_ok, bool hi_ok, bool has_row, int k0, int k1, int cph, int cw,
                                                int c32, int tq) {
    const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll 1
    for (int c = cph; c < c32; c += U * cw) {
        // A's rows first, all in flight; x (a few rows, read by every
        // group's warps, mostly from L1) as each chunk is summed.
        uint4 al[U], ah[U];
        int col[U], valid[U];  // valid <= 0: past the slice
#pragma unroll
        for (int j = 0; j < U; ++j) {
            col[j] = k0 + (c + j * cw) * 32 + tq * 8;
            valid[j] = c + j * cw < c32 ? k1 - col[j] : 0;
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            if (VEC) {
                al[j] = lo_ok && valid[j] > 0 ? ldg16(a_lo + col[j]) : z;
                ah[j] = hi_ok && valid[j] > 0 ? ldg16(a_hi + col[j]) : z;
            } else {
                al[j] = lo_ok && valid[j] > 0 ? load8(a_lo + col[j], valid[j], false) : z;
                ah[j] = hi_ok && valid[j] > 0 ? load8(a_hi + col[j], valid[j], false) : z;
            }
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            uint4 xv = z;
            if (has_row && valid[j] > 0) xv = VEC ? ldg16(xrow + col[j]) : load8(xrow + col[j], valid[j], false);
            mma_k16(d, al[j].x, ah[j].x, al[j].y, ah[j].y, xv.x, xv.y);
            mma_k16(d, al[j].z, ah[j].z, al[j].w, ah[j].w, xv.z, xv.w);
        }
    }
}

// The scalar shrink of warp (kp, cg): steps of RU rank rows (kp, kp + kw,
// ...) x XR item rows over its column passes (cg, cg + groups, ... of 32
// 8-column chunks from k0), RU A loads in flight per lane. A warp's column
// passes are summed in its registers before one butterfly8 and one shared
// add per step, so each rank sum gets one add per column group: two at
// most, and a + b == b + a, so the result does not depend on the warps'
// timing (a replay equals its eager run bit for bit).
template <int RU, int XR>
__device__ __forceinline__ void shrink_scalar_steps(float* sT, const bf16_t* A, const bf16_t* X, const int* rows,
                                                    int x_stride, int nr, int rank, int in, int k0, int k1, int nch,
                                                    int kp, int kw, int cg, int groups, int lane, bool vec_a,
                                                    bool vec_x) {
    static_assert(RU * XR == 8, "butterfly8 sums 8 values");
#pragma unroll 1
    for (int g0 = 0; g0 < nr; g0 += XR) {
#pragma unroll 1
        for (int k = kp; k < rank; k += kw * RU) {
            float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
            for (int cb = cg * 32; cb < nch; cb += groups * 32) {
                const int c = cb + lane;
                const int col = k0 + c * 8;
                const int valid = c < nch ? k1 - col : 0;
                uint4 a[RU];
#pragma unroll
                for (int j = 0; j < RU; ++j) {
                    const int kk = k + j * kw;
                    a[j] = kk < rank ? load8(A + (u64)kk * in + col, valid, vec_a) : make_uint4(0, 0, 0, 0);
                }
                // x of rows g0 .. g0 + XR (an item's later rows and rank
                // steps re-read it, and A, from L1).
                uint4 xr[XR];
#pragma unroll
                for (int g = 0; g < XR; ++g)
                    xr[g] = g0 + g < nr ? load8(X + (u64)rows[g0 + g] * x_stride + col, valid, vec_x)
                                        : make_uint4(0, 0, 0, 0);
                // The 8 partial dots (rank rows x item rows); rows past the
                // rank or the item's rows are zero, unwritten.
#pragma unroll
                for (int j = 0; j < RU; ++j)
#pragma unroll
                    for (int g = 0; g < XR; ++g) v[j * XR + g] = dot8(a[j], xr[g], v[j * XR + g]);
            }
            // Summed over the warp at once.
            const float sum = butterfly8(v, lane);
            const int vi = butterfly8_index(lane);
            const int kk = k + (vi / XR) * kw;
            const int g = g0 + vi % XR;
            if ((lane & 3) == 0 && kk < rank && g < nr) atomicAdd(&sT[g * BGMV_MAX_RANK + kk], sum);
        }
    }
}

// How the shrink sums a row: scalar (unpacking, FMAs, butterfly8) or on
// tensor cores (an mma_k16 per 16 rank rows x 16 columns).
#define SHRINK_SCALAR 0
#define SHRINK_TC 1

template <int MODE>
__device__ __forceinline__ void bgmv2_shrink_body(const Bgmv2Params& p) {
    __shared__ float s_tc[MODE == SHRINK_TC ? BGMV_WARPS * 128 : 1];  // the tensor-core rounds' tiles
    __shared__ ItemRows s_item;
    __shared__ float sT[BGMV_G * BGMV_MAX_RANK];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int t = (int)blockIdx.z;
    const LoraTarget tg = p.targets[t];
    const int nwin = p.n_rows;
    const bool lead_block = blockIdx.x == 0;
    // Waiting first: before anything is read, and before the expand is let
    // in (the expand reads y before its own wait).
    if (p.overlap >= CHAIN_WAIT_FIRST) grid_dependency_wait();
    // Every row is an item of its own: nothing is scanned (the expand finds
    // each row's entry itself). The expand may get resident now (a
    // dependent launch); it waits for this grid to complete.
    grid_launch_dependents();
    if (tid == 0) prefetch_l2((const void*)tg.table, (u64)min(tg.n_entries, 4096) * sizeof(PairEntry));
    const int n_items = nwin;
    // Enough K slices that the units fill the grid once, rounded down to a
    // power of two (whole 256-column passes when in is a multiple of 4096):
    // the host's count (`two_phase_slices` in bgmv.rs).
    const int ks_n = p.row_ks;
    // Overlap: the previous kernel (a previous apply's expand, say) may still
    // read the scratch and write x: both only after this wait, which every
    // block passes once (the lead block before its header).
    bool waited = p.overlap != CHAIN_EARLY_READS;
    auto wait_previous_then_header = [&]() {
        if (!waited) grid_dependency_wait();
        waited = true;
        if (lead_block && tid == 0) {
            Bgmv2Header h;
            h.n_items = n_items;
            h.k_splits = ks_n;
            h.pad[0] = 0;
            h.pad[1] = 0;
            *bgmv2_header(p, t) = h;
        }
    };
    if (waited) wait_previous_then_header();
    const PairEntry* table = (const PairEntry*)tg.table;
    const bf16_t* X = (const bf16_t*)p.x;
    const int in = p.in_dim;
    const int units = n_items * ks_n;

#pragma unroll 1
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const int it = u / ks_n;
        const int ks = u - it * ks_n;
        __syncthreads();  // the previous unit no longer reads s_item / sT
        // Every row has one K slice 0: its unit reports a bad index or entry.
        if (warp == 0)
            load_row_item((const int*)p.idx, it, tg.n_entries, table, p.rank_stride, p.fault, ks == 0, &s_item);
        __syncthreads();
        const PairEntry en = s_item.entry;
        const int rank = (int)en.rank;
        const int nr = rank > 0 ? s_item.nrows : 0;
        int k0, k1;
        split8(in, ks_n, ks, k0, k1);
        const bf16_t* A = (const bf16_t*)en.a;
        if (!waited) wait_previous_then_header();
        if (nr == 0) continue;  // uniform over the block
#pragma unroll 1
        for (int v = tid; v < nr * rank; v += BGMV_THREADS) sT[(v / rank) * BGMV_MAX_RANK + v % rank] = 0.f;
        __syncthreads();

        const int nch = (k1 - k0 + 7) >> 3;
        // Warps tile (column group, rank phase): up to two groups of 32
        // chunks (256 columns) side by side (each of them walks its passes;
        // see the sums below), the remaining factor splits the rank rows.
        const int groups = min(2, max(1, (nch + 31) >> 5));
        const int kw = BGMV_WARPS / groups;
        const int cg = warp % groups;
        const int kp = warp / groups;
        const bool vec_a = (in % 8 == 0) && aligned16(A);
        const bool vec_x = (p.x_stride % 8 == 0) && aligned16(X);
        if (MODE == SHRINK_TC) {
            // Tensor cores: a warp's m16n8k16 tile is 16 rank rows x the
            // item's (up to 8) rows over 32 columns, which each lane reads as
            // 16 contiguous bytes of two A rows and of its x row: the columns
            // of a tile are summed in whatever order, so lane 4 g + t holds
            // columns 8 t .. 8 t + 7, of which words 0-1 and 2-3 are the k
            // pairs of two mma_k16. One instruction per 256 multiply-adds
            // instead of the scalar path's unpacking, FMAs and exchanges.
            const int groups16 = (rank + 15) >> 4;
            const int c32 = (nch + 3) >> 2;
            // Warps tile (chunk phase, group phase): on chunks, except that
            // warps move to groups (while there are groups for them) until
            // each has BGMV2_TC_UNROLL chunks per group, its loads in flight.
            int cw = 8;
            while (cw > 1 && (cw > c32 || (c32 < BGMV2_TC_UNROLL * cw && 2 * (BGMV_WARPS / cw) <= groups16))) cw >>= 1;
            const int gw = BGMV_WARPS / cw;
            const int cph = warp % cw;
            const int g = lane >> 2;
            const int tq = lane & 3;
            const bool has_row = g < nr;
            const bf16_t* xrow = X + (u64)s_item.rows[has_row ? g : 0] * p.x_stride;
            const int rounds = (groups16 + gw - 1) / gw;
#pragma unroll 1
            for (int round = 0; round < rounds; ++round) {
                const int grp = warp / cw + round * gw;
                const int r0 = grp * 16 + g;
                const bool lo_ok = r0 < rank;
                const bool hi_ok = r0 + 8 < rank;
                const bf16_t* a_lo = A + (u64)r0 * in;
                const bf16_t* a_hi = A + (u64)(r0 + 8) * in;
                float d[4] = {0.f, 0.f, 0.f, 0.f};
                if (grp >= groups16) {
                } else if (vec_a && vec_x) {
                    shrink_tc_group<true, BGMV2_TC_UNROLL>(d, a_lo, a_hi, xrow, lo_ok, hi_ok, has_row, k0, k1, cph, cw, c32, tq);
                } else {
                    shrink_tc_group<false, 1>(d, a_lo, a_hi, xrow, lo_ok, hi_ok, has_row, k0, k1, cph, cw, c32, tq);
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) s_tc[warp * 128 + i * 32 + lane] = d[i];
                __syncthreads();
                shrink_tc_sum(sT, s_tc, round, gw, cw, groups16, rank, nr);
                __syncthreads();  // s_tc is rewritten by the next round
            }
        } else if (kp < kw) {
            // One-row items: 8 rank rows per step and one x row, so a lane
            // has 8 A loads in flight where steps of 4 x 2 have 4 and leave
            // half their sums empty (H200, in a graph, n = 64 of rank-64
            // adapters: 25.72 -> 25.2 µs).
            // (nr is 1 there: an item of rank 0 was skipped above.)
            shrink_scalar_steps<8, 1>(sT, A, X, s_item.rows, p.x_stride, 1, rank, in, k0, k1, nch, kp, kw, cg, groups,
                                      lane, vec_a, vec_x);
        }
        __syncthreads();
#pragma unroll 1
        for (int v = tid; v < nr * rank; v += BGMV_THREADS) {
            const int g = v / rank;
            const int k = v - g * rank;
            bgmv2_part(p, t, ks, s_item.rows[g])[k] = sT[g * BGMV_MAX_RANK + k];
        }
    }
    // A block without units has written nothing; it still waits, so that the
    // lead block writes the header of an empty batch too.
    if (!waited) wait_previous_then_header();
}

// Four blocks per multiprocessor (`SHRINK_BLOCKS_PER_SM` in bgmv.rs): more
// A loads in flight and twice the K slices of three (n = 64, rank 64: 35.4
// against 39.6 µs on the H200).
#if !DECODE_DORA
extern "C" __global__ void __launch_bounds__(BGMV_THREADS, 4) bgmv2_shrink_rows(const Bgmv2Params p) {
    bgmv2_shrink_body<SHRINK_SCALAR>(p);
}
// `TwoPhaseForm::shrink_tensor_cores`.
extern "C" __global__ void __launch_bounds__(BGMV_THREADS, 4) bgmv2_shrink_tc_rows(const Bgmv2Params p) {
    bgmv2_shrink_body<SHRINK_TC>(p);
}
#endif

// The sum over K splits [0, k_splits) of part[ks * split], k_splits <= KS, in split order: all KS
// loads issued before the first add (splits past k_splits read split 0 again and are not added).
template <int KS>
__device__ __forceinline__ float sum_splits(const float* part, u64 split, int k_splits) {
    float w[KS];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) w[ks] = part[(ks < k_splits ? ks : 0) * split];
    float s = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
        if (ks < k_splits) s += w[ks];
    return s;
}

// rows[g] of an item, g < BGMV_G, selected through registers (no indexing
// of the array, which would put it in local memory).
__device__ __forceinline__ int item_row(const int (&rows)[BGMV_G], int g) {
    int r = rows[0];
#pragma unroll
    for (int q = 1; q < BGMV_G; ++q) r = g == q ? rows[q] : r;
    return r;
}

// Dynamic shared memory of the expand: sAcc [GR][cols] f32, sY [GR][cols] Y,
// sT [GR][rpad] f32, for items of GR rows (1: every row its own item).
template <typename Y, bool DORA>
__device__ __forceinline__ void bgmv2_expand_body(const Bgmv2Params& p) {
    extern __shared__ __align__(16) unsigned char dyn[];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int t = (int)blockIdx.z;
    const LoraTarget tg = p.targets[t];
    const int cols = p.expand_cols;
    const int stride = p.rank_stride;
    const int rpad = (stride + 7) & ~7;
    constexpr int GR = 1;
    float* sAcc = (float*)dyn;
    Y* sY = (Y*)(dyn + GR * cols * 4);
    float* sT = (float*)(dyn + GR * cols * (4 + (int)sizeof(Y)));
    // The next apply may get resident now (under the overlap, or waiting
    // first with the next launch early); it waits for this grid.
    if (p.overlap == CHAIN_EARLY_READS || p.overlap == CHAIN_WAIT_FIRST_EARLY_NEXT) grid_launch_dependents();
    // As the shrink's dependent this block may start before the shrink ends:
    // it waits for it (and its writes) before reading the scratch, further down.
    const int chunks = (tg.out_dim + cols - 1) / cols;
    Y* Yp = (Y*)p.y;
    const int ys = p.y_stride;
    const int coff = tg.y_col_off;
    // Unit u is row u / chunks, whose entry this kernel reads from
    // idx and the table (the shrink raised their faults): neither depends on
    // the shrink, so a block's first unit copies its y values in before the
    // wait (not under the overlap, where the kernel before the shrink may
    // still write y), and its first B rows are loaded into registers before it
    // (the B pass below). An L2 prefetch of its whole B span there was slower
    // than no prefetch (H200, in a graph, n = 64: rank 64 24.83 -> 24.07 µs
    // without it, 14336 outputs 19.66 -> 18.56).
    auto row_entry = [&](int row) {
        PairEntry en;
        checked_entry(((const int*)p.idx)[row], tg.n_entries, (const PairEntry*)tg.table, stride, p.fault, false, &en);
        return en;
    };
    auto vec_y_of = [&](int o0, int lc) {
        return ((int)sizeof(Y) * ys % 16 == 0) && ((int)sizeof(Y) * (coff + o0) % 16 == 0) && aligned16(Yp) &&
               (lc % 8 == 0);
    };
    bool y_early = false;  // the first unit's y already requested
    if ((int)blockIdx.x < p.n_rows * chunks) {
        const int row = (int)blockIdx.x / chunks;
        const int o0 = ((int)blockIdx.x - row * chunks) * cols;
        const int lc = min(cols, tg.out_dim - o0);
        const PairEntry en = row_entry(row);
        if (en.rank > 0) {
            if (p.overlap != CHAIN_EARLY_READS && vec_y_of(o0, lc)) {
                const unsigned char* src = (const unsigned char*)(Yp + (u64)row * ys + coff + o0);
#pragma unroll 1
                for (int c = tid; c < lc * (int)sizeof(Y) / 16; c += BGMV_THREADS)
                    cp_async16((unsigned char*)sY + c * 16, src + c * 16);
                cp_async_commit();
                y_early = true;
            }
        }
    }
    // The block waits for the shrink inside its first unit, after that
    // unit's first B rows are requested (B is not the shrink's output).
    bool waited = false;
    const int k_splits = p.row_ks;
    const int units = p.n_rows * chunks;
#pragma unroll 1
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const int it = u / chunks;
        const int o0 = (u - it * chunks) * cols;
        const int lc = min(cols, tg.out_dim - o0);
        int rank, nr;
        const bf16_t* B;
        float scale;
        int rows[BGMV_G];
        const float* dora_g = nullptr;  // the DoRA epilogue's rescale of the row's entry, or null
        {
            const PairEntry en = row_entry(it);
            rank = (int)en.rank;
            nr = 1;
            if (rank == 0) continue;  // uniform over the block
            B = (const bf16_t*)en.b;
            scale = en.scale;
            if constexpr (DORA) dora_g = tg.dora != 0ull ? dora_scale_of(tg, ((const int*)p.idx)[it]) : nullptr;
#pragma unroll
            for (int g = 0; g < BGMV_G; ++g) rows[g] = it;
        }
        __syncthreads();  // the previous unit no longer reads shared memory

        // y of this unit's row, unless requested before the wait.
        const bool vec_y = ((int)sizeof(Y) * ys % 16 == 0) && ((int)sizeof(Y) * (coff + o0) % 16 == 0) &&
                           aligned16(Yp) && (lc % 8 == 0);
        const bool y_requested = y_early && u == (int)blockIdx.x;
        // Under the overlap the kernel before the shrink may still write y.
        if (!waited && p.overlap == CHAIN_EARLY_READS) {
            grid_dependency_wait();
            waited = true;
        }
        if (vec_y && !y_requested) {
            const int per_row = lc * (int)sizeof(Y) / 16;
#pragma unroll 1
            for (int v = tid; v < nr * per_row; v += BGMV_THREADS) {
                const int g = v / per_row;
                const int c = v - g * per_row;
                const int r = item_row(rows, g);
                cp_async16((unsigned char*)(sY + g * cols) + c * 16,
                           (const unsigned char*)(Yp + (u64)r * ys + coff + o0) + c * 16);
            }
        }
        cp_async_commit();
        // This unit's B rows past the first few are read after the partials
        // are summed: ask L2 for its span now (not for the first unit,
        // above); and for the next unit's. (Spelled !(==): as != the
        // compiler orders the instructions otherwise.)
        if (tid == 32 && !(u == (int)blockIdx.x)) prefetch_l2(B + (u64)o0 * stride, (u64)lc * stride * 2);
        if (tid == 0 && u + (int)gridDim.x < units) {
            const int nit = (u + (int)gridDim.x) / chunks;
            const int no0 = (u + (int)gridDim.x - nit * chunks) * cols;
            // B and the rank of the next row's entry only (the whole entry costs registers).
            const int e = ((const int*)p.idx)[nit];
            if (e >= 0 && e < tg.n_entries) {
                const PairEntry* pe = (const PairEntry*)tg.table + e;
                const u32 r = pe->rank;
                const u64 b = pe->b;
                if (r > 0 && r <= (u32)stride && b != 0)
                    prefetch_l2((const bf16_t*)b + (u64)no0 * stride, (u64)min(cols, tg.out_dim - no0) * stride * 2);
            }
        }

        const int rank8 = (rank + 7) & ~7;
        // B pass: L lanes (a power of two) hold the 8-column chunks of one
        // output row, so a warp reads 32 / L whole rows, contiguous in B.
        const int cpr = rank8 >> 3;
        int L = 1;
        while (L < cpr) L <<= 1;
        const int per_pass = 32 / L;
        const int sub = lane / L;
        const int ch = lane - sub * L;
        const bool vec_b = (stride % 8 == 0) && aligned16(B);
        const int step = BGMV_WARPS * per_pass * BGMV2_UNROLL;
        auto load_b = [&](uint4 (&b)[BGMV2_UNROLL], int base) {
#pragma unroll
            for (int j = 0; j < BGMV2_UNROLL; ++j) {
                const int o = base + j * BGMV_WARPS * per_pass + sub;
                b[j] = (o < lc && ch < cpr) ? load8(B + (u64)(o0 + o) * stride + ch * 8, rank - ch * 8, vec_b)
                                            : make_uint4(0, 0, 0, 0);
            }
        };
        // A warp requests its next B rows right after the last dot products
        // that consume the current ones, so they are in flight during the
        // halving steps (n = 64 on the H200: rank 64 31.1 -> 30.5 µs,
        // 14336 outputs 28.0 -> 26.8). Its first B rows are requested before
        // the partials are summed and before the wait for the shrink (B is
        // not its output), so their round trip overlaps the
        // wait and the partials' (H200, in a graph, n = 64: rank 64 24.33 ->
        // 22.23 µs, 14336 outputs 18.91 -> 17.15).
        uint4 b[BGMV2_UNROLL];
        load_b(b, warp * per_pass);
        if (!waited) {
            grid_dependency_wait();
            waited = true;
        }

        // t = scale * (sum of the K-slice partials), zero from rank to the next multiple of 8.
#pragma unroll 1
        for (int v = tid; v < nr * rank8; v += BGMV_THREADS) {
            const int g = v / rank8;
            const int k = v - g * rank8;
            const int r = item_row(rows, g);
            // Every split loaded unconditionally, then added: the compiler issues all the loads before
            // the first add, one L2 round trip (loads guarded one by one were interleaved with the
            // adds, each add waiting for its load before the next issued). Eight splits or fewer
            // (n >= 64 by default) load eight, which leaves registers for B's first rows unspilled.
            float s = 0.f;
            if (k < rank) {
                const float* part = bgmv2_part(p, t, 0, r) + k;
                const u64 split = (u64)p.n_rows * rpad;
                s = k_splits <= 8 ? sum_splits<8>(part, split, k_splits)
                                  : sum_splits<BGMV2_MAX_SPLITS>(part, split, k_splits);
            }
            sT[g * rpad + k] = s * scale;
        }
        __syncthreads();

#pragma unroll 1
        for (int base = warp * per_pass; base < lc; base += step) {
            // Each lane's partial dots of its 4 rows, summed over the rows' L
            // lanes by halving exchanges (4 shuffles at L = 8 instead of 12;
            // n = 64, rank 64: 31.5 against 35.7 µs with the shrink's butterfly8).
            static_assert(BGMV2_UNROLL == 4, "two halving steps");
#pragma unroll 1
            for (int g = 0; g < nr; ++g) {
                float v[4] = {0.f, 0.f, 0.f, 0.f};
                if (ch < cpr) {
                    const float4 ta = *(const float4*)(sT + g * rpad + ch * 8);
                    const float4 tb = *(const float4*)(sT + g * rpad + ch * 8 + 4);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        float w[8];
                        unpack8(b[j], w);
                        v[j] = ta.x * w[0] + ta.y * w[1] + ta.z * w[2] + ta.w * w[3] + tb.x * w[4] + tb.y * w[5] +
                               tb.z * w[6] + tb.w * w[7];
                    }
                }
                if (g == nr - 1) load_b(b, base + step);  // past lc: zeros, no load
                // Halving steps over bits L/2 and L/4 of the lane, then plain sums below.
                int idx = 0;
                int kept = 4;
                if (L >= 2) {
                    const int off = L >> 1;
                    const bool h = (lane & off) != 0;
                    v[0] = (h ? v[2] : v[0]) + __shfl_xor_sync(0xffffffffu, h ? v[0] : v[2], off);
                    v[1] = (h ? v[3] : v[1]) + __shfl_xor_sync(0xffffffffu, h ? v[1] : v[3], off);
                    idx = h ? 2 : 0;
                    kept = 2;
                }
                if (L >= 4) {
                    const int off = L >> 2;
                    const bool h = (lane & off) != 0;
                    v[0] = (h ? v[1] : v[0]) + __shfl_xor_sync(0xffffffffu, h ? v[0] : v[1], off);
                    idx += h ? 1 : 0;
                    kept = 1;
#pragma unroll 1
                    for (int o2 = L >> 3; o2 > 0; o2 >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o2);
                }
                // Lanes holding the same values: the one with the low bits clear writes.
                if (kept == 1 && (ch & ((L >> 2) - 1)) != 0) continue;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int o = base + (idx + i) * BGMV_WARPS * per_pass + sub;
                    if (i < kept && o < lc) sAcc[g * cols + o] = v[i];
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();
        // Waiting first with the next launch late: let it in once this
        // block's last unit has only its stores left.
        if (p.overlap == CHAIN_WAIT_FIRST && u + (int)gridDim.x >= units) grid_launch_dependents();

        // y += delta (through the DoRA epilogue where the entry has a rescale), rounded once; 16-byte pieces when aligned.
        if (vec_y) {
            const int per_row = lc >> 3;
#pragma unroll 1
            for (int v = tid; v < nr * per_row; v += BGMV_THREADS) {
                const int g = v / per_row;
                const int c = (v - g * per_row) * 8;
                const int r = item_row(rows, g);
                const Y* sy = sY + g * cols + c;
                const float* sa = sAcc + g * cols + c;
                float out8[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) out8[j] = dora_epilogue_if<DORA>(y_load(sy + j) + sa[j], dora_g, tg, o0 + c + j);
                y_store8(Yp + (u64)r * ys + coff + o0 + c, out8);
            }
        } else {
#pragma unroll 1
            for (int v = tid; v < nr * lc; v += BGMV_THREADS) {
                const int g = v / lc;
                const int o = v - g * lc;
                const int r = item_row(rows, g);
                Y* dst = Yp + (u64)r * ys + coff + o0 + o;
                y_store(dst, dora_epilogue_if<DORA>(y_load(dst) + sAcc[g * cols + o], dora_g, tg, o0 + o));
            }
        }
    }
    // A block whose units all had rank 0 still waits, so this grid completes
    // only after the shrink (a following dependent launch relies on it).
    if (!waited) grid_dependency_wait();
}

// Plain, or with the DoRA epilogue compiled in (_dora; decode.cuh).
extern "C" __global__ void __launch_bounds__(BGMV_THREADS, 4) DECODE_NAME(bgmv2_expand_rows_bf16)(const Bgmv2Params p) {
    bgmv2_expand_body<bf16_t, kDecodeDora>(p);
}
extern "C" __global__ void __launch_bounds__(BGMV_THREADS, 4) DECODE_NAME(bgmv2_expand_rows_f32)(const Bgmv2Params p) {
    bgmv2_expand_body<float, kDecodeDora>(p);
}
