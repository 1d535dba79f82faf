"""Forward kernel on CUDA: bf16/fp16/fp32 against `attention_reference` in fp32 (fp64 for fp32).

Same pass rule and helpers as tests/test_kernels_forward_unit.py (flash-attn's: error <= 2x the
error of the reference fed input-dtype tensors, plus one unit of the dtype), on shapes past one
block: every head dim of the contract, odd lengths, s_q != s_k, GQA/MQA, windows, varlen with gaps,
dense padding, bias/ALiBi/softcap, dropout, and a batch whose offsets pass 2^31 elements.
Errors go to the junit report (`--junitxml`) as properties.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d].
"""

from __future__ import annotations

import pytest
import torch
from fusedlayers.kernels._dropout import dropout_keep_mask
from test_kernels_forward_unit import _compare, _forward, _reference, _varlen_meta

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _qkv(b, s_q, s_k, h, h_kv, d, d_v, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=DEV).to(dtype)

    return randn(b, s_q, h, d), randn(b, s_k, h_kv, d), randn(b, s_k, h_kv, d_v)


def _record(record_property, errors):
    for name, (err, pt_err) in errors.items():
        record_property(f"{name}_error", f"{err:.3g}")
        record_property(f"{name}_pytorch_error", f"{pt_err:.3g}")


HEAD_DIMS = [40, 59, 64, 80, 96, 111, 128, 160, 192, 256]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_head_dims_bf16(d, causal, record_property):
    """Every contract head dim, GQA 4:2, odd s_q != s_k, bottom-right causal and full."""
    q, k, v = _qkv(2, 257, 383, 4, 2, d, d, torch.bfloat16, seed=d)
    window = (-1, 0) if causal else (-1, -1)
    _, _, errors = _compare(q, k, v, high=torch.float32, window=window)
    _record(record_property, errors)


@pytest.mark.parametrize(
    "d, d_v",
    [(8, 8), (32, 32), (40, 24), (64, 64), (128, 128), (256, 256), (192, 128), (72, 200)],
)
def test_fp16_and_dv(d, d_v, record_property):
    """fp16, small head dims (64-wide tiles), and d_v != d_qk; MQA (one KV head)."""
    q, k, v = _qkv(2, 300, 190, 8, 1, d, d_v, torch.float16, seed=d + d_v)
    _, _, errors = _compare(q, k, v, high=torch.float32, window=(-1, 0))
    _record(record_property, errors)


def test_fp32_ieee(record_property):
    """fp32 inputs use ieee dots: within 2x of PyTorch's fp32 error against fp64."""
    q, k, v = _qkv(2, 200, 333, 4, 4, 96, 96, torch.float32, seed=1)
    _, _, errors = _compare(q, k, v, high=torch.float64, window=(-1, 0))
    _record(record_property, errors)


@pytest.mark.parametrize(
    "window, bottom_right, s_q, s_k",
    [
        ((-1, 0), False, 700, 300),
        ((-1, 0), True, 700, 300),
        ((128, 0), True, 600, 900),
        ((64, 64), False, 513, 513),
        ((0, -1), True, 100, 1000),
    ],
)
def test_windows(window, bottom_right, s_q, s_k, record_property):
    """Windows with both alignments; some settings leave rows with no visible key."""
    q, k, v = _qkv(2, s_q, s_k, 4, 2, 128, 128, torch.bfloat16, seed=s_q + s_k)
    out, lse, errors = _compare(
        q, k, v, high=torch.float32, window=window, bottom_right=bottom_right
    )
    assert (out.transpose(1, 2)[torch.isinf(lse)] == 0).all()
    _record(record_property, errors)


@pytest.mark.parametrize("padded", [False, True])
def test_varlen(padded, record_property):
    """thd with cu_seqlens (and gaps), a one-token sequence, causal bottom-right."""
    meta, rows_q, rows_k = _varlen_meta([513, 1, 200, 1024], [300, 77, 200, 1100], padded, DEV)
    q, k, v = _qkv(1, rows_q, rows_k, 8, 2, 128, 128, torch.bfloat16, seed=rows_q)
    _, _, errors = _compare(q[0], k[0], v[0], high=torch.float32, seq=meta, window=(-1, 0))
    _record(record_property, errors)


def test_dense_padding(record_property):
    """Right-padded dense batch with per-sequence lengths and a sliding window."""
    seq = dict(
        seqlens_q=torch.tensor([400, 17, 256], dtype=torch.int32, device=DEV),
        seqlens_k=torch.tensor([123, 500, 256], dtype=torch.int32, device=DEV),
    )
    q, k, v = _qkv(3, 400, 500, 4, 4, 64, 64, torch.bfloat16, seed=5)
    _, _, errors = _compare(q, k, v, high=torch.float32, seq=seq, window=(100, 0))
    _record(record_property, errors)


def test_bias_alibi_softcap(record_property):
    """fp32 bias shared over the batch (stride 0), ALiBi [b, h] with stride_b 0, softcap."""
    b, h, s_q, s_k = 2, 4, 333, 444
    q, k, v = _qkv(b, s_q, s_k, h, 2, 128, 128, torch.bfloat16, seed=6)
    bias = torch.randn(1, h, s_q, s_k, device=DEV).expand(b, h, s_q, s_k)
    slopes = torch.rand(1, h, device=DEV).expand(b, h)
    kw = dict(bias=bias, alibi_slopes=slopes, softcap=20.0, window=(-1, 0))
    _, _, errors = _compare(q, k, v, high=torch.float32, **kw)
    _record(record_property, errors)


def test_dropout(record_property):
    """In-kernel dropout equals the reference given `dropout_keep_mask`; reruns are identical."""
    b, h, s_q, s_k, p = 2, 4, 300, 520, 0.17
    q, k, v = _qkv(b, s_q, s_k, h, 4, 64, 64, torch.bfloat16, seed=7)
    keep = dropout_keep_mask((99, 12), b, h, s_q, s_k, p, DEV)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    rng = dict(seed=99, offset=12)
    out, lse, errors = _compare(
        q, k, v, kernel_kw=rng, ref_kw=dict(dropout_mask=keep), high=torch.float32, dropout_p=p
    )
    out2, lse2 = _forward(q, k, v, dropout_p=p, **rng)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    _record(record_property, errors)


@pytest.mark.big_memory
def test_offsets_past_int32(record_property):
    """q, k, v, out of 2^31 + 2^21 elements: the last batch entry is read and written correctly."""
    b, s, h, d = 1025, 128, 128, 128
    q, k, v = _qkv(b, s, s, h, h, d, d, torch.bfloat16, seed=8)
    out, lse = _forward(q, k, v, window=(-1, 0))
    for z in (0, b - 1):
        sl = slice(z, z + 1)
        ref_out, ref_lse = _reference(q[sl], k[sl], v[sl], torch.float32, window=(-1, 0))
        err = (out[sl].float() - ref_out).abs().max().item()
        lse_err = (lse[sl] - ref_lse).abs().max().item()
        record_property(f"batch{z}_out_error", f"{err:.3g}")
        assert err < 2e-2 and lse_err < 1e-3, (z, err, lse_err)
