"""The attention front end: one entry behind `DotProductAttention` and the `flash_attn_*` API.

It validates the call, turns the caller's layout into what the compute paths take (views, never a
copy unless a kernel requirement is unmet), turns TE's mask vocabulary into a window, alignment,
lengths and bias, and runs the Triton kernels or the reference.

Shapes per `qkv_format` (h = query heads, hg = KV heads):
    sbhd: q [s_q, b, h, d_qk], k [s_k, b, hg, d_qk], v [s_k, b, hg, d_v] -> out [s_q, b, h, d_v]
    bshd: q [b, s_q, h, d_qk], k [b, s_k, hg, d_qk], v [b, s_k, hg, d_v] -> out [b, s_q, h, d_v]
    thd:  q [t_q, h, d_qk],    k [t_k, hg, d_qk],    v [t_k, hg, d_v]    -> out [t_q, h, d_v]
    lse (fp32): [b, h, s_q] for sbhd/bshd, [h, t_q] for thd.

Signature cache: a call with no mask tensor, no `cu_seqlens`, no bias and no ALiBi (the common
training and inference call) is validated and normalized once per signature, that is q, k and v's
shapes, strides, dtypes and devices and every argument the checks read; a later call with the
same signature reuses the result, and any change (a stride, a length, a dtype, a scale)
validates again. On the kernel path without dropout the result is the kernel call itself
(`kernels.attention_ops.plan_call`): a hit goes from the signature to the launch. Calls with
those tensors are checked in full every time; the facts read off their values are memoized per
tensor version (`_host_cache`). So are fp8 calls (float8_e4m3fn q/k/v, FlashAttention-3's
descales; `allow_fp8`): their descale tensors and the forward-only rule (no input may require
grad) are checked per call, and none of it reads a device value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._backend import choose_backend
from .._logging import debug_enabled, log_decision
from ..errors import ArgumentError
from . import masks, validation
from .reference import attention_reference

try:
    from ..kernels import flash_attention
    from ..kernels._common import remember
    from ..kernels._launch import tensor_signature
    from ..kernels.attention_ops import PlannedCall, flash_attention_planned, plan_call
except ImportError:  # Triton missing or broken: `choose_backend` sends calls to the reference
    flash_attention = tensor_signature = None  # and calls are validated in full every time
    PlannedCall = None

BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


@dataclass
class _Prepared:
    """What both compute paths take: bshd/thd views plus normalized mask and bias."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    varlen: dict
    seqlens_q: torch.Tensor | None
    seqlens_kv: torch.Tensor | None
    spec: masks.MaskSpec
    bool_mask: torch.Tensor | None
    bias: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    copies: list[str]

    @property
    def batch(self) -> int:
        """Sequences in the call (varlen: `len(cu_seqlens_q) - 1`)."""
        return len(self.varlen["cu_seqlens_q"]) - 1 if self.varlen else self.q.shape[0]


class _Validated(NamedTuple):
    """What a validated, tensor-free call (module docstring) leaves for its signature's hits."""

    spec: masks.MaskSpec  # the mask it normalized to
    kernel_call: PlannedCall | None  # the whole kernel call; None: hits take `_run_kernel` or
    # the reference (dropout, the reference path, empty inputs)


_VALIDATED: dict[tuple, _Validated] = {}
_MAX_VALIDATED = 1024


def _bshd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """sbhd <-> bshd as a transposed view (its own inverse); other formats as they are."""
    return t.transpose(0, 1) if qkv_format == "sbhd" else t


def _kernel_view(t: torch.Tensor, qkv_format: str, name: str, copies: list[str]) -> torch.Tensor:
    """sbhd -> bshd as a transposed view; copy only if the head dim is not contiguous."""
    t = _bshd(t, qkv_format)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        copies.append(f"{name}: stride(-1)={t.stride(-1)} != 1, copied to contiguous")
        t = t.contiguous()
    return t


def _hit_prepared(q, k, v, spec: masks.MaskSpec) -> _Prepared:
    """The `_Prepared` record of a signature hit, given its kernel views (`_bshd`: the signature
    fixes the strides, which needed no copy when the call was validated)."""
    return _Prepared(q, k, v, {}, None, None, spec, None, None, None, [])


