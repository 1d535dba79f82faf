"""Seeded random differential test of the attention kernels on CUDA, one test per (route, seed).

The cases of tests/random_cases.py at GPU sizes (bf16/fp16/fp32, every head dim of the contract,
lengths up to 257, caches up to 1k tokens; under ~2k tokens a case), on the routes "portable",
"sm90" (pinned to the Hopper kernels where they cover the call, the portable ones elsewhere),
"decode" and "auto", against the reference in fp32 (fp64 for fp32 inputs) by the 2x rule.

Environment:
    FUSEDLAYERS_RANDOM_CASES   cases per route and seed (default 16: the normal GPU suite)
    FUSEDLAYERS_RANDOM_SEEDS   comma-separated seeds, one test each (default 0; or
                               FUSEDLAYERS_RANDOM_SEED)
    FUSEDLAYERS_RANDOM_ONLY    run only these case indices (with one seed: a failure's rerun)
    FUSEDLAYERS_RANDOM_REPORT  merge a JSON summary into this file (cases, passed, failed,
                               rejected per route and per seed; every failure with its rerun)
Each test prints its summary line (`-rP` shows it) and, for a failure, the case, the kernel and
PyTorch errors and a one-line rerun command.

Cost: nearly every case is a new kernel specialization, so a cold Triton cache dominates. On an
H200 (Triton 3.6, 2026-11-28) a route took about 4 s a case (decode) to 10-20 s a case (training
routes, fp32 and large head dims compiling longest); hence the small default.

The long run, 500 cases per route for each of three seeds, spread over xdist workers:
    FUSEDLAYERS_RANDOM_CASES=500 FUSEDLAYERS_RANDOM_SEEDS=0,1,2 \\
        FUSEDLAYERS_RANDOM_REPORT=random_report.json \\
        pytest -q -rP -n 12 tests/gpu/test_random_differential_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch
from random_cases import ROUTES
from random_runner import env_int, env_ints, run_route, write_report

pytestmark = pytest.mark.gpu

DEFAULT_CASES = 16
SEEDS = env_ints("FUSEDLAYERS_RANDOM_SEEDS") or env_ints("FUSEDLAYERS_RANDOM_SEED") or [0]
FILE = "tests/gpu/test_random_differential_gpu.py"


@pytest.fixture
def exact_fp32_matmul():
    """The fp32 reference must not run on TF32 (another test in the worker may have allowed it)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize(
    "route, seed",
    [(route, seed) for route in ROUTES for seed in SEEDS],
    ids=[f"{route}-seed{seed}" for route in ROUTES for seed in SEEDS],
)
def test_random_differential_gpu(route, seed, exact_fp32_matmul, record_property):
    def rerun(index) -> str:
        return (
            f"FUSEDLAYERS_RANDOM_SEEDS={seed} FUSEDLAYERS_RANDOM_ONLY={index} "
            f"pytest -q -rP '{FILE}::test_random_differential_gpu[{route}-seed{seed}]'"
        )

    count = env_int("FUSEDLAYERS_RANDOM_CASES", DEFAULT_CASES)
    only = env_ints("FUSEDLAYERS_RANDOM_ONLY")
    summary = run_route(route, seed, count, "cuda", only=only, rerun=rerun)
    for key, value in summary.counts.items():
        record_property(key, value)
    if os.environ.get("FUSEDLAYERS_RANDOM_REPORT"):
        write_report(os.environ["FUSEDLAYERS_RANDOM_REPORT"], summary)
    assert not summary.failures, summary.report()
