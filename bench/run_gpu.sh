#!/usr/bin/env bash
# One lease call: build for sm_90, run every test on the GPU backend (CUDA kernels vs the reference,
# bit for bit), dump the compiler's resource report and SASS facts, then time everything: through
# JAX against the XLA-fused reference (bench_kernels.py) and per kernel with CUDA events (kernel_bench.cu).
# Usage (device machine): bash bench/run_gpu.sh   -- output goes to $OUT (or ./gpu_logs): run.log (every
# stage), logs.tgz (each stage's full log), gemm_table.json (TUNE=1), ncu_*.txt (NCU=1).
# Knobs: PYTEST_ARGS, TEST_FILES (the tests stage's files, default tests), TEST_WORKERS (its xdist workers on
# the one GPU, default 0: one process), BENCH_ARGS (bench_kernels.py), GEMM_ARGS (bench_gemm.py), MODEL_ARGS (bench_model.py),
# TUNE_ARGS (bench_gemm_tune.py), NCU_ARGS (ncu), NCU_MNK (M,N,K of the profiled fprop GEMM, 8192,8192,8192),
# NCU_KERNEL (ncu's kernel-name regex), NCU_SOURCE=1 (also each kernel's section details and its stall
# samples per SASS line: ncu_*_source.csv.gz), NCU_PAIRS (1D2D and/or 1D1D), NCU_BACKENDS (each a backend, or
# backend:options for ncu_gemm.py --options, e.g. cutlass:config=4,raster=1,swizzle=4), TABLE (a gemm_table.json from an earlier call: copied to $OUT, so that
# TUNE_ARGS=--resume continues it and GEMM / NCU use it), KB=1 (kernel_bench), KB_PREBUILT;
# stages: TESTS=0, KERNELS=0, GEMM=0 skip theirs; BUILD=0 reuses the last build (rebuilt where the tree differs from what it compiled: give it the
# build call's CUTLASS setting); CUTLASS=1 builds the CUTLASS
# module too (the nvidia-cutlass wheel from .whl/: carry .whl); BACKENDS=1 tests/test_gemm_backends.py and
# tests/test_command_buffers.py and tests/test_compiled_for_gpu.py;
# PREBUILT=1 the modules of bench/prebuild.sh instead of a build (carry .prebuilt);
# TUNE=1 bench_gemm_tune.py (then GEMM=1 benches with its table); NCU=1 Nsight Compute on one GEMM per pair
# (NCU_PAIRS) and backend (each at the table's best options when there is one); MODEL=1 bench_model.py;
# PRODUCERS=1 the fused producers: their tests on the GPU, then bench_producers.py (PRODUCERS_ARGS);
# RAGGED=1 the mixture-of-experts tests on the GPU, then bench_ragged.py (RAGGED_ARGS); NCU_RAGGED=1 Nsight
# Compute on the grouped quantize's and grouped GEMMs' kernels (NCU_RAGGED_WHAT, NCU_RAGGED_ARGS);
# NCU_PRODUCERS=1 Nsight Compute on the fused SwiGLU kernels (NCU_SOURCES) and their SASS; PATCHES (with
# PATCH_TESTS, PATCH_TEST_FILES, PATCH_BENCH): kernels not yet landed, applied and timed after the rest.
# Everything at once outruns one 600 s call (build ~100 s (CUTLASS=1: ~+120 s), tests ~300 s (TEST_WORKERS=8), kernels ~70 s,
# kernel_bench ~60 s, GEMM ~300 s, tune ~300 s, model ~150 s): split it over calls with the stage knobs, e.g.
#   CUTLASS=1 TESTS=0 KERNELS=0 GEMM=0 BACKENDS=1 TUNE=1   then   BUILD=0 ... TESTS=0 KERNELS=0 TABLE=... NCU=1
# A pending kernel against the landed one (carry .whl; about 700 s with the CUTLASS module, so two calls on one
# warm machine, the second with BUILD=0 and PATCHES...): CUTLASS=1 TESTS=0 KERNELS=0 GEMM=0 RAGGED=1
#   RAGGED_ARGS="--experts 8,256 --rows 16384 --routing balanced" PATCHES=bench/pending/X.patch
#   PATCH_TEST_FILES="tests/test_quantize_grouped.py tests/test_ragged_dot.py" PATCH_TESTS="kernel_matches or ..."
#   PATCH_BENCH="python3 bench_ragged.py --experts 8,256 --rows 16384 --routing balanced"
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
L=$(mktemp -d /tmp/jf_logs.XXXXXX)  # each stage's full log; packed into $OUT/logs.tgz at the end
trap 'tar -czf "$OUT/logs.tgz" -C "$L" . 2>/dev/null' EXIT
trap 'exit 143' TERM INT
log() { tee -a "$L/$1" "$OUT/run.log"; }  # a stage's output: its own log and run.log (and stdout)
stage() { echo "=== $* ($(date +%T))" | tee -a "$OUT/run.log"; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | log gpu.txt
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | log gpu.txt
kb_pid=
ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)  # NCU stages
build_env=()  # the build's environment (CUTLASS=1: the CUTLASS module too), for the PATCHES stage's rebuild as well
if [ "${CUTLASS:-0}" != 0 ]; then
  build_env=(JAX_FP8_CUTLASS=1 CMAKE_BUILD_PARALLEL_LEVEL=16)
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the nvidia-cutlass wheel's headers (installed below)
fi
# the package built and installed in place (the BUILD stage, and the PATCHES stage's incremental rebuild),
# its pip log appended to $1; a failed build ends the call with the log's tail
# Each call's tree comes with its own mtimes, older than the objects an earlier call built from a patched
# copy of it, so ninja would keep those: the sources whose content differs from the last build's are touched.
sums=build/.jf_sources.md5
install() {
  [ -f $sums ] && md5sum --quiet -c $sums 2>/dev/null | sed -n 's/: FAILED$//p' | xargs -r touch
  env ${build_env[@]+"${build_env[@]}"} python3 -m pip install --no-build-isolation --no-deps -e . -v >> "$1" 2>&1 \
    || { tail -50 "$1" | tee -a "$OUT/run.log"; exit 1; }
  bash bench/prebuild.sh --sources > $sums
}
# PREBUILT=1: the CPU, CUDA and CUTLASS modules bench/prebuild.sh built from this tree on the CPU machine (carry
# .prebuilt): checked, put beside the package, which runs from the tree; no build (not with PATCHES or KB).
if [ "${PREBUILT:-0}" != 0 ]; then
  stage prebuilt
  bash bench/prebuild.sh --check 2>&1 | log build.log
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  cp .prebuilt/_jax_fp8_*.so jax_fp8/
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  BUILD=0
fi
if [ "${BUILD:-1}" != 0 ]; then
  stage build
  rm -rf build
  # kernel_bench (~3 min to build) compiles in the background while the module builds and the tests run
  # KB=1 builds and runs it (KB_PREBUILT=1: use bench/.bin/kernel_bench as carried, if it runs here).
  if [ -n "${KB:-}" ] && { [ -z "${KB_PREBUILT:-}" ] || ! bench/.bin/kernel_bench 256 256 > /dev/null 2>&1; }; then
    bash bench/build_kernel_bench.sh > "$L/kernel_bench_build.log" 2>&1 & kb_pid=$!
  else  # the memcpy target that bench_kernels.py times (seconds)
    bash bench/build_kernel_bench.sh --copy-only > "$L/kernel_bench_build.log" 2>&1 & kb_pid=$!
  fi
  # no network there: the nvidia-cutlass wheel (its headers) travels in .whl/
  if [ "${CUTLASS:-0}" != 0 ] && ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl 2>&1 | log build.log
  fi
  install "$L/build.log"
  grep -E "ptxas info|spill" "$L/build.log" | sort | uniq -c | sort -rn | head -20 | log ptxas_summary.txt
  so=$(python3 -c "import jax_fp8._jax_fp8_cuda as m; print(m.__file__)")
  cuobjdump --dump-sass "$so" > /tmp/sass.txt 2>/dev/null  # too large to bring back
  echo "SASS: $(grep -c 'LDG.E.128' /tmp/sass.txt) LDG.E.128, $(grep -c -E 'LDL|STL' /tmp/sass.txt) local-memory ops, arch: $(grep -m1 -o 'sm_[0-9]*' /tmp/sass.txt)" | log sass_summary.txt
  rm -f /tmp/sass.txt
