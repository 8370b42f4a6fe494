"""A whole existing Flax model on FP8 in one call: ``fp8_model`` / ``fp8_autocast`` (linen) and
``use_fp8_dot_general`` (nnx) on a decoder-only language model shaped as flax's
``examples/lm1b/models.py`` (written here from flax's stock layers: ``nn.Embed``, a fixed sinusoidal
position table, pre-LayerNorm blocks of an unmodified ``nn.MultiHeadDotProductAttention`` under a
causal mask and a ``Dense``-ReLU-``Dense`` MLP, a final LayerNorm and a ``Dense`` head or the tied
``Embed.attend``; no dropout, so that losses compare), and its nnx counterpart.

Every projection runs the FP8 GEMM: the ``jf_fp8_gemm`` primitives in the jaxpr are three per
projection in a training step (fprop, dgrad, wgrad), one in a forward, and no call falls back
(``Fp8GemmFallbackWarning``). The attention's 3-D kernels (q/k/v (d, heads, head_dim), out (heads,
head_dim, d), contracting two dims) reach the GEMM through ``fp8_dot_general``'s fold of them to 2-D;
without that fold the three tests that count GEMMs would see fallbacks.
"""
import dataclasses
import functools
import os
import subprocess
import sys
import warnings
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from helpers import assert_bits_equal

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp8.flax_utils import Fp8Report, fp8_autocast, fp8_model, use_fp8_dot_general  # noqa: E402

GEMM = "jf_fp8_gemm["
Fallback = jf.Fp8GemmFallbackWarning


@dataclasses.dataclass(frozen=True)
class Cfg:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    mlp: int = 256
    layers: int = 2
    max_len: int = 128
    dtype: Any = jnp.bfloat16
    tied_head: bool = False  # lm1b's logits_via_embedding
    remat: bool = False
    scan: bool = False


CFG = Cfg()
#: projections of CFG's model: q, k, v, out and the MLP's two per layer, and the head
PROJECTIONS = 6 * CFG.layers + 1


def _tokens(batch=8, seq=128, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 1, CFG.vocab)  # no padding id (0)


def _sinusoids(max_len: int, d: int) -> np.ndarray:
    """lm1b's fixed position table, (1, max_len, d): sines in the first half of the features, cosines after."""
    pos = np.arange(max_len)[:, None]
    freq = np.exp(-np.log(10000.0) * np.arange(d // 2) / (d // 2 - 1))
    return np.concatenate([np.sin(pos * freq), np.cos(pos * freq)], axis=1)[None].astype(np.float32)


def _shift_right(tokens):
    return jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]


# ---- linen: lm1b's structure ----------------------------------------------------------------------
class LinenMlp(nn.Module):
    cfg: Cfg

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.cfg.mlp, dtype=self.cfg.dtype)(x))
        return nn.Dense(x.shape[-1], dtype=self.cfg.dtype)(h)


class LinenBlock(nn.Module):
    """Pre-LayerNorm: x + attention(LN(x)), then + MLP(LN(x))."""
    cfg: Cfg

    @nn.compact
    def __call__(self, x, mask):
        cfg = self.cfg
        h = nn.LayerNorm(dtype=cfg.dtype)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=cfg.heads, qkv_features=cfg.d_model, dtype=cfg.dtype,
                                            use_bias=False, broadcast_dropout=False, deterministic=True)(h, mask=mask)
        x = x + h
        return x + LinenMlp(cfg)(nn.LayerNorm(dtype=cfg.dtype)(x))


class LinenScanBlock(nn.Module):
    """LinenBlock as an ``nn.scan`` body: (carry, broadcast mask) -> (carry, None)."""
    cfg: Cfg

    @nn.compact
    def __call__(self, x, mask):
        return LinenBlock(self.cfg, name="block")(x, mask), None


class LinenLm(nn.Module):
    cfg: Cfg

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0, dtype=cfg.dtype),
                                nn.make_causal_mask(tokens, dtype=cfg.dtype))
        embed = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=nn.initializers.normal(1.0), name="embed")
        y = embed(_shift_right(tokens)) + _sinusoids(cfg.max_len, cfg.d_model)[:, :tokens.shape[1]]
        y = y.astype(cfg.dtype)
        if cfg.scan:
            body = nn.remat(LinenScanBlock) if cfg.remat else LinenScanBlock
            y, _ = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                           length=cfg.layers)(cfg, name="layers")(y, mask)
        else:
            block = nn.remat(LinenBlock) if cfg.remat else LinenBlock
            for i in range(cfg.layers):
                y = block(cfg, name=f"block_{i}")(y, mask)
        y = nn.LayerNorm(dtype=cfg.dtype, name="final_norm")(y)
        if cfg.tied_head:
            return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(cfg.d_model)
        return nn.Dense(cfg.vocab, dtype=cfg.dtype, name="logits")(y)


