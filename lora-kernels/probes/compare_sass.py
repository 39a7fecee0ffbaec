#!/usr/bin/env python3
"""Compare the machine code of two builds of the kernel sources, function by function.

usage: compare_sass.py BEFORE_DIR AFTER_DIR [ARCH]

Each directory holds the translation units `cargo xtask cuda-sources DIR`
writes (one `.cu` per kernel family). Every unit is compiled with
`nvcc -cubin -arch=ARCH` (default sm_90a) and disassembled with
`cuobjdump -sass`; each `extern "C"` kernel's SASS is then compared across
the two builds, whatever unit it lives in, without the address comments;
the first lines that differ are printed for up to four changed kernels.
Exit 0 only when every kernel of the first build is in the second with
identical SASS.
"""
import difflib
import os
import re
import subprocess
import sys
import tempfile


def normalize(line):
    """One SASS line without its address comment and padding (the encoding
    words stay: they carry the scheduling control bits)."""
    line = re.sub(r"/\*[0-9a-fA-F]{4,}\*/", "", line)
    return " ".join(line.split())


def kernels(src_dir, arch, work):
    out = {}
    for name in sorted(os.listdir(src_dir)):
        if not name.endswith(".cu"):
            continue
        cubin = os.path.join(work, os.path.basename(src_dir.rstrip("/")) + "_" + name + ".cubin")
        subprocess.run(
            ["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-o", cubin, os.path.join(src_dir, name)],
            check=True,
        )
        sass = subprocess.run(["cuobjdump", "-sass", cubin], check=True, capture_output=True, text=True).stdout
        current = None
        for line in sass.splitlines():
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                current = m.group(1)
                out[current] = []
                continue
            if current is not None and normalize(line):
                out[current].append(normalize(line))
    return {k: "\n".join(v) for k, v in out.items()}


def main():
    if len(sys.argv) not in (3, 4):
        print(__doc__)
        return 2
    arch = sys.argv[3] if len(sys.argv) == 4 else "sm_90a"
    with tempfile.TemporaryDirectory() as work:
        before = kernels(sys.argv[1], arch, work)
        after = kernels(sys.argv[2], arch, work)
    same = [k for k in before if after.get(k) == before[k]]
    changed = [k for k in before if k in after and after[k] != before[k]]
    missing = [k for k in before if k not in after]
    new = [k for k in after if k not in before]
    print(f"{len(before)} kernels before, {len(after)} after: {len(same)} identical")
    for label, names in [("changed", changed), ("missing", missing), ("new", new)]:
        if names:
            print(f"{label}: {' '.join(sorted(names))}")
    for name in sorted(changed)[:4]:
        diff = difflib.unified_diff(before[name].splitlines(), after[name].splitlines(), lineterm="", n=0)
        print(f"--- {name}")
        print("\n".join(list(diff)[2:14]))
    return 0 if not changed and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
