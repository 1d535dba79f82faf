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
    FUSEDLAYERS_RANDOM_SHARDS  split each (route, seed) into this many tests, so that xdist
                               workers share a route (default 1)
    FUSEDLAYERS_RANDOM_PART    "g/G": collect only every G-th of those tests, from the g-th
                               (0-based): one pytest process per GPU, each with its own
                               CUDA_VISIBLE_DEVICES
    FUSEDLAYERS_RANDOM_STOP_AT a Unix time after which no new case starts; the cases left are
                               reported as not run (a time-boxed run)
Each test prints its summary line (`-rP` shows it) and, for a failure, the case, the kernel and
PyTorch errors and a one-line rerun command.

Cost: nearly every case is a new kernel specialization, so a cold Triton cache dominates. On an
H200 (Triton 3.6, 2026-11-28) a route took about 4 s a case (decode) to 10-20 s a case (training
routes, fp32 and large head dims compiling longest); hence the small default.

The long run, 500 cases per route for each of three seeds, spread over xdist workers:
    FUSEDLAYERS_RANDOM_CASES=500 FUSEDLAYERS_RANDOM_SEEDS=0,1,2 FUSEDLAYERS_RANDOM_SHARDS=8 \\
        FUSEDLAYERS_RANDOM_REPORT=random_report.json \\
        pytest -q -rP -n 12 tests/gpu/test_random_differential_gpu.py
(`.ci/gpu random` runs it, on every GPU of the machine.)
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


SHARDS = env_int("FUSEDLAYERS_RANDOM_SHARDS", 1)


def _tests() -> list[tuple[str, int, int]]:
    """(route, seed, shard) of every test, or of this process's part of them."""
    tests = [(r, s, k) for r in ROUTES for s in SEEDS for k in range(SHARDS)]
    part = os.environ.get("FUSEDLAYERS_RANDOM_PART", "").strip()
    if part:
        g, n = (int(x) for x in part.split("/"))
        tests = tests[g::n]
    return tests


@pytest.mark.parametrize(
    "route, seed, shard",
    _tests(),
    ids=[f"{r}-seed{s}" + (f"-shard{k}" if SHARDS > 1 else "") for r, s, k in _tests()],
)
def test_random_differential_gpu(route, seed, shard, exact_fp32_matmul, record_property):
    def rerun(index) -> str:
        return (
            f"FUSEDLAYERS_RANDOM_SEEDS={seed} FUSEDLAYERS_RANDOM_ONLY={index} "
            "FUSEDLAYERS_RANDOM_SHARDS=1 FUSEDLAYERS_RANDOM_PART= "
            f"pytest -q -rP '{FILE}::test_random_differential_gpu[{route}-seed{seed}]'"
        )

    count = env_int("FUSEDLAYERS_RANDOM_CASES", DEFAULT_CASES)
    only = env_ints("FUSEDLAYERS_RANDOM_ONLY")
    stop_at = os.environ.get("FUSEDLAYERS_RANDOM_STOP_AT")
    summary = run_route(route, seed, count, "cuda", only=only, shard=(shard, SHARDS),
                        stop_at=float(stop_at) if stop_at else None, rerun=rerun)  # fmt: skip
    for key, value in summary.counts.items():
        record_property(key, value)
    if os.environ.get("FUSEDLAYERS_RANDOM_REPORT"):
        write_report(os.environ["FUSEDLAYERS_RANDOM_REPORT"], summary)
    assert not summary.failures, summary.report()
