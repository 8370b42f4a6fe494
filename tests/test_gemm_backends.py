"""Every GEMM backend and kernel choice (cuBLASLt's heuristic and each of its candidate algorithms, each
CUTLASS configuration) against the fp64 product of the quantized operands within the derived bound
(test_gemm.py's module doc), on every shape class, and the backends against each other on the same
operands; the table that picks a kernel per shape (``jax_fp8.gemm.table``) and the CUDA lowering of a
kernel choice (on any machine with the CUDA module, through ``jax.export``).

The kernels run on an H200 only; elsewhere those tests skip, saying why.
"""
import dataclasses
import json
import warnings

import jax
import numpy as np
import pytest
from jax import export

import jax_fp8 as jf
from jax_fp8 import _ffi
from jax_fp8.gemm import backends, plan as gemm_plan, table as gemm_table
from jax_fp8 import gemm as G
from jax_fp8.gemm.backends.cublaslt import CANDIDATES, CUBLASLT, WORKSPACE_BYTES
from jax_fp8.gemm.contract import GemmBackend
from helpers import assert_bits_equal, deq, stable_seed
from test_gemm import BF16, F32, B1, B2, assert_within, data, f64, gemm_bound

try:
    from jax_fp8.gemm.backends.cutlass import CONFIGS, CUTLASS
except ImportError:  # pragma: no cover - the module ships with the package
    CUTLASS, CONFIGS = None, ()

#: shape classes: aligned, padded (M, N, K off the alignment), partial blocks (K and rows % 128 != 0),
#: tiny M, tiny N, K = 128; and long K, with k-tile counts 1 to 4, 7 and 10 between them (the "_overlap"
#: configurations' mainloop takes tiles two at a time: odd and even counts, one trip and several)
SHAPES = {"aligned": (256, 384, 512), "padded": (37, 50, 300), "partial": (130, 257, 200), "tiny_m": (1, 256, 512),
          "tiny_n": (256, 8, 384), "k128": (192, 136, 128), "k7": (64, 128, 896), "k10_partial": (136, 264, 1200)}
PAIRS = {"1D2D": (B1, B2), "1D1D": (B1, B1)}
#: and one with more 128x128 tiles than two per SM of an H100/H200 (288): the persistent kernels' CTAs
#: walk several tiles, where state carried from one tile to the next would show
MANY_TILES = {"many_tiles": (2048, 2304, 384)}


def _variants():
    """(id, backend) of every kernel choice to test: cuBLASLt's heuristic, CUTLASS's every configuration
    (default rasterization) and one with rasterization along N and swizzle 4. cuBLASLt's candidate
    algorithms are enumerated per problem (how many it offers depends on the shape)."""
    out = [("cublaslt", CUBLASLT)]
    if CUTLASS is not None:
        out += [(f"cutlass-{name}", CUTLASS.with_options(config=i)) for i, name in enumerate(CONFIGS)]
        out.append(("cutlass-raster1-swizzle4", CUTLASS.with_options(config=0, raster=1, swizzle=4)))
    return out


def _runs(backend: GemmBackend) -> None:
    why = backend.unavailable("cuda") if jax.default_backend() == "gpu" else "no GPU backend"
    if why is not None:
        pytest.skip(f"{backend!r} does not run here: {why}")


_PROBLEMS: dict = {}


def _problem(shape_id: str, pair_id: str):
    """Operands and, once per problem, the fp64 result and bound of each output dtype (and accumulate)."""
    key = (shape_id, pair_id)
    if key not in _PROBLEMS:
        M, N, K = {**SHAPES, **MANY_TILES}[shape_id]
        rng = np.random.default_rng(stable_seed("backends", shape_id, pair_id))
        a_block, b_block = PAIRS[pair_id]
        qa = jf.quantize_blockwise(data(rng, (M, K), F32, outliers=True), block=a_block, layout="gemm_ready")
        qb = jf.quantize_blockwise(data(rng, (N, K), F32), block=b_block, layout="gemm_ready")  # E5M2: test_gemm
        c = data(rng, (M, N), F32) * 10
        a, b = deq(qa).astype(np.float64), deq(qb).astype(np.float64)
        bounds = {dt: gemm_bound(a, b, dt) for dt in (BF16, F32)}
        bounds["acc"] = gemm_bound(a, b, F32, f64(c))
        _PROBLEMS[key] = (qa, qb, c, bounds)
    return _PROBLEMS[key]


