#!/usr/bin/env bash
# Compile-checks the CUTLASS FP8 GEMM translation units (jax_fp8/csrc/cutlass_gemm_*.cu and the grouped
# GEMMs' cutlass_ragged_*.cu, the kernels of the optional _jax_fp8_cutlass module) for sm_90a with nvcc directly: no pip, no CMake, no GPU. Prints
# the time each takes and ptxas's registers and spills per kernel; exits non-zero when one fails to
# compile, a kernel spills (ALLOW_SPILLS=1: report spills only), or ptxas serializes a kernel's WGMMAs
# or waits for them where the source does not (its C7514 / C7517 notes: silent slowdowns).
#
#   bash bench/check_cutlass_kernel.sh            # the first translation unit (cutlass_gemm_1d2d_bf16)
#   bash bench/check_cutlass_kernel.sh 2          # the I-th (0-based, in the order --list prints)
#   bash bench/check_cutlass_kernel.sh 1d1d_f32   # by name (ragged_m_bf16: a grouped GEMM's)
#   bash bench/check_cutlass_kernel.sh all        # every one, one after the other (~2 min each on 2 cores)
#   bash bench/check_cutlass_kernel.sh --list
#   bash bench/check_cutlass_kernel.sh --headers  # print the CUTLASS include directory it would use
#   NVCC_FLAGS=-DJF_CUTLASS_ONLY_CONFIG=4 bash bench/check_cutlass_kernel.sh 2   # one configuration only (CI)
#
# CUTLASS's headers (>= 4.2): $CUTLASS_INCLUDE_DIR (the dir holding cutlass/cutlass.h), else those of an
# importable nvidia-cutlass (cutlass_library), else the nvidia-cutlass wheel in .whl/ unpacked (unzip)
# into $TMPDIR. Extra nvcc flags: $NVCC_FLAGS (e.g. -DJF_CUTLASS_E5M2=1 for the E5M2 kernels too).
set -euo pipefail
cd "$(dirname "$0")/.."
TUS=(gemm_1d2d_bf16 gemm_1d2d_f32 gemm_1d1d_bf16 gemm_1d1d_f32 ragged_m_bf16 ragged_m_f32 ragged_k_bf16 ragged_k_f32
     ragged_m_bf16_c1x2 ragged_m_f32_c1x2 ragged_k_bf16_c1x2 ragged_k_f32_c1x2
     ragged_m_bf16_split ragged_m_f32_split ragged_k_bf16_split ragged_k_f32_split
     ragged_m_bf16_ordered ragged_m_f32_ordered ragged_k_bf16_ordered ragged_k_f32_ordered)

if [ "${1:-}" = "--list" ]; then
  for i in "${!TUS[@]}"; do echo "$i cutlass_${TUS[$i]}"; done
  exit 0
fi
command -v nvcc >/dev/null || { echo "check_cutlass_kernel: nvcc not found"; exit 1; }

inc=${CUTLASS_INCLUDE_DIR:-}
if [ -z "$inc" ]; then
  inc=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))" 2>/dev/null || true)
fi
if [ -z "$inc" ] || [ ! -f "$inc/cutlass/cutlass.h" ]; then
  whl=$(ls .whl/nvidia_cutlass-*.whl 2>/dev/null | sort -V | tail -1 || true)
  if [ -n "$whl" ]; then
    dest=${TMPDIR:-/tmp}/jf_cutlass_$(basename "$whl" .whl)
    if [ ! -f "$dest/cutlass_library/source/include/cutlass/cutlass.h" ]; then
      mkdir -p "$dest"
      unzip -q -o "$whl" 'cutlass_library/source/include/*' -d "$dest"
    fi
    inc=$dest/cutlass_library/source/include
  fi
fi
[ -n "$inc" ] && [ -f "$inc/cutlass/cutlass.h" ] || {
  echo "check_cutlass_kernel: no CUTLASS headers (set CUTLASS_INCLUDE_DIR, or pip install nvidia-cutlass)"; exit 1; }
[ "${1:-}" = "--headers" ] && { echo "$inc"; exit 0; }  # where they are (bench/prebuild.sh)
echo "CUTLASS headers: $inc"

sel=${1:-0}
if [ "$sel" = all ]; then
  picks=("${TUS[@]}")
elif [[ "$sel" =~ ^[0-9]+$ ]]; then
  [ "$sel" -lt "${#TUS[@]}" ] || { echo "check_cutlass_kernel: index $sel out of range (0..$((${#TUS[@]} - 1)))"; exit 1; }
  picks=("${TUS[$sel]}")
else
  picks=("${sel#cutlass_}")
  picks=("${picks[0]%.cu}")
  [[ "${picks[0]}" == ragged_* || "${picks[0]}" == gemm_* ]] || picks=("gemm_${picks[0]}")  # 1d1d_f32: a GEMM's
fi

out=${TMPDIR:-/tmp}/jf_cutlass_check
mkdir -p "$out"
rc=0
for tu in "${picks[@]}"; do
  src=jax_fp8/csrc/cutlass_$tu.cu
  [ -f "$src" ] || { echo "check_cutlass_kernel: no $src"; exit 1; }
  log=$out/cutlass_$tu.ptxas.txt
  t0=$(date +%s)
  # shellcheck disable=SC2086
  if ! nvcc -std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
      --expt-extended-lambda -Xptxas=-v -isystem "$inc" -Ijax_fp8/csrc ${NVCC_FLAGS:-} -c "$src" \
      -o "$out/cutlass_$tu.o" > "$log" 2>&1; then
    cat "$log"
    echo "FAILED $src after $(($(date +%s) - t0)) s"
    exit 1
  fi
  secs=$(($(date +%s) - t0))
  kernels=$(grep -c 'spill stores' "$log" || true)
  spills=$(grep -cE '[1-9][0-9]* bytes spill (stores|loads)' "$log" || true)
  regs=$(grep -oE 'Used [0-9]+ registers' "$log" | awk '{print $2}' | sort -n | uniq | tr '\n' ' ')
  stack=$(grep -oE '[0-9]+ bytes stack frame' "$log" | awk '{print $1}' | sort -n | uniq | tr '\n' ' ')
  echo "compiled $src for sm_90a in $secs s: $kernels kernels, registers {${regs% }} (launch bound), stack bytes {${stack% }}, $spills with spills (ptxas log: $log)"
  serial=$(grep -cE 'C751[47]' "$log" || true)
  if [ "$serial" -gt 0 ]; then
    echo "ptxas serialized or waited for WGMMAs ($serial notes):"; grep -E 'C751[47]' "$log" | cut -c1-160
    rc=1
  fi
  if [ "$spills" -gt 0 ]; then
    grep -E '[1-9][0-9]* bytes spill' "$log"
    [ "${ALLOW_SPILLS:-0}" = 1 ] || rc=1
  fi
done
exit "$rc"
