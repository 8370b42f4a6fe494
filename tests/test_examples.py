"""The examples run a few steps in CI: the loss falls, and FP8 stays close to bf16."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


@pytest.mark.parametrize("fmt", ["mxfp8", "blockwise"])
def test_train_mlp_fp8_tracks_bf16(fmt, capsys):
    import train_mlp

    fp8, bf16 = train_mlp.main(["--fmt", fmt, "--steps", "80", "--batch", "128", "--width", "128"])
    assert fp8[-1] < 0.25 * fp8[0]
    tail = lambda l: sum(l[-8:]) / 8  # noqa: E731
    # stated tolerance: FP8 training loss within 15% of the bf16 run's after 80 steps
    assert tail(fp8) < 1.15 * tail(bf16), (tail(fp8), tail(bf16))
    assert "final loss" in capsys.readouterr().out


def test_shard_map_model_trains(capsys):
    import shard_map_model

    # 150 local rows: the activation gather falls back. No bf16 baseline (test_shard_map_model_mxfp8 checks it)
    losses = shard_map_model.main(["--steps", "12", "--no-bf16"])
    assert losses[-1] < 0.5 * losses[0]
    out = capsys.readouterr().out
    assert "fallback" in out and "one pmax of the 128x128 tile amaxes" in out
    assert "master weight all-gather over 'data' (FP8, 1 byte per element; plus 2 int32 shard windows per " \
           "weight): 102,400 B   (bf16: 204,800 B, 0.50x)" in out


def test_shard_map_model_fast_path(capsys):
    """128 local rows: the activations are gathered as FP8 (both usages), and the model still trains."""
    import shard_map_model

    losses = shard_map_model.main(["--steps", "8", "--seq-len", "256", "--batch", "4", "--log-every", "4", "--no-bf16"])
    assert losses[-1] < 0.6 * losses[0]
    out = capsys.readouterr().out
    assert "128 rows: fast path" in out and "(fast path: FP8 rowwise data" in out


def test_shard_map_model_mxfp8(capsys):
    """--recipe mxfp8: MXFP8 master weights (one uint8 scale all-reduce) and activations gathered as FP8
    (128 local rows: whole 32-row blocks), fed to fp8_dot_general without a second quantization."""
    import shard_map_model
    from jax_fp8 import MXFP8GemmFallbackWarning

    with pytest.warns(MXFP8GemmFallbackWarning):
        losses = shard_map_model.main(["--steps", "8", "--seq-len", "256", "--batch", "4", "--log-every", "4",
                                       "--recipe", "mxfp8"])
    assert losses[-1] < 0.6 * losses[0]
    out = capsys.readouterr().out
    assert "MXFP8: 1x32 / 32x1 blocks" in out and "128 rows: fast path" in out
    assert "one pmax of the E8M0 block scales, uint8" in out
    ratio = float(out.split("fp8 / bf16: loss ratio ")[1].split()[0])  # the bf16 baseline, same steps and data
    assert 0.9 < ratio < 1.1, out


@pytest.mark.parametrize("name", ["blockwise", "mxfp8"])
def test_shard_map_fp8_linear_gradients_are_fp8_dot_generals(name):
    """fp8_linear on the pre-quantized weight gives the forward, dx and (straight-through) dW that
    fp8_dot_general gives for the high-precision weight it quantizes the same way: bit for bit."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_fp8 as jf
    import shard_map_model as S
    from helpers import assert_bits_equal

    kx, kw, kd = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (256, 384), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (384, 256), jnp.float32) / 20).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (256, 256), jnp.float32).astype(jnp.bfloat16)
    recipe = S.RECIPES[name]
    wq = jf.to_layout(jf.quantize(w, recipe.scheme("rhs")), "gemm_ready")

    @jax.jit
    def ours(x, wq):
        y, vjp = jax.vjp(lambda x, g: S.fp8_linear(x, wq, g, recipe), x, jnp.zeros(w.shape, jnp.float32))
        return (y,) + vjp(dy)

    @jax.jit
    def reference(x, w):
        y, vjp = jax.vjp(lambda x, w: jf.fp8_dot_general(x, w, S.FPROP, recipe=recipe), x, w)
        return (y,) + vjp(dy)

    (y, dx, dw), (y_ref, dx_ref, dw_ref) = ours(x, wq), reference(x, w)
    assert_bits_equal(y, y_ref, "y")
    assert_bits_equal(dx, dx_ref, "dx")
    assert dw.dtype == jnp.float32 and np.isfinite(np.asarray(dw)).all()
    assert_bits_equal(dw.astype(jnp.bfloat16), dw_ref, "dW")