def _xent(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens).mean()


def _kernel_paths(params) -> set:
    """The paths of the parameter dicts holding a 'kernel' (or the tied head's 'embedding'): the projections."""
    found = set()

    def walk(tree, path):
        if "kernel" in tree:
            found.add(path)
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, path + (k,))

    walk(params, ())
    return found


def _traced(fn, *args):
    """The jaxpr of ``fn(*args)`` as text, and the messages of the Fp8GemmFallbackWarnings its trace raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", Fallback)
        text = str(jax.make_jaxpr(fn)(*args))
    return text, [str(w.message) for w in caught if issubclass(w.category, Fallback)]


@pytest.fixture(scope="module")
def linen_lm():
    """The bf16 model, its variables, and the same model on FP8 with the shapes of its own init's."""
    model, tokens = LinenLm(CFG), _tokens()
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    fp8 = fp8_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Fallback)  # fallbacks are asserted in test_linen_lm_every_projection_...
        fp8_variables = jax.eval_shape(fp8.init, jax.random.key(0), tokens)
    return model, fp8, variables, fp8_variables, tokens


def test_linen_lm_converts_every_projection_and_keeps_the_parameters(linen_lm):
    model, fp8, variables, fp8_variables, _ = linen_lm
    # the same tree of the same shapes (a bf16 checkpoint loads into the FP8 model and back; the
    # values are the same too: test_linen_report_says_what_it_left_and_why)
    assert jax.tree_util.tree_structure(fp8_variables) == jax.tree_util.tree_structure(variables)
    same = jax.tree_util.tree_map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), fp8_variables, variables)
    assert all(jax.tree_util.tree_leaves(same))
    report = fp8.report
    assert isinstance(report, Fp8Report) and len(report) == PROJECTIONS and not report.left, str(report)
    assert set(report.paths) == _kernel_paths(variables["params"]), str(report)  # every kernel's layer
    assert Counter(layer.kind for layer in report.converted) == {"nn.DenseGeneral": 4 * CFG.layers,
                                                                "nn.Dense": 2 * CFG.layers + 1}
    assert report.attention == [(f"block_{i}", "MultiHeadDotProductAttention_0") for i in range(CFG.layers)]
    text = str(report)
    assert f"{PROJECTIONS} layers on fp8_dot_general, 0 left" in text
    assert "q·k and p·v products of 2 attention layers" in text and "8 nn.DenseGeneral, 5 nn.Dense" in text

    # where= picks by path; the head left in bf16 is reported with the reason
    head_bf16 = fp8_model(model, where=lambda path, m: path != ("logits",))
    jax.eval_shape(head_bf16.apply, variables, _tokens())
    assert len(head_bf16.report) == PROJECTIONS - 1 and [str(x) for x in head_bf16.report.left] == [
        "logits (nn.Dense): excluded by where"]


def test_linen_lm_every_projection_runs_the_fp8_gemm(linen_lm):
    """Forward: one jf_fp8_gemm per projection; training step: three; no fallback (the attention's
    eight DenseGenerals, 3-D kernels, by fp8_dot_general's fold of them to the 2-D GEMM)."""
    model, fp8, variables, _, tokens = linen_lm

    def loss(apply):
        return lambda v, t: _xent(apply(v, t), t)

    bf16_fwd, _ = _traced(model.apply, variables, tokens)
    assert bf16_fwd.count(GEMM) == 0
    fwd, fwd_fallbacks = _traced(fp8.apply, variables, tokens)
    grad, grad_fallbacks = _traced(jax.grad(loss(fp8.apply)), variables, tokens)
    assert not fwd_fallbacks and not grad_fallbacks, sorted(set(fwd_fallbacks + grad_fallbacks))
    assert fwd.count(GEMM) == PROJECTIONS and grad.count(GEMM) == 3 * PROJECTIONS, (fwd.count(GEMM),
                                                                                      grad.count(GEMM))
    assert fwd.count("dot_general[") == 2 * CFG.layers  # only the attention's q·k and p·v, left in bf16
    # lm1b's logits_via_embedding: the tied head (Embed.attend) is the 13th projection
    tied = LinenLm(dataclasses.replace(CFG, tied_head=True))
    tied_fp8 = fp8_model(tied)
    fwd, fallbacks = _traced(tied_fp8.init_with_output, jax.random.key(0), tokens)
    assert not fallbacks and fwd.count(GEMM) == PROJECTIONS, (fallbacks, fwd.count(GEMM))
    assert [str(x) for x in tied_fp8.report.converted if "attend" in x.kind] == ["embed (nn.Embed.attend)"]