fi
# BUILD=0 after a call that built a patched copy (PATCHES), or on a changed tree: rebuilt where they differ
if [ "${BUILD:-1}" = 0 ] && [ -f $sums ] && ! md5sum --quiet -c $sums > /dev/null 2>&1; then
  stage "rebuild (the sources differ from the last build's)"
  install "$L/rebuild.log"
fi
python3 -c "import jax_fp8.gemm.backends.cublaslt as f, jax_fp8._jax_fp8_cuda as m; print('cuBLASLt:', f.cublaslt(), 'GEMM on CUDA unavailable because:', f.unavailable(), 'cublaslt.h checked against cublasLt.h at build:', m.cublaslt_header_checked)" 2>&1 | log gpu.txt
python3 -c "from jax_fp8.gemm.backends.cutlass import CUTLASS, CONFIGS; print('CUTLASS configs', CONFIGS, 'unavailable because:', CUTLASS.unavailable('cuda'))" 2>&1 | tail -1 | log gpu.txt
# no -x: one failure must hide no other result. TEST_FILES: a part of the suite (the whole outruns one call);
# TEST_WORKERS=N: N pytest-xdist workers sharing the GPU, each allocating its memory as it goes
if [ "${TESTS:-1}" != 0 ]; then
  stage tests
  test_env=()  # with workers: no worker takes the GPU's memory up front
  [ "${TEST_WORKERS:-0}" != 0 ] && test_env=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
  # stopped (SIGINT: pytest still prints its summary of what ran) CALL_S (570) seconds after this script started,
  # so that a suite longer than the call still brings back its log
  left=$(( ${CALL_S:-570} - SECONDS > 30 ? ${CALL_S:-570} - SECONDS : 30 ))
  env ${test_env[@]+"${test_env[@]}"} timeout -s INT -k 20 $left python3 -m pytest ${TEST_FILES:-tests} -q \
    -n "${TEST_WORKERS:-0}" -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | log tests.log | tail -15
