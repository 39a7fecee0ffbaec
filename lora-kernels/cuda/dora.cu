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

// One DoRA pair's rescale (dora_row_scale in dora.rs): g[o] = m[o] / ||W[o, :] +
// scale * (B A)[o, :]||, B A summed over the rank in f32 (no fused multiply-add, as
// the CPU reference), the squares in f64; one block per output row.
struct DoraNormParams {
    u64 w;  // [out, in] f32
    u64 a;  // [rank, in] bf16
    u64 b;  // [out, stride] bf16
    u64 m;  // [out] f32
    u64 g;  // [out] f32
    int out_dim;
    int in_dim;
    int rank;
    int stride;
    float scale;
    int pad;
};

static_assert(sizeof(DoraNormParams) == 64, "mirrors dora.rs");

extern "C" __global__ void dora_row_scale(const DoraNormParams p) {
    __shared__ double partial[256];
    const float* w = (const float*)p.w;
    const bf16_t* a = (const bf16_t*)p.a;
    const bf16_t* b = (const bf16_t*)p.b;
    for (int o = blockIdx.x; o < p.out_dim; o += gridDim.x) {
        const bf16_t* brow = b + (u64)o * p.stride;
        double sum = 0.0;
        for (int i = threadIdx.x; i < p.in_dim; i += blockDim.x) {
            float lora = 0.0f;
            for (int k = 0; k < p.rank; ++k) {
                lora = __fadd_rn(lora, __fmul_rn(bf2f(brow[k]), bf2f(a[(u64)k * p.in_dim + i])));
            }
            const double v = (double)__fadd_rn(w[(u64)o * p.in_dim + i], __fmul_rn(p.scale, lora));
            sum += v * v;
        }
        partial[threadIdx.x] = sum;
        __syncthreads();
        for (int h = blockDim.x / 2; h > 0; h /= 2) {
            if (threadIdx.x < h) partial[threadIdx.x] += partial[threadIdx.x + h];
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            const float norm = (float)sqrt(partial[0]);
            ((float*)p.g)[o] = __fdiv_rn(((const float*)p.m)[o], norm);
        }
        __syncthreads();
    }
}
