"""Per-signature launch plans (kernels/_flash_bwd.py, _flash_fwd.py, _flash_decode.py): a plan
is made once per signature and reused, and any change it depends on (a stride, a length, a
dtype, an argument, a setting) makes a new one. Every call's results are checked against the
fp64 reference, so a plan reused where it should not be fails on the numbers too.

Shapes: dense q/dout [b, s_q, h, d], k/v [b, s_k, h_kv, d]; varlen [t, h, d].
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_testing import check_close
from fusedlayers.kernels import _common, _flash_bwd, _flash_decode, _flash_fwd
from kvcache_testing import KVCase, call_kernel, check_kv_case, make_kv_inputs, reference
from test_kernels_backward_unit import _check, _dense, _mask_kwargs
from test_kernels_forward_unit import NO_SEQ, _compare

F16, F32 = torch.float16, torch.float32


def _count_plans(monkeypatch, module) -> list:
    """Empty `module`'s plan table; returns the list its `_make_plan` appends to per plan."""
    monkeypatch.setattr(module, "_PLANS", {})
    made = []
    real = module._make_plan

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_make_plan", counting)
    return made


@pytest.fixture
def bwd_plans(monkeypatch):
    """The backward plans made during a test (`_count_plans`)."""
    return _count_plans(monkeypatch, _flash_bwd)


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


def test_plans_follow_the_causal_order_budget(bwd_plans, fwd_plans, monkeypatch):
    """The causal launch order (`_common.causal_order_heads`) is planned: a changed budget makes
    new forward and backward plans whose launch arguments differ, with the same results."""
    tensors, ref, kern = _bwd(0)
    q, k, v = _qkv(0)
    for budget in (1 << 24, 0):
        monkeypatch.setattr(_common, "CAUSAL_ORDER_L2_BYTES", budget)
        _check(tensors, F16, ref, kern)
        _compare(q, k, v, window=(-1, 0))
    assert len(bwd_plans) == 2 and len(fwd_plans) == 2
    assert len({plan.dq.ints for plan in _flash_bwd._PLANS.values()}) == 2
    assert len({plan.dkdv.ints for plan in _flash_bwd._PLANS.values()}) == 2
    assert len({plan.ints for plan in _flash_fwd._PLANS.values()}) == 2


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


@pytest.mark.parametrize("shape", [torch.Size([2, 3, 4]), (5,), (0, 3), (), torch.Size([])])
def test_buffers_take_any_shape(shape):
    """The launchers' `empty`/`zeros`: new contiguous buffers of the shape, dtype and device
    asked for, sizes given as a torch.Size or a tuple, 0-d included; `zeros` all zero."""
    for make in (_common.empty, _common.zeros):
        t = make(shape, F16, torch.device("cpu"))
        assert t.shape == torch.Size(shape) and t.dtype == F16 and t.device.type == "cpu"
        assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * 2
    # Freed memory of the same size, filled, is what an allocator hands out next: a `zeros`
    # that only allocated would return the fill.
    filled = torch.full(shape, 7.0)
    del filled
    assert not _common.zeros(shape, F32, torch.device("cpu")).any()


@pytest.fixture
def fwd_plans(monkeypatch):
    """The forward plans made during a test (`_count_plans`)."""
    return _count_plans(monkeypatch, _flash_fwd)


def _qkv(seed, b=2, s_q=20, s_k=35, h=4, h_kv=2, d=16, dtype=F16):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, s_q, h, d), (b, s_k, h_kv, d), (b, s_k, h_kv, d))
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]


def test_forward_plan_is_made_once_and_computes_on_new_data(fwd_plans):
    for seed in range(3):
        _compare(*_qkv(seed), window=(-1, 0))
    assert len(fwd_plans) == 1


@pytest.mark.parametrize(
    "change", ["stride", "length", "dtype", "heads", "window", "scale", "seqlens", "varlen"]
)
def test_forward_any_change_makes_a_new_plan(fwd_plans, change):
    q, k, v = _qkv(0)
    _compare(q, k, v, window=(-1, 0))
    kw = dict(window=(-1, 0))
    q, k, v = _qkv(1)
    if change == "stride":  # k read through a transposed (non-contiguous) view
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "length":
        q, k, v = _qkv(1, s_k=40)
    elif change == "dtype":
        q, k, v = _qkv(1, dtype=F32)
    elif change == "heads":
        q, k, v = _qkv(1, h=6, h_kv=3)
    elif change == "window":
        kw["window"] = (4, 2)
    elif change == "scale":
        kw["scale"] = 0.5
    elif change == "seqlens":  # right-padded: rows past a length are 0 with LSE -inf
        kw["seq"] = dict(seqlens_q=torch.tensor([20, 7], dtype=torch.int32))
    if change == "varlen":
        lens_q, lens_k = [20, 13], [35, 22]
        cu = [torch.tensor([0, a, a + b], dtype=torch.int32) for a, b in (lens_q, lens_k)]
        seq = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=20, max_seqlen_k=35)
        q, k, v = (t.reshape(-1, *t.shape[2:])[:n] for t, n in zip((q, k, v), (33, 57, 57)))
        _compare(q, k, v, seq=seq, **kw)
    else:
        _compare(q, k, v, **kw)
    assert len(fwd_plans) == 2


def test_forward_launch_hands_out_constexprs_of_its_own():
    """Tools change the constexprs forward_launch returns (one explicit config); the plan the
    next call reuses must not see that."""
    q, k, v = _qkv(0)
    args = dict(NO_SEQ, softmax_scale=0.25, window_left=-1, window_right=-1, bottom_right=True,
                bias=None, alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0,
                offset=0)  # fmt: skip
    consts = _flash_fwd.forward_launch(q, k, v, **args)[4]
    consts.update(BLOCK_M=-1, HEAD_DIM_QK=-1)
    assert _flash_fwd.forward_launch(q, k, v, **args)[4]["HEAD_DIM_QK"] == 16
    _compare(q, k, v, scale=0.25)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed-qkv"])
def test_eager_backward_starts_from_the_forward_signature(
    bwd_plans, fwd_plans, packed, monkeypatch
):
    """Through the eager autograd route the backward signs only dout: the forward signed the
    inputs, and out, lse and the gradient buffers are the route's own (their signatures follow
    from the forward's and its packed-gradient plan). One forward and one backward plan for
    three steps on new data, gradients as the reference's; separate and packed q/k/v differ in
    their gradient buffers' strides, so each gets its own backward plan."""
    from fusedlayers.kernels import flash_attention

    from fusedlayers.attention.reference import attention_reference

    def leaves(seed):
        q, k, v = _qkv(seed, s_k=20, h=2, h_kv=2)
        if not packed:
            return [t.requires_grad_() for t in (q, k, v)], None
        qkv = torch.stack((q, k, v), dim=2).requires_grad_()  # [b, s, 3, h, d]
        return list(qkv.unbind(2)), qkv

    signed_again = []
    monkeypatch.setattr(_flash_bwd, "attention_signature", lambda **kw: signed_again.append(1))
    monkeypatch.setattr(_flash_bwd, "call_signature", lambda *a: signed_again.append(2))
    for seed in range(3):
        (q, k, v), qkv = leaves(seed)
        out, _ = flash_attention(q, k, v, softmax_scale=0.25, window_size=(-1, 0))
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, qkv if packed else (q, k, v), dout)
        got = torch.cat(got[0].unbind(2) if packed else got)
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out = attention_reference(*ref, softmax_scale=0.25, window_size=(-1, 0))
        want = torch.cat(torch.autograd.grad(ref_out, ref, dout.double()))
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)
    assert len(fwd_plans) == 1 and len(bwd_plans) == 1 and not signed_again


def test_eager_backward_signs_dout(bwd_plans):
    """The eager backward's signature keeps dout's: a dout 2 bytes off 16-byte alignment (a
    contiguous view into a larger buffer) is a new specialization for the kernels, so a new
    plan, and the gradients stay the reference's for both. (With the suite's signature checks
    on, a launch reusing the aligned dout's kernel would also fail.)"""
    from fusedlayers.kernels import flash_attention

    from fusedlayers.attention.reference import attention_reference

    q, k, v = (t.requires_grad_() for t in _qkv(0, s_k=20, h=2, h_kv=2))
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = attention_reference(*ref, softmax_scale=0.25, window_size=(-1, 0))
    for offset in (0, 1, 8):  # fp16 elements: aligned, misaligned, aligned again
        out, _ = flash_attention(q, k, v, softmax_scale=0.25, window_size=(-1, 0))
        buffer = torch.randn(out.numel() + offset, dtype=out.dtype)
        dout = buffer[offset:].view(out.shape)
        assert (dout.data_ptr() % 16 == 0) == (offset != 1)
        got = torch.cat(torch.autograd.grad(out, (q, k, v), dout))
        want = torch.autograd.grad(ref_out, ref, dout.double(), retain_graph=True)
        torch.testing.assert_close(got.double(), torch.cat(want), atol=2e-2, rtol=0)
    assert len(bwd_plans) == 2


