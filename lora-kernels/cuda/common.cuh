// Shared definitions for every kernel family. Prepended to each family's
// source by the host (no #include: NVRTC needs no header search path), so
// every family sees the same table structs and bf16 helpers.
//
// The structs here mirror `#[repr(C)]` structs in lora-kernels/src; their
// sizes are asserted on the Rust side.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

// One (adapter, module) pair: device addresses of A [stride, in] and
// B [out, stride] (row-major BF16), its scale and its true rank (0 = none).
struct PairEntry {
    u64 a;
    u64 b;
    float scale;
    u32 rank;
};

// One output target of a LoRA apply: a PairEntry table (already offset to the
// first entry of this (layer, module)), its entry count, the output width and
// the column offset of this target inside y; and the DoRA epilogue's inputs
// (ops/dora.rs): `dora`, 0 or a table of n_entries addresses indexed like the
// PairEntry table (each 0, or an entry's rescale g [out_dim] f32), and
// `bias`, 0 or the projection's base bias [out_dim] f32.
struct LoraTarget {
    u64 table;
    int n_entries;
    int out_dim;
    int y_col_off;
    int pad;
    u64 dora;
    u64 bias;
};

// MAX_TARGETS: from the host's prelude (`cuda_rt::prelude`).

static_assert(sizeof(PairEntry) == 24, "PairEntry mirrors lora_kernels::PairEntry");
static_assert(sizeof(LoraTarget) == 40, "LoraTarget mirrors lora_kernels::ops::TargetParams");

// Fault bits a kernel ORs into the device's fault word instead of touching
// memory it was not given. The host reads and clears the word.
#define FAULT_BAD_INDEX 1u
#define FAULT_BAD_RANK 2u
#define FAULT_BAD_SEQLENS 4u
#define FAULT_BAD_TOKEN 8u
#define FAULT_BAD_OVERLAY_ROW 16u
#define FAULT_BAD_EXPERT 32u

__device__ __forceinline__ void raise_fault(u64 fault, u32 bits) {
    if (fault != 0ull) atomicOr((u32*)fault, bits);
}

__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even, NaN stays NaN (quiet): the same rule as half::bf16::from_f32.
__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) { return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16); }

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
    acc = fmaf(bf_lo(a.x), bf_lo(b.x), acc);
    acc = fmaf(bf_hi(a.x), bf_hi(b.x), acc);
    acc = fmaf(bf_lo(a.y), bf_lo(b.y), acc);
    acc = fmaf(bf_hi(a.y), bf_hi(b.y), acc);
    acc = fmaf(bf_lo(a.z), bf_lo(b.z), acc);
    acc = fmaf(bf_hi(a.z), bf_hi(b.z), acc);
    acc = fmaf(bf_lo(a.w), bf_lo(b.w), acc);
    acc = fmaf(bf_hi(a.w), bf_hi(b.w), acc);
    return acc;
}

__device__ __forceinline__ void unpack8(uint4 w, float* f) {
    f[0] = bf_lo(w.x);
    f[1] = bf_hi(w.x);
    f[2] = bf_lo(w.y);
    f[3] = bf_hi(w.y);
    f[4] = bf_lo(w.z);
    f[5] = bf_hi(w.z);
    f[6] = bf_lo(w.w);
    f[7] = bf_hi(w.w);
}

__device__ __forceinline__ uint4 ldg16(const bf16_t* p) { return __ldg((const uint4*)p); }

__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15ull) == 0ull; }

// acc + sum_j w[j] t[j] over 8 bf16 weights, in j order.
__device__ __forceinline__ float dot8f(uint4 w, const float* t, float acc) {
    float f[8];
    unpack8(w, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(t[j], f[j], acc);
    return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Hint: start pulling [p, p + bytes) into L2. Only the 16-byte aligned
// interior of the range is requested, so nothing outside it is touched.
__device__ __forceinline__ void prefetch_l2(const void* p, u64 bytes) {
#if __CUDA_ARCH__ >= 900
    u64 s = (u64)p;
    u64 e = s + bytes;
    s = (s + 15ull) & ~15ull;
    e = e & ~15ull;
    if (e > s) {
        u64 n = e - s;
        // The bulk prefetch size is a 32-bit count; split huge ranges.
        while (n > 0) {
            u32 chunk = n > 0x40000000ull ? 0x40000000u : (u32)n;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s), "r"(chunk) : "memory");
            s += chunk;
            n -= chunk;
        }
    }
#else
    (void)p;
    (void)bytes;
#endif
}

// How a launch follows the stream's previous kernel (`overlap` in the
// decode kernels' parameter blocks, mirroring bgmv/entry.rs `Chain`): a
// plain launch; a programmatic dependent that reads idx, the tables and the
// adapters before griddepcontrol.wait (the opt-in overlap); or one whose
// blocks wait before any read, as a plain launch would (so they are
// resident, their launch done, when that kernel ends), letting the next
// launch in once their work is out or at once (its own wait keeps it
// behind this kernel).
#define CHAIN_PLAIN 0
#define CHAIN_EARLY_READS 1
#define CHAIN_WAIT_FIRST 2
#define CHAIN_WAIT_FIRST_EARLY_NEXT 3