@pytest.mark.parametrize("argv, message", [
    (["--data", "3", "--seq", "4"], "--data 3 x --seq 4 needs 12 devices, but only"),  # then what exists here
    (["--batch", "10"], "--batch 10 is not divisible by --data 4"),
    (["--seq-len", "99"], "--seq-len 99 is not divisible by --seq 2"),
    (["--data", "0"], "--data must be a positive integer, got 0"),
])
def test_shard_map_model_bad_mesh_flag(argv, message, capsys):
    """A bad mesh flag stops before any work with an argparse error that names it."""
    import shard_map_model

    with pytest.raises(SystemExit) as exc:
        shard_map_model.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_helper_module_says_what_it_is(capsys):
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "examples", "_fp8_mlp.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "Helper module" in out and "examples/train_mlp.py" in out


# train_transformer.py --mesh: 1 layer of the default model (d_model 128: one 128-wide K block; ffn 384:
# the gate/up kernel's fsdp shards are 3 tiles of 128 each), batch 8 x 128 tokens: one sequence per device
MESH_RUN = ["--d-model", "128", "--ffn", "384", "--heads", "4", "--layers", "1", "--seq", "128", "--batch", "8",
            "--vocab", "256", "--steps", "4", "--warmup", "2", "--variants", "fp8", "--log-every", "1000"]


def test_train_transformer_mesh_matches_one_device(capsys):
    """--mesh data=4,fsdp=2 on the 8 simulated CPU devices (plain jax.jit, NamedShardings only): the FP8
    losses are the single-device run's, and the FSDP weights travel as FP8 bytes.

    Stated tolerance, relative: step 1 (a forward pass on the same parameters; every FP8 GEMM gives the
    same bits on a shard, only the fp32 mean over the batch sums in another order) 1e-5; steps 2-4
    2e-3. After the first update the parameters differ by rounding: XLA's bf16 attention backward gives
    other bits for one sequence per device than for eight on one (its dq and dk differ in ~40% of the
    elements by a bf16 ulp), and re-quantizing to FP8 lets such differences flip roundings; measured
    1.5e-4 at most over these 4 steps (2.6e-4 at step 2, 8.5e-3 by step 60 of the default run, bf16
    8e-4). A wrong gradient shows at once: the misplaced scale grid of a 3-tile shard gave 9.5e-3 at step 2."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import jax
    import numpy as np

    import train_transformer

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py gives the CPU 8)")
    one = train_transformer.main(MESH_RUN)["fp8"]
    mesh = train_transformer.main(MESH_RUN + ["--mesh", "data=4,fsdp=2"])["fp8"]
    rel = np.abs(np.array(mesh.losses) - np.array(one.losses)) / np.array(one.losses)
    assert rel[0] < 1e-5 and rel.max() < 2e-3, (one.losses, mesh.losses)
    out = capsys.readouterr().out
    assert "mesh data=4 x fsdp=2 (8 cpu devices" in out and "w_gate_up (128, 768) dim 1" in out
    assert "[     fp8] compiled step, per device: temp" in out and "all-gather" in out and "all-reduce" in out
    # FSDP: less state per device than on one device
    assert mesh.stats["argument"] < one.stats["argument"], (mesh.stats["argument"], one.stats["argument"])
    # every all-gather: a projection weight as FP8 bytes (u8, either orientation), the embedding table (a
    # jnp.take lookup, no FP8 operand) or a scale grid (a few bytes); no activation, no bf16/f32 weight
    kernels = {(128, 384), (128, 128), (128, 768), (384, 128), (128, 256)}
    kernels |= {k[::-1] for k in kernels}
    gathers = [(dt, shape) for op, dt, shape in mesh.stats["collectives"] if op == "all-gather"]
    weights = [(dt, shape) for dt, shape in gathers if shape in kernels and dt == "u8"]
    assert {shape for _, shape in weights} == {(128, 768), (768, 128), (128, 256), (256, 128)}, gathers
    rest = [(dt, shape) for dt, shape in gathers if (dt, shape) not in weights and shape != (256, 128)]
    assert all(np.prod(shape) <= 64 for _, shape in rest), rest


def test_train_transformer_mesh_flags():
    """Run as a script, --mesh gives the CPU as many simulated devices as the mesh has, unless XLA_FLAGS
    already says; a bad --mesh stops with an argparse error naming it."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import train_transformer as TT

    flag = "--xla_force_host_platform_device_count"
    assert TT.xla_flags_for_mesh(["--mesh", "data=4,fsdp=2"], "") == f"{flag}=8"
    assert TT.xla_flags_for_mesh(["--steps", "3", "--mesh=fsdp=2"], "--xla_cpu_ftz=false") == \
        f"--xla_cpu_ftz=false {flag}=2"
    assert TT.xla_flags_for_mesh(["--mesh", "data=4"], f"{flag}=8") == f"{flag}=8"
    assert TT.xla_flags_for_mesh(["--mesh", "model=2"], "") == "" and TT.xla_flags_for_mesh([], "") == ""
    assert TT.mesh_axes("data=4, fsdp=2") == {"data": 4, "fsdp": 2}
    for bad, message in (("model=2", "each axis one of data, fsdp"), ("data=0", "positive integer"),
                         ("data=64", "needs 64 devices, but only"), ("data=3", "--batch 8 is not divisible by")):
        with pytest.raises(SystemExit) as exc:
            TT.parse_args(["--mesh", bad])
        assert exc.value.code == 2


