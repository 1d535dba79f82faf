"""A loss that reads the LSE, on the GPU: fp16 and bf16 through every backward route.

Each case takes the gradient of sum(out * dout) + sum(lse * dlse) (`Case(lse_grad=True)`) and
applies the suite's pass rule against `attention_reference` in fp32 (tests/attention_testing.py:
3x PyTorch's own error in the input dtype for gradients, plus one unit). Routes: delta in the
dQ pass (up to `DELTA_IN_DQ_MAX_LEN` tokens), the preprocess kernel (longer calls), the
deterministic two-pass scheme, and the sm_90 backward (`set_backward_path("sm90")`, on an
sm_90 GPU), which reads the preprocess's delta. Every route of `kernels.attention_ops` that
returns an LSE with a gradient (eager Function, `PlannedCall`, the custom op, torch.compile) is
checked in bf16, and the backward's launch plans are checked to key on dlse where the launches
go through the compiled kernels' launchers (bound slots; the suite's signature checks would
fail a launch reusing another specialization's kernel). The CPU twin is
tests/test_kernels_lse_grad.py.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d], lse [b, h, s_q]; varlen [t, h, d],
lse [h, t].
"""

from __future__ import annotations

import pytest
import torch
from attention_testing import (
    Case,
    check_case,
    check_results,
    make_inputs,
    run_kernel,
    run_reference,
)
from fusedlayers.kernels import _flash_bwd, _flash_bwd_sm90, dispatch
from test_backward_sm90_gpu import needs_sm90
from test_kernels_gpu import recorded
from test_kernels_lse_grad import ROUTES, _route_call

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
CAUSAL = (-1, 0)

CASES = [
    Case(lse_grad=True, b=2, s_q=300, s_k=417, h=4, h_kv=4, d=64, dtype=BF16),
    Case(lse_grad=True, b=2, s_q=513, s_k=513, h=8, h_kv=2, d=128, dtype=BF16, window=CAUSAL),
    Case(lse_grad=True, b=2, s_q=700, s_k=300, h=6, h_kv=2, d=96, dtype=F16, window=CAUSAL,
         bottom_right=False),
    Case(lse_grad=True, b=3, s_q=400, s_k=500, h=4, h_kv=1, d=128, dtype=BF16, layout="varlen",
         window=CAUSAL),
    Case(lse_grad=True, b=3, s_q=333, s_k=300, h=4, h_kv=2, d=64, dtype=F16,
         layout="varlen_padded"),
    Case(lse_grad=True, b=3, s_q=600, s_k=400, h=4, h_kv=2, d=64, dtype=BF16, layout="seqlens",
         window=CAUSAL),
    Case(lse_grad=True, b=2, s_q=256, s_k=300, h=4, h_kv=2, d=64, dtype=BF16, bias="1hss",
         softcap=10.0),
    Case(lse_grad=True, b=2, s_q=300, s_k=300, h=4, h_kv=2, d=64, dtype=BF16, dropout_p=0.2,
         window=(60, 0)),
    # Longer than DELTA_IN_DQ_MAX_LEN: the preprocess computes delta.
    Case(lse_grad=True, b=1, s_q=2048, s_k=2048, h=4, h_kv=2, d=128, dtype=BF16, window=CAUSAL),
    Case(lse_grad=True, b=2, s_q=1500, s_k=1100, h=4, h_kv=4, d=64, dtype=F16,
         deterministic=True),
    # Bottom-right causal with more queries than keys: the first rows see no key.
    Case(lse_grad=True, b=2, s_q=500, s_k=200, h=4, h_kv=2, d=64, dtype=BF16, window=CAUSAL),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_lse_gradient_matches_reference(case, request):
    with recorded(request, case.label()) as entry:
        entry["errors"] = check_case(case, "cuda", high_dtype=torch.float32)


def test_lse_gradient_through_the_preprocess_on_short_calls(monkeypatch, request):
    """A short call with the preprocess forced: the same numbers as delta in the dQ pass."""
    monkeypatch.setattr(_flash_bwd, "DELTA_IN_DQ_MAX_LEN", 0)
    case = CASES[1]
    with recorded(request, case.label()) as entry:
        entry["errors"] = check_case(case, "cuda", high_dtype=torch.float32)


def test_rows_without_keys_drop_their_dlse():
    """NaN and inf in dlse on rows with LSE -inf change no gradient."""
    case = CASES[-1]
    inputs = make_inputs(case, "cuda")
    clean = run_kernel(case, inputs)
    empty = slice(0, case.s_q - case.s_k)
    dlse = inputs["dlse"].clone()
    dlse[:, 0, empty], dlse[:, 1, empty] = float("nan"), float("inf")
    poisoned = run_kernel(case, {**inputs, "dlse": dlse})
    for name in ("dq", "dk", "dv"):
        assert torch.equal(poisoned[name], clean[name]), name


SM90_CASES = [
    Case(lse_grad=True, b=2, s_q=1024, s_k=1024, h=4, h_kv=2, d=128, dtype=BF16),
    Case(lse_grad=True, b=2, s_q=1000, s_k=1000, h=4, h_kv=4, d=64, dtype=BF16, window=CAUSAL),
    Case(lse_grad=True, b=2, s_q=777, s_k=300, h=8, h_kv=2, d=128, dtype=F16, window=CAUSAL),
    Case(lse_grad=True, b=5, s_q=600, s_k=600, h=4, h_kv=2, d=128, dtype=BF16, layout="varlen",
         window=CAUSAL),
]  # fmt: skip


@pytest.fixture
def sm90_launches(monkeypatch):
    """Pins the sm_90 backward; the list of its launches."""
    launches = []
    launch = _flash_bwd_sm90.backward_sm90

    def spy(*args, **kwargs):
        launches.append(kwargs)
        return launch(*args, **kwargs)

    monkeypatch.setattr(_flash_bwd_sm90, "backward_sm90", spy)
    previous = dispatch.set_backward_path("sm90")
    yield launches
    dispatch.set_backward_path(previous)


@needs_sm90
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: c.label())
def test_sm90_backward_takes_dlse(case, sm90_launches, request):
    """The sm_90 backward reads the preprocess's delta, dlse folded in."""
    with recorded(request, case.label()) as entry:
        entry["errors"] = check_case(case, "cuda", high_dtype=torch.float32)
    assert sm90_launches, "the sm_90 backward did not run"


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_carries_dlse(route, request):
    """bf16 through each route that hands back an LSE with a gradient, twice (the second call
    launches through the plan's bound slots), against the fp32 reference."""
    case = Case(lse_grad=True, b=2, s_q=300, s_k=333, h=4, h_kv=2, d=64, dtype=BF16,
                window=CAUSAL)  # fmt: skip
    inputs = make_inputs(case, "cuda")
    high = run_reference(case, inputs, torch.float32)
    low = run_reference(case, inputs, case.dtype)
    fn, _ = _route_call(route, case)
    with recorded(request, f"{route} {case.label()}") as entry:
        for _ in range(2):
            leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v")]
            out, lse = fn(*leaves)
            grads = torch.autograd.grad((out, lse), leaves, (inputs["dout"], inputs["dlse"]))
            got = dict(out=out.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2])
            entry["errors"] = check_results(got, high, low, case.s_k)


def test_backward_plans_key_on_dlse():
    """A loss on out alone, on the LSE too, with a dlse 4 bytes off 16-byte alignment, and on
    out alone again: each computes its own gradients (a plan reused across them would launch
    a kernel of another specialization, which the suite's signature checks refuse, or skip
    the fold)."""
    case = Case(lse_grad=True, b=2, s_q=200, s_k=257, h=4, h_kv=2, d=64, dtype=BF16,
                window=CAUSAL)  # fmt: skip
    inputs = make_inputs(case, "cuda")
    without = {**inputs, "dlse": None}
    buffer = torch.empty(inputs["dlse"].numel() + 1, device="cuda")
    misaligned = buffer[1:].view(inputs["dlse"].shape)
    misaligned.copy_(inputs["dlse"])
    for call_inputs in (without, inputs, {**inputs, "dlse": misaligned}, without, inputs):
        for _ in range(2):  # the second launches through bound slots
            kernel = run_kernel(case, call_inputs)
            high = run_reference(case, call_inputs, torch.float32)
            low = run_reference(case, call_inputs, case.dtype)
            check_results(kernel, high, low, case.s_k)