_RUN = jax.jit(G.fp8_gemm, static_argnames=("out_dtype", "backend"))


def _check_backend(backend, shape_id, pair_id):
    qa, qb, c, bounds = _problem(shape_id, pair_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)  # the kernel itself, never the reference
        for out_dtype in (BF16, F32):
            got = _RUN(qa, qb, out_dtype=out_dtype, backend=backend)
            assert got.dtype == out_dtype
            assert_within(got, *bounds[out_dtype], f"{backend!r} {shape_id} {pair_id} {out_dtype}")
        got = _RUN(qa, qb, out_dtype=F32, c=c, backend=backend)
        assert_within(got, *bounds["acc"], f"{backend!r} {shape_id} {pair_id} accumulate")


@pytest.mark.parametrize("pair_id", PAIRS)
@pytest.mark.parametrize("shape_id", SHAPES)
@pytest.mark.parametrize("variant", _variants(), ids=lambda v: v[0] if isinstance(v, tuple) else str(v))
def test_backend_within_bound(variant, shape_id, pair_id):
    _, backend = variant
    _runs(backend)
    _check_backend(backend, shape_id, pair_id)


@pytest.mark.parametrize("pair_id", PAIRS)
@pytest.mark.parametrize("shape_id", ["aligned", "partial", "tiny_m"])
def test_cublaslt_every_candidate_within_bound(shape_id, pair_id):
    """Each algorithm cuBLASLt's heuristic offers for the problem (what the autotuner may pick); an index
    past the problem's list runs the heuristic's first choice, the same bits as ``algo=-1``."""
    _runs(CUBLASLT)
    qa, qb, _, bounds = _problem(shape_id, pair_id)
    first = f64(_RUN(qa, qb, out_dtype=F32, backend=CUBLASLT))
    for i in range(CANDIDATES):
        got = _RUN(qa, qb, out_dtype=F32, backend=CUBLASLT.with_options(algo=i))
        assert_within(got, *bounds[F32], f"cuBLASLt algo={i} {shape_id} {pair_id}")
    assert np.array_equal(f64(_RUN(qa, qb, out_dtype=F32, backend=CUBLASLT.with_options(algo=0))), first)


@pytest.mark.parametrize("pair_id", PAIRS)
@pytest.mark.parametrize("shape_id", SHAPES)
def test_backends_agree(shape_id, pair_id):
    """CUTLASS and cuBLASLt on the same operands: apart by at most the sum of their bounds (each is within
    its bound of the exact product), and identical where the exact product is exact in both."""
    if CUTLASS is None:
        pytest.skip("no CUTLASS backend")
    _runs(CUBLASLT), _runs(CUTLASS)
    qa, qb, _, bounds = _problem(shape_id, pair_id)
    exact, bound = bounds[F32]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)  # both kernels, never the reference
        x = f64(_RUN(qa, qb, out_dtype=F32, backend=CUBLASLT))
        y = f64(_RUN(qa, qb, out_dtype=F32, backend=CUTLASS))
    assert np.all(np.abs(x - y) <= 2 * bound), f"{shape_id} {pair_id}: backends apart by more than their bounds"
    assert np.abs(x - exact).max() <= bound.max() and np.abs(y - exact).max() <= bound.max()


