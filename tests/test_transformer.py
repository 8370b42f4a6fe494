"""The Llama-style decoder example (flax) trains a few steps with its loss falling, FP8 next to bf16, and
the end-to-end benchmark runs its three variants at a tiny size."""
import math
import os
import sys

import numpy as np
import pytest

from jax_fp8 import MXFP8GemmFallbackWarning

pytest.importorskip("flax")
pytest.importorskip("optax")
HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

TINY = ["--d-model", "128", "--ffn", "256", "--heads", "2", "--layers", "1", "--seq", "64", "--batch", "4",
        "--vocab", "128"]


def test_train_transformer_loss_falls_fp8_tracks_bf16(capsys):
    import train_transformer

    res = train_transformer.main(TINY + ["--steps", "16", "--warmup", "2", "--lr", "1e-2", "--log-every", "5"])
    (fp8, fp8_t), bf16 = res["fp8"][:2], res["bf16"].losses
    assert len(fp8) == len(bf16) == len(fp8_t) == 16
    assert fp8[0] > 0.9 * math.log(128)  # starts near the uniform guess
    # stated tolerance: after 16 steps the loss has fallen by 25%, and FP8 is within 3% of bf16
    assert np.mean(fp8[-3:]) < 0.75 * fp8[0], fp8
    assert abs(np.mean(fp8[-3:]) / np.mean(bf16[-3:]) - 1) < 0.03, (fp8[-3:], bf16[-3:])
    out = capsys.readouterr().out
    assert "[     fp8] step     1/16" in out and "[    bf16] step    16/16" in out
    assert "fp8 / bf16: loss ratio" in out and "step-time ratio" in out


def test_train_transformer_mxfp8_recipe_tracks_bf16(capsys):
    """--recipe mxfp8: every projection on fp8_dot_general with the MXFP8 recipe (on the CPU its GEMMs
    run as their reference, with its warning); the loss falls and stays within 3% of bf16's."""
    import train_transformer

    with pytest.warns(MXFP8GemmFallbackWarning):
        res = train_transformer.main(TINY + ["--steps", "16", "--warmup", "2", "--lr", "1e-2", "--log-every", "5",
                                             "--recipe", "mxfp8"])
    fp8, bf16 = res["fp8"].losses, res["bf16"].losses
    assert np.mean(fp8[-3:]) < 0.75 * fp8[0], fp8
    assert abs(np.mean(fp8[-3:]) / np.mean(bf16[-3:]) - 1) < 0.03, (fp8[-3:], bf16[-3:])
    out = capsys.readouterr().out
    assert "fp8 recipe mxfp8" in out and "fp8 / bf16: loss ratio" in out


def test_train_transformer_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import train_transformer

    path = tmp_path / "losses.png"
    train_transformer.plot(str(path), {"fp8": [3.0, 2.0, 1.5], "bf16": [3.0, 2.1, 1.4]})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--d-model", "100", "--heads", "3"], "must split into 3 heads"),
    (["--variants", "fp8,int4"], "unknown variant 'int4'"),
    (["--steps", "0"], "--steps must be a positive integer"),
])
def test_train_transformer_bad_flags(argv, message, capsys):
    import train_transformer

    with pytest.raises(SystemExit) as exc:
        train_transformer.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_attention_implementation():
    """auto: cuDNN's fused attention on an NVIDIA GPU with 16-bit activations, XLA's elsewhere; a bad
    name raises, naming the field."""
    import jax
    import jax.numpy as jnp
    import _transformer as T

    dev = jax.devices()[0]
    nvidia = dev.platform == "gpu" and "NVIDIA" in dev.device_kind
    assert T.Config().attention_impl() == ("cudnn" if nvidia else "xla")
    assert T.Config(dtype=jnp.float32).attention_impl() == "xla"
    assert T.Config(attention="xla").attention_impl() == "xla"
    with pytest.raises(ValueError, match="attention must be one of"):
        T.Config(attention="flash")


def test_same_start_and_data_for_every_variant():
    """The variants share the parameter tree (flax-fp8 adds only its FP8 meta collection)."""
    import jax
    import _transformer as T

    cfg = T.Config(vocab=128, d_model=128, ffn=256, heads=2, layers=1, seq=64)
    params = T.init_params(cfg)
    states = {v: T.init_state(cfg, v, params, T.optimizer()) for v in T.VARIANTS}
    for v, s in states.items():
        assert jax.tree_util.tree_structure(s.params["params"]) == jax.tree_util.tree_structure(params), v
    assert set(states["flax-fp8"].params) == {"params", "_overwrite_with_gradient"}
    a, b = T.make_batches(cfg, 2, 3), T.make_batches(cfg, 2, 3)
    assert a.shape == (3, 2, 65) and np.array_equal(a, b)


def test_every_projection_on_the_fp8_gemm():
    """The fp8 variant's training step runs every projection's three GEMMs (fprop, dgrad, wgrad) as
    jf_fp8_gemm: 4 projections per layer (QKV, out, gate/up, down) and the LM head; bf16 runs none.
    Counted in the jaxpr, so the same on every platform."""
    import jax
    import _transformer as T

    for layers in (1, 2):
        cfg = T.Config(vocab=128, d_model=128, ffn=256, heads=2, layers=layers, seq=64)
        params, tokens = T.init_params(cfg), T.make_batches(cfg, 2, 1)[0]
        for variant, want in (("fp8", 3 * (4 * layers + 1)), ("fp8-fused", 3 * (4 * layers + 1)), ("bf16", 0)):
            state = T.init_state(cfg, variant, params, T.optimizer())
            step = T.make_train_step(donate=False)
            jaxpr = str(jax.make_jaxpr(step)(state, tokens))
            assert jaxpr.count("jf_fp8_gemm") == want, (variant, layers, jaxpr.count("jf_fp8_gemm"))


def test_bench_model_smoke(capsys):
    import bench_model

    res = bench_model.main(TINY[:-4] + ["--seq", "64", "--batch", "2", "--vocab", "128", "--steps", "4", "--untimed",
                                        "1", "--dispatch", "3", "--loss-window", "2"])
    assert set(res) == {"fp8", "bf16", "flax-fp8", "fp8-auto", "fp8-fused"}
    for v, r in res.items():
        assert len(r["losses"]) == 4 and np.isfinite(r["losses"]).all() and r["step_s"] > 0, v
        assert not r["fallbacks"], r["fallbacks"]
    out = capsys.readouterr().out
    assert "fp8 / bf16: step-time ratio" in out and "flax-fp8 / bf16: step-time ratio" in out
