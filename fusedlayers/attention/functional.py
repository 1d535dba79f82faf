"""flash-attn's functional API, on fusedlayers' front end and Triton kernels.

Names, arguments and semantics follow flash-attn 2:
    flash_attn_func(q, k, v)              q [b, s_q, h, d], k/v [b, s_k, hg, d] -> [b, s_q, h, d_v]
    flash_attn_varlen_func(q, k, v, ...)  q [t_q, h, d], k/v [t_k, hg, d]       -> [t_q, h, d_v]
    flash_attn_qkvpacked_func(qkv)        qkv [b, s, 3, h, d]
    flash_attn_kvpacked_func(q, kv)       kv [b, s_k, 2, hg, d]
    flash_attn_varlen_qkvpacked_func      qkv [t, 3, h, d]
    flash_attn_varlen_kvpacked_func       kv [t_k, 2, hg, d]
Packed inputs are read in place: the packed functions take views (`split_packed`) and hand them
to the same front end (packing is data the kernels take through strides, not another code path);
the backward writes the gradients into one buffer laid out like the packed tensor and returns it
as the packed tensor's gradient, without a copy.

GQA/MQA: query head `i` reads KV head `i // (h / hg)`. `causal=True` is bottom-right aligned,
as in flash-attn >= 2.1: with s_q=2, s_k=5 the mask is
    1 1 1 1 0
    1 1 1 1 1
(query i sees keys j <= i + s_k - s_q). `window_size=(left, right)` keeps keys in
`[i + s_k - s_q - left, i + s_k - s_q + right]`, -1 = unbounded on that side.
`alibi_slopes` ([h] or [b, h], fp32) adds `-slope * |i + s_k - s_q - j|`. `softcap > 0` applies
`softcap * tanh(s / softcap)` to the scaled scores (0 = off; negative, NaN or inf raise).
`softmax_scale` is None (1/sqrt(d)) or a finite number > 0; zero, negative, NaN and inf raise,
where flash-attn would compute with them. With `return_attn_probs=True` the functions
return `(out, softmax_lse, None)`: the LSE is fp32 `[b, h, s_q]` (varlen `[h, t_q]`) and, unlike
flash-attn's (whose backward drops its gradient without a word), differentiable: a loss may read
it, as attention sinks do (`out * sigmoid(lse - sink)`), and q, k and v get that term's gradient.
The third entry, flash-attn's debug-only dropout pattern, is not produced.
These functions always run the Triton kernels: CUDA tensors, or CPU tensors under
`TRITON_INTERPRET=1`; the modules pick the reference path on machines without CUDA.

FP8 (FlashAttention-3's interface, forward only): q, k and v may all be `torch.float8_e4m3fn`,
with optional keyword-only `q_descale`, `k_descale`, `v_descale`, fp32 `[b, hg]` (one per
sequence and KV head; None = 1): attention runs on `x * x_descale`, and the output is bf16. It
needs a GPU of compute capability 8.9+ (or the interpreter); inputs that require grad and
`dropout_p > 0` raise. Descales given with other dtypes are ignored, as in FlashAttention-3.
`attention_reference(..., q_descale=...)` computes the same in PyTorch.
"""

from __future__ import annotations

import torch

from ..errors import ArgumentError
from . import validation
from .frontend import attention
from .masks import flash_attn_spec
from .packing import split_packed
from .paged_kv import gather_pages


def _finish(out, lse, return_attn_probs):
    return (out, lse, None) if return_attn_probs else out


def _common(alibi_slopes, q_descale, k_descale, v_descale):
    return dict(
        core_attention_bias_type="alibi" if alibi_slopes is not None else "no_bias",
        alibi_slopes=alibi_slopes,
        backend="kernel",
        names=validation.FLASH_ATTN_NAMES,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        allow_fp8=True,
    )


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Attention on `[b, s, h, d]` tensors; see the module docstring for the semantics.

    fp8: float8_e4m3fn q, k, v with fp32 `[b, hg]` descales (or None) -> bf16, forward only.
    """
    out, lse = attention(
        q,
        k,
        v,
        qkv_format="bshd",
        mask_spec=flash_attn_spec(causal, window_size),
        softmax_scale=softmax_scale,
        softcap=softcap,
        dropout_p=dropout_p,
        deterministic=deterministic,
        tag="flash_attn_func",
        **_common(alibi_slopes, q_descale, k_descale, v_descale),
    )
    return _finish(out, lse, return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Attention on packed sequences `[t, h, d]` with int32 `cu_seqlens_q/k` `[b+1]`.

    fp8: float8_e4m3fn q, k, v with fp32 `[b, hg]` descales (b = sequences, or None) -> bf16,
    forward only.

    With `block_table` (int32 `[b, max_blocks]`, flash-attn 2.6's paged KV), k and v are pages
    `[num_blocks, page_size, hg, d]` and sequence z's key j is row `j % page_size` of page
    `block_table[z, j // page_size]`, for `j < cu_seqlens_k[z+1] - cu_seqlens_k[z]`; see
    `paged_kv.gather_pages`.
    """
    if block_table is not None:
        k, v = gather_pages(k, v, block_table, cu_seqlens_q, cu_seqlens_k)
    out, lse = attention(
        q,
        k,
        v,
        qkv_format="thd",
        mask_spec=flash_attn_spec(causal, window_size),
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_k,
        softmax_scale=softmax_scale,
        softcap=softcap,
        dropout_p=dropout_p,
        deterministic=deterministic,
        tag="flash_attn_varlen_func",
        **_common(alibi_slopes, q_descale, k_descale, v_descale),
    )
    return _finish(out, lse, return_attn_probs)


def _unpack(packed: torch.Tensor, count: int, dim: int, name: str) -> list[torch.Tensor]:
    """The q/k/v views of a packed tensor; their gradients come back to it as one buffer."""
    if packed.dim() <= dim or packed.shape[dim] != count:
        raise ArgumentError(
            f"{name} must have size {count} in dim {dim} (packed q/k/v), got shape "
            f"{tuple(packed.shape)}"
        )
    return list(split_packed(packed, dim))


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """`qkv [b, s, 3, h, d]` -> `[b, s, h, d]`."""
    if qkv.dim() != 5:
        raise ArgumentError(f"qkv must be 5-D [b, s, 3, h, d], got shape {tuple(qkv.shape)}")
    q, k, v = _unpack(qkv, 3, 2, "qkv")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """`q [b, s_q, h, d]`, `kv [b, s_k, 2, hg, d]` -> `[b, s_q, h, d]`."""
    if kv.dim() != 5:
        raise ArgumentError(f"kv must be 5-D [b, s_k, 2, hg, d], got shape {tuple(kv.shape)}")
    k, v = _unpack(kv, 2, 2, "kv")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """`qkv [t, 3, h, d]` with `cu_seqlens [b+1]` -> `[t, h, d]`."""
    if qkv.dim() != 4:
        raise ArgumentError(f"qkv must be 4-D [t, 3, h, d], got shape {tuple(qkv.shape)}")
    q, k, v = _unpack(qkv, 3, 1, "qkv")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """`q [t_q, h, d]`, `kv [t_k, 2, hg, d]` -> `[t_q, h, d]`."""
    if kv.dim() != 4:
        raise ArgumentError(f"kv must be 4-D [t_k, 2, hg, d], got shape {tuple(kv.shape)}")
    k, v = _unpack(kv, 2, 1, "kv")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )
