"""DotProductAttention's TE semantics, checked against the naive fp64 oracle (CPU: reference path).

The same module runs the kernels on CUDA; tests/gpu/ compares the two paths there.
"""

import logging
import warnings

import pytest
import torch
from naive_attention import naive_attention

import fusedlayers
from fusedlayers import DotProductAttention
from fusedlayers.attention.masks import alibi_slopes_for

B, H, D = 2, 4, 8


def _qkv(s_q, s_kv, hg=H, fmt="bshd", seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, s_q, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, s_kv, hg, D, generator=g, dtype=dtype)
    v = torch.randn(B, s_kv, hg, D, generator=g, dtype=dtype)
    if fmt == "sbhd":
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    return q, k, v


def _unflat(out, fmt):
    out = out.view(*out.shape[:-1], H, D)
    return out.transpose(0, 1) if fmt == "sbhd" else out


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize(
    "mask_type,bottom_right,window",
    [
        ("no_mask", True, (-1, -1)),
        ("causal", False, (-1, 0)),
        ("causal_bottom_right", True, (-1, 0)),
    ],
)
@pytest.mark.parametrize("s_q,s_kv", [(5, 5), (3, 6), (6, 3)])
def test_mask_types_match_te_alignment(fmt, mask_type, bottom_right, window, s_q, s_kv):
    q, k, v = _qkv(s_q, s_kv, hg=2, fmt=fmt)
    dpa = DotProductAttention(H, D, num_gqa_groups=2, qkv_format=fmt, attn_mask_type=mask_type)
    out = _unflat(dpa(q, k, v), fmt)
    q_, k_, v_ = ((t.transpose(0, 1) if fmt == "sbhd" else t) for t in (q, k, v))
    ref, _ = naive_attention(q_, k_, v_, window=window, bottom_right=bottom_right)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_output_shapes_per_format():
    dpa = DotProductAttention(H, (D, 6), num_gqa_groups=1, attn_mask_type="no_mask")
    q, k, _ = _qkv(5, 7, hg=1, fmt="sbhd")
    v = torch.randn(7, B, 1, 6, dtype=torch.float64)
    assert dpa(q, k, v).shape == (5, B, H * 6)
    assert dpa(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), qkv_format="bshd"
    ).shape == (B, 5, H * 6)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = dpa(q[:, 0], k[:5, 0], v[:5, 0], qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert out.shape == (5, H * 6)


@pytest.mark.parametrize(
    "mask_type,window,bottom_right",
    [
        ("padding", (-1, -1), True),
        ("padding_causal", (-1, 0), False),
        ("padding_causal_bottom_right", (-1, 0), True),
    ],
)
@pytest.mark.parametrize("source", ["mask", "cu_seqlens"])
def test_padding_from_mask_or_cu_seqlens(mask_type, window, bottom_right, source):
    s_q, s_kv = 5, 6
    q, k, v = _qkv(s_q, s_kv)
    lens_q, lens_kv = [5, 3], [4, 6]
    kwargs = {}
    if source == "mask":
        q_mask = torch.arange(s_q)[None, :] >= torch.tensor(lens_q)[:, None]
        kv_mask = torch.arange(s_kv)[None, :] >= torch.tensor(lens_kv)[:, None]
        kwargs["attention_mask"] = (q_mask[:, None, None], kv_mask[:, None, None])
    else:
        kwargs["cu_seqlens_q"] = torch.tensor([0, 5, 8], dtype=torch.int32)
        kwargs["cu_seqlens_kv"] = torch.tensor([0, 4, 10], dtype=torch.int32)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask_type)
    out = _unflat(dpa(q, k, v, **kwargs), "bshd")
    for z in range(B):
        nq, nk = lens_q[z], lens_kv[z]
        ref, _ = naive_attention(
            q[z : z + 1, :nq],
            k[z : z + 1, :nk],
            v[z : z + 1, :nk],
            window=window,
            bottom_right=bottom_right,
        )
        torch.testing.assert_close(out[z, :nq], ref[0], atol=1e-10, rtol=1e-10)
        assert out[z, nq:].abs().sum() == 0