def _adam_steps(loss_fn, params, tokens, steps=4, out_shardings=None) -> list[float]:
    """The losses of ``steps`` jitted Adam steps on ``loss_fn(params, tokens)`` (``out_shardings``: the
    step's, e.g. those of the parameters it was given, so that the next step reuses its compile)."""
    tx = optax.adam(3e-3)

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def step(params, opt, tokens):
        loss, g = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    opt, losses = tx.init(params), []
    if out_shardings is not None:  # the step count too (a one-device scalar), else step 2 compiles again
        opt = jax.device_put(opt, out_shardings)
    for _ in range(steps):
        params, opt, loss = step(params, opt, tokens)
        losses.append(float(loss))
    return losses


def _linen_loss(apply):
    return lambda params, tokens: _xent(apply({"params": params}, tokens), tokens)


@pytest.fixture(scope="module")
def bf16_losses(linen_lm):
    """The bf16 model's losses (one device), the baseline of the linen and nnx FP8 runs (same weights)."""
    model, _, variables, _, tokens = linen_lm
    return _adam_steps(_linen_loss(model.apply), variables["params"], tokens)


def test_linen_lm_trains_as_bf16_does_data_parallel(linen_lm, bf16_losses):
    """Adam steps under jit on 8 devices, the batch split over ("data",) (each device's 128 rows one
    sequence), the parameters replicated: it compiles, runs, and its losses are bf16's (one device)
    within FP8's rounding."""
    _, fp8, variables, _, tokens = linen_lm
    mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(variables["params"], replicated)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Fallback)  # asserted in the test above
        fp8_losses = _adam_steps(_linen_loss(fp8.apply), params, jax.device_put(tokens, NamedSharding(mesh, P("data"))),
                                 out_shardings=replicated)
    assert np.isfinite(fp8_losses).all() and fp8_losses[-1] < fp8_losses[0] - 0.1, fp8_losses
    np.testing.assert_allclose(fp8_losses, bf16_losses, rtol=0.02)


def test_linen_lm_under_remat_and_scan():
    """nn.scan over nn.remat'd blocks (stacked parameters): the same tree as the model's own, one
    conversion per scanned layer, and the gradient traces (the scan body's six projections once)."""
    cfg = dataclasses.replace(CFG, remat=True, scan=True)
    model, tokens = LinenLm(cfg), _tokens()
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    fp8 = fp8_model(model)
    fwd, fwd_fallbacks = _traced(fp8.init_with_output, jax.random.key(0), tokens)
    assert jax.tree_util.tree_structure(jax.eval_shape(fp8.init, jax.random.key(0), tokens)) == \
        jax.tree_util.tree_structure(variables)
    assert len(fp8.report) == 7 and not fp8.report.left, str(fp8.report)
    assert ("layers", "block", "MultiHeadDotProductAttention_0", "query") in fp8.report.paths
    v = jax.tree_util.tree_map(lambda s: jnp.full(s.shape, 0.02, s.dtype), variables)
    grad, grad_fallbacks = _traced(jax.grad(lambda v, t: _xent(fp8.apply(v, t), t)), v, tokens)
    assert "remat" in grad or "checkpoint" in grad
    assert not fwd_fallbacks and not grad_fallbacks, sorted(set(fwd_fallbacks + grad_fallbacks))
    assert fwd.count(GEMM) == 7, fwd.count(GEMM)  # the scan body's 6, once, and the head


# ---- linen: what the conversion leaves, and its values -------------------------------------------
def _own_dot(lhs, rhs, dn, precision=None, preferred_element_type=None, **kw):
    return lax.dot_general(lhs, rhs, dn, precision, preferred_element_type, **kw)


class OwnDotCls:
    """A dot_general_cls: instantiated by the layer at each call."""

    def __call__(self, *args, **kwargs):
        return _own_dot(*args, **kwargs)


class ProjectsItsOwnWay(nn.Dense):
    """A Dense whose __call__ never calls its dot_general."""

    @nn.compact
    def __call__(self, x):
        return x @ self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))


