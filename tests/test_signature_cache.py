"""The front end's signature cache (fusedlayers/attention/frontend.py): a call is validated
once per signature, and any change a check reads (a stride, a length, a dtype, an argument)
validates again; calls with mask, length, bias or ALiBi tensors are validated every time."""

from __future__ import annotations

import pytest
import torch
from naive_attention import naive_attention

from fusedlayers.attention import frontend, validation
from fusedlayers.attention.reference import attention_reference


@pytest.fixture
def checks(monkeypatch):
    """Counts full validations (`validation.check_qkv` runs once per uncached call)."""
    monkeypatch.setattr(frontend, "_VALIDATED", {})
    calls = []
    real = validation.check_qkv

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(validation, "check_qkv", counting)
    return calls


def _qkv(b=2, s=6, h=4, hg=2, d=8, s_kv=None, fmt="bshd"):
    s_kv = s if s_kv is None else s_kv
    shape = (lambda s_: (s_, b)) if fmt == "sbhd" else (lambda s_: (b, s_))
    q = torch.randn(*shape(s), h, d, dtype=torch.float64)
    k = torch.randn(*shape(s_kv), hg, d, dtype=torch.float64)
    v = torch.randn(*shape(s_kv), hg, d, dtype=torch.float64)
    return q, k, v


def _attend(q, k, v, **kwargs):
    kwargs.setdefault("qkv_format", "bshd")
    return frontend.attention(q, k, v, backend="reference", **kwargs)[0]


def _expected(q, k, v, fmt="bshd", causal=False):
    if fmt == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out, _ = naive_attention(q, k, v, window=(-1, 0) if causal else (-1, -1))
    out = out.to(q.dtype)
    return out.transpose(0, 1) if fmt == "sbhd" else out


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_a_repeated_signature_is_validated_once_and_computes_on_new_data(checks, fmt):
    for seed in range(3):
        torch.manual_seed(seed)
        q, k, v = _qkv(fmt=fmt)
        out = _attend(q, k, v, qkv_format=fmt, attn_mask_type="causal")
        torch.testing.assert_close(out, _expected(q, k, v, fmt, causal=True))
    assert len(checks) == 1


@pytest.mark.parametrize(
    "change",
    [
        "stride",  # same shapes, k read through a transposed (non-contiguous) view
        "length",  # another key length
        "dtype",
        "heads",
        "scale",
        "mask_type",
    ],
)
def test_any_change_validates_again(checks, change):
    q, k, v = _qkv()
    kwargs = dict(attn_mask_type="no_mask")
    _attend(q, k, v, **kwargs)
    if change == "stride":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "length":
        q, k, v = _qkv(s_kv=9)
    elif change == "dtype":
        q, k, v = (t.float() for t in (q, k, v))
    elif change == "heads":
        q, k, v = _qkv(h=6, hg=3)
    elif change == "scale":
        kwargs["softmax_scale"] = 0.5
    elif change == "mask_type":
        kwargs["attn_mask_type"] = "causal"
    out = _attend(q, k, v, **kwargs)
    assert len(checks) == 2
    if change not in ("scale", "mask_type"):
        torch.testing.assert_close(out, _expected(q, k, v), atol=1e-5, rtol=1e-5)


def test_a_cached_signature_does_not_let_bad_input_through(checks):
    q, k, v = _qkv(hg=4)
    _attend(q, k, v)
    with pytest.raises(ValueError, match="heads"):  # 4 query heads over 3 KV heads
        _attend(q, k[:, :, :3].clone(), v[:, :, :3].clone())
    with pytest.raises(ValueError, match="softmax_scale"):
        _attend(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="softmax_scale"):
        _attend(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        _attend(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="layer"):  # batch of k differs from q's
        _attend(q, k[:1], v[:1])
    _attend(q, k, v)  # still cached
    assert len(checks) == 3  # the first call, the head and batch mismatches


def test_calls_with_tensor_arguments_are_validated_every_time(checks):
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 4:] = True
    for _ in range(2):
        _attend(q, k, v, attn_mask_type="padding", attention_mask=mask)
    slopes = torch.rand(4, dtype=torch.float32)
    for _ in range(2):
        _attend(q, k, v, core_attention_bias_type="alibi", alibi_slopes=slopes)
    assert len(checks) == 4


def test_unhashable_window_is_validated_every_time(checks):
    q, k, v = _qkv()
    for _ in range(2):
        _attend(q, k, v, attn_mask_type="no_mask", window_size=[2, 0])
    assert len(checks) == 2


# The kernel path (the Triton interpreter on CPU): a hit of a call without dropout launches the
# kernel call planned on the miss (`kernels.attention_ops.plan_call`), without the generic path.


@pytest.fixture
def planned(monkeypatch):
    """Counts the front end's launches of a planned call and the plans it makes."""
    counts = {"calls": 0, "plans": 0}
    real_call, real_plan = frontend.flash_attention_planned, frontend.plan_call

    def call(*args, **kwargs):
        counts["calls"] += 1
        return real_call(*args, **kwargs)

    def plan(*args, **kwargs):
        counts["plans"] += 1
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(frontend, "flash_attention_planned", call)
    monkeypatch.setattr(frontend, "plan_call", plan)
    return counts