def test_hlo_collectives_parser():
    """train_transformer.py's collective counts read the compiled HLO: sync and async (GPU) forms, tuples."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import _transformer as T

    hlo = """
  %all-gather.1 = f32[256,128]{1,0} all-gather(f32[128,128]{1,0} %p0), channel_id=1, dimensions={0}
  %ags = ((u8[64,768]{1,0}, f32[1,6]{1,0}), (u8[128,768]{1,0}, f32[2,6]{1,0})) all-gather-start(%a, %b), dimensions={0}
  %agd = (u8[128,768]{1,0}, f32[2,6]{1,0}) all-gather-done(%ags)
  %ar = (f32[128,384]{1,0}, f32[]) all-reduce(%g, %l), to_apply=%add, metadata={op_name="jit(step)/all-reduce"}
  %ars = bf16[8]{0} all-reduce-start(bf16[8]{0} %x), to_apply=%add
"""
    got = T.hlo_collectives(hlo)
    assert got == [("all-gather", "f32", (256, 128)), ("all-gather", "u8", (128, 768)), ("all-gather", "f32", (2, 6)),
                   ("all-reduce", "f32", (128, 384)), ("all-reduce", "f32", ()), ("all-reduce", "bf16", (8,))], got
    assert T.summarize_collectives(got) == {"all-gather": (3, 256 * 128 * 4 + 128 * 768 + 48),
                                            "all-reduce": (3, 128 * 384 * 4 + 4 + 16)}


def test_train_moe_fp8_tracks_bf16(capsys):
    """The MoE example at its defaults but 30 of its 60 steps (the same compiles; the steps were half
    of the test's time): the experts on fp8_ragged_dot train as on bf16 lax.ragged_dot (final losses
    within 1%; measured 0.2% at 30 steps, 0.1% at 60), and both learn (the loss from 5.2 at the first
    step to 1.9, 2.5x below the uniform guess)."""
    import train_moe

    losses = train_moe.main(["--steps", "30"])
    tail = {v: np.mean(l[-6:]) for v, l in losses.items()}
    assert abs(tail["fp8"] / tail["bf16"] - 1) < 0.01, tail
    assert tail["bf16"] < 0.5 * losses["bf16"][0], tail
    assert "final loss" in capsys.readouterr().out


def test_train_moe_expert_parallel(capsys):
    """--expert-parallel 4: the experts split over 4 devices, token copies exchanged by all-to-all (FP8 on
    the wire in the FP8 run). The split model's logits match the one-device model's on the same
    parameters and tokens (bf16 lax.ragged_dot over other groupings: bf16 roundings apart, 0.4% of the
    largest logit measured; a token sent to a wrong expert or back to a wrong row changes it by O(1)), and
    the FP8 run trains as the bf16 run (final losses within 1%)."""
    import jax
    import jax.numpy as jnp
    import train_moe
    from jax import lax
    from jax.sharding import AxisType, PartitionSpec as P

    from helpers import stable_seed

    mesh = jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:4])
    dims = dict(vocab=64, d_model=128, heads=4, layers=1, experts=8, top_k=2, ffn=256, ragged_dot=lax.ragged_dot)
    tokens = jnp.asarray(np.random.default_rng(stable_seed("moe ep")).integers(0, 64, (8, 32)), jnp.int32)
    params = train_moe.Model(**dims).init(jax.random.key(0), tokens)
    whole = train_moe.Model(**dims).apply(params, tokens)[0]
    split = jax.jit(jax.shard_map(lambda p, t: train_moe.Model(**dims, expert_axis="ep").apply(p, t)[0], mesh=mesh,
                                  in_specs=(train_moe.expert_specs(params), P("ep")), out_specs=P("ep")))
    got, want = (np.asarray(v, np.float64) for v in (split(params, tokens), whole))
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max(), np.abs(got - want).max()
    if len(jax.devices()) < 4:  # the example's mesh takes the default backend's devices: one GPU here
        pytest.skip("train_moe.py --expert-parallel 4 needs 4 devices of the default backend")
    losses = train_moe.main(["--expert-parallel", "4", "--steps", "20"])
    tail = {v: np.mean(l[-4:]) for v, l in losses.items()}
    assert abs(tail["fp8"] / tail["bf16"] - 1) < 0.01, tail
    assert tail["bf16"] < 0.5 * losses["bf16"][0], tail
    assert "expert parallel: 2 experts and 2 sequences on each of 4 devices" in capsys.readouterr().out
