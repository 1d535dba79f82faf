"""Reference attention: the full semantics in plain PyTorch.

One implementation serves as the `use_reference=True` debug path of every module and as the
tests' oracle. It computes in fp32 (fp64 when given fp64) and returns the input dtype; fp8 inputs
are dequantized to fp32 first (`dequantize_fp8`) and return bf16, as the kernels do.

Shapes (the layouts of the kernel entry, see docs/internals.md):
    dense  q [b, s_q, h_q, d_qk], k [b, s_k, h_kv, d_qk], v [b, s_k, h_kv, d_v]
           -> out [b, s_q, h_q, d_v], lse [b, h_q, s_q]
    varlen q [t_q, h_q, d_qk], k [t_k, h_kv, d_qk], v [t_k, h_kv, d_v]
           -> out [t_q, h_q, d_v], lse [h_q, t_q]
    (lse: fp32, natural log)

Mask semantics: query i sees key j iff i + off - left <= j <= i + off + right (bounds with -1 are
absent), off = s_k - s_q of the sequence when `bottom_right` else 0; causal is (-1, 0).
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def dequantize_fp8(
    x: torch.Tensor,
    descale: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    seq_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 values of fp8 `x`: `x.float() * descale` of each row's (sequence, KV head).

    x: dense `[b, s, h, d]`, or varlen `[t, h, d]` with `cu_seqlens` (and `seq_offsets`, the first
    row of each sequence when there are gaps; gap rows take a neighbour's descale, and no
    sequence reads them). descale: fp32 `[b, h_kv]` or None (1). `h` may be a multiple of `h_kv`
    (query heads): query head `i` takes KV head `i // (h / h_kv)`'s descale, GQA's mapping.
    """
    values = x.float()
    if descale is None:
        return values
    per_head = descale.float().repeat_interleave(x.shape[-2] // descale.shape[1], dim=1)
    if cu_seqlens is None:  # dense: batch is dim 0
        return values * per_head[:, None, :, None]
    starts = (cu_seqlens if seq_offsets is None else seq_offsets).long()
    rows = torch.arange(x.shape[0], device=x.device)
    # The sequence of each row: how many sequences after the first start at or before it.
    sequence = torch.searchsorted(starts[1:-1].contiguous(), rows, right=True)
    return values * per_head[sequence][:, :, None]


def visible_mask(
    s_q: int,
    s_k: int,
    window_size: tuple[int, int],
    bottom_right: bool,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Bool [s_q, s_k], True where query i may attend to key j (window and causal only)."""
    left, right = window_size
    i = torch.arange(s_q, device=device).unsqueeze(1)
    j = torch.arange(s_k, device=device).unsqueeze(0)
    diag = i + (s_k - s_q if bottom_right else 0)
    visible = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    return visible


def alibi_bias(
    slopes: torch.Tensor, s_q: int, s_k: int, bottom_right: bool, dtype: torch.dtype
) -> torch.Tensor:
    """ALiBi term `-slope * |i + off - j|`: slopes [b, h] -> [b, h, s_q, s_k]."""
    i = torch.arange(s_q, device=slopes.device).unsqueeze(1)
    j = torch.arange(s_k, device=slopes.device).unsqueeze(0)
    distance = (i + (s_k - s_q if bottom_right else 0) - j).abs().to(dtype)
    return -slopes.to(dtype)[:, :, None, None] * distance


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window_size: tuple[int, int],
    bottom_right: bool,
    attn_mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    dropout_p: float,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention on q [b, h_q, s_q, d], k/v [b, h_kv, s_k, d] already in compute dtype.

    attn_mask (True = masked), bias and keep broadcast to [b, h_q, s_q, s_k]; alibi_slopes [b, h_q].
    Returns out [b, h_q, s_q, d_v] and lse [b, h_q, s_q].
    """
    b, h_q, s_q, _ = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    group = h_q // h_kv
    # GQA/MQA: query head h reads KV head h // group.
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, s_q, s_k, bottom_right, scores.dtype)
    masked = ~visible_mask(s_q, s_k, window_size, bottom_right, q.device)
    if attn_mask is not None:
        masked = masked | attn_mask
    scores = scores.masked_fill(masked, float("-inf"))
    # Rows with no visible key: max is -inf; shift by 0 instead so exp gives 0 and no NaN appears,
    # in the forward or in the gradient.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / denom.clamp_min(torch.finfo(denom.dtype).tiny)
    lse = (row_max + torch.log(denom)).squeeze(-1)
    if dropout_p > 0:
        probs = probs * keep.to(probs.dtype) / (1.0 - dropout_p)
    return torch.matmul(probs, v), lse


def _to_bhsd(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).transpose(1, 2)


def _slice_bhss(t: torch.Tensor | None, z: int, s_q: int, s_k: int) -> torch.Tensor | None:
    """Sequence z's [1, h, s_q, s_k] block of a tensor broadcastable to [b, h, >=s_q, >=s_k]."""
    if t is None:
        return None
    while t.dim() < 4:
        t = t.unsqueeze(0)
    t = t[z : z + 1] if t.shape[0] > 1 else t
    rows = slice(0, s_q) if t.shape[2] > 1 else slice(None)
    cols = slice(0, s_k) if t.shape[3] > 1 else slice(None)
    return t[:, :, rows, cols]


def _keep_mask(
    dropout_p: float,
    dropout_mask: torch.Tensor | None,
    generator: torch.Generator | None,
    shape: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor | None:
    if dropout_p <= 0:
        return None
    if dropout_mask is not None:
        return dropout_mask
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    seqlens_q: torch.Tensor | None = None,
    seqlens_kv: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    bottom_right: bool = True,
    attn_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    return_lse: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Attention with every feature of the kernels, in plain PyTorch.

    Args:
        q, k, v: dense `[b, s, h, d]` or, with `cu_seqlens_q/kv`, varlen `[t, h, d]`; any strides.
        cu_seqlens_q/kv: int32 `[b+1]` cumulative sequence lengths (varlen).
        cu_seqlens_q/kv_padded: int32 `[b+1]` first row of each sequence in memory when sequences
            have padding between them; rows outside every sequence come back as 0.
        seqlens_q/kv: int32 `[b]` valid lengths of a right-padded dense batch; queries past the
            length come back as 0 (LSE -inf), keys past it are never attended.
        softmax_scale: defaults to `1/sqrt(d_qk)`.
        window_size, bottom_right: see the module docstring.
        attn_mask: bool, True = masked out, broadcastable to `[b, h_q, s_q, s_k]` (varlen: indexed
            by positions within each sequence, batch = sequence index).
        bias: additive, broadcastable to `[b, h_q, s_q, s_k]`, added after scaling and softcap.
        alibi_slopes: `[h_q]` or `[b, h_q]`.
        softcap: `softcap * tanh(s / softcap)` on the scaled scores when > 0.
        dropout_p: drop probability; the keep-mask is `dropout_mask` (bool `[b, h_q, s_q, s_k]`,
            True = keep) or drawn with `generator`.
        return_lse: also return the log-sum-exp, fp32, dense `[b, h_q, s_q]` / varlen `[h_q, t_q]`.
        q_descale, k_descale, v_descale: for float8_e4m3fn q, k, v: fp32 `[b, h_kv]` or None
            (1), FlashAttention-3's meaning: the inputs are dequantized to fp32
            (`dequantize_fp8`) and the output is bf16.
    """
    softmax_scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if q.dtype == torch.float8_e4m3fn:
        out = attention_reference(
            dequantize_fp8(q, q_descale, cu_seqlens_q, cu_seqlens_q_padded),
            dequantize_fp8(k, k_descale, cu_seqlens_kv, cu_seqlens_kv_padded),
            dequantize_fp8(v, v_descale, cu_seqlens_kv, cu_seqlens_kv_padded),
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            seqlens_q=seqlens_q, seqlens_kv=seqlens_kv, softmax_scale=softmax_scale,
            window_size=window_size, bottom_right=bottom_right, attn_mask=attn_mask, bias=bias,
            alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
            dropout_mask=dropout_mask, generator=generator, return_lse=return_lse,
        )  # fmt: skip
        if return_lse:
            return out[0].bfloat16(), out[1]
        return out.bfloat16()
    if alibi_slopes is not None and alibi_slopes.dim() == 1:
        alibi_slopes = alibi_slopes.unsqueeze(0)
    options = dict(
        scale=softmax_scale,
        window_size=tuple(window_size),
        bottom_right=bottom_right,
        softcap=softcap,
        dropout_p=dropout_p,
    )
    if cu_seqlens_q is not None:
        out, lse = _varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            attn_mask,
            bias,
            alibi_slopes,
            dropout_mask,
            generator,
            options,
        )
    else:
        out, lse = _dense(
            q,
            k,
            v,
            seqlens_q,
            seqlens_kv,
            attn_mask,
            bias,
            alibi_slopes,
            dropout_mask,
            generator,
            options,
        )
    return (out, lse) if return_lse else out


def _dense(
    q, k, v, seqlens_q, seqlens_kv, attn_mask, bias, alibi_slopes, dropout_mask, generator, options
):
    dtype = _compute_dtype(q.dtype)
    b, s_q, h_q, _ = q.shape
    s_k = k.shape[1]
    if seqlens_q is None and seqlens_kv is None:
        keep = _keep_mask(
            options["dropout_p"], dropout_mask, generator, (b, h_q, s_q, s_k), q.device
        )
        out, lse = _attend(
            _to_bhsd(q, dtype),
            _to_bhsd(k, dtype),
            _to_bhsd(v, dtype),
            attn_mask=attn_mask,
            bias=bias,
            alibi_slopes=alibi_slopes,
            keep=keep,
            **options,
        )
        return out.transpose(1, 2).to(q.dtype), lse.float()
    # Right-padded batch: each sequence is attended on its own valid lengths, so alignment
    # (bottom-right, ALiBi) follows the real lengths, as in the varlen path.
    lens_q = seqlens_q.tolist() if seqlens_q is not None else [s_q] * b
    lens_k = seqlens_kv.tolist() if seqlens_kv is not None else [s_k] * b
    starts = torch.arange(b + 1, dtype=torch.int64)
    cu_q = torch.tensor([0] + list(_cumsum(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(_cumsum(lens_k)), dtype=torch.int32)
    out, lse = _varlen(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        cu_q,
        cu_k,
        (starts * s_q).int(),
        (starts * s_k).int(),
        attn_mask,
        bias,
        alibi_slopes,
        dropout_mask,
        generator,
        options,
    )
    lse = lse.view(h_q, b, s_q).transpose(0, 1)
    return out.view(b, s_q, h_q, -1), lse


def _cumsum(values):
    total = 0
    for value in values:
        total += value
        yield total


def _varlen(
    q,
    k,
    v,
    cu_q,
    cu_k,
    offsets_q,
    offsets_k,
    attn_mask,
    bias,
    alibi_slopes,
    dropout_mask,
    generator,
    options,
):
    dtype = _compute_dtype(q.dtype)
    offsets_q = cu_q if offsets_q is None else offsets_q
    offsets_k = cu_k if offsets_k is None else offsets_k
    h_q, d_v = q.shape[1], v.shape[-1]
    out = q.new_zeros(q.shape[0], h_q, d_v, dtype=dtype)
    lse = torch.full((h_q, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    lens_q = (cu_q[1:] - cu_q[:-1]).tolist()
    lens_k = (cu_k[1:] - cu_k[:-1]).tolist()
    for z, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
        start_q, start_k = int(offsets_q[z]), int(offsets_k[z])
        rows_q = slice(start_q, start_q + len_q)
        rows_k = slice(start_k, start_k + len_k)
        keep = _keep_mask(
            options["dropout_p"],
            _slice_bhss(dropout_mask, z, len_q, len_k),
            generator,
            (1, h_q, len_q, len_k),
            q.device,
        )
        o, l_ = _attend(
            q[rows_q].to(dtype).transpose(0, 1).unsqueeze(0),
            k[rows_k].to(dtype).transpose(0, 1).unsqueeze(0),
            v[rows_k].to(dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=_slice_bhss(attn_mask, z, len_q, len_k),
            bias=_slice_bhss(bias, z, len_q, len_k),
            alibi_slopes=None
            if alibi_slopes is None
            else alibi_slopes[z % alibi_slopes.shape[0]].unsqueeze(0),
            keep=keep,
            **options,
        )
        out = out.index_copy(
            0, torch.arange(start_q, start_q + len_q, device=q.device), o[0].transpose(0, 1)
        )
        lse[:, rows_q] = l_[0].float()
    return out.to(q.dtype), lse


__all__ = ["attention_reference", "dequantize_fp8", "visible_mask", "alibi_bias"]
