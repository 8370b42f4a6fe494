"""Helper module, not an example to run: the small Llama-style decoder that ``train_transformer.py`` and
``bench/bench_model.py`` import (and ``tests/test_transformer.py`` through them). Needs flax and optax.

The model is a ``flax.linen`` module whose every projection is an ``nn.Dense``; its ``dot_general`` picks
the arithmetic, and nothing else changes between the variants:

- ``"fp8"``: ``nn.Dense(dot_general=jax_fp8.fp8_dot_general)``, Float8 blockwise (1x128 activations
  and gradients, 128x128 weights) on the FP8 GEMM in forward and backward; no FP8 state;
- ``"bf16"``: ``lax.dot_general`` (bf16 operands, as flax's mixed precision gives them);
- ``"fp8-auto"``: as ``"fp8"`` through ``fp8_dot_general_for(recipe, where="auto")``: each projection
  runs in FP8 only where :mod:`jax_fp8.gemm.crossover`'s measured table says a layer of its shapes gains on
  this GPU, else as ``lax.dot_general`` (no table for the GPU: FP8 everywhere, with a warning);
- ``"fp8-fused"``: as ``"fp8"``, with each block's RMSNorm + QKV projection and RMSNorm + SwiGLU MLP on
  :mod:`jax_fp8.fused` (``flax_utils.RMSNormDense`` / ``RMSNormMLP``): the norms, SwiGLU and its
  gradient write the next GEMM's FP8 operands directly and the fp32 masters are cast and quantized in
  one pass, with the parameters of the unfused block (same names and values);
- ``"flax-fp8"``: flax's per-tensor FP8 (``nn.Dense(dot_general_cls=nn.Fp8DirectDotGeneralOp)``), whose
  scales and amax histories live in the ``_overwrite_with_gradient`` collection: its "gradients" are
  the new values (flax's ``TrainState.apply_gradients`` handles that, so every variant uses it).

Blocks: pre-RMSNorm, fused QKV projection, rotary position embeddings, causal attention through
``jax.nn.dot_product_attention`` in the activation dtype, output projection, pre-RMSNorm, fused
gate/up projection, SwiGLU, down projection. Master weights in ``param_dtype`` (fp32), activations in
``dtype`` (bf16). The data is next-token prediction on sequences from a fixed random Markov chain
(each token has a few likely successors), so the loss falls towards the chain's entropy.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fp8 as jf
from jax_fp8.flax_utils import RMSNormDense, RMSNormMLP, fp8_dot_general_for
# the device mesh and the compiled step's collectives (T.make_mesh, T.compiled_stats, ...)
from _mesh import (MESH_AXES, TILE, batch_axes, collective_bytes, compiled_stats, describe_shardings,  # noqa: F401
                   fsdp_spec, hlo_collectives, make_mesh, mesh_shardings, summarize_collectives, tree_bytes)

VARIANTS = ("fp8", "bf16", "flax-fp8", "fp8-auto", "fp8-fused")
ATTENTION = ("auto", "xla", "cudnn")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and data sizes. ``dtype``: activations; ``param_dtype``: master weights."""

    vocab: int = 256
    d_model: int = 128
    ffn: int = 384
    heads: int = 4
    layers: int = 2
    seq: int = 128
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    attention: str = "auto"  # jax.nn.dot_product_attention's implementation: see attention_impl

    def __post_init__(self):
        for f in ("vocab", "d_model", "ffn", "heads", "layers", "seq"):
            if getattr(self, f) < 1:
                raise ValueError(f"Config: {f} must be a positive integer, got {getattr(self, f)}")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(f"Config: d_model {self.d_model} must split into {self.heads} heads of an even size")
        if self.attention not in ATTENTION:
            raise ValueError(f"Config: attention must be one of {ATTENTION}, got {self.attention!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def attention_impl(self) -> str:
        """The attention implementation: "auto" picks cuDNN's fused (flash) attention where it runs (an
        NVIDIA GPU, 16-bit activations, head_dim <= 128) and XLA's otherwise, which materializes the
        (seq, seq) scores of every head (1.1e9 values per layer at bench_model.py's default size)."""
        if self.attention != "auto":
            return self.attention
        dev = jax.devices()[0]
        cudnn_ok = (dev.platform == "gpu" and "NVIDIA" in dev.device_kind and self.head_dim <= 128
                    and jnp.dtype(self.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))
        return "cudnn" if cudnn_ok else "xla"

    def n_params(self) -> int:
        per_layer = 4 * self.d_model ** 2 + 3 * self.d_model * self.ffn + 2 * self.d_model
        return self.layers * per_layer + 2 * self.vocab * self.d_model + self.d_model


def dense_options(variant: str, recipe: Optional[jf.Float8BlockScaling | jf.MXFP8BlockScaling] = None) -> dict:
    """The ``nn.Dense`` keyword arguments of a variant (see the module docstring)."""
    if variant in ("fp8", "fp8-fused"):
        return {"dot_general": fp8_dot_general_for(recipe)}
    if variant == "fp8-auto":
        return {"dot_general": fp8_dot_general_for(recipe, where="auto")}
    if variant == "bf16":
        return {}
    if variant == "flax-fp8":
        return {"dot_general_cls": nn.Fp8DirectDotGeneralOp}
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def rope(x, positions):
    """Rotary position embedding of x (batch, seq, heads, head_dim), computed in fp32."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]  # (seq, half)
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Block(nn.Module):
    """One pre-norm decoder block: attention and a SwiGLU MLP, each with a residual. ``fused``: the norms
    and the MLP on jax_fp8's fused layers (the same parameters)."""

    cfg: Config
    dense: dict
    fused: bool = False
    recipe: Optional[Any] = None

    def _dense(self, features: int, name: str) -> nn.Dense:
        c = self.cfg
        return nn.Dense(features, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype, name=name, **self.dense)

    def _shared(self, module: nn.Module) -> nn.Module:
        nn.share_scope(self, module)  # its parameters under this block's names, as the unfused modules'
        return module

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        B, S, D = x.shape
        if self.fused:
            qkv = self._shared(RMSNormDense(3 * D, dtype=c.dtype, param_dtype=c.param_dtype, recipe=self.recipe,
                                            norm_name="attn_norm", dense_name="wqkv"))(x)
        else:
            h = nn.RMSNorm(dtype=c.dtype, param_dtype=c.param_dtype, name="attn_norm")(x)
            qkv = self._dense(3 * D, "wqkv")(h)
        qkv = qkv.reshape(B, S, 3, c.heads, c.head_dim)
        pos = jnp.arange(S)
        q, k, v = rope(qkv[:, :, 0], pos), rope(qkv[:, :, 1], pos), qkv[:, :, 2]
        # (B, S, heads, head_dim), in c.dtype
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=c.attention_impl())
        x = x + self._dense(D, "wo")(a.reshape(B, S, D))
        if self.fused:
            return x + self._shared(RMSNormMLP(c.ffn, dtype=c.dtype, param_dtype=c.param_dtype, recipe=self.recipe,
                                               norm_name="mlp_norm", gate_up_name="w_gate_up", down_name="w_down"))(x)
        h = nn.RMSNorm(dtype=c.dtype, param_dtype=c.param_dtype, name="mlp_norm")(x)
        gate, up = jnp.split(self._dense(2 * c.ffn, "w_gate_up")(h), 2, axis=-1)
        return x + self._dense(D, "w_down")(nn.silu(gate) * up)


