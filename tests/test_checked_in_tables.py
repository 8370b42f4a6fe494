"""The measured tables checked in to the package (``jax_fp8.gemm.table.TABLE``: the kernel per GPU and
shape; ``jax_fp8.gemm.crossover.TABLES``: where FP8 pays) hold only rows their readers take. A bad row
there would raise, or steer a GEMM wrongly, only on the GPU it names, when a function is traced: these
checks run everywhere."""
import math

import pytest

import jax_fp8 as jf
from jax_fp8.gemm import crossover, table
from jax_fp8.gemm.backends import cutlass, implementations

GEMM_ROWS = [(kind, key, row) for kind, keys in table.TABLE.items() for key, rows in keys.items() for row in rows]
#: the crossover tables' recipe keys, as fp8_pays is asked with each
RECIPES = {"blockwise": jf.Float8BlockScaling(), "mxfp8": jf.MXFP8BlockScaling()}


def _shape_ok(shape) -> bool:
    return len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)


@pytest.mark.parametrize("kind, key, row", GEMM_ROWS,
                         ids=[f"{k}-{p}-{'x'.join(map(str, r[0]))}" for k, p, r in GEMM_ROWS])
def test_every_gemm_table_row_names_options_its_backend_takes(kind, key, row):
    shape, name, options = row
    assert key in table.KEYS, key
    assert _shape_ok(shape), shape
    if key.startswith("ragged_"):
        # the grouped GEMMs run on CUTLASS's grouped kernels; at its own shape a row is the one chosen
        assert name == cutlass.CUTLASS.name, name
        assert cutlass.ragged_options(key[-1], *shape, device_kind=kind) == {**cutlass.DEFAULT_RAGGED_OPTIONS,
                                                                             **options}
    else:
        backend = implementations()[name]
        backend.with_options(**options)  # raises ValueError naming an option out of range
        assert table.choose_for(key, *shape, device_kind=kind) == (name, options)


def test_gemm_table_rows_are_unique_per_shape():
    for kind, keys in table.TABLE.items():
        for key, rows in keys.items():
            shapes = [r[0] for r in rows]
            assert len(shapes) == len(set(shapes)), (kind, key)


@pytest.mark.parametrize("kind", sorted(crossover.TABLES))
def test_every_crossover_row_is_a_shape_and_a_ratio(kind):
    for recipe, rows in crossover.TABLES[kind].items():
        assert recipe in RECIPES and crossover.recipe_name(RECIPES[recipe]) == recipe, recipe
        shapes = [shape for shape, _ in rows]
        assert len(shapes) == len(set(shapes)), (kind, recipe)
        for shape, ratio in rows:
            assert _shape_ok(shape), shape
            assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0, (shape, ratio)
        # the nearest row answers at each measured shape
        for shape, ratio in rows:
            assert crossover.fp8_pays(*shape, RECIPES[recipe], device_kind=kind) == (ratio > 1), (shape, ratio)


def test_the_measured_gpus_have_their_tables():
    """Both lent GPUs' crossover grids (M 4096, 8192, 16384 x K, N 512 to 14336: 72 shapes) and the H200's
    kernel rows are there: the checks above would pass on an emptied table."""
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        shapes = {shape for shape, _ in crossover.TABLES[kind]["blockwise"]}
        assert len(shapes) >= 72 and {m for m, _, _ in shapes} >= {4096, 8192, 16384}, (kind, len(shapes))
    assert {"1D2D", "1D1D", "ragged_k"} <= set(table.TABLE["NVIDIA H200"])
