#!/usr/bin/env bash
# Builds the package's modules (CPU, CUDA and CUTLASS) on this machine, for the device machine's Python and
# jax (nvcc compiles for sm_90 / sm_90a without a GPU), into .prebuilt/ (git-ignored), so that a device call
# runs this tree's kernels without its own build, about 4 of its minutes (bench/run_gpu.sh PREBUILT=1,
# carrying .prebuilt).
#
#   bash bench/prebuild.sh            # build: about 10 minutes on 2 cores
#   bash bench/prebuild.sh --check    # the modules are this tree's and this python3's (run_gpu.sh runs it)
#   bash bench/prebuild.sh --sources  # md5 of the sources the modules are built from (run_gpu.sh's too)
#
# DEVICE_PYTHON (python3.12, or pyenv's 3.12) and DEVICE_JAX (0.11.2): the device's Python and the jax whose XLA FFI headers
# the modules are built against; a venv of them is made under $TMPDIR. CUTLASS's headers: those that
# bench/check_cutlass_kernel.sh finds (the nvidia-cutlass wheel in .whl/, unpacked).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.prebuilt
sources() { find jax_fp8/csrc CMakeLists.txt -type f -print0 | sort -z | xargs -0 md5sum; }
[ "${1:-}" = "--sources" ] && { sources; exit 0; }

if [ "${1:-}" = "--check" ]; then
  [ -f $out/sources.md5 ] || { echo "prebuild: no $out/sources.md5 (build with bench/prebuild.sh)"; exit 1; }
  diff <(sources) $out/sources.md5 > /dev/null || { echo "prebuild: $out was built from other sources than this tree's"; exit 1; }
  suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  for m in _jax_fp8_cpu _jax_fp8_cuda _jax_fp8_cutlass; do
    [ -f "$out/$m$suffix" ] || { echo "prebuild: no $out/$m$suffix for this python3 (built: $(ls $out/*.so))"; exit 1; }
  done
  echo "prebuild: $(cat $out/built_for.txt); this machine: jax $(python3 -c 'import jax; print(jax.__version__)')"
  exit 0
fi

jax=${DEVICE_JAX:-0.11.2} py=${DEVICE_PYTHON:-}
if [ -z "$py" ]; then  # python3.12 on the PATH, else pyenv's 3.12 (its shim answers only for the active version)
  for c in python3.12 "$(pyenv root 2>/dev/null)/versions/$(pyenv versions --bare 2>/dev/null | grep -m1 '^3\.12')/bin/python"; do
    "$c" -c "" 2>/dev/null && { py=$c; break; }
  done
  [ -n "$py" ] || { echo "prebuild: no Python 3.12 found (set DEVICE_PYTHON)"; exit 1; }
fi
venv=${TMPDIR:-/tmp}/jf_prebuild_$($py -c 'import sys; print("%d%d" % sys.version_info[:2])')_jax$jax
[ -x $venv/bin/python ] || { $py -m venv $venv && $venv/bin/pip install -q "jax==$jax" nanobind cmake ninja; }
inc=$(bash bench/check_cutlass_kernel.sh --headers)
build=${TMPDIR:-/tmp}/jf_prebuild_build
rm -rf $build
JAX_FP8_CUTLASS=1 CUTLASS_INCLUDE_DIR=$inc $venv/bin/cmake -S . -B $build -G Ninja \
  -DCMAKE_MAKE_PROGRAM=$venv/bin/ninja -DPython_EXECUTABLE=$venv/bin/python > /dev/null
t0=$SECONDS
$venv/bin/ninja -C $build -j "$(nproc)" _jax_fp8_cpu _jax_fp8_cuda _jax_fp8_cutlass > $build/ninja.log 2>&1 || { tail -30 $build/ninja.log; exit 1; }
rm -rf $out && mkdir -p $out
cp $build/_jax_fp8_*.so $out/
sources > $out/sources.md5
echo "Python $($venv/bin/python -c 'import platform; print(platform.python_version())'), jax $jax, commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- jax_fp8/csrc CMakeLists.txt || echo ' + changes')" > $out/built_for.txt
echo "prebuild: $out ($(cat $out/built_for.txt)) in $((SECONDS - t0)) s; spills: $(grep -cE '[1-9][0-9]* bytes spill stores' $build/ninja.log || true) kernels"
