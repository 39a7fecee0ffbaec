// The DoRA rescale (lora-kernels/src/ops/dora.rs): after the LoRA expand has
// written y = W x + b + s·B A x in place, y <- g * (y - b) + b on the columns
// of each target for every row whose slot has a DoRA pair there. Rows of other
// slots and base rows (-1) are not touched. Rounded as the CPU reference is:
// no fused multiply-add (__fmul_rn / __fsub_rn / __fadd_rn).

struct DoraTargetParams {
    u64 table;  // [n_entries] addresses of each slot's g [out_dim] (f32), 0 = no DoRA pair
    u64 bias;   // [out_dim] f32, the projection's base bias (zeros without one)
    int n_entries;
    int out_dim;
    int y_col_off;
    int pad;
};

struct DoraParams {
    u64 row_slot;  // [n_rows] i32
    u64 y;
    u64 fault;
    int n_rows;
    int y_stride;
    int n_targets;
    int pad;
    DoraTargetParams t[MAX_TARGETS];
};

static_assert(sizeof(DoraTargetParams) == 32, "mirrors dora.rs");
static_assert(sizeof(DoraParams) == 40 + 32 * MAX_TARGETS, "mirrors dora.rs");

__device__ __forceinline__ float dora_load(const float* y) { return *y; }
__device__ __forceinline__ float dora_load(const bf16_t* y) { return bf2f(*y); }
__device__ __forceinline__ void dora_store(float* y, float v) { *y = v; }
__device__ __forceinline__ void dora_store(bf16_t* y, float v) { *y = f2bf(v); }

// One block per row (grid-strided); the block's threads walk the columns.
template <typename Y>
__device__ __forceinline__ void dora_rescale_impl(const DoraParams& p) {
    const int* rs = (const int*)p.row_slot;
    for (int r = blockIdx.x; r < p.n_rows; r += gridDim.x) {
        const int s = rs[r];
        if (s < 0) continue;
        Y* row = (Y*)p.y + (u64)r * p.y_stride;
        for (int k = 0; k < p.n_targets; ++k) {
            const DoraTargetParams t = p.t[k];
            if (s >= t.n_entries) {
                if (threadIdx.x == 0) raise_fault(p.fault, FAULT_BAD_INDEX);
                continue;
            }
            const u64 ga = ((const u64*)t.table)[s];
            if (ga == 0ull) continue;
            const float* g = (const float*)ga;
            const float* b = (const float*)t.bias;
            Y* cols = row + t.y_col_off;
            for (int c = threadIdx.x; c < t.out_dim; c += blockDim.x) {
                const float bc = b[c];
                const float v = __fadd_rn(__fmul_rn(g[c], __fsub_rn(dora_load(cols + c), bc)), bc);
                dora_store(cols + c, v);
            }
        }
    }
}

extern "C" __global__ void dora_rescale_bf16(const DoraParams p) { dora_rescale_impl<bf16_t>(p); }
extern "C" __global__ void dora_rescale_f32(const DoraParams p) { dora_rescale_impl<float>(p); }