def test_left_padding_falls_back_to_a_general_mask():
    q, k, v = _qkv(5, 5)
    mask = torch.zeros(B, 1, 1, 5, dtype=torch.bool)
    mask[0, ..., :2] = True  # left padding: not expressible as lengths
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")
    out = _unflat(dpa(q, k, v, attention_mask=mask), "bshd")
    full = mask.expand(B, H, 5, 5) | mask.transpose(-1, -2).expand(B, H, 5, 5)
    ref, _ = naive_attention(q, k, v, mask=full)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_arbitrary_mask():
    q, k, v = _qkv(4, 6)
    mask = torch.rand(B, H, 4, 6, generator=torch.Generator().manual_seed(3)) < 0.4
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="arbitrary")
    out = _unflat(dpa(q, k, v, attention_mask=mask), "bshd")
    torch.testing.assert_close(out, naive_attention(q, k, v, mask=mask)[0], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "mask_type,window,effective,bottom_right",
    [
        ("causal", (-1, -1), (-1, 0), False),
        ("causal", (2, 3), (2, 0), False),
        ("no_mask", (-1, 0), (-1, -1), True),
        ("causal_bottom_right", (1, 4), (1, 0), True),
    ],
)
def test_window_normalization_warns_and_adjusts(mask_type, window, effective, bottom_right):
    q, k, v = _qkv(4, 6)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask_type)
    with pytest.warns(UserWarning, match="window_size"):
        out = _unflat(dpa(q, k, v, window_size=window), "bshd")
    ref, _ = naive_attention(q, k, v, window=effective, bottom_right=bottom_right)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "mask_type,window", [("causal", (-1, 2)), ("no_mask", (2, -1)), ("padding", (-1, 3))]
)
def test_invalid_windows_raise(mask_type, window):
    q, k, v = _qkv(4, 4)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask_type)
    with pytest.raises(ValueError, match=r"window_size=\(.*invalid"):
        dpa(q, k, v, window_size=window)


def test_sliding_window_no_mask_is_bottom_right():
    q, k, v = _qkv(4, 7)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask", window_size=(1, 2))
    out = _unflat(dpa(q, k, v), "bshd")
    torch.testing.assert_close(
        out, naive_attention(q, k, v, window=(1, 2))[0], atol=1e-10, rtol=1e-10
    )


@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias"])
def test_bias_types(bias_type):
    q, k, v = _qkv(4, 5)
    bias = torch.randn(1, H, 4, 5, dtype=torch.float64)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="no_mask")
    out = _unflat(
        dpa(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=bias), "bshd"
    )
    effective = bias * D**-0.5 if bias_type == "pre_scale_bias" else bias
    ref, _ = naive_attention(q, k, v, bias=effective.expand(B, H, 4, 5))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "mask_type,bottom_right", [("causal", False), ("causal_bottom_right", True)]
)
def test_alibi_default_slopes_follow_mask_alignment(mask_type, bottom_right):
    q, k, v = _qkv(3, 6)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask_type)
    out = _unflat(dpa(q, k, v, core_attention_bias_type="alibi"), "bshd")
    slopes = alibi_slopes_for(H).expand(B, H)
    ref, _ = naive_attention(q, k, v, slopes=slopes, window=(-1, 0), bottom_right=bottom_right)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_alibi_slopes_standard_values():
    torch.testing.assert_close(
        alibi_slopes_for(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)])
    )
    six = alibi_slopes_for(6)
    torch.testing.assert_close(six[:4], torch.tensor([2.0 ** (-2 * (i + 1)) for i in range(4)]))
    torch.testing.assert_close(six[4:], torch.tensor([2.0**-1, 2.0**-3]))


