// Token-overlay kernels: the row diff that finds overridden vocab rows, the
// embedding lookup that takes a slot's overlay row where it has one, and the
// lm_head overlay that rewrites the logits of a slot's overridden ids; and the
// LoRA on the input embedding (a gather of A's token column, an expand by B).

// Per-slot embedding overlay: slot_map (i32[vocab], row index or -1) and the
// compacted rows ([n_rows, h] bf16). slot_map == 0: the slot has no overlay.
struct EmbedOverlayEntry {
    u64 slot_map;
    u64 rows;
    u32 n_rows;
    u32 pad;
};
static_assert(sizeof(EmbedOverlayEntry) == 24, "mirrors lora_kernels::EmbedOverlayEntry");

// Per-slot lm_head overlay: ids (u32[count], vocab ids) and rows ([count, h]
// bf16). count == 0: the slot has no head overlay.
struct LmHeadOverlayEntry {
    u64 ids;
    u64 rows;
    u32 count;
    u32 pad;
};
static_assert(sizeof(LmHeadOverlayEntry) == 24, "mirrors lora_kernels::LmHeadOverlayEntry");

struct RowDiffParams {
    u64 table;
    u64 base;
    u64 out;  // u8[vocab]
    int vocab;
    int h;
    int table_stride;
    int base_stride;
    float thresh;
    int pad;
};
static_assert(sizeof(RowDiffParams) == 48, "mirrors overlay.rs");

// out[v] = 1 when some |table[v, j] - base[v, j]| is not <= thresh (a NaN
// difference counts as a difference), else 0. One warp per row.
extern "C" __global__ void rowdiff_bf16(const RowDiffParams p) {
    const bf16_t* T = (const bf16_t*)p.table;
    const bf16_t* Bs = (const bf16_t*)p.base;
    unsigned char* out = (unsigned char*)p.out;
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    const bool vec = (p.h % 8 == 0) && (p.table_stride % 8 == 0) && (p.base_stride % 8 == 0) && aligned16(T) &&
                     aligned16(Bs);
    for (int v = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; v < p.vocab; v += warps) {
        const bf16_t* tr = T + (u64)v * p.table_stride;
        const bf16_t* br = Bs + (u64)v * p.base_stride;
        bool diff = false;
        if (vec) {
            for (int c = lane * 8; c < p.h; c += 256) {
                float a[8];
                float b[8];
                unpack8(ldg16(tr + c), a);
                unpack8(ldg16(br + c), b);
#pragma unroll
                for (int j = 0; j < 8; ++j) diff |= !(fabsf(a[j] - b[j]) <= p.thresh);
            }
        } else {
            for (int c = lane; c < p.h; c += 32) diff |= !(fabsf(bf2f(tr[c]) - bf2f(br[c])) <= p.thresh);
        }
        const unsigned any = __ballot_sync(0xffffffffu, diff);
        if (lane == 0) out[v] = any ? 1 : 0;
    }
}

struct EmbedParams {
    u64 ids;       // u32[n]
    u64 row_slot;  // i32[n], -1: base only
    u64 base;      // [vocab, base_stride] bf16
    u64 entries;   // EmbedOverlayEntry[n_slots]
    u64 out;       // [n, out_stride] bf16
    u64 fault;
    int n;
    int h;
    int vocab;        // rows of base and entries of each slot_map
    int n_slots;
    int base_stride;
    int out_stride;
    int vocab_start;  // the token id of base's row 0 (a vocab-parallel rank's first id)
    int vocab_size;   // the model's vocabulary: ids at or past it are faults
};
static_assert(sizeof(EmbedParams) == 80, "mirrors overlay.rs");

