"""Forward kernel unit checks on tiny shapes (Triton interpreter on CPU, or CUDA when present).

The launcher `flash_attention_forward` is called directly (no autograd wrapper) and compared with
`attention_reference` in fp64 ("high"); the pass rule is flash-attn's: max error <= 2x the error
of the same reference fed the input-dtype tensors ("low"), plus one unit of the dtype (atol).
fp16 and fp32 only: the interpreter's bf16 dot is wrong (Triton issue 11584); bf16 runs on the GPU.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d].
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl
from fusedlayers.kernels import _common
from fusedlayers.kernels._common import key_block_range, query_block_range
from fusedlayers.kernels._dropout import dropout_keep_mask
from fusedlayers.kernels._flash_fwd import flash_attention_forward

from fusedlayers.attention.reference import attention_reference

NO_SEQ = dict.fromkeys(
    ("cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q", "seq_offsets_k")
    + ("max_seqlen_q", "max_seqlen_k", "seqlens_q", "seqlens_k")
)


def _forward(q, k, v, *, window=(-1, -1), bottom_right=True, scale=None, seq=None, **extra):
    """Launcher call with defaults; `seq` overrides the sequence arguments."""
    args = dict(
        NO_SEQ,
        softmax_scale=q.shape[-1] ** -0.5 if scale is None else scale,
        window_left=window[0],
        window_right=window[1],
        bottom_right=bottom_right,
        bias=None,
        alibi_slopes=None,
        softcap=0.0,
        dropout_p=0.0,
        seed=0,
        offset=0,
    )
    args.update(seq or {})
    args.update(extra)
    return flash_attention_forward(q, k, v, **args)


def _reference(q, k, v, dtype, *, window=(-1, -1), bottom_right=True, scale=None, seq=None, **kw):
    """attention_reference on inputs cast to `dtype`, with the launcher's argument names."""
    seq = seq or {}
    return attention_reference(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        cu_seqlens_q=seq.get("cu_seqlens_q"),
        cu_seqlens_kv=seq.get("cu_seqlens_k"),
        cu_seqlens_q_padded=seq.get("seq_offsets_q"),
        cu_seqlens_kv_padded=seq.get("seq_offsets_k"),
        seqlens_q=seq.get("seqlens_q"),
        seqlens_kv=seq.get("seqlens_k"),
        softmax_scale=scale,
        window_size=window,
        bottom_right=bottom_right,
        return_lse=True,
        **kw,
    )


def _check(name, actual, high, low, rel_atol):
    """Pass rule; returns (error, pytorch_error). atol = rel_atol * max(|high|, 1).

    Non-finite entries of `high` (LSE -inf on empty rows) must be reproduced exactly.
    """
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    finite = torch.isfinite(high)
    assert torch.equal(torch.isfinite(actual), finite), f"{name}: non-finite pattern differs"
    assert torch.equal(actual[~finite].double(), high[~finite]), f"{name}: wrong non-finite values"
    if not finite.any():
        return 0.0, 0.0
    err = (actual.double() - high)[finite].abs().max().item()
    pt_err = (low.double() - high)[finite].abs().max().item()
    atol = rel_atol * max(high[finite].abs().max().item(), 1.0)
    assert err <= 2 * pt_err + atol, f"{name}: error {err:.3g} > 2 x {pt_err:.3g} + {atol:.3g}"
    return err, pt_err


# LSE atol: the low run computes the LSE in fp32 too, so PyTorch's error is ~0 there; allow for
# the fp32 accumulation order and the hardware exp2/log2 approximations.
LSE_REL_ATOL = 1e-5


def _compare(q, k, v, kernel_kw=None, ref_kw=None, high=torch.float64, **kw):
    """Kernel (kw + kernel_kw) against the reference in `high` and in q's dtype (kw + ref_kw).

    atol for out: one unit of q's dtype at the output's magnitude. Returns (out, lse, errors)
    with errors = {"out": (err, pytorch_err), "lse": (...)}.
    """
    out, lse = _forward(q, k, v, **kw, **(kernel_kw or {}))
    ref_kw = {**kw, **(ref_kw or {})}
    ref_high = _reference(q, k, v, high, **ref_kw)
    ref_low = _reference(q, k, v, q.dtype, **ref_kw)
    eps = torch.finfo(q.dtype).eps
    errors = dict(
        out=_check("out", out, ref_high[0].double(), ref_low[0], eps),
        lse=_check("lse", lse, ref_high[1].double(), ref_low[1], LSE_REL_ATOL),
    )
    return out, lse, errors