class Decoder(nn.Module):
    """Token embedding, ``cfg.layers`` blocks, final RMSNorm and an output projection (also a Dense)."""

    cfg: Config
    dense: dict
    fused: bool = False
    recipe: Optional[Any] = None

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        x = nn.Embed(c.vocab, c.d_model, param_dtype=c.param_dtype, name="embed")(tokens).astype(c.dtype)
        for i in range(c.layers):
            x = Block(c, self.dense, self.fused, self.recipe, name=f"block_{i}")(x)
        x = nn.RMSNorm(dtype=c.dtype, param_dtype=c.param_dtype, name="final_norm")(x)
        return nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype, name="lm_head",
                        **self.dense)(x)


def make_model(cfg: Config, variant: str,
               recipe: Optional[jf.Float8BlockScaling | jf.MXFP8BlockScaling] = None) -> Decoder:
    return Decoder(cfg, dense_options(variant, recipe), fused=variant == "fp8-fused", recipe=recipe)


# ---- data ---------------------------------------------------------------------------------------
NOISE = 0.01  # probability that the next token is uniform instead of one of its likely successors


def markov_chain(vocab: int, seed: int = 0, successors: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random Markov chain: each token's ``successors`` likely next tokens (vocab, successors) and
    their probabilities (random weights summing to 1); with probability ``NOISE`` the next token is
    uniform instead."""
    rng = np.random.default_rng(seed)
    k = min(successors, vocab)
    succ = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(vocab)]).astype(np.int32)
    return succ, rng.dirichlet(np.ones(k), size=vocab)


def transition_matrix(chain) -> np.ndarray:
    """The chain's (vocab, vocab) transition probabilities."""
    succ, w = chain
    vocab = succ.shape[0]
    p = np.full((vocab, vocab), NOISE / vocab)
    np.add.at(p, (np.arange(vocab)[:, None], succ), (1 - NOISE) * w)
    return p


def chain_entropy(chain) -> float:
    """The chain's entropy rate in nats: the lowest expected next-token loss (under its stationary law)."""
    p = transition_matrix(chain)
    w, v = np.linalg.eig(p.T)
    pi = np.abs(np.real(v[:, np.argmin(np.abs(w - 1))]))
    pi /= pi.sum()
    return float(-(pi[:, None] * p * np.log(p)).sum())


def sample_sequences(chain, n: int, length: int, seed: int = 1) -> np.ndarray:
    """``n`` sequences of ``length`` tokens (int32) from the chain, the first token uniform."""
    succ, w = chain
    vocab, k = succ.shape
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(w, axis=1)
    out = np.empty((n, length), np.int32)
    out[:, 0] = rng.integers(0, vocab, n)
    for t in range(1, length):
        prev = out[:, t - 1]
        j = np.minimum((cdf[prev] < rng.random(n)[:, None]).sum(1), k - 1)
        out[:, t] = np.where(rng.random(n) < NOISE, rng.integers(0, vocab, n), succ[prev, j])
    return out


def make_batches(cfg: Config, batch: int, n_batches: int, seed: int = 0) -> jax.Array:
    """A device array (n_batches, batch, seq + 1) of token sequences from the chain of ``seed``; step i
    trains on batch i % n_batches (pass n_batches = steps for data that never repeats)."""
    seqs = sample_sequences(markov_chain(cfg.vocab, seed), n_batches * batch, cfg.seq + 1, seed + 1)
    return jnp.asarray(seqs.reshape(n_batches, batch, cfg.seq + 1))


# ---- training -----------------------------------------------------------------------------------
def init_params(cfg: Config, seed: int = 0):
    """The parameters every variant starts from (the variants share the ``params`` tree)."""
    tokens = jnp.zeros((1, cfg.seq), jnp.int32)
    return make_model(cfg, "bf16").init(jax.random.key(seed), tokens)["params"]


def optimizer(lr: float = 3e-3, warmup: int = 10) -> optax.GradientTransformation:
    sched = optax.linear_schedule(lr / warmup, lr, warmup) if warmup > 0 else lr
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))


