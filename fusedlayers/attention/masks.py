"""TransformerEngine's mask vocabulary, reduced to what the compute paths take.

The kernels and the reference know only a window `(left, right)`, a diagonal alignment
(`bottom_right`), per-sequence lengths and an optional additive bias. This module maps TE's
`attn_mask_type` names, `window_size` conventions and `attention_mask` tensors onto those.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .._host_cache import per_version
from ..errors import ArgumentError, ArgumentTypeError

ATTN_MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)


@dataclass(frozen=True)
class MaskSpec:
    """A normalized mask: window (left, right) with -1 unbounded, the diagonal alignment, whether
    padding information is expected, and whether an arbitrary boolean mask applies."""

    window_size: tuple[int, int]
    bottom_right: bool
    padding: bool
    arbitrary: bool


def check_mask_type(attn_mask_type: str) -> None:
    if attn_mask_type not in ATTN_MASK_TYPES:
        raise ArgumentError(
            f"attn_mask_type={attn_mask_type!r} is not one of {', '.join(ATTN_MASK_TYPES)}"
        )


def normalize_window_size(
    attn_mask_type: str, window_size: tuple[int, int] | None
) -> tuple[int, int]:
    """TE's per-mask-type window rule.

    Causal types take `(-1, 0)` or `(>=0, 0)`: `None` becomes `(-1, 0)`, and a window that looks
    forward is cut to `right = 0` with a warning. Other types take `(-1, -1)` or `(>=0, >=0)`:
    `None` becomes `(-1, -1)` and `(-1, 0)` is widened to `(-1, -1)` with a warning (the causal
    part belongs in `attn_mask_type`). Anything else raises.
    """
    check_mask_type(attn_mask_type)
    causal = "causal" in attn_mask_type
    if window_size is None:
        return (-1, 0) if causal else (-1, -1)
    if len(window_size) != 2 or not all(isinstance(x, int) for x in window_size):
        raise ArgumentError(f"window_size={window_size!r} must be a pair of ints (left, right)")
    left, right = (int(x) for x in window_size)
    if left < -1 or right < -1:
        raise ArgumentError(f"window_size={window_size!r}: entries must be >= -1 (-1 = unbounded)")
    if causal:
        if (left, right) == (-1, 0) or (left >= 0 and right == 0):
            return left, right
        if (left, right) == (-1, -1) or (left >= 0 and right > 0):
            warnings.warn(
                f"window_size={window_size!r} with attn_mask_type={attn_mask_type!r}: causal "
                f"masks see no future keys, using ({left}, 0)",
                stacklevel=3,
            )
            return left, 0
        raise ArgumentError(
            f"window_size={window_size!r} is invalid for attn_mask_type={attn_mask_type!r}: "
            "expected (-1, 0) or (>=0, 0)"
        )
    if (left, right) == (-1, -1) or (left >= 0 and right >= 0):
        return left, right
    if (left, right) == (-1, 0):
        warnings.warn(
            f"window_size=(-1, 0) with attn_mask_type={attn_mask_type!r}: use a causal mask type "
            "for causal attention; using (-1, -1)",
            stacklevel=3,
        )
        return -1, -1
    raise ArgumentError(
        f"window_size={window_size!r} is invalid for attn_mask_type={attn_mask_type!r}: "
        "expected (-1, -1) or (>=0, >=0)"
    )


def mask_spec(attn_mask_type: str, window_size: tuple[int, int] | None) -> MaskSpec:
    """Map TE's mask type and window onto the compute paths' parameters.

    TE aligns `causal`/`padding_causal` (and their windows and ALiBi) top-left; every other type,
    including `no_mask` with a window, bottom-right, as flash-attn does.
    """
    window = normalize_window_size(attn_mask_type, window_size)
    return MaskSpec(
        window_size=window,
        bottom_right=attn_mask_type not in ("causal", "padding_causal"),
        padding="padding" in attn_mask_type,
        arbitrary=attn_mask_type == "arbitrary",
    )


def flash_attn_spec(causal: bool, window_size: tuple[int, int]) -> MaskSpec:
    """flash-attn's convention: causal and windows are bottom-right aligned, each side of the
    window may be -1 on its own, and `causal=True` caps the right side at 0.

    Every flash-attn call needs one, so specs are kept per (causal, window_size) given as a
    bool and a tuple of ints: a model's calls share a few. Not while torch.compile traces: the
    graph would be guarded on what the memo holds, and a spec kept while tracing would make the
    next call compile again."""
    keep = not torch.compiler.is_compiling()
    if keep:
        try:
            return _FLASH_ATTN_SPECS[causal, window_size]
        except (KeyError, TypeError):  # new, or a list for window_size (not kept)
            pass
    if len(window_size) != 2 or any(int(x) < -1 for x in window_size):
        raise ArgumentError(f"window_size={window_size!r} must be (left, right) with entries >= -1")
    left, right = (int(x) for x in window_size)
    if causal:
        right = 0
    spec = MaskSpec(window_size=(left, right), bottom_right=True, padding=False, arbitrary=False)
    plain = causal.__class__ is bool and all(x.__class__ is int for x in window_size)
    if (
        keep
        and plain
        and isinstance(window_size, tuple)
        and len(_FLASH_ATTN_SPECS) < _MAX_FLASH_ATTN_SPECS
    ):
        _FLASH_ATTN_SPECS[causal, window_size] = spec
    return spec


_FLASH_ATTN_SPECS: dict[tuple, MaskSpec] = {}
_MAX_FLASH_ATTN_SPECS = 256


def seqlens_from_padding_mask(
    mask: torch.Tensor, name: str, batch: int, length: int, device: torch.device
) -> torch.Tensor | None:
    """Lengths `[b]` (int32) from a TE padding mask `[b, 1, 1, s]` (True = padded position).

    `batch`, `length` and `device` are the attention inputs' b, s and device; a mask that does
    not match them raises. Returns None when some row is not right-padded (a False after a
    True): such a mask is then applied as a general boolean mask instead, which is always correct.
    """
    if not isinstance(mask, torch.Tensor):
        raise ArgumentTypeError(
            f"{name} must be a bool tensor [b, 1, 1, s], got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise ArgumentError(
            f"{name}: a padding mask must be bool [b, 1, 1, s], got {mask.dtype} "
            f"{tuple(mask.shape)}"
        )
    if (mask.shape[0], mask.shape[3]) != (batch, length):
        raise ArgumentError(
            f"{name} of shape {tuple(mask.shape)} does not match the inputs: expected "
            f"[{batch}, 1, 1, {length}] (batch {batch}, sequence length {length})"
        )
    if mask.device != device:
        raise ArgumentError(f"{name} is on {mask.device}, the inputs on {device}")
    # torch.equal reads the answer on the host: once per mask and in-place version.
    return per_version(mask, "right-padded lengths", _right_padded_lengths)


def _right_padded_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    valid = ~mask[:, 0, 0, :]
    lengths = valid.sum(dim=-1)
    positions = torch.arange(valid.shape[-1], device=mask.device)
    right_padded = torch.equal(valid, positions.unsqueeze(0) < lengths.unsqueeze(1))
    return lengths.to(torch.int32) if right_padded else None


def alibi_slopes_for(num_heads: int, device=None) -> torch.Tensor:
    """The standard ALiBi slopes `[num_heads]` (fp32): a geometric sequence starting at
    2^(-8/n) for the largest power of two n <= num_heads, with the remaining heads taking the
    odd-indexed slopes of the sequence for 2n (Press et al., 2022)."""
    base = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / base) for i in range(base)]
    extra = [2.0 ** (-8.0 * (i + 1) / (2 * base)) for i in range(2 * base)][0::2]
    slopes += extra[: num_heads - base]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def bool_mask_to_bias(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive form of a boolean mask (True = masked): -inf where masked, 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