def _randn(*shape, dtype, device, gen):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "d, d_v, s_q, s_k",
    [(8, 8, 37, 45), (40, 24, 33, 17), (59, 59, 50, 50), (64, 80, 1, 61), (111, 16, 20, 3)],
)
def test_dense_head_dims_and_lengths(dtype, d, d_v, s_q, s_k, device):
    """Odd head dims (masked loads over the next power of two), d_v != d_qk, odd lengths."""
    g = torch.Generator().manual_seed(d * 1000 + s_q)
    q = _randn(2, s_q, 2, d, dtype=dtype, device=device, gen=g)
    k = _randn(2, s_k, 2, d, dtype=dtype, device=device, gen=g)
    v = _randn(2, s_k, 2, d_v, dtype=dtype, device=device, gen=g)
    _compare(q, k, v)


@pytest.mark.parametrize("h_kv", [1, 2])
def test_gqa_mqa_head_mapping(h_kv, device):
    """Query head h reads KV head h // (h_q // h_kv); K/V given as strided views of one buffer."""
    g = torch.Generator().manual_seed(h_kv)
    kv = _randn(2, 29, 2, h_kv, 32, dtype=torch.float16, device=device, gen=g)
    q = _randn(2, 19, 4, 32, dtype=torch.float16, device=device, gen=g)
    _compare(q, kv[:, :, 0], kv[:, :, 1])


