"""The README's complete examples run as pasted: each ```python block after the marker line below
runs in a fresh Python process (the blocks set XLA_FLAGS before jax starts, as a user's script would); on
the CPU where the default backend has fewer than 8 devices (one GPU), as the README tells such users."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- tests/test_readme.py runs this block as it is -->"
BLOCKS = re.findall(re.escape(MARKER) + r"\n```python\n(.*?)\n```", README.read_text(), re.S)


def test_the_marked_blocks_are_found():
    assert len(BLOCKS) == README.read_text().count(MARKER) == 2


@pytest.mark.parametrize("block", BLOCKS, ids=["shard_map", "sharded jit"][:len(BLOCKS)])
def test_readme_block_runs_as_pasted(block, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(block)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the block sets its own
    if jax.device_count() < 8:  # as the README says for fewer than 8 GPUs: the block's 8 CPU devices
        env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]  # no fallback, no gathered dim
