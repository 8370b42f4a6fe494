"""Several local processes joined by ``jax.distributed`` (gloo), one mesh of 8 CPU devices (2 x 4 and
4 x 2): the collectives give every process the same bits as one process (tests/mp_worker.py has the
cases; tests/multiprocess.py starts them)."""
import warnings

import pytest

from multiprocess import run_processes


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["master_weights", "sequence_gather", "gradients"])
def test_collectives_across_processes(case, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = run_processes(case, n)
    assert all("equal" in out for out in outs), outs