fi
[ "${PRODUCERS:-0}" != 0 ] && { stage producers; python3 -m pytest tests/test_producers.py tests/test_fused_layers.py \
  tests/test_command_buffers.py -q -n 0 -p no:cacheprovider 2>&1 | log producers_tests.log | tail -15;
  (cd bench && python3 bench_producers.py ${PRODUCERS_ARGS:-}) 2>&1 | log bench_producers.log | tail -12; }
# NCU_PRODUCERS=1: Nsight Compute on fused producer kernels (NCU_SOURCES; instruction mix, stalls by SASS line), their SASS
if [ "${NCU_PRODUCERS:-0}" != 0 ]; then
  stage ncu_producers
  for src in ${NCU_SOURCES:-SwigluSrc swiglu_pair_kernel GeluSrc}; do
    # (--kernel-id's fields are split at ':', so a regex with "::" in it cannot go there)
    ${ncu_bin:-ncu} --clock-control none --kernel-name-base demangled --kernel-name "regex:(Packed<.*$src<|$src<)" \
      --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section InstructionStats --section WarpStateStats \
      --section SourceCounters ${NCU_ARGS:-} python3 bench/bench_producers.py --widths 4096x14336 --iters 2 \
      > "$OUT/ncu_$src.txt" 2>&1
    tee -a "$OUT/run.log" < "$OUT/ncu_$src.txt" | grep -E "Executed Ipc|Issue Slots|Registers|Duration|Occupancy" | head
  done
  so=$(python3 -c "import jax_fp8._jax_fp8_cuda as m; print(m.__file__)")
  cuobjdump --dump-sass "$so" | awk '/Function :/ {keep = /Packed|swiglu_pair/} keep' | gzip > "$OUT/sass_packed.txt.gz"