def _kernel_attend(q, k, v, **kwargs):
    kwargs.setdefault("qkv_format", "bshd")
    return frontend.attention(q, k, v, backend="kernel", **kwargs)[0]


def _reference_with_grads(q, k, v, dout, fmt, window, bottom_right, scale=None):
    """fp64 reference output and gradients of q, k and v."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    views = [t.transpose(0, 1) for t in leaves] if fmt == "sbhd" else leaves
    out = attention_reference(
        *views, window_size=window, bottom_right=bottom_right, softmax_scale=scale
    )
    out = out.transpose(0, 1) if fmt == "sbhd" else out
    return out, torch.autograd.grad(out, leaves, dout.double())


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_kernel_hits_launch_the_planned_call_on_fresh_data(checks, planned, fmt, grad):
    for seed in range(3):
        torch.manual_seed(seed)
        q, k, v = (t.float().requires_grad_(grad) for t in _qkv(fmt=fmt))
        out = _kernel_attend(q, k, v, qkv_format=fmt, attn_mask_type="causal")
        dout = torch.randn_like(out)
        want, want_grads = _reference_with_grads(q, k, v, dout, fmt, (-1, 0), False)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        assert out.requires_grad == grad
        if grad:
            got = torch.autograd.grad(out, (q, k, v), dout)
            for name, g, w in zip("qkv", got, want_grads):
                torch.testing.assert_close(g.double(), w, atol=5e-5, rtol=5e-5, msg=name)
    assert len(checks) == 1
    assert planned == {"calls": 2, "plans": 1}


@pytest.mark.parametrize("change", ["stride", "deterministic", "softcap", "scale", "window"])
def test_each_argument_a_plan_fixes_makes_a_new_plan(checks, planned, change):
    torch.manual_seed(0)
    q, k, v = (t.float() for t in _qkv())
    kwargs = dict(attn_mask_type="no_mask")
    _kernel_attend(q, k, v, **kwargs)
    window, scale = (-1, -1), None
    if change == "stride":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "deterministic":
        kwargs["deterministic"] = True
    elif change == "softcap":
        kwargs["softcap"] = 5.0
    elif change == "scale":
        kwargs["softmax_scale"] = scale = 0.25
    else:
        kwargs["window_size"] = window = (2, 1)
    for _ in range(2):  # the miss plans, the hit launches that plan
        out = _kernel_attend(q, k, v, **kwargs)
    assert len(checks) == 2
    assert planned == {"calls": 1, "plans": 2}
    if change != "softcap":
        want, _ = _reference_with_grads(q, k, v, torch.ones_like(out), "bshd", window, True, scale)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_dropout_hits_take_the_generic_path(checks, planned):
    q, k, v = (t.float() for t in _qkv())
    outs = []
    for _ in range(2):
        torch.manual_seed(5)  # the same seed draws the same keep-mask
        outs.append(_kernel_attend(q, k, v, dropout_p=0.3))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    assert len(checks) == 1
    assert planned == {"calls": 0, "plans": 0}


def test_planned_hits_on_packed_qkv(checks, planned):
    """q, k and v viewed from one packed tensor (the packed-gradient plan of the eager route):
    the hit's packed gradient has the reference's values too."""
    from fusedlayers import flash_attn_qkvpacked_func

    for seed in range(2):
        torch.manual_seed(seed)
        qkv = torch.randn(2, 6, 3, 4, 8, requires_grad=True)
        out = flash_attn_qkvpacked_func(qkv, causal=True)
        dout = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, qkv, dout)
        views = qkv.unbind(2)
        want, want_grads = _reference_with_grads(*views, dout, "bshd", (-1, 0), True)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(grad.double(), torch.stack(want_grads, 2), atol=5e-5, rtol=5e-5)
    assert len(checks) == 1
    assert planned == {"calls": 1, "plans": 1}


def test_planned_hits_still_log_each_new_call_site(monkeypatch, caplog):
    """FUSEDLAYERS_DEBUG=1 logs once per call site; a call site whose first call is a planned
    hit (the signature was validated elsewhere) is logged too, with the kernel path."""
    import logging

    monkeypatch.setattr(frontend, "_VALIDATED", {})
    monkeypatch.setenv("FUSEDLAYERS_DEBUG", "1")
    q, k, v = (t.float() for t in _qkv(fmt="sbhd"))
    with caplog.at_level(logging.INFO, logger="fusedlayers"):
        _kernel_attend(q, k, v, qkv_format="sbhd", attn_mask_type="causal", tag="first site")
        _kernel_attend(q, k, v, qkv_format="sbhd", attn_mask_type="causal", tag="second site")
    records = [r.getMessage() for r in caplog.records if r.name == "fusedlayers"]
    assert len(records) == 2 and "second site" in records[1]
    assert "qkv_format=sbhd" in records[1] and "backend=triton" in records[1]
