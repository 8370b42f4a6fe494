"""No extra passes of ours around the GEMMs: the decoder's FP8 training step (examples/_transformer.py,
every projection on ``fp8_dot_general``, aligned sizes) holds three quantize calls and three GEMMs per
projection and not one data-movement op (pad, slice, transpose, concatenate, copy, gather) made by
jax_fp8's code (source locations say whose ops), on one device and with the 8 devices of a mesh in
view (where stacked sequences may split). What XLA adds when it compiles for the GPU is the profile's
job (bench/bench_model.py --profile)."""
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import collections, os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "..", "examples"))
    import jax
    import _transformer as T
    import jax_fp8

    ROOT = os.path.dirname(jax_fp8.__file__) + os.sep
    MOVES = {"pad", "slice", "dynamic_slice", "dynamic_update_slice", "transpose", "concatenate", "copy",
             "copy_p", "gather", "rev"}
    cfg = T.Config(d_model=256, ffn=512, heads=2, layers=2, seq=256, vocab=256)
    # the jaxpr needs the state's shapes, not its values: no eager initialisation (seconds of op compiles)
    state = jax.eval_shape(lambda: T.init_state(cfg, "fp8", T.init_params(cfg, 0), T.optimizer()))
    jaxpr = jax.make_jaxpr(T.make_train_step(donate=False))(state, T.make_batches(cfg, 2, 1)[0])
    calls, ours = collections.Counter(), []

    def walk(j):
        for e in j.eqns:
            name = e.primitive.name
            calls[name] += name.startswith("jf_")
            tb = e.source_info.traceback
            frames = [f for f in (tb.frames if tb is not None else ()) if f.file_name.startswith(ROOT)]
            if name in MOVES and frames:
                ours.append(f"{name} {e.outvars[0].aval} at {frames[0].file_name}:{frames[0].line_num}")
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    print("CALLS", calls["jf_quantize"], calls["jf_fp8_gemm"], len(jax.devices()))
    print("OURS", ours)
""")


def _scan(devices: int):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, HERE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line[:4] in ("CALL", "OURS"))
    return [int(v) for v in lines["CALLS"].split()], lines["OURS"]


def test_fp8_step_has_no_data_movement_of_ours():
    for devices in (1, 8):
        (quantize, gemm, seen), ours = _scan(devices)
        assert seen == devices
        # 9 projections (4 per layer, the head), each: x, W and dy quantized once, 3 GEMMs
        assert quantize == gemm == 27, (quantize, gemm)
        assert ours == "[]", f"{devices} device(s): {ours}"