def test_thd_with_padded_offsets_equals_per_sequence():
    lens, offsets = [3, 4], [0, 5, 9]
    x = torch.randn(9, H, D, dtype=torch.float64)
    kx = torch.randn(9, 2, D, dtype=torch.float64)
    vx = torch.randn(9, 2, D, dtype=torch.float64)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    padded = torch.tensor(offsets, dtype=torch.int32)
    dpa = DotProductAttention(
        H, D, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal"
    )
    out = dpa(
        x,
        kx,
        vx,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
    ).view(9, H, D)
    for z in range(2):
        rows = slice(offsets[z], offsets[z] + lens[z])
        ref, _ = naive_attention(
            x[None, rows], kx[None, rows], vx[None, rows], window=(-1, 0), bottom_right=False
        )
        torch.testing.assert_close(out[rows], ref[0], atol=1e-10, rtol=1e-10)
    assert out[3:5].abs().sum() == 0


def test_dropout_only_in_training_and_checkpointing_keeps_the_mask():
    q, k, v = (t.requires_grad_(True) for t in _qkv(6, 6))
    dpa = DotProductAttention(H, D, qkv_format="bshd", attention_dropout=0.5)
    dpa.eval()
    torch.testing.assert_close(dpa(q, k, v), DotProductAttention(H, D, qkv_format="bshd")(q, k, v))
    dpa.train()
    torch.manual_seed(7)
    plain = dpa(q, k, v)
    grads = torch.autograd.grad(plain.square().sum(), (q, k, v))
    torch.manual_seed(7)
    ckpt = dpa(q, k, v, checkpoint_core_attention=True)
    grads_ckpt = torch.autograd.grad(ckpt.square().sum(), (q, k, v))
    assert torch.equal(plain, ckpt)
    for a, b in zip(grads, grads_ckpt):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_use_reference_switch_and_reference_mode():
    dpa = DotProductAttention(H, D, use_reference=True)
    assert dpa.use_reference and dpa.reference_active
    dpa.use_reference = False
    assert not dpa.reference_active
    with fusedlayers.reference_mode():
        assert dpa.reference_active
    assert not dpa.reference_active


@pytest.mark.parametrize(
    "shape_q,shape_kv",
    [((0, B, H, D), (0, B, H, D)), ((4, 0, H, D), (4, 0, H, D)), ((4, B, H, D), (0, B, H, D))],
)
def test_empty_inputs_return_empty_outputs(shape_q, shape_kv):
    dpa = DotProductAttention(H, D, attn_mask_type="no_mask")
    out = dpa(torch.randn(shape_q), torch.randn(shape_kv), torch.randn(shape_kv))
    assert out.shape == (*shape_q[:2], H * D) and (out == 0).all()


def test_debug_log_once_per_call_site(monkeypatch, caplog):
    monkeypatch.setenv("FUSEDLAYERS_DEBUG", "1")
    q, k, v = _qkv(4, 4, fmt="sbhd")
    dpa = DotProductAttention(H, D, layer_number=3)
    with caplog.at_level(logging.INFO, logger="fusedlayers"):
        for _ in range(3):
            dpa(q, k, v)
    records = [r.getMessage() for r in caplog.records if r.name == "fusedlayers"]
    assert len(records) == 1
    assert "qkv_format=sbhd" in records[0] and "backend=reference" in records[0]
    assert "layer_number=3" in records[0] and "copies: none" in records[0]


def test_non_contiguous_head_dim_is_copied_and_logged(monkeypatch, caplog):
    monkeypatch.setenv("FUSEDLAYERS_DEBUG", "1")
    q, k, v = _qkv(4, 4)
    q_strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    dpa = DotProductAttention(H, D, qkv_format="bshd")
    with caplog.at_level(logging.INFO, logger="fusedlayers"), warnings.catch_warnings():
        out = dpa(q_strided, k, v)
    torch.testing.assert_close(out, dpa(q, k, v))
    assert any("query_layer: stride(-1)" in r.getMessage() for r in caplog.records)