fi
[ "${BACKENDS:-0}" != 0 ] && { stage backends; python3 -m pytest tests/test_gemm_backends.py tests/test_command_buffers.py tests/test_compiled_for_gpu.py -q -n 0 -p no:cacheprovider 2>&1 | log backends.log | tail -15; }
[ -n "$kb_pid" ] && { wait $kb_pid || tail -20 "$L/kernel_bench_build.log" | tee -a "$OUT/run.log"; }
[ "${KERNELS:-1}" != 0 ] && { stage kernels; python3 bench/bench_kernels.py ${BENCH_ARGS:-} 2>&1 | log bench.log; }
# kernel-level CUDA-event timing of the same kernels (no JAX dispatch), checked against the host math
[ -n "${KB:-}" ] && { stage kernel_bench; for size in "32768 16384" "8192 8192"; do bench/.bin/kernel_bench $size; done 2>&1 | log kernel_bench.log; }
# the GEMM table: every cuBLASLt algorithm and CUTLASS config per problem (written after each problem)
[ -n "${TABLE:-}" ] && [ -f "$TABLE" ] && [ ! -f "$OUT/gemm_table.json" ] && cp "$TABLE" "$OUT/gemm_table.json"
# (it stops by itself CALL_S (570) seconds after this script started, keeping what it measured; TUNE_ARGS may
# override with --max-seconds)
[ "${TUNE:-0}" != 0 ] && { stage tune; python3 bench/bench_gemm_tune.py --out "$OUT/gemm_table.json" \
  --max-seconds $(( ${CALL_S:-570} - SECONDS > 30 ? ${CALL_S:-570} - SECONDS : 30 )) ${TUNE_ARGS:-} 2>&1 | log tune.log; }
