// Slot repack: write regions of a pool slot from the raw bytes of an
// adapter file already on the device. Each region is a row-major source
// block `[rows, src_cols]` (BF16, F16 or F32, any byte alignment) placed at
// the top-left of a destination block `[dst_rows, dst_cols]` of BF16; every
// other destination element is zero. The conversions round like lora-pool's
// host packer (half::bf16::from_f32 after an exact f16 -> f32).

struct RepackRegion {
    u64 src_byte;  // first source byte
    u64 dst_elem;  // first destination element
    u32 rows;      // source rows (0: all zeros)
    u32 src_cols;
    u32 dst_rows;  // >= rows
    u32 dst_cols;  // >= src_cols
    u32 dtype;     // 0 BF16, 1 F16, 2 F32
    u32 pad;
};
static_assert(sizeof(RepackRegion) == 40, "mirrors lora_kernels::ops::repack::RepackRegion");

struct RepackParams {
    u64 regions;  // const RepackRegion*
    u64 src;      // const u8*
    u64 dst;      // bf16_t*
    u64 gate;     // const u64*: write nothing unless it holds all ones; 0: no gate
};

// f16 bits -> f32, exact; NaN keeps its payload with the quiet bit set (as half::f16::to_f32).
__device__ __forceinline__ float repack_f16(u32 h) {
    const u32 sign = (h & 0x8000u) << 16;
    const u32 exp = h & 0x7c00u;
    const u32 man = h & 0x03ffu;
    if (exp == 0x7c00u) return __uint_as_float(sign | 0x7f800000u | (man != 0u ? 0x400000u | (man << 13) : 0u));
    if (exp == 0u) {
        // Zero or subnormal: man * 2^-24, exact in f32.
        const float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 0x1c000u) << 13) | (man << 13));
}

__device__ __forceinline__ bf16_t repack_load(const unsigned char* s, u64 i, u32 dtype) {
    if (dtype == 2u) {
        const unsigned char* b = s + 4ull * i;
        const u32 w = (u32)b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16) | ((u32)b[3] << 24);
        return f2bf(__uint_as_float(w));
    }
    const unsigned char* b = s + 2ull * i;
    const u32 h = (u32)b[0] | ((u32)b[1] << 8);
    return dtype == 1u ? f2bf(repack_f16(h)) : (bf16_t)h;
}

// grid (x: blocks per region, y: region), 256 threads.
extern "C" __global__ void repack_regions(const RepackParams p) {
    // The gate is the flag of a value scan queued before this launch on the
    // same stream: a scan that found a value not finite leaves it cleared,
    // and the destination is then left as it was.
    if (p.gate != 0ull && *(const volatile u64*)p.gate != ~0ull) return;
    const RepackRegion r = ((const RepackRegion*)p.regions)[blockIdx.y];
    const unsigned char* s = (const unsigned char*)p.src + r.src_byte;
    bf16_t* d = (bf16_t*)p.dst + r.dst_elem;
    const u64 total = (u64)r.dst_rows * r.dst_cols;
    const u64 step = (u64)gridDim.x * blockDim.x;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool contiguous = r.src_cols == r.dst_cols || r.rows == 0u;
    if (contiguous && r.dtype == 0u && ((((u64)s) | ((u64)d)) & 15ull) == 0ull) {
        // The copy is the first `n` elements, then zeros: 16-byte pieces.
        const u64 n = (u64)r.rows * r.src_cols;
        const u64 pieces = total / 8ull;
        for (u64 v = first; v < pieces; v += step) {
            const u64 e = 8ull * v;
            if (e + 8ull <= n) {
                ((uint4*)d)[v] = ((const uint4*)s)[v];
            } else if (e >= n) {
                ((uint4*)d)[v] = make_uint4(0u, 0u, 0u, 0u);
            } else {
                for (u64 k = e; k < e + 8ull; ++k) d[k] = k < n ? ((const bf16_t*)s)[k] : (bf16_t)0;
            }
        }
        for (u64 k = 8ull * pieces + first; k < total; k += step) d[k] = k < n ? ((const bf16_t*)s)[k] : (bf16_t)0;
        return;
    }
    for (u64 e = first; e < total; e += step) {
        const u64 row = e / r.dst_cols;
        const u64 col = e - row * r.dst_cols;
        d[e] = (row < r.rows && col < r.src_cols) ? repack_load(s, row * r.src_cols + col, r.dtype) : (bf16_t)0;
    }
}

struct ScanParams {
    u64 regions;  // const RepackRegion*
    u64 src;      // const u8*
    u64 hits;     // u64 per region, all ones before the launch
    u64 any;      // u64, all ones before the launch; cleared on any hit
};

__device__ __forceinline__ bool bf_not_finite(u32 h) { return (h & 0x7f80u) == 0x7f80u; }

// For each region, the first element of its source block [rows, src_cols]
// (row-major index) that is not finite once converted to BF16 as
// repack_regions converts it (a NaN or an infinity, or an F32 value that
// rounds past BF16's range): atomicMin into hits[region], and `any`
// cleared (the gate of a repack queued after it). Reads the source only.
// grid (x: blocks per region, y: region), 256 threads.
extern "C" __global__ void first_non_finite(const ScanParams p) {
    const RepackRegion r = ((const RepackRegion*)p.regions)[blockIdx.y];
    const unsigned char* s = (const unsigned char*)p.src + r.src_byte;
    const u64 n = (u64)r.rows * r.src_cols;
    const u64 step = (u64)gridDim.x * blockDim.x;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    // Each thread's elements come in increasing order, so its first hit is
    // its least; the least over threads is the region's.
    u64 found = ~0ull;
    if (r.dtype == 0u && (((u64)s) & 15ull) == 0ull) {
        const u64 pieces = n / 8ull;
        for (u64 v = first; v < pieces && found == ~0ull; v += step) {
            const uint4 w = ((const uint4*)s)[v];
            const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                if (found == ~0ull && bf_not_finite(words[k / 2] >> (16 * (k % 2)))) found = 8ull * v + k;
            }
        }
        // The last n % 8 elements, after every whole piece (so a hit there
        // loses to any hit in the pieces).
        for (u64 e = 8ull * pieces + first; e < n && found == ~0ull; e += step) {
            if (bf_not_finite(((const bf16_t*)s)[e])) found = e;
        }
    } else {
        for (u64 e = first; e < n && found == ~0ull; e += step) {
            if (bf_not_finite(repack_load(s, e, r.dtype))) found = e;
        }
    }
    if (found != ~0ull) {
        atomicMin((unsigned long long*)p.hits + blockIdx.y, (unsigned long long)found);
        atomicMin((unsigned long long*)p.any, 0ull);
    }
}
