"""``jax_fp8.groups.route``: a router's top-k choices into the grouped layout ``ragged_dot`` takes (token
copies sorted by expert, in token order within one, each expert padded to ``pad_to`` rows), against a
plain NumPy construction from the definition, for generated routings (every pad residue, empty experts,
every token on one expert); and ``permute`` / ``unpermute`` round trips."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp8 import groups
from helpers import stable_seed


def _numpy_layout(ids, G, pad_to):
    T, k = ids.shape
    flat = ids.reshape(-1)
    rows, sizes = [], []
    for g in range(G):
        mine = [a for a in range(T * k) if flat[a] == g]
        n = -(-len(mine) // pad_to) * pad_to
        rows += mine + [-1] * (n - len(mine))
        sizes.append(n)
    rows += [-1] * (groups.layout_rows(T, k, G, pad_to) - len(rows))
    return np.asarray(rows), np.asarray(sizes)


#: one compile per shape, G and pad_to: the kinds of routing are arguments of it
_route = jax.jit(groups.route, static_argnums=(1, 2))

CASES = [(T, k, G, pad, kind) for T, k, G in ((1, 1, 1), (7, 2, 4), (64, 8, 256), (300, 2, 8))
         for pad in (1, 4, 128) for kind in ("uniform", "one_expert", "skewed")]


@pytest.mark.parametrize("T,k,G,pad_to,kind", CASES)
def test_route_is_the_definition(T, k, G, pad_to, kind):
    rng = np.random.default_rng(stable_seed("route", T, k, G, pad_to, kind))
    if kind == "uniform":
        ids = np.stack([rng.choice(G, k, replace=False) if k <= G else rng.integers(0, G, k) for _ in range(T)])
    elif kind == "one_expert":
        ids = np.full((T, k), G - 1)
    else:
        ids = np.minimum(rng.geometric(0.5, (T, k)) - 1, G - 1)
    r = _route(jnp.asarray(ids, jnp.int32), G, pad_to)
    rows, sizes = _numpy_layout(ids, G, pad_to)
    np.testing.assert_array_equal(r.rows, rows)
    np.testing.assert_array_equal(r.group_sizes, sizes)
    np.testing.assert_array_equal(np.asarray(r.rows)[np.asarray(r.dest)], np.arange(T * k))
    x = jnp.asarray(rng.standard_normal((T, 3)), jnp.float32)
    xp = r.permute(x, k)
    np.testing.assert_array_equal(xp, np.where(rows[:, None] >= 0, np.asarray(x)[np.maximum(rows, 0) // k], 0))
    w = jnp.asarray(rng.uniform(size=(T, k)), jnp.float32)
    np.testing.assert_allclose(r.unpermute(xp, w), np.asarray(x) * np.asarray(w).sum(1, keepdims=True), rtol=1e-6)
