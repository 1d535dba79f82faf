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
                               workers share a route (default 4)
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
from random_cases import ROUTES, Case
from random_report import env_int, env_ints, write_report
from random_runner import run_case, run_route

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


# Four tests per (route, seed) by default: one route's 16 cases took 4-5 minutes in one xdist
# worker on a cold cache, the normal suite's longest test.
SHARDS = env_int("FUSEDLAYERS_RANDOM_SHARDS", 4)


def _tests() -> list[tuple[str, int, int]]:
    """(route, seed, shard) of every test, or of this process's part of them; shards outermost,
    so that a time-boxed run covers every route and seed alike."""
    tests = [(r, s, k) for k in range(SHARDS) for s in SEEDS for r in ROUTES]
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


# The cases the long run found failing, as drawn (`str(case)`), kept as regression tests of
# their fixes (tests/test_found_by_random_cases.py holds the CPU side of each).
FOUND = [
    # bf16 with an fp32 bias that needs its gradient: the dQ pass asked 256 KiB of shared
    # memory (OutOfResources); a bias tile per stage now counts in `bwd_config`'s fit.
    Case(route='portable', entry='DotProductAttention', dtype=torch.bfloat16, qkv_format='sbhd',
         layout='3hd', b=2, s_q=97, s_kv=97, h=5, h_kv=5, d=96, d_v=96, bias='bhss',
         bias_grad=True, bias_fp32=True, calls=('grad', 'no_grad', 'grad'),
         data_seed=1420973006),
    Case(route='portable', entry='DotProductAttention', dtype=torch.bfloat16, qkv_format='sbhd',
         layout='heads_split', b=3, s_q=2, s_kv=2, h=6, h_kv=3, d=80, d_v=80, mask='arbitrary',
         arbitrary='b1ss', window=(2, 1), softmax_scale=0.235, bias='11ss', bias_grad=True,
         data_seed=200941870),
    # fp32 with ALiBi and padding_causal: dK 1.07x the bound, within the error of summing
    # dP = dO V^T in another order than cuBLAS (`random_runner._product_atol`, now in the bound).
    Case(route='portable', entry='DotProductAttention', dtype=torch.float32, qkv_format='sbhd',
         b=3, s_q=2, s_kv=256, h=3, h_kv=3, d=128, d_v=128, lens_q=(2, 1, 0),
         lens_kv=(6, 46, 196), mask='padding_causal', padding_via='mask_pair',
         softmax_scale=0.477, alibi='bh', poison=True, data_seed=1394906727),
]  # fmt: skip


@pytest.mark.parametrize("case", FOUND, ids=[f"found{i}" for i in range(len(FOUND))])
def test_found_cases_gpu(case, exact_fp32_matmul):
    status, problems = run_case(case, "cuda")
    assert status == "pass", "\n".join(problems)
