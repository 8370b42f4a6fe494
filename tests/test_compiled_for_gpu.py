"""The decoder's FP8 training step as a GPU runs it: XLA's program compiled for an H200 (the GPU where
there is one, else a compile-only H200 where jax's CUDA plugin is installed; ``tests/gpu_compile.py``),
read from XLA's thunk dump:

- at XLA's default flags every one of our custom calls (9 projections x 3 quantize calls and 3 GEMMs)
  sits in a command buffer, a CUDA graph replayed with no launch per call: the handlers'
  command-buffer trait is honoured; with custom calls left out of command buffers none is (the check
  can fail);
- no extra passes over memory: besides our calls the FP8 step has no more kernels than the bf16 step
  has besides its GEMMs, and no more data-movement kernels of any kind (transposes, copies, pads,
  slices, concatenates, converts, gathers, scatters): XLA adds nothing around our calls;
- on 8 GPUs, a sequence-parallel linear layer (S split under plain ``jax.jit``: the stacked operands)
  has no transpose or copy at all: the stacked operands fold into the GEMMs by reshapes.

Skipped where neither a GPU nor jax's CUDA plugin is present, or our CUDA module is not built."""
import pytest

import gpu_compile

SIZES = "1024x2048x2x2x512"  # d_model x FFN x layers x batch x seq: aligned, quick to compile


@pytest.fixture(scope="module")
def compiled():
    why = gpu_compile.why_not()
    if why is not None:
        pytest.skip(why)
    return {v: gpu_compile.summary(gpu_compile.compile_step(v, SIZES)) for v in ("fp8", "bf16")}


def test_every_custom_call_of_the_step_in_a_command_buffer(compiled):
    fp8 = compiled["fp8"]
    assert fp8["ours"] == 54, fp8
    assert fp8["ours_captured"] == fp8["ours"], fp8
    off = gpu_compile.summary(gpu_compile.compile_step("fp8", SIZES, "--xla_gpu_enable_command_buffer=FUSION"))
    assert off["ours"] == 54 and off["ours_captured"] == 0, off


def test_no_kernel_added_around_our_calls(compiled):
    fp8, bf16 = compiled["fp8"], compiled["bf16"]
    assert fp8["gemms"] == 0 and bf16["gemms"] == 27, (fp8, bf16)
    assert fp8["compute"] <= bf16["compute"], (fp8, bf16)
    for kind in gpu_compile.MOVES:
        assert fp8["moves"][kind] <= bf16["moves"][kind], (kind, fp8["moves"], bf16["moves"])
    assert fp8["outside"] <= bf16["outside"], (fp8, bf16)


def test_sequence_parallel_layer_moves_no_data():
    why = gpu_compile.why_not()
    if why is not None:
        pytest.skip(why)
    import jax_fp8

    if jax_fp8._ffi.cuda_device_present():
        import jax

        if len(jax.devices("cuda")) < 8:
            pytest.skip("needs 8 GPUs (or none: then 8 compile-only H200s)")
    assert gpu_compile.sequence_parallel_moves(8) == []
