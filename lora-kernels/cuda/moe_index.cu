// Entry-index builders for routed-expert LoRA. Both write, per expanded row,
// the index `expert * max_loras + adapter` into a [num_experts * max_loras]
// PairEntry table, or -1 (no delta), for the row-indexed apply (bgmv).

struct MoeDecodeIndexParams {
    u64 row_adapter;  // i32[n_tokens]
    u64 topk_ids;     // i32[n_tokens * top_k]
    u64 idx;          // i32[n_tokens * top_k] (out)
    u64 fault;
    int n_expanded;
    int top_k;
    int max_loras;
    int n_experts;
};
static_assert(sizeof(MoeDecodeIndexParams) == 48, "mirrors moe_index.rs");

// Decode: expanded row r belongs to token r / top_k.
extern "C" __global__ void moe_decode_index_i32(const MoeDecodeIndexParams p) {
    const int* ra = (const int*)p.row_adapter;
    const int* ids = (const int*)p.topk_ids;
    int* idx = (int*)p.idx;
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < p.n_expanded; r += gridDim.x * blockDim.x) {
        const int a = ra[r / p.top_k];
        int out = -1;
        if (a >= 0) {
            const int e = ids[r];
            if (a >= p.max_loras) {
                raise_fault(p.fault, FAULT_BAD_INDEX);
            } else if (e < 0 || e >= p.n_experts) {
                raise_fault(p.fault, FAULT_BAD_EXPERT);
            } else {
                out = e * p.max_loras + a;
            }
        }
        idx[r] = out;
    }
}

struct MoeSortedIndexParams {
    u64 sorted_token;    // i32[n_sorted]: the expanded row each sorted row came from
    u64 expert_offsets;  // i32[n_experts + 1]
    u64 row_adapter;     // i32[n_tokens]
    u64 idx;             // i32[n_sorted] (out)
    u64 fault;
    int n_sorted;
    int n_experts;
    int top_k;
    int max_loras;
    int n_tokens;
    int pad;
};
static_assert(sizeof(MoeSortedIndexParams) == 64, "mirrors moe_index.rs");

// The expert owning sorted row i: the largest e < n_experts with
// offsets[e] <= i (binary search), and only if i < offsets[e + 1]; else -1.
// The CPU reference runs the same search, so both agree on any input.
__device__ __forceinline__ int owning_expert(const int* off, int n_experts, int i) {
    int lo = 0;
    int hi = n_experts;  // answer in [lo, hi)
    if (n_experts <= 0 || off[0] > i) return -1;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (off[mid] <= i) lo = mid; else hi = mid;
    }
    return i < off[lo + 1] ? lo : -1;
}

extern "C" __global__ void moe_sorted_index_i32(const MoeSortedIndexParams p) {
    const int* st = (const int*)p.sorted_token;
    const int* off = (const int*)p.expert_offsets;
    const int* ra = (const int*)p.row_adapter;
    int* idx = (int*)p.idx;
    const long long n_expanded = (long long)p.n_tokens * p.top_k;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n_sorted; i += gridDim.x * blockDim.x) {
        int out = -1;
        const int e = owning_expert(off, p.n_experts, i);
        const int src = st[i];
        // A source row outside [0, n_tokens * top_k) is a padding row: no delta.
        if (e >= 0 && src >= 0 && (long long)src < n_expanded) {
            const int a = ra[src / p.top_k];
            if (a >= p.max_loras) {
                raise_fault(p.fault, FAULT_BAD_INDEX);
            } else if (a >= 0) {
                out = e * p.max_loras + a;
            }
        }
        idx[i] = out;
    }
}