@pytest.mark.parametrize("pair_id", PAIRS)
@pytest.mark.parametrize("shape_id", [*SHAPES, *MANY_TILES])
def test_ordered_mainloop_has_the_cooperative_bits(shape_id, pair_id):
    """The "_ordered" mainloop (csrc/cutlass_ordered.cuh) only reorders when the two consumer warp groups
    issue their WGMMAs: the same products, promoted in the same order, so the bits of CUTLASS's own
    cooperative kernel of the same tile and cluster, with and without c, every k-tile count here, and
    CTAs walking several tiles."""
    if CUTLASS is None:
        pytest.skip("no CUTLASS backend")
    _runs(CUTLASS)
    qa, qb, c, _ = _problem(shape_id, pair_id)
    coop = CUTLASS.with_options(config=CONFIGS.index("128x128x128_c1x2_coop"))
    ordered = CUTLASS.with_options(config=CONFIGS.index("128x128x128_c1x2_coop_ordered"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.Fp8GemmFallbackWarning)  # both kernels, never the reference
        for out_dtype, acc in ((BF16, None), (F32, None), (F32, c)):
            assert_bits_equal(_RUN(qa, qb, out_dtype=out_dtype, c=acc, backend=ordered),
                              _RUN(qa, qb, out_dtype=out_dtype, c=acc, backend=coop),
                              f"{shape_id} {pair_id} {jax.numpy.dtype(out_dtype).name} accumulate={acc is not None}")


# ---- the choice of a kernel per shape ---------------------------------------------------------------
def test_table_nearest_row_and_load(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_table, "TABLE", {})
    rows = {"1D2D": [[[4096, 4096, 4096], "cublaslt", {"algo": 2}], [[256, 256, 256], "cutlass", {"config": 1}]],
            "1D1D": [[[8192, 8192, 8192], "cutlass", {"config": 0, "swizzle": 4}]]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device_kind": "NVIDIA H200", "rows": rows}))
    gemm_table.load(str(path))
    assert gemm_table.choose(4096, 4096, 4096, B1, B2, "NVIDIA H200") == ("cublaslt", {"algo": 2})
    # a cuBLASLt candidate index answers its own shape only: elsewhere the nearest other row
    assert gemm_table.choose(3000, 5000, 4096, B1, B2, "NVIDIA H200") == ("cutlass", {"config": 1})
    assert gemm_table.choose(300, 200, 128, B1, B2, "NVIDIA H200") == ("cutlass", {"config": 1})
    assert gemm_table.choose(1, 1, 1, B1, B1, "NVIDIA H200") == ("cutlass", {"config": 0, "swizzle": 4})
    assert gemm_table.choose(4096, 4096, 4096, B2, B1, "NVIDIA H200") is None  # no 2D1D rows
    assert gemm_table.choose(4096, 4096, 4096, B1, B2, "NVIDIA H100") is None  # no rows for that GPU
    with pytest.raises(ValueError, match="unknown key .2D2D."):
        gemm_table.load({"device_kind": "x", "rows": {"2D2D": []}})
    with pytest.raises(ValueError, match="device_kind"):
        gemm_table.load({"rows": {}})


def test_plan_takes_the_tables_kernel(monkeypatch):
    """plan_gemm runs the backend and options the table names for this device's kind, where that backend
    takes the problem and runs here; else the first backend of BACKENDS, on its own choice."""
    runs_here = dataclasses.replace(CUBLASLT, name="test-runs-here", unavailable=lambda platform, devices=None: None)
    monkeypatch.setattr(backends, "BACKENDS", (CUBLASLT, runs_here))
    kind = jax.local_devices()[0].device_kind
    monkeypatch.setattr(gemm_table, "TABLE", {kind: {"1D2D": [((256, 256, 256), "test-runs-here", {"algo": 3})]}})
    p = gemm_plan.plan_gemm(300, 200, 250, B1, B2)
    assert p.backend is runs_here.with_options(algo=3) and p.padded == (304, 200, 256)
    assert repr(p.backend) == "test-runs-here(algo=3)"
    p = gemm_plan.plan_gemm(300, 200, 250, B1, B1)  # no 1D1D row: the first backend that runs here
    assert p.backend is (CUBLASLT if CUBLASLT.unavailable("cuda") is None else runs_here)
    forced = CUBLASLT.with_options(algo=1)
    assert gemm_plan.plan_gemm(300, 200, 250, B1, B2, backend=forced).backend is forced


def test_backend_options_are_one_object_per_choice():
    v = CUBLASLT.with_options(algo=3)
    assert v is CUBLASLT.with_options(algo=3) and v.base is CUBLASLT and v.options == (("algo", 3),)
    assert CUBLASLT.with_options() is CUBLASLT and CUBLASLT.with_options(algo=4) is not v
    with pytest.raises(TypeError, match="unexpected keyword argument 'alg'"):
        CUBLASLT.with_options(alg=3)
    with pytest.raises(ValueError, match="algo must be -1"):
        CUBLASLT.with_options(algo=CANDIDATES)
    if CUTLASS is not None:
        with pytest.raises(ValueError, match="swizzle must be one of"):
            CUTLASS.with_options(config=0, swizzle=3)
    qa, qb = _problem("aligned", "1D2D")[:2]
    with pytest.raises(TypeError, match="backend must be a GemmBackend, a backend's name or None"):
        G.fp8_gemm(qa, qb, backend=3)
    with pytest.raises(ValueError, match="backend must be a GemmBackend, one of .*'reference'.* got 'cublas'"):
        G.fp8_gemm(qa, qb, backend="cublas")


# ---- the CUDA lowering of a kernel choice -------------------------------------------------------------
def _cuda_text(backend, pair_id="1D2D", accumulate=False):
    qa, qb, c, _ = _problem("aligned", pair_id)
    ok = [export.DisabledSafetyCheck.custom_call(t) for t in ("jf_cublaslt_gemm", "jf_cutlass_gemm")]
    f = jax.jit(lambda a, b, c: G.fp8_gemm(a, b, F32, c=c if accumulate else None, backend=backend))
    return export.export(f, platforms=["cuda"], disabled_checks=ok)(qa, qb, c).mlir_module()


def _lowers_here(backend):
    """The backend with its kernel's CUDA lowering used on any machine (as where it runs)."""
    if not _ffi.AVAILABLE["cuda"]:
        pytest.skip("the CUDA module is not built: the CUDA lowering is the reference")
    return dataclasses.replace(backend, name=backend.name + "-lowered", unavailable=lambda platform, devices=None: None)


def test_cublaslt_lowering_passes_algo_and_a_workspace_result():
    lowered = _lowers_here(CUBLASLT)
    for backend, algo in ((lowered, -1), (lowered.with_options(algo=5), 5)):
        text = _cuda_text(backend)
        call = next(line for line in text.splitlines() if "custom_call @jf_cublaslt_gemm(" in line)
        assert f"algo = {algo} : i64" in call and "a_block_rows = 1 : i64" in call and "b_block_rows = 128" in call
        assert f"tensor<{WORKSPACE_BYTES}xui8>" in call, call  # the workspace: a result buffer
    if _ffi.AVAILABLE["cuda"]:
        import jax_fp8._jax_fp8_cuda as m

        assert (m.cublaslt_workspace_bytes, m.cublaslt_candidates) == (WORKSPACE_BYTES, CANDIDATES)


def test_cutlass_lowering_passes_its_options():
    if CUTLASS is None:
        pytest.skip("no CUTLASS backend")
    lowered = _lowers_here(CUTLASS)
    text = _cuda_text(lowered.with_options(config=len(CONFIGS) - 1, raster=1, swizzle=8), "1D1D", accumulate=True)
    call = next(line for line in text.splitlines() if "custom_call @jf_cutlass_gemm(" in line)
    for attr in (f"config = {len(CONFIGS) - 1} : i64", "raster = 1 : i64", "swizzle = 8 : i64", "b_block_rows = 1 :"):
        assert attr in call, (attr, call)


class _Device:
    """A device as a lowering names it (a compile-only topology's GPUs carry these attributes)."""

    def __init__(self, platform, compute_capability=None):
        self.platform, self.compute_capability = platform, compute_capability


class _Context:
    def __init__(self, axis_context):
        self.module_context = type("ModuleContext", (), {"axis_context": axis_context})()


def test_backends_judge_the_devices_compiled_for():
    """The backends ask whether their kernels run on the GPUs a lowering compiles for (jit's device
    assignment, shard_map's mesh), also ahead of time on a machine without them; with none named (an
    export), on this process's CUDA devices."""
    from jax_fp8.gemm.contract import cuda_capabilities
    from jax_fp8.primitives.registration import lowering_devices

    assert cuda_capabilities([_Device("gpu", "9.0"), _Device("gpu", "9.0")]) == ({"9.0"}, None)
    assert cuda_capabilities([_Device("cuda", "10.0")]) == ({"10.0"}, None)
    here = cuda_capabilities()
    assert cuda_capabilities([_Device("cpu")]) == here and cuda_capabilities(None) == here
    if jax.devices()[0].platform != "gpu":
        assert here[0] == set() and "no CUDA device" in here[1]
    if _ffi.AVAILABLE["cuda"] and CUTLASS is not None and CUTLASS.unavailable("cuda") is None:
        assert "sm ['8.0']" in CUTLASS.unavailable("cuda", [_Device("gpu", "8.0")])

    gpus = (_Device("gpu", "9.0"),)
    assert lowering_devices(_Context(type("ShardingContext", (), {"device_assignment": gpus})())) == gpus
    mesh = type("Mesh", (), {"devices": np.array(gpus * 2).reshape(1, 2)})()
    assert lowering_devices(_Context(type("SPMDAxisContext", (), {"mesh": mesh})())) == gpus * 2
    assert lowering_devices(_Context(type("ShardingContext", (), {"device_assignment": None})())) is None
