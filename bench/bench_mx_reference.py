"""MXFP8 off Blackwell: the GEMM the MXFP8 recipe runs where cuDNN's block-scaled GEMM does not (Hopper,
CPU), a bf16 GEMM of the dequantized operands with fp32 accumulation, against bf16 ``lax.dot_general``
and the fp32 ``Precision.HIGHEST`` dot it replaced, on the same pre-quantized operands, one GEMM per
call (the dequantization included); then one linear layer's forward + backward with the MXFP8 recipe
(``implementation="reference"``) against bf16.

  python bench/bench_mx_reference.py [--shapes 4096x4096x4096,8192x8192x8192] [--iters 30]
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

import jax_fp8 as jf
from jax_fp8.gemm.reference import mx_gemm_reference, mx_values

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import jax_time  # noqa: E402

NK, KN = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))


def fp32_highest(a, sa, b, sb):
    """The MXFP8 reference before: an fp32 dot of the dequantized operands at HIGHEST."""
    return lax.dot_general(mx_values(a, sa), mx_values(b, sb), NK, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def layer(dot):
    def f(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: dot(a, b, KN, preferred_element_type=jnp.bfloat16), x, w)
        return (y, *vjp(dy))
    return f


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x4096x4096,8192x8192x8192,16384x4096x14336", help="MxNxK,...")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    keys = iter(jax.random.split(jax.random.key(0), 64))
    mx = jf.MXFP8BlockScaling()

    def emulated(x, w, dn, **kw):
        return jf.fp8_dot_general(x, w, dn, recipe=mx, implementation="reference", **kw)

    for shape in args.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        sets = []
        for _ in range(3):
            a, b = (jax.random.normal(next(keys), s, jnp.bfloat16) for s in ((M, K), (N, K)))
            qa, qb = jf.quantize_mxfp8(a), jf.quantize_mxfp8(b)
            sets.append((a, b, qa.rowwise_data, qa.rowwise_scale_inv, qb.rowwise_data, qb.rowwise_scale_inv))
        bf16 = jax_time(lambda a, b, *_: lax.dot_general(a, b, NK, preferred_element_type=jnp.bfloat16), sets,
                        args.iters)
        ref = jax_time(lambda a, b, *q: mx_gemm_reference(*q, out_dtype=jnp.bfloat16), sets, args.iters)
        old = jax_time(lambda a, b, *q: fp32_highest(*q), sets, args.iters)
        print(f"GEMM {M}x{N}x{K}: bf16 {bf16 * 1e6:.1f} us; MXFP8 reference (bf16 GEMM) {ref * 1e6:.1f} us "
              f"({bf16 / ref:.2f}x bf16); fp32 HIGHEST {old * 1e6:.1f} us ({bf16 / old:.2f}x bf16)")
        lsets = [tuple(jax.random.normal(next(keys), s, jnp.bfloat16) for s in ((M, K), (K, N), (M, N)))
                 for _ in range(3)]
        t_bf16 = jax_time(layer(lax.dot_general), lsets, args.iters)
        t_mx = jax_time(layer(emulated), lsets, args.iters)
        print(f"LINEAR {M}x{K}->{N} fwd+bwd: bf16 {t_bf16 * 1e6:.1f} us; MXFP8 reference {t_mx * 1e6:.1f} us "
              f"({t_bf16 / t_mx:.2f}x bf16)")


if __name__ == "__main__":
    main()
