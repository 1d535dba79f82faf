"""Per-signature launch plans of the layers' kernels (kernels/_norm.py, _activation.py, _rope.py,
_cache_append.py): a plan is made once per signature and reused on new data, and a change it
depends on (a stride that decides whether rows are read in place or copied, a shape, a dtype,
an argument) makes a new one. Every call is checked against the fp64 reference through the
kernels' own harnesses, so a plan reused where it should not be fails on the numbers too.

Shapes: x [..., n] (norm, activation); RoPE t [b, s, h, d] / [s, b, h, d] / [t, h, d]; the cache
append's q [b, s_q, h, d], k/v [b, s_new, h_kv, d].
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_testing import check_close
from fusedlayers.kernels import _activation, _cache_append, _norm, _rope
from kvcache_testing import KVCase, check_kv_case
from norm_testing import NormCase, check_norm_case
from test_activation_kernels import check_activation, problem
from test_rope_kernel import (
    RopeCase,
    check_rope_case,
    make_inputs,
    rope_results,
    test_pair_equals_two_calls,
)


def _count_plans(monkeypatch, module, maker: str, tables: tuple[str, ...]) -> list:
    """Empty `module`'s plan tables; returns the list its plan maker `maker` appends to per
    plan made."""
    for table in tables:
        monkeypatch.setattr(module, table, {})
    made = []
    real = getattr(module, maker)

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, maker, counting)
    return made


@pytest.mark.parametrize("layout", ["contiguous", "sliced", "transposed"])
def test_norm_plans_are_made_once_and_compute_on_new_data(monkeypatch, layout):
    """Three forward+backward calls on new data (sliced rows are read in place, transposed ones
    copied per call): one forward and one backward plan, each call against fp64."""
    forward = _count_plans(monkeypatch, _norm, "_forward_plan", ("_FWD_PLANS",))
    backward = _count_plans(monkeypatch, _norm, "_backward_plan", ("_BWD_PLANS",))
    for seed in range(3):
        check_norm_case(NormCase(layout=layout, seed=seed), "cpu")
    assert (len(forward), len(backward)) == (1, 1)


@pytest.mark.parametrize("change", ["row stride", "rows not in place", "rows", "rms", "eps"])
def test_norm_any_change_makes_a_new_plan(monkeypatch, change):
    forward = _count_plans(monkeypatch, _norm, "_forward_plan", ("_FWD_PLANS",))
    backward = _count_plans(monkeypatch, _norm, "_backward_plan", ("_BWD_PLANS",))
    base = NormCase()
    check_norm_case(base, "cpu")
    case = {
        "row stride": dataclasses.replace(base, layout="sliced"),
        "rows not in place": dataclasses.replace(base, layout="transposed"),
        "rows": dataclasses.replace(base, shape=(3, 6, 33)),
        "rms": dataclasses.replace(base, rms=True),
        "eps": dataclasses.replace(base, eps=1e-3),
    }[change]
    check_norm_case(dataclasses.replace(case, seed=1), "cpu")
    # eps reaches only the forward kernel; every other change both.
    assert (len(forward), len(backward)) == ((2, 1) if change == "eps" else (2, 2))


def test_activation_plans_are_made_once_and_compute_on_new_data(monkeypatch):
    made = _count_plans(monkeypatch, _activation, "_plan", ("_PLANS",))
    for seed in range(3):
        check_activation("swiglu", *problem("swiglu", (4, 3), 33, torch.float32, seed=seed))
    assert len(made) == 2  # forward and backward


@pytest.mark.parametrize("change", ["rows not in place", "width", "activation", "dtype"])
def test_activation_any_change_makes_a_new_plan(monkeypatch, change):
    made = _count_plans(monkeypatch, _activation, "_plan", ("_PLANS",))
    check_activation("swiglu", *problem("swiglu", (4, 3), 33, torch.float32, seed=0))
    activation, n, dtype = "swiglu", 33, torch.float32
    if change == "width":
        n = 40
    elif change == "activation":
        activation = "geglu"
    elif change == "dtype":
        dtype = torch.float16
    x, dy = problem(activation, (4, 3), n, dtype, seed=1)
    if change == "rows not in place":  # rows without one stride: copied per call
        x, dy = problem(activation, (3, 4), n, dtype, seed=1)
        x, dy = x.transpose(0, 1), dy.transpose(0, 1)
    check_activation(activation, x, dy)
    assert len(made) == 4


def test_rope_plans_are_made_once_and_compute_on_new_data(monkeypatch):
    made = _count_plans(monkeypatch, _rope, "_plan", ("_PLANS",))
    for seed in range(3):
        check_rope_case(RopeCase(fmt="sbhd", strided="heads", seed=seed), "cpu")
    assert len(made) == 2  # forward and backward (its incoming gradient is copied: stride(-1) 3)


@pytest.mark.parametrize("change", ["format", "strided view", "start positions", "interleaved"])
def test_rope_any_change_makes_a_new_plan(monkeypatch, change):
    made = _count_plans(monkeypatch, _rope, "_plan", ("_PLANS",))
    base = RopeCase()
    check_rope_case(base, "cpu")
    case = {
        "format": dataclasses.replace(base, fmt="sbhd"),
        "strided view": dataclasses.replace(base, strided="per_head"),
        "start positions": dataclasses.replace(base, start=True),
        "interleaved": dataclasses.replace(base, interleaved=True),
    }[change]
    check_rope_case(dataclasses.replace(case, seed=1), "cpu")
    # A strided view's incoming gradient reaches the backward launch as a contiguous copy, as
    # the base case's does: only the forward is new there.
    assert len(made) == (3 if change == "strided view" else 4)


def test_rope_start_positions_alone_make_a_new_plan(monkeypatch):
    """The same tensors and angle table with and without start positions: two plans per pass,
    each call against fp64 (a plan keyed without the positions would rotate from 0)."""
    made = _count_plans(monkeypatch, _rope, "_plan", ("_PLANS",))
    case = RopeCase(start=True)  # its table is long enough for the positions
    inputs = make_inputs(case)
    for start in (None, inputs["start_positions"]):
        call = dict(inputs, start_positions=start)
        got = rope_results(case, call, "kernel", case.dtype)
        high = rope_results(case, call, "reference", torch.float64)
        low = rope_results(case, call, "reference", case.dtype)
        for name, a, b, c, factor in zip(("out", "dt"), got, high, low, (2.0, 3.0)):
            check_close(name, a, b, c, factor=factor)
    assert len(made) == 4


def test_rope_pair_plans_are_reused(monkeypatch):
    """The q/k pair launch on two runs of the same cases (each checked equal to two one-tensor
    calls): the second run makes no plan."""
    made = _count_plans(monkeypatch, _rope, "_plan", ("_PLANS",))
    test_pair_equals_two_calls("cpu", "bshd", True, 10, False, 2)
    first = len(made)
    test_pair_equals_two_calls("cpu", "bshd", True, 10, False, 2)
    assert first > 0 and len(made) == first


def test_cache_append_plan_is_made_once_and_computes_on_new_data(monkeypatch):
    """Three steps appending new rotated rows at new lengths: one append plan, each step's
    output and cache contents against fp64 (`check_kv_case`)."""
    made = _count_plans(monkeypatch, _cache_append, "_plan", ("_PLANS",))
    for seed in range(3):
        check_kv_case(KVCase(s_q=2, s_new=2, rotary="half", seed=seed), "cpu")
    assert len(made) == 1


@pytest.mark.parametrize("change", ["rotary", "paged", "batch index", "new rows"])
def test_cache_append_any_change_makes_a_new_plan(monkeypatch, change):
    made = _count_plans(monkeypatch, _cache_append, "_plan", ("_PLANS",))
    base = KVCase(s_q=2, s_new=2, rotary="half")
    check_kv_case(base, "cpu")
    case = {
        "rotary": dataclasses.replace(base, rotary="interleaved"),
        "paged": dataclasses.replace(base, page_size=16),
        "batch index": dataclasses.replace(base, batch_idx=True),
        "new rows": dataclasses.replace(base, s_q=3, s_new=3),
    }[change]
    check_kv_case(dataclasses.replace(case, seed=1), "cpu")
    assert len(made) == 2
