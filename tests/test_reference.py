"""The reference attention against an independent naive fp64 computation, feature by feature."""

import pytest
import torch
from naive_attention import naive_attention

from fusedlayers.attention.reference import attention_reference

B, H = 2, 4


def _qkv(s_q, s_k, h=H, hg=H, d=8, d_v=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, s_q, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, s_k, hg, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, s_k, hg, d_v or d, generator=g, dtype=torch.float64)
    return q, k, v


def _check(out, lse, ref_out, ref_lse):
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("s_q,s_k", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0), (1, 2), (0, 0), (-1, 1)])
@pytest.mark.parametrize("bottom_right", [True, False])
def test_masks_and_windows(s_q, s_k, window, bottom_right):
    q, k, v = _qkv(s_q, s_k)
    out, lse = attention_reference(
        q, k, v, window_size=window, bottom_right=bottom_right, return_lse=True
    )
    ref = naive_attention(q, k, v, window=window, bottom_right=bottom_right)
    _check(out, lse, *ref)


@pytest.mark.parametrize("hg", [4, 2, 1])
def test_gqa_mqa_and_value_head_dim(hg):
    q, k, v = _qkv(4, 6, hg=hg, d=8, d_v=5)
    out, lse = attention_reference(q, k, v, window_size=(-1, 0), return_lse=True)
    _check(out, lse, *naive_attention(q, k, v, window=(-1, 0)))


@pytest.mark.parametrize(
    "shape", [(1, H, 4, 6), (B, 1, 4, 6), (B, H, 4, 6), (1, 1, 4, 6), (1, 1, 1, 6)]
)
def test_bias_shapes(shape):
    q, k, v = _qkv(4, 6)
    bias = torch.randn(shape, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, bias=bias, return_lse=True)
    ref = naive_attention(q, k, v, bias=bias.expand(B, H, 4, 6))
    _check(out, lse, *ref)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("bottom_right", [True, False])
def test_alibi(per_batch, bottom_right):
    q, k, v = _qkv(3, 6)
    slopes = torch.rand(B, H) if per_batch else torch.rand(H)
    out, lse = attention_reference(
        q,
        k,
        v,
        alibi_slopes=slopes,
        window_size=(-1, 0),
        bottom_right=bottom_right,
        return_lse=True,
    )
    ref = naive_attention(
        q, k, v, slopes=slopes.expand(B, H), window=(-1, 0), bottom_right=bottom_right
    )
    _check(out, lse, *ref)


def test_softcap_scale_and_bool_mask():
    q, k, v = _qkv(5, 6)
    q = q * 4
    mask = torch.rand(B, 1, 5, 6) < 0.3
    out, lse = attention_reference(
        q, k, v, softcap=2.0, softmax_scale=0.7, attn_mask=mask, return_lse=True
    )
    ref = naive_attention(q, k, v, softcap=2.0, scale=0.7, mask=mask.expand(B, H, 5, 6))
    _check(out, lse, *ref)


