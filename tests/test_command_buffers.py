"""Our CUDA custom calls inside XLA's command buffers (CUDA graphs): a linear layer's forward + backward
on ``fp8_dot_general`` (3 quantize calls, 3 GEMMs, on cuBLASLt or CUTLASS), and the fused RMSNorm + SwiGLU
MLP of ``jax_fp8.norm_mlp`` (5 fused producers, 1 quantize call, 6 GEMMs), compiled with command buffers
on, and an MoE projection's forward + backward on ``fp8_ragged_dot`` (2 grouped quantize calls, 1 dense, 3
grouped GEMMs; the group sizes an argument: the graph replays with other routings, so nothing is read on
the host), has every one of its custom calls inside a command buffer (a ``kCommandBuffer`` thunk of XLA's thunk
dump, read as ``tests/gpu_compile.py`` reads it: XLA forms command buffers from the thunk sequence, so
the optimized HLO does not show them), and replaying the graph on fresh inputs gives the bits of the
same step compiled with command buffers off. GPU only (the flags must be set before jax starts: each
setting runs in its own process). ``tests/test_compiled_for_gpu.py`` checks the whole training step's
calls, also without a GPU."""
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jax_fp8 as jf
import gpu_compile

SCRIPT = textwrap.dedent(r"""
    import json, os, re, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_fp8 as jf

    backend, layer = sys.argv[2], sys.argv[3]  # every GEMM on this backend, by a GEMM table for this GPU
    kind = jax.local_devices()[0].device_kind
    jf.gemm.table.TABLE[kind] = {p: [((256, 256, 256), backend, {})] for p in ("1D2D", "1D1D")}

    bf16, f32 = jnp.bfloat16, jnp.float32
    if layer == "linear":
        def step(x, w, dy):
            y, vjp = jax.vjp(lambda x, w: jf.fp8_dot_general(x, w, (((1,), (0,)), ((), ()))), x, w)
            return (y, *vjp(dy))
        specs = [((256, 512), bf16), ((512, 384), bf16), ((256, 384), bf16)]
    elif layer == "mlp":  # the fused MLP: fp32 masters (gamma, both kernels), bf16 activations
        def step(x, g, w1, w2, dy):
            y, vjp = jax.vjp(jf.norm_mlp, x, g, w1, w2)
            return (y, *vjp(dy))
        specs = [((256, 512), bf16), ((512,), f32), ((512, 768), f32), ((384, 512), f32), ((256, 512), bf16)]
    else:  # an MoE projection: fp8_ragged_dot, the group sizes an argument that differs in every replay
        def step(x, w, dy, sizes):
            y, vjp = jax.vjp(lambda x, w: jf.fp8_ragged_dot(x, w, sizes), x, w)
            return (y, *vjp(dy))
        specs = [((640, 256), bf16), ((4, 256, 384), bf16), ((640, 384), bf16)]

    f = jax.jit(step)
    keys = lambda seed: jax.random.split(jax.random.key(seed), len(specs))
    def args(seed):
        a = [jax.random.normal(k, s, jnp.float32).astype(d) for k, (s, d) in zip(keys(seed), specs)]
        if layer == "moe":  # 4 groups of random sizes, rows past their total
            a.append(jnp.asarray(np.random.default_rng(seed).multinomial(600, [0.4, 0.1, 0.0, 0.5]), jnp.int32))
        return a
    hlo = f.lower(*args(0)).compile().as_text()
    ours = re.findall(r'custom_call_target="(jf_[a-z0-9_]+)"', hlo)
    gemms = re.findall(r'custom_call_target="(jf_[a-z]+_gemm)"', hlo)
    assert gemms == [f"jf_{backend}_gemm"] * len(gemms), gemms
    # the primitives' names, as the thunks are named
    ours = ["jf_fp8_gemm" if o in gemms else "jf_fp8_ragged_gemm" if o == "jf_cutlass_ragged_gemm" else o
            for o in ours]
    outs = [np.asarray(o).view(np.uint16 if o.dtype.itemsize == 2 else np.uint32).tolist() for seed in (1, 2, 3) for o in f(*args(seed))]
    json.dump({"ours": ours, "outs": outs}, open(sys.argv[1], "w"))
""")


def _run(tmp_path, name, flags, backend, layer):
    out, dump = tmp_path / f"{name}.json", tmp_path / f"dump_{name}"
    # Both runs without XLA's autotuner: it times its own fusions' candidate emitters at every compile, and
    # the norm backward's row sums (jax.numpy, around our calls) then come out of whichever won: on an
    # H100 3 of 131072 bfloat16 dx values were 1 ulp apart between the two runs, one way round in one
    # session and the other way in the next (openxla/xla#37902 shows jnp.sum doing this). That says
    # nothing about our calls' replay, which this test is about.
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags} --xla_gpu_autotune_level=0 "
                                     f"--xla_dump_to={dump}")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), backend, layer], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # XLA forms command buffers from the thunk sequence, after the HLO: its thunk dump says which
    # thunks went into one (tests/gpu_compile.py reads it)
    captured = [re.sub(r"(_local)?(\.\d+)*$", "", name) for name, _, inside in gpu_compile.read_dump(str(dump))["thunks"]
                if name.startswith("jf_") and inside]
    return {**json.loads(out.read_text()), "in_command_buffers": captured}


#: Our custom calls in each layer's step (the GEMM primitive's name, as the thunks are named).
CALLS = {"linear": ["jf_fp8_gemm"] * 3 + ["jf_quantize"] * 3,
         "mlp": ["jf_fp8_gemm"] * 6 + ["jf_produce_quantize"] * 5 + ["jf_quantize"],
         # x and dy by the grouped quantize (group sizes read on the device), the experts' weights by the dense one
         "moe": ["jf_fp8_ragged_gemm"] * 3 + ["jf_quantize_grouped"] * 2 + ["jf_quantize"]}


@pytest.mark.skipif(not jf.kernels_available().get("cuda"), reason="needs our CUDA kernels on a GPU")
@pytest.mark.parametrize("backend", ["cublaslt", "cutlass"])
@pytest.mark.parametrize("layer", ["linear", "mlp", "moe"])
def test_custom_calls_captured_and_replays_bit_exact(tmp_path, backend, layer):
    from jax_fp8.gemm.backends import BACKENDS

    if jax.default_backend() != "gpu":
        pytest.skip("no GPU backend")
    if layer == "moe" and backend != "cutlass":
        pytest.skip("the grouped GEMMs run on CUTLASS only")
    why = next(b for b in BACKENDS if b.name == backend).unavailable("cuda")
    if why is not None:
        pytest.skip(f"{backend} does not run here: {why}")
    on = _run(tmp_path, "on", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT "
                              "--xla_gpu_graph_min_graph_size=1", backend, layer)
    off = _run(tmp_path, "off", "--xla_gpu_enable_command_buffer=", backend, layer)
    assert sorted(on["ours"]) == sorted(CALLS[layer]), on["ours"]
    assert sorted(on["in_command_buffers"]) == sorted(on["ours"]), on["in_command_buffers"]
    assert off["in_command_buffers"] == [], off["in_command_buffers"]
    assert len(on["outs"]) == 3 * (5 if layer == "mlp" else 3)
    for i, (a, b) in enumerate(zip(on["outs"], off["outs"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"output {i}")