table=(); [ -f "$OUT/gemm_table.json" ] && table=(--table "$OUT/gemm_table.json")
# the FP8 GEMM against bf16, flax's per-tensor FP8 and PyTorch's cuBLAS GEMMs (blockwise, per-tensor)
[ "${GEMM:-1}" != 0 ] && { stage gemm; python3 bench/bench_gemm.py ${table[@]+"${table[@]}"} ${GEMM_ARGS:-} 2>&1 | log bench_gemm.log; }
# Nsight Compute on one fprop GEMM per backend: ncu_gemm.py runs it between cuProfilerStart/Stop after a warm-up
if [ "${NCU:-0}" != 0 ]; then
  stage ncu
  for pair in ${NCU_PAIRS:-1D2D}; do
    for spec in ${NCU_BACKENDS:-cublaslt cutlass}; do
      b=${spec%%:*}; opts=(); [ "$spec" != "$b" ] && opts=(--options "${spec#*:}")
      name=ncu_${spec//[:,=]/_}_$pair.txt
      # --clock-control none: the clocks as they run (H200.md), not ncu's base clocks. NCU_SOURCE=1: a report
      # too, whose details (every section's tables: the stall reasons) and source page (stall samples per SASS
      # line, CSV) come back beside the summary
      rep=(); [ "${NCU_SOURCE:-0}" != 0 ] && rep=(--section SourceCounters --import-source no -o "$L/${name%.txt}")
      ${ncu_bin:-ncu} --profile-from-start off --clock-control none --kernel-name-base demangled \
        --kernel-name "regex:${NCU_KERNEL:-nvjet|xmma|gemm|Gemm|cutlass}" --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --print-summary per-kernel \
        ${rep[@]+"${rep[@]}"} ${NCU_ARGS:-} python3 bench/ncu_gemm.py --backend $b ${opts[@]+"${opts[@]}"} --pair $pair \
        --mnk "${NCU_MNK:-8192,8192,8192}" --runs 2 ${table[@]+"${table[@]}"} > "$OUT/$name" 2>&1
      if [ -n "${rep[*]}" ] && [ -f "$L/${name%.txt}.ncu-rep" ]; then
        ${ncu_bin:-ncu} --import "$L/${name%.txt}.ncu-rep" --print-details all >> "$OUT/$name" 2>&1
        ${ncu_bin:-ncu} --import "$L/${name%.txt}.ncu-rep" --page source --csv --print-source sass 2>&1 \
          | gzip > "$OUT/${name%.txt}_source.csv.gz"
      fi
      cp "$OUT/$name" "$L/"; tee -a "$OUT/run.log" < "$OUT/$name"
    done
  done
fi
# mixture of experts: the grouped quantize and fp8_ragged_dot against bf16 lax.ragged_dot (RAGGED_ARGS)
[ "${RAGGED:-0}" != 0 ] && { stage ragged; python3 -m pytest tests/test_quantize_grouped.py tests/test_ragged_dot.py \
  -q -n 0 -p no:cacheprovider 2>&1 | log ragged_tests.log | tail -4;
  (cd bench && python3 bench_ragged.py ${RAGGED_ARGS:-}) 2>&1 | log bench_ragged.log; }
# NCU_RAGGED=1: Nsight Compute on every kernel of one grouped quantize, one grouped forward and one grouped
# wgrad (ncu_ragged.py, NCU_RAGGED_ARGS: its shape), a summary per kernel (ncu_ragged_<what>.txt)
if [ "${NCU_RAGGED:-0}" != 0 ]; then
  stage ncu_ragged
  for what in ${NCU_RAGGED_WHAT:-quantize forward wgrad}; do
    ${ncu_bin:-ncu} --profile-from-start off --clock-control none --kernel-name-base demangled \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats ${NCU_ARGS:-} python3 bench/ncu_ragged.py --what $what ${NCU_RAGGED_ARGS:-} \
      > "$OUT/ncu_ragged_$what.txt" 2>&1
    cp "$OUT/ncu_ragged_$what.txt" "$L/"
    grep -E "^  [a-zA-Z_].*\(|Duration|Memory Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy" \
      "$OUT/ncu_ragged_$what.txt" | cut -c1-160 | tee -a "$OUT/run.log"
  done
fi
# PATCHES="bench/pending/a.patch ...": after the stages above (the unpatched build), apply the patches to this
# copy of the tree, rebuild incrementally (the changed translation units only), then PATCH_TESTS (a pytest
# -k expression over PATCH_TEST_FILES) and PATCH_BENCH (a command run in bench/): the same machine's
# before-and-after of a kernel not yet landed (patch_tests.log, patch_bench.log)
if [ -n "${PATCHES:-}" ]; then
  stage patches
  for p in $PATCHES; do
    git apply "$p" 2>&1 | log patch.log || { echo "$p does not apply" | log patch.log; exit 1; }
    echo "applied $p" | log patch.log
  done
  install "$L/patch_build.log"
  grep -E "Building CUDA object|spill stores" "$L/patch_build.log" | sort | uniq -c | log patch.log
  [ -n "${PATCH_TESTS:-}" ] && python3 -m pytest ${PATCH_TEST_FILES:-tests} -k "$PATCH_TESTS" -q -n 0 -p no:cacheprovider 2>&1 \
    | log patch_tests.log | tail -4
  [ -n "${PATCH_BENCH:-}" ] && (cd bench && eval "$PATCH_BENCH") 2>&1 | log patch_bench.log
fi
# the decoder's training step: FP8 blockwise vs bf16 vs flax's per-tensor FP8
[ "${MODEL:-0}" != 0 ] && { stage model; python3 bench/bench_model.py ${MODEL_ARGS:-} 2>&1 | log bench_model.log; }
true
