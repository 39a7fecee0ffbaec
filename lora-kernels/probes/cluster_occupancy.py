#!/usr/bin/env python3
"""Ask the driver how many thread-block clusters of each cluster kernel are resident at once.

usage: cluster_occupancy.py SOURCES_DIR [ARCH]

SOURCES_DIR holds the translation units `cargo xtask cuda-sources DIR`
writes. Each is compiled with `nvcc -cubin -arch=ARCH` (default sm_90a) and
loaded through the driver API; for every kernel with compiled-in cluster
dimensions, at a few dynamic shared memory sizes, it prints the blocks per
multiprocessor (`cuOccupancyMaxActiveBlocksPerMultiprocessor`), the active
clusters (`cuOccupancyMaxActiveClusters`) and the share of
multiprocessors x blocks they fill: the planners count 7/8 of that for
clusters of 4 and 8 (GPC packing) and all of it for pairs.
"""
import ctypes
import os
import re
import subprocess
import sys
import tempfile


class LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint),
    ]


MAX_THREADS, STATIC_SMEM, NUM_REGS, MAX_DYN_SMEM, CLUSTER_WIDTH = 0, 1, 4, 8, 11
SM_COUNT, SMEM_PER_SM = 16, 81


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    arch = sys.argv[2] if len(sys.argv) == 3 else "sm_90a"
    cu = ctypes.CDLL("libcuda.so.1")

    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: CUresult {rc}")

    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    check(cu.cuCtxSetCurrent(ctx), "set current")
    val = ctypes.c_int()
    check(cu.cuDeviceGetAttribute(ctypes.byref(val), SM_COUNT, dev), "sm count")
    sms = val.value
    check(cu.cuDeviceGetAttribute(ctypes.byref(val), SMEM_PER_SM, dev), "smem per sm")
    smem_per_sm = val.value
    print(f"{sms} multiprocessors, {smem_per_sm} bytes of shared memory each")
    print("kernel | cluster | threads | regs | dyn smem | blocks/SM | clusters | share of SMs x blocks")
    with tempfile.TemporaryDirectory() as work:
        for name in sorted(os.listdir(sys.argv[1])):
            if not name.endswith(".cu"):
                continue
            src = os.path.join(sys.argv[1], name)
            cubin = os.path.join(work, name + ".cubin")
            subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-o", cubin, src], check=True)
            text = open(src).read()
            found = set(re.findall(r"\b(bgmv\w*)", text))
            names = sorted(found | {n + "_list" for n in found})
            module = ctypes.c_void_p()
            check(cu.cuModuleLoad(ctypes.byref(module), cubin.encode()), f"load {name}")
            for kernel in names:
                func = ctypes.c_void_p()
                if cu.cuModuleGetFunction(ctypes.byref(func), module, kernel.encode()) != 0:
                    continue
                attr = {}
                for key in (MAX_THREADS, STATIC_SMEM, NUM_REGS, CLUSTER_WIDTH):
                    check(cu.cuFuncGetAttribute(ctypes.byref(val), key, func), "attribute")
                    attr[key] = val.value
                cluster = attr[CLUSTER_WIDTH]
                if cluster <= 1:
                    continue
                threads = attr[MAX_THREADS]
                for dyn in (0, 32 << 10, 56 << 10, 72 << 10, 100 << 10, 200 << 10):
                    if dyn + attr[STATIC_SMEM] > smem_per_sm - 1024:
                        continue
                    check(cu.cuFuncSetAttribute(func, MAX_DYN_SMEM, dyn), "set smem")
                    blocks = ctypes.c_int()
                    check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), func, threads, ctypes.c_size_t(dyn)), "blocks")
                    cfg = LaunchConfig(cluster * sms, 1, 1, threads, 1, 1, dyn, None, None, 0)
                    clusters = ctypes.c_int()
                    rc = cu.cuOccupancyMaxActiveClusters(ctypes.byref(clusters), func, ctypes.byref(cfg))
                    if rc != 0:
                        print(f"{kernel} | {cluster} | {threads} | {attr[NUM_REGS]} | {dyn} | {blocks.value} | error {rc} |")
                        continue
                    share = clusters.value * cluster / max(1, sms * blocks.value)
                    print(f"{kernel} | {cluster} | {threads} | {attr[NUM_REGS]} | {dyn} | {blocks.value} | {clusters.value} | {share:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
