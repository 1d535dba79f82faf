"""Shared harness for the FP8 attention tests (CPU interpreter and GPU suites).

Inputs are quantized the way a user quantizes them: fp32 values with a different magnitude per
(sequence, KV head), scaled per (sequence, KV head) by their amax onto e4m3's range (max 448), so
the descales are far from 1 and differ across the batch and the heads. The oracle is
`attention_reference` on the dequantized values (`x8 * descale`, computed here, not by the code
under test) in a high precision.

The pass rule is the project's (flash-attn's): the kernel's max error is at most 2x that of the
same reference fed the dequantized inputs rounded to bf16 (the dtype of the fp8 path's P V
product and of its output) with a bf16 result, plus one bf16 unit at the output's magnitude.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d], k/v [t_k, h_kv,
d(_v)] with cu_seqlens int32 [b+1]; descales fp32 [b, h_kv]; LSE dense [b, h, s_q] / varlen
[h, t_q].
"""

from __future__ import annotations

import torch

from fusedlayers import attention_reference, flash_attn_func, flash_attn_varlen_func

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# LSE atol relative to its magnitude: the kernel and the references sum in different orders.
LSE_REL_ATOL = 1e-5


def sequence_of_rows(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the sequence each row of a packed (thd) tensor belongs to."""
    lengths = cu_seqlens.diff().long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)[
        :rows
    ]


def quantize(x: torch.Tensor, h_kv: int, seq: torch.Tensor | None, batch: int):
    """(fp8 x, fp32 descale [batch, h_kv], fp64 dequantized x) for x dense [b, s, h, d], or
    packed [t, h, d] with `seq` (the sequence of each row). Heads h = g * h_kv share their KV
    head's descale (query heads i*g .. i*g + g - 1 take KV head i's, FlashAttention-3's)."""
    group = x.shape[-2] // h_kv
    if seq is None:  # dense: amax over rows, the heads of a group and the head dim
        amax = x.abs().unflatten(2, (h_kv, group)).amax(dim=(1, 3, 4))
        per_row = amax[:, None, :]  # [b, 1, h_kv]
    else:
        row_amax = x.abs().unflatten(1, (h_kv, group)).amax(dim=(2, 3))  # [t, h_kv]
        index = seq[:, None].expand(-1, h_kv)
        amax = torch.zeros(batch, h_kv, device=x.device).scatter_reduce(0, index, row_amax, "amax")
        per_row = amax[seq]  # [t, h_kv]
    descale = (amax / E4M3_MAX).clamp_min(1e-12).float()
    scale = (per_row / E4M3_MAX).clamp_min(1e-12).repeat_interleave(group, dim=-1)[..., None]
    x8 = (x / scale).to(FP8)
    per_row_descale = (descale[:, None, :] if seq is None else descale[seq]).double()
    dequantized = x8.double() * per_row_descale.repeat_interleave(group, dim=-1)[..., None]
    return x8, descale, dequantized


def random_inputs(
    b, s_q, s_k, h, h_kv, d, d_v, *, device, seed, varlen=False
) -> dict:  # fmt: skip
    """Quantized random q, k, v with magnitudes spread over 0.1 .. 10 per (sequence, head).

    Returns q8/k8/v8, q/k/v_descale, q/k/v_deq (fp64) and, for varlen, cu_seqlens_q/k (random
    lengths, the first sequence the longest) with max_seqlen_q/k.
    """
    g = torch.Generator().manual_seed(seed)
    meta = {}
    if varlen:
        lens_q = [s_q, *torch.randint(1, s_q + 1, (b - 1,), generator=g).tolist()]
        lens_k = [s_k, *torch.randint(1, s_k + 1, (b - 1,), generator=g).tolist()]
        cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
              for n in (lens_q, lens_k)]  # fmt: skip
        meta = dict(cu_seqlens_q=cu[0].to(device), cu_seqlens_k=cu[1].to(device))
        meta.update(max_seqlen_q=s_q, max_seqlen_k=s_k)
        rows_q, rows_k = (sum(lens_q),), (sum(lens_k),)
        seq_q = sequence_of_rows(meta["cu_seqlens_q"], rows_q[0])
        seq_k = sequence_of_rows(meta["cu_seqlens_k"], rows_k[0])
    else:
        rows_q, rows_k, seq_q, seq_k = (b, s_q), (b, s_k), None, None

    def spread(*shape):
        """randn times 10^u, u uniform in [-1, 1], one u per (sequence, head)."""
        x = torch.randn(shape, generator=g)
        magnitude = 10.0 ** (2 * torch.rand(b, shape[-2], generator=g) - 1)
        x = x.to(device)
        magnitude = magnitude.to(device)
        per_row = magnitude[:, None, :] if len(shape) == 4 else magnitude[seq]
        return x * per_row[..., None]

    seq_q = None if seq_q is None else seq_q.to(device)
    seq_k = None if seq_k is None else seq_k.to(device)
    data = dict(meta)
    for name, shape, seq in (("q", (*rows_q, h, d), seq_q), ("k", (*rows_k, h_kv, d), seq_k),
                             ("v", (*rows_k, h_kv, d_v), seq_k)):  # fmt: skip
        x8, descale, deq = quantize(spread(*shape), h_kv, seq, b)
        data.update({f"{name}8": x8, f"{name}_descale": descale, f"{name}_deq": deq})
    return data


