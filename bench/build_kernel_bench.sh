#!/usr/bin/env bash
# Builds bench/kernel_bench.cu (standalone, no Python at run time) and bench/device_copy.cu (the memcpy
# target bench_kernels.py times) for sm_90 into bench/.bin/.
# Extra arguments go to nvcc; -o names the output; --copy-only builds only the memcpy target.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/.bin
INC=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
out=bench/.bin/kernel_bench
args=()
copy_only=
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out=$2; shift 2; elif [ "$1" = "--copy-only" ]; then copy_only=1; shift; else args+=("$1"); shift; fi
done
[ -n "$copy_only" ] || nvcc -std=c++17 -arch=sm_90 -O3 -ftz=false -prec-div=true -prec-sqrt=true -fmad=false --expt-relaxed-constexpr \
  -diag-suppress 940,2473,186 -Xptxas=-v -I"$INC" -Ijax_fp8/csrc "${args[@]}" bench/kernel_bench.cu -o "$out" \
  2> "$out.ptxas.txt" || { cat "$out.ptxas.txt"; exit 1; }
[ -n "$copy_only" ] || echo "built $out ($(grep -c 'spill stores' "$out.ptxas.txt") kernels, $(grep -E '[1-9][0-9]* bytes spill' -c "$out.ptxas.txt") with spills)"
# The memcpy roofline target that bench_kernels.py loads (bench-only; not in the jax_fp8 module).
nvcc -std=c++17 -arch=sm_90 -O3 -shared -Xcompiler -fPIC -cudart static -diag-suppress 940,2473,186 -I"$INC" \
  bench/device_copy.cu -o bench/.bin/libjf_device_copy.so
echo "built bench/.bin/libjf_device_copy.so"