// With t = ids[i] - vocab_start: out[i, :] = overlay row slot_map_s[t] of
// slot s = row_slot[i] when it is >= 0, else base[t, :]. An id outside this
// rank's rows (vocab_start .. vocab_start + vocab) writes a zero row (a
// vocab-parallel rank's masked lookup); an id past vocab_size writes a zero
// row and raises a fault. One block per row.
extern "C" __global__ void embed_overlay_bf16(const EmbedParams p) {
    const u32* ids = (const u32*)p.ids;
    const int* rs = (const int*)p.row_slot;
    const bf16_t* base = (const bf16_t*)p.base;
    const EmbedOverlayEntry* ents = (const EmbedOverlayEntry*)p.entries;
    bf16_t* out = (bf16_t*)p.out;
    for (int i = blockIdx.x; i < p.n; i += gridDim.x) {
        const u32 gid = ids[i];
        const u32 id = gid - (u32)p.vocab_start;
        bf16_t* dst = out + (u64)i * p.out_stride;
        const bf16_t* src = 0;
        if (gid >= (u32)p.vocab_size) {
            if (threadIdx.x == 0) raise_fault(p.fault, FAULT_BAD_TOKEN);
        } else if (gid < (u32)p.vocab_start || id >= (u32)p.vocab) {
            // Another rank's token: a zero row here.
        } else {
            src = base + (u64)id * p.base_stride;
            const int s = rs != 0 ? rs[i] : -1;
            if (s >= p.n_slots) {
                if (threadIdx.x == 0) raise_fault(p.fault, FAULT_BAD_INDEX);
            } else if (s >= 0) {
                const EmbedOverlayEntry en = ents[s];
                if (en.slot_map != 0) {
                    const int m = ((const int*)en.slot_map)[id];
                    if (m >= 0) {
                        if ((u32)m >= en.n_rows) {
                            if (threadIdx.x == 0) raise_fault(p.fault, FAULT_BAD_OVERLAY_ROW);
                        } else {
                            src = (const bf16_t*)en.rows + (u64)m * p.h;
                        }
                    }
                }
            }
        }
        const bool vec = src != 0 && (p.h % 8 == 0) && (p.out_stride % 8 == 0) && aligned16(src) && aligned16(dst);
        if (vec) {
            for (int c = threadIdx.x * 8; c < p.h; c += blockDim.x * 8) *(uint4*)(dst + c) = ldg16(src + c);
        } else {
            for (int c = threadIdx.x; c < p.h; c += blockDim.x) dst[c] = src != 0 ? src[c] : (bf16_t)0;
        }
    }
}

struct LmHeadParams {
    u64 hidden;    // [n, hidden_stride] bf16
    u64 row_slot;  // i32[n]
    u64 entries;   // LmHeadOverlayEntry[n_slots]
    u64 logits;    // [n, logits_stride] (bf16 or f32)
    u64 fault;
    int n;
    int h;
    int vocab;
    int n_slots;
    int hidden_stride;
    int logits_stride;
};
static_assert(sizeof(LmHeadParams) == 64, "mirrors overlay.rs");

// logits[i, ids[k]] = dot(hidden[i, :], rows[k, :]) (f32) for every row i
// whose slot has a head overlay. Grid (rows, blocks over k); one warp per k.
template <typename Y>
__device__ __forceinline__ void lmhead_overlay_body(const LmHeadParams& p) {
    const bf16_t* H = (const bf16_t*)p.hidden;
    const int* rs = (const int*)p.row_slot;
    const LmHeadOverlayEntry* ents = (const LmHeadOverlayEntry*)p.entries;
    Y* L = (Y*)p.logits;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    for (int i = blockIdx.x; i < p.n; i += gridDim.x) {
        const int s = rs[i];
        if (s < 0) continue;
        if (s >= p.n_slots) {
            if (threadIdx.x == 0 && blockIdx.y == 0) raise_fault(p.fault, FAULT_BAD_INDEX);
            continue;
        }
        const LmHeadOverlayEntry en = ents[s];
        if (en.count == 0 || en.ids == 0 || en.rows == 0) continue;
        const u32* oid = (const u32*)en.ids;
        const bf16_t* rows = (const bf16_t*)en.rows;
        const bf16_t* hr = H + (u64)i * p.hidden_stride;
        const bool vec = (p.h % 8 == 0) && aligned16(hr) && aligned16(rows);
        for (int k = blockIdx.y * nw + warp; k < (int)en.count; k += gridDim.y * nw) {
            const u32 id = oid[k];
            const bf16_t* wr = rows + (u64)k * p.h;
            float acc = 0.f;
            if (vec) {
                for (int c = lane * 8; c < p.h; c += 256) acc = dot8(ldg16(wr + c), ldg16(hr + c), acc);
            } else {
                for (int c = lane; c < p.h; c += 32) acc = fmaf(bf2f(wr[c]), bf2f(hr[c]), acc);
            }
            acc = warp_sum(acc);
            if (lane == 0) {
                if (id >= (u32)p.vocab) {
                    raise_fault(p.fault, FAULT_BAD_TOKEN);
                } else {
                    y_store(L + (u64)i * p.logits_stride + id, acc);
                }
            }
        }
    }
}

extern "C" __global__ void lmhead_overlay_bf16(const LmHeadParams p) { lmhead_overlay_body<bf16_t>(p); }
extern "C" __global__ void lmhead_overlay_f32(const LmHeadParams p) { lmhead_overlay_body<float>(p); }

struct EmbedLoraParams {
    u64 ids;       // u32[n]
    u64 row_slot;  // i32[n], -1: no delta
    u64 table;     // PairEntry[n_entries]: A [stride, vocab], B [h, stride]
    u64 out;       // [n, out_stride] (f32 or bf16)
    u64 fault;
    int n;
    int h;
    int vocab;        // columns of A
    int n_entries;
    int stride;
    int out_stride;
    int vocab_start;  // the token id of A's column 0 (a vocab-parallel rank's first id)
    int vocab_size;   // the model's vocabulary: ids at or past it are faults
};
static_assert(sizeof(EmbedLoraParams) == 72, "mirrors embed_lora.rs");

// LoRA on the input embedding: out[i, :] += scale * B * A[:, ids[i]] for every
// row i whose slot s = row_slot[i] has a pair (rank > 0) in table[s]. One
// block per row; each thread expands some columns of B over the rank, reading
// A's column t - vocab_start (rank values, vocab apart) from L1. A token
// outside A's columns (another vocab-parallel rank's) adds nothing. A slot
// past the table, a bad entry or a token id past vocab_size raises a fault
// and leaves the row.
template <typename Y>
__device__ __forceinline__ void embed_lora_body(const EmbedLoraParams& p) {
    const u32* ids = (const u32*)p.ids;
    const int* rs = (const int*)p.row_slot;
    const PairEntry* table = (const PairEntry*)p.table;
    Y* out = (Y*)p.out;
    for (int i = blockIdx.x; i < p.n; i += gridDim.x) {
        const int s = rs[i];
        if (s < 0) continue;
        if (s >= p.n_entries) {
            if (threadIdx.x == 0) raise_fault(p.fault, FAULT_BAD_INDEX);
            continue;
        }
        const PairEntry e = table[s];
        if (e.rank == 0) continue;
        if ((int)e.rank > p.stride || e.a == 0ull || e.b == 0ull) {
            if (threadIdx.x == 0) raise_fault(p.fault, FAULT_BAD_RANK);
            continue;
        }
        const u32 gid = ids[i];
        if (gid >= (u32)p.vocab_size) {
            if (threadIdx.x == 0) raise_fault(p.fault, FAULT_BAD_TOKEN);
            continue;
        }
        const u32 t = gid - (u32)p.vocab_start;
        if (gid < (u32)p.vocab_start || t >= (u32)p.vocab) continue;
        const bf16_t* A = (const bf16_t*)e.a;
        const bf16_t* B = (const bf16_t*)e.b;
        const int r = (int)e.rank;
        Y* dst = out + (u64)i * p.out_stride;
        for (int c = threadIdx.x; c < p.h; c += blockDim.x) {
            const bf16_t* brow = B + (u64)c * p.stride;
            float acc = 0.f;
            for (int k = 0; k < r; ++k) acc = fmaf(bf2f(brow[k]), bf2f(A[(u64)k * p.vocab + t]), acc);
            y_store(dst + c, y_load(dst + c) + e.scale * acc);
        }
    }
}

extern "C" __global__ void embed_lora_f32(const EmbedLoraParams p) { embed_lora_body<float>(p); }
extern "C" __global__ void embed_lora_bf16(const EmbedLoraParams p) { embed_lora_body<bf16_t>(p); }
