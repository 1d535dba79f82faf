"""Per-signature launch plans (kernels/_flash_bwd.py, _flash_fwd.py, _flash_decode.py): a plan
is made once per signature and reused, and any change it depends on (a stride, a length, a
dtype, an argument, a setting) makes a new one. Every call's results are checked against the
fp64 reference, so a plan reused where it should not be fails on the numbers too.

Shapes: dense q/dout [b, s_q, h, d], k/v [b, s_k, h_kv, d]; varlen [t, h, d].
"""

from __future__ import annotations

import pytest
import torch
from fusedlayers.kernels import _common, _flash_bwd
from test_kernels_backward_unit import _check, _dense, _mask_kwargs

F16, F32 = torch.float16, torch.float32


@pytest.fixture
def bwd_plans(monkeypatch):
    """An empty backward plan table, and the list of signatures `_make_plan` was called for."""
    monkeypatch.setattr(_flash_bwd, "_PLANS", {})
    made = []
    real = _flash_bwd._make_plan

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_flash_bwd, "_make_plan", counting)
    return made


def _bwd(seed, s_q=24, s_k=33, h=4, h_kv=2, d=16, dtype=F16, window=(-1, 0), **kern_extra):
    tensors = _dense(seed, 1, s_q, s_k, h, h_kv, d, None, dtype)
    ref, kern = _mask_kwargs(d**-0.5, window, True)
    return tensors, ref, dict(kern, **kern_extra)


def test_backward_plan_is_made_once_and_computes_on_new_data(bwd_plans):
    for seed in range(3):
        tensors, ref, kern = _bwd(seed)
        _check(tensors, F16, ref, kern)
    assert len(bwd_plans) == 1


@pytest.mark.parametrize(
    "change", ["stride", "length", "dtype", "heads", "window", "scale", "deterministic"]
)
def test_backward_any_change_makes_a_new_plan(bwd_plans, change):
    tensors, ref, kern = _bwd(0)
    _check(tensors, F16, ref, kern)
    dtype = F16
    if change == "stride":  # k and v read through transposed (non-contiguous) views
        tensors, ref, kern = _bwd(1)
        for name in ("k", "v"):
            tensors[name] = tensors[name].transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "length":
        tensors, ref, kern = _bwd(1, s_k=40)
    elif change == "dtype":
        tensors, ref, kern = _bwd(1, dtype=F32)
        dtype = F32
    elif change == "heads":
        tensors, ref, kern = _bwd(1, h=6, h_kv=3)
    elif change == "window":
        tensors, ref, kern = _bwd(1, window=(5, 3))
    elif change == "scale":
        tensors, ref, kern = _bwd(1)
        ref["softmax_scale"] = kern["softmax_scale"] = 0.5
    elif change == "deterministic":
        tensors, ref, kern = _bwd(1, deterministic=True)
    _check(tensors, dtype, ref, kern)
    assert len(bwd_plans) == 2


def test_backward_plan_follows_the_settings_it_reads(bwd_plans, monkeypatch):
    """A plan records the GQA split count: changing the override makes a new plan whose
    launch has the new grid, with the same gradients."""
    from attention_testing import KernelSpy

    spy = KernelSpy(_flash_bwd._flash_bwd_dkdv_kernel)
    monkeypatch.setattr(_flash_bwd, "_flash_bwd_dkdv_kernel", spy)
    tensors, ref, kern = _bwd(0, h=4, h_kv=1)
    _check(tensors, F16, ref, kern)
    monkeypatch.setattr(_flash_bwd, "GROUP_SPLITS_OVERRIDE", 2)
    _check(tensors, F16, ref, kern)
    assert len(bwd_plans) == 2
    blocks = _flash_bwd.cdiv(33, _flash_bwd.INTERPRETER_CONFIG[1])
    assert spy.grids == [(blocks,), (2 * blocks,)]


def test_backward_plan_zero_fills_by_the_call_not_the_plan(bwd_plans):
    """Right-padded keys (seqlens_k): gradient rows past each length are 0 on every call, also
    when the caller hands in dirty gradient buffers on a plan hit."""
    g = torch.Generator().manual_seed(3)
    for seed in range(2):
        tensors, ref, kern = _bwd(seed)
        lens = torch.tensor([20], dtype=torch.int32)
        ref["seqlens_kv"] = lens
        kern["seqlens_k"] = lens
        kern["dk"] = torch.randn(tensors["k"].shape, generator=g).half()
        kern["dv"] = torch.randn(tensors["v"].shape, generator=g).half()
        got = _check(tensors, F16, ref, kern)
        assert (got["dk"][:, 20:] == 0).all() and (got["dv"][:, 20:] == 0).all()
    assert len(bwd_plans) == 1


def test_remember_bounds_a_table():
    table: dict = {}
    for i in range(10):
        assert _common.remember(table, i, str(i), 4) == str(i)
        assert len(table) <= 4 and table[i] == str(i)