def init_state(cfg: Config, variant: str, params, tx: optax.GradientTransformation,
               recipe: Optional[jf.Float8BlockScaling | jf.MXFP8BlockScaling] = None) -> TrainState:
    """A flax ``TrainState`` of the variant's model starting from ``params`` (plus flax-fp8's FP8 meta)."""
    model = make_model(cfg, variant, recipe)
    if variant == "flax-fp8":
        variables = dict(model.init(jax.random.key(0), jnp.zeros((1, cfg.seq), jnp.int32)))
        variables["params"] = params
    else:
        variables = {"params": params}
    return TrainState.create(apply_fn=model.apply, params=variables, tx=tx)


def loss_fn(apply_fn: Callable, variables, tokens):
    """Mean next-token cross entropy of tokens (batch, seq + 1), logits in fp32."""
    logits = apply_fn(variables, tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_train_step(donate: bool = True, shardings: Optional[tuple] = None) -> Callable:
    """``step(state, tokens) -> (state, loss)``: forward, backward and optimizer update, jitted. With
    ``shardings`` = (the state's, the batch's) (see :func:`mesh_shardings`) the jit takes and gives the
    state in its shardings and the batch in its own: plain ``jax.jit``, the partitioner splits the rest."""

    def step(state: TrainState, tokens):
        loss, grads = jax.value_and_grad(lambda v: loss_fn(state.apply_fn, v, tokens))(state.params)
        return state.apply_gradients(grads=grads), loss

    donate_argnums = (0,) if donate else ()
    if shardings is None:
        return jax.jit(step, donate_argnums=donate_argnums)
    state_sh, batch_sh = shardings
    return jax.jit(step, in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, NamedSharding(batch_sh.mesh, P())), donate_argnums=donate_argnums)


