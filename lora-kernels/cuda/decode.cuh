// What the decode families share: the rows' entry checks and the 8-aligned
// split of a dimension. Prepended after cluster.cuh and ptx.cuh to bgmv.cu,
// bgmv_entry.cu and bgmv_rows.cu (`cuda_rt::Family::source`).

// Each decode file is compiled as two modules (`cuda_rt::Family`): its plain
// kernels (DECODE_DORA 0) and the same kernels with the DoRA epilogue
// compiled in (DECODE_DORA 1), each named NAME_dora. A pool that never
// launches a DoRA call never compiles the second. The kernels that write no
// y (the item list, the shrinks, the empty launch) are in the plain module.
#ifndef DECODE_DORA
#error "DECODE_DORA is defined by the host (cuda_rt::Family::source)"
#endif
constexpr bool kDecodeDora = DECODE_DORA != 0;
#if DECODE_DORA
#define DECODE_NAME(NAME) NAME##_dora
#else
#define DECODE_NAME(NAME) NAME
#endif

// Tables of at most this many entries are copied whole into shared memory
// while the row indices arrive, so an item's entry is no second round trip.
#define BGMV_TABLE_SMEM 128

// Piece i of [0, n) split into `parts` pieces whose starts are multiples of 8.
__device__ __forceinline__ void split8(int n, int parts, int i, int& b, int& e) {
    int per = (n + parts - 1) / parts;
    per = (per + 7) & ~7;
    b = min(n, i * per);
    e = min(n, b + per);
}

// A window row's entry index as the scans use it: -1 (no delta) for a
// negative one, or for one past the table, which also raises a fault when `report`.
__device__ __forceinline__ int checked_index(int e, int n_entries, u64 fault, bool report) {
    if (e >= n_entries) {
        if (report) raise_fault(fault, FAULT_BAD_INDEX);
        e = -1;
    }
    return e < 0 ? -1 : e;
}

// A table entry the kernels must not read through: a rank past the stride
// (or the kernels' most), or a missing A or B address. Counted as rank 0.
__device__ __forceinline__ bool bad_entry(const PairEntry& en, int stride) {
    return en.rank > (u32)stride || en.rank > BGMV_MAX_RANK || (en.rank > 0 && (en.a == 0 || en.b == 0));
}

// The entry a row index names, checked: returns the entry index, or -1 (no
// delta) for a negative index or one past the table (which raises
// FAULT_BAD_INDEX when `report`); a bad entry raises FAULT_BAD_RANK when
// `report` and comes back with rank 0. *en is rank 0 whenever -1 is returned.
__device__ __forceinline__ int checked_entry(int raw, int n_entries, const PairEntry* table, int stride, u64 fault,
                                             bool report, PairEntry* en) {
    const int e = checked_index(raw, n_entries, fault, report);
    *en = {0ull, 0ull, 0.f, 0u};
    if (e >= 0) {
        *en = table[e];
        if (bad_entry(*en, stride)) {
            if (report) raise_fault(fault, FAULT_BAD_RANK);
            en->rank = 0;
        }
    }
    return e;
}

// The parameter block of the entry-clustered and row-register forms.
struct BgeParams {
    u64 x;
    u64 y;
    u64 idx;
    u64 fault;
    int n_rows;
    int in_dim;
    int x_stride;
    int y_stride;
    int overlap;  // how the launch follows the stream's previous kernel: CHAIN_PLAIN .. CHAIN_WAIT_FIRST_EARLY_NEXT
    int stage_cols;  // outputs per block staged in shared memory (B rows and y values), 0: none
    LoraTarget targets[MAX_TARGETS];
};
static_assert(sizeof(BgeParams) == 216 && sizeof(BgeParams) - sizeof(LoraTarget) * MAX_TARGETS == 56, "mirrors bgmv.rs");

