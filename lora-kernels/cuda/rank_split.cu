// The two halves of a rank-split LoRA apply (lora-kernels/src/ops/rank_split.rs):
// the shrink of a rank's block of A's rank rows into an f32 part, and, after the
// caller's all-gather of every rank's part, the expand of the gathered rank
// vector by the rank's B rows. One block per (row, target); rows grid-strided.

struct RankShrinkParams {
    u64 x;         // bf16 [n_rows, x_stride]
    u64 row_slot;  // i32 [n_rows], -1: base
    u64 out;       // f32 [n_rows][n_targets][part_rows]
    u64 fault;
    int n_rows;
    int in_dim;
    int x_stride;
    int n_targets;
    int part;       // this rank's block of rank rows
    int part_rows;  // rows per block (stride / parts)
    int stride;     // the padded rank (max_rank)
    int pad;
    LoraTarget targets[MAX_TARGETS];
};

struct RankExpandParams {
    u64 gathered;  // f32 [parts][part_len]
    u64 row_slot;  // i32 [n_rows]
    u64 y;
    u64 fault;
    int n_rows;
    int y_stride;
    int n_targets;
    int parts;
    int part_rows;
    int stride;
    int part_len;  // n_rows * n_targets * part_rows
    int pad;
    LoraTarget targets[MAX_TARGETS];
};

static_assert(sizeof(RankShrinkParams) == 64 + sizeof(LoraTarget) * MAX_TARGETS, "mirrors rank_split.rs");
static_assert(sizeof(RankExpandParams) == 64 + sizeof(LoraTarget) * MAX_TARGETS, "mirrors rank_split.rs");

// The entry of row slot s, or false (base row, rank 0, or a fault raised).
__device__ __forceinline__ bool rank_split_entry(const LoraTarget& t, int s, int stride, u64 fault, PairEntry& e) {
    if (s < 0) return false;
    if (s >= t.n_entries) {
        if (threadIdx.x == 0) raise_fault(fault, FAULT_BAD_INDEX);
        return false;
    }
    e = ((const PairEntry*)t.table)[s];
    if (e.rank == 0u) return false;
    if ((int)e.rank > stride || e.a == 0ull || e.b == 0ull) {
        if (threadIdx.x == 0) raise_fault(fault, FAULT_BAD_RANK);
        return false;
    }
    return true;
}

// out[i, t, j] = sum_c A[j, c] x[i, c] for part rows j whose global rank row is
// below the entry's rank, 0 elsewhere: every element is written. One warp per
// rank row j, lanes over the input columns, a shuffle reduction.
extern "C" __global__ void rank_shrink_part(const RankShrinkParams p) {
    const int t = blockIdx.y;
    const LoraTarget tg = p.targets[t];
    const int* rs = (const int*)p.row_slot;
    const bf16_t* x = (const bf16_t*)p.x;
    float* out = (float*)p.out;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (int i = blockIdx.x; i < p.n_rows; i += gridDim.x) {
        float* dst = out + ((u64)i * p.n_targets + t) * p.part_rows;
        PairEntry e;
        int rows = 0;
        if (rank_split_entry(tg, rs[i], p.stride, p.fault, e)) {
            rows = (int)e.rank - p.part * p.part_rows;
            rows = rows < 0 ? 0 : (rows > p.part_rows ? p.part_rows : rows);
        }
        const bf16_t* xr = x + (u64)i * p.x_stride;
        for (int j = warp; j < p.part_rows; j += warps) {
            float acc = 0.f;
            if (j < rows) {
                const bf16_t* arow = (const bf16_t*)e.a + (u64)j * p.in_dim;
                for (int c = lane; c < p.in_dim; c += 32) acc = fmaf(bf2f(arow[c]), bf2f(xr[c]), acc);
                for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            }
            if (lane == 0) dst[j] = acc;
        }
    }
}

// y[i, cols of t] += scale * sum_{k < rank} B[o, k] v[k], v the gathered rank
// vector of (i, t): rank row k in part k / part_rows. The vector goes to shared
// memory first; threads walk the output columns.
template <typename Y>
__device__ __forceinline__ void rank_expand_body(const RankExpandParams& p) {
    extern __shared__ float v[];
    const int t = blockIdx.y;
    const LoraTarget tg = p.targets[t];
    const int* rs = (const int*)p.row_slot;
    const float* g = (const float*)p.gathered;
    for (int i = blockIdx.x; i < p.n_rows; i += gridDim.x) {
        PairEntry e;
        const bool on = rank_split_entry(tg, rs[i], p.stride, p.fault, e);
        if (!on) continue;  // uniform over the block: no barrier is skipped by some threads only
        const int rank = (int)e.rank;
        const u64 cell = ((u64)i * p.n_targets + t) * p.part_rows;
        __syncthreads();  // the previous row's readers are done with v
        for (int k = threadIdx.x; k < rank; k += blockDim.x)
            v[k] = g[(u64)(k / p.part_rows) * p.part_len + cell + k % p.part_rows];
        __syncthreads();
        const bf16_t* B = (const bf16_t*)e.b;
        Y* dst = (Y*)p.y + (u64)i * p.y_stride + tg.y_col_off;
        for (int o = threadIdx.x; o < tg.out_dim; o += blockDim.x) {
            const bf16_t* brow = B + (u64)o * p.stride;
            float acc = 0.f;
            for (int k = 0; k < rank; ++k) acc = fmaf(bf2f(brow[k]), v[k], acc);
            y_store(dst + o, y_load(dst + o) + e.scale * acc);
        }
    }
}

extern "C" __global__ void rank_expand_gathered_f32(const RankExpandParams p) { rank_expand_body<float>(p); }
extern "C" __global__ void rank_expand_gathered_bf16(const RankExpandParams p) { rank_expand_body<bf16_t>(p); }
