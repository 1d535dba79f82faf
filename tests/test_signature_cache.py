"""The front end's signature cache (fusedlayers/attention/frontend.py): a call is validated
once per signature, and any change a check reads (a stride, a length, a dtype, an argument)
validates again; calls with mask, length, bias or ALiBi tensors are validated every time."""

from __future__ import annotations

import pytest
import torch
from naive_attention import naive_attention

from fusedlayers.attention import frontend, validation


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
