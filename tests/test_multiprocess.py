"""Several local processes joined by ``jax.distributed`` (gloo), one mesh of 8 CPU devices (2 x 4 and
4 x 2): the collectives give every process the same bits as one process (tests/mp_worker.py has the
cases; tests/multiprocess.py starts them). One launch per process count runs every case."""
import warnings

import pytest

from multiprocess import run_processes

CASES = {"master_weights": "master weights equal single-process quantization",
         "sequence_gather": "sequence gather equals",
         "gradients": "gradients equal the single-process and lax computations"}


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_across_processes(n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = run_processes(",".join(CASES), n)
    for pid, out in enumerate(outs):
        for case, said in CASES.items():
            assert f"process {pid}: {said}" in out, (case, out)