class Run(NamedTuple):
    """What :func:`train` returns: the loss and the seconds of every step (the first step's time includes
    compiling it), and :func:`compiled_stats` of the compiled step."""

    losses: list
    times: list
    stats: dict


def train(cfg: Config, variant: str, params, batches, steps: int, tx: optax.GradientTransformation,
          log: Optional[Callable[[str], None]] = print, log_every: int = 10, recipe=None,
          mesh: Optional[jax.sharding.Mesh] = None) -> Run:
    """Train ``steps`` steps, syncing every step. With a ``mesh`` the state and every batch are placed in
    :func:`mesh_shardings` (FSDP parameters and optimizer state, batch over the data axes) and the step
    is plain ``jax.jit`` with those shardings."""
    state = init_state(cfg, variant, jax.tree_util.tree_map(jnp.array, params), tx, recipe)
    place = lambda tokens: tokens  # noqa: E731
    shardings = None
    if mesh is not None:
        shardings = mesh_shardings(state, mesh)
        state = jax.device_put(state, shardings[0])
        place = lambda tokens: jax.device_put(tokens, shardings[1])  # noqa: E731
    step = make_train_step(shardings=shardings)
    compiled = None
    losses, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        tokens = place(batches[i % batches.shape[0]])
        if compiled is None:  # compiled ahead of the first call, to read its memory and collectives
            compiled = step.lower(state, tokens).compile()
        state, loss = compiled(state, tokens)
        losses.append(float(loss))  # syncs
        times.append(time.perf_counter() - t0)
        if log is not None and log_every and (i % log_every == 0 or i == steps - 1):
            log(f"[{variant:>8}] step {i + 1:5d}/{steps}  loss {losses[-1]:.4f}  step {1e3 * times[-1]:9.2f} ms")
    return Run(losses, times, compiled_stats(compiled))


# ---- the command-line flags of train_transformer.py and bench/bench_model.py ----------------------
def add_model_flags(ap, *, d_model: int, ffn: int, heads: int, layers: int, seq: int, batch: int, vocab: int,
                    variants: str) -> None:
    """The model, data and variant flags both scripts take (with their own defaults)."""
    ap.add_argument("--d-model", type=int, default=d_model)
    ap.add_argument("--ffn", type=int, default=ffn, help="SwiGLU hidden size")
    ap.add_argument("--heads", type=int, default=heads)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--seq", type=int, default=seq, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=batch, help="sequences per step")
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="activation dtype")
    ap.add_argument("--param-dtype", default="float32", choices=sorted(DTYPES), help="master weight dtype")
    ap.add_argument("--attention", default="auto", choices=ATTENTION,
                    help="dot_product_attention implementation (auto: cuDNN on NVIDIA GPUs, else XLA)")
    ap.add_argument("--variants", default=variants,
                    help=f"comma-separated, from {','.join(VARIANTS)} (flax-fp8: flax's per-tensor FP8)")
    ap.add_argument("--seed", type=int, default=0)


def check_model_flags(ap, args, positive: tuple = ()) -> None:
    """Checks add_model_flags' flags (and the `positive` ones) through ``ap.error``; sets
    ``args.variants`` to a list and ``args.cfg`` to the model's Config."""
    for flag in ("d_model", "ffn", "heads", "layers", "seq", "batch", "vocab") + tuple(positive):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown variant {v!r} (choose from {', '.join(VARIANTS)})")
    try:
        args.cfg = Config(vocab=args.vocab, d_model=args.d_model, ffn=args.ffn, heads=args.heads, layers=args.layers,
                          seq=args.seq, dtype=DTYPES[args.dtype], param_dtype=DTYPES[args.param_dtype],
                          attention=args.attention)
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nRun the example instead:\n"
          "  python examples/train_transformer.py      # FP8 decoder next to bf16 on the CPU\n"
          "  python bench/bench_model.py --tiny        # the end-to-end step benchmark (GPU: default sizes)")
