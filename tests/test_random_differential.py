"""Seeded random differential test of the attention kernels, CPU variant (Triton interpreter).

A few dozen whole configurations drawn by tests/random_cases.py (entry points, layouts, masks,
lengths, repeats with another configuration in between; fp16/fp32, tiny shapes: s <= 33,
d <= 64, h <= 4), compared with the fp64 reference by the 2x rule. Routes "portable", "auto" and
"decode" ("sm90" needs an sm_90 GPU: tests/gpu/test_random_differential_gpu.py).

Environment: FUSEDLAYERS_RANDOM_SEED (default 0), FUSEDLAYERS_RANDOM_CASES (cases per route,
default `CASES`), FUSEDLAYERS_RANDOM_ONLY=<index>[,<index>...] (run those cases alone),
FUSEDLAYERS_RANDOM_REPORT=<path> (JSON summary). A failure prints its case, the errors and the
command that reruns it alone.
"""

from __future__ import annotations

import os

import pytest
import torch
from random_report import env_int, env_ints, write_report
from random_runner import run_route

import fusedlayers.attention.frontend as front_end

pytestmark = pytest.mark.skipif(
    front_end.flash_attention is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="runs the kernels (CUDA, or the Triton CPU interpreter)",
)

CASES = {"portable": 13, "auto": 12, "decode": 11}


@pytest.mark.parametrize("route", list(CASES))
def test_random_differential(route, device, kernels_on_cpu):
    seed = env_int("FUSEDLAYERS_RANDOM_SEED", 0)

    def rerun(index) -> str:
        return (
            f"FUSEDLAYERS_RANDOM_SEED={seed} FUSEDLAYERS_RANDOM_ONLY={index} "
            f"pytest -q 'tests/test_random_differential.py::test_random_differential[{route}]'"
        )

    count = env_int("FUSEDLAYERS_RANDOM_CASES", CASES[route])
    only = env_ints("FUSEDLAYERS_RANDOM_ONLY")
    summary = run_route(route, seed, count, device, only=only, rerun=rerun)
    if os.environ.get("FUSEDLAYERS_RANDOM_REPORT"):
        write_report(os.environ["FUSEDLAYERS_RANDOM_REPORT"], summary)
    assert not summary.failures, summary.report()
