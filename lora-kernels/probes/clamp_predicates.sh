#!/usr/bin/env bash
# Every kernel family's SASS, scanned for integer clamps with a predicate
# output (`VIMNMX... Rd, Pn, ...`): ptxas 13.0 folded a test of a clamped
# value into one such predicate wrongly in bgmv_rows.cu (NOTES.md v30).
# Not part of the library or CI; run on the GPU machine (needs nvcc):
#   bash lora-kernels/probes/clamp_predicates.sh
# Each family is compiled as the library compiles it: common.cuh, then
# its sources in order, for sm_90a. Prints a count per family and the
# functions holding any.
set -u
cd "$(dirname "$0")/../cuda"
tmp="$(mktemp -d)"
for fam in "bgmv.cu bgmv_entry.cu bgmv_rows.cu" sgmv.cu moe_index.cu overlay.cu repack.cu; do
  # shellcheck disable=SC2086 # the family's sources, in order
  cat common.cuh $fam >"$tmp/fam.cu"
  if ! nvcc -arch=sm_90a -O3 -std=c++17 -cubin -o "$tmp/fam.cubin" "$tmp/fam.cu" 2>"$tmp/err"; then
    echo "$fam: build failed"; head -5 "$tmp/err"; continue
  fi
  cuobjdump -sass "$tmp/fam.cubin" >"$tmp/fam.sass"
  hits="$(grep -cE 'VIMNMX[.A-Z0-9]* R[Z0-9]+, P[0-6]' "$tmp/fam.sass")"
  echo "$fam: $(grep -c VIMNMX "$tmp/fam.sass") VIMNMX, $hits with a predicate output"
  [ "$hits" = 0 ] || grep -E 'Function :|VIMNMX[.A-Z0-9]* R[Z0-9]+, P[0-6]' "$tmp/fam.sass" | grep -B1 VIMNMX | head -20
done
rm -rf "$tmp"
