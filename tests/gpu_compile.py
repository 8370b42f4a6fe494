"""Helper module of ``tests/test_compiled_for_gpu.py``: the decoder's training step
(``examples/_transformer.py``) compiled by XLA for an H200 and read from XLA's thunk dump, the program
the GPU runs: which thunks sit in a command buffer (a CUDA graph), and which kernels XLA emits around
our custom calls.

On a machine with a CUDA GPU the step compiles for it; elsewhere, where jax's CUDA plugin is installed
(``pip install "jax[cuda13]"``), for a compile-only H200 (jax's deviceless ahead-of-time compilation:
``jax.experimental.topologies`` with the target description below, CUDA 13 driver and runtime, so that
XLA keeps custom calls in command buffers as on the H200 machine's driver 580). Each compile runs in a
process of its own (``--xla_dump_to`` is read when jax starts).

Also a script, printing :func:`summary` of each variant's step::

    python tests/gpu_compile.py 4096x14336x2x2 [GPUS]   # d_model x FFN x layers x batch (seq 4096)
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))

#: An H200 as XLA's GPU compiler sees it (GpuTargetConfigProto): 132 SMs of compute capability 9.0,
#: 141 GB at 4.8 TB/s, 50 MiB of L2, CUDA 13.0 driver and runtime, cuDNN 9.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
  driver_version: "13.0.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""

#: Kernel and thunk names that move data rather than compute (how XLA names what a fusion's root does).
MOVES = ("transpose", "copy", "pad", "slice", "concatenate", "gather", "scatter", "convert")


def why_not() -> Optional[str]:
    """None where the step can be compiled for a GPU here (our CUDA module built, and a CUDA device or
    jax's CUDA plugin); else why not."""
    from jax_fp8 import _ffi

    if not _ffi.AVAILABLE["cuda"]:
        return "the jax_fp8 CUDA module is not built"
    if _ffi.cuda_device_present() or _cuda_plugin():
        return None
    return "no CUDA device and no jax CUDA plugin (pip install 'jax[cuda13]') to compile for one"


def _cuda_plugin() -> bool:
    spec = importlib.util.find_spec("jax_plugins")
    return spec is not None and any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(spec.submodule_search_locations))


def compile_step(variant: str, sizes: str, flags: str = "", devices: int = 1) -> dict:
    """The step of ``variant`` ("fp8", "bf16", "flax-fp8") at ``sizes`` (d_model x FFN x layers x
    batch, seq 4096 unless a fifth number gives it) compiled for ``devices`` GPUs (more than one: the
    example's mesh, batch over "data", FSDP weights over "fsdp" of 2, plain ``jax.jit``) with the XLA
    ``flags`` added: :func:`read_dump` of its thunks. Raises AssertionError with the process's output
    if it fails."""
    with tempfile.TemporaryDirectory() as dump:
        _child(["--compile", variant, sizes, str(devices)], devices, f"{flags} --xla_dump_to={dump}")
        return read_dump(dump)


def sequence_parallel_moves(devices: int = 8) -> list:
    """The transposes and copies in the program of a sequence-parallel linear layer's forward and
    backward (x (2, 4096, 4096) split along its sequences over 4 GPUs, W (4096, 4096) along N over 2;
    ``fp8_dot_general`` under plain ``jax.jit``) compiled for ``devices`` GPUs: ``[(name, shape)]``."""
    stdout = _child(["--linear", str(devices)], devices)
    return [tuple(m) for m in json.loads(stdout.strip().splitlines()[-1])]


