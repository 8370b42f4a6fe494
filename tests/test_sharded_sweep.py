"""Generated sharded-``jit`` programs (tests/sweep.py): every one compiles and gives the one-device
values, whatever the widths, meshes and shardings.

The fixed sample runs in the suite (about 2 minutes); ``--sweep-examples N`` adds N programs drawn
by hypothesis from the same space, with the same checks:

    python -m pytest tests/test_sharded_sweep.py --sweep-examples 2000 -k hypothesis
"""
from __future__ import annotations

import math

import pytest

import sweep
from sweep import (COMMON, CONSTRUCTIONS, DOT_OPS, DOT_SHARDINGS, MESHES, ODD, QUANTIZE_OPS, QUANTIZE_SHARDINGS,
                   Case, fixed_sample, roles, run_case)

SAMPLE = fixed_sample()


def _sizes(case: Case) -> dict:
    return dict(zip(roles(case.op, case.sharding), (*case.x_shape, case.n)))


def test_the_sample_covers_every_class():
    """What the fixed sample must hold, checked on it (so a change to the generator cannot silently
    drop a class): every op with every sharding of its family; every op, sharding and construction on
    every mesh size, every sharding with every construction and the dot's shardings on every mesh; per family, mesh size and dim, every residue
    of the block count modulo the mesh size, 32-wide partial blocks, ODD sizes and the COMMON widths."""
    pairs = {(c.op, c.sharding) for c in SAMPLE}
    assert pairs >= {(op, s) for op in QUANTIZE_OPS for s in QUANTIZE_SHARDINGS}
    assert pairs >= {(op, s) for op in DOT_OPS for s in DOT_SHARDINGS}
    assert {(c.sharding, c.mesh) for c in SAMPLE if c.op in DOT_OPS} >= {(s, m) for s in DOT_SHARDINGS for m in MESHES}
    built = {(c.sharding, c.construction) for c in SAMPLE}
    assert built >= {(s, how) for s in QUANTIZE_SHARDINGS + DOT_SHARDINGS for how in CONSTRUCTIONS}
    for family, ops in (("quantize", QUANTIZE_OPS), ("dot", DOT_OPS)):
        cases = [c for c in SAMPLE if c.family == family]
        assert {c.mesh for c in cases} == set(MESHES), family
        assert {(c.op, c.mesh) for c in cases if c.op in DOT_OPS} >= {(op, m) for op in DOT_OPS for m in MESHES} \
            if family == "dot" else True
        for L in {math.prod(shape) for shape, _ in MESHES.values()}:
            at_l = [c for c in cases if math.prod(MESHES[c.mesh][0]) == L]
            assert {c.construction for c in at_l} == set(CONSTRUCTIONS), (family, L)
            for kind, dims in (("rows", ("rows", "seq")), ("k", ("k",)), ("n", ("n",))):  # seq: rows too
                sizes = [v for c in at_l for d, v in _sizes(c).items() if d in dims]
                if family == "quantize" and kind == "n":
                    continue
                residues = {(s // 128) % L for s in sizes if s % 32 == 0}
                assert residues == set(range(L)), (family, L, kind, sorted(residues))
        every = [v for c in cases for r, v in _sizes(c).items() if r != "batch"]
        assert {v % 128 for v in every} >= {0, 32, 64, 96}, family  # whole and partial 128-blocks
        assert set(every) & set(ODD), family
        assert set(every) >= set(COMMON), (family, sorted(set(COMMON) - set(every)))


@pytest.mark.parametrize("case", SAMPLE, ids=str)
def test_sharded_program_compiles_and_matches_one_device(case):
    run_case(case)


def test_hypothesis_sweep(request):
    """``--sweep-examples N``: N programs drawn by hypothesis (the flag's run is recorded in
    bench/RESULTS.md, "Sharded-jit sweep")."""
    n = request.config.getoption("--sweep-examples")
    if not n:
        pytest.skip("the drawn sweep runs with --sweep-examples N")
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=n, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(sweep.case_strategy())
    def check(case):
        run_case(case)

    check()