// 8 consecutive bf16 at p (16-byte load when aligned, else element loads).
__device__ __forceinline__ uint4 load8_any(const bf16_t* p, bool aligned) {
    if (aligned) return ldg16(p);
    uint4 r;
    r.x = (u32)__ldg(p + 0) | ((u32)__ldg(p + 1) << 16);
    r.y = (u32)__ldg(p + 2) | ((u32)__ldg(p + 3) << 16);
    r.z = (u32)__ldg(p + 4) | ((u32)__ldg(p + 5) << 16);
    r.w = (u32)__ldg(p + 6) | ((u32)__ldg(p + 7) << 16);
    return r;
}

// The bf16 pair (lo, hi) as one word, and the residual pair: t = hi + lo to about 16 bits.
__device__ __forceinline__ void split_pair(float a, float b, u32& hi, u32& lo) {
    hi = pack_bf2_rn(a, b);
    lo = pack_bf2_rn(a - bf_lo(hi), b - bf_hi(hi));
}

// Mask of the ranks r0, r0 + 1 of a bf16 pair word that lie below `rank`.
__device__ __forceinline__ u32 rank_mask(int r0, int rank) {
    return (r0 < rank ? 0x0000ffffu : 0u) | (r0 + 1 < rank ? 0xffff0000u : 0u);
}

// Waiting first (p.overlap, a CHAIN_* code of common.cuh): the wait, and the early next launch, before anything is read.
__device__ __forceinline__ void bge_wait_first(const BgeParams& p) {
    if (p.overlap >= CHAIN_WAIT_FIRST) {  // CHAIN_WAIT_FIRST or CHAIN_WAIT_FIRST_EARLY_NEXT
        grid_dependency_wait();
        if (p.overlap == CHAIN_WAIT_FIRST_EARLY_NEXT) grid_launch_dependents();
    }
}

// The entry bodies' end of a block's work: the next launch let in, unless that was done at once.
__device__ __forceinline__ void bge_next_after_work(const BgeParams& p) {
    if (p.overlap == CHAIN_EARLY_READS || p.overlap == CHAIN_WAIT_FIRST) grid_launch_dependents();
}

// Eight consecutive outputs' values of one row.
struct Out8 {
    float v[8];
};

// The DoRA epilogue (common.cuh) of eight outputs from column c0, where the
// rescale g is non-null (bias null: zeros), for the _dora entry kernels (the
// plain kernels call none of this): the sixteen loads go out together before
// any arithmetic, one round trip; it takes the two addresses, not the
// target, so no kernel parameter's address escapes into the call (which made
// ptxas copy the parameters to the stack, and reload the bias address per
// output). Not inlined: its registers stay out of the entry forms'
// allocation (inlined, it spilled the rank-16 kernels at 80 registers).
__device__ __noinline__ Out8 bge_dora8_apply(Out8 o, const float* g, const float* bias, int c0) {
    float gv[8], bv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) gv[i] = __ldg(g + c0 + i);
    if (bias != nullptr) {
#pragma unroll
        for (int i = 0; i < 8; ++i) bv[i] = __ldg(bias + c0 + i);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) bv[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = dora_rescale(o.v[i], gv[i], bv[i]);
    return o;
}

// The DoRA epilogue (common.cuh) of the entry forms' eight outputs of one
// row, where entry e (checked) has a rescale at target tg: d[j][h] and
// d[j][h + 1] (h = 0 or 2) hold outputs c0 + 2j and c0 + 2j + 1 of the
// target, j < 4 (the permuted tiles' order).
__device__ __forceinline__ void bge_dora8(float (&d)[4][4], int h, const LoraTarget& tg, int e, int c0) {
    const float* g = dora_scale_of(tg, e);
    if (g == nullptr) return;
    Out8 o;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        o.v[2 * j] = d[j][h];
        o.v[2 * j + 1] = d[j][h + 1];
    }
    o = bge_dora8_apply(o, g, (const float*)tg.bias, c0);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        d[j][h] = o.v[2 * j];
        d[j][h + 1] = o.v[2 * j + 1];
    }
}
