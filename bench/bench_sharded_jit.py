"""Sharded arrays under plain ``jax.jit`` (no shard_map): per-device memory and collectives of the
compiled program, jax_fp8 next to the ``lax`` / ``jnp`` code it replaces, on one mesh.

Compiles (does not run) one linear layer's gradient step and the quantize calls for data parallel,
tensor parallel (column, row) and FSDP shardings, and prints, per case and implementation: the
compiled per-device temporaries (``memory_analysis().temp_size_in_bytes``) and every all-gather /
all-reduce / all-to-all / collective-permute with its element type and per-device result bytes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/bench_sharded_jit.py [--m 16384 --k 4096 --n 4096]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fp8 as jf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _transformer as T  # noqa: E402


def collectives(hlo: str) -> Counter:
    """(op, element type) -> per-device result bytes, summed over the compiled HLO's collectives (the
    decoder example's reader of them, ``examples/_transformer.py``)."""
    out = Counter()
    for entry in T.hlo_collectives(hlo):
        out[entry[:2]] += T.collective_bytes(entry)
    return out


def measure(fn, *args) -> tuple[float, Counter]:
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20, collectives(compiled.as_text())


def grad_step(dot):
    dims = (((1,), (0,)), ((), ()))
    return jax.grad(lambda x, w: jnp.sum(dot(x, w, dims).astype(jnp.float32) ** 2), argnums=(0, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    args = ap.parse_args()
    n_dev = len(jax.devices())
    line = jax.make_mesh((n_dev,), ("data",), axis_types=(AxisType.Auto,))
    grid = jax.make_mesh((n_dev // 2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    print(f"jax {jax.__version__}, {n_dev} {jax.devices()[0].platform} devices; meshes {dict(line.shape)} and "
          f"{dict(grid.shape)}; x ({args.m}, {args.k}) bf16, W ({args.k}, {args.n}) bf16")
    cases = {  # name: (mesh, x spec, W spec)
        "data parallel": (line, P("data", None), P()),
        "tensor parallel, column": (grid, P("data", None), P(None, "model")),
        "tensor parallel, row": (grid, P("data", "model"), P("model", None)),
        "FSDP": (line, P("data", None), P("data", None)),
    }
    x = jax.ShapeDtypeStruct((args.m, args.k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((args.k, args.n), jnp.bfloat16)
    print("| case | implementation | temp MiB / device | collectives (op dtype: MiB per device) |")
    print("| --- | --- | ---: | --- |")
    for name, (mesh, xs, ws) in cases.items():
        xa = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, xs))
        wa = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, ws))
        for impl, dot in (("lax.dot_general", lax.dot_general), ("jf.fp8_dot_general", jf.fp8_dot_general)):
            mem, coll = measure(grad_step(dot), xa, wa)
            text = ", ".join(f"{op} {dt}: {b / 2**20:.2f}" for (op, dt), b in sorted(coll.items())) or "none"
            print(f"| {name} (gradient step) | {impl} | {mem:.1f} | {text} |")
    xa = jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=NamedSharding(grid, P("data", "model")))
    for impl, fn in (("jnp reference (jf.reference)", lambda v: jf.reference.quantize_mxfp8(v, colwise=True)),
                     ("jf.quantize_mxfp8", lambda v: jf.quantize_mxfp8(v, colwise=True)),
                     ("jf.quantize_blockwise 128x128", lambda v: jf.quantize_blockwise(v, block=(128, 128))),
                     ("jf.quantize_dequantize", lambda v: jf.quantize_dequantize(v, "blockwise"))):
        mem, coll = measure(fn, xa)
        text = ", ".join(f"{op} {dt}: {b / 2**20:.2f}" for (op, dt), b in sorted(coll.items())) or "none"
        print(f"| quantize, x f32 split P('data', 'model') | {impl} | {mem:.1f} | {text} |")


if __name__ == "__main__":
    main()
