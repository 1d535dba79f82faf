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
from attention_testing import Case, check_case, check_results, make_inputs, run_reference
from fusedlayers.kernels import (
    _flash_bwd_sm90,
    _flash_fwd_sm90,
    _launch,
    set_backward_path,
    set_forward_path,
)

import fusedlayers
from fusedlayers.attention import frontend

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


# The sm_90 kernels: their first arguments are TMA descriptors, keyed by what Triton types them
# by (`_launch._runtime_key`), so their repeated calls launch directly too. Causal forwards run
# the persistent grid with a fresh tile counter per call; a counter left over from the previous
# call would skip tiles.
SM90_CASES = [
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=2, d=128, dtype=BF16, window=(-1, 0)),
    Case(b=3, s_q=700, s_k=900, h=6, h_kv=2, d=64, dtype=F16, layout="varlen"),
]


def _sm90_ready() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and _flash_fwd_sm90.GLUON_AVAILABLE
    )


@pytest.fixture
def sm90_kernels():
    """Pins the sm_90 forward and backward for one test, whatever the key lengths."""
    previous = set_forward_path("sm90"), set_backward_path("sm90")
    yield
    set_forward_path(previous[0])
    set_backward_path(previous[1])


@pytest.mark.skipif(not _sm90_ready(), reason="needs an sm_90 GPU and Triton's Gluon")
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("case", SM90_CASES, ids=Case.label)
def test_sm90_one_signature_on_fresh_data(case, checked, sm90_kernels, monkeypatch):
    """Four calls of one signature on the sm_90 kernels, each on new inputs and checked: from the
    second call on, the forward and the backward launch straight through their compiled
    kernels, with this call's descriptors. With the checks on, each such launch is also
    verified against the per-argument key."""
    monkeypatch.setattr(_launch, "_check_signatures", checked)
    launched = []
    kernels = {_flash_fwd_sm90: _flash_fwd_sm90._attn_fwd_sm90,
               _flash_bwd_sm90: _flash_bwd_sm90._attn_bwd_sm90}  # fmt: skip
    for module, module_kernel in kernels.items():

        def spy(kernel, *args, _launch_fn=module.launch, **kwargs):
            launched.append(kernel)
            return _launch_fn(kernel, *args, **kwargs)

        def bound_spy(slot, args, _bound_fn=module.launch_bound, _kernel=module_kernel):
            # a launch through the bound slot alone (`launch` is not called for it then)
            done = _bound_fn(slot, args)
            if done:
                launched.append(_kernel)
            return done

        monkeypatch.setattr(module, "launch", spy)
        monkeypatch.setattr(module, "launch_bound", bound_spy)
    for seed in range(4):
        check_case(dataclasses.replace(case, seed=seed), "cuda")
    for kernel in (_flash_fwd_sm90._attn_fwd_sm90, _flash_bwd_sm90._attn_bwd_sm90):
        assert launched.count(kernel) == 4, f"{kernel.fn.__name__} ran {launched.count(kernel)}x"
        launches = _launch._LAUNCHES.get(id(kernel))
        assert launches is not None and launches.compiled, (
            f"{kernel.fn.__name__} never took the direct launcher's keyed path"
        )


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


# The front end's planned calls (fusedlayers/attention/frontend.py): from the second call of a
# signature, `attention` launches the kernel call it planned on the first (`plan_call`), with the
# plan's launch signature. Each call must still compute on its own inputs and gradients.
FRONT_END_CASES = [
    ("portable", Case(b=2, s_q=192, s_k=192, h=4, h_kv=2, d=64, dtype=BF16, window=(-1, 0))),
    ("sm90", Case(b=1, s_q=1024, s_k=1024, h=4, h_kv=2, d=128, dtype=BF16, window=(-1, 0))),
]


def _front_end(case: Case, inputs: dict, fmt: str) -> dict:
    """`frontend.attention` (causal) on the case's q, k and v given in `fmt`: out, lse and the
    gradients, in the kernels' bshd layout."""
    leaves = [inputs[n].detach().to(case.dtype).requires_grad_() for n in ("q", "k", "v")]
    views = [t.transpose(0, 1) for t in leaves] if fmt == "sbhd" else leaves
    out, lse = frontend.attention(
        *views, qkv_format=fmt, attn_mask_type="causal", softmax_scale=case.scale
    )
    out = out.transpose(0, 1) if fmt == "sbhd" else out
    grads = torch.autograd.grad(out, leaves, inputs["dout"].to(out.dtype))
    return dict(out=out.detach(), lse=lse.detach(), **dict(zip(("dq", "dk", "dv"), grads)))


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "slots"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("path,case", FRONT_END_CASES, ids=[p for p, _ in FRONT_END_CASES])
def test_front_end_planned_calls_on_fresh_data(path, case, fmt, checked, monkeypatch):
    """Four front-end calls of one signature on new inputs, each checked with the suite's pass
    rule; the last three launch the planned call, through the signature checks or (unchecked)
    the plans' bound launch slots."""
    if path == "sm90" and not _sm90_ready():
        pytest.skip("needs an sm_90 GPU and Triton's Gluon")
    monkeypatch.setattr(_launch, "_check_signatures", checked)
    monkeypatch.setattr(frontend, "_VALIDATED", {})
    planned = []
    real = frontend.flash_attention_planned
    monkeypatch.setattr(
        frontend, "flash_attention_planned", lambda *a: planned.append(1) or real(*a)
    )
    previous = set_forward_path(path), set_backward_path(path)
    try:
        for seed in range(4):
            seeded = dataclasses.replace(case, seed=seed)
            inputs = make_inputs(seeded, "cuda")
            high = run_reference(seeded, inputs, torch.float64)
            low = run_reference(seeded, inputs, seeded.dtype)
            check_results(_front_end(seeded, inputs, fmt), high, low, seeded.s_k)
    finally:
        set_forward_path(previous[0])
        set_backward_path(previous[1])
    assert len(planned) == 3
