"""Scalar arguments, padding masks, layer sizes and generation prompts: each bad value raises before
any compute, naming the argument and the value."""

from __future__ import annotations

import math

import pytest
import torch
from fusedlayers.models import GPT, GPTConfig

import fusedlayers
import fusedlayers.attention.frontend as front_end
from fusedlayers.attention.reference import attention_reference

H, D = 4, 8
BAD_SCALES = [float("nan"), float("inf"), 0.0, -0.125]
BAD_SOFTCAPS = [-1.0, float("nan"), float("inf")]


@pytest.fixture
def no_compute(monkeypatch):
    """Any attention compute fails the test: the error must come first."""

    def computed(*args, **kwargs):
        raise AssertionError("attention ran before the bad argument was reported")

    monkeypatch.setattr(front_end, "_run_kernel", computed)
    monkeypatch.setattr(front_end, "_run_reference", computed)


def _bshd(b=2, s=6, h=H, hg=H, d=D):
    return torch.randn(b, s, h, d), torch.randn(b, s, hg, d), torch.randn(b, s, hg, d)


@pytest.mark.parametrize("scale", BAD_SCALES)
def test_softmax_scale_must_be_finite_and_positive(scale, no_compute):
    q, k, v = _bshd()
    with pytest.raises(ValueError, match=rf"softmax_scale={scale!r} must be a finite number > 0"):
        fusedlayers.flash_attn_func(q, k, v, softmax_scale=scale)
    with pytest.raises(ValueError, match="softmax_scale"):
        fusedlayers.DotProductAttention(H, D, softmax_scale=scale)
    with pytest.raises(ValueError, match="softmax_scale"):
        front_end.attention(q, k, v, qkv_format="bshd", softmax_scale=scale)


@pytest.mark.parametrize("softcap", BAD_SOFTCAPS)
def test_softcap_must_be_zero_or_finite_positive(softcap, no_compute):
    q, k, v = _bshd()
    with pytest.raises(ValueError, match=rf"softcap={softcap!r} must be 0 \(off\)"):
        fusedlayers.flash_attn_func(q, k, v, softcap=softcap)
    with pytest.raises(ValueError, match="softcap"):
        fusedlayers.flash_attn_varlen_func(
            q[0], k[0], v[0], torch.tensor([0, 6], dtype=torch.int32),
            torch.tensor([0, 6], dtype=torch.int32), 6, 6, softcap=softcap,
        )  # fmt: skip


def test_scalar_arguments_of_the_wrong_type():
    q, k, v = _bshd()
    with pytest.raises(TypeError, match="softmax_scale must be a float or None, got str"):
        fusedlayers.flash_attn_func(q, k, v, softmax_scale="0.1")
    with pytest.raises(TypeError, match="softcap must be a float, got NoneType"):
        fusedlayers.flash_attn_func(q, k, v, softcap=None)


@pytest.mark.parametrize(("scale", "softcap"), [(0.05, 0.0), (2.0, 3.0), (1, 0)])
def test_legal_scalars_match_the_reference(scale, softcap):
    """The accepted range still computes: the module's path against the fp64 reference."""
    q, k, v = (t.double() for t in _bshd())
    out, _ = front_end.attention(
        q, k, v, qkv_format="bshd", softmax_scale=scale, softcap=softcap, backend="reference"
    )
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    expected = torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), v).flatten(2)
    torch.testing.assert_close(out.flatten(2), expected, rtol=1e-10, atol=1e-10)


def test_kvcache_rejects_bad_scalars_before_writing(kernels_on_cpu):
    q = torch.randn(2, 1, H, D, dtype=torch.float16)
    k_cache = torch.randn(2, 8, H, D, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    k_new, v_new = torch.randn(2, 1, H, D, dtype=torch.float16), torch.randn(2, 1, H, D).half()
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    before = k_cache.clone()
    for kwargs, name in (({"softcap": -1.0}, "softcap"), ({"softmax_scale": math.nan}, "scale")):
        with pytest.raises(ValueError, match=name):
            fusedlayers.flash_attn_with_kvcache(
                q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, **kwargs
            )
        assert torch.equal(k_cache, before), "the cache was written before the error"


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((3, 1, 1, 6), r"attention_mask of shape \(3, 1, 1, 6\) does not match the inputs: "
                       r"expected \[2, 1, 1, 6\] \(batch 2, sequence length 6\)"),
        ((2, 1, 1, 5), r"expected \[2, 1, 1, 6\]"),
        ((2, 1, 1, 0), r"expected \[2, 1, 1, 6\]"),
        ((2, 6), r"a padding mask must be bool \[b, 1, 1, s\]"),
    ],
)  # fmt: skip
def test_padding_mask_of_the_wrong_batch_or_length(shape, match, no_compute):
    q, k, v = _bshd()
    mask = torch.zeros(shape, dtype=torch.bool)
    attn = fusedlayers.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")
    with pytest.raises(ValueError, match=match):
        attn(q, k, v, attention_mask=mask)