class Mixer(nn.Module):
    """An unknown type with a dot_general-like field."""
    dot_general: Any = lax.dot_general

    @nn.compact
    def __call__(self, x):
        return self.dot_general(x, self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 128)),
                                (((x.ndim - 1,), (0,)), ((), ())))


class Zoo(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(128, name="plain")(x)
        x = nn.Dense(128, dot_general=jf.fp8_dot_general, name="already_fp8")(x)
        x = nn.Dense(128, dot_general=_own_dot, name="own_dot")(x)
        x = nn.Dense(128, dot_general_cls=OwnDotCls, name="own_cls")(x)
        x = nn.Dense(128, name="excluded")(x)
        x = ProjectsItsOwnWay(128, name="own_way")(x)
        x = Mixer(name="mixer")(x)
        return nn.Einsum((128, 256), "bsk,kn->bsn", name="einsum")(x)


def test_linen_report_says_what_it_left_and_why():
    x = jax.random.normal(jax.random.key(1), (2, 128, 128), jnp.float32)
    fp8 = fp8_model(Zoo(), where=lambda path, m: path != ("excluded",))
    variables = fp8.init(jax.random.key(0), x)
    jax.tree_util.tree_map(lambda a, b: assert_bits_equal(a, b, "init"), variables, Zoo().init(jax.random.key(0), x))
    report = fp8.report
    assert sorted(report) == [("already_fp8",), ("einsum",), ("plain",)], str(report)
    left = {layer.path[0]: layer.reason for layer in report.left}
    assert left["own_dot"] == "has its own dot_general (_own_dot)"
    assert left["own_cls"] == "has its own dot_general_cls (OwnDotCls)"
    assert left["excluded"] == "excluded by where"
    assert left["own_way"].startswith("its call never reached dot_general")
    assert left["mixer"].startswith("a nn.Mixer with dot_general, a type jax_fp8.flax_utils does not know")
    assert set(left) == {"own_dot", "own_cls", "excluded", "own_way", "mixer"}
    assert "3 layers on fp8_dot_general, 5 left as they were (recipe Float8BlockScaling, where=a callable)" \
        in str(report) and "  left: own_dot (nn.Dense): has its own dot_general (_own_dot)" in str(report)

    # the converted Einsum computes jnp.einsum on fp8_dot_general, bit for bit
    p = variables["params"]["einsum"]
    h = jax.random.normal(jax.random.key(2), (2, 128, 128), jnp.float32)
    want = jnp.einsum("bsk,kn->bsn", h, p["kernel"], _dot_general=jf.fp8_dot_general) + p["bias"]
    with fp8_autocast() as report:
        got = nn.Einsum((128, 256), "bsk,kn->bsn").apply({"params": p}, h)
    assert_bits_equal(got, want, "nn.Einsum") and report.paths == [()]
    # fp8_autocast and fp8_model agree, and outside the context nothing changes
    y = Zoo().apply(variables, x)
    with fp8_autocast(where=lambda path, m: path != ("excluded",)):
        y_ctx = Zoo().apply(variables, x)
    assert_bits_equal(fp8.apply(variables, x), y_ctx, "fp8_autocast vs fp8_model")
    assert not np.array_equal(np.asarray(y), np.asarray(y_ctx))


def test_linen_auto_and_a_context_that_traced_nothing():
    x = jnp.ones((2, 128), jnp.float32)
    dense = nn.Dense(128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jf.CrossoverWarning)  # no crossover table for a CPU
        auto = fp8_model(dense, where="auto")
        variables = auto.init(jax.random.key(0), x)
    assert auto.report == [()] and auto.report.where == "auto" and "where='auto': each call" in str(auto.report)
    # jit's cache does not know the context: a function traced before it keeps its bf16 trace, and says so
    f = jax.jit(dense.apply)
    f(variables, x)
    with pytest.warns(UserWarning, match="fp8_autocast: no flax.linen module was traced inside the context"):
        with fp8_autocast() as report:
            f(variables, x)
    assert len(report) == 0


def test_import_jax_fp8_imports_no_flax():
    """``jf.flax_utils`` comes with ``import jax_fp8``; flax only when one of its functions is called."""
    code = ("import sys, jax_fp8 as jf; assert callable(jf.flax_utils.fp8_model); "
            "assert 'flax' not in sys.modules, 'flax imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]


def test_linen_errors_name_the_argument():
    with pytest.raises(TypeError, match="fp8_model: module must be a flax.linen.Module, got the nnx module Linear"):
        fp8_model(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="fp8_model: where must be None, 'all', 'auto' or a callable"):
        fp8_model(nn.Dense(4), where="bf16")
    with pytest.raises(TypeError, match="fp8_autocast: recipe must be a jax_fp8.Float8BlockScaling"):
        with fp8_autocast("e5m2"):
            pass
    with pytest.raises(TypeError, match="use_fp8_dot_general: model must be a flax.nnx.Module, got the linen"):
        use_fp8_dot_general(LinenLm(CFG))


# ---- nnx: the same model ------------------------------------------------------------------------
class NnxBlock(nnx.Module):
    def __init__(self, cfg: Cfg, rngs: nnx.Rngs):
        d = cfg.d_model
        self.norm1 = nnx.LayerNorm(d, dtype=cfg.dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg.heads, d, d, use_bias=False, decode=False, dtype=cfg.dtype,
                                           rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, dtype=cfg.dtype, rngs=rngs)
        self.up = nnx.LinearGeneral(d, cfg.mlp, dtype=cfg.dtype, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, d, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm1(x), mask=mask, deterministic=True)
        return x + self.down(jax.nn.relu(self.up(self.norm2(x))))


class NnxLm(nnx.Module):
    def __init__(self, cfg: Cfg, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.blocks = nnx.List([NnxBlock(cfg, rngs) for _ in range(cfg.layers)])
        self.final_norm = nnx.LayerNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.head = nnx.Einsum("bsd,dv->bsv", (cfg.d_model, cfg.vocab), (cfg.vocab,), dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens):
        cfg = self.cfg
        mask = nnx.combine_masks(nnx.make_attention_mask(tokens > 0, tokens > 0, dtype=cfg.dtype),
                                 nnx.make_causal_mask(tokens, dtype=cfg.dtype))
        y = self.embed(_shift_right(tokens)) + _sinusoids(cfg.max_len, cfg.d_model)[:, :tokens.shape[1]]
        y = y.astype(cfg.dtype)
        for block in self.blocks:
            y = block(y, mask)
        return self.head(self.final_norm(y))


def _nnx_loss(graphdef, rest):
    return lambda params, tokens: _xent(nnx.merge(graphdef, params, rest)(tokens), tokens)


def test_nnx_lm_every_projection_on_fp8():
    """use_fp8_dot_general on the nnx model: 13 projections (nnx.MultiHeadAttention's LinearGenerals,
    LinearGeneral, Linear, Einsum), the state untouched; jaxpr counts as for linen (the attention's
    3-D kernels wait on the fold); a few training steps as bf16's."""
    model, tokens = NnxLm(CFG, nnx.Rngs(0)), _tokens()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    before = jax.tree_util.tree_map(np.asarray, params)
    report = use_fp8_dot_general(model)
    fp8_graphdef, fp8_params, fp8_rest = nnx.split(model, nnx.Param, ...)
    assert jax.tree_util.tree_structure(fp8_params) == jax.tree_util.tree_structure(params)
    jax.tree_util.tree_map(lambda a, b: assert_bits_equal(a, b, "state"), fp8_params, before)
    assert len(report) == PROJECTIONS and not report.left, str(report)
    assert Counter(layer.kind for layer in report.converted) == {"nnx.LinearGeneral": 5 * CFG.layers,
                                                                "nnx.Linear": CFG.layers, "nnx.Einsum": 1}
    assert ("blocks", 0, "attn", "query") in report and report.attention == [("blocks", i, "attn")
                                                                             for i in range(CFG.layers)]
    assert use_fp8_dot_general(model) == report.paths  # again: rebinds the same layers

    fwd, fwd_fallbacks = _traced(lambda p, t: nnx.merge(fp8_graphdef, p, fp8_rest)(t), fp8_params, tokens)
    grad, grad_fallbacks = _traced(jax.grad(_nnx_loss(fp8_graphdef, fp8_rest)), fp8_params, tokens)
    assert not fwd_fallbacks and not grad_fallbacks, sorted(set(fwd_fallbacks + grad_fallbacks))
    assert fwd.count(GEMM) == PROJECTIONS and grad.count(GEMM) == 3 * PROJECTIONS, (fwd.count(GEMM),
                                                                                      grad.count(GEMM))
    assert fwd.count("dot_general[") == 2 * CFG.layers  # only the attention's q·k and p·v, left in bf16


def _load_linen(model: NnxLm, params) -> None:
    """Sets the nnx model's weights to the linen model's (the same layers, the same shapes)."""
    def put(var, value):
        var[...] = value

    put(model.embed.embedding, params["embed"]["embedding"])
    for i, block in enumerate(model.blocks):
        p = params[f"block_{i}"]
        for norm, name in ((block.norm1, "LayerNorm_0"), (block.norm2, "LayerNorm_1")):
            put(norm.scale, p[name]["scale"]), put(norm.bias, p[name]["bias"])
        for name in ("query", "key", "value", "out"):
            put(getattr(block.attn, name).kernel, p["MultiHeadDotProductAttention_0"][name]["kernel"])
        for layer, name in ((block.up, "Dense_0"), (block.down, "Dense_1")):
            put(layer.kernel, p["LinenMlp_0"][name]["kernel"]), put(layer.bias, p["LinenMlp_0"][name]["bias"])
    put(model.final_norm.scale, params["final_norm"]["scale"]), put(model.final_norm.bias, params["final_norm"]["bias"])
    put(model.head.kernel, params["logits"]["kernel"]), put(model.head.bias, params["logits"]["bias"])


def test_nnx_lm_trains_as_bf16_does(linen_lm, bf16_losses):
    """The nnx model, on FP8 by use_fp8_dot_general and given the linen model's weights: its Adam steps
    under jit give bf16's losses (the linen model's, the same weights) within FP8's rounding."""
    model, tokens = NnxLm(CFG, nnx.Rngs(0)), linen_lm[-1]
    _load_linen(model, linen_lm[2]["params"])
    use_fp8_dot_general(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Fallback)  # asserted in the test above
        fp8_losses = _adam_steps(_nnx_loss(graphdef, rest), params, tokens)
    assert np.isfinite(fp8_losses).all() and fp8_losses[-1] < fp8_losses[0] - 0.1, fp8_losses
    np.testing.assert_allclose(fp8_losses, bf16_losses, rtol=0.02)


def own_einsum(*args, **kwargs):
    return jnp.einsum(*args, **kwargs)


class NnxMixer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((128, 128)))
        self.dot_general = lax.dot_general


class NnxZoo(nnx.Module):
    def __init__(self, rngs):
        self.plain = nnx.Linear(128, 128, rngs=rngs)
        self.own_dot = nnx.Linear(128, 128, dot_general=_own_dot, rngs=rngs)
        self.own_cls = nnx.LinearGeneral(128, 128, dot_general_cls=OwnDotCls, rngs=rngs)
        self.own_einsum = nnx.Einsum("bk,kn->bn", (128, 128), einsum_op=own_einsum, rngs=rngs)
        self.head = nnx.Linear(128, 128, rngs=rngs)
        self.mixer = NnxMixer(rngs)


def test_nnx_report_says_what_it_left_and_why(caplog):
    model = NnxZoo(nnx.Rngs(0))
    with caplog.at_level("INFO", logger="jax_fp8"):
        report = use_fp8_dot_general(model, where=lambda path, m: "head" not in path, log=True)
    assert report == [("plain",)] and model.plain.dot_general is jf.fp8_dot_general
    left = {layer.path[0]: layer.reason for layer in report.left}
    assert left["own_dot"] == "has its own dot_general (_own_dot)" and model.own_dot.dot_general is _own_dot
    assert left["own_cls"] == "has its own dot_general_cls (OwnDotCls)"
    assert left["own_einsum"] == "has its own einsum_op (own_einsum)"
    assert left["head"] == "excluded by where"
    assert left["mixer"].startswith("a nnx.NnxMixer with dot_general, a type jax_fp8.flax_utils does not know")
    assert set(left) == {"own_dot", "own_cls", "own_einsum", "head", "mixer"}
    assert "1 layer on fp8_dot_general, 5 left as they were" in caplog.text
    # calling it again rebinds the recipe (and where) of the layers it made FP8
    e5m2 = jf.Float8BlockScaling(grad_dtype=jnp.float8_e5m2)
    layer = nnx.Einsum("bk,kn->bn", (128, 128), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (128, 128), jnp.float32)
    assert use_fp8_dot_general(layer) == [()]
    want = jnp.einsum("bk,kn->bn", x, layer.kernel[...], _dot_general=jf.fp8_dot_general)  # (no bias_shape: no bias)
    assert_bits_equal(layer(x), want, "nnx.Einsum")
    assert use_fp8_dot_general(layer, e5m2) == [()]
    assert layer.einsum_op.keywords["_dot_general"].keywords["recipe"] is e5m2