WINDOWS = [(-1, 0), (5, 3), (0, 0), (-1, 2), (7, -1), (40, 0)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("bottom_right", [True, False])
@pytest.mark.parametrize("s_q, s_k", [(21, 53), (53, 21)])
def test_windows_and_alignment(window, bottom_right, s_q, s_k, device):
    """Causal TL/BR and sliding windows; some settings leave rows with no key (out 0, LSE -inf)."""
    g = torch.Generator().manual_seed(s_q + 7 * window[0] + window[1])
    q = _randn(1, s_q, 2, 16, dtype=torch.float32, device=device, gen=g)
    k = _randn(1, s_k, 1, 16, dtype=torch.float32, device=device, gen=g)
    v = _randn(1, s_k, 1, 16, dtype=torch.float32, device=device, gen=g)
    out, lse, _ = _compare(q, k, v, window=window, bottom_right=bottom_right)
    empty = torch.isinf(lse)
    assert (out.transpose(1, 2)[empty] == 0).all()


@pytest.mark.parametrize("order_pairs", [1, 4, 6])
@pytest.mark.parametrize("h_kv", [3, 1])
def test_causal_launch_order_covers_every_tile(order_pairs, h_kv, device, monkeypatch):
    """Causal launches interleave `order_pairs` (sequence, head) pairs longest-first
    (`causal_order_heads`); 4 of 6 pairs leaves a smaller last group. Every query block of every
    pair must still be computed once: out is allocated uninitialized, so a block the order
    skipped fails the comparison."""
    g = torch.Generator().manual_seed(order_pairs * 10 + h_kv)
    q = _randn(2, 53, 3, 16, dtype=torch.float16, device=device, gen=g)
    k = _randn(2, 47, h_kv, 16, dtype=torch.float16, device=device, gen=g)
    v = _randn(2, 47, h_kv, 16, dtype=torch.float16, device=device, gen=g)
    row_bytes, group = 2 * 16 * q.element_size(), 3 // h_kv
    # The L2 budget that fits order_pairs / group KV heads (GQA: a group shares one).
    budget = max(1, order_pairs // group) * 47 * row_bytes
    monkeypatch.setattr(_common, "CAUSAL_ORDER_L2_BYTES", budget)
    expected = min(6, max(1, order_pairs // group) * group)
    assert _common.causal_order_heads(47, row_bytes, group, 6) == expected
    _compare(q, k, v, window=(-1, 0), bottom_right=False)


def test_causal_order_heads_bounds():
    """At least one pair, at most all of them, whole GQA groups; 0 bytes: one pair at a time."""
    assert _common.causal_order_heads(4096, 512, 1, 64) == 8  # 16 MiB / 2 MiB
    assert _common.causal_order_heads(4096, 512, 4, 64) == 32  # 8 KV heads x 4 query heads
    assert _common.causal_order_heads(1 << 20, 512, 2, 64) == 2  # one KV head over budget
    assert _common.causal_order_heads(16, 64, 1, 5) == 5
    saved = _common.CAUSAL_ORDER_L2_BYTES
    try:
        _common.CAUSAL_ORDER_L2_BYTES = 0
        assert _common.causal_order_heads(16, 64, 4, 64) == 1
    finally:
        _common.CAUSAL_ORDER_L2_BYTES = saved


def _varlen_meta(lens_q, lens_k, padded, device):
    def cu(lens):
        return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)

    def gaps(lens):  # two unused rows before each sequence
        starts = [sum(lens[:i]) + 2 * (i + 1) for i in range(len(lens))]
        return torch.tensor([*starts, starts[-1] + lens[-1]], dtype=torch.int32, device=device)

    meta = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k))
    meta.update(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    rows_q, rows_k = sum(lens_q), sum(lens_k)
    if padded:
        meta.update(seq_offsets_q=gaps(lens_q), seq_offsets_k=gaps(lens_k))
        rows_q, rows_k = rows_q + 2 * len(lens_q) + 3, rows_k + 2 * len(lens_k) + 3
    return meta, rows_q, rows_k


@pytest.mark.parametrize("padded", [False, True])
def test_varlen(padded, device):
    """thd with cu_seqlens (and gaps between sequences); unowned rows stay 0 / -inf."""
    g = torch.Generator().manual_seed(3)
    meta, rows_q, rows_k = _varlen_meta([17, 5, 33], [9, 40, 33], padded, device)
    q = _randn(rows_q, 4, 24, dtype=torch.float16, device=device, gen=g)
    k = _randn(rows_k, 2, 24, dtype=torch.float16, device=device, gen=g)
    v = _randn(rows_k, 2, 24, dtype=torch.float16, device=device, gen=g)
    _compare(q, k, v, seq=meta, window=(-1, 0))


def test_dense_padding_seqlens(device):
    """Right-padded dense batch: per-sequence lengths set the diagonal and the key bound."""
    g = torch.Generator().manual_seed(4)
    seq = dict(
        seqlens_q=torch.tensor([30, 11], dtype=torch.int32, device=device),
        seqlens_k=torch.tensor([7, 41], dtype=torch.int32, device=device),
    )
    q = _randn(2, 30, 2, 16, dtype=torch.float32, device=device, gen=g)
    k = _randn(2, 41, 2, 16, dtype=torch.float32, device=device, gen=g)
    v = _randn(2, 41, 2, 16, dtype=torch.float32, device=device, gen=g)
    _compare(q, k, v, seq=seq, window=(4, 0))


@pytest.mark.parametrize("pattern", ["bhss", "1h1s", "b1s1"])
def test_bias_alibi_softcap(pattern, device):
    """Additive bias as a broadcast (stride-0) view in fp32 with fp16 q, plus ALiBi and softcap."""
    g = torch.Generator().manual_seed(5)
    b, h, s_q, s_k = 2, 2, 23, 35
    q = _randn(b, s_q, h, 32, dtype=torch.float16, device=device, gen=g)
    k = _randn(b, s_k, h, 32, dtype=torch.float16, device=device, gen=g)
    v = _randn(b, s_k, h, 32, dtype=torch.float16, device=device, gen=g)
    sizes = dict(b=b, h=h, s=None)
    dims = [sizes.get(c) or 1 for c in pattern[:2]]
    dims += [n if c == "s" else 1 for c, n in zip(pattern[2:], (s_q, s_k))]
    bias = _randn(*dims, dtype=torch.float32, device=device, gen=g).expand(b, h, s_q, s_k)
    slopes = _randn(1, h, dtype=torch.float32, device=device, gen=g).abs().expand(b, h)
    kw = dict(bias=bias, alibi_slopes=slopes, softcap=3.0, window=(9, 2))
    _compare(q, k, v, **kw)


def test_dropout_matches_keep_mask_and_is_deterministic(device):
    """In-kernel dropout equals the reference given `dropout_keep_mask`; reruns are identical."""
    g = torch.Generator().manual_seed(6)
    b, h, s_q, s_k, p = 2, 2, 27, 38, 0.3
    q = _randn(b, s_q, h, 16, dtype=torch.float32, device=device, gen=g)
    k = _randn(b, s_k, h, 16, dtype=torch.float32, device=device, gen=g)
    v = _randn(b, s_k, h, 16, dtype=torch.float32, device=device, gen=g)
    keep = dropout_keep_mask((1234, 77), b, h, s_q, s_k, p, device)
    assert 0.6 < keep.float().mean().item() < 0.8
    rng = dict(seed=1234, offset=77)
    out, lse, _ = _compare(
        q, k, v, kernel_kw=rng, ref_kw=dict(dropout_mask=keep), dropout_p=p, window=(-1, 0)
    )
    out2, lse2 = _forward(q, k, v, dropout_p=p, window=(-1, 0), **rng)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    out3, _ = _forward(q, k, v, dropout_p=p, window=(-1, 0), seed=1234, offset=78)
    assert not torch.equal(out, out3)


@triton.jit
def _ranges_kernel(params_ptr, out_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per program: params (start, diag, left, right, length) -> key and query ranges."""
    pid = tl.program_id(0)
    p = params_ptr + pid * 5
    start = tl.load(p)
    diag = tl.load(p + 1)
    left = tl.load(p + 2)
    right = tl.load(p + 3)
    n = tl.load(p + 4)
    k_lo, k_full_lo, k_full_hi, k_hi = key_block_range(
        start, diag, left, right, n, BLOCK_M, BLOCK_N, True, True
    )
    q_lo, q_full_lo, q_full_hi, q_hi = query_block_range(
        start, diag, left, right, n, BLOCK_M, BLOCK_N, True, True
    )
    offs = tl.arange(0, 8)
    # Written as one 8-wide row: the key range, then the query range.
    row = tl.where(offs == 0, k_lo, 0) + tl.where(offs == 1, k_full_lo, 0)
    row += tl.where(offs == 2, k_full_hi, 0) + tl.where(offs == 3, k_hi, 0)
    row += tl.where(offs == 4, q_lo, 0) + tl.where(offs == 5, q_full_lo, 0)
    row += tl.where(offs == 6, q_full_hi, 0) + tl.where(offs == 7, q_hi, 0)
    tl.store(out_ptr + pid * 8 + offs, row)


def _check_range(res, tile, n, visible, block):
    """(lo, full_lo, full_hi, hi) for one tile against brute force over positions [0, n).

    tile: the tile's positions on the other axis; visible(x, t): position x sees tile position t.
    """
    lo, full_lo, full_hi, hi = res
    assert all(x % block == 0 or x == hi for x in (lo, full_lo, full_hi)), res
    assert lo <= full_lo <= full_hi, res
    assert full_lo == full_hi or full_hi <= n, res
    for x in range(n):
        seen = [visible(x, t) for t in tile]
        if any(seen):
            assert lo <= x < hi, (res, x)
        if full_lo <= x < full_hi:
            assert all(seen), (res, x)


def test_block_ranges_cover_visible_and_band_is_fully_visible(device):
    """key_block_range / query_block_range against brute force over random tiles and windows."""
    g = torch.Generator().manual_seed(8)
    block_m, block_n = 16, 8
    params = torch.stack(
        [
            torch.randint(0, 4, (200,), generator=g) * block_m,
            torch.randint(-40, 40, (200,), generator=g),
            torch.randint(0, 30, (200,), generator=g),
            torch.randint(0, 30, (200,), generator=g),
            torch.randint(1, 70, (200,), generator=g),
        ],
        dim=1,
    ).to(torch.int32)
    out = torch.zeros(200, 8, dtype=torch.int32, device=device)
    _ranges_kernel[(200,)](params.to(device), out, BLOCK_M=block_m, BLOCK_N=block_n)
    for (start, diag, left, right, n), res in zip(params.tolist(), out.cpu().tolist()):

        def sees(i, j, diag=diag, left=left, right=right):  # query i sees key j
            return i + diag - left <= j <= i + diag + right

        rows, cols = range(start, start + block_m), range(start, start + block_n)
        _check_range(res[:4], rows, n, lambda j, i: sees(i, j), block_n)
        _check_range(res[4:], cols, n, sees, block_m)


def test_empty_batch_and_empty_queries(device):
    """No query rows at all: nothing is launched, outputs come back empty."""
    q = torch.randn(2, 0, 2, 16, device=device)
    k = torch.randn(2, 5, 2, 16, device=device)
    out, lse = _forward(q, k, k)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)