// Programmatic dependent launch: a kernel launched as a dependent of the
// previous one waits here until that kernel completed and its writes are
// visible; a kernel lets its dependents get resident early by calling
// grid_launch_dependents. Both are no-ops without a dependent launch.
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#else
__device__ __forceinline__ void grid_dependency_wait() {}
__device__ __forceinline__ void grid_launch_dependents() {}
#endif

// The 32-bit shared-window address of a shared-memory pointer.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u64 g = (u64)p;
    u64 s;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"(g));
    return (u32)s;
}

// The DoRA epilogue (ops/dora.rs) of every expand: the rescale g of checked
// entry e (>= 0) at target tg, or null where the target has no DoRA table or
// the entry no DoRA pair there (a plain row: the expand writes y + delta).
__device__ __forceinline__ const float* dora_scale_of(const LoraTarget& tg, int e) {
    return tg.dora != 0ull && e >= 0 ? (const float*)((const u64*)tg.dora)[e] : nullptr;
}

// The value an expand writes at column c (of the target) of a row: v = y +
// delta as the form computed it, and for a DoRA entry (g non-null)
// g[c] * (v - bias[c]) + bias[c], without a fused multiply-add (the CPU
// reference's order, `pairs.rs`); a plain row's v unchanged, bit for bit.
// dora_rescale is that arithmetic on g[c] and bias[c] already loaded (a form
// that brings them in early, e.g. sgmv's expand through shared memory).
__device__ __forceinline__ float dora_rescale(float v, float g, float b) {
    return __fadd_rn(__fmul_rn(g, __fsub_rn(v, b)), b);
}
__device__ __forceinline__ float dora_epilogue(float v, const float* g, const LoraTarget& tg, int c) {
    if (g == nullptr) return v;
    const float b = tg.bias != 0ull ? ((const float*)tg.bias)[c] : 0.f;
    return dora_rescale(v, g[c], b);
}

// The decode kernels' epilogue is a property of the instantiation: DORA
// (the `_dora` entry points, launched where a target of the call carries a
// DoRA table) applies dora_epilogue; a plain instantiation returns v and
// compiles none of it (no g lookup, no branch, no registers).
template <bool DORA>
__device__ __forceinline__ float dora_epilogue_if(float v, const float* g, const LoraTarget& tg, int c) {
    if constexpr (DORA) return dora_epilogue(v, g, tg, c);
    return v;
}

// Output element access for y of type bf16 or f32.
__device__ __forceinline__ float y_load(const bf16_t* p) { return bf2f(*p); }
__device__ __forceinline__ float y_load(const float* p) { return *p; }
__device__ __forceinline__ void y_store(bf16_t* p, float v) { *p = f2bf(v); }
__device__ __forceinline__ void y_store(float* p, float v) { *p = v; }

// Two adjacent outputs (caller guarantees alignment: 4 bytes for bf16, 8 for f32).
__device__ __forceinline__ void y_load2(const bf16_t* p, float& a, float& b) {
    u32 w = *(const u32*)p;
    a = bf_lo(w);
    b = bf_hi(w);
}
__device__ __forceinline__ void y_load2(const float* p, float& a, float& b) {
    float2 w = *(const float2*)p;
    a = w.x;
    b = w.y;
}
// Two floats to bf16x2 (lo in the low half) with the hardware's round to
// nearest even: the same result as f2bf for every non-NaN value, in one
// instruction instead of a handful per value.
__device__ __forceinline__ u32 pack_bf2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two adjacent outputs (4- or 8-byte aligned), rounded by the hardware.
__device__ __forceinline__ void y_store2(bf16_t* p, float a, float b) { *(u32*)p = pack_bf2_rn(a, b); }
__device__ __forceinline__ void y_store2(float* p, float a, float b) { *(float2*)p = make_float2(a, b); }

// Exclusive prefix sum over a block of BLOCK threads (BLOCK a multiple of 32,
// at most 1024). `scratch` holds at least BLOCK / 32 + 1 ints. Returns the
// exclusive prefix of v and stores the block total in *total.
template <int BLOCK>
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int* total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < BLOCK / 32 ? scratch[lane] : 0;
        int wincl = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int n = __shfl_up_sync(0xffffffffu, wincl, o);
            if (lane >= o) wincl += n;
        }
        if (lane < BLOCK / 32) scratch[lane] = wincl - w;
        if (lane == BLOCK / 32 - 1) scratch[BLOCK / 32] = wincl;
    }
    __syncthreads();
    int res = scratch[warp] + incl - v;
    *total = scratch[BLOCK / 32];
    __syncthreads();
    return res;
}