def test_cross_attention_padding_pair_checked_per_side(no_compute):
    q, k, v = torch.randn(2, 4, H, D), torch.randn(2, 7, H, D), torch.randn(2, 7, H, D)
    attn = fusedlayers.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")
    q_mask, kv_mask = torch.zeros(2, 1, 1, 4, dtype=torch.bool), torch.zeros(2, 1, 1, 7).bool()
    with pytest.raises(ValueError, match=r"attention_mask\[1\] \(kv padding\) of shape"):
        attn(q, k, v, attention_mask=(q_mask, kv_mask[..., :5]))
    with pytest.raises(ValueError, match=r"attention_mask\[0\] \(query padding\) of shape"):
        attn(q, k, v, attention_mask=(kv_mask, kv_mask))
    with pytest.raises(ValueError, match="the pair \\(q_mask, kv_mask\\), got 3 items"):
        attn(q, k, v, attention_mask=(q_mask, kv_mask, kv_mask))


def test_right_sized_padding_mask_matches_the_reference():
    q, k, v = (t.double() for t in _bshd())
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 4:] = True  # second sequence: 4 valid tokens
    attn = fusedlayers.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")
    out = attn(q, k, v, attention_mask=mask).view(2, 6, H, D)
    expected = attention_reference(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1, :4], expected[1, :4])


def test_hidden_size_not_divisible_by_heads_needs_kv_channels():
    with pytest.raises(ValueError, match=r"hidden_size \(100\) is not divisible by num_attention"):
        fusedlayers.TransformerLayer(100, 256, 3)
    with pytest.raises(ValueError, match=r"hidden_size \(100\) is not divisible"):
        fusedlayers.MultiheadAttention(100, 3)
    layer = fusedlayers.TransformerLayer(100, 256, 3, kv_channels=32)  # chosen head size: fine
    assert layer(torch.randn(5, 2, 100)).shape == (5, 2, 100)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_attention_heads": 0}, r"num_attention_heads \(0\) must be a positive integer"),
        ({"num_attention_heads": 4, "kv_channels": 0}, r"kv_channels \(0\) must be a positive"),
        ({"num_attention_heads": 4, "num_gqa_groups": True}, r"num_gqa_groups \(True\)"),
    ],
)
def test_head_arguments_must_be_positive_integers(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fusedlayers.MultiheadAttention(64, **kwargs)


@pytest.fixture(scope="module")
def tiny_gpt():
    return GPT(GPTConfig.named("tiny"))


@pytest.mark.parametrize(
    ("idx", "kwargs", "match"),
    [
        (torch.zeros(1, 0, dtype=torch.long), {}, r"idx of shape \(1, 0\) is empty"),
        (torch.zeros(0, 4, dtype=torch.long), {}, r"idx of shape \(0, 4\) is empty"),
        (torch.zeros(4, dtype=torch.long), {}, r"idx must be integer token ids \[b, s\]"),
        (torch.zeros(1, 4), {}, r"idx must be integer token ids .*torch.float32"),
        (torch.full((1, 4), 10**6), {}, r"idx holds token ids in \[1000000, 1000000\]"),
        (torch.zeros(1, 4, dtype=torch.long), {"max_new_tokens": -1}, r"max_new_tokens \(-1\)"),
        (torch.zeros(1, 4, dtype=torch.long), {"temperature": -0.5}, r"temperature \(-0.5\)"),
        (torch.zeros(1, 4, dtype=torch.long), {"top_k": 0}, r"top_k \(0\)"),
    ],
)
def test_generate_rejects_bad_prompts_and_settings(tiny_gpt, idx, kwargs, match):
    args = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        tiny_gpt.generate(idx, args.pop("max_new_tokens"), **args)