def _varlen_args(q, k, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_q, max_kv, names) -> dict:
    if cu_q is None:
        raise ArgumentError("qkv_format='thd' needs cu_seqlens_q (int32 [batch + 1])")
    if cu_kv is None:
        if k.shape[0] != q.shape[0]:
            raise ArgumentError(
                f"{names.cu_seqlens_kv} is required when {names.k} has {k.shape[0]} tokens "
                f"and {names.q} {q.shape[0]}"
            )
        cu_kv, cu_kv_pad = cu_q, cu_q_pad
    values_q = validation.check_cu_seqlens(cu_q, "cu_seqlens_q", q.shape[0], cu_q_pad)
    values_kv = validation.check_cu_seqlens(cu_kv, names.cu_seqlens_kv, k.shape[0], cu_kv_pad)
    if len(values_q) != len(values_kv):
        raise ArgumentError(
            f"cu_seqlens_q has {len(values_q) - 1} sequences but {names.cu_seqlens_kv} has "
            f"{len(values_kv) - 1}"
        )
    lens_q = [b - a for a, b in zip(values_q, values_q[1:])]
    lens_kv = [b - a for a, b in zip(values_kv, values_kv[1:])]
    return dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=cu_q_pad,
        cu_seqlens_kv_padded=cu_kv_pad,
        max_seqlen_q=validation.check_max_seqlen(max_q, lens_q, "max_seqlen_q"),
        max_seqlen_kv=validation.check_max_seqlen(max_kv, lens_kv, names.max_seqlen_kv),
    )


def _padding(attention_mask, cu_q, cu_kv, b, s_q, s_kv, device):
    """Padding for sbhd/bshd: (seqlens_q, seqlens_kv, bool mask or None).

    TE passes padding as `attention_mask` (self: `[b, 1, 1, s]`; cross: a `(q_mask, kv_mask)`
    pair; True = padded) or as `cu_seqlens_q/kv`. Right padding becomes lengths; any other
    pattern becomes a general boolean mask, which is always correct.
    """
    if attention_mask is not None:
        if isinstance(attention_mask, (tuple, list)):
            if len(attention_mask) != 2:
                raise ArgumentError(
                    "attention_mask as a sequence must be the pair (q_mask, kv_mask), got "
                    f"{len(attention_mask)} items"
                )
            q_mask, kv_mask = attention_mask
            q_name, kv_name = "attention_mask[0] (query padding)", "attention_mask[1] (kv padding)"
        else:
            q_mask, kv_mask = (
                (attention_mask, attention_mask) if s_q == s_kv else (None, attention_mask)
            )
            q_name = kv_name = "attention_mask"
        lens_q = (
            None
            if q_mask is None
            else masks.seqlens_from_padding_mask(q_mask, q_name, b, s_q, device)
        )
        lens_kv = masks.seqlens_from_padding_mask(kv_mask, kv_name, b, s_kv, device)
        if (q_mask is not None and lens_q is None) or lens_kv is None:
            # [b, 1, 1, s_kv] | [b, 1, s_q, 1] -> [b, 1, s_q, s_kv]
            full = kv_mask if q_mask is None else kv_mask | q_mask.transpose(-1, -2)
            return None, None, full
        return lens_q, lens_kv, None
    lens = []
    for cu, name, s in ((cu_q, "cu_seqlens_q", s_q), (cu_kv, "cu_seqlens_kv", s_kv)):
        if cu is None:
            lens.append(None)
            continue
        values = validation.check_cu_seqlens(cu, name, validation.host_values(cu)[-1])
        if len(values) != b + 1 or max(b_ - a for a, b_ in zip(values, values[1:])) > s:
            raise ArgumentError(f"{name}={values[:16]} does not describe {b} sequences of <= {s}")
        lens.append((cu[1:] - cu[:-1]).to(torch.int32))
    return lens[0], lens[1], None


def _bias_terms(bias_type, bias, alibi_slopes, scale, target, num_heads, device):
    """(additive bias or None, alibi slopes [1 or b, h] or None) from TE's bias arguments."""
    if bias_type not in BIAS_TYPES:
        raise ArgumentError(f"core_attention_bias_type={bias_type!r} is not one of {BIAS_TYPES}")
    if bias_type in ("pre_scale_bias", "post_scale_bias"):
        if bias is None:
            raise ArgumentError(f"core_attention_bias_type={bias_type!r} needs core_attention_bias")
        validation.check_broadcastable(bias, target, "core_attention_bias")
        # (q.k + bias) * scale == q.k * scale + bias * scale
        return (bias * scale if bias_type == "pre_scale_bias" else bias), None
    if bias is not None:
        raise ArgumentError(
            f"core_attention_bias is given but core_attention_bias_type={bias_type!r}; use "
            "'post_scale_bias' or 'pre_scale_bias'"
        )
    if bias_type == "no_bias":
        if alibi_slopes is not None:
            raise ArgumentError("alibi_slopes is given but core_attention_bias_type='no_bias'")
        return None, None
    if alibi_slopes is None:
        alibi_slopes = masks.alibi_slopes_for(num_heads, device)
    if alibi_slopes.shape not in ((num_heads,), (target[0], num_heads)):
        raise ArgumentError(
            f"alibi_slopes shape {tuple(alibi_slopes.shape)} must be [{num_heads}] or "
            f"[{target[0]}, {num_heads}]"
        )
    return None, alibi_slopes.to(device=device, dtype=torch.float32).reshape(-1, num_heads)