def test_dropout_with_given_keep_mask():
    q, k, v = _qkv(4, 5)
    keep = torch.rand(B, H, 4, 5) >= 0.25
    out = attention_reference(q, k, v, dropout_p=0.25, dropout_mask=keep)
    ref, _ = naive_attention(q, k, v, keep=keep, dropout_p=0.25)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_dropout_with_generator_is_reproducible_and_drops_p():
    q, k, v = _qkv(64, 64)
    a = attention_reference(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(1))
    b = attention_reference(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    keep = torch.rand(B, H, 64, 64, generator=torch.Generator().manual_seed(1)) >= 0.3
    ref, _ = naive_attention(q[:, :2], k, v, keep=keep[:, :, :2], dropout_p=0.3)
    torch.testing.assert_close(a[:, :2], ref, atol=1e-10, rtol=1e-10)


def _pack(x, lengths, offsets=None):
    """Dense [b, s, h, d] -> rows [t, h, d] holding the first lengths[z] rows of each batch,
    placed at `offsets[z]` (padding rows between sequences filled with noise)."""
    if offsets is None:
        offsets = [sum(lengths[:z]) for z in range(len(lengths) + 1)]
    rows = torch.randn(offsets[-1], *x.shape[2:], dtype=x.dtype)
    for z, n in enumerate(lengths):
        rows[offsets[z] : offsets[z] + n] = x[z, :n]
    return rows


@pytest.mark.parametrize("padded", [False, True])
def test_varlen_matches_per_sequence_dense(padded):
    lens_q, lens_k = [3, 5], [6, 2]
    q, k, v = _qkv(5, 6, hg=2)
    offs_q = [0, 4, 11] if padded else None
    offs_k = [0, 7, 9] if padded else None
    cu = lambda lens: torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32)
    pad = lambda offs: None if offs is None else torch.tensor(offs, dtype=torch.int32)
    out, lse = attention_reference(
        _pack(q, lens_q, offs_q),
        _pack(k, lens_k, offs_k),
        _pack(v, lens_k, offs_k),
        cu_seqlens_q=cu(lens_q),
        cu_seqlens_kv=cu(lens_k),
        cu_seqlens_q_padded=pad(offs_q),
        cu_seqlens_kv_padded=pad(offs_k),
        window_size=(-1, 0),
        return_lse=True,
    )
    starts = offs_q or [0, 3]
    for z in range(B):
        ref, ref_lse = naive_attention(
            q[z : z + 1, : lens_q[z]],
            k[z : z + 1, : lens_k[z]],
            v[z : z + 1, : lens_k[z]],
            window=(-1, 0),
        )
        rows = slice(starts[z], starts[z] + lens_q[z])
        _check(out[rows], lse[:, rows], ref[0], ref_lse[0])
    if padded:
        assert out[3:4].abs().max() == 0 and torch.isinf(lse[:, 3]).all()


def test_dense_padding_lengths():
    q, k, v = _qkv(5, 6)
    seqlens_q = torch.tensor([5, 2], dtype=torch.int32)
    seqlens_kv = torch.tensor([4, 6], dtype=torch.int32)
    out, lse = attention_reference(
        q, k, v, seqlens_q=seqlens_q, seqlens_kv=seqlens_kv, window_size=(-1, 0), return_lse=True
    )
    for z in range(B):
        n_q, n_k = int(seqlens_q[z]), int(seqlens_kv[z])
        ref, ref_lse = naive_attention(
            q[z : z + 1, :n_q], k[z : z + 1, :n_k], v[z : z + 1, :n_k], window=(-1, 0)
        )
        _check(out[z, :n_q], lse[z, :, :n_q], ref[0], ref_lse[0])
        assert out[z, n_q:].abs().sum() == 0 and torch.isinf(lse[z, :, n_q:]).all()


def test_rows_with_no_visible_key_give_zero_output_and_gradient():
    q, k, v = _qkv(4, 4)
    q.requires_grad_(True)
    k.requires_grad_(True)
    mask = torch.zeros(B, 1, 4, 4, dtype=torch.bool)
    mask[:, :, 1] = True
    out, lse = attention_reference(q, k, v, attn_mask=mask, return_lse=True)
    assert out[:, 1].abs().max() == 0 and torch.isinf(lse[:, :, 1]).all()
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert q.grad[:, 1].abs().max() == 0


def test_low_precision_input_returns_input_dtype_and_fp32_lse():
    q, k, v = (t.half() for t in _qkv(4, 4))
    out, lse = attention_reference(q, k, v, return_lse=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32


def test_gradcheck_fp64():
    q, k, v = (t[:1, :3, :2].clone().requires_grad_(True) for t in _qkv(3, 3))
    bias = torch.randn(1, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, bias: attention_reference(
        q, k, v, bias=bias, softcap=3.0, window_size=(1, 0)
    )
    assert torch.autograd.gradcheck(fn, (q, k, v, bias))