def run_kernel(data: dict, **options):
    """flash_attn_func / flash_attn_varlen_func on the fp8 inputs: (out, lse)."""
    descales = {f"{n}_descale": data[f"{n}_descale"] for n in "qkv"}
    qkv = data["q8"], data["k8"], data["v8"]
    if "cu_seqlens_q" in data:
        seq = [data[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
        out, lse, _ = flash_attn_varlen_func(
            *qkv, *seq, **options, **descales, return_attn_probs=True
        )
    else:
        out, lse, _ = flash_attn_func(*qkv, **options, **descales, return_attn_probs=True)
    return out, lse


def run_reference(data: dict, dtype: torch.dtype, *, causal=False, window_size=(-1, -1),
                  **options):  # fmt: skip
    """attention_reference on the dequantized inputs cast to `dtype`: (out, lse)."""
    window = (window_size[0], 0) if causal else window_size
    return attention_reference(
        *(data[f"{n}_deq"].to(dtype) for n in "qkv"),
        cu_seqlens_q=data.get("cu_seqlens_q"),
        cu_seqlens_kv=data.get("cu_seqlens_k"),
        window_size=window,
        return_lse=True,
        **options,
    )


def check_fp8(data: dict, high: torch.dtype, **options) -> dict:
    """Kernel against the references by the pass rule; returns {name: (error, pytorch_error)}.

    `options`: flash-attn keywords (`causal`, `window_size`, `softmax_scale`, `softcap`,
    `alibi_slopes`) the kernel and the references both take."""
    out, lse = run_kernel(data, **options)
    assert out.dtype == torch.bfloat16
    ref_out, ref_lse = run_reference(data, high, **options)
    low_out, low_lse = run_reference(data, torch.bfloat16, **options)
    errors = {}
    for name, actual, ref, low, rel_atol in (
        ("out", out, ref_out, low_out, torch.finfo(torch.bfloat16).eps),
        ("lse", lse, ref_lse, low_lse, LSE_REL_ATOL),
    ):
        assert not torch.isnan(actual).any(), f"{name}: NaN"
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(actual), finite), f"{name}: non-finite pattern differs"
        if not finite.any():
            continue
        err = (actual.double() - ref.double())[finite].abs().max().item()
        pt_err = (low.double() - ref.double())[finite].abs().max().item()
        atol = rel_atol * max(ref.double()[finite].abs().max().item(), 1.0)
        assert err <= 2 * pt_err + atol, (
            f"{name}: kernel error {err:.3g} > 2 x PyTorch bf16 error {pt_err:.3g} + atol "
            f"{atol:.3g}"
        )
        errors[name] = (err, pt_err)
    return errors
