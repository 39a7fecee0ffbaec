// DoRA's staging kernel (lora-kernels/src/ops/dora.rs). The rescale itself is
// every expand's epilogue (dora_epilogue in common.cuh).

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
