// What the standalone probes share (not part of the library): the CUDA
// error check, and (with PROBE_LIBRARY_ROWS defined before the include) the
// library's row-register kernel body under a probe's own declaration.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CK(x)                                                                 \
    do {                                                                      \
        cudaError_t e = (x);                                                  \
        if (e != cudaSuccess) {                                               \
            printf("error %s at line %d\n", cudaGetErrorString(e), __LINE__); \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#ifdef PROBE_LIBRARY_ROWS
#include "../cuda/common.cuh"
// The library's sm_90 kernels sit under `#if __CUDA_ARCH__ >= 900`, which
// the host pass must see too (NVRTC compiles device code only).
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#define PROBE_HOST_ARCH
#endif
#include "../cuda/bgmv.cu"
#include "../cuda/bgmv_entry.cu"
#ifdef ROWS_SRC
#include ROWS_SRC
#else
#include "../cuda/bgmv_rows.cu"
#endif
#ifdef PROBE_HOST_ARCH
#undef __CUDA_ARCH__
#endif

// The library kernel's body under the probe's own declaration (the
// library's is compiled for device code only).
template <bool FULL>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(BGR_THREADS, 1) library_rows(const BgeParams p) {
    bgr_body<bf16_t, FULL>(p);
}

// A bf16 value's float, on the host.
static float host_bf(bf16_t h) {
    const u32 u = (u32)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif
