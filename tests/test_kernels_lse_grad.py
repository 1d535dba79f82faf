"""The attention LSE is differentiable: a loss that reads out and lse, under the interpreter.

An upstream gradient dlse on lse_i = log sum_j exp(s_ij) adds P_ij * dlse_i to dS_ij, so the
backward runs with delta_i = rowsum(dO * O)_i - dlse_i and nothing else changes. Each case
takes the gradient of sum(out * dout) + sum(lse * dlse) on fresh random inputs and compares dq,
dk, dv (and dbias) with fp64 autograd through `attention_reference` by the pass rule of
`attention_testing` (3x PyTorch's own error in the input dtype for gradients), on every place
delta is computed: the dQ pass (short calls), the preprocess kernel (long calls, forced here)
and the atomic-dQ scheme; and on every route of `kernels.attention_ops` that returns an LSE with
a gradient: the eager Function, a `PlannedCall` (the front end's signature hits), the custom op
called directly, and the op traced by torch.compile. fp16/fp32 only (the interpreter's bf16 dot
is broken); tests/gpu/test_lse_grad_gpu.py runs bf16 and the sm_90 backward.

Layouts: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d], lse [b, h, s_q]; varlen q [t_q, h, d],
lse [h, t_q].
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_testing import (
    Case,
    KernelSpy,
    check_case,
    check_results,
    make_inputs,
    run_kernel,
    run_reference,
)
from fusedlayers.kernels import _flash_bwd, attention_ops, flash_attention
from fusedlayers.kernels.attention_ops import (
    flash_attention_planned,
    flash_attn_bwd,
    flash_attn_fwd,
    plan_call,
)

import fusedlayers as fl
from fusedlayers.attention import frontend
from fusedlayers.attention.reference import attention_reference

F16, F32 = torch.float16, torch.float32
CAUSAL = (-1, 0)

CASES = [
    Case(lse_grad=True, s_q=19, s_k=21),
    Case(lse_grad=True, h=4, h_kv=2, s_q=20, s_k=13, window=CAUSAL),
    Case(lse_grad=True, h=4, h_kv=1, s_q=17, s_k=17, window=CAUSAL, bottom_right=False, dtype=F32),
    Case(lse_grad=True, layout="varlen", b=3, s_q=18, s_k=21, h=4, h_kv=2, window=CAUSAL),
    Case(lse_grad=True, layout="varlen_padded", b=2, s_q=11, s_k=15, h=2, h_kv=1, dtype=F32),
    Case(lse_grad=True, layout="seqlens", b=2, s_q=18, s_k=11, window=CAUSAL),
    Case(lse_grad=True, bias="1hss", softcap=4.0, s_q=9, s_k=18),
    Case(lse_grad=True, dropout_p=0.3, h=2, h_kv=1, s_q=17, s_k=19, window=CAUSAL),
]


def _ids(cases):
    return [c.label() for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_lse_gradient_matches_reference(case, device, monkeypatch):
    """Short calls: the dQ pass computes delta (minus dlse) and runs first."""
    spy = KernelSpy(_flash_bwd._flash_bwd_dq_kernel)
    monkeypatch.setattr(_flash_bwd, "_flash_bwd_dq_kernel", spy)
    check_case(case, device)
    assert [launch["HAS_DLSE"] for launch in spy.launches] == [True]


LONG_ROUTE = [CASES[1], CASES[4]]


@pytest.mark.parametrize("case", LONG_ROUTE, ids=_ids(LONG_ROUTE))
def test_lse_gradient_through_the_preprocess(case, device, monkeypatch):
    """Long calls: the preprocess kernel computes delta (minus dlse) before both passes, and
    the dQ pass, which reads that delta, must not subtract dlse a second time."""
    monkeypatch.setattr(_flash_bwd, "DELTA_IN_DQ_MAX_LEN", 0)
    spies = {}
    for name in ("_flash_bwd_preprocess_kernel", "_flash_bwd_dq_kernel"):
        spies[name] = KernelSpy(getattr(_flash_bwd, name))
        monkeypatch.setattr(_flash_bwd, name, spies[name])
    check_case(case, device)
    assert [launch["HAS_DLSE"] for launch in spies["_flash_bwd_preprocess_kernel"].launches] == [
        True
    ]
    assert [launch["HAS_DLSE"] for launch in spies["_flash_bwd_dq_kernel"].launches] == [False]


ATOMIC = [CASES[1], CASES[5]]


@pytest.mark.parametrize("case", ATOMIC, ids=_ids(ATOMIC))
def test_lse_gradient_on_the_atomic_path(case, device, monkeypatch):
    """The atomic-dQ scheme reads the preprocess's delta too (as the sm_90 backward does)."""
    monkeypatch.setattr(_flash_bwd, "ATOMIC_DQ_DEVICES", "any")
    spy = KernelSpy(_flash_bwd._flash_bwd_dkdv_kernel)
    monkeypatch.setattr(_flash_bwd, "_flash_bwd_dkdv_kernel", spy)
    check_case(case, device)
    assert spy.launches and all(launch["ATOMIC_DQ"] for launch in spy.launches)


def test_unused_lse_costs_nothing_and_zero_dlse_changes_nothing(device, monkeypatch):
    """A loss on out alone launches no dlse work; a zero dlse gives the same bits."""
    spy = KernelSpy(_flash_bwd._flash_bwd_dq_kernel)
    monkeypatch.setattr(_flash_bwd, "_flash_bwd_dq_kernel", spy)
    case = Case(h=4, h_kv=2, s_q=13, s_k=20, window=CAUSAL)
    inputs = make_inputs(case, device)
    plain = run_kernel(case, inputs)
    assert [launch["HAS_DLSE"] for launch in spy.launches] == [False]
    zero = {**inputs, "dlse": torch.zeros(case.b, case.h, case.s_q, device=device)}
    with_zero = run_kernel(case, zero)
    assert spy.launches[-1]["HAS_DLSE"]
    for name in ("dq", "dk", "dv"):
        assert torch.equal(plain[name], with_zero[name]), name


# ------------------------------------------------------------------------- the routes


def _route_call(route: str, case: Case):
    """A function (q, k, v) -> (out, lse) through one route of `kernels.attention_ops`, and the
    type name of the autograd node that route leaves on `out` (None: not checked)."""
    scale, window = case.scale, case.window
    if route == "eager":
        fn = lambda q, k, v: flash_attention(q, k, v, softmax_scale=scale, window_size=window)  # noqa: E731
        return fn, "_EagerFlashAttentionBackward"
    if route == "planned":

        def planned(q, k, v):
            call = plan_call(q, k, v, softmax_scale=scale, window_size=window)
            return flash_attention_planned(q, k, v, call)

        return planned, "_EagerFlashAttentionBackward"
    if route == "op":  # the custom op in eager: its registered autograd formula

        def op(q, k, v):
            seq = (None,) * 8
            args = (*seq, scale, window[0], window[1], True, None, None, 0.0, 0.0, None, False)
            return flash_attn_fwd(q, k, v, *args)

        return op, None
    assert route == "compiled"
    fn = lambda q, k, v: flash_attention(q, k, v, softmax_scale=scale, window_size=window)  # noqa: E731
    return torch.compile(fn, fullgraph=True, backend="aot_eager"), None


ROUTES = ["eager", "planned", "op", "compiled"]


def test_every_route_carries_dlse(device):
    """Each route that hands back an LSE with a gradient folds dlse in: the gradients pass the
    rule against the fp64 reference, and all routes give the same bits (same launches)."""
    case = Case(lse_grad=True, h=4, h_kv=2, s_q=14, s_k=19, window=CAUSAL, seed=11)
    inputs = make_inputs(case, device)
    high = run_reference(case, inputs, torch.float64)
    low = run_reference(case, inputs, case.dtype)
    results = {}
    for route in ROUTES:
        fn, node = _route_call(route, case)
        leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v")]
        out, lse = fn(*leaves)
        assert lse.requires_grad, route
        if node is not None:
            assert type(out.grad_fn).__name__ == node, route
        grads = torch.autograd.grad((out, lse), leaves, (inputs["dout"], inputs["dlse"]))
        got = dict(out=out.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2])
        check_results(got, high, low, case.s_k)
        results[route] = got
    for route in ROUTES[1:]:
        for name in ("dq", "dk", "dv"):
            assert torch.equal(results[route][name], results["eager"][name]), (route, name)


@pytest.mark.parametrize("route", ["eager", "planned", "op"])
def test_loss_on_lse_alone(route, device):
    """Only the LSE reaches the loss: out's gradient is absent (None) and stands as zeros."""
    case = Case(h=2, h_kv=1, s_q=11, s_k=14, window=(4, 2), dtype=F32)
    inputs = make_inputs(case, device)
    dlse = torch.randn(case.b, case.h, case.s_q, generator=torch.Generator().manual_seed(3))
    leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v")]
    fn, _ = _route_call(route, case)
    _, lse = fn(*leaves)
    got = torch.autograd.grad(lse, leaves, dlse.to(device))
    high = [t.detach().double().requires_grad_() for t in leaves]
    _, ref = attention_reference(
        *high, softmax_scale=case.scale, window_size=case.window, return_lse=True
    )
    want = torch.autograd.grad(
        ref, high, dlse.to(device=device, dtype=ref.dtype), allow_unused=True
    )
    assert want[2] is None and torch.equal(got[2], torch.zeros_like(got[2]))  # lse ignores v
    for name, g, w in zip(("dq", "dk"), got, want):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-4, msg=name)


def test_rows_without_keys_drop_their_dlse(device):
    """Rows with no visible key (LSE -inf) get zero gradients whatever dlse holds there, NaN or
    inf included (a merge of two -inf LSEs hands back NaN); the other rows are unaffected."""
    # Bottom-right causal with s_q > s_k: the first s_q - s_k queries see no key.
    case = Case(lse_grad=True, s_q=21, s_k=6, window=CAUSAL, h=2, h_kv=1, bias="1hss")
    check_case(case, device)
    inputs = make_inputs(case, device)
    clean = run_kernel(case, inputs)
    empty = slice(0, case.s_q - case.s_k)
    dlse = inputs["dlse"].clone()
    dlse[:, 0, empty], dlse[:, 1, empty] = float("nan"), float("inf")
    poisoned = run_kernel(case, {**inputs, "dlse": dlse})
    for name in ("dq", "dk", "dv", "dbias"):
        assert torch.equal(poisoned[name], clean[name]), name
    assert (poisoned["dq"][:, empty] == 0).all()


@pytest.fixture
def bwd_plans(monkeypatch):
    """The backward plans made during a test: `_flash_bwd._make_plan`'s calls."""
    monkeypatch.setattr(_flash_bwd, "_PLANS", {})
    made = []
    real = _flash_bwd._make_plan
    monkeypatch.setattr(
        _flash_bwd, "_make_plan", lambda *a, **kw: made.append(kw["has_dlse"]) or real(*a, **kw)
    )
    return made


def test_backward_plans_key_on_dlse(bwd_plans, device):
    """The eager route's backward signature holds dlse's: a loss on out alone, then one on the
    LSE too, then one with a dlse 4 bytes off 16-byte alignment (a new specialization of the
    kernels that read it) each get their own plan, and one on out alone again reuses the first.
    Every gradient passes the rule against the fp64 reference."""
    case = Case(lse_grad=True, h=4, h_kv=2, s_q=13, s_k=17, window=CAUSAL, seed=4)
    inputs = make_inputs(case, device)
    high, low = (run_reference(case, inputs, dtype) for dtype in (torch.float64, case.dtype))
    without = {**inputs, "dlse": None}
    high_out, low_out = (run_reference(case, without, dtype) for dtype in (torch.float64, F16))
    buffer = torch.empty(inputs["dlse"].numel() + 1, device=device)
    misaligned = buffer[1:].view(inputs["dlse"].shape)
    misaligned.copy_(inputs["dlse"])
    assert misaligned.data_ptr() % 16 != 0
    calls = [
        (without, high_out, low_out),
        (inputs, high, low),
        ({**inputs, "dlse": misaligned}, high, low),
        (without, high_out, low_out),
    ]
    for call_inputs, want_high, want_low in calls:
        check_results(run_kernel(case, call_inputs), want_high, want_low, case.s_k)
    assert bwd_plans == [False, True, True]


def test_flash_attn_func_lse_is_differentiable(device, monkeypatch):
    """flash_attn_func / flash_attn_varlen_func(return_attn_probs=True): the returned LSE
    carries a gradient (flash-attn's drops it silently), on the front end's first call and on
    its signature hit, which takes the planned route."""
    planned = []
    real_planned = frontend.flash_attention_planned
    monkeypatch.setattr(
        frontend, "flash_attention_planned", lambda *a: planned.append(1) or real_planned(*a)
    )
    monkeypatch.setattr(frontend, "_VALIDATED", {})
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, n, h, 16, generator=g) for n, h in ((9, 4), (12, 2), (12, 2)))
    weight = torch.randn(2, 9, 4, 16, generator=g).to(device)
    high = [t.to(device).double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_reference(*high, window_size=CAUSAL, return_lse=True)
    want = torch.autograd.grad((ref * weight.double()).sum() + ref_lse.sin().sum(), high)
    for call in range(2):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        out, lse, _ = fl.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
        assert lse.requires_grad
        got = torch.autograd.grad((out * weight).sum() + lse.sin().sum(), leaves)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=f"{call}: {name}")
        assert len(planned) == call  # the second call is the signature hit

    # varlen: the same two sequences as thd, lse [h, t]
    cu = torch.tensor([0, 9, 18], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 12, 24], dtype=torch.int32, device=device)
    flat = [t.to(device).flatten(0, 1).requires_grad_() for t in (q, k, v)]
    out_t, lse_t, _ = fl.flash_attn_varlen_func(
        *flat, cu, cu_k, 9, 12, causal=True, return_attn_probs=True
    )
    assert lse_t.shape == (4, 18)
    loss = (out_t * weight.flatten(0, 1)).sum() + lse_t.sin().sum()
    got_t = torch.autograd.grad(loss, flat)
    for name, a, b in zip(("dq", "dk", "dv"), got_t, want):
        torch.testing.assert_close(a.double(), b.flatten(0, 1), atol=2e-5, rtol=1e-4, msg=name)


def test_torch_compile_with_lse_in_the_loss(device):
    """torch.compile(fullgraph=True) over a loss reading the LSE: the backward op's fake takes
    dlse, and the compiled gradients equal the eager ones."""
    case = Case(lse_grad=True, h=2, h_kv=1, s_q=10, s_k=12, dtype=F32)
    inputs = make_inputs(case, device)

    def loss(q, k, v):
        out, lse = flash_attention(q, k, v, softmax_scale=0.3, window_size=CAUSAL)
        return (out * inputs["dout"]).sum() + (lse * inputs["dlse"]).sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v")]
        grads.append(torch.autograd.grad(fn(*leaves), leaves))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), name


def test_opcheck_backward_with_dlse(device):
    """torch.library.opcheck of the backward op given a dlse (schema, fake, traced calls)."""
    case = Case(h=2, h_kv=1, s_q=5, s_k=7, lse_grad=True)
    inputs = make_inputs(case, device)
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    seq = (None,) * 8
    out, lse = flash_attn_fwd(q, k, v, *seq, 0.3, -1, 0, True, None, None, 0.0, 0.0, None, False)
    args = (inputs["dout"], q, k, v, out, lse, *seq, 0.3, -1, 0, True, None, False)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(
        flash_attn_bwd, (*args, None, 0.0, 0.0, None, False, inputs["dlse"]), test_utils=checks
    )


def test_dlse_of_the_wrong_shape_is_refused(device):
    """The launcher names a dlse that does not match the LSE it belongs to."""
    case = dataclasses.replace(CASES[0], b=1, s_q=4, s_k=5)
    inputs = make_inputs(case, device)
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    out, lse = flash_attention(q, k, v, softmax_scale=0.25)
    with pytest.raises(ValueError, match=r"dlse .*\(1, 2, 3\).*\(1, 2, 4\)"):
        _flash_bwd.flash_attention_backward(
            inputs["dout"], q, k, v, out, lse, softmax_scale=0.25, dlse=lse.new_zeros(1, 2, 3)
        )


def test_the_op_schema_names_dlse():
    """The backward op takes dlse as its last, optional argument (what compiled graphs pass)."""
    schema = str(attention_ops.flash_attn_bwd._opoverload._schema)
    assert "Tensor? dlse=None) ->" in schema, schema