def test_eager_backward_gets_no_zero_filled_lse_gradient():
    """A loss on out alone gives lse no gradient, and the eager route asks autograd not to
    materialize one: no zero fill of lse's size per backward (an allocation and a kernel
    launch on autograd's device thread, and a dlse of zeros for the kernels to fold in), and
    the gradients stay the reference's."""
    from fusedlayers.kernels import flash_attention
    from torch.utils._python_dispatch import TorchDispatchMode

    from fusedlayers.attention.reference import attention_reference

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "zero" in str(func) or "fill" in str(func):
                shape = args[0] if str(func).startswith("aten.zeros") else args[0].shape
                self.shapes.append(tuple(shape))
            return func(*args, **(kwargs or {}))

    q, k, v = (t.requires_grad_() for t in _qkv(0, s_k=20, h=2, h_kv=2))
    out, lse = flash_attention(q, k, v, softmax_scale=0.25, window_size=(-1, 0))
    dout = torch.randn_like(out)
    with Fills() as fills:
        got = torch.cat(torch.autograd.grad(out, (q, k, v), dout))
    assert tuple(lse.shape) not in fills.shapes, f"zero fills in the backward: {fills.shapes}"
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = attention_reference(*ref, softmax_scale=0.25, window_size=(-1, 0))
    want = torch.cat(torch.autograd.grad(ref_out, ref, dout.double()))
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)


@pytest.fixture
def decode_plans(monkeypatch):
    """The decode plans made during a test (`_count_plans`)."""
    return _count_plans(monkeypatch, _flash_decode)


def test_decode_plan_is_made_once_and_computes_on_new_data(decode_plans):
    """Three steps with new queries, cache contents and lengths (device values, not in the
    signature): one plan, every step against the fp64 oracle, split partials in one buffer."""
    for seed in range(3):
        check_kv_case(KVCase(seed=seed, s_cache=96, num_splits=3), "cpu")
    assert len(decode_plans) == 1


@pytest.mark.parametrize(
    "change", ["capacity", "cache stride", "splits", "window", "paged", "row blocks", "dtype"]
)
def test_decode_any_change_makes_a_new_plan(decode_plans, monkeypatch, change):
    base = KVCase(num_splits=3)
    if change == "row blocks":  # 6 query heads per KV head x 3 queries = 18 packed rows
        base = KVCase(h=6, hk=1, s_q=3, s_new=3, causal=True, num_splits=3)
    check_kv_case(base, "cpu")
    case = dataclasses.replace(base, seed=1)
    if change == "capacity":
        case = dataclasses.replace(case, s_cache=80)
    elif change == "splits":
        case = dataclasses.replace(case, num_splits=2)
    elif change == "window":
        case = dataclasses.replace(case, window=(5, 0))
    elif change == "paged":
        case = dataclasses.replace(case, page_size=16)
    elif change == "dtype":
        case = dataclasses.replace(case, dtype=F32)
    elif change == "row blocks":  # same signature, but the tile height (a setting) changes
        monkeypatch.setattr(_flash_decode, "MAX_BLOCK_M", 16)
    if change == "cache stride":  # the same cache read through [b, h_k, s, d] storage
        inputs = make_kv_inputs(case, "cpu")
        for name in ("k_cache", "v_cache"):
            inputs[name] = inputs[name].transpose(1, 2).contiguous().transpose(1, 2)
        out, lse = call_kernel(case, inputs)
        high, _ = reference(case, inputs, torch.float64)
        low, _ = reference(case, inputs, case.dtype)
        check_close("out", out, high, low, factor=2.0)
    else:
        check_kv_case(case, "cpu")
    assert len(decode_plans) == 2