def _child(args: list, devices: int, flags: str = "") -> str:
    """Runs this file with ``args`` in a process of its own, compiling for ``devices`` GPUs with the XLA
    ``flags`` added; its stdout. Raises AssertionError with its output if it fails."""
    inherited = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, XLA_FLAGS=f"{inherited} {flags}")
    from jax_fp8 import _ffi

    if not _ffi.cuda_device_present():
        # the compile-only H200s need no GPU backend; as many host devices as GPUs, so that
        # jax.devices() counts what it counts on a machine with them (fp8_dot_general asks)
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def read_dump(dump: str) -> dict:
    """The thunks of the ``jit_step`` module in ``dump`` (the first, where it was compiled more than
    once): ``{"thunks": [(name, kind, in a command buffer), ...], "command_buffers": n}``, after XLA's
    thunk passes (which form the command buffers).
    ``name``: a custom call's or kernel's name (a custom call named by its HLO instruction, e.g.
    ``jf_quantize_local.3``), else the thunk kind."""
    files = sorted(os.listdir(dump))
    seq = [f for f in files if "jit_step" in f and f.endswith("thunk_sequence_after_thunk_passes.txt")] or \
          [f for f in files if "jit_step" in f and f.endswith("thunk_sequence.txt")]
    meta = [f for f in files if "jit_step" in f and f.endswith("thunk_metadata.txt")]
    assert seq and meta, files
    seq, meta = [f for f in seq if f.startswith(seq[0].split(".")[0])], [f for f in meta if f.startswith(seq[0].split(".")[0])]
    assert len(seq) == 1 and len(meta) == 1, files
    annotations = dict((int(i), a) for a, i in re.findall(r'profile_annotation: "([^"]+)"\s*thunk_id: (\d+)',
                                                            open(os.path.join(dump, meta[0])).read()))
    thunks, stack, buffers = [], [], 0  # stack: (indent, kind) of the enclosing thunks
    for line in open(os.path.join(dump, seq[0])):
        m = re.match(r"^(\s*)(\d+): (\w+)\s*\[[^\]]*\]\s*(\S*)", line)
        if not m:
            continue
        indent, tid, kind, label = len(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inside = any(k == "kCommandBuffer" for _, k in stack)
        stack.append((indent, kind))
        if kind == "kCommandBuffer":
            buffers += 1
            continue
        name = annotations.get(tid, kind) if kind == "kCustomCall" else (label if "Kernel" in kind else kind)
        thunks.append((name, kind, inside))
    return {"thunks": thunks, "command_buffers": buffers}


def summary(dump: dict) -> dict:
    """Counts of a :func:`read_dump`: our custom calls (``ours``) and how many sit in a command buffer
    (``ours_captured``), other thunks outside any (``outside``), GEMM kernels, and the data-movement
    kernels and thunks per kind of :data:`MOVES` (``moves``), and every other kernel (``compute``)."""
    s = {"ours": 0, "ours_captured": 0, "outside": 0, "gemms": 0, "compute": 0, "moves": collections.Counter()}
    for name, kind, inside in dump["thunks"]:
        if name.startswith("jf_"):
            s["ours"] += 1
            s["ours_captured"] += inside
            continue
        s["outside"] += not inside
        if "gemm" in name or kind in ("kGemm", "kCublasLtMatmul"):
            s["gemms"] += 1
        elif kind == "kCopy" or any(m in name for m in MOVES):
            s["moves"][next((m for m in MOVES if m in name), "copy")] += 1
        elif "Kernel" in kind:
            s["compute"] += 1
    return s


def _compile(variant: str, sizes: str, devices: str = "1") -> None:
    """In the child process: build and compile the step (no array is made: shapes only)."""
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import jax
    import jax.numpy as jnp

    import _transformer as T

    n = int(devices)
    gpus = _gpus(n)
    d, f, layers, batch, *seq = map(int, sizes.split("x"))
    cfg = T.Config(d_model=d, ffn=f, heads=max(1, d // 128), layers=layers, seq=seq[0] if seq else 4096, vocab=1024,
                   attention="cudnn")
    state = jax.eval_shape(lambda: T.init_state(cfg, variant, T.init_params(cfg, 0), T.optimizer()))
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq + 1), jnp.int32)
    # the example's layout on n GPUs: batch over "data", FSDP weights over "fsdp" (one GPU: both 1)
    fsdp = 2 if n % 2 == 0 else 1
    mesh = jax.make_mesh((n // fsdp, fsdp), T.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=list(gpus))
    shardings = T.mesh_shardings(state, mesh)
    typed = lambda tree, sh: jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                                    tree, sh)
    T.make_train_step(shardings=shardings).lower(typed(state, shardings[0]), typed(tokens, shardings[1])).compile()


def _gpus(n: int) -> list:
    """``n`` GPUs to compile for: this machine's, else compile-only H200s."""
    import jax

    if os.environ.get("JAX_PLATFORMS") == "cpu":
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology=f"1x1x{n}").devices)
    return jax.devices("cuda")[:n]


def _compile_linear(devices: str) -> None:
    """In the child process: :func:`sequence_parallel_moves`' program, its moves printed as JSON."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jax_fp8 as jf

    mesh = jax.make_mesh((int(devices) // 2, 2), ("seq", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=_gpus(int(devices)))
    x = jax.ShapeDtypeStruct((2, 4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "seq", None)))
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model")))

    def loss(x, w):
        return jnp.sum(jf.fp8_dot_general(x, w, (((2,), (0,)), ((), ()))).astype(jnp.float32) ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    moves = re.findall(r"(?m)^\s*%([\w.-]*(?:transpose|copy)[\w.-]*) = (\w+\[[\d,]*\])", entry)
    print(json.dumps(moves))


def main(argv: list) -> None:
    if argv[:1] == ["--compile"]:
        return _compile(*argv[1:])
    if argv[:1] == ["--linear"]:
        return _compile_linear(*argv[1:])
    sizes, devices = (argv + ["4096x14336x2x2", "1"][len(argv):])[:2]
    why = why_not()
    if why is not None:
        sys.exit(f"gpu_compile: {why}")
    for variant in ("fp8", "bf16", "flax-fp8"):
        s = summary(compile_step(variant, sizes, devices=int(devices)))
        print(json.dumps({"variant": variant, "sizes": sizes, "gpus": int(devices), **s}))


if __name__ == "__main__":
    main(sys.argv[1:])
