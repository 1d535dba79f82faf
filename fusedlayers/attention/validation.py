"""Input checks for the attention front end, run once before any compute.

Every error names the argument and the value that is wrong, so a user can fix the call without
reading this code. The kernels and the reference then assume normalized, valid input.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import NamedTuple

import torch

from .._host_cache import per_version
from ..errors import ArgumentError, ArgumentTypeError

QKV_FORMATS = ("sbhd", "bshd", "thd")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
MAX_KERNEL_HEAD_DIM = 256
# FP8 attention (forward only) takes FlashAttention-3's one fp8 format, on GPUs whose tensor
# cores multiply it (Ada and later).
FP8_DTYPE = torch.float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def host_values(t: torch.Tensor) -> list[int]:
    """`t.tolist()` for a 1-D integer tensor (cu_seqlens), read once per tensor and version."""
    return list(per_version(t, "values", torch.Tensor.tolist))


class ArgNames(NamedTuple):
    """What the caller calls the arguments, so that errors speak its words: TransformerEngine's
    by default (`TE_NAMES`), flash-attn's for the `flash_attn_*` functions (`FLASH_ATTN_NAMES`)."""

    q: str = "query_layer"
    k: str = "key_layer"
    v: str = "value_layer"
    dropout: str = "attention_dropout"
    cu_seqlens_kv: str = "cu_seqlens_kv"
    max_seqlen_kv: str = "max_seqlen_kv"
    # Where to compute what the kernels cannot (head dims over MAX_KERNEL_HEAD_DIM).
    beyond_kernels: str = "use_reference=True computes it in PyTorch"


TE_NAMES = ArgNames()
FLASH_ATTN_NAMES = ArgNames(
    "q", "k", "v", "dropout_p", "cu_seqlens_k", "max_seqlen_k",
    "fusedlayers.attention_reference computes it in PyTorch",
)  # fmt: skip


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_qkv_format(qkv_format: str) -> None:
    if qkv_format not in QKV_FORMATS:
        raise ArgumentError(f"qkv_format={qkv_format!r} is not one of {', '.join(QKV_FORMATS)}")


def check_head_counts(num_heads: int, num_kv_heads: int, where: str = "") -> None:
    """Query heads must split evenly over KV heads (GQA); `where` names the source."""
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
        raise ArgumentError(
            f"{where}number of query heads ({num_heads}) must be a positive multiple of the "
            f"number of KV heads ({num_kv_heads})"
        )


def kernel_blocker(q: torch.Tensor, v: torch.Tensor) -> str:
    """Why the kernels cannot take q and v's dtype and head dims ("" when they can): where
    `backend="auto"` takes the reference path instead."""
    dtypes = KERNEL_DTYPES + (FP8_DTYPE,)
    if q.dtype in dtypes and max(q.shape[-1], v.shape[-1]) <= MAX_KERNEL_HEAD_DIM:
        return ""
    return f"dtype {q.dtype}, head dims ({q.shape[-1]}, {v.shape[-1]}) not supported by the kernels"


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _check_fp8_dtypes(q, k, v, names: ArgNames, allow_fp8: bool) -> None:
    """fp8 q/k/v: all three float8_e4m3fn, and only where the caller takes fp8."""
    tensors = ((names.q, q), (names.k, k), (names.v, v))
    if not any(_is_fp8(t.dtype) for _, t in tensors):
        return
    got = ", ".join(f"{name} {t.dtype}" for name, t in tensors)
    if not allow_fp8:
        raise ArgumentTypeError(
            f"fp8 inputs ({got}) are taken by flash_attn_func and flash_attn_varlen_func only"
        )
    if any(t.dtype != FP8_DTYPE for _, t in tensors):
        raise ArgumentTypeError(
            f"{names.q}, {names.k} and {names.v} must all be {FP8_DTYPE} or none of them "
            f"(the only fp8 format supported), got {got}"
        )