def prepare(
    q,
    k,
    v,
    *,
    qkv_format,
    attn_mask_type,
    window_size,
    attention_mask,
    cu_seqlens_q,
    cu_seqlens_kv,
    cu_seqlens_q_padded,
    cu_seqlens_kv_padded,
    max_seqlen_q,
    max_seqlen_kv,
    softmax_scale,
    core_attention_bias_type,
    core_attention_bias,
    alibi_slopes,
    kernel_path,
    spec=None,
    expected_heads=None,
    names=validation.TE_NAMES,
    allow_fp8=False,
) -> _Prepared:
    """Validate and normalize a call; see `attention` for the arguments."""
    validation.check_qkv(q, k, v, qkv_format, kernel_path, names, allow_fp8)
    if expected_heads is not None:
        validation.check_configured_heads(q, k, v, expected_heads)
    spec = masks.mask_spec(attn_mask_type, window_size) if spec is None else spec
    copies: list[str] = []
    qb, kb, vb = (_kernel_view(t, qkv_format, n, copies) for t, n in zip((q, k, v), names))
    varlen, lens_q, lens_kv, bool_mask = {}, None, None, None
    if qkv_format == "thd":
        if attention_mask is not None:
            raise ArgumentError("attention_mask is not used with qkv_format='thd': pass cu_seqlens")
        varlen = _varlen_args(
            qb,
            kb,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            max_seqlen_q,
            max_seqlen_kv,
            names,
        )
        b, s_q, s_kv = (
            len(varlen["cu_seqlens_q"]) - 1,
            varlen["max_seqlen_q"],
            varlen["max_seqlen_kv"],
        )
    else:
        b, s_q, s_kv = qb.shape[0], qb.shape[1], kb.shape[1]
        if spec.padding:
            lens_q, lens_kv, bool_mask = _padding(
                attention_mask, cu_seqlens_q, cu_seqlens_kv, b, s_q, s_kv, q.device
            )
        elif spec.arbitrary:
            if attention_mask is None or attention_mask.dtype != torch.bool:
                raise ArgumentError(
                    "attn_mask_type='arbitrary' needs a bool attention_mask (True = masked out) "
                    "broadcastable to [b, h, s_q, s_kv]"
                )
            validation.check_broadcastable(
                attention_mask, (b, q.shape[-2], s_q, s_kv), "attention_mask"
            )
            bool_mask = attention_mask
        elif attention_mask is not None:
            raise ArgumentError(
                f"attention_mask is given but attn_mask_type={attn_mask_type!r} does not use it; "
                "use a 'padding*' type or 'arbitrary'"
            )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    bias, slopes = _bias_terms(
        core_attention_bias_type,
        core_attention_bias,
        alibi_slopes,
        scale,
        (b, q.shape[-2], s_q, s_kv),
        q.shape[-2],
        q.device,
    )
    if bias is not None and qkv_format == "thd":
        raise ArgumentError("core_attention_bias is not supported with qkv_format='thd'")
    return _Prepared(qb, kb, vb, varlen, lens_q, lens_kv, spec, bool_mask, bias, slopes, copies)


def _run_reference(p: _Prepared, scale, softcap, dropout_p, descales):
    q_descale, k_descale, v_descale = descales
    return attention_reference(
        p.q,
        p.k,
        p.v,
        **{k: v for k, v in p.varlen.items() if not k.startswith("max")},
        seqlens_q=p.seqlens_q,
        seqlens_kv=p.seqlens_kv,
        softmax_scale=scale,
        window_size=p.spec.window_size,
        bottom_right=p.spec.bottom_right,
        attn_mask=p.bool_mask,
        bias=p.bias,
        alibi_slopes=p.alibi_slopes,
        softcap=softcap,
        dropout_p=dropout_p,
        return_lse=True,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )


def _run_kernel(p: _Prepared, scale, softcap, dropout_p, deterministic, descales):
    bias = p.bias
    b = p.batch
    h, s_q = p.q.shape[-2], p.q.shape[-3]
    if p.bool_mask is not None:
        # The kernels take one additive bias; a boolean mask is its -inf form.
        mask_bias = masks.bool_mask_to_bias(p.bool_mask)
        bias = mask_bias if bias is None else bias + mask_bias
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bias = bias.expand(b, h, s_q, p.k.shape[-3])
    slopes = None if p.alibi_slopes is None else p.alibi_slopes.expand(b, h)
    v = p.varlen
    return flash_attention(
        p.q,
        p.k,
        p.v,
        cu_seqlens_q=v.get("cu_seqlens_q"),
        cu_seqlens_k=v.get("cu_seqlens_kv"),
        seq_offsets_q=v.get("cu_seqlens_q_padded"),
        seq_offsets_k=v.get("cu_seqlens_kv_padded"),
        max_seqlen_q=v.get("max_seqlen_q"),
        max_seqlen_k=v.get("max_seqlen_kv"),
        seqlens_q=p.seqlens_q,
        seqlens_k=p.seqlens_kv,
        softmax_scale=scale,
        window_size=p.spec.window_size,
        bottom_right=p.spec.bottom_right,
        bias=bias,
        alibi_slopes=slopes,
        softcap=softcap,
        dropout_p=dropout_p,
        deterministic=deterministic,
        q_descale=descales[0],
        k_descale=descales[1],
        v_descale=descales[2],
    )


def _plain_number(x) -> bool:
    """An argument the signature can hold as it is: None, or a Python int or float."""
    return x is None or x.__class__ in (int, float)


def _kernel_call(p: _Prepared, softmax_scale, softcap, dropout_p, deterministic, kernel_path):
    """The kernel call a tensor-free call's signature hits can make directly (`plan_call`), or
    None where they take the generic path: the reference, dropout (its seed specializes each
    launch) and empty inputs (no launch)."""
    if not kernel_path or dropout_p > 0 or 0 in (p.q.numel(), p.k.numel(), p.v.numel()):
        return None
    scale = p.q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return plan_call(
        p.q, p.k, p.v, softmax_scale=scale, window_size=p.spec.window_size,
        bottom_right=p.spec.bottom_right, softcap=softcap, deterministic=deterministic,
    )  # fmt: skip


def _empty_result(q, v, qkv_format):
    """Batch 0 or length 0: no compute. Queries with no keys output 0 with LSE -inf (bf16
    zeros for fp8 inputs, as the kernels return)."""
    out_dtype = torch.bfloat16 if q.dtype == validation.FP8_DTYPE else q.dtype
    out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=out_dtype)
    if qkv_format == "thd":
        lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    else:
        b, s = (q.shape[1], q.shape[0]) if qkv_format == "sbhd" else q.shape[:2]
        lse = q.new_full((b, q.shape[-2], s), float("-inf"), dtype=torch.float32)
    return out, lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qkv_format: str = "bshd",
    attn_mask_type: str = "no_mask",
    window_size: tuple[int, int] | None = None,
    attention_mask=None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    softmax_scale: float | None = None,
    core_attention_bias_type: str = "no_bias",
    core_attention_bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    backend: str = "auto",
    tag: str = "attention",
    mask_spec: masks.MaskSpec | None = None,
    expected_heads: tuple[int, int, int, int] | None = None,
    names: validation.ArgNames = validation.TE_NAMES,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    allow_fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in any supported layout; returns `(out, lse)` (shapes in the module docstring).

    `attn_mask_type`, `window_size`, `attention_mask`, `cu_seqlens_*`, `core_attention_bias*`
    and `alibi_slopes` follow TransformerEngine's `DotProductAttention`; `softcap` and
    `deterministic` follow flash-attn. `backend`: `auto` (kernels for CUDA tensors, else the
    reference), `kernel` (error on CPU unless TRITON_INTERPRET=1) or `reference`.
    `tag` names the caller in `FUSEDLAYERS_DEBUG=1` logs. `mask_spec`, when given, replaces
    `attn_mask_type`/`window_size` (the flash-attn API builds its own, bottom-right aligned).
    `expected_heads = (h, hg, d_qk, d_v)` checks the inputs against a module's configuration.
    `names`: what the caller calls the arguments, for error messages (TE's by default).
    `allow_fp8`: take float8_e4m3fn q/k/v (the flash-attn functions), forward only, with
    FlashAttention-3's `q_descale`, `k_descale`, `v_descale` (fp32 `[b, h_kv]` or None); the
    output is bf16 (`validation.check_fp8` has the rules). Descales are ignored with other dtypes.
    """
    # `kernel` takes every call (`check_qkv` then names what the kernels cannot take).
    blocker = "" if backend == "kernel" else validation.kernel_blocker(q, v)
    kernel_path, why = choose_backend(backend, q, names.q, blocker)
    signature = None
    if (
        attention_mask is None
        and cu_seqlens_q is None
        and cu_seqlens_kv is None
        and core_attention_bias is None
        and alibi_slopes is None
        and core_attention_bias_type == "no_bias"
        and _plain_number(softmax_scale)
        and _plain_number(softcap)
        and _plain_number(dropout_p)
        and tensor_signature is not None
        and q.dtype != validation.FP8_DTYPE  # checked per call (module docstring)
        and not torch.compiler.is_compiling()
    ):
        signature = (
            tensor_signature(q), tensor_signature(k), tensor_signature(v), qkv_format,
            attn_mask_type, window_size, mask_spec, softmax_scale, softcap, dropout_p,
            kernel_path, expected_heads, deterministic,
        )  # fmt: skip
    try:
        hit = _VALIDATED.get(signature) if signature is not None else None
    except TypeError:  # an unhashable argument (a list for window_size): no caching
        signature = hit = None
    if hit is not None and hit.kernel_call is not None:
        qb, kb, vb = _bshd(q, qkv_format), _bshd(k, qkv_format), _bshd(v, qkv_format)
        if debug_enabled():
            p = _hit_prepared(qb, kb, vb, hit.spec)
            _log(p, q, k, v, qkv_format, attn_mask_type, kernel_path, why, tag)
        out, lse = flash_attention_planned(qb, kb, vb, hit.kernel_call)
        return _bshd(out, qkv_format), lse
    if hit is not None:
        p = _hit_prepared(*(_bshd(t, qkv_format) for t in (q, k, v)), hit.spec)
    else:
        validation.check_qkv_format(qkv_format)
        validation.check_dropout(dropout_p, names.dropout)
        validation.check_softmax_scale(softmax_scale)
        validation.check_softcap(softcap)
        p = prepare(
            q,
            k,
            v,
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            attention_mask=attention_mask,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            softmax_scale=softmax_scale,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            kernel_path=kernel_path,
            spec=mask_spec,
            expected_heads=expected_heads,
            names=names,
            allow_fp8=allow_fp8,
        )
        descales = (q_descale, k_descale, v_descale)
        validation.check_fp8(
            q, k, v, descales, p.batch, dropout_p=dropout_p, kernel_path=kernel_path, names=names
        )
        if signature is not None and not p.copies:
            remember(
                _VALIDATED,
                signature,
                _Validated(p.spec, _kernel_call(p, softmax_scale, softcap, dropout_p,
                                                deterministic, kernel_path)),
                _MAX_VALIDATED,
            )  # fmt: skip
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if debug_enabled():
        _log(p, q, k, v, qkv_format, attn_mask_type, kernel_path, why, tag)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return _empty_result(q, v, qkv_format)
    # Descales reach the compute paths only with fp8 inputs (FlashAttention-3 ignores them else).
    descales = (q_descale, k_descale, v_descale) if q.dtype == validation.FP8_DTYPE else (None,) * 3
    if kernel_path:
        out, lse = _run_kernel(p, scale, softcap, dropout_p, deterministic, descales)
    else:
        out, lse = _run_reference(p, scale, softcap, dropout_p, descales)
    return _bshd(out, qkv_format), lse


def _log(p, q, k, v, qkv_format, attn_mask_type, kernel_path, why, tag):
    from .layouts import get_qkv_layout

    try:
        layout = get_qkv_layout(q, k, v, qkv_format)
    except ValueError as error:
        layout = f"unnamed ({error})"
    log_decision(
        tag,
        f"qkv_format={qkv_format} layout={layout} mask={attn_mask_type} "
        f"window={p.spec.window_size} bottom_right={p.spec.bottom_right}; "
        f"copies: {'; '.join(p.copies) or 'none'}; "
        f"backend={'triton' if kernel_path else 'reference'} ({why})",
    )
