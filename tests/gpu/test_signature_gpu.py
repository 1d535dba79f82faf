"""Launches by signature (kernels/_launch.py) and the front end's signature cache on the GPU.

Repeated calls of one signature take the cached paths: each must still compute on its own,
fresh data (checked against the fp64 reference with the suite's pass rule), and the suite's
signature checks (tests/conftest.py) verify that every cached launch maps to the kernel Triton
would have picked; with the checks off, the plans' bound launch slots must do the same. A
change Triton specializes on (alignment, dropout seeds) must not reuse a kernel compiled for
another specialization.
"""

import dataclasses

import pytest
import torch
from attention_testing import Case, check_case
from fusedlayers.kernels import _launch, set_backward_path, set_forward_path

import fusedlayers

pytestmark = pytest.mark.gpu

BF16, F16 = torch.bfloat16, torch.float16
CASES = [
    Case(b=2, s_q=96, s_k=96, h=4, h_kv=2, d=64, dtype=BF16, window=(-1, 0)),
    Case(b=3, s_q=80, s_k=112, h=4, h_kv=1, d=128, dtype=F16, layout="varlen"),
    Case(b=2, s_q=64, s_k=64, h=2, h_kv=2, d=64, dtype=BF16, dropout_p=0.2),
    Case(b=2, s_q=48, s_k=70, h=4, h_kv=4, d=32, dtype=F16, layout="seqlens", alibi="batch"),
]


@pytest.mark.parametrize("case", CASES, ids=Case.label)
def test_one_signature_on_fresh_data(case):
    """Four calls per case (the first compiles, the rest hit the signature tables), each on new
    inputs, each checked; the dropout case draws a new seed and offset every call."""
    assert _launch._check_signatures
    for seed in range(4):
        check_case(dataclasses.replace(case, seed=seed), "cuda")


@pytest.mark.parametrize("case", CASES, ids=Case.label)
def test_bound_launch_slots_on_fresh_data(case, monkeypatch):
    """The same calls with the signature checks off, as users run: from the third call of a
    signature the plans' launches go through their bound slots (`_launch.launch_slot`), which
    must hand each call's own tensors, seed and offset to the kernel."""
    monkeypatch.setattr(_launch, "_check_signatures", False)
    for seed in range(5):
        check_case(dataclasses.replace(case, seed=seed), "cuda")


@pytest.fixture
def portable_kernels():
    """Pins the portable kernels for one test, whatever the suite's --forward-path/--backward-path
    say: the sm_90 kernels take no misaligned storage (TMA), so a pinned sm_90 run would compare
    two different kernels below."""
    previous = set_forward_path("portable"), set_backward_path("portable")
    yield
    set_forward_path(previous[0])
    set_backward_path(previous[1])


@pytest.mark.parametrize("offset", [0, 1, 8])
def test_misaligned_views_after_aligned_calls(offset, portable_kernels):
    """q, k and v sliced from a buffer at `offset` elements: 2-byte aligned at 1, 16-byte at 8.
    The portable kernel specialized for 16-byte aligned pointers must not run on the others."""
    torch.manual_seed(offset)
    shape, n = (2, 128, 4, 64), 2 * 128 * 4 * 64
    aligned = [torch.randn(shape, device="cuda", dtype=BF16) for _ in range(3)]
    fusedlayers.flash_attn_func(*aligned, causal=True)  # the aligned signature, compiled
    fusedlayers.flash_attn_func(*aligned, causal=True)  # and cached
    views = []
    for t in aligned:
        buffer = torch.empty(n + offset, device="cuda", dtype=BF16)
        view = buffer[offset:].view(shape)
        view.copy_(t)
        views.append(view.requires_grad_())
    leaves = [t.clone().requires_grad_() for t in aligned]
    dout = torch.randn(shape, device="cuda", dtype=BF16)
    out_view = fusedlayers.flash_attn_func(*views, causal=True)
    out = fusedlayers.flash_attn_func(*leaves, causal=True)
    torch.testing.assert_close(out_view, out, atol=0, rtol=0)
    grads_view = torch.autograd.grad(out_view, views, dout)
    grads = torch.autograd.grad(out, leaves, dout)
    for g_view, g in zip(grads_view, grads):
        torch.testing.assert_close(g_view, g, atol=2e-2, rtol=2e-2)