def check_qkv(
    q, k, v, qkv_format: str, kernel_path: bool, names: ArgNames = TE_NAMES, allow_fp8=False
) -> None:
    """Ranks, dtypes, devices, head counts and dims of query/key/value in `qkv_format`;
    `allow_fp8`: whether float8_e4m3fn q/k/v are taken (the flash-attn functions)."""
    check_qkv_format(qkv_format)
    rank = 3 if qkv_format == "thd" else 4
    for name, t in ((names.q, q), (names.k, k), (names.v, v)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ArgumentError(
                f"{name} must be {rank}-D for qkv_format={qkv_format!r} "
                f"([{', '.join(qkv_format)}]), got {_describe(t)}"
            )
    _check_fp8_dtypes(q, k, v, names, allow_fp8)
    allowed = KERNEL_DTYPES if kernel_path else REFERENCE_DTYPES
    allowed += (FP8_DTYPE,) if allow_fp8 else ()
    if q.dtype not in allowed:
        raise ArgumentTypeError(
            f"{names.q} dtype {q.dtype} is not supported (use one of {allowed})"
        )
    for name, t in ((names.k, k), (names.v, v)):
        if t.dtype != q.dtype:
            raise ArgumentTypeError(
                f"{name} dtype {t.dtype} differs from {names.q} dtype {q.dtype}"
            )
        if t.device != q.device:
            raise ArgumentError(f"{name} is on {t.device} but {names.q} is on {q.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ArgumentError(
            f"{names.k} {tuple(k.shape)} and {names.v} {tuple(v.shape)} must match in every "
            "dim but the last (head dim)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ArgumentError(
            f"{names.q} head dim ({q.shape[-1]}) differs from {names.k} head dim ({k.shape[-1]})"
        )
    if qkv_format != "thd":
        batch_dim = 1 if qkv_format == "sbhd" else 0
        if q.shape[batch_dim] != k.shape[batch_dim]:
            raise ArgumentError(
                f"{names.q} batch ({q.shape[batch_dim]}) differs from {names.k} batch "
                f"({k.shape[batch_dim]}) for qkv_format={qkv_format!r}"
            )
    check_head_counts(q.shape[-2], k.shape[-2], f"{names.q}/{names.k}: ")
    if kernel_path:
        for name, t in ((names.q, q), (names.v, v)):
            if t.shape[-1] > MAX_KERNEL_HEAD_DIM:
                raise ArgumentError(
                    f"{name} head dim {t.shape[-1]} exceeds the kernels' maximum "
                    f"{MAX_KERNEL_HEAD_DIM} ({names.beyond_kernels})"
                )


def check_fp8(
    q, k, v, descales, batch: int, *, dropout_p: float, kernel_path: bool, names: ArgNames
) -> None:
    """FlashAttention-3's fp8 contract, after `check_qkv`: `descales` = (q, k, v descale), each
    None (1) or fp32 `[batch, h_kv]` on q's device; fp8 is forward only and has no dropout; the
    kernels need a GPU of compute capability 8.9+.

    With other inputs the descales are ignored, unchecked, as FlashAttention-3 ignores them:
    callers written for it pass them whatever the dtype. Their values are never read here: a
    host read would stall the call (and break CUDA graph capture). They must be finite and > 0,
    as quantization scales are.
    """
    if q.dtype != FP8_DTYPE:
        return
    given = [(n, d) for n, d in zip(DESCALE_NAMES, descales) if d is not None]
    want = (batch, k.shape[-2])
    for name, d in given:
        if not isinstance(d, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a float32 tensor, got {type(d).__name__}")
        if d.dtype != torch.float32 or tuple(d.shape) != want or d.device != q.device:
            raise ArgumentError(
                f"{name} must be a float32 tensor [batch, num_kv_heads] = {list(want)} on "
                f"{q.device}, got {_describe(d)}"
            )
    tracked = [(names.q, q), (names.k, k), (names.v, v), *given]
    if torch.is_grad_enabled():
        for name, t in tracked:
            if t.requires_grad:
                raise ArgumentError(
                    f"{name} requires grad, but {FP8_DTYPE} attention is forward only (no "
                    "backward): detach the inputs or call it under torch.no_grad()"
                )
    if dropout_p > 0:
        raise ArgumentError(
            f"{names.dropout}={dropout_p}: {FP8_DTYPE} attention is forward only and has no "
            "dropout; pass 0"
        )
    if kernel_path:
        check_fp8_device(q.device, names.q)


def check_fp8_device(device: torch.device, name: str) -> None:
    """The kernels' fp8 dot needs compute capability 8.9+ (CPU tensors: the interpreter runs it)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ArgumentError(
            f"{name} is {FP8_DTYPE}, which the kernels multiply on GPUs of compute capability "
            f"8.9 or higher (Ada, Hopper, Blackwell); {device} has compute capability "
            f"{capability[0]}.{capability[1]}"
        )


def check_configured_heads(q, k, v, expected: tuple[int, int, int, int]) -> None:
    """Head counts and dims must be the ones a module was built for: (h, hg, d_qk, d_v)."""
    got = (q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1])
    what = (
        "query_layer heads",
        "key_layer heads (num_gqa_groups)",
        "query_layer head dim",
        "value_layer head dim",
    )
    for name, have, want in zip(what, got, expected):
        if have != want:
            raise ArgumentError(f"{name} is {have}, but the module was built for {want}")


def check_cu_seqlens(
    cu: torch.Tensor, name: str, tokens: int, padded: torch.Tensor | None = None
) -> list[int]:
    """Validate a `cu_seqlens` tensor and return its values on the host.

    `cu` is int32 `[b+1]`, starts at 0, never decreases; without padded offsets it ends at the
    token count `tokens`; with `padded` (TE's `cu_seqlens_*_padded`) every sequence must fit in
    its padded slot and the padded offsets end at `tokens`.
    """
    if not isinstance(cu, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be an int32 tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise ArgumentError(f"{name} must be a 1-D int32 tensor [batch + 1], got {_describe(cu)}")
    values = host_values(cu)
    if values[0] != 0:
        raise ArgumentError(f"{name} must start at 0, got {values[:8]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ArgumentError(f"{name} must not decrease, got {values[:16]}")
    if padded is None:
        if values[-1] != tokens:
            raise ArgumentError(
                f"{name} ends at {values[-1]} but the tensor holds {tokens} tokens "
                "(pass cu_seqlens_*_padded when sequences have padding between them)"
            )
        return values
    offsets = check_cu_seqlens(padded, name + "_padded", tokens)
    if len(offsets) != len(values):
        raise ArgumentError(
            f"{name} has {len(values) - 1} sequences but {name}_padded has {len(offsets) - 1}"
        )
    for i in range(len(values) - 1):
        length, slot = values[i + 1] - values[i], offsets[i + 1] - offsets[i]
        if length > slot:
            raise ArgumentError(
                f"sequence {i} has {length} tokens ({name}) but only {slot} rows between its "
                f"padded offsets ({name}_padded)"
            )
    return values


def check_max_seqlen(max_seqlen: int | None, lengths: list[int], name: str) -> int:
    """`max_seqlen` defaults to the longest sequence and may not be shorter than it."""
    longest = max(lengths, default=0)
    if max_seqlen is None:
        return longest
    if int(max_seqlen) < longest:
        raise ArgumentError(f"{name}={max_seqlen} is below the longest sequence ({longest})")
    return int(max_seqlen)


def check_dropout(p: float, name: str = "attention_dropout") -> None:
    if not 0.0 <= float(p) < 1.0:
        raise ArgumentError(f"{name}={p} must be in [0, 1)")


def is_whole(value, minimum: int) -> bool:
    """`value` is an int (bools excluded: True is not a head count) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_softmax_scale(scale, name: str = "softmax_scale") -> None:
    """None (1/sqrt(d_qk)) or a finite number > 0.

    Zero would make every key equally likely and a negative scale would favour the least similar
    keys; neither is a softmax temperature anyone means, and NaN or inf poison every output. The
    kernels would compute all of them without complaint, so they are refused here.
    """
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise ArgumentTypeError(
            f"{name} must be a float or None, got {type(scale).__name__} {scale!r}"
        )
    if not math.isfinite(scale) or scale <= 0:
        raise ArgumentError(f"{name}={scale!r} must be a finite number > 0 (or None for 1/sqrt(d))")


def check_softcap(softcap, name: str = "softcap") -> None:
    """0 (off) or a finite number > 0: scores become softcap * tanh(scores / softcap)."""
    if isinstance(softcap, bool) or not isinstance(softcap, Real):
        raise ArgumentTypeError(f"{name} must be a float, got {type(softcap).__name__} {softcap!r}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ArgumentError(f"{name}={softcap!r} must be 0 (off) or a finite number > 0")


def check_broadcastable(t: torch.Tensor, target: tuple[int, ...], name: str) -> None:
    """`t` must broadcast to `target` ([b, h, s_q, s_k]) without growing it."""
    if t.dim() > len(target):
        raise ArgumentError(f"{name} with shape {tuple(t.shape)} has more dims than {target}")
    for size, want in zip(reversed(t.shape), reversed(target)):
        if size not in (1, want):
            raise ArgumentError(
                f"{name} with shape {tuple(t.shape)} does not broadcast to [b, h, s_q, s_k] = "
                f"{list(target)}"
            )
